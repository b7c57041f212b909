"""A plan as an aligned text table for people (`lpctl plan`, logs, the README)."""
from __future__ import annotations

from logicpipe.planner.mesh import MeshPlan
from logicpipe.planner.model import ModelSpec
from logicpipe.planner.plan import Plan
from logicpipe.planner.types import Objective
from logicpipe.planner.units import format_bytes, format_ms

_HEADERS = ("#", "node", "device", "layers", "memory", "compute ms", "transfer ms", "stage ms")
_RIGHT = {0, 4, 5, 6, 7}  # numeric columns are right-aligned


def _rows(plan: Plan) -> list[tuple[str, ...]]:
    return [(str(i), s.node_id, (s.device_kind if s.weight_format == "" else f"{s.device_kind} {s.weight_format}")
             + (f" x{s.devices}" if s.devices > 1 else ""),  # (a tensor-parallel stage: its width)
             f"{s.start}-{s.end - 1} ({s.num_layers})", format_bytes(s.memory_bytes),
             format_ms(s.compute_s), format_ms(s.transfer_s), format_ms(s.total_s))
            for i, s in enumerate(plan.stages)]


def _footer(plan: Plan) -> str:
    what = "bottleneck" if plan.objective is Objective.THROUGHPUT else "sum"
    text = (f"objective {plan.objective.value}: {what} {format_ms(plan.cost_s)} ms per step; "
            f"strategy {plan.strategy}, {len(plan.stages)} stages, {plan.metadata.num_layers} layers")
    if plan.exact:
        return text + " (optimal)"
    return text + f"; lower bound {format_ms(plan.lower_bound_s)} ms, gap {plan.gap * 100:.1f}%"


def _table(plan: Plan) -> list[str]:
    rows = [_HEADERS, *_rows(plan)]
    widths = [max(len(row[c]) for row in rows) for c in range(len(_HEADERS))]

    def line(row: tuple[str, ...]) -> str:
        cells = [cell.rjust(w) if c in _RIGHT else cell.ljust(w) for c, (cell, w) in enumerate(zip(row, widths))]
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return [line(rows[0]), rule, *(line(r) for r in rows[1:])]


def format_plan_table(plan: Plan) -> str:
    """Columns: stage #, node, device kind (+ weight format), layers "a-b (count)" inclusive,
    memory, compute / transfer / stage ms per step; a footer with the objective's value."""
    return "\n".join([*_table(plan), _footer(plan)])


def format_mesh_plan_table(mesh: MeshPlan) -> str:
    """One table per pipeline (the columns of `format_plan_table`; compute and transfer for one
    micro-batch) under "pipeline i: N stages, m micro-batches, R rows, predicted X tok/s", then a
    footer with the aggregate prediction and the idle nodes."""
    lines: list[str] = []
    for i, plan in enumerate(mesh.pipelines):
        if i:
            lines.append("")
        lines.append(f"pipeline {i}: {len(plan.stages)} stages, {plan.micro_batches} micro-batches, {plan.rows} rows, "
                     f"predicted {plan.tokens_per_s:.1f} tok/s")
        lines.extend(_table(plan))
    wl = mesh.workload
    if mesh.objective is Objective.THROUGHPUT:
        what = f"{mesh.tokens_per_s:.1f} tok/s predicted for {wl.batch} sequences at {wl.context_tokens} tokens of context"
    else:
        what = f"{mesh.tokens_per_s:.1f} tok/s predicted for one stream at {wl.context_tokens} tokens of context (pipeline 0)"
    cap = f"at most {mesh.replicas_asked}" if mesh.replicas_asked else "chosen by the planner"
    idle = ", ".join(mesh.idle_node_ids) or "none"
    lines.append(f"objective {mesh.objective.value}: {len(mesh.pipelines)} pipelines ({cap}), {what}; idle nodes: {idle}")
    return "\n".join(lines)


def format_model_note(model: ModelSpec) -> str:
    """For a mixture of experts, what a layer holds and what a token reads of it (memory vs speed,
    in the model's format); "" for a dense model."""
    if not model.num_experts:
        return ""
    return (f"mixture of experts: {model.num_experts} experts per layer, {model.experts_per_token} per token; a layer "
            f"holds {format_bytes(model.layer_weight_bytes)}, one token reads {format_bytes(model.layer_read_bytes(1))} "
            f"of it, a step of 8 rows {format_bytes(model.layer_read_bytes(8))} ({model.weight_format})")
