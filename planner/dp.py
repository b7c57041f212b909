"""Exact placement for up to EXACT_MAX_DEVICES devices: which devices take part, in what order,
with which contiguous layer ranges, minimizing the cost model of `cost.py` exactly.

Both searches fix the first device f in an outer loop, so the embedding memory of the first stage
and the closing link (last stage -> f) are known exactly, and walk states
(mask of devices used, current device) layer by layer (|mask| = 1, 2, ...).

THROUGHPUT (min-max), parametric. For a bottleneck B, device d followed by device x can take
cap_B(d, role, x) = the most layers k with memory(k) fitting and compute(k) + transfer(d -> x) <= B.
For a fixed ordered path the layers its first s stages can cover form the interval
[s, sum of their caps], and every path into (mask, cur) has the same s = |mask| - 1, so the union
over paths is [s, M(mask, cur)] with M the best sum of caps: a DP over (mask, cur) keeping only M
decides feasibility exactly (cur closes the ring if some l in [s, M] leaves 1..cap_B(cur, last, f)
layers for it). The optimum is the smallest B among the finitely many stage costs
{compute(d, role, k) + transfer} for which the check succeeds: a binary search over that sorted
set. Among the chains feasible at the optimum, the one with the lowest latency sum is returned
(layers given to the fastest devices first within their caps).

LATENCY (min-sum), decomposed. The sum of stage times is
    sum of hops along the path + return hop + embed(f) + head(last) + sum(k_d * layer_s(d)),
and for a fixed set, first f and last e the layer part does not depend on the order of the
middle devices (only f's and e's memory caps differ), so
    optimum = min over (set, f, e) of [shortest Hamiltonian path f -> e through the set
              (Held-Karp)] + [fill the fastest devices first up to their memory caps].

Cost: O(n^2 2^n (n + log(n L))) for throughput, O(n^3 2^n) for latency; n <= 8 by default.
"""
from __future__ import annotations

import bisect
import math

from logicpipe.planner.instance import FIRST, LAST, MID, SINGLE, Chain, Instance, fill_fastest
from logicpipe.planner.search import parent_path, smallest_feasible

EXACT_MAX_DEVICES = 8
"""Above this many eligible devices `make_plan` uses the heuristic of `heuristic.py`."""

Caps = tuple[list[list[int]], list[list[int]], list[list[int]], list[bool]]  # first[f][j], mid[d][j], last[d][f], single_ok[f]


# ---------------------------------------------------------------- throughput (min-max) ----

def cost_lists(inst: Instance) -> tuple[list, list, list, list]:
    """Increasing stage costs for k = 1..cap, per (device, successor) and role."""
    n, L = inst.n, inst.num_layers
    rng = range(n)

    def costs(d: int, role: int, transfer: float) -> list[float]:
        return [inst.compute_s(d, role, k) + transfer for k in range(1, inst.caps[d][role] + 1)]

    first = [[costs(f, FIRST, inst.hop_s[f][j]) if j != f else [] for j in rng] for f in rng]
    mid = [[costs(d, MID, inst.hop_s[d][j]) if j != d else [] for j in rng] for d in rng]
    last = [[costs(d, LAST, inst.ret_s[d][f]) if f != d else [] for f in rng] for d in rng]
    single = [[inst.compute_s(f, SINGLE, L) + inst.ret_s[f][f]] if inst.caps[f][SINGLE] >= L else [] for f in rng]
    return first, mid, last, single


def stage_cost_candidates(lists: tuple[list, list, list, list]) -> list[float]:
    """Every stage cost any plan can have, sorted: the optimal bottleneck is one of them."""
    first, mid, last, single = lists
    values = {c for table in (first, mid, last) for row in table for col in row for c in col}
    values.update(c for row in single for c in row)
    return sorted(values)


def caps_at(lists: tuple[list, list, list, list], bound: float) -> Caps:
    """cap_B for every (device, successor, role) at bottleneck `bound`."""
    first, mid, last, single = lists

    def cap(table: list) -> list[list[int]]:
        return [[bisect.bisect_right(col, bound) for col in row] for row in table]

    return cap(first), cap(mid), cap(last), [bool(row) and row[0] <= bound for row in single]


def _walk(n: int, L: int, f: int, caps: Caps, collect: bool) -> bool | list[Chain]:
    """DP over (mask, cur) from first device f. Without `collect`: whether any chain is feasible.
    With it: one chain (path + any feasible layer split) per feasible closing state."""
    cf, cm, cl, single_ok = caps
    found: list[Chain] = []
    if single_ok[f]:
        if not collect:
            return True
        found.append(((f, L),))
    succ = [[(j, 1 << j, c) for j, c in enumerate(row) if c > 0] for row in cm]
    first_succ = [(j, 1 << j, c) for j, c in enumerate(cf[f]) if c > 0]
    frontier: dict[tuple[int, int], int] = {(1 << f, f): 0}
    parents: dict[tuple[int, int], tuple[int, int]] = {}
    for p in range(1, min(n, L) + 1):  # p = devices in mask = stages including cur
        nxt: dict[tuple[int, int], int] = {}
        s = p - 1
        for (mask, cur), m in frontier.items():
            if cur != f:
                c = cl[cur][f]
                if c > 0 and max(s, L - c) <= min(m, L - 1):
                    if not collect:
                        return True
                    found.append(_split(mask, cur, f, caps, parents, c, L))
            if p >= L:
                continue
            for j, bit, c in (first_succ if cur == f else succ[cur]):
                if mask & bit:
                    continue
                v = m + c
                if v > L - 1:
                    v = L - 1
                key = (mask | bit, j)
                if nxt.get(key, -1) < v:
                    nxt[key] = v
                    if collect:
                        parents[key] = (mask, cur)
        frontier = nxt
    return found if collect else False


def _split(mask: int, cur: int, f: int, caps: Caps, parents: dict, last_cap: int, L: int) -> Chain:
    """The path into (mask, cur) with per-stage caps; any feasible layer split (refined later)."""
    cf, cm, _, _ = caps
    path = parent_path(parents, (mask, cur))
    stage_caps = [cf[f][path[1]]] + [cm[path[i]][path[i + 1]] for i in range(1, len(path) - 1)] + [last_cap]
    counts = [1] * len(path)
    remaining = L - len(path)
    for i, c in enumerate(stage_caps):
        take = min(c - 1, remaining)
        counts[i] += take
        remaining -= take
    assert remaining == 0, "feasible closing state must admit a split"
    return tuple(zip(path, counts))


def _chain_caps(inst: Instance, chain: Chain, caps: Caps) -> list[int]:
    cf, cm, cl, _ = caps
    path = [d for d, _ in chain]
    if len(path) == 1:
        return [inst.num_layers]
    f = path[0]
    return [cf[f][path[1]]] + [cm[path[i]][path[i + 1]] for i in range(1, len(path) - 1)] + [cl[path[-1]][f]]


def min_bottleneck_exact(inst: Instance, lower_bound_s: float = 0.0) -> Chain | None:
    """The chain with the smallest bottleneck (ties: smallest latency sum among the DP's chains);
    None when no chain fits in memory. `lower_bound_s` only prunes the binary search."""
    n, L = inst.n, inst.num_layers
    lists = cost_lists(inst)
    cands = stage_cost_candidates(lists)

    def feasible(bound: float) -> bool:
        caps = caps_at(lists, bound)
        return any(_walk(n, L, f, caps, collect=False) for f in range(n))

    bound = smallest_feasible(cands, feasible, lower_bound_s)
    if bound is None:
        return None
    caps = caps_at(lists, bound)
    best: tuple[float, Chain] | None = None
    for f in range(n):
        for chain in _walk(n, L, f, caps, collect=True):  # type: ignore[union-attr]
            devices = [d for d, _ in chain]
            counts = fill_fastest(inst, devices, _chain_caps(inst, chain, caps))
            assert counts is not None
            refined = tuple(zip(devices, counts))
            key = sum(inst.chain_times(refined))
            if best is None or key < best[0]:
                best = (key, refined)
    assert best is not None
    return best[1]


# ---------------------------------------------------------------- latency (min-sum) -------

def _fill_cost(inst: Instance, by_speed: list[int], mask: int, f: int, e: int) -> float | None:
    """sum(k_d * layer_s(d)) of `fill_fastest` over the devices of `mask` (f first, e last)."""
    caps = inst.caps
    remaining = inst.num_layers - bin(mask).count("1")
    if remaining < 0:
        return None
    total = 0.0
    for d in by_speed:
        if not mask >> d & 1:
            continue
        cap = caps[d][FIRST if d == f else LAST if d == e else MID]
        if cap < 1:
            return None
        take = min(cap - 1, remaining)
        remaining -= take
        total += (1 + take) * inst.layer_s[d]
    return total if remaining == 0 else None


def min_latency_exact(inst: Instance) -> Chain | None:
    """The chain with the smallest sum of stage times; None when no chain fits in memory."""
    n, L = inst.n, inst.num_layers
    by_speed = sorted(range(n), key=lambda d: (inst.layer_s[d], d))
    best_cost, best_chain = math.inf, None
    for f in range(n):
        if inst.caps[f][SINGLE] >= L:
            cost = inst.compute_s(f, SINGLE, L) + inst.ret_s[f][f]
            if cost < best_cost:
                best_cost, best_chain = cost, ((f, L),)
    for f in range(n):
        if inst.caps[f][FIRST] < 1 or L < 2:
            continue
        frontier: dict[tuple[int, int], float] = {(1 << f, f): 0.0}
        parents: dict[tuple[int, int], tuple[int, int]] = {}
        for p in range(1, min(n, L) + 1):
            nxt: dict[tuple[int, int], float] = {}
            for (mask, e), hops in frontier.items():
                if e != f and inst.caps[e][LAST] >= 1:
                    fill = _fill_cost(inst, by_speed, mask, f, e)
                    if fill is not None:
                        cost = hops + inst.ret_s[e][f] + inst.embed_s[f] + inst.head_s[e] + fill
                        if cost < best_cost:
                            best_cost, best_chain = cost, _latency_chain(inst, mask, e, f, parents)
                if p >= L:
                    continue
                for j in range(n):
                    bit = 1 << j
                    if mask & bit or inst.caps[j][MID] < 1:
                        continue
                    v = hops + inst.hop_s[e][j]
                    key = (mask | bit, j)
                    if v < nxt.get(key, math.inf):
                        nxt[key] = v
                        parents[key] = (mask, e)
            frontier = nxt
    return best_chain


def _latency_chain(inst: Instance, mask: int, e: int, f: int, parents: dict) -> Chain:
    path = parent_path(parents, (mask, e))
    caps = [inst.caps[d][FIRST if i == 0 else LAST if i == len(path) - 1 else MID] for i, d in enumerate(path)]
    counts = fill_fastest(inst, path, caps)
    assert counts is not None
    return tuple(zip(path, counts))
