"""A standby controller, and the active controller's side of it.

Two controllers (on two boxes) name each other with --peer. The one that finds no active peer at
start is active; the other follows it as the standby: it streams the active's journal
(Replicate: a snapshot, then every change, and a heartbeat every HEARTBEAT_S with the nodes of
the plan in force), so its own journal is a copy. When that stream breaks and no peer answers as active for
TAKEOVER_S and the stages' lease (STAGE_LEASE_S), the standby takes over, if it reaches a
majority of the plan's stages and none follows a newer controller already: it starts as the active controller with a fencing epoch above
the one it copied, re-adopts the plan's nodes (assigning them with the new epoch, which the
stages then hold: the old active's Assign and OpenSession are refused from then on), and resumes
every journaled request from its tokens. Clients hold both addresses (lpctl --controller A,B) and
resume there.

Replicate serves the named standby only (PeerAuth): over TLS the certificate named by
--standby-name, in plaintext a caller that sends the secret of --peer-secret-file (which both
controllers of the pair are given; the standby sends it as PEER_SECRET_HEADER). Anyone else, any
other controller certificate included, gets PERMISSION_DENIED: the journal holds every running
prompt's tokens.

A controller that a stage refuses for a newer epoch steps down (controller.app.on_fenced): it
stops, and its service manager starts it again, as the standby of the new active.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time

import grpc

from logicpipe.common.transport import Transport
from logicpipe.controller.jobs.journal import ADMIT, DROP, EPOCH, TOKENS, Op
from logicpipe.controller.mesh.pipeline import probe_node
from logicpipe.errors import FailedPrecondition, PermissionDenied
from logicpipe.v1 import controller_pb2, controller_pb2_grpc

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.5       # the active's stream to a standby says something at least this often
TAKEOVER_S = 1.5        # no active controller heard from for this long: the standby takes over
CONNECT_TIMEOUT_S = 0.5  # a peer that does not answer this fast counts as gone
MAX_BEHIND = 200_000    # journal operations queued for a standby that reads too slowly: it is cut off
STAGE_LEASE_S = 3.0     # the stages' lease (stage_node.net.fence.LEASE_S): a takeover waits it out
PROBE_TIMEOUT_S = 1.0   # a stage that does not answer a takeover's probe this fast counts as unreachable
PEER_SECRET_HEADER = "lp-peer-secret"  # call metadata: the standby's proof in plaintext (--peer-secret-file)
MAX_SECRET_BYTES = 4096


def read_peer_secret(path: str) -> bytes:
    """--peer-secret-file: its content, stripped (at least 16 bytes, at most MAX_SECRET_BYTES)."""
    try:
        secret = open(path, "rb").read(MAX_SECRET_BYTES + 1).strip()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not 16 <= len(secret) <= MAX_SECRET_BYTES or not all(33 <= c < 127 for c in secret):
        raise ValueError(f"{path} must hold one word of 16 to {MAX_SECRET_BYTES} printable ASCII characters (e.g. `openssl rand -hex 32 > "
                         f"{path}`), the same on both controllers")
    return secret


class PeerAuth:
    """Who may Replicate: the named standby. `standby_name`: its certificate name (TLS);
    `secret`: what it sends in plaintext. Neither set: nobody."""

    def __init__(self, standby_name: str = "", secret: bytes = b""):
        self.standby_name, self.secret = standby_name, secret

    def check(self, tls: bool, name: str, metadata) -> None:
        if tls:
            if not self.standby_name:
                raise PermissionDenied("this controller replicates its journal to no one: name its standby's "
                                       "certificate with --standby-name NAME")
            if name != self.standby_name:
                raise PermissionDenied(f"this controller replicates its journal only to its standby "
                                       f"{self.standby_name!r} (--standby-name); certificate {name!r} is not it")
            return
        if not self.secret:
            raise PermissionDenied("this controller replicates its journal to no one in plaintext: give both "
                                   "controllers the same --peer-secret-file")
        sent = next((v for k, v in metadata or () if k == PEER_SECRET_HEADER), "")
        sent = sent.encode() if isinstance(sent, str) else bytes(sent)
        if not hmac.compare_digest(sent, self.secret):
            raise PermissionDenied("this controller replicates its journal only to its standby, which sends the "
                                   f"secret of --peer-secret-file ({PEER_SECRET_HEADER}); "
                                   + ("this caller sent none" if not sent else "this caller's does not match"))


def op_to_proto(op: Op) -> controller_pb2.JournalOp:
    return controller_pb2.JournalOp(kind=op.kind, request_id=op.id,
                                    job_json=json.dumps(op.job, separators=(",", ":")) if op.job is not None else "",
                                    priority=op.priority, start=op.start, tokens=op.tokens, epoch=op.epoch)


def op_from_proto(m: controller_pb2.JournalOp) -> Op:
    return Op(m.kind, m.request_id, job=json.loads(m.job_json) if m.job_json else None, priority=m.priority,
              start=m.start, tokens=tuple(m.tokens), epoch=m.epoch)


class Replicator:
    """The active controller's journal, streamed to its standby (Controller.Replicate)."""

    def __init__(self, app):
        self.app = app
        self.followers: dict[str, float] = {}  # standby -> when it started following

    def _plan(self) -> dict:
        return {"nodes_json": json.dumps({h.node_id: h.address for h in self.app.pipelines.nodes})}

    async def follow(self, follower: str, tls: bool = False, name: str = "", metadata=None):
        """Controller.Replicate: the journal for the named standby only (`tls`, `name`: the
        caller's certificate name, `metadata`: its call metadata; see PeerAuth)."""
        if self.app.role != "active" or self.app.fenced:
            raise FailedPrecondition(self.app.not_serving() or "this controller is not the active one")
        opts = self.app.options
        PeerAuth(opts.standby_name, opts.peer_secret).check(tls, name, metadata)
        queue: asyncio.Queue = asyncio.Queue()
        journal = self.app.journal
        unsubscribe = journal.subscribe(queue.put_nowait)
        snapshot = journal.snapshot()  # taken with the subscription, in one step of the loop: nothing between
        self.followers[follower] = time.time()
        log.info("standby %s follows this controller's journal (%d requests)", follower, len(journal.entries))
        try:
            yield controller_pb2.JournalOp(kind="snapshot")
            for op in snapshot:
                yield op_to_proto(op)
            yield controller_pb2.JournalOp(kind="ready", **self._plan())
            while not self.app.fenced:
                if queue.qsize() > MAX_BEHIND:
                    raise FailedPrecondition(f"the standby fell {queue.qsize()} journal changes behind; follow again")
                try:
                    op = await asyncio.wait_for(queue.get(), HEARTBEAT_S)
                except asyncio.TimeoutError:
                    yield controller_pb2.JournalOp(kind="heartbeat", **self._plan())
                    continue
                yield op_to_proto(op)
        finally:
            unsubscribe()
            self.followers.pop(follower, None)


class Standby:
    """Follows the active controller among `peers` until none answers for TAKEOVER_S."""

    def __init__(self, app, peers: list[str], transport: Transport, me: str = "", secret: bytes = b""):
        self.app = app
        self.peers = peers
        self.transport = transport
        self.me = me
        self.metadata = ((PEER_SECRET_HEADER, secret.decode("ascii")),) if secret else None
        self.nodes: dict[str, str] = {}  # the active's plan: node id -> address (where a takeover starts)
        self.last_heard = time.monotonic()  # when the active last said anything (a snapshot, a change, a heartbeat)

    async def run(self) -> dict[str, str]:
        """Be the standby until a takeover is due; returns the nodes of the last plan seen."""
        app = self.app
        app.role = "standby"
        app.journal.start()  # the copy is written to this controller's own journal as it comes
        heard = time.monotonic()
        refused_logged = 0.0
        while True:
            for peer in self.peers:
                try:
                    if await self._follow(peer):
                        heard = time.monotonic()
                except (grpc.aio.AioRpcError, asyncio.TimeoutError) as exc:
                    why = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else "no answer in time"
                    if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                        heard = time.monotonic()  # it answers, so it lives: never take over from it
                        if heard - refused_logged > 30:
                            refused_logged = heard
                            log.error("peer %s refuses to replicate to this standby: %s", peer, why)
                        continue
                    log.debug("peer %s: %s", peer, why)
            heard = max(heard, self.last_heard)  # a stream that broke was heard from until it broke
            silent = time.monotonic() - heard
            if silent >= TAKEOVER_S and silent >= STAGE_LEASE_S + 0.3:  # the old active's lease has run out too
                why = await self._cannot_take_over()
                if not why:
                    log.warning("no active controller answers (%s) for %.1f s: taking over", ", ".join(self.peers),
                                silent)
                    app.active_peer = ""
                    return self.nodes
                if time.monotonic() - refused_logged > 10:
                    refused_logged = time.monotonic()
                    log.warning("no active controller answers (%s), but this standby does not take over: %s",
                                ", ".join(self.peers), why)
            await asyncio.sleep(0.1)

    async def _cannot_take_over(self) -> str:
        """Why this standby must not call itself active now ("": it may): it reaches no majority of
        the plan's stages (it may be the one cut off), or a stage already follows a controller of a
        newer epoch than the one copied."""
        if not self.nodes:
            return ""
        answers = await asyncio.gather(*(probe_node(self.transport, a, PROBE_TIMEOUT_S) for a in self.nodes.values()),
                                       return_exceptions=True)
        ok = [st for st in answers if not isinstance(st, BaseException)]
        if 2 * len(ok) <= len(self.nodes):
            return f"it reaches {len(ok)} of the plan's {len(self.nodes)} stages, no majority"
        newer = [st for st in ok if st.controller_epoch > self.app.journal.epoch]
        if newer:
            return (f"stage {newer[0].node_id} follows controller {newer[0].controller_id} of epoch "
                    f"{newer[0].controller_epoch}, above the one copied ({self.app.journal.epoch})")
        return ""

    async def _follow(self, peer: str) -> bool:
        """Copy `peer`'s journal while it streams it; returns whether it was followed at all."""
        app = self.app
        followed = False
        async with self.transport.channel(peer, "controller") as ch:
            call = controller_pb2_grpc.ControllerStub(ch).Replicate(controller_pb2.ReplicateRequest(follower=self.me),
                                                                     metadata=self.metadata)
            snapshot: list[Op] | None = None
            while True:
                m = await asyncio.wait_for(call.read(), TAKEOVER_S if followed else CONNECT_TIMEOUT_S + TAKEOVER_S)
                if m is grpc.aio.EOF:
                    return followed
                self.last_heard = time.monotonic()
                if m.kind == "snapshot":
                    snapshot = []
                elif m.kind in ("ready", "heartbeat"):
                    if m.kind == "ready" and snapshot is not None:
                        app.journal.replace(snapshot)
                        snapshot = None
                        log.info("following the active controller %s: %d journaled requests, epoch %d", peer,
                                 len(app.journal.entries), app.journal.epoch)
                    followed = True
                    app.active_peer = peer
                    if m.nodes_json:
                        self.nodes = json.loads(m.nodes_json) or self.nodes
                elif m.kind in (ADMIT, TOKENS, DROP, EPOCH):
                    op = op_from_proto(m)
                    if snapshot is not None:
                        snapshot.append(op)
                    else:
                        app.journal.apply(op)
