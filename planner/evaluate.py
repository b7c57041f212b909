"""Pipelines that exist, costed again: `evaluate_mesh` takes the pipelines a controller has in
force (or keeps, or adds to) and predicts what they do at a workload, by the same round model
`make_mesh_plan` chooses by (`cost.py`), so a plan in force and a new one compare on equal terms.

THROUGHPUT: the workload's `batch` sequences are split between the pipelines as a router that
sends each next request where it adds most spreads them (water-filling on the predicted tokens/s
of each pipeline at its rows); each pipeline runs its best number of micro-batches for its share.
LATENCY: one stream on each; the plan's figure is pipeline 0's.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from functools import lru_cache

from logicpipe.planner.cost import best_micro_batches, build_stages, memory_overflow_bytes
from logicpipe.planner.mesh import MeshPlan
from logicpipe.planner.model import ModelSpec
from logicpipe.planner.plan import Plan
from logicpipe.planner.types import DEFAULT_RESERVE, DeviceProfile, Objective, Reserve, Workload
from logicpipe.planner.width import as_planned


def split_rows(rates: Sequence, rows: int, holds: Sequence | None = None) -> list[int]:
    """`rows` sequences over the pipelines whose tokens/s at r rows is `rates[i](r)`: each next
    row to the pipeline it adds most tokens/s to (ties: the lower index), among those that hold the
    KV of one more (`holds[i](r)`: whether pipeline i holds r sequences; rows no pipeline holds
    are left out: they would queue)."""
    shares = [0] * len(rates)
    for _ in range(rows):
        room = [i for i, r in enumerate(shares) if holds is None or holds[i](r + 1)]
        if not room:
            break
        best = max(room, key=lambda i: (rates[i](shares[i] + 1) - rates[i](shares[i]), -i))
        shares[best] += 1
    return shares


def evaluate_mesh(plans: Iterable[Plan], profiles: Iterable[DeviceProfile], model: ModelSpec, workload: Workload,
                  objective: Objective | str = Objective.THROUGHPUT, *, replicas: int = 0,
                  reserve: Reserve = DEFAULT_RESERVE) -> MeshPlan:
    """`plans` (their nodes and layer ranges as they are) as one MeshPlan predicted at `workload`:
    each Plan's `rows`, `micro_batches` and `tokens_per_s` set anew, its stages kept. ValueError
    when there is no plan, or a stage's node has no profile here."""
    plans = tuple(plans)
    if not plans:
        raise ValueError("no pipeline to evaluate")
    objective = Objective.parse(objective)
    by_id = {p.node_id: p for p in profiles}
    missing = [s.node_id for plan in plans for s in plan.stages if s.node_id not in by_id]
    if missing:
        raise ValueError(f"no profile for node {missing[0]} of the pipelines to evaluate")
    shapes = [([as_planned(by_id[s.node_id], s.devices) for s in plan.stages], [s.num_layers for s in plan.stages])
              for plan in plans]
    context = workload.context_tokens

    def rate_of(i: int):
        order, counts = shapes[i]

        @lru_cache(maxsize=None)
        def best(rows: int) -> tuple[int, float]:
            return best_micro_batches(order, counts, model, rows, context)

        return best

    def holds_of(i: int):
        order, counts = shapes[i]

        @lru_cache(maxsize=None)
        def holds(rows: int) -> bool:  # its stages hold the KV of `rows` sequences at the context
            stages = build_stages(order, counts, model, Workload(context_tokens=context, batch=rows))
            return rows <= 1 or all(memory_overflow_bytes(s, p, reserve) <= 0 for s, p in zip(stages, order))

        return holds

    best = [rate_of(i) for i in range(len(plans))]
    if objective is Objective.LATENCY:
        rows = [1] * len(plans)
    else:
        rows = split_rows([lambda r, b=b: b(r)[1] for b in best], workload.batch,
                          [holds_of(i) for i in range(len(plans))])
    pipelines = []
    for plan, b, r in zip(plans, best, rows):
        m, tps = b(r)
        pipelines.append(dataclasses.replace(plan, rows=r, micro_batches=m, tokens_per_s=tps))
    total = pipelines[0].tokens_per_s if objective is Objective.LATENCY else sum(p.tokens_per_s for p in pipelines)
    return MeshPlan(pipelines=tuple(pipelines), objective=objective, workload=workload, tokens_per_s=total,
                    replicas_asked=replicas)
