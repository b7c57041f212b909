"""Plan artifacts: JSON round trip, validation of edited files, reuse checks, the text table."""
from __future__ import annotations

import dataclasses
import json

import pytest

from logicpipe.planner import (
    FORMAT_VERSION,
    DeviceProfile,
    Link,
    ModelSpec,
    Objective,
    PlanFormatError,
    Reserve,
    Workload,
    format_plan_table,
    make_plan,
    plan_from_json,
    plan_to_json,
    profiles_digest,
    reuse_mismatch,
)
from logicpipe.planner.digest import model_digest, profile_digest

GiB = 2**30
MODEL = ModelSpec.llama(name="SmolLM2-135M-Instruct", hidden_size=576, intermediate_size=1536, num_heads=9,
                        num_kv_heads=3, vocab_size=49152, num_layers=30, tied_embeddings=True, weight_format="bf16")
WORKLOAD = Workload(tokens_per_step=4, context_tokens=2048, batch=4)
GPU = DeviceProfile("gpu-a", "cuda", 300 * 2**20, 2e13, 8e11, links={"cpu-b": Link(1.25e8, 3e-4)})
CPU = DeviceProfile("cpu-b", "cpu", 16 * GiB, 5e11, 4e10, links={"gpu-a": Link(1.25e8, 3e-4)},
                    weight_formats=("fp32", "bf16"))
PROFILES = [GPU, CPU]


@pytest.fixture(params=list(Objective), ids=lambda o: o.value)
def plan(request):
    return make_plan(PROFILES, MODEL, WORKLOAD, request.param)


def test_round_trip_is_equal(plan):
    text = plan_to_json(plan)
    assert plan_from_json(text) == plan
    assert plan_to_json(plan_from_json(text)) == text


def test_round_trip_of_every_strategy():
    gpu = dataclasses.replace(GPU, memory_bytes=2 * GiB)
    for strategy in ("uniform", "memory", "compute", "mixed"):
        p = make_plan([CPU, gpu], MODEL, WORKLOAD, strategy=strategy)
        assert plan_from_json(plan_to_json(p)) == p
    p = make_plan([CPU, GPU], MODEL, WORKLOAD, strategy="custom", boundaries=[(0, 19), (20, 29)])
    assert plan_from_json(plan_to_json(p)) == p


def test_metadata_records_inputs(plan):
    meta = plan.metadata
    assert meta.format_version == FORMAT_VERSION
    assert meta.model_digest == model_digest(MODEL) and len(meta.model_digest) == 64
    assert meta.profiles_digest == profiles_digest(PROFILES) == profiles_digest(reversed(PROFILES))
    assert dict(meta.node_digests) == {"gpu-a": profile_digest(GPU), "cpu-b": profile_digest(CPU)}
    assert meta.workload == WORKLOAD and meta.num_layers == 30


def test_digests_are_stable_and_sensitive():
    assert profile_digest(GPU) == profile_digest(dataclasses.replace(GPU))
    assert profile_digest(GPU) != profile_digest(dataclasses.replace(GPU, flops=2.1e13))
    # links given as a mapping or as pairs in any order make the same profile
    a = DeviceProfile("x", "cpu", 1, 1.0, 1.0, links={"b": Link(1.0, 0.0), "a": Link(2.0, 0.0)})
    b = DeviceProfile("x", "cpu", 1, 1.0, 1.0, links=[("a", Link(2.0, 0.0)), ("b", Link(1.0, 0.0))])
    assert a == b and profile_digest(a) == profile_digest(b)
    assert model_digest(MODEL) != model_digest(dataclasses.replace(MODEL, weights_digest="abc"))


def test_reuse_when_nothing_changed(plan):
    assert reuse_mismatch(plan, MODEL, PROFILES, plan.objective) is None
    assert reuse_mismatch(plan, MODEL, list(reversed(PROFILES)), plan.objective.value, WORKLOAD, Reserve()) is None


def test_reuse_mismatch_names_a_changed_profile(plan):
    changed = dataclasses.replace(CPU, memory_bytes=CPU.memory_bytes // 2)
    assert reuse_mismatch(plan, MODEL, [GPU, changed], plan.objective) == "profile of node cpu-b changed"


def test_reuse_mismatch_names_joined_and_gone_nodes(plan):
    newcomer = DeviceProfile("gpu-c", "cuda", 8 * GiB, 2e13, 8e11)
    reason = reuse_mismatch(plan, MODEL, [GPU, newcomer], plan.objective)
    assert reason == "node cpu-b is gone; node gpu-c is new"


def test_reuse_mismatch_names_a_changed_model(plan):
    other = dataclasses.replace(MODEL, weights_digest="0123456789abcdef")
    reason = reuse_mismatch(plan, other, PROFILES, plan.objective)
    assert reason == (f"model digest differs: plan {model_digest(MODEL)[:12]}, now {model_digest(other)[:12]}")


def test_reuse_mismatch_names_a_changed_objective(plan):
    other = Objective.LATENCY if plan.objective is Objective.THROUGHPUT else Objective.THROUGHPUT
    reason = reuse_mismatch(plan, MODEL, PROFILES, other)
    assert reason == f"objective differs: plan {plan.objective.value}, now {other.value}"


def test_reuse_mismatch_names_format_version_workload_reserve_and_all_reasons(plan):
    old = dataclasses.replace(plan, metadata=dataclasses.replace(plan.metadata, format_version=FORMAT_VERSION + 1))
    assert reuse_mismatch(old, MODEL, PROFILES, plan.objective) == f"format version {FORMAT_VERSION + 1} != {FORMAT_VERSION}"
    assert "workload differs" in reuse_mismatch(plan, MODEL, PROFILES, plan.objective, Workload(context_tokens=8192))
    assert "memory reserve differs" in reuse_mismatch(plan, MODEL, PROFILES, plan.objective, reserve=Reserve(0.2))
    many = reuse_mismatch(plan, dataclasses.replace(MODEL, name="other"), [GPU], "latency" if plan.objective is Objective.THROUGHPUT else "throughput")
    assert "model digest differs" in many and "node cpu-b is gone" in many and "objective differs" in many


def _edited(plan, edit) -> str:
    doc = json.loads(plan_to_json(plan))
    edit(doc)
    return json.dumps(doc)


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.pop("stages"), "plan is missing 'stages'"),
    (lambda d: d.update(stages=[]), "stages must be a non-empty list"),
    (lambda d: d.update(objective="fastest"), "unknown objective 'fastest'"),
    (lambda d: d["stages"][0].update(start=1), "stages\\[0\\] starts at layer 1, expected 0"),
    (lambda d: d["stages"][-1].update(end=31), "stages end at layer 31 but metadata.num_layers is 30"),
    (lambda d: d["stages"][0].update(end=0), "stages\\[0\\] has end 0 <= start 0"),
    (lambda d: d["stages"][0].update(compute_s="fast"), "stages\\[0\\].compute_s must be a finite number"),
    (lambda d: d["stages"][0].update(memory_bytes=True), "stages\\[0\\].memory_bytes must be an integer"),
    (lambda d: d["stages"][0].pop("node_id"), "stages\\[0\\] is missing 'node_id'"),
    (lambda d: d["metadata"]["workload"].update(batch=0), "metadata.workload.batch must be an integer >= 1"),
    (lambda d: d["metadata"]["reserve"].update(fraction=1.5), "metadata.reserve: reserve fraction must be in"),
    (lambda d: d.update(exact="yes"), "plan.exact must be true or false"),
    (lambda d: d.update(format_version="1"), "plan.format_version must be an integer"),
    (lambda d: d["metadata"].update(node_digests=[]), "metadata.node_digests must be an object"),
])
def test_malformed_plans_give_clear_errors(plan, edit, match):
    with pytest.raises(PlanFormatError, match=match):
        plan_from_json(_edited(plan, edit))


def test_duplicate_node_is_rejected():
    p = make_plan([CPU, GPU], MODEL, WORKLOAD, strategy="uniform", reserve=Reserve(0.0, 0))

    def dup(d):
        d["stages"][1]["node_id"] = d["stages"][0]["node_id"]
    with pytest.raises(PlanFormatError, match="a node appears in two stages"):
        plan_from_json(_edited(p, dup))


@pytest.mark.parametrize("text, match", [
    ("{not json", "not valid JSON: .* line 1 column 2"),
    ("[1, 2]", "plan JSON must be an object, got list"),
    ("", "not valid JSON"),
])
def test_invalid_json_text(text, match):
    with pytest.raises(ValueError, match=match):
        plan_from_json(text)


def test_table_is_aligned_and_complete():
    plan = make_plan(PROFILES, MODEL, WORKLOAD, Objective.THROUGHPUT)
    text = format_plan_table(plan)
    lines = text.splitlines()
    assert lines[0].split() == ["#", "node", "device", "layers", "memory", "compute", "ms", "transfer", "ms", "stage", "ms"]
    assert len(lines) == 2 + len(plan.stages) + 1
    for i, stage in enumerate(plan.stages):
        row = lines[2 + i]
        assert row.split()[0] == str(i) and stage.node_id in row
        assert f"{stage.start}-{stage.end - 1} ({stage.num_layers})" in row
        assert ("MiB" in row) or ("GiB" in row)
    assert "objective throughput: bottleneck" in lines[-1] and "(optimal)" in lines[-1]
    # columns line up: the layers column starts at the same offset in every row
    offset = lines[0].index("layers")
    assert all(line[offset - 2:offset] == "  " for line in lines[2:-1])


def test_table_footer_reports_gap_for_fixed_strategies():
    plan = make_plan([CPU, GPU], MODEL, WORKLOAD, Objective.LATENCY, strategy="uniform", reserve=Reserve(0.0, 0))
    footer = format_plan_table(plan).splitlines()[-1]
    assert "objective latency: sum" in footer and "lower bound" in footer and "gap" in footer
