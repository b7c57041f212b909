"""The replica search: which pipelines over disjoint devices serve B concurrent sequences fastest
under the decode-round model of `cost.py`.

Building block: the single-pipeline DP over a subset of the devices, costed by `mesh_search.py`
(a chain's predicted tokens/s f(R) at R rows, within its capacity).

Up to EXACT_MESH_DEVICES devices (`subset_blocks`, `best_partitions`):
1. every subset of the devices is a candidate pipeline: the DP's chain over it, run with the KV of
   as many rows as the subset can hold (at most B) -- unless one of its devices adds nothing to
   those rows and is no faster than the others (then it only adds a stage: a hop, an overhead, its
   share of the weights read again per micro-batch; the subset without it is the candidate; a
   faster device may still pay for its stage by taking layers off slower ones). Devices with
   identical profiles and links are interchangeable, so a subset is planned once per count of
   each kind of device;
2. a partition of the devices into pipelines (and idle devices) with the rows split between them
   is searched by a Lagrangian relaxation: at a price lam per row, pipeline S is worth
   g_S(lam) = max_R f_S(R) - lam * R, which adds up over the pipelines of a partition, so a DP
   over device masks (3^n) finds the best partition for that price; prices from 0 (every pipeline
   takes what it holds) up, bisected so the rows add up to B, give the candidate partitions;
3. each candidate is costed exactly: B rows water-filled one at a time to the pipeline whose
   tokens/s gains most, and the best kept (ties within TIE_FRACTION: more pipelines, then fewer
   stages).
Cost: at most 2^n DP calls (far fewer for alike devices), about 17 x 3^n steps for the partitions.

Above it (`greedy_partition`): peel pipelines from the remaining devices, each time the candidate
with the most tokens/s per device at its fair share of the rows (B / n per device it uses) among:
every single device that holds the model, the DP's chain over the fewest devices that hold it
(largest memory first, or fastest first) and over those plus one or two more; while the total
stays within TIE_FRACTION. At most six DP calls per pipeline peeled, plus one over all devices
(a single pipeline over everything is a candidate too).

Either way the best partition is then offered the devices it leaves idle as more pipelines, kept
when the prediction stays within TIE_FRACTION (spare pipelines take streams when the load grows,
and a lost node stops fewer requests).
"""
from __future__ import annotations

import dataclasses
import math

from logicpipe.planner.instance import SINGLE, Chain
from logicpipe.planner.mesh_search import TIE_FRACTION, MeshSearch, Partition
from logicpipe.planner.types import Objective

EXACT_MESH_DEVICES = 8
"""Up to this many eligible devices the replica search tries every subset as a pipeline."""

_PRICES = 16  # bisection steps of the row price


# ------------------------------------------------------------------ small meshes: exact ----

def device_kinds(search: MeshSearch) -> list[int]:
    """[d] the kind of device d (the first device of its kind): devices of one kind have equal
    profiles but the node id, and equal links to and from every other device and each other, so
    any subset is planned alike up to renaming them."""
    ps, n = search.profiles, search.n
    key = [dataclasses.replace(p, node_id="x", links=()) for p in ps]
    kind = list(range(n))
    for b in range(n):
        for a in range(b):
            if kind[a] != a or key[a] != key[b]:
                continue
            pa, pb = ps[a], ps[b]
            if pa.link_to(pb.node_id) == pb.link_to(pa.node_id) and all(
                    pa.link_to(x.node_id) == pb.link_to(x.node_id) and x.link_to(pa.node_id) == x.link_to(pb.node_id)
                    for i, x in enumerate(ps) if i not in (a, b)):
                kind[b] = a
                break
    return kind


def subset_blocks(search: MeshSearch) -> dict[int, Chain]:
    """{device mask: the DP's chain over exactly those devices} for every subset whose chain uses
    all of it, but those with a needless device: one that adds nothing to the rows the subset
    holds and is no faster than any other device of it (it only adds a stage: a hop, an overhead,
    its share of the weights read again per micro-batch)."""
    n, kind = search.n, device_kinds(search)
    members: dict[int, list[int]] = {}
    for d in range(n):
        members.setdefault(kind[d], []).append(d)

    def canonical(mask: int) -> tuple[tuple[int, ...], dict[int, int]]:
        """The subset of the same kinds made of the first devices of each kind, and the renaming."""
        rename, used = {}, {}
        for d in range(n):
            if mask >> d & 1:
                i = used.get(kind[d], 0)
                used[kind[d]] = i + 1
                rename[members[kind[d]][i]] = d
        return tuple(sorted(rename)), rename

    most: dict[tuple[int, ...], int] = {}
    rows = [0] * (1 << n)
    for mask in range(1, 1 << n):
        key, _ = canonical(mask)
        if key not in most:
            most[key] = search.most_rows(key)
        rows[mask] = most[key]
    speed = search.time_inst(search.dp_rows).layer_s

    def needless(mask: int, d: int) -> bool:
        """Device d adds no rows to `mask` and is no faster than any other device of it."""
        rest = mask ^ 1 << d
        return rows[rest] >= rows[mask] and all(speed[d] >= speed[x] for x in range(n) if rest >> x & 1)

    planned: dict[tuple[int, ...], Chain | None] = {}
    blocks: dict[int, Chain] = {}
    for mask in range(1, 1 << n):
        r = rows[mask]
        if r == 0 or any(mask >> d & 1 and mask != 1 << d and needless(mask, d) for d in range(n)):
            continue
        key, rename = canonical(mask)
        if key not in planned:
            planned[key] = search.chain(key, Objective.THROUGHPUT, r)
        chain = planned[key]
        if chain is not None and len(chain) == len(key):
            blocks[mask] = tuple((rename[d], k) for d, k in chain)
            search.alias[blocks[mask]] = chain
    return blocks


def _grid(cap: int) -> list[int]:
    """Row counts the price search looks at: every count to 4, then about 25% apart, and cap."""
    out, r = [], 1
    while r < cap:
        out.append(r)
        r = r + 1 if r < 4 else max(r + 1, int(r * 1.25))
    out.append(cap)
    return out


def best_partitions(search: MeshSearch, blocks: dict[int, Chain], max_pipelines: int) -> list[Partition]:
    """Candidate partitions from the price search of the module docstring (`max_pipelines` 0:
    any number)."""
    n = search.n
    tables, costed = {}, {}
    for mask, chain in blocks.items():
        same = search.alias.get(chain, chain)
        if same not in costed:
            cap = search.capacity(same)
            costed[same] = [(r, search.rate(same, r)[1]) for r in _grid(cap)] if cap >= 1 else None
        if costed[same] is not None:
            tables[mask] = costed[same]
    if not tables:
        return []
    K = max_pipelines if max_pipelines else 1  # the DP tracks the count of pipelines only when capped

    def solve(price: float) -> tuple[Partition, int]:
        gain = {}
        for mask, table in tables.items():
            r, g = max(((r, f - price * r) for r, f in table), key=lambda x: x[1])
            if g > 0:
                gain[mask] = (g, r)
        # best[mask][k]: (value, pipelines, -stages, rows, blocks) with at most k+1 pipelines (or any, uncapped)
        empty = (0.0, 0, 0, 0, ())
        best: list[list[tuple]] = [[empty] * K for _ in range(1 << n)]
        for mask in range(1, 1 << n):
            low = mask & -mask
            rest = mask ^ low
            row = list(best[rest])  # the lowest device idle
            sub = rest
            while True:
                s = sub | low
                hit = gain.get(s)
                if hit is not None:
                    g, r = hit
                    prev_row = best[mask ^ s]
                    for k in range(K):
                        prev = prev_row[k] if not max_pipelines else prev_row[k - 1] if k else empty
                        cand = (prev[0] + g, prev[1] + 1, prev[2] - len(blocks[s]), prev[3] + r, prev[4] + (s,))
                        if cand[:3] > row[k][:3]:
                            row[k] = cand
                if sub == 0:
                    break
                sub = (sub - 1) & rest
            best[mask] = row
        top = best[(1 << n) - 1][K - 1]
        return tuple(blocks[s] for s in top[4]), top[3]

    found: dict[frozenset, Partition] = {}
    part, used = solve(0.0)
    found[frozenset(part)] = part
    hi = 2.0 * max(f / r for table in tables.values() for r, f in table)
    lo = hi * 1e-6
    for _ in range(_PRICES):
        mid = math.sqrt(lo * hi)
        part, used = solve(mid)
        found.setdefault(frozenset(part), part)
        lo, hi = (mid, hi) if used > search.batch else (lo, mid)
    return [p for p in found.values() if p]


# ------------------------------------------------------------------- large meshes: greedy ----

def _peel_candidates(search: MeshSearch, remaining: list[int]) -> list[Chain]:
    """Pipelines worth peeling from `remaining`: single devices, and the DP's chain over the
    fewest devices that hold the model (largest memory or fastest first), plus one or two more."""
    out: list[Chain] = []
    L = search.model.num_layers
    caps1 = search.caps(1)
    singles = [d for d in remaining if caps1[d][SINGLE] >= L]
    out.extend(((d, L),) for d in singles)
    inst = search.time_inst(search.dp_rows)
    orders = (sorted(remaining, key=lambda d: (-caps1[d][1], inst.layer_s[d], d)),
              sorted(remaining, key=lambda d: (inst.layer_s[d], -caps1[d][1], d)))
    seen: set[tuple[int, ...]] = set()
    for order in orders:
        size = next((k for k in range(2, len(order) + 1) if search.holds(order[:k], 1)), None)
        if size is None:
            continue
        for extra in range(3):
            group = tuple(sorted(order[:size + extra]))
            if len(group) < size + extra or group in seen:
                continue
            seen.add(group)
            rows = search.most_rows(group)
            chain = search.chain(group, Objective.THROUGHPUT, rows) if rows else None
            if chain is not None:
                out.append(chain)
    return out


def greedy_partition(search: MeshSearch, max_pipelines: int, start: Partition = ()) -> Partition:
    """Pipelines peeled one at a time from the devices `start` leaves (module docstring): each
    time the candidate with the most tokens/s per device at its fair share of the rows (B per
    device, times its devices, within what it holds), while the total stays within TIE_FRACTION."""
    chosen = list(start)
    used = {d for chain in chosen for d, _ in chain}
    remaining = [d for d in range(search.n) if d not in used]
    current = search.split_rows(tuple(chosen))[1] if chosen else 0.0
    while remaining and (not max_pipelines or len(chosen) < max_pipelines):
        best: tuple[float, int, Chain] | None = None
        for chain in _peel_candidates(search, remaining):
            cap = search.capacity(chain)
            if cap < 1:
                continue
            share = min(cap, max(1, -(-search.batch * len(chain) // search.n)))
            key = (search.rate(chain, share)[1] / len(chain), -len(chain), chain)
            if best is None or key[:2] > best[:2]:
                best = key
        if best is None:
            break
        value = search.split_rows((*chosen, best[2]))[1]
        if value < current * (1 - TIE_FRACTION):
            break
        chosen.append(best[2])
        current = max(current, value)
        remaining = [d for d in remaining if d not in {d for d, _ in best[2]}]
    return tuple(chosen)


def throughput_partition(search: MeshSearch, max_pipelines: int) -> tuple[Partition, list[int], float]:
    """The best pipelines for aggregate tokens/s at B rows: (chains, rows each, tokens/s). The
    best candidate is offered the devices it leaves idle as more pipelines (more streams at no
    loss: the tie rule keeps them when the prediction stays within TIE_FRACTION)."""
    cands: list[Partition] = []
    if search.n <= EXACT_MESH_DEVICES:
        cands.extend(best_partitions(search, subset_blocks(search), max_pipelines))
    else:
        cands.append(greedy_partition(search, max_pipelines))
        everything = search.chain(range(search.n), Objective.THROUGHPUT, max(1, search.most_rows(range(search.n))))
        if everything is not None:
            cands.append((everything,))
    if not any(cands):
        return (), [], 0.0
    best = search.best_of(cands)[0]
    return search.best_of([best, greedy_partition(search, max_pipelines, start=best)])


def latency_partition(search: MeshSearch, max_pipelines: int) -> Partition:
    """The pipeline with the shortest token trip for one stream first, then (when more are allowed)
    the same again from the devices left, each holding the KV of B rows."""
    remaining = list(range(search.n))
    chosen: list[Chain] = []
    while remaining and (not max_pipelines or len(chosen) < max_pipelines):
        if not search.holds(remaining, search.batch):
            break
        chain = search.chain(remaining, Objective.LATENCY, search.batch)
        if chain is None:
            break
        chosen.append(chain)
        used = {d for d, _ in chain}
        remaining = [d for d in remaining if d not in used]
    return tuple(chosen)
