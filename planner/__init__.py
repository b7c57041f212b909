"""LogicPipe planner: device profiles + model spec + workload -> pipeline plan.

Pure: standard library only, no I/O, nothing else of LogicPipe imported. Modules:

    types.py       Link, DeviceProfile, Workload, Reserve, Objective, InfeasibleError
    model.py       ModelSpec (+ ModelSpec.decoder), weight formats, a mixture's active bytes
    plan.py        Stage, PlanMetadata, Plan
    cost.py        the one cost model (read its docstring first)
    instance.py    the cost model tabulated for the searches
    dp.py          exact DP (<= 8 devices)       heuristic.py   more devices
    bounds.py      lower bounds, infeasibility   strategies.py  uniform/memory/compute/mixed/custom
    digest.py      stable digests                artifact.py    plan JSON, reuse check
    table.py       plan as a text table          api.py         make_plan
"""
from logicpipe.planner.api import STRATEGIES, make_plan
from logicpipe.planner.artifact import PlanFormatError, plan_from_json, plan_to_json, reuse_mismatch
from logicpipe.planner.cost import build_stages, check_memory, plan_cost_s
from logicpipe.planner.digest import model_digest, profile_digest, profiles_digest
from logicpipe.planner.model import ModelSpec
from logicpipe.planner.plan import FORMAT_VERSION, Plan, PlanMetadata, Stage
from logicpipe.planner.table import format_model_note, format_plan_table
from logicpipe.planner.types import (
                           DEFAULT_LINK,
                           DEFAULT_RESERVE,
                           LOOPBACK,
                           DeviceProfile,
                           InfeasibleError,
                           Link,
                           NodeId,
                           Objective,
                           Reserve,
                           Workload,
)

__all__ = [
    "DEFAULT_LINK", "DEFAULT_RESERVE", "FORMAT_VERSION", "LOOPBACK", "STRATEGIES",
    "DeviceProfile", "InfeasibleError", "Link", "ModelSpec", "NodeId", "Objective", "Plan", "PlanFormatError",
    "PlanMetadata", "Reserve", "Stage", "Workload",
    "build_stages", "check_memory", "format_model_note", "format_plan_table", "make_plan", "model_digest", "plan_cost_s",
    "plan_from_json", "plan_to_json", "profile_digest", "profiles_digest", "reuse_mismatch",
]
