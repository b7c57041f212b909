"""The planner driver: live node profiles and measured links -> planner.make_plan -> stage
assignments; plan artifacts reused when their metadata still match.

Measurements are rounded before they become profiles (speeds to two significant digits, memory
down to a 1/16 power-of-two step, links to half-octave buckets) so that the jitter of a
re-measurement does not void a saved plan; a real change (another device, a much slower link, a
new model) still does, and the reason is logged.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
from argparse import ArgumentTypeError
from pathlib import Path
from types import SimpleNamespace

from logicpipe.common.modeldir import ModelConfig, model_digest
from logicpipe.controller.cli.model_prep import default_model_dir
from logicpipe.errors import InvalidArgument, Unavailable
from logicpipe.formats import DTYPE_BYTES, DTYPE_FORMAT, FORMAT_DTYPE, KV_FORMATS
from logicpipe.planner import (
    DeviceProfile,
    InfeasibleError,
    Link,
    MeshPlan,
    ModelSpec,
    Objective,
    Plan,
    Workload,
    evaluate_mesh,
    format_mesh_plan_table,
    format_model_note,
    make_mesh_plan,
    make_plan,
    mesh_plan_from_json,
    mesh_plan_to_json,
    mesh_reuse_mismatch,
)
from logicpipe.planner.model import device_weight_format
from logicpipe.planner.prefill import best_chunk
from logicpipe.v1 import stage_pb2

log = logging.getLogger(__name__)

MEASURE_TIMEOUT_S = 30.0
# host time a decode step costs a stage beyond its kernels, by device kind, as measured by the
# benches (docs/planning.md): a CUDA stage replays a graph and overlaps the next launch with the
# token read-back (decode step period 6.1 ms against a 5.6 ms replay on an H100); a CPU stage is
# left at the planner's DEFAULT_STEP_OVERHEAD_S (fitted here at 1.0-2.4 ms)
STEP_OVERHEAD_S = {"cuda": 0.5e-3}


def round_sig(x: float, digits: int) -> float:
    if x <= 0 or not math.isfinite(x):
        return x
    return round(x, digits - 1 - int(math.floor(math.log10(x))))


def bucket(x: float) -> float:
    """x rounded to the nearest half-octave (a power of sqrt(2)), 4 significant digits."""
    if x <= 0 or not math.isfinite(x):
        return x
    return round_sig(2 ** (round(math.log2(x) * 2) / 2), 4)


def memory_floor(nbytes: int) -> int:
    """nbytes rounded down to a step of 1/16 of its power of two (at most 6% lost)."""
    if nbytes <= 16:
        return nbytes
    step = 2 ** (nbytes.bit_length() - 5)
    return nbytes // step * step


def model_spec(config: ModelConfig, name: str, digest: str, dtype: str = "float32") -> ModelSpec:
    """The planner's view of a model of any supported family (its biases, norms, experts)."""
    a, moe = config.arch, config.arch.moe
    return ModelSpec.decoder(
        name=name, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, vocab_size=config.vocab_size,
        num_layers=config.num_layers, head_dim=config.head_dim, tied_embeddings=config.tie_word_embeddings,
        weight_format=DTYPE_FORMAT[dtype], weights_digest=digest, qkv_bias=a.qkv_bias, o_bias=a.o_bias,
        qk_norm=a.qk_norm, norms=4 if a.sandwich else 2,
        num_experts=moe.num_experts if moe else 0, experts_per_token=moe.top_k if moe else 0,
        expert_intermediate_size=moe.intermediate_size if moe else 0,
        moe_layers=sum(moe.layers) if moe else None, sinks=a.sinks,
        expert_bias=a.checkpoint == "gpt_oss", router_bias=a.checkpoint == "gpt_oss", moe_shared_params=_moe_shared_params(config),
        tp_sizes=tp_sizes(config), **mla_shape(config), **hybrid_shape(config), **kinds_shape(config))


def tp_sizes(config: ModelConfig) -> tuple[int, ...]:
    """The sizes a tensor-parallel width must divide (the stage's own check, stage_node.model.tp.check_split):
    query and KV heads, the MLP's intermediate size or the experts (and a shared expert's), the vocabulary;
    () for attention that does not split yet (multi-head latent, linear): the planner then keeps width 1."""
    a = config.arch
    if a.mla is not None or a.hybrid:
        return ()
    mlp = (a.moe.num_experts,) + ((a.moe.shared_intermediate_size,) if a.moe.shared_intermediate_size else ()) \
        if a.moe is not None else (config.intermediate_size,)
    return (config.num_heads, config.num_kv_heads, *mlp, config.vocab_size)


def kinds_shape(config: ModelConfig) -> dict:
    """ModelSpec.decoder's per-layer kinds where layers differ in what a sequence keeps ({} where
    every layer is full attention): sliding-window layers their window, linear-attention layers
    their recurrent state."""
    a = config.arch
    if not a.layer_types or set(a.layer_types) == {"full"}:
        return {}
    return dict(layer_kinds=a.layer_types, sliding_window=a.sliding_window or 0,
                state_elements_per_layer=a.linear.state_elements() if a.linear is not None else 0)


def mla_shape(config: ModelConfig) -> dict:
    """ModelSpec.decoder's attention overrides for multi-head latent attention ({} for other
    attention): its parameters per layer, the latent row a token caches, and the absorbed attention's
    FLOPs per context token (scores over the latent row, values over its latent part, every head)."""
    m = config.arch.mla
    if m is None:
        return {}
    h, heads = config.hidden_size, config.num_heads
    qk = m.nope_dim + m.rope_dim
    q = (h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * heads * qk) if m.q_lora_rank else h * heads * qk
    bias = (m.q_lora_rank + m.latent + h) if config.arch.o_bias else 0
    params = q + h * m.latent + m.kv_lora_rank + m.kv_lora_rank * heads * (m.nope_dim + m.v_dim) \
        + heads * m.v_dim * h + bias + 2 * h
    return dict(attention_params=params, kv_elements_per_token=m.latent, kv_vectors_per_token=1,
                attention_flops_per_context_token=2.0 * heads * (m.latent + m.kv_lora_rank))


def hybrid_shape(config: ModelConfig) -> dict:
    """ModelSpec.decoder's attention overrides for a hybrid of gated delta-net and gated full attention
    ({} for other models): the average layer's mixer parameters (a linear layer's projections,
    convolution, decay and norm; a full layer's q with its gate, k, v, o and q/k norms; both with the
    layer's two norms), attention FLOPs per context token and KV elements per token of a full layer
    (the linear layers' recurrent state is counted by their kind: `kinds_shape`)."""
    lin, a = config.arch.linear, config.arch
    if lin is None:
        return {}
    h, d, heads, kv = config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads
    n_full = sum(1 for i in range(config.num_layers) if not a.is_linear(i))
    full = h * d * (3 * heads + 2 * kv) + 2 * d + 2 * h
    rows = 2 * lin.key_heads * lin.key_dim + 2 * lin.value_heads * lin.value_dim + 2 * lin.value_heads
    linear = (h * rows + lin.conv_dim * lin.conv_kernel + 2 * lin.value_heads + lin.value_dim
              + lin.value_heads * lin.value_dim * h + 2 * h)
    layers = config.num_layers
    return dict(attention_params=(n_full * full + (layers - n_full) * linear) / layers,
                attention_flops_per_context_token=4.0 * heads * d * n_full / layers,
                kv_elements_per_token=2 * kv * d, kv_vectors_per_token=2 * kv)


def _moe_shared_params(config: ModelConfig) -> int:
    """Parameters of a routing layer that every token reads besides the router: the shared expert
    (gate, up, down), its sigmoid gate and the correction bias (count)."""
    moe, h = config.arch.moe, config.hidden_size
    if moe is None:
        return 0
    return 3 * h * moe.shared_intermediate_size + (h if moe.shared_gate else 0) + (
        moe.num_experts if moe.correction_bias else 0)


def device_profile(status: stage_pb2.StatusReply, links: dict[str, Link], spec: ModelSpec | None = None) -> DeviceProfile:
    """A node's planner profile; with `spec`, its FLOP/s are those it measured in the format it
    will run `spec` in (a GPU's fp32 products are several times slower than its bf16 ones)."""
    p = status.profile
    if not p.flops or not p.mem_bandwidth:
        raise Unavailable(f"node {status.node_id} reports no measured profile (started with --no-profile?)")
    profile = DeviceProfile(
        node_id=status.node_id, device_kind=p.device_kind or status.device.split(":")[0],
        memory_bytes=memory_floor(p.memory_bytes), flops=round_sig(p.flops, 2),
        mem_bandwidth=round_sig(p.mem_bandwidth, 2), links=links, weight_formats=tuple(p.weight_formats) or ("fp32",),
        compute_format=p.compute_format, weight_bandwidth=round_sig(p.weight_bandwidth, 2),
        weight_bytes_per_param=round_sig(p.weight_bytes_per_param, 3), devices=max(1, p.devices),
        max_devices=p.max_devices if p.max_devices > 1 and p.devices <= 1 else 0,
        allreduce_latency_s=round_sig(p.allreduce_latency_s, 2), allreduce_bandwidth=round_sig(p.allreduce_bandwidth, 2),
        kv_format=p.kv_format if p.kv_format in KV_FORMATS else "", full_sliding_kv=p.full_sliding_kv)
    if profile.device_kind in STEP_OVERHEAD_S:
        profile = dataclasses.replace(profile, step_overhead_s=STEP_OVERHEAD_S[profile.device_kind])
    fmt = device_weight_format(profile, spec) if spec is not None else None
    if fmt and p.format_flops.get(fmt):
        profile = dataclasses.replace(profile, flops=round_sig(p.format_flops[fmt], 2))
    return profile


def stage_formats(plan: Plan, profiles: list[DeviceProfile]) -> list[tuple[str, str, str]]:
    """Per plan stage: (compute dtype, weight format, dtype of the hidden states it sends on). The
    weight format is the plan's; a quantized stage computes in its node's compute format; hidden
    states travel in the narrower of the sender's and the receiver's dtype (the receiver converts)."""
    by_id = {p.node_id: p for p in profiles}
    dtypes = []
    for s in plan.stages:
        node = by_id.get(s.node_id)
        fmt = s.weight_format if s.weight_format in FORMAT_DTYPE else ((node.compute_format if node else "") or "fp32")
        dtypes.append(FORMAT_DTYPE[fmt])
    out = []
    for i, s in enumerate(plan.stages):
        wire = dtypes[i]
        if i + 1 < len(dtypes) and DTYPE_BYTES[dtypes[i + 1]] < DTYPE_BYTES[wire]:
            wire = dtypes[i + 1]
        out.append((dtypes[i], s.weight_format, wire))
    return out


async def measure_pairs(stubs: dict[str, object], addresses: dict[str, str], pairs: list[tuple[str, str]], *,
                        epoch: int = 0, owner: str = "") -> list[Link | Exception]:
    """For each ordered pair (a, b): the link from node a to node b, as node a measures it, or
    the exception that measuring it raised. `epoch`, `owner`: the controller's (a node measures
    only for the controller that holds it, and measuring takes hold of it)."""
    async def one(a: str, b: str) -> Link:
        reply = await stubs[a].MeasureLink(stage_pb2.MeasureLinkRequest(
            target_address=addresses[b], probes=9, controller_epoch=epoch, controller_id=owner),
            timeout=MEASURE_TIMEOUT_S)
        return Link(bandwidth=bucket(max(reply.bandwidth, 1.0)), latency=bucket(max(reply.latency_s, 0.0)))

    return list(await asyncio.gather(*(one(a, b) for a, b in pairs), return_exceptions=True))


def plan_for(profiles: list[DeviceProfile], spec: ModelSpec, workload: Workload, strategy: str, objective: str,
             boundaries: list[int] | None = None) -> Plan:
    """make_plan with custom boundaries given as cut points ("10,20" -> [0,9], [10,19], [20,L-1])."""
    pairs = None
    if strategy == "custom":
        if not boundaries:
            raise InvalidArgument("the custom strategy needs --boundaries, e.g. 10,20")
        cuts = [0, *boundaries, spec.num_layers]
        pairs = [(a, b - 1) for a, b in zip(cuts, cuts[1:])]
    try:
        return make_plan(profiles, spec, workload, Objective.parse(objective), strategy=strategy, boundaries=pairs)
    except InfeasibleError as exc:
        raise InvalidArgument(f"the model does not fit: {exc}") from exc
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from exc


def repair(plan: Plan, lost: set[str], profiles: list[DeviceProfile], spec: ModelSpec, workload: Workload,
           options, idle: list[str] = ()) -> Plan | None:
    """`plan` over its stages still usable: every survivor keeps the layers it holds, so the KV it
    kept serves the replays and only the lost layers are computed again (issue 34). A lost stage's
    range goes whole to an idle node (`idle`: usable nodes no pipeline serves on; the lost node
    itself first when it is back), else to the stage before it (a lost first stage's to the one
    after). None when no stage is lost, or none would hold layers, or the ranges do not fit."""
    by_id = {p.node_id: p for p in profiles}
    spare = [n for n in idle if n in by_id]
    ranges: list[list] = []  # [node id, start, end]
    orphan = None            # start of lost layers no survivor before them can take
    for st in plan.stages:
        if st.node_id in lost or st.node_id not in by_id:
            who = st.node_id if st.node_id in spare else (spare[0] if spare else None)
            if who is not None:  # a replacement: it computes the lost range, the others skip
                spare.remove(who)
                ranges.append([who, st.start if orphan is None else orphan, st.end])
                orphan = None
            elif ranges:
                ranges[-1][2] = st.end
            elif orphan is None:
                orphan = st.start
            continue
        ranges.append([st.node_id, st.start if orphan is None else orphan, st.end])
        orphan = None
    survivors = {st.node_id for st in plan.stages} - lost
    if not ranges or orphan is not None or not survivors & {r[0] for r in ranges} or \
            [r[0] for r in ranges] == [st.node_id for st in plan.stages] and not lost & {r[0] for r in ranges}:
        return None  # (nothing lost, or no survivor keeps layers: a plan afresh spreads the replays)
    try:
        return make_plan([by_id[n] for n, _, _ in ranges], spec, workload, Objective.parse(options.objective),
                         strategy="custom", boundaries=[(a, b - 1) for _, a, b in ranges])
    except ValueError as exc:  # (InfeasibleError too) the ranges do not fit: plan afresh
        log.info("no repair of the broken pipeline fits (%s): planning afresh", exc)
        return None


def replicas_flag(value: str) -> int:
    """--replicas: "auto" (0) or a count >= 1."""
    if value.strip().lower() == "auto":
        return 0
    try:
        n = int(value)
    except ValueError:
        raise ArgumentTypeError(f"--replicas must be auto or a whole number >= 1, not {value!r}") from None
    if not 1 <= n <= 64:
        raise ArgumentTypeError(f"--replicas must be auto or 1 to 64, not {n}")
    return n


def classic(options) -> bool:
    """One pipeline over the nodes, costed by its bottleneck stage (as before replicas): asked for
    with --replicas 1 or a fixed strategy."""
    return options.replicas == 1 or options.strategy != "dp"


def mesh_for(profiles: list[DeviceProfile], spec: ModelSpec, workload: Workload, options, *,
             replicas: int | None = None, boundaries: list[int] | None = None) -> MeshPlan:
    """The plan for these nodes by the controller's options (strategy, objective, --replicas, or
    `replicas` pipelines at most): replicas chosen by predicted tokens/s at `workload` (its batch:
    requests at once; a plan that would not hold that many sequences' KV is made for one), or, in
    `classic` mode, one pipeline. InvalidArgument when none fits."""
    if classic(options):
        plan = plan_for(profiles, spec, Workload(context_tokens=workload.context_tokens), options.strategy,
                        options.objective, boundaries)
        return evaluate([plan], profiles, spec, workload, options)
    cap = options.replicas if replicas is None else replicas
    for load in dict.fromkeys((workload, Workload(context_tokens=workload.context_tokens))):
        try:
            return make_mesh_plan(profiles, spec, load, Objective.parse(options.objective), replicas=cap)
        except InfeasibleError as exc:
            last = exc
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc
    raise InvalidArgument(f"the model does not fit: {last}")


def evaluate(plans: list[Plan], profiles: list[DeviceProfile], spec: ModelSpec, workload: Workload, options) -> MeshPlan:
    """These pipelines as one mesh plan, costed at `workload` (the requests split between them)."""
    return evaluate_mesh(plans, profiles, spec, workload, Objective.parse(options.objective),
                         replicas=options.replicas)


def pipeline_key(plan: Plan) -> tuple[tuple[str, int, int, int], ...]:
    """What makes two pipelines the same: their nodes, layer ranges and widths (devices), in order."""
    return tuple((s.node_id, s.start, s.end, s.devices) for s in plan.stages)


def same_pipelines(a: MeshPlan, b: MeshPlan) -> bool:
    return sorted(map(pipeline_key, a.pipelines)) == sorted(map(pipeline_key, b.pipelines))


def extends(new: MeshPlan, old: MeshPlan) -> bool:
    """`new` keeps every pipeline of `old` as it is and adds others."""
    kept = set(map(pipeline_key, new.pipelines))
    return bool(old.pipelines) and all(pipeline_key(p) in kept for p in old.pipelines) \
        and len(new.pipelines) > len(old.pipelines)


def better(new: MeshPlan, old: MeshPlan, options) -> bool:
    """`new` is worth moving requests for: in `classic` mode its step costs less by --replan-gain
    (as before replicas); else its predicted tokens/s are higher by that much."""
    if classic(options):
        return new.pipelines[0].cost_s <= old.pipelines[0].cost_s * (1 - options.replan_gain) if old.pipelines else True
    return new.tokens_per_s > old.tokens_per_s * (1 + options.replan_gain)


def describe(mesh: MeshPlan) -> str:
    """'2 pipelines (1 + 2 stages), 412 tok/s predicted at 8 requests x 2048 tokens'."""
    stages = " + ".join(str(len(p.stages)) for p in mesh.pipelines)
    n = len(mesh.pipelines)
    return (f"{n} pipeline{'s' if n != 1 else ''} ({stages} stages), {mesh.tokens_per_s:.0f} tok/s predicted at "
            f"{mesh.workload.batch} requests x {mesh.workload.context_tokens} tokens")


def to_json(mesh: MeshPlan) -> str:
    return mesh_plan_to_json(mesh)


def reuse_or_plan(path: str | None, profiles: list[DeviceProfile], spec: ModelSpec, workload: Workload,
                  options) -> MeshPlan:
    """The saved plan at `path` if it matches these inputs, else a new plan (written to `path`)."""
    if path and Path(path).is_file():
        try:
            saved = mesh_plan_from_json(Path(path).read_text())
            why = mesh_reuse_mismatch(saved, spec, profiles, options.objective, workload=workload,
                                      replicas=options.replicas)
            strategies = {p.strategy for p in saved.pipelines}
            if why is None and strategies == {options.strategy}:
                log.info("reusing the plan in %s", path)
                return saved
            log.info("not reusing the plan in %s: %s", path, why or f"strategy {', '.join(strategies)} != {options.strategy}")
        except (OSError, ValueError) as exc:
            log.warning("ignoring the plan in %s: %s", path, exc)
    mesh = mesh_for(profiles, spec, workload, options)
    if path:
        Path(path).write_text(to_json(mesh))
        log.info("wrote the plan to %s", path)
    return mesh


def profiles_from_file(path: str) -> list[DeviceProfile]:
    """Profiles from a JSON file: a list of objects with the DeviceProfile fields; "links" maps
    another node id to {"bandwidth": bytes/s, "latency": s}."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot read profiles from {path}: {exc}") from exc
    items = doc.get("profiles", doc) if isinstance(doc, dict) else doc
    if not isinstance(items, list) or not items:
        raise InvalidArgument(f"{path}: expected a list of device profiles")
    out = []
    for i, item in enumerate(items):
        try:
            links = {k: Link(**v) for k, v in item.get("links", {}).items()}
            out.append(DeviceProfile(**{**item, "links": links,
                                        "weight_formats": tuple(item.get("weight_formats", ("fp32", "fp16", "bf16")))}))
        except (TypeError, ValueError, AttributeError) as exc:
            raise InvalidArgument(f"{path}: profile #{i}: {exc}") from exc
    return out


def plan_from_profiles_file(profiles_path: str, model_dir: str | None, strategy: str | None, objective: str,
                            boundaries: list[int] | None, context: int, *, replicas: int = 0,
                            concurrency: int = 1) -> tuple[str, str]:
    """(plan JSON, table) for `lpctl plan --profiles FILE`: no controller, no nodes."""
    mdir = Path(model_dir) if model_dir else default_model_dir()
    spec = model_spec(ModelConfig.from_dir(mdir), mdir.name, model_digest(mdir))
    options = SimpleNamespace(strategy=strategy or "dp", objective=objective, replicas=replicas, replan_gain=0.0)
    mesh = mesh_for(profiles_from_file(profiles_path), spec, Workload(context_tokens=context, batch=concurrency),
                    options, boundaries=boundaries)
    return to_json(mesh), plan_table(mesh, spec)


def plan_table(mesh: MeshPlan, spec: ModelSpec) -> str:
    """The plan's tables, pipeline by pipeline, with what a mixture-of-experts layer holds and what
    a token reads of it."""
    note = format_model_note(spec)
    return format_mesh_plan_table(mesh) + (f"\n{note}" if note else "")


class PrefillChunks:  # one per controller, for all its pipelines (each its own generation)
    """Prompt rows per step on stage 0 for a prompt of N tokens: `fixed` (--prefill-chunk), else the
    chunk the cost model says brings the first token soonest on the plan in force
    (planner.prefill), cached per (plan generation, 16-token bucket); 0 (the stages' budget)
    without a plan."""

    MAX_CACHED = 4096

    def __init__(self, fixed: int = 0):
        self.fixed = fixed
        self._cache: dict[tuple[int, int], int] = {}

    def choose(self, prompt_tokens: int, generation: int, plan: Plan | None, profiles: list[DeviceProfile],
               spec: ModelSpec) -> int:
        if self.fixed:
            return self.fixed
        key = (generation, -(-prompt_tokens // 16))
        if key in self._cache:
            return self._cache[key]
        by_id = {p.node_id: p for p in profiles}
        if plan is None or any(s.node_id not in by_id for s in plan.stages):
            return 0
        if len(self._cache) > self.MAX_CACHED:
            self._cache.clear()
        self._cache[key] = best_chunk([by_id[s.node_id] for s in plan.stages], [s.end - s.start for s in plan.stages],
                                      spec, key[1] * 16)
        return self._cache[key]
