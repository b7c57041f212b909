"""Pipelined prefill: the chunk size that gets a long prompt through the pipeline soonest.

A prompt of n tokens cut into chunks of c flows through S stages back to back: stage i works on
chunk j while stage i+1 works on chunk j-1. With t_i(c) the time stage i takes for one chunk (its
compute and transfer from the cost model, plus a fixed per-step overhead the roofline does not
see), the last chunk leaves the last stage after about

    ttft(c) = sum_i t_i(c) + (ceil(n / c) - 2) * max_i t_i(c) + max_i t_i(last chunk)

the fill of the pipeline, then one chunk per bottleneck step. Small chunks fill the pipeline
sooner but pay each step's fixed costs (reading the weights, the overhead) more often; one big
chunk pays them once but leaves every stage but one idle. `best_chunk` tries the multiples of the
KV block size and keeps the fastest.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from logicpipe.planner.cost import build_stages
from logicpipe.planner.model import ModelSpec
from logicpipe.planner.types import DeviceProfile, Workload

STEP_OVERHEAD_S = 0.015
"""Seconds one step costs a stage beyond its roofline compute and transfer: scheduling, packing
the batch, serializing the activations, the hop, and the matrix products of a few rows running
below the profiled FLOP/s. Calibrated on the 3-stage CPU mesh: a sweep of chunk sizes for a
1,500-token prompt (16 to 4,096 tokens) was fastest at 128 to 256, which this value reproduces;
the 3 ms of the hop and scheduling alone would pick 48-token chunks, measured 20% slower."""


def chunk_times_s(profiles: Sequence[DeviceProfile], layer_counts: Sequence[int], model: ModelSpec,
                  chunk: int, context: int) -> list[float]:
    """Seconds each stage takes for one prefill chunk of `chunk` tokens."""
    work = Workload(tokens_per_step=chunk, context_tokens=max(1, context), batch=1)
    return [s.compute_s + s.transfer_s + STEP_OVERHEAD_S for s in build_stages(profiles, layer_counts, model, work)]


def prefill_time_s(times: Sequence[float], last_times: Sequence[float], prompt_tokens: int, chunk: int) -> float:
    """The time to first token of a prompt cut into chunks whose stage times are `times` (the last,
    shorter chunk's: `last_times`): the first chunk fills the pipeline, each later one leaves it a
    bottleneck step after the one before."""
    chunks = math.ceil(prompt_tokens / chunk)
    if chunks == 1:
        return sum(times)
    return sum(times) + (chunks - 2) * max(times) + max(last_times)


def best_chunk(profiles: Sequence[DeviceProfile], layer_counts: Sequence[int], model: ModelSpec,
               prompt_tokens: int, *, granule: int = 16, max_chunk: int = 512) -> int:
    """The chunk size (a multiple of `granule`, at most `max_chunk`; the whole prompt when it is
    shorter) that the cost model says gives the first token soonest."""
    if prompt_tokens <= granule:
        return max(1, prompt_tokens)
    top = min(prompt_tokens, max_chunk)
    best, best_s = top, math.inf
    for c in list(range(granule, top, granule)) + [top]:
        context = prompt_tokens // 2  # attention reads half the prompt on average
        last = prompt_tokens - (math.ceil(prompt_tokens / c) - 1) * c
        t = prefill_time_s(chunk_times_s(profiles, layer_counts, model, c, context),
                           chunk_times_s(profiles, layer_counts, model, last, context), prompt_tokens, c)
        if t < best_s * (1 - 1e-9):
            best, best_s = c, t
    return best
