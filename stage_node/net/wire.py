"""The wire adapter of a stage: the only code that reads or builds protobuf (for `service.py` and
the links). Reading validates: a message that can never work raises InvalidArgument with a
message that says what is wrong; nothing here touches torch. The runtime and the engine see only
their own types."""
from __future__ import annotations

from logicpipe import tensor_codec
from logicpipe.errors import InvalidArgument, MeshError, code_number
from logicpipe.formats import FLOAT_DTYPES
from logicpipe.limits import check_address, check_id
from logicpipe.sampling import MAX_GRAMMAR_CHARS, MAX_TOP_LOGPROBS, SamplingParams
from logicpipe.stage_node.config import Assignment
from logicpipe.stage_node.net.events import Event, TokenEvent
from logicpipe.stage_node.net.fence import Caller
from logicpipe.stage_node.engine.handoff import KvRows
from logicpipe.stage_node.engine.inbox import StepMsg
from logicpipe.stage_node.engine.sequence import SeqSpec, SeqWork
from logicpipe.stage_node.engine.stats import StageSnapshot
from logicpipe.tensor_codec import RawTensor
from logicpipe.v1 import stage_pb2

MAX_STOP_IDS = 1024         # stop token ids of one session
MAX_STEP_ROWS = 16384       # token rows in one step or feed message
MAX_CANDIDATES = 64         # candidate tokens per sequence per step
MAX_KEY_CHARS = 128         # a session's kv_import_key


def sampling_from_proto(p: stage_pb2.SamplingParams) -> SamplingParams:
    try:
        return SamplingParams.from_proto(p).validate()
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from exc


def assignment_from_proto(req: stage_pb2.AssignRequest, controller_address: str) -> Assignment:
    """Assign -> Assignment, its ids and addresses checked here (the rest by Assignment.check);
    `controller_address`: the request's, with the caller's host filled in."""
    for what, value in (("plan_id", req.plan_id), ("model_digest", req.model_digest),
                        ("prev_node_id", req.prev_node_id), ("last_node_id", req.last_node_id),
                        ("controller_id", req.controller_id)):
        check_id(what, value, empty_ok=True)
    for what, value in (("next_address", req.next_address), ("first_address", req.first_address),
                        ("controller_address", controller_address), ("tp_init", req.tp_init.removeprefix("tcp://"))):
        check_address(what, value, empty_ok=True)
    for node in req.tp_members:
        check_id("tp_members", node)
    return Assignment(
        model_dir=req.model_dir, start=req.start_layer, end=req.end_layer, num_layers=req.num_layers,
        stage_index=req.stage_index, num_stages=req.num_stages, next_address=req.next_address,
        first_address=req.first_address, dtype=req.dtype or "float32", plan_id=req.plan_id,
        model_digest=req.model_digest, generation=req.generation, micro_batches=req.micro_batches,
        weight_format=req.weight_format, wire_dtype=req.wire_dtype, prev_node_id=req.prev_node_id,
        last_node_id=req.last_node_id, controller_address=controller_address, tp_width=req.tp_width,
        tp_rank=req.tp_rank, tp_world=req.tp_world, tp_init=req.tp_init, tp_members=tuple(req.tp_members))


def spec_from_proto(req: stage_pb2.OpenSessionRequest, *, context: int, vocab_size: int, opener: Caller = Caller()) -> SeqSpec:
    """OpenSession -> SeqSpec, checked against the model's context and vocabulary; `opener`: who
    opened it (only it may close it)."""
    check_id("session_id", req.session_id)
    check_id("owner", req.owner, empty_ok=True)
    if not 1 <= req.capacity <= context:
        raise InvalidArgument(f"capacity {req.capacity} tokens is outside [1, {context}] (the model's context)")
    if len(req.stop_token_ids) > MAX_STOP_IDS:
        raise InvalidArgument(f"{len(req.stop_token_ids)} stop token ids, over the cap of {MAX_STOP_IDS}")
    prompt = tuple(req.prompt_token_ids)
    if len(prompt) > req.capacity:
        raise InvalidArgument(f"{len(prompt)} prompt tokens exceed the session's capacity of {req.capacity}")
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")
    if req.generated > (len(prompt) if prompt else req.capacity):
        raise InvalidArgument(f"generated {req.generated} is past the {len(prompt) if prompt else req.capacity} "
                              f"{'prompt tokens' if prompt else 'positions of capacity'} (a replay's prompt holds the "
                              "tokens generated before)")
    if req.speculate > MAX_CANDIDATES:
        raise InvalidArgument(f"speculate {req.speculate} is over the cap of {MAX_CANDIDATES} candidates per step")
    bad = next((t for t in req.sampling.logit_bias if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab_size})")
    for name in ("top_logprobs", "prompt_logprobs"):
        if getattr(req, name) > MAX_TOP_LOGPROBS:
            raise InvalidArgument(f"{name} {getattr(req, name)} is over the cap of {MAX_TOP_LOGPROBS}")
    if len(req.grammar) > MAX_GRAMMAR_CHARS:
        raise InvalidArgument(f"grammar has {len(req.grammar)} characters, over the cap of {MAX_GRAMMAR_CHARS}")
    if req.parent_session_id:
        check_id("parent_session_id", req.parent_session_id)
        if req.parent_length > len(prompt):
            raise InvalidArgument(f"parent_length {req.parent_length} is past the {len(prompt)} prompt tokens "
                                  "(a fork's prompt is its whole input from position 0)")
    if req.kv_import_length or req.kv_import_key:
        if not 1 <= req.kv_import_length < len(prompt):
            raise InvalidArgument(f"kv_import_length {req.kv_import_length} must be 1 to {max(0, len(prompt) - 1)} "
                                  f"(below the {len(prompt)} prompt tokens: the last one is computed here)")
        if not 16 <= len(req.kv_import_key) <= MAX_KEY_CHARS:
            raise InvalidArgument(f"kv_import_key must be 16 to {MAX_KEY_CHARS} characters, not {len(req.kv_import_key)}")
        check_id("kv_import_key", req.kv_import_key)
        if req.parent_session_id or req.prefill_only:
            raise InvalidArgument("kv_import_length cannot go with parent_session_id or prefill_only")
    if req.prefill_only and (req.parent_session_id or req.HasField("prompt_logprobs") or not prompt):
        raise InvalidArgument("prefill_only needs prompt_token_ids, and goes with neither parent_session_id nor "
                              "prompt_logprobs")
    return SeqSpec(session_id=req.session_id, capacity=req.capacity, sampling=sampling_from_proto(req.sampling),
                   max_new_tokens=req.max_new_tokens or 1 << 30, stop_ids=frozenset(req.stop_token_ids),
                   owner=req.owner, opener=opener, prompt=prompt, generated=req.generated, parent=req.parent_session_id,
                   parent_length=req.parent_length, index=req.sequence, priority=req.priority,
                   prefill_rank=req.prefill_rank, speculate=req.speculate, prefill_chunk=req.prefill_chunk,
                   top_logprobs=req.top_logprobs if req.HasField("top_logprobs") else None,
                   prompt_logprobs=req.prompt_logprobs if req.HasField("prompt_logprobs") else None,
                   grammar=req.grammar, prefill_only=req.prefill_only, import_length=req.kv_import_length,
                   import_key=req.kv_import_key)


def works_from_proto(batch: stage_pb2.StepBatch, *, vocab_size: int) -> list[SeqWork]:
    """The sequences of a step or feed message, checked for shape (not against any state)."""
    if not batch.seqs:
        raise InvalidArgument("step has no sequences")
    rows = sum(s.num_tokens for s in batch.seqs)
    if rows > MAX_STEP_ROWS:
        raise InvalidArgument(f"step of {rows} token rows is over the {MAX_STEP_ROWS}-row cap; send smaller chunks")
    seen: set[str] = set()
    works = []
    for s in batch.seqs:
        check_id("session_id", s.session_id)
        if s.session_id in seen:
            raise InvalidArgument(f"session {s.session_id} appears twice in one step; send its next slice "
                                  "in a later step")
        seen.add(s.session_id)
        if s.num_tokens < 1:
            raise InvalidArgument(f"session {s.session_id}: num_tokens must be >= 1")
        if len(s.token_ids) != s.num_tokens:
            raise InvalidArgument(f"session {s.session_id}: {len(s.token_ids)} token ids for num_tokens={s.num_tokens}")
        bad = next((t for t in s.token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidArgument(f"session {s.session_id}: token id {bad} outside the vocabulary [0, {vocab_size})")
        if s.num_candidates > min(MAX_CANDIDATES, s.num_tokens - 1):
            raise InvalidArgument(f"session {s.session_id}: {s.num_candidates} candidates in {s.num_tokens} tokens "
                                  f"(at most {MAX_CANDIDATES}, and one token before them)")
        works.append(SeqWork(s.session_id, s.start_pos, tuple(s.token_ids), sample=not s.prefill_only,
                             num_candidates=s.num_candidates, finished=s.finished))
    return works


def step_from_proto(batch: stage_pb2.StepBatch, *, vocab_size: int, hidden_size: int, stage_index: int) -> StepMsg:
    """A computed step from the previous stage: its sequences and hidden states [rows, hidden_size]."""
    works = works_from_proto(batch, vocab_size=vocab_size)
    rows = sum(w.num_tokens for w in works)
    if not batch.HasField("hidden"):
        raise InvalidArgument(f"stage {stage_index} needs hidden states, the step has none")
    try:
        hidden = tensor_codec.check(batch.hidden, rank=2, dtypes=FLOAT_DTYPES)
    except tensor_codec.TensorError as exc:
        raise InvalidArgument(f"hidden states: {exc}") from exc
    if hidden.shape != (rows, hidden_size):
        raise InvalidArgument(f"hidden states of shape {list(hidden.shape)}, expected [{rows}, {hidden_size}]")
    return StepMsg(tuple(works), hidden)


def seq_step(w: SeqWork) -> stage_pb2.SeqStep:
    return stage_pb2.SeqStep(session_id=w.session_id, start_pos=w.start_pos, num_tokens=w.num_tokens,
                             token_ids=w.token_ids, prefill_only=not w.sample, num_candidates=w.num_candidates,
                             finished=w.finished)


def step_batch(works: list[SeqWork], generation: int, hidden: RawTensor | None = None) -> stage_pb2.StepBatch:
    msg = stage_pb2.StepBatch(seqs=[seq_step(w) for w in works], generation=generation)
    if hidden is not None:
        msg.hidden.CopyFrom(tensor_codec.raw_to_proto(hidden))
    return msg


def event_to_proto(ev: Event) -> stage_pb2.Event:
    if isinstance(ev, TokenEvent):
        return stage_pb2.Event(session_id=ev.session_id, token=stage_pb2.TokenEvent(
            token_ids=ev.token_ids, index=ev.index, finished=bool(ev.finish_reason), finish_reason=ev.finish_reason,
            candidates=ev.candidates, logprobs=[lp.to_proto() for lp in ev.logprobs],
            prompt_logprobs=[lp.to_proto() for lp in ev.prompt_logprobs]))
    return stage_pb2.Event(session_id=ev.session_id, error=stage_pb2.SessionError(
        code=code_number(ev.error.code), message=str(ev.error), node_id=ev.node_id))


def stream_reply(session_id: str, err: MeshError) -> stage_pb2.StreamReply:
    return stage_pb2.StreamReply(session_id=session_id, code=code_number(err.code), message=str(err))


def profile_to_proto(profile) -> stage_pb2.DeviceProfile:
    if profile is None:
        return stage_pb2.DeviceProfile()
    return stage_pb2.DeviceProfile(
        device_kind=profile.device_kind, device_name=profile.device_name, memory_bytes=profile.memory_bytes,
        flops=profile.flops, mem_bandwidth=profile.mem_bandwidth, weight_formats=list(profile.weight_formats),
        compute_format=profile.compute_format, weight_bandwidth=profile.weight_bandwidth,
        weight_bytes_per_param=profile.weight_bytes_per_param, format_flops=dict(profile.format_flops),
        devices=profile.devices, allreduce_latency_s=profile.allreduce_latency_s,
        allreduce_bandwidth=profile.allreduce_bandwidth, kv_format=profile.kv_format,
        full_sliding_kv=profile.full_sliding_kv, max_devices=profile.max_devices)


def status_reply(snap: StageSnapshot, *, profile, compute_id: str, version: str) -> stage_pb2.StatusReply:
    st = snap.stats
    reply = stage_pb2.StatusReply(
        node_id=snap.node_id, state=snap.state, device=snap.device, steps=st.steps, tokens=st.rows,
        seq_rows=st.seq_rows, max_step_seqs=st.max_step_seqs, uptime_s=snap.uptime_s,
        profile=profile_to_proto(profile), version=version, sessions_expired=st.sessions_expired,
        session_ttl_s=snap.session_ttl_s, block_size=snap.block_size, compute_id=compute_id, compute_s=st.compute_s,
        stopping=snap.stopping, weights_pulled_bytes=st.weights_pulled_bytes, sampled_steps=st.sampled_steps,
        sampled_tokens=st.sampled_tokens, candidates_verified=st.candidates_verified,
        candidates_accepted=st.candidates_accepted, drafter=snap.drafter, swapped_out_seqs=st.swapped_out_seqs,
        swapped_out_blocks=st.swapped_out_blocks, swapped_out_bytes=st.swapped_out_bytes,
        swapped_in_seqs=st.swapped_in_seqs, swapped_in_blocks=st.swapped_in_blocks,
        swapped_in_bytes=st.swapped_in_bytes, swapped_in_tokens=st.swapped_in_tokens, swap_full=st.swap_full,
        max_step_s=st.max_step_s, decode_steps=st.decode_steps, max_decode_step_s=st.max_decode_step_s,
        decode_steps_over_bar=st.decode_steps_over_bar, step_bar_s=snap.step_bar_s, tp_port=snap.tp_port,
        tp_leader=snap.tp_leader, mirrored_out_blocks=st.mirrored_out_blocks,
        mirrored_in_blocks=st.mirrored_in_blocks, mirror_errors=st.mirror_errors,
        kv_disk_written_blocks=st.kv_disk_written_blocks, kv_disk_restored_blocks=st.kv_disk_restored_blocks,
        kv_disk_errors=st.kv_disk_errors)
    e = snap.engine
    if e is not None:
        reply.model_dir, reply.model_digest, reply.plan_id = e.model_dir, e.model_digest, e.plan_id
        reply.start_layer, reply.end_layer, reply.num_layers = e.start, e.end, e.num_layers
        reply.stage_index, reply.num_stages, reply.generation = e.stage_index, e.num_stages, e.generation
        reply.parameter_count, reply.tied_copy_count = e.parameter_count, e.tied_copy_count
        reply.dtype, reply.weight_format, reply.weight_bytes = e.dtype, e.weight_format, e.weight_bytes
        reply.open_sessions, reply.orphaned_sessions = e.open_sessions, e.orphaned_sessions
        reply.block_size, reply.kv_blocks_total = e.block_size, e.kv_blocks_total
        reply.kv_blocks_used, reply.kv_blocks_cached, reply.kv_bytes = e.kv_blocks_used, e.kv_blocks_cached, e.kv_bytes
        reply.prefix_hit_tokens, reply.preempted = e.prefix_hit_tokens, e.preempted
        reply.micro_batches = e.micro_batches
        reply.swap_bytes_total, reply.swap_bytes_used = e.swap_bytes_total, e.swap_bytes_used
    return reply


def kv_chunk(session_id: str, import_key: str, layer: int, start_pos: int, kv: RawTensor) -> stage_pb2.KvChunk:
    return stage_pb2.KvChunk(session_id=session_id, import_key=import_key, layer=layer, start_pos=start_pos,
                             kv=tensor_codec.raw_to_proto(kv))


def kv_chunk_from_proto(msg: stage_pb2.KvChunk) -> KvRows:
    """An ImportKv chunk, checked for shape (not against any state): [parts, heads, positions, dim]."""
    check_id("session_id", msg.session_id)
    if len(msg.import_key) > MAX_KEY_CHARS:
        raise InvalidArgument(f"import_key is {len(msg.import_key)} characters, over the {MAX_KEY_CHARS} cap")
    try:
        kv = tensor_codec.check(msg.kv, rank=4, dtypes=FLOAT_DTYPES)
    except tensor_codec.TensorError as exc:
        raise InvalidArgument(f"kv: {exc}") from exc
    if not 1 <= kv.shape[0] <= 2 or kv.shape[2] < 1:
        raise InvalidArgument(f"kv of shape {list(kv.shape)}: expected [parts (1 or 2), kv_heads, positions >= 1, "
                              "head_dim]")
    return KvRows(msg.session_id, msg.import_key, msg.layer, msg.start_pos, kv)
