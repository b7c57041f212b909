"""The StageNode gRPC servicer: translates between protobuf (through `wire`) and the runtime, which
sees only its own types."""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import time

import grpc

from logicpipe import __version__
from logicpipe.common.transport import Transport, caller_address
from logicpipe.errors import InvalidArgument, PermissionDenied, ResourceExhausted, Unavailable
from logicpipe.limits import check_address, check_id
from logicpipe.policy import STAGE, STREAM_KEY_HEADER
from logicpipe.stage_node.net import kv_link, wire
from logicpipe.stage_node.net.fence import MAX_REVOKED, Caller
from logicpipe.stage_node.net.linkprobe import measure_link
from logicpipe.stage_node.profile import HostProfile
from logicpipe.stage_node.runtime import StageRuntime
from logicpipe.v1 import stage_pb2, stage_pb2_grpc

MAX_ECHO_BYTES = 32 * 2**20  # the payload an Echo sends back, bytes
LARGE_ECHO_BYTES = 2**20     # Echo calls moving more than this (either way) run at most
LARGE_ECHOES = 2             #   this many at a time; more are refused, not queued
MAX_PROBES = 64              # MeasureLink round trips in one call
MAX_MEASURE_WAITING = 16     # MeasureLink calls waiting for the one in progress; more are refused
MAX_SUBSCRIBERS = 64         # Events subscriptions open at once


MAX_KEY_CHARS = 128          # a plan's stream key


def revoked_names(names) -> list[str]:
    """A revocation list from the wire, each name checked like any id."""
    if len(names) > MAX_REVOKED:
        raise InvalidArgument(f"a revocation list of {len(names)} names is over the cap of {MAX_REVOKED}")
    return [check_id("a revoked name", n) for n in names]


class StageNodeServicer(stage_pb2_grpc.StageNodeServicer):
    def __init__(self, runtime: StageRuntime, transport: Transport, profile: HostProfile | None = None,
                 compute_id: str = ""):
        self.runtime = runtime
        self.transport = transport  # the process's: who a caller is (TLS), how MeasureLink dials
        self.profile = profile      # measured at start (None: --no-profile)
        self.compute_id = compute_id  # stage_node.profile.compute_id
        self._large_echoes = 0
        self._measuring = asyncio.Lock()
        self._measure_waiting = 0

    def profile_digest(self) -> str:
        """12 hex of the measured profile (the mDNS record carries it: a changed profile re-plans)."""
        return hashlib.sha256(wire.profile_to_proto(self.profile).SerializeToString(deterministic=True)).hexdigest()[:12]

    def _caller(self, context) -> Caller:
        return Caller.of(self.transport.peer(context)[1], context.invocation_metadata())

    async def Assign(self, request, context):
        a = wire.assignment_from_proto(request, caller_address(request.controller_address, context.peer()))
        revoked = revoked_names(request.revoked)
        if len(request.stream_key) > MAX_KEY_CHARS:
            raise InvalidArgument(f"stream_key is {len(request.stream_key)} characters, over the {MAX_KEY_CHARS} cap")
        fence, caller = self.runtime.fence, self._caller(context)
        cid, epoch = request.controller_id, request.controller_epoch
        standby = check_id("standby_name", request.standby_name, empty_ok=True)
        fence.may_take(caller, cid, epoch)  # refused before anything loads

        def admit() -> None:  # loaded and valid: only now does the caller hold this node
            fence.take(caller, cid, epoch, standby)
            fence.set_revoked(revoked)

        t0 = time.monotonic()
        eng = await self.runtime.assign(a, stream_key=request.stream_key, admit=admit)
        if eng is None:  # a member of another node's stage: its follower loads with rank 0's LOAD
            return stage_pb2.AssignReply(load_seconds=time.monotonic() - t0)
        return stage_pb2.AssignReply(parameter_count=eng.shard.parameter_count,
                                     tied_copy_count=eng.shard.tied_copy_count, load_seconds=time.monotonic() - t0)

    async def Revoked(self, request, context):
        names = revoked_names(request.names)
        self.runtime.fence.check(self._caller(context), "revocation lists")
        self.runtime.fence.set_revoked(names)
        return stage_pb2.RevokedReply(revoked=len(self.runtime.fence.revoked))

    async def Release(self, request, context):
        released = self.runtime.fence.release(self._caller(context), request.controller_id)
        return stage_pb2.ReleaseReply(released=released)

    async def OpenSession(self, request, context):
        caller = self._caller(context)
        self.runtime.fence.check(caller, "sessions")
        cfg = self.runtime.require_ready().shard.config
        spec = wire.spec_from_proto(request, context=cfg.max_position_embeddings, vocab_size=cfg.vocab_size,
                                    opener=caller)
        return stage_pb2.OpenSessionReply(cached_tokens=self.runtime.open_session(spec))

    async def CloseSession(self, request, context):
        caller = self._caller(context)
        self.runtime.fence.check(caller, "CloseSession")
        return stage_pb2.CloseSessionReply(tokens_held=self.runtime.close_session(request.session_id, caller,
                                                                                  swap=request.swap))

    async def Stream(self, request_iterator, context):
        self.runtime.require_ready()
        self._check_streamer(context)
        async for batch in request_iterator:
            eng = self.runtime.require_ready()
            cfg, a = eng.shard.config, eng.assignment
            if a.first:
                works = wire.works_from_proto(batch, vocab_size=cfg.vocab_size)
            else:
                works = wire.step_from_proto(batch, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                                             stage_index=a.stage_index)
            for sid, err in self.runtime.receive(works, batch.generation):
                yield wire.stream_reply(sid, err)

    def _check_streamer(self, context) -> None:
        """Who may stream into this stage: the stages of its plan (over TLS by name: the stage
        before it, and on stage 0 the last stage; and by the plan's stream key when it has one),
        and the controller that holds it (prompts into stage 0)."""
        eng = self.runtime.engine
        if eng is None:
            return
        role, name = self.transport.peer(context)
        a = eng.assignment
        if role == STAGE:  # over TLS, by name; RoleCheck admitted no role but stage and controller
            allowed = {x for x in (a.prev_node_id, a.last_node_id) if x}
            if allowed and name not in allowed:
                raise PermissionDenied(f"node {self.runtime.node_id} takes steps only from "
                                       f"{' or '.join(sorted(allowed))}, not from stage {name!r}")
        key = next((v for k, v in context.invocation_metadata() or () if k == STREAM_KEY_HEADER), "")
        if eng.stream_key and isinstance(key, str) and hmac.compare_digest(key.encode(), eng.stream_key.encode()):
            return
        if role == STAGE and not eng.stream_key:
            return
        try:
            self.runtime.fence.check(self._caller(context), "prompts")
        except PermissionDenied:
            if role == STAGE or eng.stream_key:
                raise PermissionDenied(f"node {self.runtime.node_id} takes steps only from the stages of its plan "
                                       "(they send its stream key) and prompts only from the controller that holds "
                                       "it") from None
            raise

    async def SendKv(self, request, context):
        """Disaggregated prefill: send a prefilled session's KV of some layers to a stage of another
        pipeline (engine.handoff); only the controller that holds this stage may ask."""
        check_id("session_id", request.session_id)
        check_id("target_session_id", request.target_session_id)
        check_id("controller_id", request.controller_id, empty_ok=True)
        check_address("target_address", request.target_address)
        self.runtime.fence.check(self._caller(context), "SendKv")
        chunks = self.runtime.export_kv(request.session_id, request.length, (request.start_layer, request.end_layer))
        sent, seconds, _ = await kv_link.send_kv(self.transport, request.target_address, request.target_session_id,
                                                 request.import_key, chunks)
        return kv_link.send_reply(sent, seconds)

    async def ImportKv(self, request_iterator, context):
        """Disaggregated prefill: KV chunks of a session opened here with kv_import_length, from a
        stage of the prefill pipeline (each chunk carries the session's kv_import_key)."""
        self.runtime.require_ready()
        chunks, complete = 0, False
        async for msg in request_iterator:
            complete = await self.runtime.import_kv(wire.kv_chunk_from_proto(msg))
            chunks += 1
        return stage_pb2.ImportKvReply(chunks=chunks, complete=complete)

    async def SetMirror(self, request, context):
        """KV mirrors (net.mirror): the stages this one copies its full KV blocks to, and the key its
        own PutBlocks take; only the controller that holds this stage may say."""
        check_id("controller_id", request.controller_id, empty_ok=True)
        targets = [check_address("targets", t) for t in request.targets]
        self.runtime.fence.check(self._caller(context), "SetMirror")
        return stage_pb2.SetMirrorReply(targets=self.runtime.mirror.set(targets, request.key, request.generation))

    async def PutBlocks(self, request, context):
        """KV mirrors: full KV blocks of another pipeline's stage, for this one's prefix cache (they
        carry the mirror key the controller gave both)."""
        return await self.runtime.mirror.put(request)

    async def Events(self, request, context):
        owner = check_id("owner", request.owner, empty_ok=True)
        self.runtime.fence.check(self._caller(context), "Events subscriptions")
        if self.runtime.events.subscribers >= MAX_SUBSCRIBERS:
            raise ResourceExhausted(f"node {self.runtime.node_id} has {MAX_SUBSCRIBERS} Events subscribers already")
        sub = self.runtime.events.subscribe(owner)
        try:
            await context.send_initial_metadata(())  # the subscriber knows it is subscribed
            while True:
                events = await sub.next_batch()
                if sub.overflowed:
                    raise ResourceExhausted(f"node {self.runtime.node_id}: this Events subscriber fell behind; "
                                            "read faster or subscribe again")
                yield stage_pb2.EventBatch(events=[wire.event_to_proto(ev) for ev in events])
        finally:
            self.runtime.events.unsubscribe(sub)

    async def Status(self, request, context):
        reply = wire.status_reply(self.runtime.snapshot(), profile=self.profile, compute_id=self.compute_id,
                                  version=__version__)
        fence = self.runtime.fence
        fence.renew(self._caller(context))  # the holder's probe renews its lease
        reply.controller_epoch, reply.controller_id, reply.revoked = fence.epoch, fence.controller_id, len(fence.revoked)
        st = self.runtime.stats
        reply.stale_steps, reply.replay_rows_resumed, reply.replay_layers_skipped = \
            st.stale_steps, st.replay_rows_resumed, st.replay_layers_skipped
        reply.mirror_targets = len(self.runtime.mirror.targets)
        reply.kv_disk_bytes = self.runtime.kv_disk.bytes
        return reply

    async def Echo(self, request, context):
        if request.reply_bytes > MAX_ECHO_BYTES:
            raise InvalidArgument(f"reply_bytes {request.reply_bytes} over the {MAX_ECHO_BYTES}-byte cap")
        if max(request.reply_bytes, len(request.payload)) <= LARGE_ECHO_BYTES:
            return stage_pb2.EchoReply(payload=bytes(request.reply_bytes))
        if self._large_echoes >= LARGE_ECHOES:
            raise ResourceExhausted(f"node {self.runtime.node_id} is already answering {LARGE_ECHOES} large Echo "
                                    "calls; retry when they are done")
        self._large_echoes += 1
        try:
            return stage_pb2.EchoReply(payload=bytes(request.reply_bytes))
        finally:
            self._large_echoes -= 1

    async def MeasureLink(self, request, context):
        check_id("controller_id", request.controller_id, empty_ok=True)
        self.runtime.fence.check_holder(self._caller(context), "MeasureLink")  # it dials only for its holder
        if not request.target_address or len(request.target_address) > 256:
            raise InvalidArgument("target_address must be a host:port of 1 to 256 characters")
        if request.probes > MAX_PROBES:
            raise InvalidArgument(f"probes {request.probes} over the cap of {MAX_PROBES}")
        if self._measure_waiting >= MAX_MEASURE_WAITING:
            raise ResourceExhausted(f"node {self.runtime.node_id} has {MAX_MEASURE_WAITING} link measurements "
                                    "waiting; retry when they are done")
        self._measure_waiting += 1
        try:
            await self._measuring.acquire()  # one measurement at a time, the others wait their turn
        finally:
            self._measure_waiting -= 1
        try:
            try:
                latency, bandwidth = await measure_link(self.transport, request.target_address, request.probes or 5,
                                                        min(request.payload_bytes or 2**20, MAX_ECHO_BYTES))
            except grpc.aio.AioRpcError as exc:
                detail = (exc.details() or "").splitlines()[0][:200] if exc.details() else ""
                raise Unavailable(f"{request.target_address} is not a reachable stage node: {exc.code().name} "
                                  f"{detail}") from None
            except asyncio.TimeoutError:
                raise Unavailable(f"{request.target_address} did not answer in time") from None
        finally:
            self._measuring.release()
        return stage_pb2.MeasureLinkReply(latency_s=latency, bandwidth=bandwidth)
