"""The one cost model every strategy is judged by.

Notation: a workload runs T = tokens_per_step tokens per forward pass over B = batch sequences,
each holding C = context_tokens of KV. A device has F FLOP/s, W bytes/s of memory bandwidth and
Ww bytes/s of weight reading in its own format (`weight_bandwidth`, W when not measured). It holds
the layers' matrices at a weight scale sw and everything in floats (embeddings, head, KV,
activations) at a float scale sf, both relative to the model's format (see `model.py`: 2 for an
fp32 upcast of a 16-bit model, 0.25 for int8 matrices of an fp32 model, ...). Its KV is held at a
KV scale sk: sf, or for a node with 8-bit KV (`kv_format`, --kv-dtype) a byte an element plus a
float32 scale a (token, KV head) vector (`model.kv_scale`: 0.27 of an fp32 model's at head dim 64).

Compute (seconds per step). Every layer is memory- or compute-bound, whichever is slower:

    layer_s = max( T * (layer_flops_per_token + C * attention_flops_per_context_token) / F,
                   sw * layer_read_bytes(T) / Ww  +  sk * B * C * kv_bytes_per_token_per_layer / W )

    (layer_read_bytes(T) is layer_weight_bytes for a dense model; for a mixture of experts, the
    dense part and the experts T rows are expected to route to: see `model.py`.)
    A tensor-parallel node (`devices` > 1: its F, W, Ww are those of all its devices) adds its two
    all-reduces a layer, at its measured latency La and bandwidth Ba:
    layer_s += 2 * (La + sf * T * activation_bytes_per_token / Ba)

    stage compute_s = n_layers * layer_s  (+ embed_s on the first stage)  (+ head_s on the last)
    embed_s = sf * T * activation_bytes_per_token / W        (T embedding rows read)
    head_s  = max( T * lm_head_flops_per_token / F,  sf * lm_head_bytes / Wh )
    (Wh: the weight rate Ww on a node that holds its layers in a float format, else W)

Transfer (seconds per step), over the sender's measured link to the receiver:

    stage i -> i+1:  min(sf_i, sf_i+1) * T * activation_bytes_per_token / bandwidth + latency
                     (hidden states travel in the narrower of the two float formats)
    last -> stage 0: T * TOKEN_ID_BYTES / bandwidth + latency   (the sampled tokens go back;
                     a single-stage pipeline uses LOOPBACK and pays nothing)

A stage's time is compute_s + transfer_s. The THROUGHPUT objective minimizes the bottleneck,
max over stages; with several micro-batches in flight every stage is busy and a step leaves the
pipeline every bottleneck seconds. The LATENCY objective minimizes the sum over stages: one
token's trip around the ring.

Memory (bytes). A stage holds its layers' weights and the KV for the workload, plus the embedding
on the first stage and the final norm + LM head on the last (a single stage with tied embeddings
holds the shared matrix once):

    stage memory_bytes = n_layers * (ceil(sw * layer_weight_bytes) + ceil(sk * B * C * kv_bytes_per_token_per_layer))
                         + ceil(sf * (embedding_bytes [first] + lm_head_bytes [last]))
    and it must be <= Reserve.usable_bytes(profile.memory_bytes).

    Where layers differ in what a sequence keeps (`ModelSpec.layer_kinds`, issue 37: sliding-window
    layers min(C, window) tokens of KV, or C on a node whose windows keep every position, its profile's
    `full_sliding_kv`; linear-attention layers a fixed state), C * kv is the average
    layer's share (`mean_kv_bytes_per_layer`) in the per-layer terms above (the KV a step reads, the
    DP's layers per device), and a stage's memory_bytes is its own range's (`range_memory_bytes`,
    from prefix counts of each kind).

Decode rounds (the step cost model of replicas and micro-batches, `make_mesh_plan`). A pipeline of
S stages serves R concurrent sequences at context C in m micro-batches (1 <= m <= min(S, R)) of
r = ceil(R / m) rows each. One step of one micro-batch on stage i takes

    t_i(r) = compute_s + transfer_s of the stage at Workload(tokens_per_step=r, context_tokens=C, batch=r)
             + o_i                                                    [s]
    (per layer max(r * flops / F, sw * weight bytes / Ww + sf * r * C * kv / W): the stage's
     weights are read ONCE PER MICRO-BATCH STEP, the KV of the micro-batch's rows once; embedding
     on the first stage, LM head + sampling on the last, the hop to the next stage; o_i is the
     device's `step_overhead_s`, host time per step, DEFAULT_STEP_OVERHEAD_S when not measured)

A round moves every micro-batch through every stage once; stage i is busy m * t_i(r) of it, and
one micro-batch needs the whole ring sum_i t_i(r), so

    round_s(m) = max(m * max_i t_i(r), sum_i t_i(r))                  [s]
    tokens_per_s(m) = R / round_s(m)                                  [tokens/s: one per sequence a round]

and the planner runs the m with the most tokens/s (`best_micro_batches`). With S stages and S
micro-batches every weight is read S times a round: for memory-bound decode a pipeline of S equal
devices is never faster than one of them alone holding the model (it buys memory; only the KV
reads and the FLOPs are split), while R sequences split over replicas divide the rows.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from logicpipe.planner.model import (
    FLOAT_FORMATS,
    ModelSpec,
    device_weight_format,
    float_scale,
    kv_scale,
    weight_scale,
    wire_scale,
)
from logicpipe.planner.plan import Stage
from logicpipe.planner.types import DeviceProfile, InfeasibleError, Objective, Reserve, Workload
from logicpipe.planner.units import format_bytes

TOKEN_ID_BYTES = 8
"""Bytes per token id the last stage sends back to stage 0 (an int64)."""

DEFAULT_STEP_OVERHEAD_S = 1e-3
"""s of host time a decode step costs a stage beyond its roofline (scheduling, launches) when the
node did not measure its own `step_overhead_s`: an assumption, not a measurement."""


def layer_time_s(profile: DeviceProfile, model: ModelSpec, workload: Workload) -> float:
    """Seconds one decoder layer takes on `profile` for one step of `workload`."""
    t, c = workload.tokens_per_step, workload.context_tokens
    flops = t * (model.layer_flops_per_token + c * model.attention_flops_per_context_token)
    read_s = (weight_scale(profile, model) * model.layer_read_bytes(t) / (profile.weight_bandwidth or profile.mem_bandwidth)
              + _held_kv(profile, model, workload.batch * model.mean_kv_bytes_per_layer(c),
                         lambda ks, fs: workload.batch * model.mean_kv_bytes_per_layer(c, kv_scale=ks, state_scale=fs))
              / profile.mem_bandwidth)
    return max(flops / profile.flops, read_s) + allreduce_time_s(profile, model, workload)


def allreduce_time_s(profile: DeviceProfile, model: ModelSpec, workload: Workload) -> float:
    """Seconds a layer of a tensor-parallel stage spends in its two all-reduces (after attention and
    after the MLP, each of the step's rows of hidden states), at the node's measured latency and
    bandwidth (issue 36); 0 on one device or where not measured."""
    if profile.devices <= 1 or not profile.allreduce_bandwidth:
        return 0.0
    rows = workload.tokens_per_step * model.activation_bytes_per_token * float_scale(profile, model)
    return 2 * (profile.allreduce_latency_s + rows / profile.allreduce_bandwidth)


def embed_time_s(profile: DeviceProfile, model: ModelSpec, workload: Workload) -> float:
    """Seconds the embedding lookup takes on the first stage (reading T rows)."""
    return float_scale(profile, model) * workload.tokens_per_step * model.activation_bytes_per_token / profile.mem_bandwidth


def head_time_s(profile: DeviceProfile, model: ModelSpec, workload: Workload) -> float:
    """Seconds the final norm + LM head take on the last stage: a product like a layer's, read at
    the node's weight rate when it holds its layers in a float format (measured on a CPU stage: the
    head runs at that rate, not at the copy rate), else at the copy rate."""
    flops = workload.tokens_per_step * model.lm_head_flops_per_token
    fmt = device_weight_format(profile, model)
    rate = profile.weight_bandwidth if profile.weight_bandwidth and fmt in FLOAT_FORMATS else profile.mem_bandwidth
    return max(flops / profile.flops, float_scale(profile, model) * model.lm_head_bytes / rate)


def compose_compute_s(num_layers: int, layer_s: float, embed_s: float, head_s: float, *, is_first: bool, is_last: bool) -> float:
    """A stage's compute time from its parts. Every caller (strategies, DP tables, brute force)
    goes through this one expression so equal plans get bit-equal costs."""
    total = num_layers * layer_s
    if is_first:
        total += embed_s
    if is_last:
        total += head_s
    return total


def stage_compute_s(profile: DeviceProfile, model: ModelSpec, workload: Workload, num_layers: int, *,
                    is_first: bool, is_last: bool) -> float:
    """Seconds per step of a stage of `num_layers` layers on `profile`."""
    return compose_compute_s(num_layers, layer_time_s(profile, model, workload), embed_time_s(profile, model, workload),
                             head_time_s(profile, model, workload), is_first=is_first, is_last=is_last)


def layer_memory_bytes(profile: DeviceProfile, model: ModelSpec, workload: Workload) -> int:
    """Bytes the average layer takes on `profile`: weights + what B sequences of C tokens keep in it
    (full layers C tokens of KV, sliding layers their window, or C where the node's windows keep every
    position: `full_sliding_kv`; linear layers a state: ModelSpec.kv_bytes_per_sequence)."""
    c, whole = workload.context_tokens, profile.full_sliding_kv
    kv = _held_kv(profile, model, workload.batch * model.mean_kv_bytes_per_layer(c, whole=whole),
                  lambda ks, fs: workload.batch * model.mean_kv_bytes_per_layer(c, kv_scale=ks, state_scale=fs,
                                                                                whole=whole))
    return math.ceil(weight_scale(profile, model) * model.layer_weight_bytes) + math.ceil(kv)


def range_memory_bytes(profile: DeviceProfile, model: ModelSpec, workload: Workload, start: int, end: int) -> int:
    """Bytes layers [start, end) take on `profile`: their weights and what B sequences of C tokens keep
    in each of them by its kind (a stage of Gemma 3's full layers keeps more than one of its sliding ones;
    a node whose windows keep every position, `full_sliding_kv`, as much in both)."""
    c, whole = workload.context_tokens, profile.full_sliding_kv
    kv = _held_kv(profile, model, workload.batch * model.kv_bytes_per_sequence(c, start, end, whole=whole),
                  lambda ks, fs: workload.batch * model.kv_bytes_per_sequence(c, start, end, kv_scale=ks, state_scale=fs,
                                                                              whole=whole))
    return (end - start) * math.ceil(weight_scale(profile, model) * model.layer_weight_bytes) + math.ceil(kv)


def _held_kv(profile: DeviceProfile, model: ModelSpec, in_model_format: float, scaled) -> float:
    """Bytes of KV (and recurrent states) on `profile`: `in_model_format` x float_scale where its KV is in
    its compute format (the expression as before 8-bit KV, to the bit), else `scaled(kv_scale, float_scale)`
    (8-bit KV; the states stay in floats)."""
    if profile.kv_format == "":
        return float_scale(profile, model) * in_model_format
    return scaled(kv_scale(profile, model), float_scale(profile, model))


def edge_memory_bytes(profile: DeviceProfile, model: ModelSpec, *, is_first: bool, is_last: bool) -> int:
    """Bytes of embedding (first stage) and final norm + LM head (last stage) on `profile`."""
    total = 0
    if is_first:
        total += model.embedding_bytes
    if is_last:
        total += model.lm_head_bytes
    if is_first and is_last and model.tied_embeddings:
        total -= model.embedding_bytes  # one process: the head reuses the embedding matrix
    return math.ceil(float_scale(profile, model) * total)


def stage_memory_bytes(profile: DeviceProfile, model: ModelSpec, workload: Workload, num_layers: int, *,
                       is_first: bool, is_last: bool, start: int | None = None) -> int:
    """Bytes a stage of `num_layers` layers holds on `profile` (without the reserve); with `start`, of
    layers [start, start + num_layers) exactly (`range_memory_bytes`), else of as many average layers."""
    layers = num_layers * layer_memory_bytes(profile, model, workload) if start is None or not model.layer_kinds else \
        range_memory_bytes(profile, model, workload, start, start + num_layers)
    return layers + edge_memory_bytes(profile, model, is_first=is_first, is_last=is_last)


def max_layers(profile: DeviceProfile, model: ModelSpec, workload: Workload, reserve: Reserve, *,
               is_first: bool, is_last: bool) -> int:
    """Most layers a stage on `profile` can hold (0..num_layers); 0 when the device cannot run the
    model's weight format or cannot hold even one layer."""
    if device_weight_format(profile, model) is None:
        return 0
    room = reserve.usable_bytes(profile.memory_bytes) - edge_memory_bytes(profile, model, is_first=is_first, is_last=is_last)
    if room < 0:
        return 0
    per_layer = layer_memory_bytes(profile, model, workload)
    if per_layer == 0:
        return model.num_layers
    return min(model.num_layers, room // per_layer)


def activation_transfer_s(src: DeviceProfile, dst: DeviceProfile, model: ModelSpec, workload: Workload) -> float:
    """Seconds to send one step's hidden states from stage `src` to the next stage `dst`."""
    link = src.link_to(dst.node_id)
    wire = wire_scale(src, dst, model) if src.node_id != dst.node_id else 1.0
    return wire * workload.tokens_per_step * model.activation_bytes_per_token / link.bandwidth + link.latency


def return_transfer_s(last: DeviceProfile, first: DeviceProfile, workload: Workload) -> float:
    """Seconds for the last stage to send one step's sampled token ids back to stage 0."""
    link = last.link_to(first.node_id)
    return workload.tokens_per_step * TOKEN_ID_BYTES / link.bandwidth + link.latency


def build_stages(profiles: Sequence[DeviceProfile], layer_counts: Sequence[int], model: ModelSpec,
                 workload: Workload) -> tuple[Stage, ...]:
    """Stages for `profiles` in pipeline order taking `layer_counts` consecutive layers each.
    ValueError unless the counts are >= 1 and add up to the model's layers. Memory is not checked
    here (see `check_memory`)."""
    if len(profiles) != len(layer_counts) or not profiles:
        raise ValueError(f"need one layer count per device: {len(profiles)} devices, {len(layer_counts)} counts")
    if any(k < 1 for k in layer_counts) or sum(layer_counts) != model.num_layers:
        raise ValueError(f"layer counts {list(layer_counts)} must be >= 1 each and add up to {model.num_layers}")
    last = len(profiles) - 1
    stages = []
    start = 0
    for i, (profile, count) in enumerate(zip(profiles, layer_counts)):
        is_first, is_last = i == 0, i == last
        transfer = (return_transfer_s(profile, profiles[0], workload) if is_last
                    else activation_transfer_s(profile, profiles[i + 1], model, workload))
        stages.append(Stage(
            node_id=profile.node_id,
            device_kind=profile.device_kind,
            weight_format=device_weight_format(profile, model) or model.weight_format,
            start=start,
            end=start + count,
            compute_s=stage_compute_s(profile, model, workload, count, is_first=is_first, is_last=is_last),
            transfer_s=transfer,
            memory_bytes=stage_memory_bytes(profile, model, workload, count, is_first=is_first, is_last=is_last,
                                            start=start),
            devices=profile.devices,
            members=profile.members,
        ))
        start += count
    return tuple(stages)


def plan_cost_s(stages: Sequence[Stage], objective: Objective) -> float:
    """The objective's value: max (THROUGHPUT) or sum (LATENCY) of the stages' compute + transfer."""
    times = [s.compute_s + s.transfer_s for s in stages]
    return max(times) if objective is Objective.THROUGHPUT else sum(times)


def memory_overflow_bytes(stage: Stage, profile: DeviceProfile, reserve: Reserve) -> int:
    """Bytes by which `stage` exceeds its node's usable memory (<= 0 when it fits)."""
    return stage.memory_bytes - reserve.usable_bytes(profile.memory_bytes)


def check_memory(stages: Sequence[Stage], profiles: Mapping[str, DeviceProfile], model: ModelSpec,
                 reserve: Reserve) -> None:
    """InfeasibleError naming the first stage that cannot run: a weight format the node lacks,
    or more memory than it has (with the overflow)."""
    for index, stage in enumerate(stages):
        profile = profiles[stage.node_id]
        if device_weight_format(profile, model) is None:
            raise InfeasibleError(
                f"stage {index} (node {stage.node_id}) cannot run weight format {model.weight_format} "
                f"(it offers {', '.join(profile.weight_formats)})")
        over = memory_overflow_bytes(stage, profile, reserve)
        if over > 0:
            usable = reserve.usable_bytes(profile.memory_bytes)
            raise InfeasibleError(
                f"stage {index} (node {stage.node_id}, layers {stage.start}-{stage.end - 1}) needs "
                f"{format_bytes(stage.memory_bytes)} but the node has {format_bytes(usable)} usable "
                f"after the reserve: {format_bytes(over)} over")


# ------------------------------------------------------------ decode rounds (micro-batches) ----

def step_overhead_s(profile: DeviceProfile) -> float:
    """s of host time one step costs `profile` beyond compute and transfer."""
    return profile.step_overhead_s or DEFAULT_STEP_OVERHEAD_S


def micro_batch_rows(rows: int, micro_batches: int) -> int:
    """Rows of one micro-batch when `rows` sequences are split into `micro_batches`: ceil(R / m)."""
    return -(-rows // micro_batches)


def micro_workload(rows_per_micro_batch: int, context_tokens: int) -> Workload:
    """The workload one decode step of one micro-batch is costed at (one token per row)."""
    return Workload(tokens_per_step=rows_per_micro_batch, context_tokens=context_tokens, batch=rows_per_micro_batch)


def compose_step_s(stage_total_s: float, overhead_s: float) -> float:
    """t_i: a stage's step time from its compute + transfer and its overhead (one expression for
    every caller, so equal pipelines get bit-equal predictions)."""
    return stage_total_s + overhead_s


def compose_round_s(step_times_s: Sequence[float], micro_batches: int) -> float:
    """round_s = max(m * max_i t_i, sum_i t_i): the busiest stage or the ring, whichever is longer."""
    return max(micro_batches * max(step_times_s), sum(step_times_s))


def step_times_s(profiles: Sequence[DeviceProfile], layer_counts: Sequence[int], model: ModelSpec,
                 rows_per_micro_batch: int, context_tokens: int) -> list[float]:
    """t_i(r) for the pipeline `profiles` (in order) holding `layer_counts` layers each, one
    micro-batch of `rows_per_micro_batch` rows at `context_tokens` context, overhead included."""
    stages = build_stages(profiles, layer_counts, model, micro_workload(rows_per_micro_batch, context_tokens))
    return [compose_step_s(s.total_s, step_overhead_s(p)) for s, p in zip(stages, profiles)]


def _check_rows(rows: int, micro_batches: int, stages: int) -> None:
    if not 1 <= micro_batches <= stages:
        raise ValueError(f"micro_batches must lie in [1, {stages}] (the stages), got {micro_batches!r}")
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows!r}")


def pipeline_round_s(profiles: Sequence[DeviceProfile], layer_counts: Sequence[int], model: ModelSpec,
                     rows: int, context_tokens: int, micro_batches: int) -> float:
    """s for every one of `rows` sequences to get one token, in `micro_batches` micro-batches."""
    _check_rows(rows, micro_batches, len(profiles))
    r = micro_batch_rows(rows, micro_batches)
    return compose_round_s(step_times_s(profiles, layer_counts, model, r, context_tokens), micro_batches)


def pipeline_tokens_per_s(profiles: Sequence[DeviceProfile], layer_counts: Sequence[int], model: ModelSpec,
                          rows: int, context_tokens: int, micro_batches: int) -> float:
    """Predicted decode tokens/s of the pipeline: rows / round_s."""
    return rows / pipeline_round_s(profiles, layer_counts, model, rows, context_tokens, micro_batches)


def best_micro_batches(profiles: Sequence[DeviceProfile], layer_counts: Sequence[int], model: ModelSpec,
                       rows: int, context_tokens: int) -> tuple[int, float]:
    """(m, tokens/s) for the m in 1..min(stages, rows) with the most tokens/s (ties: fewer
    micro-batches); (1, 0.0) for rows = 0."""
    if rows < 1:
        return 1, 0.0
    best_m, best = 1, -1.0
    for m in range(1, min(len(profiles), rows) + 1):
        rate = pipeline_tokens_per_s(profiles, layer_counts, model, rows, context_tokens, m)
        if rate > best:
            best_m, best = m, rate
    return best_m, best
