"""StageNode gRPC servicer: translates between protobuf and the runtime's domain types."""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from logicpipe import tensor_codec
from logicpipe.errors import InvalidArgument, MeshError
from logicpipe.v1 import stage_pb2, stage_pb2_grpc
from stage_node import __version__
from stage_node.runtime import MAX_STEP_ROWS, Assignment, SeqWork, StageRuntime, Work
from stage_node.sampling import SamplingParams

log = logging.getLogger(__name__)

MAX_ECHO_BYTES = 32 * 2**20
HIDDEN_DTYPES = tuple(tensor_codec.DTYPES[n] for n in ("float32", "float16", "bfloat16"))


async def _abort(context: grpc.aio.ServicerContext, err: MeshError):
    await context.abort(err.code, str(err))


def sampling_from_proto(p: stage_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p or 1.0,
                          seed=p.seed if p.HasField("seed") else None)


def work_from_proto(batch: stage_pb2.StepBatch, runtime: StageRuntime) -> Work:
    """Validate a step message against this stage's assignment. Raises InvalidArgument."""
    shard = runtime.require_ready()
    if not batch.seqs:
        raise InvalidArgument("step has no sequences")
    rows = 0
    seqs = []
    seen: set[str] = set()
    for s in batch.seqs:
        if s.session_id in seen:
            raise InvalidArgument(f"session {s.session_id} appears twice in one step; send its next slice "
                                  "in a later step")
        seen.add(s.session_id)
        if s.num_tokens < 1:
            raise InvalidArgument(f"session {s.session_id}: num_tokens must be >= 1")
        rows += s.num_tokens
        if shard.first:
            if len(s.token_ids) != s.num_tokens:
                raise InvalidArgument(
                    f"session {s.session_id}: {len(s.token_ids)} token ids for num_tokens={s.num_tokens}")
            bad = [t for t in s.token_ids if not 0 <= t < shard.config.vocab_size]
            if bad:
                raise InvalidArgument(f"session {s.session_id}: token id {bad[0]} outside the vocabulary "
                                      f"[0, {shard.config.vocab_size})")
        seqs.append(SeqWork(s.session_id, s.start_pos, s.num_tokens, tuple(s.token_ids), s.prefill_only))
    if rows > MAX_STEP_ROWS:
        raise InvalidArgument(f"step of {rows} token rows is over the {MAX_STEP_ROWS}-row cap; send smaller chunks")
    if shard.first:
        return Work(seqs)
    if not batch.HasField("hidden"):
        raise InvalidArgument(f"stage {runtime.assignment.stage_index} needs hidden states, the step has none")
    try:
        hidden = tensor_codec.decode(batch.hidden, rank=2, dtypes=HIDDEN_DTYPES)
    except tensor_codec.TensorError as exc:
        raise InvalidArgument(f"hidden states: {exc}") from exc
    if tuple(hidden.shape) != (rows, shard.config.hidden_size):
        raise InvalidArgument(f"hidden states of shape {list(hidden.shape)}, expected [{rows}, {shard.config.hidden_size}]")
    return Work(seqs, hidden)


def profile_to_proto(profile) -> stage_pb2.DeviceProfile:
    if profile is None:
        return stage_pb2.DeviceProfile()
    return stage_pb2.DeviceProfile(
        device_kind=profile.device_kind, device_name=profile.device_name, memory_bytes=profile.memory_bytes,
        flops=profile.flops, mem_bandwidth=profile.mem_bandwidth, weight_formats=list(profile.weight_formats))


class StageNodeServicer(stage_pb2_grpc.StageNodeServicer):
    def __init__(self, runtime: StageRuntime, profile=None):
        self.runtime = runtime
        self.profile = profile  # stage_node.profile.HostProfile, measured at start

    async def Assign(self, request, context):
        a = Assignment(
            model_dir=request.model_dir, start=request.start_layer, end=request.end_layer,
            num_layers=request.num_layers, stage_index=request.stage_index, num_stages=request.num_stages,
            next_address=request.next_address, first_address=request.first_address,
            dtype=request.dtype or "float32", plan_id=request.plan_id, model_digest=request.model_digest)
        t0 = time.monotonic()
        try:
            shard = await self.runtime.assign(a)
        except MeshError as err:
            await _abort(context, err)
        return stage_pb2.AssignReply(parameter_count=shard.parameter_count, tied_copy_count=shard.tied_copy_count,
                                     load_seconds=time.monotonic() - t0)

    async def OpenSession(self, request, context):
        try:
            self.runtime.open_session(request.session_id, request.capacity, sampling_from_proto(request.sampling),
                                      request.max_new_tokens or 1 << 30, frozenset(request.stop_token_ids))
        except MeshError as err:
            await _abort(context, err)
        return stage_pb2.OpenSessionReply()

    async def CloseSession(self, request, context):
        try:
            held = self.runtime.close_session(request.session_id)
        except MeshError as err:
            await _abort(context, err)
        return stage_pb2.CloseSessionReply(tokens_held=held)

    async def Stream(self, request_iterator, context):
        try:
            self.runtime.require_ready()
        except MeshError as err:
            await _abort(context, err)
        async for batch in request_iterator:
            try:
                work = work_from_proto(batch, self.runtime)
                rejected = self.runtime.submit(work)
            except MeshError as err:
                await _abort(context, err)
            for sid, err in rejected:
                yield stage_pb2.StreamReply(session_id=sid, code=err.code.value[0], message=str(err))

    async def Events(self, request, context):
        q = self.runtime.subscribe()
        try:
            await context.send_initial_metadata(())  # the subscriber knows it is subscribed
            while True:
                events = list(await q.get())
                while not q.empty():
                    events.extend(q.get_nowait())
                yield stage_pb2.EventBatch(events=events)
        finally:
            self.runtime.unsubscribe(q)

    async def Status(self, request, context):
        rt, a, shard = self.runtime, self.runtime.assignment, self.runtime.shard
        reply = stage_pb2.StatusReply(
            node_id=rt.node_id, state=rt.state, device=str(rt.device), open_sessions=len(rt.sessions),
            kv_bytes=rt.kv_bytes(), steps=rt.steps, tokens=rt.tokens, uptime_s=time.monotonic() - rt.started,
            profile=profile_to_proto(self.profile), version=__version__)
        if a is not None and shard is not None:
            reply.model_dir, reply.model_digest, reply.plan_id = a.model_dir, a.model_digest, a.plan_id
            reply.start_layer, reply.end_layer, reply.num_layers = a.start, a.end, a.num_layers
            reply.stage_index, reply.num_stages = a.stage_index, a.num_stages
            reply.parameter_count, reply.tied_copy_count = shard.parameter_count, shard.tied_copy_count
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
