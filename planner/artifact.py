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
                 "compute_s": ..., "transfer_s": ..., "memory_bytes": ...,
                 "devices": ["node-a"]}, ...]}   (a tensor-parallel stage: ["node-a:0", "node-a:1"]; one
                                                  over several nodes, --tp-group: ["node-a", "node-b"])

A plan may also carry the decode prediction of `make_mesh_plan`: "micro_batches", "rows" and
"tokens_per_s" (read when present, 0 when absent; written only when set, so a version-1 plan
reads and writes as it did).

A mesh plan (format version 2; `MeshPlan`, several pipelines over disjoint nodes):

    {"format_version": 2, "objective": "throughput", "tokens_per_s": ..., "replicas_asked": 0,
     "workload": {"tokens_per_step": 1, "context_tokens": 2048, "batch": 16},
     "pipelines": [<a plan as above, with "micro_batches", "rows", "tokens_per_s">, ...]}

`mesh_plan_from_json` reads a version-1 plan too, as a mesh of that one pipeline.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable

from logicpipe.planner.digest import digest_of_nodes, model_digest, node_digests
from logicpipe.planner.mesh import MESH_FORMAT_VERSION, MeshPlan
from logicpipe.planner.model import ModelSpec
from logicpipe.planner.plan import FORMAT_VERSION, Plan, PlanMetadata, Stage
from logicpipe.planner.types import DeviceProfile, NodeId, Objective, Reserve, Workload


class PlanFormatError(ValueError):
    """A plan artifact that is not valid JSON or not a valid plan; the message names the field."""


# ------------------------------------------------------------------------------- write ----

def plan_to_dict(plan: Plan) -> dict:
    """The plan as plain JSON types (the artifact layout above)."""
    meta = plan.metadata
    out = {
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
                    "memory_bytes": s.memory_bytes, "devices": list(s.device_ids)} for s in plan.stages],
    }
    if plan.micro_batches or plan.rows or plan.tokens_per_s:
        out.update(micro_batches=plan.micro_batches, rows=plan.rows, tokens_per_s=plan.tokens_per_s)
    return out


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


def _stage(obj: object, index: int, prefix: str = "") -> Stage:
    where = f"{prefix}stages[{index}]"
    if not isinstance(obj, dict):
        raise PlanFormatError(f"plan JSON: {where} must be an object, got {type(obj).__name__}")
    start, end = _int(obj, "start", where), _int(obj, "end", where)
    if end <= start:
        raise PlanFormatError(f"plan JSON: {where} has end {end} <= start {start} (a stage holds at least one layer)")
    node = _str(obj, "node_id", where)
    if not node:
        raise PlanFormatError(f"plan JSON: {where}.node_id is empty")
    devices = _devices(obj, node, where)
    return Stage(node_id=NodeId(node), device_kind=_str(obj, "device_kind", where),
                 weight_format=_str(obj, "weight_format", where), start=start, end=end,
                 compute_s=_float(obj, "compute_s", where), transfer_s=_float(obj, "transfer_s", where),
                 memory_bytes=_int(obj, "memory_bytes", where), devices=len(devices),
                 members=tuple(devices) if len(devices) > 1 and all(":" not in d for d in devices) else ())


def _devices(obj: dict, node: str, where: str) -> list[str]:
    """The devices the stage lists under `devices` (optional: one, the node): node:gpu names of one node's
    devices, or node ids (the first `node`) of a stage over several nodes."""
    devices = obj.get("devices", [node])
    if not isinstance(devices, list) or not devices or not all(isinstance(d, str) and d for d in devices):
        raise PlanFormatError(f"plan JSON: {where}.devices must be a non-empty list of device names")
    if len(devices) > 1 and all(":" not in d for d in devices) and (devices[0] != node or len(set(devices)) < len(devices)):
        raise PlanFormatError(f"plan JSON: {where}.devices of a stage over several nodes must be distinct node ids, "
                              f"{node} first")
    return devices


def _metadata(doc: dict, version: int, prefix: str = "") -> PlanMetadata:
    meta = _obj(doc, "metadata", prefix.rstrip(".") or "plan")
    where = f"{prefix}metadata"
    nodes = _obj(meta, "node_digests", where)
    for node, digest in nodes.items():
        if not isinstance(digest, str):
            raise PlanFormatError(f"plan JSON: {where}.node_digests[{node!r}] must be a string, got {digest!r}")
    wl, rs = _obj(meta, "workload", where), _obj(meta, "reserve", where)
    workload = _workload(wl, f"{where}.workload")
    reserve = _build(f"{where}.reserve", Reserve, fraction=_float(rs, "fraction", f"{where}.reserve"),
                     fixed_bytes=_int(rs, "fixed_bytes", f"{where}.reserve"))
    return PlanMetadata(format_version=version, model_name=_str(meta, "model_name", where),
                        model_digest=_str(meta, "model_digest", where), profiles_digest=_str(meta, "profiles_digest", where),
                        node_digests=tuple(sorted((NodeId(k), v) for k, v in nodes.items())),
                        num_layers=_int(meta, "num_layers", where, 1), workload=workload, reserve=reserve)


def _workload(wl: dict, where: str) -> Workload:
    return _build(where, Workload, tokens_per_step=_int(wl, "tokens_per_step", where, 1),
                  context_tokens=_int(wl, "context_tokens", where, 1), batch=_int(wl, "batch", where, 1))


def plan_from_dict(doc: object, prefix: str = "") -> Plan:
    """A plan from the artifact layout; PlanFormatError naming the first bad field. `prefix`
    ("pipelines[1]." for a pipeline of a mesh plan) is put before every field named."""
    where = prefix.rstrip(".") or "plan"
    if not isinstance(doc, dict):
        raise PlanFormatError(f"plan JSON{': ' + where if prefix else ''} must be an object, got {type(doc).__name__}")
    version = _int(doc, "format_version", where, 1)
    try:
        objective = Objective.parse(_str(doc, "objective", where))
    except ValueError as exc:
        raise PlanFormatError(f"plan JSON: {prefix}{exc}") from None
    meta = _metadata(doc, version, prefix)
    raw_stages = _field(doc, "stages", where)
    if not isinstance(raw_stages, list) or not raw_stages:
        raise PlanFormatError(f"plan JSON: {prefix}stages must be a non-empty list")
    stages = tuple(_stage(s, i, prefix) for i, s in enumerate(raw_stages))
    expected = 0
    for i, s in enumerate(stages):
        if s.start != expected:
            raise PlanFormatError(f"plan JSON: {prefix}stages[{i}] starts at layer {s.start}, expected {expected} "
                                  f"(stages must be contiguous from 0)")
        expected = s.end
    if expected != meta.num_layers:
        raise PlanFormatError(f"plan JSON: {prefix}stages end at layer {expected} but {prefix}metadata.num_layers is {meta.num_layers}")
    seen = [s.node_id for s in stages]
    if len(set(seen)) != len(seen):
        raise PlanFormatError(f"plan JSON: a node appears in two stages{' of ' + where if prefix else ''}: {seen}")
    predicted = {key: (_int(doc, key, where) if key != "tokens_per_s" else _float(doc, key, where))
                 for key in ("micro_batches", "rows", "tokens_per_s") if key in doc}
    return Plan(stages=stages, objective=objective, strategy=_str(doc, "strategy", where),
                cost_s=_float(doc, "cost_s", where), lower_bound_s=_float(doc, "lower_bound_s", where),
                exact=_bool(doc, "exact", where), metadata=meta, **predicted)


def _load(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanFormatError(f"plan JSON is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except TypeError:
        raise PlanFormatError(f"plan JSON must be text, got {type(text).__name__}") from None


def plan_from_json(text: str) -> Plan:
    """Parse and validate a plan artifact; PlanFormatError (a ValueError) saying what is wrong."""
    return plan_from_dict(_load(text))


# -------------------------------------------------------------------------- mesh plans ----

def mesh_plan_to_dict(mesh: MeshPlan) -> dict:
    """The mesh plan as plain JSON types (format version 2, above)."""
    wl = mesh.workload
    pipelines = []
    for plan in mesh.pipelines:
        doc = plan_to_dict(plan)
        doc.update(micro_batches=plan.micro_batches, rows=plan.rows, tokens_per_s=plan.tokens_per_s)
        pipelines.append(doc)
    return {
        "format_version": MESH_FORMAT_VERSION,
        "objective": mesh.objective.value,
        "tokens_per_s": mesh.tokens_per_s,
        "replicas_asked": mesh.replicas_asked,
        "workload": {"tokens_per_step": wl.tokens_per_step, "context_tokens": wl.context_tokens, "batch": wl.batch},
        "pipelines": pipelines,
    }


def mesh_plan_to_json(mesh: MeshPlan) -> str:
    """The mesh plan artifact as indented JSON text."""
    return json.dumps(mesh_plan_to_dict(mesh), indent=2, allow_nan=False) + "\n"


def mesh_plan_from_dict(doc: object) -> MeshPlan:
    """A mesh plan from the version-2 layout, or a version-1 plan as a mesh of one pipeline;
    PlanFormatError naming the first bad field (or the node found in two pipelines)."""
    if not isinstance(doc, dict):
        raise PlanFormatError(f"plan JSON must be an object, got {type(doc).__name__}")
    version = _int(doc, "format_version", "plan", 1)
    if version == FORMAT_VERSION and "pipelines" not in doc:
        plan = plan_from_dict(doc)
        return MeshPlan(pipelines=(plan,), objective=plan.objective, workload=plan.metadata.workload,
                        tokens_per_s=plan.tokens_per_s, replicas_asked=1)
    if version != MESH_FORMAT_VERSION:
        raise PlanFormatError(f"plan JSON: format_version {version} is not a mesh plan ({MESH_FORMAT_VERSION}) "
                              f"or a single plan ({FORMAT_VERSION})")
    try:
        objective = Objective.parse(_str(doc, "objective", "plan"))
    except ValueError as exc:
        raise PlanFormatError(f"plan JSON: {exc}") from None
    workload = _workload(_obj(doc, "workload", "plan"), "workload")
    raw = _field(doc, "pipelines", "plan")
    if not isinstance(raw, list) or not raw:
        raise PlanFormatError("plan JSON: pipelines must be a non-empty list")
    pipelines = tuple(plan_from_dict(p, f"pipelines[{i}].") for i, p in enumerate(raw))
    owner: dict[str, int] = {}
    for i, plan in enumerate(pipelines):
        if plan.objective is not objective:
            raise PlanFormatError(f"plan JSON: pipelines[{i}].objective is {plan.objective.value}, the plan's {objective.value}")
        for node in plan.node_ids:
            if node in owner:
                raise PlanFormatError(f"plan JSON: node {node} appears in pipelines[{owner[node]}] and pipelines[{i}] "
                                      f"(pipelines must be disjoint)")
            owner[node] = i
    return MeshPlan(pipelines=pipelines, objective=objective, workload=workload,
                    tokens_per_s=_float(doc, "tokens_per_s", "plan"), replicas_asked=_int(doc, "replicas_asked", "plan"))


def mesh_plan_from_json(text: str) -> MeshPlan:
    """Parse and validate a mesh plan artifact (or a version-1 plan); PlanFormatError saying what is wrong."""
    return mesh_plan_from_dict(_load(text))


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


def mesh_reuse_mismatch(mesh: MeshPlan, model: ModelSpec, profiles: Iterable[DeviceProfile], objective: Objective | str,
                        workload: Workload | None = None, reserve: Reserve | None = None,
                        replicas: int | None = None) -> str | None:
    """`reuse_mismatch` for a mesh plan: None when it was made for exactly these inputs; else one
    sentence naming every difference. The model, profiles, objective and reserve are checked on
    pipeline 0 (all pipelines share them); `workload` against the mesh's, `replicas` (the cap asked
    for) against `replicas_asked`; both only when given. A version-1 plan read as a mesh is
    compared as it was (its workload is its own)."""
    reasons = []
    first = reuse_mismatch(mesh.pipelines[0], model, profiles, objective, reserve=reserve)
    if first:
        reasons.append(first)
    if workload is not None and mesh.workload != workload:
        reasons.append(f"workload differs: plan {mesh.workload}, now {workload}")
    if replicas is not None and mesh.replicas_asked != replicas:
        reasons.append(f"replicas differ: plan {mesh.replicas_asked}, now {replicas}")
    return "; ".join(reasons) if reasons else None
