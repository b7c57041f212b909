"""The tensor-parallel width of a stage, chosen by the planner (issue 36).

A node started with `--tp-max N` offers up to N devices (its profile's `max_devices`; its figures are
one device's) and lets the plan choose how many one stage of it spans. The candidates are the widths
1..N that divide the model (`ModelSpec.tp_widths`: heads, KV heads, the MLP or experts, the
vocabulary); a width that does not is never one. Width w is the node seen as `at_width(profile, w)`:

    devices = w; on separate devices (CUDA) memory, FLOP/s and bandwidths times w; on a CPU, whose
    ranks share the host's memory and cores, the figures as measured; the all-reduce its ranks
    measured at start (over all N, taken for every w), which the cost model adds twice a layer
    (`cost.allreduce_time_s`); at w > 1 its sliding-window layers count as full (`full_sliding_kv`:
    a tensor-parallel stage's ranks keep every position).

`best_over_widths` runs a search (the DP, the replica search, a fixed strategy) once for every
combination of the flexible nodes' widths and keeps the best result: the one that costs least
(a Plan) or gives the most tokens/s (a MeshPlan; LATENCY: one stream's), narrower widths winning
ties within TIE_FRACTION. So TP is chosen where it shortens a token (or raises throughput), width 1
where the all-reduce costs more than the split saves (a CPU's gloo on loopback). A node of fixed
width (`--tp N`, `max_devices` 0) keeps it. A width left out (1 included) leaves the node's other
devices idle: one node's devices are one stage, never several.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import TypeVar

from logicpipe.planner.model import ModelSpec
from logicpipe.planner.types import DeviceProfile, InfeasibleError

SHARED_HOST_KINDS = ("cpu",)
"""Device kinds whose ranks share one host's memory and cores: a wider stage has no more of them."""

MAX_COMBINATIONS = 64
"""Most width combinations tried in full; above, every flexible node takes the same width (its widest
candidate up to it), one search per width."""

TIE_FRACTION = 0.01
"""Results within this share of the best count as equal: the narrower (fewer devices) wins."""

R = TypeVar("R")


def width_choices(profile: DeviceProfile, model: ModelSpec) -> tuple[int, ...]:
    """The widths a stage of `profile` may have for `model`: its fixed `devices`, or the widths up to
    its `max_devices` that divide the model."""
    if profile.max_devices <= 1:
        return (profile.devices,)
    return model.tp_widths(profile.max_devices)


def at_width(profile: DeviceProfile, width: int) -> DeviceProfile:
    """`profile` (one device's figures, `max_devices` >= width) as one stage over `width` devices."""
    if profile.max_devices <= 1:
        if width != profile.devices:
            raise ValueError(f"node {profile.node_id} has a fixed width of {profile.devices} (--tp), not {width}")
        return profile
    if not 1 <= width <= profile.max_devices:
        raise ValueError(f"node {profile.node_id} offers 1 to {profile.max_devices} devices, not {width}")
    # (a stage of several ranks keeps every position of its sliding-window layers: they count as full)
    whole = profile.full_sliding_kv or width > 1
    if profile.device_kind in SHARED_HOST_KINDS:
        return dataclasses.replace(profile, devices=width, max_devices=0, full_sliding_kv=whole)
    return dataclasses.replace(profile, devices=width, max_devices=0, full_sliding_kv=whole,
                               memory_bytes=profile.memory_bytes * width,
                               flops=profile.flops * width, mem_bandwidth=profile.mem_bandwidth * width,
                               weight_bandwidth=profile.weight_bandwidth * width)


def as_planned(profile: DeviceProfile, width: int) -> DeviceProfile:
    """The profile a stage of `width` devices on this node was planned with: `at_width` on a node that
    lets the planner choose (a plan in force, costed again), the profile itself on a node of fixed width."""
    return at_width(profile, width) if profile.max_devices > 1 and width <= profile.max_devices else profile


def width_combinations(profiles: Sequence[DeviceProfile], model: ModelSpec) -> list[tuple[DeviceProfile, ...]]:
    """The profiles at every combination of their candidate widths, fewest devices in all first
    (all of them when at most MAX_COMBINATIONS, else one combination per width: module docstring)."""
    choices = [width_choices(p, model) for p in profiles]
    combos = list(itertools.product(*choices))
    if len(combos) > MAX_COMBINATIONS:
        widths = sorted({w for c in choices for w in c})
        combos = [tuple(max((x for x in c if x <= w), default=c[0]) for c in choices) for w in widths]
        combos = list(dict.fromkeys(combos))
    combos.sort(key=sum)
    return [tuple(p if p.max_devices <= 1 else at_width(p, w) for p, w in zip(profiles, combo)) for combo in combos]


def flexible(profiles: Sequence[DeviceProfile]) -> bool:
    """Whether any node lets the planner choose its width."""
    return any(p.max_devices > 1 for p in profiles)


def best_over_widths(profiles: Sequence[DeviceProfile], model: ModelSpec, search: Callable[[list[DeviceProfile]], R],
                     value: Callable[[R], float], *, higher: bool) -> R:
    """search(profiles at some widths) for every width combination; the result of the best `value`
    (`higher`: more is better), ties within TIE_FRACTION to the fewer devices. InfeasibleError (the
    widest combination's: what is missing even there) when none fits."""
    best: tuple[float, R] | None = None
    error: InfeasibleError | None = None
    for combo in width_combinations(profiles, model):
        try:
            result = search(list(combo))
        except InfeasibleError as exc:
            error = exc
            continue
        v = value(result)
        if best is None or (v > best[0] * (1 + TIE_FRACTION) if higher else v < best[0] * (1 - TIE_FRACTION)):
            best = (v, result)
    if best is None:
        assert error is not None
        raise error
    return best[1]
