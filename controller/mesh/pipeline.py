"""The pipeline in force: the stage nodes, their layer ranges, and the controller's links to them.

The controller talks to every stage for assignment, sessions and events, and writes prompts to
stage 0. It never sits between two stages.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import grpc

from logicpipe.common.transport import Transport
from logicpipe.errors import MeshError, Unavailable, code_number, from_code
from logicpipe.policy import KEY_HEADER
from logicpipe.controller.mesh.membership import STALL_GRACE_S
from logicpipe.v1 import stage_pb2, stage_pb2_grpc

log = logging.getLogger(__name__)

RPC_TIMEOUT_S = 10.0      # unary calls to a stage (not Assign, OpenSession)
OPEN_TIMEOUT_S = 5.0      # OpenSession (admission takes no compute)
ASSIGN_TIMEOUT_S = 600.0  # loading a shard can take minutes on a slow disk
PROBE_INTERVAL_S = 0.5    # every stage of the pipeline is asked for its Status this often (after the last round)
PROBE_TIMEOUT_S = 1.5     # an answer slower than this counts as none
DOWN_AFTER_MISSES = 2     # unanswered probes in a row before a stage counts as down ...
# ... and silent STALL_GRACE_S (membership's, one grace for both) since its last answer: a stage that
# stalls (SIGSTOP, a swap storm) but keeps its connection open and answers again within it keeps its
# sessions, so with no other pipeline its requests wait for it rather than replaying elsewhere (a
# stage that died closes its event stream and is lost at once, without it). With other pipelines, a
# pipeline is silent when one of its stages has left a probe unanswered for SILENT_PROBE_S (or missed
# one) and answered none for SILENT_S, and no event came from the pipeline for as long: its running
# requests move to a pipeline that answers (Pipeline.on_silent; the scheduler's evacuate), and none
# opens on it. Checked each SILENT_TICK_S while a probe round waits. A stage answers Status from its
# event loop while a step computes in its worker thread, so a busy stage is not silent; a stopped one is
# found 0.6 to 1.1 s after it stopped (1.0, 0.75 and 0.25 before: 1.2 to 1.5 s, three times in a row for one
# request in a 1.5 s storm's misses, docs/benchmarks.md's sixteenth sitting)
SILENT_S = 0.6
SILENT_PROBE_S = 0.5
SILENT_TICK_S = 0.1
# a prompt stream that ended (by an error, or closed by its stage) while its stage 0 still serves: the
# sessions whose feed went on it and that no stage was heard of since are told UNAVAILABLE (they replay)
# after this grace, unless the stage was lost meanwhile (then its re-plan moves them, as any of its requests)
ENDED_FEED_GRACE_S = 1.0


@dataclass(frozen=True)
class StageAssignment:
    address: str
    start: int  # first layer, inclusive
    end: int    # exclusive
    dtype: str = ""  # its compute dtype, from the plan ("": the pipeline's)
    weight_format: str = ""  # its layers' format, from the plan ("": that of its dtype)
    wire_dtype: str = ""     # the dtype its hidden states travel in ("": its dtype)
    node_id: str = ""        # the node's id (over TLS its certificate's name: who may stream to whom)
    tp_width: int = 0        # devices its stage spans, from the plan (0: the node's own; planner.width)
    # a stage over several nodes (--tp-group): (node id, address) of every node by rank, this one first, and
    # where they meet (its rank 0's tcp://HOST:--tp-port); () and "" for a stage of one node
    members: tuple[tuple[str, str], ...] = ()
    tp_init: str = ""


@dataclass
class StageHandle:
    address: str
    channel: grpc.aio.Channel
    stub: stage_pb2_grpc.StageNodeStub
    node_id: str = ""
    start: int = 0
    end: int = 0
    device: str = ""
    parameter_count: int = 0
    status: stage_pb2.StatusReply | None = None
    events_task: asyncio.Task | None = field(default=None, repr=False)
    misses: int = 0          # Status probes unanswered in a row (reported to membership as a hint)
    answered: float = field(default_factory=time.monotonic)  # when it last answered a probe (monotonic)
    asked: float = 0.0       # when the probe it has not answered yet was sent (0: none outstanding)
    stalled: bool = False    # reported silent (see STALL_GRACE_S) and not answered since
    down_reason: str = ""    # why it was lost ("" while it is not)
    lost: bool = False       # its event stream ended, or it serves another plan: only a new plan brings it back
    leader: str = ""         # a member of a stage over several nodes: that stage's node (its rank 0)

    @property
    def kv_positions(self) -> int:
        """KV positions this stage's pool holds in all (0 if unknown)."""
        return self.status.kv_blocks_total * self.status.block_size if self.status else 0


async def probe_node(transport: Transport, address: str, timeout: float = RPC_TIMEOUT_S,
                     metadata=None) -> stage_pb2.StatusReply:
    """Status of a node, or Unavailable naming it (Status is open to any caller; `metadata`: the
    controller's key, with which the probe renews its lease on the stages it holds)."""
    async with transport.channel(address, "stage") as ch:
        try:
            return await stage_pb2_grpc.StageNodeStub(ch).Status(stage_pb2.StatusRequest(), timeout=timeout,
                                                                 metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            why = "no answer in time" if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED else exc.details()
            raise Unavailable(f"stage node {address} is unreachable: {why}") from exc


class _KeyedStub:
    """A StageNodeStub whose every call carries `metadata` (unless the call gives its own)."""

    def __init__(self, channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...]):
        self._stub, self._metadata = stage_pb2_grpc.StageNodeStub(channel), metadata

    def __getattr__(self, method: str):
        call = getattr(self._stub, method)
        return lambda *args, **kwargs: call(*args, **{"metadata": self._metadata, **kwargs})


def _mesh_error(exc: grpc.aio.AioRpcError, address: str) -> MeshError:
    return from_code(exc.code(), f"stage {address}: {exc.details()}")


def absent_members(details: str, members: tuple[tuple[str, str], ...]) -> str:
    """The addresses of the members that rank 0 of a stage over several nodes says did not join it (its
    Assign's error: "... member B, C did not join at ..."), comma-separated; "" for any other error. The
    failed install is then theirs (the controller leaves them out), not rank 0's."""
    head, sep, _ = details.partition(" did not join")
    named = head.rpartition("member ")[2].split(", ") if sep else []
    return ", ".join(address for node, address in members[1:] if node in named)


def compute_groups(statuses: list[stage_pb2.StatusReply]) -> int:
    """How many micro-batches keep the stages busy: one per stage, except that CPU stages on one
    machine (the same compute_id) share its cores and count once: there, micro-batches only take
    turns. GPU stages count one each even on a shared GPU: their decode is bound by each process's
    kernel launches, which overlap."""
    return len({st.compute_id if st.compute_id and st.device.startswith("cpu") else f"node:{st.node_id}"
                for st in statuses})


@dataclass
class ControllerIdentity:
    """Who the controller is to the stages, shared by all its pipelines: a stage takes the calls
    of the controller that holds it only (stage_node.fence)."""

    owner: str = field(default_factory=lambda: f"controller-{uuid.uuid4().hex[:12]}")  # our sessions live while we listen
    # our proof to the stages (call metadata): the owner id is no secret, this key is
    metadata: tuple[tuple[str, str], ...] = field(default_factory=lambda: ((KEY_HEADER, secrets.token_hex(16)),))
    epoch: int = 0       # the fencing epoch: stages refuse an older one (another controller took over)
    revoked: list[str] = field(default_factory=list)  # certificate names the stages refuse (every Assign carries them)
    # the stream keys of the plans we assigned lately: a stage shows one to PullWeights (only the
    # stages we assign know them), so the model's files go to no one else
    stream_keys: deque = field(default_factory=lambda: deque(maxlen=64))
    standby_name: str = ""  # over TLS: our standby's certificate, the one the stages let take over from us
    mirror_key: str = field(default_factory=lambda: secrets.token_hex(16))  # our stages' KV mirrors (mesh.mirrors)

    def assigned(self, key: str) -> bool:
        """Whether `key` is the stream key of a plan this controller assigned lately."""
        return bool(key) and any(hmac.compare_digest(key.encode(), k.encode()) for k in self.stream_keys)


class HoldsIdentity:
    """The controller's identity read through `self.identity` (a Pipeline's and the PipelineSet's,
    which share one): owner, key, fencing epoch, revocation list, and stubs that carry the key."""

    identity: ControllerIdentity

    @property
    def owner(self) -> str:
        return self.identity.owner

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return self.identity.metadata

    @property
    def epoch(self) -> int:
        return self.identity.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.identity.epoch = value

    @property
    def revoked(self) -> list[str]:
        return self.identity.revoked

    @revoked.setter
    def revoked(self, value: list[str]) -> None:
        self.identity.revoked = list(value)

    def stub(self, channel: grpc.aio.Channel) -> stage_pb2_grpc.StageNodeStub:
        """A stage stub whose calls carry our key (a stage takes its holder's calls only)."""
        return _KeyedStub(channel, self.metadata)


class Pipeline(HoldsIdentity):
    """One pipeline (a replica): stage handles in pipeline order, event fan-in, and the input
    stream to stage 0. `index` names it among the controller's pipelines; `plan` is the planner's
    pipeline it installs (None before the first install)."""

    def __init__(self, transport: Transport, on_event: Callable[[stage_pb2.Event], None],
                 on_stage_lost: Callable[[str, str], None], owner: str = "",
                 why_down: Callable[[str], str] = lambda address: "", *,
                 identity: ControllerIdentity | None = None, index: int = 0):
        self.transport = transport
        self._on_event = on_event
        self._on_stage_lost = on_stage_lost
        self.why_down = why_down  # membership's word on a node (by address): why it is down, "" when it is alive
        self._pending_closes: dict[str, set[str]] = {}  # stage address -> sessions to close there again
        self._monitor: asyncio.Task | None = None
        self.identity = identity if identity is not None else ControllerIdentity(**({"owner": owner} if owner else {}))
        self.index = index
        self.plan = None      # planner.Plan of this pipeline (its stages, predicted tokens/s)
        self.stages: list[StageHandle] = []
        self.members: list[StageHandle] = []  # the members (ranks > 0) of its stages over several nodes
        self.plan_id = ""
        self.generation = 0
        self.retired = False  # being replaced: no request opens on it any more
        self.detaches = 0     # bumped when its requests are moved off it (an open in flight then belongs to the past)
        self.micro_batches = 1
        self.model_dir = ""
        self._prompt_call = None
        self._prompt_lock = asyncio.Lock()
        # sessions whose last feed was written on a prompt stream and that no stage has sent an event
        # for since: if that stream is dropped (stage 0 took no input in time), their feed may be lost
        # with it, so they are told (and replay) rather than wait for their token watchdog
        self._unheard: dict[str, object] = {}
        self._tasks: set[asyncio.Task] = set()
        self.heard = time.monotonic()  # when any of its stages last sent an event
        self.on_silent: Callable[["Pipeline"], None] = lambda pipeline: None  # (see SILENT_S; set by its owner)

    @property
    def tokens_per_s(self) -> float:
        """Decode tokens/s the planner predicts for it (0: unknown): the router's weight."""
        return self.plan.tokens_per_s if self.plan is not None else 0.0

    # ---- set-up ---------------------------------------------------------------------------
    async def probe(self, address: str, timeout: float = RPC_TIMEOUT_S) -> stage_pb2.StatusReply:
        """Status of a node, or Unavailable naming it (with our key: it renews our lease there)."""
        return await probe_node(self.transport, address, timeout, self.metadata)

    async def install(self, model_dir: str, digest: str, num_layers: int, assignments: list[StageAssignment],
                      dtype: str = "float32", micro_batches: int = 0, controller_address: str = "",
                      generation: int = 0, planned_micro_batches: int = 0) -> None:
        """Push the assignments (all at once: a stage links to its successor on its first step,
        and no step runs before every stage has its assignment) and subscribe to every stage's
        events. `micro_batches` 0: the planner's `planned_micro_batches`, at most one per distinct
        compute device (stages sharing one machine's cores take turns, they do not overlap). A stage without the model
        on disk pulls its tensors from `controller_address`."""
        await self.close(wait_closes=False)
        self.plan_id = uuid.uuid4().hex[:12]
        # increases, across restarts too (`generation`: the controller's, above every pipeline's before)
        self.generation = generation or max(self.generation + 1, int(time.time() * 1000))
        self.model_dir = model_dir
        if not micro_batches:
            statuses = await asyncio.gather(*(self.probe(a.address) for a in assignments))
            groups = compute_groups(list(statuses))
            micro_batches = min(planned_micro_batches, groups) if planned_micro_batches else groups
        self.micro_batches = micro_batches
        handles = []
        for a in assignments:
            ch = self.transport.channel(a.address, "stage")
            handles.append(StageHandle(a.address, ch, self.stub(ch), start=a.start, end=a.end))
        n = len(handles)
        stream_key = secrets.token_hex(16)  # this plan's: its stages stream to each other with it
        self.identity.stream_keys.append(stream_key)  # and show it to PullWeights

        def request(i: int) -> stage_pb2.AssignRequest:
            h = handles[i]
            return stage_pb2.AssignRequest(
                model_dir=model_dir, model_digest=digest, start_layer=h.start, end_layer=h.end,
                num_layers=num_layers, stage_index=i, num_stages=n,
                next_address=handles[i + 1].address if i + 1 < n else "",
                first_address=handles[0].address if i > 0 else "", dtype=assignments[i].dtype or dtype,
                weight_format=assignments[i].weight_format, wire_dtype=assignments[i].wire_dtype,
                prev_node_id=assignments[i - 1].node_id if i > 0 else "",
                last_node_id=assignments[-1].node_id if i == 0 and n > 1 else "",
                plan_id=self.plan_id, controller_epoch=self.epoch, controller_id=self.owner,
                generation=self.generation, micro_batches=micro_batches, controller_address=controller_address,
                revoked=self.revoked, stream_key=stream_key, standby_name=self.identity.standby_name,
                tp_width=assignments[i].tp_width, tp_world=len(assignments[i].members),
                tp_init=assignments[i].tp_init, tp_members=[n for n, _ in assignments[i].members])

        async def assign(i: int) -> None:
            h = handles[i]
            req = request(i)
            try:
                reply = await h.stub.Assign(req, timeout=ASSIGN_TIMEOUT_S)
                h.parameter_count = reply.parameter_count
                h.status = await h.stub.Status(stage_pb2.StatusRequest(), timeout=RPC_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                raise _mesh_error(exc, absent_members(exc.details() or "", assignments[i].members) or h.address) from exc
            h.node_id, h.device = h.status.node_id, h.status.device
            log.info("stage %d: %s (%s) layers [%d, %d) ready in %.1f s", i, h.node_id, h.address,
                     h.start, h.end, reply.load_seconds)

        members: list[tuple[int, int, StageHandle]] = []  # (stage, rank, its handle)
        for i, a in enumerate(assignments):
            for rank, (node_id, address) in enumerate(a.members[1:], 1):
                ch = self.transport.channel(address, "stage")
                members.append((i, rank, StageHandle(address, ch, self.stub(ch), node_id=node_id, start=a.start,
                                                     end=a.end, leader=a.members[0][0])))

        async def assign_member(i: int, rank: int, h: StageHandle) -> None:
            """A member of stage i's group: it joins rank 0 (whose Assign waits for it) and follows it."""
            req = request(i)
            req.tp_rank = rank
            try:
                await h.stub.Assign(req, timeout=ASSIGN_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                raise _mesh_error(exc, h.address) from exc
            log.info("stage %d: %s (%s) is its rank %d", i, h.node_id, h.address, rank)

        try:
            results = await asyncio.gather(*(assign(i) for i in range(n)),
                                           *(assign_member(i, r, h) for i, r, h in members), return_exceptions=True)
            for r in results:
                if isinstance(r, BaseException):
                    raise r
        except BaseException:
            for h in [*handles, *(h for _, _, h in members)]:
                await h.channel.close()
            raise
        self.stages = handles
        self.members = [h for _, _, h in members]
        ready = []
        for h in handles:
            ready.append(asyncio.get_running_loop().create_future())
            h.events_task = asyncio.create_task(self._watch_events(h, ready[-1]))
        await asyncio.gather(*ready)
        now = time.monotonic()  # (its stages answered their Assign just now: not silent from the start)
        self.heard = now
        for h in handles:
            h.answered = now
        self._monitor = asyncio.create_task(self._watch_health(), name="stage-health")

    @property
    def down(self) -> list[tuple[str, str]]:
        """(address, why) of every stage that was lost or whose node membership holds down."""
        out = []
        for h in [*self.stages, *self.members]:
            why = h.down_reason if h.lost else self.why_down(h.address)
            if why:
                out.append((h.address, why))
        return out

    async def _watch_health(self) -> None:
        """Probe every stage each PROBE_INTERVAL_S (faster than membership's round): one silent for
        DOWN_AFTER_MISSES probes is reported (`on_stage_lost`, a hint: membership decides whether
        the node is down); one that serves another plan generation is lost. Closes that failed are
        retried on stages that answer."""
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            stages, members = list(self.stages), list(self.members)
            replies = await self._probe_round(stages + members)
            self._check_members(members, replies[len(stages):])
            for h, r in zip(stages, replies):
                if isinstance(r, BaseException):
                    h.misses += 1
                    silent = time.monotonic() - h.answered
                    if h.misses >= DOWN_AFTER_MISSES and silent >= STALL_GRACE_S and not h.stalled:
                        h.stalled = True
                        why = f"no answer to {h.misses} status probes in a row ({silent:.1f} s)"
                        log.warning("stage %s (%s): %s", h.node_id, h.address, why)
                        self._on_stage_lost(h.address, why)
                    elif h.misses == DOWN_AFTER_MISSES:
                        log.info("stage %s (%s) stalls: no answer to %d status probes; waiting up to %.0f s for it",
                                 h.node_id, h.address, h.misses, STALL_GRACE_S)
                    continue
                if h.misses >= DOWN_AFTER_MISSES and not h.stalled:
                    log.info("stage %s (%s) answers again after %.1f s: its sessions go on", h.node_id, h.address,
                             time.monotonic() - h.answered)
                h.misses, h.status, h.answered, h.stalled = 0, r, time.monotonic(), False
                if r.generation != self.generation and not h.lost and h in self.stages:
                    # it restarted, or another party assigned it: steps between it and its neighbours
                    # are refused as stale from now on (it reports them), so the plan cannot serve
                    h.lost = True
                    h.down_reason = (f"it serves plan generation {r.generation or 'none'} ({r.state}), not "
                                     f"{self.generation}; {r.stale_steps} stale steps refused")
                    log.warning("stage %s (%s) left our plan: %s", h.node_id, h.address, h.down_reason)
                    self._on_stage_lost(h.address, h.down_reason)
                    continue
                if not self.why_down(h.address) and self._pending_closes.get(h.address):
                    self._in_background(self._retry_closes(h))  # (the probes go on meanwhile)
            if self.silent_stage() is not None:
                self._report_silent()

    async def _probe_round(self, handles: list[StageHandle]) -> list:
        """Status of each of `handles` (or the exception its call raised), PROBE_TIMEOUT_S at most; a
        stage that turns silent meanwhile (silent_stage) is reported at once (on_silent), not at the
        round's end."""
        asked = time.monotonic()
        for h in handles:
            h.asked = asked
        calls = [asyncio.ensure_future(h.stub.Status(stage_pb2.StatusRequest(), timeout=PROBE_TIMEOUT_S))
                 for h in handles]

        def answered(h: StageHandle, call: asyncio.Future) -> None:  # (as each answers, not at the round's end)
            if not call.cancelled() and call.exception() is None:  # (one that failed counts as a miss)
                h.answered, h.asked = time.monotonic(), 0.0

        for h, c in zip(handles, calls):
            c.add_done_callback(lambda c, h=h: answered(h, c))
        pending = set(calls)
        try:
            while pending:
                _, pending = await asyncio.wait(pending, timeout=SILENT_TICK_S)
                if pending and self.silent_stage() is not None:
                    self._report_silent()
        finally:
            for c in pending:
                c.cancel()
        out = []
        for c in calls:
            try:
                out.append(c.result())
            except BaseException as exc:  # noqa: BLE001 — a probe's failure is its answer
                out.append(exc)
        return out

    def _report_silent(self) -> None:
        """on_silent, whose failure is logged: it must not end the health loop that calls it."""
        try:
            self.on_silent(self)
        except Exception:  # noqa: BLE001 — the probes go on; the next round reports it again
            log.exception("moving the requests of pipeline %d (a stage is silent) failed", self.index)

    def silent_stage(self) -> StageHandle | None:
        """A stage that has left a probe unanswered SILENT_PROBE_S (or missed its last) and answered
        none for SILENT_S, while no event came from this pipeline for as long: its requests wait on it
        (None: none such)."""
        now = time.monotonic()
        if now - self.heard < SILENT_S:
            return None
        return next((h for h in self.stages if not h.lost and now - h.answered >= SILENT_S
                     and (h.misses or (h.asked and now - h.asked >= SILENT_PROBE_S))), None)

    def _check_members(self, members: list[StageHandle], replies: list) -> None:
        """A member of a stage over several nodes that answers but follows no group any more (its follower
        ended: rank 0 stopped it, or it crashed) breaks that stage: lost, so the plan is made again.
        (One that does not answer is membership's to judge, as any node.)"""
        for h, r in zip(members, replies):
            if isinstance(r, BaseException) or h.lost or h not in self.members or \
                    (r.state, r.tp_leader) == ("member", h.leader):
                continue
            h.lost = True
            now = f"{r.state} of {r.tp_leader}" if r.tp_leader else r.state
            h.down_reason = f"it left the tensor-parallel stage of {h.leader} (it is {now})"
            log.warning("member %s (%s) of a tensor-parallel stage: %s", h.node_id, h.address, h.down_reason)
            self._on_stage_lost(h.address, h.down_reason)

    async def _retry_closes(self, h: StageHandle) -> None:
        sessions = self._pending_closes.pop(h.address, set())
        await self.close_session_many(sessions, [h])

    def largest_request(self) -> int:
        """Positions of KV the smallest stage pool holds: no sequence can grow past it."""
        return min((h.kv_positions for h in self.stages if h.kv_positions), default=0)

    async def _watch_events(self, h: StageHandle, ready: asyncio.Future) -> None:
        call = h.stub.Events(stage_pb2.EventsRequest(owner=self.owner))
        try:
            await call.initial_metadata()
            ready.set_result(None)
            async for batch in call:
                self.heard = time.monotonic()
                for ev in batch.events:
                    if self._unheard:  # (mostly empty: a dict lookup spared per token)
                        self._unheard.pop(ev.session_id, None)  # (its input arrived)
                    self._on_event(ev)
            reason = "its event stream ended"
        except asyncio.CancelledError:
            call.cancel()
            raise
        except grpc.aio.AioRpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
        if not ready.done():
            ready.set_exception(Unavailable(f"stage {h.address} sends no events: {reason}"))
        if h in self.stages and not h.lost:
            h.lost = True
            h.down_reason = h.down_reason or f"its event stream ended ({reason})"
            self._pending_closes.pop(h.address, None)  # its sessions went with it
            log.warning("lost stage %s (%s): %s", h.node_id, h.address, reason)
            self._on_stage_lost(h.address, reason)

    async def close(self, wait_closes: bool = True) -> None:
        """Let go of the stages. `wait_closes`: session closes in flight get their chance to land
        first (not when a new plan replaces this one: a stalled stage would hold it up)."""
        stages, self.stages = self.stages, []
        members, self.members = self.members, []
        for h in members:
            await h.channel.close()
        self._pending_closes.clear()
        if self._monitor is not None:
            self._monitor.cancel()
        await self._close_prompt_stream()
        if self._tasks and wait_closes:
            await asyncio.wait(self._tasks, timeout=RPC_TIMEOUT_S)
        for h in stages:
            if h.events_task:
                h.events_task.cancel()
            await h.channel.close()

    # ---- sessions -------------------------------------------------------------------------
    async def open_session(self, request: stage_pb2.OpenSessionRequest) -> int:
        """Open on every stage; returns the leading input positions every stage already holds (the
        prefix cache's hits). On any failure close those opened and raise the first error."""
        request.owner = self.owner
        request.controller_epoch = self.epoch
        # the stages as they are now: a re-plan may replace the list (and close these channels,
        # cancelling the calls) while we wait
        stages, generation = list(self.stages), self.generation
        if not stages:
            raise Unavailable("no pipeline serves now (a new plan is being installed)")
        results = await asyncio.gather(*(h.stub.OpenSession(request, timeout=OPEN_TIMEOUT_S) for h in stages),
                                       return_exceptions=True)
        errors = [(h, r) for h, r in zip(stages, results) if isinstance(r, BaseException)]
        if errors:  # closed everywhere (in the background: a stalled stage holds up no admission meanwhile;
            # one whose answer timed out may still have admitted it, and gets the close once it answers)
            self._in_background(self.close_session_many([request.session_id], [h for h in stages if h in self.stages]))
            h, exc = errors[0]
            if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                # a stage too busy (or stalled) to admit it in time: not the request's fault; it waits
                # and opens again (a stalled stage is planned around meanwhile)
                raise Unavailable(f"stage {h.address} did not answer OpenSession within {OPEN_TIMEOUT_S:.0f} s") from exc
            if isinstance(exc, grpc.aio.AioRpcError):
                raise _mesh_error(exc, h.address) from exc
            if isinstance(exc, asyncio.CancelledError) or self.generation != generation:
                # the channel closed under it: its plan was replaced (our own cancellation is not this:
                # gather would have raised it)
                raise Unavailable(f"stage {h.address} left the plan while the request opened")
            raise exc
        return min(r.cached_tokens for r in results)

    async def close_session(self, session_id: str, only: list[StageHandle] | None = None, *, swap: bool = False) -> None:
        """Close a session on every stage (or `only` these); a stage that cannot be reached now
        gets the close again once it answers (so nothing stays held after a stall)."""
        await self.close_session_many([session_id], only or self.stages, swap=swap)

    async def close_session_many(self, sessions, stages: list[StageHandle], *, swap: bool = False) -> None:
        """`swap`: the sessions are replayed later (preempted): the stages keep their KV in their swap
        space (--swap-mib) for the replay."""
        sessions = list(sessions)
        for sid in sessions:
            self._unheard.pop(sid, None)
        pairs = [(sid, h) for sid in sessions for h in stages]
        results = await asyncio.gather(*(h.stub.CloseSession(stage_pb2.CloseSessionRequest(session_id=sid, swap=swap),
                                                             timeout=RPC_TIMEOUT_S) for sid, h in pairs),
                                       return_exceptions=True)
        for (sid, h), r in zip(pairs, results):
            gone = isinstance(r, grpc.aio.AioRpcError) and r.code() in (grpc.StatusCode.NOT_FOUND,
                                                                         grpc.StatusCode.FAILED_PRECONDITION)
            if isinstance(r, BaseException) and not gone and h in self.stages and not h.lost:
                self._pending_closes.setdefault(h.address, set()).add(sid)

    def close_session_soon(self, session_id: str, *, swap: bool = False) -> None:
        """Close a session on every stage in the background (the task is kept until done)."""
        self._in_background(self.close_session(session_id, swap=swap))

    def _in_background(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def send_feed(self, batch: stage_pb2.StepBatch) -> None:
        """Write an input feed (a prompt, a replay) to stage 0 on the controller's long-lived stream."""
        batch.generation = self.generation
        async with self._prompt_lock:
            if not self.stages:
                raise Unavailable("no pipeline serves now (a new plan is being installed)")
            if self._prompt_call is None:
                self._prompt_call = self.stages[0].stub.Stream()
                task = asyncio.create_task(self._read_prompt_replies(self._prompt_call))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            call = self._prompt_call
            try:
                # bounded: a stream whose stage never took it (its start, its flow control) holds up no
                # admission for longer (grpc's write waits for the call's start with no deadline of its own)
                await asyncio.wait_for(call.write(batch), OPEN_TIMEOUT_S)
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError, asyncio.TimeoutError) as exc:
                call.cancel()
                if self._prompt_call is call:
                    self._prompt_call = None
                why = f"took no input in {OPEN_TIMEOUT_S:.0f} s" if isinstance(exc, asyncio.TimeoutError) else \
                    f"does not take prompts: {exc}"
                where = f"stage 0 at {self.stages[0].address if self.stages else '?'}"
                if isinstance(exc, asyncio.TimeoutError):  # (a stage that died: its pipeline is planned around)
                    self._lost_with(call, f"its input was dropped with the prompt stream to {where}, which {why}")
                raise Unavailable(f"{where} {why}") from exc
            for seq in batch.seqs:
                self._unheard[seq.session_id] = call

    def _lost_with(self, call, why: str) -> None:
        """The prompt stream `call` was dropped: each session whose last feed went on it and that no
        stage has been heard of since gets an UNAVAILABLE error event (its request replays)."""
        lost = [sid for sid, c in self._unheard.items() if c is call]
        for sid in lost:
            del self._unheard[sid]
            self._on_event(stage_pb2.Event(session_id=sid, error=stage_pb2.SessionError(
                code=code_number(grpc.StatusCode.UNAVAILABLE), message=why,
                node_id=self.stages[0].node_id if self.stages else "")))
        if lost:
            log.warning("%d sessions' input may be lost with the prompt stream: they replay (%s)", len(lost), why)

    async def _read_prompt_replies(self, call) -> None:
        why = "was closed by its stage"
        try:
            async for reply in call:  # its request replays (or fails) at once, not at its deadline
                self._unheard.pop(reply.session_id, None)
                log.warning("stage 0 rejected %s: %s", reply.session_id, reply.message)
                self._on_event(stage_pb2.Event(session_id=reply.session_id, error=stage_pb2.SessionError(
                    code=reply.code, message=f"stage 0 refused its input: {reply.message}",
                    node_id=self.stages[0].node_id if self.stages else "")))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED:  # (ours: a write that timed out, the pipeline going)
                return
            why = f"ended: {exc.code().name} {exc.details()}"
            log.warning("prompt stream to stage 0 ended: %s", exc.details())
        finally:
            if self._prompt_call is call:
                self._prompt_call = None
        if any(c is call for c in self._unheard.values()):
            await asyncio.sleep(ENDED_FEED_GRACE_S)
            if self.stages and not self.retired and not self.stages[0].lost:
                self._lost_with(call, f"its input went on the prompt stream to stage 0 at {self.stages[0].address}, "
                                      f"which {why}")

    async def _close_prompt_stream(self) -> None:
        call, self._prompt_call = self._prompt_call, None
        self._unheard.clear()  # (the pipeline is going: its sessions are the re-plan's to move)
        if call is not None:
            call.cancel()
