"""StageNode gRPC servicer: translates between protobuf (through `wire`) and the runtime."""
from __future__ import annotations

import asyncio
import functools
import logging
import time

import grpc

from logicpipe.errors import MeshError, ResourceExhausted
from logicpipe.v1 import stage_pb2, stage_pb2_grpc
from stage_node import __version__, wire
from stage_node.runtime import Assignment, StageRuntime

log = logging.getLogger(__name__)

MAX_ECHO_BYTES = 32 * 2**20


def unary(method):
    """A unary handler whose MeshErrors become their gRPC status and message."""
    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except MeshError as err:
            await context.abort(err.code, str(err))
    return wrapper


class StageNodeServicer(stage_pb2_grpc.StageNodeServicer):
    def __init__(self, runtime: StageRuntime, profile=None, compute_id: str = ""):
        self.runtime = runtime
        self.profile = profile  # stage_node.profile.HostProfile, measured at start
        self.compute_id = compute_id  # stage_node.profile.compute_id

    @unary
    async def Assign(self, request, context):
        a = Assignment(
            model_dir=request.model_dir, start=request.start_layer, end=request.end_layer,
            num_layers=request.num_layers, stage_index=request.stage_index, num_stages=request.num_stages,
            next_address=request.next_address, first_address=request.first_address,
            dtype=request.dtype or "float32", plan_id=request.plan_id, model_digest=request.model_digest,
            generation=request.generation, micro_batches=request.micro_batches)
        t0 = time.monotonic()
        eng = await self.runtime.assign(a)
        return stage_pb2.AssignReply(parameter_count=eng.shard.parameter_count,
                                     tied_copy_count=eng.shard.tied_copy_count, load_seconds=time.monotonic() - t0)

    @unary
    async def OpenSession(self, request, context):
        return stage_pb2.OpenSessionReply(cached_tokens=self.runtime.open_session(request))

    @unary
    async def CloseSession(self, request, context):
        return stage_pb2.CloseSessionReply(tokens_held=self.runtime.close_session(request.session_id))

    async def Stream(self, request_iterator, context):
        try:
            self.runtime.require_ready()
        except MeshError as err:
            await context.abort(err.code, str(err))
        async for batch in request_iterator:
            try:
                rejected = self.runtime.receive(batch)
            except MeshError as err:
                await context.abort(err.code, str(err))
            for sid, err in rejected:
                yield wire.stream_reply(sid, err)

    async def Events(self, request, context):
        try:
            owner = wire.check_id("owner", request.owner, empty_ok=True)
        except MeshError as err:
            await context.abort(err.code, str(err))
        sub = self.runtime.events.subscribe(owner)
        try:
            await context.send_initial_metadata(())  # the subscriber knows it is subscribed
            while True:
                events = await sub.next_batch()
                if sub.overflowed:
                    err = ResourceExhausted(f"node {self.runtime.node_id}: this Events subscriber fell behind; "
                                            "read faster or subscribe again")
                    await context.abort(err.code, str(err))
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
            block_size=rt.options.block_size, compute_id=self.compute_id)
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
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"reply_bytes {request.reply_bytes} over the {MAX_ECHO_BYTES}-byte cap")
        return stage_pb2.EchoReply(payload=bytes(request.reply_bytes))

    async def MeasureLink(self, request, context):
        from stage_node.linkprobe import measure_link

        if not request.target_address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "target_address is empty")
        try:
            latency, bandwidth = await measure_link(request.target_address, request.probes or 5,
                                                    min(request.payload_bytes or 2**20, MAX_ECHO_BYTES))
        except (grpc.aio.AioRpcError, asyncio.TimeoutError) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{request.target_address} unreachable: {exc}")
        return stage_pb2.MeasureLinkReply(latency_s=latency, bandwidth=bandwidth)
