"""A mesh plan: pipelines (replicas) over disjoint nodes, and `make_mesh_plan` that chooses them.

    make_mesh_plan(profiles, model, workload)                  # as many pipelines as pay, throughput
    make_mesh_plan(profiles, model, workload, replicas=2)      # at most two pipelines
    make_mesh_plan(profiles, model, workload, "latency")       # the fastest pipeline for one stream first
    make_mesh_plan(profiles, model, workload, strategy="memory")  # one pipeline, every device, given order

THROUGHPUT: the pipelines, their splits and the share of `workload.batch` concurrent sequences each
serves that give the most predicted decode tokens/s in total at `workload.context_tokens` of
context (the round model of `cost.py`, the search of `replicas.py`); each pipeline holds the KV of
its share (at least one sequence). LATENCY: pipeline 0 is the one whose token trip for one stream,
sum_i t_i(1), is shortest; with `replicas` other than 1 the devices left form more such pipelines.
Each pipeline of a latency plan holds the KV of `workload.batch` sequences, as `make_plan` does.
The fixed strategies keep their meaning: one pipeline over every device in the order given.
`workload.tokens_per_step` is not used: a decode step is one token per sequence.
A node that offers several devices (`max_devices`, --tp-max) is planned at every width that divides the
model, the plan of the most predicted tokens/s kept (`width.py`): the width beside depth and replicas.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from logicpipe.planner.bounds import infeasibility_message
from logicpipe.planner.cost import (
    best_micro_batches,
    build_stages,
    check_memory,
    micro_batch_rows,
    micro_workload,
    plan_cost_s,
)
from logicpipe.planner.digest import make_metadata
from logicpipe.planner.instance import Chain, eligible_profiles
from logicpipe.planner.model import ModelSpec
from logicpipe.planner.plan import Plan, PlanMetadata, Stage
from logicpipe.planner.mesh_search import MeshSearch
from logicpipe.planner.replicas import latency_partition, throughput_partition
from logicpipe.planner.strategies import FIXED_STRATEGIES, strategy_counts
from logicpipe.planner.width import best_over_widths, flexible
from logicpipe.planner.types import (
    DEFAULT_RESERVE,
    DeviceProfile,
    InfeasibleError,
    NodeId,
    Objective,
    Reserve,
    Workload,
    unique_profiles,
)

log = logging.getLogger(__name__)

MESH_FORMAT_VERSION = 2
"""Version of the mesh plan artifact (a set of pipelines); a single plan's artifact is version 1."""


@dataclass(frozen=True)
class MeshPlan:
    """Pipelines over disjoint nodes; pipeline 0 first (for LATENCY the fastest for one stream)."""

    pipelines: tuple[Plan, ...]  # each an ordered pipeline; no node in two of them
    objective: Objective         # what the search maximized
    workload: Workload           # batch: the concurrency the plan was costed for; context_tokens: the context
    tokens_per_s: float          # predicted decode tokens/s: all pipelines at `workload` (THROUGHPUT), one stream (LATENCY)
    replicas_asked: int          # the cap on pipelines that was given; 0: the planner chose

    def __post_init__(self) -> None:
        pipelines = tuple(self.pipelines)
        if not pipelines or not all(isinstance(p, Plan) for p in pipelines):
            raise ValueError("a mesh plan needs at least one pipeline (Plan)")
        object.__setattr__(self, "pipelines", pipelines)
        seen: dict[str, int] = {}
        for i, plan in enumerate(pipelines):
            for node in plan.node_ids:
                if node in seen:
                    raise ValueError(f"node {node} appears in pipelines {seen[node]} and {i}: pipelines must be disjoint")
                seen[node] = i
        if not isinstance(self.replicas_asked, int) or self.replicas_asked < 0:
            raise ValueError(f"replicas_asked must be an integer >= 0, got {self.replicas_asked!r}")

    @property
    def node_ids(self) -> tuple[NodeId, ...]:
        """Every node taking part: pipeline by pipeline, each in pipeline order."""
        return tuple(node for plan in self.pipelines for node in plan.node_ids)

    @property
    def stages(self) -> tuple[Stage, ...]:
        """Every stage of every pipeline, pipeline by pipeline."""
        return tuple(stage for plan in self.pipelines for stage in plan.stages)

    @property
    def metadata(self) -> PlanMetadata:
        """What the plan was made from (pipeline 0's; all share the model, profiles and reserve)."""
        return self.pipelines[0].metadata

    @property
    def idle_node_ids(self) -> tuple[NodeId, ...]:
        """Nodes that were offered but take no part, sorted."""
        used = set(self.node_ids)
        return tuple(node for node, _ in self.metadata.node_digests if node not in used)

    @property
    def rows(self) -> int:
        """Sequences the pipelines serve together (their predicted shares added up)."""
        return sum(p.rows for p in self.pipelines)


def _pipeline(order: Sequence[DeviceProfile], counts: Sequence[int], model: ModelSpec, workload: Workload,
              objective: Objective, strategy: str, rows: int, held: int, micro_batches: int, tokens_per_s: float,
              devices: Sequence[DeviceProfile], reserve: Reserve) -> Plan:
    """One pipeline as a Plan: stage times for one micro-batch, memory for `held` sequences."""
    r = micro_batch_rows(max(1, rows), micro_batches)
    stages = build_stages(order, counts, model, micro_workload(r, workload.context_tokens))
    resident = Workload(tokens_per_step=r, context_tokens=workload.context_tokens, batch=held)
    memory = build_stages(order, counts, model, resident)
    stages = tuple(dataclasses.replace(s, memory_bytes=m.memory_bytes) for s, m in zip(stages, memory))
    check_memory(stages, {p.node_id: p for p in order}, model, reserve)
    return Plan(stages=stages, objective=objective, strategy=strategy, cost_s=plan_cost_s(stages, objective),
                lower_bound_s=0.0, exact=False, metadata=make_metadata(devices, model, resident, reserve),
                micro_batches=micro_batches, rows=rows, tokens_per_s=tokens_per_s)


def _from_chains(search: MeshSearch, chains: Sequence[Chain], rows: Sequence[int], held: Sequence[int],
                 workload: Workload, objective: Objective, devices: Sequence[DeviceProfile], model: ModelSpec,
                 reserve: Reserve) -> tuple[Plan, ...]:
    out = []
    for chain, r, h in zip(chains, rows, held):
        m, tps = search.rate(chain, r)
        out.append(_pipeline([search.profiles[d] for d, _ in chain], [k for _, k in chain], model, workload, objective,
                             "dp", r, h, m, tps, devices, reserve))
    return tuple(out)


def _infeasible(devices: Sequence[DeviceProfile], model: ModelSpec, workload: Workload, reserve: Reserve,
                rows: int) -> InfeasibleError:
    held = Workload(tokens_per_step=1, context_tokens=workload.context_tokens, batch=rows)
    message = infeasibility_message(devices, model, held, reserve)
    return InfeasibleError(message or f"no pipeline of model {model.name} fits the {len(devices)} devices")


def make_mesh_plan(
    profiles: Iterable[DeviceProfile],
    model: ModelSpec,
    workload: Workload,
    objective: Objective | str = Objective.THROUGHPUT,
    strategy: str = "dp",
    boundaries: Sequence[Sequence[int]] | None = None,
    *,
    replicas: int = 0,
    reserve: Reserve = DEFAULT_RESERVE,
    mix: float = 0.5,
) -> MeshPlan:
    """Plan the mesh (module docstring).

    replicas:  0: as many pipelines as the prediction favours; N >= 1: at most N ("dp" only).
    strategy, boundaries, mix: as `make_plan`; a fixed strategy gives one pipeline over all devices.

    Raises InfeasibleError when no pipeline fits (naming the memory missing); ValueError for bad
    arguments.
    """
    devices = unique_profiles(profiles)
    objective = Objective.parse(objective)
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
        raise ValueError(f"replicas must be an integer >= 0 (0: the planner chooses), got {replicas!r}")
    if not flexible(devices):
        return _mesh_plan(devices, model, workload, objective, strategy, boundaries, replicas, reserve, mix)
    mesh = best_over_widths(devices, model, lambda ps: _mesh_plan(ps, model, workload, objective, strategy, boundaries,
                                                                   replicas, reserve, mix),
                            lambda m: m.tokens_per_s, higher=True)
    pipelines = tuple(dataclasses.replace(p, metadata=make_metadata(devices, model, p.metadata.workload, reserve))
                      for p in mesh.pipelines)
    return dataclasses.replace(mesh, pipelines=pipelines)


def _mesh_plan(devices: Sequence[DeviceProfile], model: ModelSpec, workload: Workload, objective: Objective,
               strategy: str, boundaries: Sequence[Sequence[int]] | None, replicas: int, reserve: Reserve,
               mix: float) -> MeshPlan:
    """make_mesh_plan over profiles of fixed widths."""
    if strategy in FIXED_STRATEGIES:
        order = list(devices)
        counts = strategy_counts(strategy, order, model, workload, reserve, boundaries=boundaries, mix=mix)
        rows = 1 if objective is Objective.LATENCY else workload.batch
        m, tps = best_micro_batches(order, counts, model, rows, workload.context_tokens)
        plan = _pipeline(order, counts, model, workload, objective, strategy, rows, workload.batch, m, tps, devices, reserve)
        return MeshPlan(pipelines=(plan,), objective=objective, workload=workload, tokens_per_s=tps, replicas_asked=replicas)
    if strategy != "dp":
        raise ValueError(f"unknown strategy {strategy!r}; expected one of: dp, {', '.join(FIXED_STRATEGIES)}")
    if boundaries is not None:
        raise ValueError("boundaries are only used by strategy 'custom', not 'dp'")
    one_row = Workload(tokens_per_step=1, context_tokens=workload.context_tokens, batch=1)
    eligible = eligible_profiles(devices, model, one_row, reserve)
    if objective is Objective.LATENCY:
        search = MeshSearch(eligible, model, workload, reserve, dp_rows=1)
        chains = latency_partition(search, replicas) if eligible else ()
        if not chains:
            raise _infeasible(devices, model, workload, reserve, workload.batch)
        pipelines = _from_chains(search, chains, [1] * len(chains), [workload.batch] * len(chains), workload, objective,
                                 devices, model, reserve)
        total = pipelines[0].tokens_per_s
    else:
        search = MeshSearch(eligible, model, workload, reserve)
        chains, rows, total = throughput_partition(search, replicas) if eligible else ((), [], 0.0)
        if not chains:
            raise _infeasible(devices, model, workload, reserve, 1)
        pipelines = _from_chains(search, chains, rows, [max(1, r) for r in rows], workload, objective, devices, model,
                                 reserve)
        pipelines = tuple(sorted(pipelines, key=lambda p: (-p.tokens_per_s, len(p.stages))))  # the fastest first
        total = sum(p.tokens_per_s for p in pipelines)
    log.debug("mesh plan: %d pipelines (%s), %.1f tok/s predicted, %d DP calls", len(pipelines),
              ", ".join(str(len(p.stages)) for p in pipelines), total, search.dp_calls)
    return MeshPlan(pipelines=pipelines, objective=objective, workload=workload, tokens_per_s=total, replicas_asked=replicas)
