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
    width.py       a --tp-max node's width    hosts.py       a stage over several nodes (--tp-group)
    mesh.py        MeshPlan, make_mesh_plan: pipelines (replicas) over disjoint nodes
    evaluate.py    evaluate_mesh: pipelines in force costed again at a workload
    replicas.py    the replica search      mesh_search.py  its tables: a chain's tokens/s at R rows
"""
from logicpipe.planner.api import STRATEGIES, make_plan
from logicpipe.planner.artifact import (
                           PlanFormatError,
                           mesh_plan_from_json,
                           mesh_plan_to_json,
                           mesh_reuse_mismatch,
                           plan_from_json,
                           plan_to_json,
                           reuse_mismatch,
)
from logicpipe.planner.cost import (
                           DEFAULT_STEP_OVERHEAD_S,
                           best_micro_batches,
                           build_stages,
                           check_memory,
                           pipeline_round_s,
                           pipeline_tokens_per_s,
                           plan_cost_s,
                           step_times_s,
)
from logicpipe.planner.digest import model_digest, profile_digest, profiles_digest
from logicpipe.planner.evaluate import evaluate_mesh
from logicpipe.planner.hosts import apply_groups, auto_groups, group_profile, parse_groups
from logicpipe.planner.mesh import MESH_FORMAT_VERSION, MeshPlan, make_mesh_plan
from logicpipe.planner.model import ModelSpec
from logicpipe.planner.plan import FORMAT_VERSION, Plan, PlanMetadata, Stage
from logicpipe.planner.table import format_mesh_plan_table, format_model_note, format_plan_table
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
    "DEFAULT_LINK", "DEFAULT_RESERVE", "DEFAULT_STEP_OVERHEAD_S", "FORMAT_VERSION", "LOOPBACK", "MESH_FORMAT_VERSION",
    "STRATEGIES",
    "DeviceProfile", "InfeasibleError", "Link", "MeshPlan", "ModelSpec", "NodeId", "Objective", "Plan", "PlanFormatError",
    "PlanMetadata", "Reserve", "Stage", "Workload",
    "apply_groups", "auto_groups", "best_micro_batches", "build_stages", "check_memory", "evaluate_mesh", "format_mesh_plan_table", "format_model_note",
    "format_plan_table", "group_profile", "make_mesh_plan", "make_plan", "mesh_plan_from_json", "mesh_plan_to_json",
    "mesh_reuse_mismatch", "model_digest", "parse_groups", "pipeline_round_s", "pipeline_tokens_per_s", "plan_cost_s",
    "plan_from_json", "plan_to_json", "profile_digest", "profiles_digest", "reuse_mismatch", "step_times_s",
]
