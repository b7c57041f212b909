"""The planner's entry point: profiles + model + workload -> Plan.

    make_plan(profiles, model, workload)                       # DP, throughput
    make_plan(profiles, model, workload, Objective.LATENCY)    # DP, latency
    make_plan(profiles, model, workload, strategy="memory")    # a fixed strategy, given order
    make_plan(profiles, model, workload, strategy="custom", boundaries=[(0, 15), (16, 29)])

A node that offers several devices (`max_devices`, --tp-max) is planned at every width that divides
the model, the cheapest plan kept (`width.py`).
"dp" picks devices, order and split: exactly for up to EXACT_MAX_DEVICES devices that can take
part (`dp.py`), by the heuristic of `heuristic.py` above that (the plan then reports its gap to a
lower bound). The fixed strategies of `strategies.py` keep every device in the order given.
Every plan is costed by `cost.py` and checked against memory.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence

from logicpipe.planner.bounds import infeasibility_message, lower_bound_s
from logicpipe.planner.cost import build_stages, check_memory, plan_cost_s
from logicpipe.planner.digest import make_metadata
from logicpipe.planner.dp import EXACT_MAX_DEVICES, min_bottleneck_exact, min_latency_exact
from logicpipe.planner.heuristic import heuristic_chain
from logicpipe.planner.instance import Chain, eligible_profiles, make_instance
from logicpipe.planner.model import ModelSpec
from logicpipe.planner.plan import Plan
from logicpipe.planner.strategies import FIXED_STRATEGIES, strategy_counts
from logicpipe.planner.width import best_over_widths, flexible
from logicpipe.planner.types import (
    DEFAULT_RESERVE,
    DeviceProfile,
    InfeasibleError,
    Objective,
    Reserve,
    Workload,
    unique_profiles,
)

log = logging.getLogger(__name__)

STRATEGIES = ("dp", *FIXED_STRATEGIES)


def _dp_chain(profiles: Sequence[DeviceProfile], model: ModelSpec, workload: Workload, objective: Objective,
              reserve: Reserve) -> tuple[list[DeviceProfile], list[int], bool, float]:
    """(devices in order, layer counts, exact?, lower bound) chosen by the DP or the heuristic."""
    message = infeasibility_message(profiles, model, workload, reserve)
    if message is not None:
        raise InfeasibleError(message)
    inst = make_instance(eligible_profiles(profiles, model, workload, reserve), model, workload, reserve)
    bound = lower_bound_s(inst, objective)
    exact = inst.n <= EXACT_MAX_DEVICES
    chain: Chain | None
    if not exact:
        chain = heuristic_chain(inst, objective, bound)
    elif objective is Objective.THROUGHPUT:
        chain = min_bottleneck_exact(inst, bound)
    else:
        chain = min_latency_exact(inst)
    if chain is None:  # cannot happen when infeasibility_message said it fits; kept as a guard
        raise InfeasibleError(f"no placement of model {model.name} fits the {len(profiles)} devices")
    log.debug("dp over %d of %d devices (%s): %s", inst.n, len(profiles), "exact" if exact else "heuristic", chain)
    return [inst.profiles[d] for d, _ in chain], [k for _, k in chain], exact, bound


def make_plan(
    profiles: Iterable[DeviceProfile],
    model: ModelSpec,
    workload: Workload,
    objective: Objective | str = Objective.THROUGHPUT,
    strategy: str = "dp",
    boundaries: Sequence[Sequence[int]] | None = None,
    *,
    reserve: Reserve = DEFAULT_RESERVE,
    mix: float = 0.5,
) -> Plan:
    """Plan the pipeline.

    profiles:   every device that may take part (node ids unique).
    objective:  Objective.THROUGHPUT (min bottleneck) or Objective.LATENCY (min sum), or its value.
    strategy:   "dp" (choose devices, order, split) or a fixed strategy over all devices in the
                given order: "uniform", "memory", "compute", "mixed", "custom".
    boundaries: for "custom" only: one (first, last) inclusive layer pair per device.
    reserve:    memory every device keeps free (default: 10% of its memory).
    mix:        for "mixed" only: weight of the memory share against the compute share.

    Raises InfeasibleError (a ValueError) when the model does not fit, naming the missing memory
    or the overflowing stage; ValueError for bad arguments.
    """
    devices = unique_profiles(profiles)
    objective = Objective.parse(objective)
    if not flexible(devices):
        return _make_plan(devices, model, workload, objective, strategy, boundaries, reserve, mix)
    plan = best_over_widths(devices, model, lambda ps: _make_plan(ps, model, workload, objective, strategy, boundaries,
                                                                   reserve, mix), lambda p: p.cost_s, higher=False)
    return with_profiles(plan, devices, model)


def with_profiles(plan: Plan, devices: Sequence[DeviceProfile], model: ModelSpec) -> Plan:
    """`plan` with the metadata of the profiles as the nodes gave them (not as the widths tried made
    them), so a saved plan is reused while they stay the same."""
    meta = plan.metadata
    return dataclasses.replace(plan, metadata=make_metadata(devices, model, meta.workload, meta.reserve))


def _make_plan(devices: Sequence[DeviceProfile], model: ModelSpec, workload: Workload, objective: Objective,
               strategy: str, boundaries: Sequence[Sequence[int]] | None, reserve: Reserve, mix: float) -> Plan:
    """make_plan over profiles of fixed widths."""
    if strategy == "dp":
        if boundaries is not None:
            raise ValueError("boundaries are only used by strategy 'custom', not 'dp'")
        order, counts, exact, bound = _dp_chain(devices, model, workload, objective, reserve)
    elif strategy in FIXED_STRATEGIES:
        order = list(devices)
        counts = strategy_counts(strategy, order, model, workload, reserve, boundaries=boundaries, mix=mix)
        exact, bound = False, 0.0
    else:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of: {', '.join(STRATEGIES)}")
    stages = build_stages(order, counts, model, workload)
    check_memory(stages, {p.node_id: p for p in devices}, model, reserve)
    cost = plan_cost_s(stages, objective)
    if exact:
        bound = cost
    elif strategy != "dp":
        inst = make_instance(eligible_profiles(devices, model, workload, reserve), model, workload, reserve)
        bound = lower_bound_s(inst, objective)
    return Plan(stages=stages, objective=objective, strategy=strategy, cost_s=cost, lower_bound_s=bound,
                exact=exact, metadata=make_metadata(devices, model, workload, reserve))
