"""StageNode gRPC servicer: translates between protobuf (through `wire`) and the runtime."""
from __future__ import annotations

import asyncio
import hashlib
import time

import grpc

from logicpipe.common.transport import Transport, caller_address
from logicpipe.limits import MAX_ID_CHARS
from logicpipe.errors import InvalidArgument, PermissionDenied, ResourceExhausted, Unavailable
from logicpipe.v1 import stage_pb2, stage_pb2_grpc
from logicpipe import __version__
from logicpipe.stage_node import wire
from logicpipe.stage_node.linkprobe import measure_link
from logicpipe.stage_node.runtime import Assignment, StageRuntime


MAX_ECHO_BYTES = 32 * 2**20  # the payload an Echo sends back, bytes
LARGE_ECHO_BYTES = 2**20     # Echo calls moving more than this (either way) run at most
LARGE_ECHOES = 2             #   this many at a time; more are refused, not queued
MAX_PROBES = 64              # MeasureLink round trips in one call
MAX_MEASURE_WAITING = 16     # MeasureLink calls waiting for the one in progress; more are refused
MAX_SUBSCRIBERS = 64         # Events subscriptions open at once


MAX_OPENERS = 65536  # session owners remembered before the gone ones are dropped


class StageNodeServicer(stage_pb2_grpc.StageNodeServicer):
    def __init__(self, runtime: StageRuntime, transport: Transport, profile=None, compute_id: str = ""):
        self.runtime = runtime
        self.transport = transport  # the process's: who a caller is (TLS), how MeasureLink dials
        self.profile = profile  # stage_node.profile.HostProfile, measured at start
        self.compute_id = compute_id  # stage_node.profile.compute_id
        self._openers: dict[str, str] = {}  # session id -> the certificate name that opened it (TLS only)
        self._large_echoes = 0
        self._measuring = asyncio.Lock()
        self._measure_waiting = 0

    def profile_digest(self) -> str:
        """12 hex of the measured profile (the mDNS record carries it: a changed profile re-plans)."""
        return hashlib.sha256(wire.profile_to_proto(self.profile).SerializeToString(deterministic=True)).hexdigest()[:12]

    async def Assign(self, request, context):
        a = Assignment(
            model_dir=request.model_dir, start=request.start_layer, end=request.end_layer,
            num_layers=request.num_layers, stage_index=request.stage_index, num_stages=request.num_stages,
            next_address=request.next_address, first_address=request.first_address,
            dtype=request.dtype or "float32", plan_id=request.plan_id, model_digest=request.model_digest,
            generation=request.generation, micro_batches=request.micro_batches,
            weight_format=request.weight_format, wire_dtype=request.wire_dtype,
            prev_node_id=request.prev_node_id, last_node_id=request.last_node_id,
            controller_address=caller_address(request.controller_address, context.peer()))
        t0 = time.monotonic()
        eng = await self.runtime.assign(a)
        return stage_pb2.AssignReply(parameter_count=eng.shard.parameter_count,
                                     tied_copy_count=eng.shard.tied_copy_count, load_seconds=time.monotonic() - t0)

    async def OpenSession(self, request, context):
        cached = self.runtime.open_session(request)
        self._own(request.session_id, context)
        return stage_pb2.OpenSessionReply(cached_tokens=cached)

    async def CloseSession(self, request, context):
        opener = self._openers.get(request.session_id)
        _, name = self.transport.peer(context)
        if opener is not None and name != opener:
            raise PermissionDenied(f"session {request.session_id[:MAX_ID_CHARS]} belongs to {opener!r}, "
                                   f"not to {name!r}")
        held = self.runtime.close_session(request.session_id)
        self._openers.pop(request.session_id, None)
        return stage_pb2.CloseSessionReply(tokens_held=held)

    def _own(self, session_id: str, context) -> None:
        """Over TLS, remember who opened a session: only that party may close it. Entries of
        sessions gone by other ways (finished, expired) are dropped as the map grows."""
        _, name = self.transport.peer(context)
        if not name:
            return
        if len(self._openers) >= MAX_OPENERS:
            eng = self.runtime.engine
            open_now = eng.scheduler.seqs if eng is not None else {}
            self._openers = {sid: who for sid, who in self._openers.items() if sid in open_now}
        self._openers[session_id] = name

    async def Stream(self, request_iterator, context):
        self.runtime.require_ready()
        self._check_streamer(context)
        async for batch in request_iterator:
            for sid, err in self.runtime.receive(batch):
                yield wire.stream_reply(sid, err)

    def _check_streamer(self, context) -> None:
        """Over TLS a stage streams steps only to its successor (and the last stage its tokens to
        stage 0): the caller's certificate must name the stage the assignment says."""
        eng = self.runtime.engine
        if not self.transport.tls or eng is None:
            return
        role, name = self.transport.peer(context)
        if role != "stage":
            return  # the controller (prompts to stage 0); RoleCheck admitted no other role
        a = eng.assignment
        allowed = {x for x in (a.prev_node_id, a.last_node_id) if x}
        if allowed and name not in allowed:
            raise PermissionDenied(f"node {self.runtime.node_id} takes steps only from "
                                   f"{' or '.join(sorted(allowed))}, not from stage {name!r}")

    async def Events(self, request, context):
        owner = wire.check_id("owner", request.owner, empty_ok=True)
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
                yield stage_pb2.EventBatch(events=events)
        finally:
            self.runtime.events.unsubscribe(sub)

    async def Status(self, request, context):
        rt, eng = self.runtime, self.runtime.engine
        reply = stage_pb2.StatusReply(
            node_id=rt.node_id, state=rt.state.value, device=str(rt.device), steps=rt.steps, tokens=rt.rows,
            seq_rows=rt.seq_rows, max_step_seqs=rt.max_step_seqs, uptime_s=time.monotonic() - rt.started,
            profile=wire.profile_to_proto(self.profile), version=__version__, sessions_expired=rt.sessions_expired,
            orphaned_sessions=rt.orphaned_sessions(), session_ttl_s=rt.options.session_ttl_s,
            block_size=rt.options.block_size, compute_id=self.compute_id, compute_s=rt.compute_s,
            stopping=rt.stopping, weights_pulled_bytes=rt.weights_pulled_bytes, sampled_steps=rt.sampled_steps,
            sampled_tokens=rt.sampled_tokens, candidates_verified=rt.candidates_verified,
            candidates_accepted=rt.candidates_accepted, drafter=rt.drafter,
            dtype=rt.engine.assignment.dtype if rt.engine is not None else "",
            weight_format=rt.engine.shard.weight_format if rt.engine is not None else "",
            weight_bytes=rt.engine.shard.weight_bytes if rt.engine is not None else 0)
        if eng is not None:
            a, shard, kv = eng.assignment, eng.shard, eng.kv
            reply.model_dir, reply.model_digest, reply.plan_id = a.model_dir, a.model_digest, a.plan_id
            reply.start_layer, reply.end_layer, reply.num_layers = a.start, a.end, a.num_layers
            reply.stage_index, reply.num_stages, reply.generation = a.stage_index, a.num_stages, a.generation
            reply.parameter_count, reply.tied_copy_count = shard.parameter_count, shard.tied_copy_count
            reply.open_sessions = len(eng.scheduler.seqs)
            reply.block_size, reply.kv_blocks_total = kv.block_size, kv.num_blocks
            reply.kv_blocks_used, reply.kv_blocks_cached = kv.used, len(kv.cached)
            reply.kv_bytes = kv.used * eng.pool.block_bytes
            reply.prefix_hit_tokens, reply.preempted = kv.prefix_hit_tokens, eng.scheduler.preempted
            reply.micro_batches = eng.scheduler.micro_batches if a.first else 0
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
