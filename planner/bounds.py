"""Lower bounds on the optimal cost (to report a heuristic's gap) and the infeasibility diagnosis.

THROUGHPUT bound: the best single-stage plan, or for multi-stage plans: device d's stage costs at
least k_d * layer_s(d) + tau_d, where tau_d is the cheapest transfer out of d to another device,
and the last stage also pays its LM head. The bottleneck B must therefore let the devices hold all
layers with k_d <= min(floor((B - tau_d) / layer_s(d)), memory cap) (for the last one,
B - tau_d - head): the smallest such B is a bound (which links the order really uses and the
embedding are ignored).

LATENCY bound: the best single-stage plan, or for multi-stage plans the minimum over (first f,
last e) of embed(f) + f's cheapest hop + head(e) + the return e -> f + the layers filled into the
fastest devices up to their memory caps (f and e holding at least one); the middle hops and the
one-layer minimum of middle stages are ignored.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from logicpipe.planner.cost import edge_memory_bytes, layer_memory_bytes
from logicpipe.planner.instance import FIRST, LAST, MID, SINGLE, Instance, make_instance
from logicpipe.planner.model import ModelSpec, device_weight_format
from logicpipe.planner.search import smallest_feasible
from logicpipe.planner.types import DeviceProfile, Objective, Reserve, Workload
from logicpipe.planner.units import format_bytes

_SAFETY = 1.0 - 1e-12  # keeps rounding from lifting a bound above the optimum


def _cheapest_transfers(inst: Instance) -> list[float]:
    """[d] the cheapest outgoing transfer device d can have as a stage of a multi-stage pipeline."""
    return [min(min(inst.hop_s[d][j], inst.ret_s[d][j]) for j in range(inst.n) if j != d) for d in range(inst.n)]


def _layers_within(budget: float, layer_s: float, cap: int) -> int:
    """Most layers of `layer_s` seconds within `budget` (rounded up at the edge: a safe bound)."""
    if budget < 0:
        return -1
    return min(cap, math.floor(budget / layer_s + 1e-9))


def _multi_stage_throughput_bound(inst: Instance) -> float:
    """Smallest B for which the devices, each within B (layers + tau_d, the last one also its LM
    head), can hold all layers with whole layers per device; candidates are the B at which some
    device's count steps up, so the smallest feasible candidate is <= the optimum."""
    n, L, tau = inst.n, inst.num_layers, _cheapest_transfers(inst)
    t, head, caps = inst.layer_s, inst.head_s, inst.caps

    def holds_all(bound: float) -> bool:
        counts = [_layers_within(bound - tau[d], t[d], caps[d][MID]) for d in range(n)]
        total = sum(max(0, c) for c in counts)
        for e in range(n):
            last = _layers_within(bound - tau[e] - head[e], t[e], caps[e][LAST])
            if last >= 1 and total - max(0, counts[e]) + last >= L:
                return True
        return False

    cands = sorted({tau[d] + k * t[d] + extra for d in range(n) for extra in (0.0, head[d])
                    for k in range(1, caps[d][MID] + 1)})
    bound = smallest_feasible(cands, holds_all)
    return math.inf if bound is None else bound


def throughput_lower_bound(inst: Instance) -> float:
    """No chain over `inst`'s devices has a smaller bottleneck."""
    L = inst.num_layers
    single = min((inst.compute_s(d, SINGLE, L) + inst.ret_s[d][d] for d in range(inst.n) if inst.caps[d][SINGLE] >= L),
                 default=math.inf)
    multi = _multi_stage_throughput_bound(inst) if inst.n >= 2 and L >= 2 else math.inf
    return min(single, multi) * _SAFETY


def _fill_with_ends(inst: Instance, by_speed: list[int], f: int, e: int) -> float:
    """sum(k_d * layer_s(d)) with f and e holding >= 1 layer, any other device >= 0, all within
    their memory caps, layers to the fastest first; inf if they cannot hold the model."""
    cap_f, cap_e = inst.caps[f][FIRST], inst.caps[e][LAST]
    if cap_f < 1 or cap_e < 1:
        return math.inf
    remaining = inst.num_layers - 2
    total = inst.layer_s[f] + inst.layer_s[e]
    for d in by_speed:
        if remaining <= 0:
            break
        room = cap_f - 1 if d == f else cap_e - 1 if d == e else inst.caps[d][MID]
        take = min(room, remaining)
        total += take * inst.layer_s[d]
        remaining -= take
    return total if remaining <= 0 else math.inf


def latency_lower_bound(inst: Instance) -> float:
    """No chain over `inst`'s devices has a smaller sum of stage times."""
    n, L = inst.n, inst.num_layers
    single = min((inst.compute_s(d, SINGLE, L) + inst.ret_s[d][d] for d in range(n) if inst.caps[d][SINGLE] >= L),
                 default=math.inf)
    if n < 2 or L < 2:
        return single * _SAFETY
    by_speed = sorted(range(n), key=lambda d: inst.layer_s[d])
    multi = math.inf
    for f in range(n):
        out_hop = min(inst.hop_s[f][j] for j in range(n) if j != f)
        for e in range(n):
            if e != f:
                ends = inst.embed_s[f] + out_hop + inst.head_s[e] + inst.ret_s[e][f]
                if ends < multi:
                    multi = min(multi, ends + _fill_with_ends(inst, by_speed, f, e))
    return min(single, multi) * _SAFETY


def lower_bound_s(inst: Instance, objective: Objective) -> float:
    """The bound for `objective` (see the module docstring)."""
    return throughput_lower_bound(inst) if objective is Objective.THROUGHPUT else latency_lower_bound(inst)


def max_placeable_layers(inst: Instance) -> int:
    """Most layers any pipeline over `inst`'s devices can hold (the model fits iff >= num_layers)."""
    n = inst.n
    best = max((inst.caps[d][SINGLE] for d in range(n)), default=0)
    mids = [inst.caps[d][MID] for d in range(n)]
    total_mid = sum(mids)
    for f in range(n):
        for e in range(n):
            if f != e and inst.caps[f][FIRST] >= 1 and inst.caps[e][LAST] >= 1:
                best = max(best, total_mid - mids[f] - mids[e] + inst.caps[f][FIRST] + inst.caps[e][LAST])
    return best


def infeasibility_message(profiles: Sequence[DeviceProfile], model: ModelSpec, workload: Workload,
                          reserve: Reserve) -> str | None:
    """None when some pipeline over `profiles` fits in memory; else why not, with the memory
    missing in human units."""
    n = len(profiles)
    runnable = [p for p in profiles if device_weight_format(p, model) is not None]
    if not runnable:
        offers = "; ".join(f"{p.node_id}: {', '.join(p.weight_formats)}" for p in profiles)
        return f"no device can run weight format {model.weight_format} (or an fp32 upcast of it): {offers}"
    inst = make_instance(runnable, model, workload, reserve)
    L = model.num_layers
    if max_placeable_layers(inst) >= L:
        return None
    usable = {p.node_id: reserve.usable_bytes(p.memory_bytes) for p in runnable}
    largest = max(usable.values())
    layer = min(layer_memory_bytes(p, model, workload) for p in runnable)
    offer = ", ".join(f"{node} {format_bytes(b)}" for node, b in usable.items())
    for role, is_first, label, part in ((FIRST, True, "embedding", model.embedding_bytes),
                                        (LAST, False, "LM head", model.lm_head_bytes)):
        if not any(inst.caps[d][role] >= 1 or inst.caps[d][SINGLE] >= 1 for d in range(inst.n)):
            edge = min(edge_memory_bytes(p, model, is_first=is_first, is_last=not is_first) for p in runnable)
            return (f"model {model.name} needs {format_bytes(edge + layer - largest)} more than the {n} devices offer: "
                    f"no device can hold the {label} ({format_bytes(part)}) plus one layer ({format_bytes(layer)}); "
                    f"usable after the reserve: {offer}")
    need = L * layer + model.embedding_bytes + model.lm_head_bytes
    best = max_placeable_layers(inst)
    missing = max(need - sum(usable.values()), (L - best) * layer)
    return (f"model {model.name} needs {format_bytes(missing)} more than the {n} devices offer: "
            f"{L} layers x {format_bytes(layer)} (weights + KV for {workload.batch} x {workload.context_tokens} tokens) "
            f"+ {format_bytes(model.embedding_bytes)} embedding + {format_bytes(model.lm_head_bytes)} LM head "
            f"= {format_bytes(need)}; at most {best} of {L} layers fit; usable after the reserve: {offer}")
