"""The replica search's tables: one pipeline (a chain of `instance.py`) costed by the decode-round
model of `cost.py` at R rows, its capacity in rows, and a partition's rows water-filled.

A chain's value is its predicted tokens/s at R rows, f(R) = max over m in 1..min(S, R) of
R / round_s(m), for 1 <= R <= its capacity (the most rows whose KV its split holds, at most B).
Its chain comes from the single-pipeline DP of `dp.py` (the heuristic above EXACT_MAX_DEVICES)
over a subset of the devices, with each device's step overhead folded into its outgoing transfer
(every stage pays exactly one), so the DP's bottleneck is max_i t_i and its latency sum_i t_i.
"""
from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

from logicpipe.planner.bounds import lower_bound_s, max_placeable_layers
from logicpipe.planner.cost import compose_round_s, compose_step_s, max_layers, micro_batch_rows, micro_workload, step_overhead_s
from logicpipe.planner.dp import EXACT_MAX_DEVICES, min_bottleneck_exact, min_latency_exact
from logicpipe.planner.heuristic import heuristic_chain, restrict
from logicpipe.planner.instance import ROLE_FLAGS, Chain, Instance, make_instance, role_of
from logicpipe.planner.model import ModelSpec
from logicpipe.planner.types import DeviceProfile, Objective, Reserve, Workload

TIE_FRACTION = 0.01
"""Mesh plans within this share of the best predicted tokens/s count as equal: the one with more
pipelines wins (room for more streams; a lost node stops fewer requests), then fewer stages."""

Partition = tuple[Chain, ...]
"""Pipelines over disjoint devices, as chains."""

WATER_STEPS = 256
"""Most steps the water-filling of rows takes (more rows are given in equal chunks)."""


class MeshSearch:
    """Cost tables and caches for one search over `profiles` (device numbers index them)."""

    def __init__(self, profiles: Sequence[DeviceProfile], model: ModelSpec, workload: Workload, reserve: Reserve,
                 dp_rows: int = 0):
        self.profiles = tuple(profiles)
        self.model, self.reserve = model, reserve
        self.context, self.batch = workload.context_tokens, workload.batch
        self.overhead = tuple(step_overhead_s(p) for p in self.profiles)
        self.dp_calls = 0                                   # single-pipeline DP / heuristic runs
        self._time: dict[int, Instance] = {}                # rows per micro-batch -> cost tables
        self._caps: dict[int, tuple[tuple[int, ...], ...]] = {}  # rows held -> [d][role] layer caps
        self._dp_inst: dict[int, Instance] = {}             # rows held -> the DP's tables
        self._rate: dict[tuple[Chain, int], tuple[int, float]] = {}
        self._steps: dict[tuple[Chain, int], list[float]] = {}
        self._capacity: dict[Chain, int] = {}
        self.alias: dict[Chain, Chain] = {}  # a chain -> the same chain over devices of the same kinds, costed once
        # rows per micro-batch the DP balances its stages for (default: B spread over every device)
        self.dp_rows = dp_rows or max(1, self.batch // max(1, len(self.profiles)))

    @property
    def n(self) -> int:
        return len(self.profiles)

    # -------------------------------------------------------------------- tables ----

    def time_inst(self, rows_per_micro_batch: int) -> Instance:
        """Cost tables for one micro-batch of that many rows (its caps are not used)."""
        inst = self._time.get(rows_per_micro_batch)
        if inst is None:
            inst = make_instance(self.profiles, self.model, micro_workload(rows_per_micro_batch, self.context), self.reserve)
            self._time[rows_per_micro_batch] = inst
        return inst

    def caps(self, rows: int) -> tuple[tuple[int, ...], ...]:
        """[d][role] most layers device d holds with the KV of `rows` sequences."""
        caps = self._caps.get(rows)
        if caps is None:
            held = Workload(tokens_per_step=1, context_tokens=self.context, batch=rows)
            caps = tuple(tuple(max_layers(p, self.model, held, self.reserve, is_first=f, is_last=l) for f, l in ROLE_FLAGS)
                         for p in self.profiles)
            self._caps[rows] = caps
        return caps

    def dp_inst(self, rows: int) -> Instance:
        """The DP's tables: stage time t_i (overhead folded into the outgoing transfer) for a
        micro-batch of `dp_rows` rows, caps for the KV of `rows` sequences."""
        inst = self._dp_inst.get(rows)
        if inst is None:
            base = self.time_inst(self.dp_rows)
            o = self.overhead
            inst = dataclasses.replace(
                base, caps=self.caps(rows),
                hop_s=tuple(tuple(h + o[d] for h in row) for d, row in enumerate(base.hop_s)),
                ret_s=tuple(tuple(h + o[d] for h in row) for d, row in enumerate(base.ret_s)))
            self._dp_inst[rows] = inst
        return inst

    # ------------------------------------------------------------- one pipeline ----

    def holds(self, devices: Sequence[int], rows: int) -> bool:
        """Some pipeline over `devices` holds the model with the KV of `rows` sequences."""
        return max_placeable_layers(restrict(self.dp_inst(rows), devices)) >= self.model.num_layers

    def most_rows(self, devices: Sequence[int]) -> int:
        """The most rows (<= B) some pipeline over `devices` can hold; 0 when not even one."""
        if not self.holds(devices, 1):
            return 0
        lo, hi = 1, self.batch
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.holds(devices, mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def chain(self, devices: Sequence[int], objective: Objective, rows: int) -> Chain | None:
        """The DP's chain (global device numbers) over `devices` holding the KV of `rows` rows."""
        ds = list(devices)
        inst = restrict(self.dp_inst(rows), ds)
        if max_placeable_layers(inst) < self.model.num_layers:
            return None
        self.dp_calls += 1
        if len(ds) > EXACT_MAX_DEVICES:
            found = heuristic_chain(inst, objective, lower_bound_s(inst, objective))
        elif objective is Objective.THROUGHPUT:
            found = min_bottleneck_exact(inst)
        else:
            found = min_latency_exact(inst)
        return None if found is None else tuple((ds[d], k) for d, k in found)

    def fits(self, chain: Chain, rows: int) -> bool:
        """The chain's split holds the KV of `rows` sequences on every stage."""
        caps = self.caps(rows)
        return all(1 <= k <= caps[d][role_of(i, len(chain))] for i, (d, k) in enumerate(chain))

    def capacity(self, chain: Chain) -> int:
        """The most rows (<= B) the chain holds; 0 when not even one."""
        chain = self.alias.get(chain, chain)
        cap = self._capacity.get(chain)
        if cap is None:
            if not self.fits(chain, 1):
                cap = 0
            else:
                lo, hi = 1, self.batch
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    lo, hi = (mid, hi) if self.fits(chain, mid) else (lo, mid - 1)
                cap = lo
            self._capacity[chain] = cap
        return cap

    def step_times(self, chain: Chain, rows_per_micro_batch: int) -> list[float]:
        """t_i(r) of `cost.py` for the chain's stages."""
        key = (chain, rows_per_micro_batch)
        hit = self._steps.get(key)
        if hit is None:
            times = self.time_inst(rows_per_micro_batch).chain_times(chain)
            hit = self._steps[key] = [compose_step_s(t, self.overhead[d]) for t, (d, _) in zip(times, chain)]
        return hit

    def rate(self, chain: Chain, rows: int) -> tuple[int, float]:
        """(micro-batches, tokens/s) at `rows` sequences: the best m in 1..min(stages, rows)."""
        if rows < 1:
            return 1, 0.0
        chain = self.alias.get(chain, chain)
        key = (chain, rows)
        hit = self._rate.get(key)
        if hit is None:
            hit = (1, -1.0)
            for m in range(1, min(len(chain), rows) + 1):
                tps = rows / compose_round_s(self.step_times(chain, micro_batch_rows(rows, m)), m)
                if tps > hit[1]:
                    hit = (m, tps)
            self._rate[key] = hit
        return hit

    def latency_s(self, chain: Chain) -> float:
        """One token of one stream: sum_i t_i(1)."""
        return compose_round_s(self.step_times(chain, 1), 1)

    # ----------------------------------------------------------------- a partition ----

    def split_rows(self, partition: Partition) -> tuple[list[int], float]:
        """B rows water-filled over the pipelines (each next row where tokens/s gains most, within
        each pipeline's capacity; above WATER_STEPS rows, in equal chunks of ceil(B / WATER_STEPS)
        rows): (rows per pipeline, aggregate tokens/s)."""
        rows = [0] * len(partition)
        caps = [self.capacity(c) for c in partition]
        rates = [0.0] * len(partition)
        chunk = -(-self.batch // WATER_STEPS)

        def gain(i: int, left: int) -> tuple[float, int]:  # (minus tokens/s gained per row, rows given)
            more = min(chunk, left, caps[i] - rows[i])
            return -(self.rate(partition[i], rows[i] + more)[1] - rates[i]) / more, more

        left = self.batch
        heap = [(*gain(i, left), i) for i in range(len(partition)) if caps[i] >= 1]
        heapq.heapify(heap)
        while heap and left > 0:
            _, more, i = heapq.heappop(heap)
            more = min(more, left)
            rows[i] += more
            left -= more
            rates[i] = self.rate(partition[i], rows[i])[1]
            if rows[i] < caps[i] and left > 0:
                heapq.heappush(heap, (*gain(i, left), i))
        return rows, sum(rates)

    def better(self, a: tuple[float, Partition], b: tuple[float, Partition] | None) -> bool:
        """Whether (tokens/s, partition) `a` beats `b` under the tie rule of TIE_FRACTION."""
        if b is None:
            return True
        (va, pa), (vb, pb) = a, b
        if va > vb * (1 + TIE_FRACTION):
            return True
        if vb > va * (1 + TIE_FRACTION):
            return False
        ka = (len(pa), -sum(len(c) for c in pa), va)
        kb = (len(pb), -sum(len(c) for c in pb), vb)
        return ka > kb

    def best_of(self, partitions: Sequence[Partition]) -> tuple[Partition, list[int], float]:
        """The best candidate partition, its rows and aggregate tokens/s."""
        best: tuple[float, Partition] | None = None
        for part in partitions:
            if part:
                value = self.split_rows(part)[1]
                if self.better((value, part), best):
                    best = (value, part)
        assert best is not None
        rows, value = self.split_rows(best[1])
        return best[1], rows, value
