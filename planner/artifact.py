"""The plan artifact: a plan as JSON a person can read and edit, read back with validation, and
the reuse check a controller runs before it trusts a saved plan.

Layout (format version 1):

    {"format_version": 1, "objective": "throughput", "strategy": "dp", "exact": true,
     "cost_s": ..., "lower_bound_s": ...,
     "metadata": {"model_name": ..., "model_digest": ..., "profiles_digest": ...,
                  "node_digests": {"node-a": "<sha256>", ...}, "num_layers": 30,
                  "workload": {"tokens_per_step": 1, "context_tokens": 2048, "batch": 1},
                  "reserve": {"fraction": 0.1, "fixed_bytes": 0}},
     "stages": [{"node_id": ..., "device_kind": ..., "weight_format": ..., "start": 0, "end": 16,
                 "compute_s": ..., "transfer_s": ..., "memory_bytes": ...}, ...]}
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable

from logicpipe.planner.digest import digest_of_nodes, model_digest, node_digests
from logicpipe.planner.model import ModelSpec
from logicpipe.planner.plan import FORMAT_VERSION, Plan, PlanMetadata, Stage
from logicpipe.planner.types import DeviceProfile, NodeId, Objective, Reserve, Workload


class PlanFormatError(ValueError):
    """A plan artifact that is not valid JSON or not a valid plan; the message names the field."""


# ------------------------------------------------------------------------------- write ----

def plan_to_dict(plan: Plan) -> dict:
    """The plan as plain JSON types (the artifact layout above)."""
    meta = plan.metadata
    return {
        "format_version": meta.format_version,
        "objective": plan.objective.value,
        "strategy": plan.strategy,
        "exact": plan.exact,
        "cost_s": plan.cost_s,
        "lower_bound_s": plan.lower_bound_s,
        "metadata": {
            "model_name": meta.model_name,
            "model_digest": meta.model_digest,
            "profiles_digest": meta.profiles_digest,
            "node_digests": dict(meta.node_digests),
            "num_layers": meta.num_layers,
            "workload": {"tokens_per_step": meta.workload.tokens_per_step,
                         "context_tokens": meta.workload.context_tokens, "batch": meta.workload.batch},
            "reserve": {"fraction": meta.reserve.fraction, "fixed_bytes": meta.reserve.fixed_bytes},
        },
        "stages": [{"node_id": s.node_id, "device_kind": s.device_kind, "weight_format": s.weight_format,
                    "start": s.start, "end": s.end, "compute_s": s.compute_s, "transfer_s": s.transfer_s,
                    "memory_bytes": s.memory_bytes} for s in plan.stages],
    }


def plan_to_json(plan: Plan) -> str:
    """The plan artifact as indented JSON text."""
    return json.dumps(plan_to_dict(plan), indent=2, allow_nan=False) + "\n"


# -------------------------------------------------------------------------------- read ----

def _field(obj: dict, key: str, where: str) -> object:
    if key not in obj:
        raise PlanFormatError(f"plan JSON: {where} is missing {key!r}")
    return obj[key]


def _obj(obj: dict, key: str, where: str) -> dict:
    value = _field(obj, key, where)
    if not isinstance(value, dict):
        raise PlanFormatError(f"plan JSON: {where}.{key} must be an object, got {type(value).__name__}")
    return value


def _str(obj: dict, key: str, where: str) -> str:
    value = _field(obj, key, where)
    if not isinstance(value, str):
        raise PlanFormatError(f"plan JSON: {where}.{key} must be a string, got {value!r}")
    return value


def _int(obj: dict, key: str, where: str, minimum: int = 0) -> int:
    value = _field(obj, key, where)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise PlanFormatError(f"plan JSON: {where}.{key} must be an integer >= {minimum}, got {value!r}")
    return value


def _float(obj: dict, key: str, where: str) -> float:
    value = _field(obj, key, where)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise PlanFormatError(f"plan JSON: {where}.{key} must be a finite number >= 0, got {value!r}")
    return float(value)


def _bool(obj: dict, key: str, where: str) -> bool:
    value = _field(obj, key, where)
    if not isinstance(value, bool):
        raise PlanFormatError(f"plan JSON: {where}.{key} must be true or false, got {value!r}")
    return value


def _build(what: str, factory, **kwargs):
    try:
        return factory(**kwargs)
    except ValueError as exc:
        raise PlanFormatError(f"plan JSON: {what}: {exc}") from None


def _stage(obj: object, index: int) -> Stage:
    where = f"stages[{index}]"
    if not isinstance(obj, dict):
        raise PlanFormatError(f"plan JSON: {where} must be an object, got {type(obj).__name__}")
    start, end = _int(obj, "start", where), _int(obj, "end", where)
    if end <= start:
        raise PlanFormatError(f"plan JSON: {where} has end {end} <= start {start} (a stage holds at least one layer)")
    node = _str(obj, "node_id", where)
    if not node:
        raise PlanFormatError(f"plan JSON: {where}.node_id is empty")
    return Stage(node_id=NodeId(node), device_kind=_str(obj, "device_kind", where),
                 weight_format=_str(obj, "weight_format", where), start=start, end=end,
                 compute_s=_float(obj, "compute_s", where), transfer_s=_float(obj, "transfer_s", where),
                 memory_bytes=_int(obj, "memory_bytes", where))


def _metadata(doc: dict, version: int) -> PlanMetadata:
    meta = _obj(doc, "metadata", "plan")
    where = "metadata"
    nodes = _obj(meta, "node_digests", where)
    for node, digest in nodes.items():
        if not isinstance(digest, str):
            raise PlanFormatError(f"plan JSON: metadata.node_digests[{node!r}] must be a string, got {digest!r}")
    wl, rs = _obj(meta, "workload", where), _obj(meta, "reserve", where)
    workload = _build("metadata.workload", Workload, tokens_per_step=_int(wl, "tokens_per_step", "metadata.workload", 1),
                      context_tokens=_int(wl, "context_tokens", "metadata.workload", 1), batch=_int(wl, "batch", "metadata.workload", 1))
    reserve = _build("metadata.reserve", Reserve, fraction=_float(rs, "fraction", "metadata.reserve"),
                     fixed_bytes=_int(rs, "fixed_bytes", "metadata.reserve"))
    return PlanMetadata(format_version=version, model_name=_str(meta, "model_name", where),
                        model_digest=_str(meta, "model_digest", where), profiles_digest=_str(meta, "profiles_digest", where),
                        node_digests=tuple(sorted((NodeId(k), v) for k, v in nodes.items())),
                        num_layers=_int(meta, "num_layers", where, 1), workload=workload, reserve=reserve)


def plan_from_dict(doc: object) -> Plan:
    """A plan from the artifact layout; PlanFormatError naming the first bad field."""
    if not isinstance(doc, dict):
        raise PlanFormatError(f"plan JSON must be an object, got {type(doc).__name__}")
    version = _int(doc, "format_version", "plan", 1)
    try:
        objective = Objective.parse(_str(doc, "objective", "plan"))
    except ValueError as exc:
        raise PlanFormatError(f"plan JSON: {exc}") from None
    meta = _metadata(doc, version)
    raw_stages = _field(doc, "stages", "plan")
    if not isinstance(raw_stages, list) or not raw_stages:
        raise PlanFormatError("plan JSON: stages must be a non-empty list")
    stages = tuple(_stage(s, i) for i, s in enumerate(raw_stages))
    expected = 0
    for i, s in enumerate(stages):
        if s.start != expected:
            raise PlanFormatError(f"plan JSON: stages[{i}] starts at layer {s.start}, expected {expected} (stages must be contiguous from 0)")
        expected = s.end
    if expected != meta.num_layers:
        raise PlanFormatError(f"plan JSON: stages end at layer {expected} but metadata.num_layers is {meta.num_layers}")
    seen = [s.node_id for s in stages]
    if len(set(seen)) != len(seen):
        raise PlanFormatError(f"plan JSON: a node appears in two stages: {seen}")
    return Plan(stages=stages, objective=objective, strategy=_str(doc, "strategy", "plan"),
                cost_s=_float(doc, "cost_s", "plan"), lower_bound_s=_float(doc, "lower_bound_s", "plan"),
                exact=_bool(doc, "exact", "plan"), metadata=meta)


def plan_from_json(text: str) -> Plan:
    """Parse and validate a plan artifact; PlanFormatError (a ValueError) saying what is wrong."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanFormatError(f"plan JSON is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except TypeError:
        raise PlanFormatError(f"plan JSON must be text, got {type(text).__name__}") from None
    return plan_from_dict(doc)


# ------------------------------------------------------------------------------- reuse ----

def _short(digest: str) -> str:
    return digest[:12]


def reuse_mismatch(plan: Plan, model: ModelSpec, profiles: Iterable[DeviceProfile], objective: Objective | str,
                   workload: Workload | None = None, reserve: Reserve | None = None) -> str | None:
    """None when `plan` was made for exactly these inputs and may be reused; else one sentence
    naming every difference ("model digest differs: plan abc123, now def456; profile of node X
    changed"). `workload` and `reserve` are compared only when given."""
    meta = plan.metadata
    reasons: list[str] = []
    if meta.format_version != FORMAT_VERSION:
        reasons.append(f"format version {meta.format_version} != {FORMAT_VERSION}")
    now_model = model_digest(model)
    if meta.model_digest != now_model:
        reasons.append(f"model digest differs: plan {_short(meta.model_digest)}, now {_short(now_model)}")
    now_nodes = dict(node_digests(profiles))
    then_nodes = dict(meta.node_digests)
    for node in sorted(set(then_nodes) | set(now_nodes)):
        if node not in now_nodes:
            reasons.append(f"node {node} is gone")
        elif node not in then_nodes:
            reasons.append(f"node {node} is new")
        elif then_nodes[node] != now_nodes[node]:
            reasons.append(f"profile of node {node} changed")
    if not reasons and meta.profiles_digest != digest_of_nodes(now_nodes.items()):
        reasons.append("profiles digest differs")
    objective = Objective.parse(objective)
    if plan.objective is not objective:
        reasons.append(f"objective differs: plan {plan.objective.value}, now {objective.value}")
    if workload is not None and meta.workload != workload:
        reasons.append(f"workload differs: plan {meta.workload}, now {workload}")
    if reserve is not None and meta.reserve != reserve:
        reasons.append(f"memory reserve differs: plan {meta.reserve}, now {reserve}")
    return "; ".join(reasons) if reasons else None
