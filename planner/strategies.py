"""The five fixed partition strategies of the seed library (uniform, memory, compute, mixed,
custom), as alternatives to the DP. Each keeps every given device, in the given order, and only
chooses how many consecutive layers each takes; the result is costed by the same model
(`cost.py`) and checked against memory by the caller.

Proportional strategies give device i the share w_i / sum(w) of the layers, rounded by the largest
remainder method with at least one layer per device:
- uniform: w_i = 1.
- memory:  w_i = layers device i's usable memory holds (usable bytes / bytes per layer on it).
- compute: w_i = 1 / layer_s(i), layers per second under the cost model.
- mixed:   w_i = mix * memory share + (1 - mix) * compute share (shares normalized to sum 1;
           mix = 0.5 by default: memory and speed count alike).
- custom:  explicit (first, last) inclusive layer pairs, one per device, contiguous from 0.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from logicpipe.planner.cost import layer_memory_bytes, layer_time_s
from logicpipe.planner.model import ModelSpec, device_weight_format
from logicpipe.planner.types import DeviceProfile, InfeasibleError, Reserve, Workload

FIXED_STRATEGIES = ("uniform", "memory", "compute", "mixed", "custom")


def apportion(weights: Sequence[float], total: int) -> list[int]:
    """Split `total` layers in proportion to `weights` (>= 0), at least 1 each, summing to `total`.
    Rounding: floor of the ideal share (min 1), then the largest remainders get the rest."""
    n = len(weights)
    if total < n:
        raise InfeasibleError(f"{n} devices need at least one layer each but the model has {total}")
    weight_sum = sum(weights)
    ideal = [total * w / weight_sum for w in weights] if weight_sum > 0 else [total / n] * n
    counts = [max(1, math.floor(x)) for x in ideal]
    while sum(counts) < total:
        i = max(range(n), key=lambda i: (ideal[i] - counts[i], -i))
        counts[i] += 1
    while sum(counts) > total:
        i = min((i for i in range(n) if counts[i] > 1), key=lambda i: (ideal[i] - counts[i], i))
        counts[i] -= 1
    return counts


def _runnable(profiles: Sequence[DeviceProfile], model: ModelSpec) -> None:
    for index, p in enumerate(profiles):
        if device_weight_format(p, model) is None:
            raise InfeasibleError(f"stage {index} (node {p.node_id}) cannot run weight format {model.weight_format} "
                                  f"(it offers {', '.join(p.weight_formats)})")


def memory_weights(profiles: Sequence[DeviceProfile], model: ModelSpec, workload: Workload, reserve: Reserve) -> list[float]:
    """Layers each device's usable memory holds (fractional)."""
    return [reserve.usable_bytes(p.memory_bytes) / max(1, layer_memory_bytes(p, model, workload)) for p in profiles]


def compute_weights(profiles: Sequence[DeviceProfile], model: ModelSpec, workload: Workload) -> list[float]:
    """Layers per second each device runs."""
    return [1.0 / layer_time_s(p, model, workload) for p in profiles]


def _normalized(values: Sequence[float]) -> list[float]:
    total = sum(values)
    return [v / total for v in values] if total > 0 else [1.0 / len(values)] * len(values)


def mixed_weights(profiles: Sequence[DeviceProfile], model: ModelSpec, workload: Workload, reserve: Reserve,
                  mix: float) -> list[float]:
    """mix * memory share + (1 - mix) * compute share."""
    if not 0.0 <= mix <= 1.0:
        raise ValueError(f"mix must be in [0, 1], got {mix!r}")
    mem = _normalized(memory_weights(profiles, model, workload, reserve))
    comp = _normalized(compute_weights(profiles, model, workload))
    return [mix * m + (1.0 - mix) * c for m, c in zip(mem, comp)]


def counts_from_boundaries(boundaries: Sequence[Sequence[int]], num_devices: int, num_layers: int) -> list[int]:
    """Layer counts from (first, last) inclusive pairs; ValueError naming the first problem."""
    pairs = list(boundaries)
    if len(pairs) != num_devices:
        raise ValueError(f"custom boundaries: {len(pairs)} ranges for {num_devices} devices (need one per device)")
    counts, expected = [], 0
    for i, pair in enumerate(pairs):
        if (not isinstance(pair, Sequence) or len(pair) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in pair)):
            raise ValueError(f"custom boundaries: range {i} must be a (first, last) pair of layer indices, got {pair!r}")
        first, last = pair
        if first != expected:
            raise ValueError(f"custom boundaries: range {i} starts at layer {first}, expected {expected} (ranges must be contiguous from 0)")
        if last < first:
            raise ValueError(f"custom boundaries: range {i} ({first}, {last}) ends before it starts")
        counts.append(last - first + 1)
        expected = last + 1
    if expected != num_layers:
        raise ValueError(f"custom boundaries end at layer {expected - 1} but the model has layers 0-{num_layers - 1}")
    return counts


def strategy_counts(strategy: str, profiles: Sequence[DeviceProfile], model: ModelSpec, workload: Workload,
                    reserve: Reserve, *, boundaries: Sequence[Sequence[int]] | None = None, mix: float = 0.5) -> list[int]:
    """Layer counts per device (in the given order) for one of FIXED_STRATEGIES."""
    _runnable(profiles, model)
    L = model.num_layers
    if strategy == "custom":
        if boundaries is None:
            raise ValueError("strategy 'custom' needs boundaries: one (first, last) inclusive layer pair per device")
        return counts_from_boundaries(boundaries, len(profiles), L)
    if boundaries is not None:
        raise ValueError(f"boundaries are only used by strategy 'custom', not {strategy!r}")
    if strategy == "uniform":
        weights = [1.0] * len(profiles)
    elif strategy == "memory":
        weights = memory_weights(profiles, model, workload, reserve)
    elif strategy == "compute":
        weights = compute_weights(profiles, model, workload)
    elif strategy == "mixed":
        weights = mixed_weights(profiles, model, workload, reserve, mix)
    else:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of: dp, {', '.join(FIXED_STRATEGIES)}")
    return apportion(weights, L)
