"""The one cost model every strategy is judged by.

Notation: a workload runs T = tokens_per_step tokens per forward pass over B = batch sequences,
each holding C = context_tokens of KV. A device has F FLOP/s, W bytes/s of memory bandwidth and
Ww bytes/s of weight reading in its own format (`weight_bandwidth`, W when not measured). It holds
the layers' matrices at a weight scale sw and everything in floats (embeddings, head, KV,
activations) at a float scale sf, both relative to the model's format (see `model.py`: 2 for an
fp32 upcast of a 16-bit model, 0.25 for int8 matrices of an fp32 model, ...).

Compute (seconds per step). Every layer is memory- or compute-bound, whichever is slower:

    layer_s = max( T * (layer_flops_per_token + C * attention_flops_per_context_token) / F,
                   sw * layer_read_bytes(T) / Ww  +  sf * B * C * kv_bytes_per_token_per_layer / W )

    (layer_read_bytes(T) is layer_weight_bytes for a dense model; for a mixture of experts, the
    dense part and the experts T rows are expected to route to: see `model.py`.)

    stage compute_s = n_layers * layer_s  (+ embed_s on the first stage)  (+ head_s on the last)
    embed_s = sf * T * activation_bytes_per_token / W        (T embedding rows read)
    head_s  = max( T * lm_head_flops_per_token / F,  sf * lm_head_bytes / W )

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

    stage memory_bytes = n_layers * (ceil(sw * layer_weight_bytes) + ceil(sf * B * C * kv_bytes_per_token_per_layer))
                         + ceil(sf * (embedding_bytes [first] + lm_head_bytes [last]))
    and it must be <= Reserve.usable_bytes(profile.memory_bytes).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from logicpipe.planner.model import ModelSpec, device_weight_format, float_scale, weight_scale, wire_scale
from logicpipe.planner.plan import Stage
from logicpipe.planner.types import DeviceProfile, InfeasibleError, Objective, Reserve, Workload
from logicpipe.planner.units import format_bytes

TOKEN_ID_BYTES = 8
"""Bytes per token id the last stage sends back to stage 0 (an int64)."""


def layer_time_s(profile: DeviceProfile, model: ModelSpec, workload: Workload) -> float:
    """Seconds one decoder layer takes on `profile` for one step of `workload`."""
    t, c = workload.tokens_per_step, workload.context_tokens
    flops = t * (model.layer_flops_per_token + c * model.attention_flops_per_context_token)
    read_s = (weight_scale(profile, model) * model.layer_read_bytes(t) / (profile.weight_bandwidth or profile.mem_bandwidth)
              + float_scale(profile, model) * workload.batch * c * model.kv_bytes_per_token_per_layer / profile.mem_bandwidth)
    return max(flops / profile.flops, read_s)


def embed_time_s(profile: DeviceProfile, model: ModelSpec, workload: Workload) -> float:
    """Seconds the embedding lookup takes on the first stage (reading T rows)."""
    return float_scale(profile, model) * workload.tokens_per_step * model.activation_bytes_per_token / profile.mem_bandwidth


def head_time_s(profile: DeviceProfile, model: ModelSpec, workload: Workload) -> float:
    """Seconds the final norm + LM head take on the last stage."""
    flops = workload.tokens_per_step * model.lm_head_flops_per_token
    return max(flops / profile.flops, float_scale(profile, model) * model.lm_head_bytes / profile.mem_bandwidth)


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
    """Bytes one layer takes on `profile`: weights + KV for B sequences of C tokens."""
    kv = workload.batch * workload.context_tokens * model.kv_bytes_per_token_per_layer
    return math.ceil(weight_scale(profile, model) * model.layer_weight_bytes) + math.ceil(float_scale(profile, model) * kv)


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
                       is_first: bool, is_last: bool) -> int:
    """Bytes a stage of `num_layers` layers holds on `profile` (without the reserve)."""
    return num_layers * layer_memory_bytes(profile, model, workload) + edge_memory_bytes(
        profile, model, is_first=is_first, is_last=is_last)


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
            memory_bytes=stage_memory_bytes(profile, model, workload, count, is_first=is_first, is_last=is_last),
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
