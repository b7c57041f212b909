"""Replicas and the decode-round cost model: make_mesh_plan on clear-cut meshes, the round
formulas, the mesh artifact (format version 2) and the search's cost."""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
import time

import pytest

from logicpipe.planner import (
    DEFAULT_LINK,
    DEFAULT_RESERVE,
    DEFAULT_STEP_OVERHEAD_S,
    DeviceProfile,
    InfeasibleError,
    Link,
    MeshPlan,
    ModelSpec,
    Objective,
    PlanFormatError,
    Reserve,
    Workload,
    best_micro_batches,
    format_mesh_plan_table,
    make_mesh_plan,
    make_plan,
    mesh_plan_from_json,
    mesh_plan_to_json,
    mesh_reuse_mismatch,
    pipeline_round_s,
    pipeline_tokens_per_s,
    plan_to_json,
    profile_digest,
    step_times_s,
)
from logicpipe.planner import mesh_search
from logicpipe.planner.cost import edge_memory_bytes, layer_memory_bytes
from logicpipe.planner.instance import eligible_profiles

GiB = 2**30
CONTEXT = 2048


def llama_small(num_layers: int = 24) -> ModelSpec:
    return ModelSpec.llama(name="small", hidden_size=1024, intermediate_size=2816, num_heads=16, num_kv_heads=4,
                           vocab_size=32000, num_layers=num_layers, weight_format="fp16")


MODEL = llama_small()


def whole_bytes(rows: int, model: ModelSpec = MODEL) -> int:
    """Bytes one device needs to hold the whole model with the KV of `rows` sequences."""
    probe = DeviceProfile("probe", "cuda", GiB, 1e12, 1e11)
    held = Workload(tokens_per_step=1, context_tokens=CONTEXT, batch=rows)
    return model.num_layers * layer_memory_bytes(probe, model, held) + edge_memory_bytes(probe, model, is_first=True,
                                                                                         is_last=True)


def node(name: str, share: float, rows: int = 1, *, flops: float = 2e13, bandwidth: float = 4e11,
         link: Link = DEFAULT_LINK, kind: str = "cuda") -> DeviceProfile:
    """A device holding `share` of the model with the KV of `rows` sequences (after the 10% reserve)."""
    memory = math.ceil(share * whole_bytes(rows) / (1 - DEFAULT_RESERVE.fraction))
    return DeviceProfile(name, kind, memory, flops, bandwidth, default_link=link)


def stage_counts(mesh: MeshPlan) -> list[int]:
    return [len(p.stages) for p in mesh.pipelines]


# ---------------------------------------------------------------------- the round model ----

def test_round_is_the_busiest_stage_times_m_or_the_ring_and_tokens_are_rows_per_round():
    devices = [node("a", 0.6), node("b", 0.6), node("c", 0.6)]
    counts = [8, 8, 8]
    for rows in (1, 2, 5, 12):
        for m in range(1, 4):
            r = -(-rows // m)
            times = step_times_s(devices, counts, MODEL, r, CONTEXT)
            assert len(times) == 3 and all(t > DEFAULT_STEP_OVERHEAD_S for t in times)
            expected = max(m * max(times), sum(times))
            assert pipeline_round_s(devices, counts, MODEL, rows, CONTEXT, m) == expected
            assert pipeline_tokens_per_s(devices, counts, MODEL, rows, CONTEXT, m) == rows / expected
        m, best = best_micro_batches(devices, counts, MODEL, rows, CONTEXT)
        assert 1 <= m <= min(3, rows)
        assert best == max(pipeline_tokens_per_s(devices, counts, MODEL, rows, CONTEXT, k) for k in range(1, min(3, rows) + 1))
    assert best_micro_batches(devices, counts, MODEL, 0, CONTEXT) == (1, 0.0)
    with pytest.raises(ValueError, match="micro_batches"):
        pipeline_round_s(devices, counts, MODEL, 4, CONTEXT, 4)  # more micro-batches than stages


def test_weights_are_read_once_per_micro_batch_step_and_kv_once_per_row():
    solo = node("solo", 2.0, 8, flops=1e18)  # compute never binds: a step is its reads
    kv_row = 24 * CONTEXT * MODEL.kv_bytes_per_token_per_layer
    for r in (1, 4):
        expected = ((24 * MODEL.layer_weight_bytes + r * kv_row + r * MODEL.activation_bytes_per_token
                     + MODEL.lm_head_bytes) / solo.mem_bandwidth + DEFAULT_STEP_OVERHEAD_S)
        assert step_times_s([solo], [24], MODEL, r, CONTEXT)[0] == pytest.approx(expected, rel=1e-12)
    # two micro-batches on two stages: each stage reads its half of the weights twice a round
    pair = [solo, dataclasses.replace(solo, node_id="pair")]
    times = step_times_s(pair, [12, 12], MODEL, 1, CONTEXT)
    assert pipeline_round_s(pair, [12, 12], MODEL, 2, CONTEXT, 2) == max(2 * max(times), sum(times))
    assert 2 * times[0] > 24 * MODEL.layer_weight_bytes / solo.mem_bandwidth


def test_a_pipeline_of_two_equal_devices_never_beats_one_of_them_for_memory_bound_decode():
    one = node("one", 2.0, 16, flops=1e18, link=Link(1.25e9, 0.0))
    two = [one, dataclasses.replace(one, node_id="two")]
    for rows in (1, 2, 3, 4, 8, 16):
        alone = best_micro_batches([one], [24], MODEL, rows, CONTEXT)[1]
        for split in ([12, 12], [8, 16], [16, 8]):
            m, piped = best_micro_batches(two, split, MODEL, rows, CONTEXT)
            assert m <= 2
            assert piped <= alone * (1 + 1e-12), (rows, split)


# ------------------------------------------------------------------- clear-cut meshes ----

def test_four_nodes_that_each_hold_the_model_make_four_one_stage_pipelines():
    devices = [node(f"n{i}", 1.5, 8) for i in range(4)]  # 1 GbE links (DEFAULT_LINK)
    workload = Workload(tokens_per_step=8, context_tokens=CONTEXT, batch=8)
    mesh = make_mesh_plan(devices, MODEL, workload)
    assert stage_counts(mesh) == [1, 1, 1, 1]
    assert sorted(mesh.node_ids) == ["n0", "n1", "n2", "n3"] and mesh.idle_node_ids == ()
    assert [p.rows for p in mesh.pipelines] == [2, 2, 2, 2]
    assert mesh.tokens_per_s == pytest.approx(sum(p.tokens_per_s for p in mesh.pipelines))
    # the old objective (min bottleneck) made one pipeline of several stages of the same nodes
    assert len(make_plan(devices, MODEL, workload).stages) > 1


def test_nodes_holding_a_third_each_form_one_pipeline_over_them():
    devices = [node(f"n{i}", 0.42, 4) for i in range(3)]
    mesh = make_mesh_plan(devices, MODEL, Workload(tokens_per_step=4, context_tokens=CONTEXT, batch=4))
    assert stage_counts(mesh) == [3]
    assert sorted(mesh.node_ids) == ["n0", "n1", "n2"]
    plan = mesh.pipelines[0]
    assert plan.rows == 4 and 1 <= plan.micro_batches <= 3 and plan.tokens_per_s > 0


def test_eight_third_nodes_with_enough_concurrency_make_two_pipelines_not_one_long_one():
    devices = [node(f"n{i}", 0.42, 3) for i in range(8)]  # two of them cannot hold the model
    mesh = make_mesh_plan(devices, MODEL, Workload(tokens_per_step=32, context_tokens=CONTEXT, batch=32))
    assert len(mesh.pipelines) == 2
    assert all(3 <= n <= 5 for n in stage_counts(mesh)) and sum(stage_counts(mesh)) >= 7
    assert all(p.rows >= 1 for p in mesh.pipelines)
    alone = make_mesh_plan(devices, MODEL, Workload(tokens_per_step=32, context_tokens=CONTEXT, batch=32), replicas=1)
    assert mesh.tokens_per_s > alone.tokens_per_s


def test_a_big_node_and_three_small_ones_make_two_pipelines_side_by_side():
    big = node("big", 1.0, 16)  # holds the model and the KV of 16 sequences
    small = [node(f"s{i}", 0.42, 16) for i in range(3)]
    mesh = make_mesh_plan([small[0], big, small[1], small[2]], MODEL,
                          Workload(tokens_per_step=32, context_tokens=CONTEXT, batch=32))
    assert len(mesh.pipelines) == 2
    by_size = sorted(mesh.pipelines, key=lambda p: len(p.stages))
    assert by_size[0].node_ids == ("big",)
    assert sorted(by_size[1].node_ids) == ["s0", "s1", "s2"]
    assert all(p.rows >= 1 for p in mesh.pipelines)


def test_latency_on_slow_links_puts_the_node_that_holds_the_model_first_alone():
    slow = Link(10e6 / 8, 5e-3)  # 10 Mbit/s, 5 ms
    devices = [node("s0", 0.6, link=slow), node("whole", 1.2, link=slow), node("s1", 0.6, link=slow),
               node("s2", 0.6, link=slow)]
    workload = Workload(tokens_per_step=1, context_tokens=CONTEXT, batch=1)
    mesh = make_mesh_plan(devices, MODEL, workload, Objective.LATENCY)
    first = mesh.pipelines[0]
    assert first.node_ids == ("whole",)
    assert first.rows == 1 and first.micro_batches == 1
    assert mesh.tokens_per_s == first.tokens_per_s == pipeline_tokens_per_s(
        [devices[1]], [24], MODEL, 1, CONTEXT, 1)
    for extra in mesh.pipelines[1:]:  # other pipelines are whole pipelines of the rest
        assert extra.stages[0].start == 0 and extra.stages[-1].end == MODEL.num_layers
    only = make_mesh_plan(devices, MODEL, workload, "latency", replicas=1)
    assert len(only.pipelines) == 1 and only.pipelines[0].node_ids == ("whole",)
    assert sorted(only.idle_node_ids) == ["s0", "s1", "s2"]


def test_replicas_caps_the_number_of_pipelines():
    devices = [node(f"n{i}", 1.5, 8) for i in range(4)]
    workload = Workload(tokens_per_step=8, context_tokens=CONTEXT, batch=8)
    one = make_mesh_plan(devices, MODEL, workload, replicas=1)
    assert len(one.pipelines) == 1 and one.replicas_asked == 1
    assert stage_counts(one) == [1]  # one device alone predicts more than a 4-stage pipeline
    assert len(one.idle_node_ids) == 3
    two = make_mesh_plan(devices, MODEL, workload, replicas=2)
    assert len(two.pipelines) <= 2 and two.replicas_asked == 2
    assert two.tokens_per_s > one.tokens_per_s
    auto = make_mesh_plan(devices, MODEL, workload)
    assert auto.tokens_per_s >= two.tokens_per_s * 0.99 and auto.replicas_asked == 0
    with pytest.raises(ValueError, match="replicas"):
        make_mesh_plan(devices, MODEL, workload, replicas=-1)


def _random_mesh(seed: int, n: int) -> tuple[list[DeviceProfile], Workload]:
    rng = random.Random(seed)
    ids = [f"d{i}" for i in range(n)]
    devices = [DeviceProfile(i, "cuda", int(rng.uniform(0.2, 1.4) * whole_bytes(1)), rng.uniform(1e12, 3e13),
                             rng.uniform(5e10, 9e11), step_overhead_s=rng.choice([0.0, 5e-4, 3e-3]),
                             links={o: Link(rng.choice([1.25e7, 1.25e8, 1.25e9]), rng.uniform(1e-4, 2e-3))
                                    for o in ids if o != i})
               for i in ids]
    batch = rng.choice([1, 3, 8, 24])
    return devices, Workload(tokens_per_step=batch, context_tokens=CONTEXT, batch=batch)


@pytest.mark.parametrize("seed", range(6))
def test_every_mesh_plan_is_consistent_with_the_cost_model(seed):
    devices, workload = _random_mesh(seed, 3 + seed)
    by_id = {p.node_id: p for p in devices}
    try:
        mesh = make_mesh_plan(devices, MODEL, workload)
    except InfeasibleError:
        return
    assert len(set(mesh.node_ids)) == len(mesh.node_ids)
    assert sum(p.rows for p in mesh.pipelines) <= workload.batch
    for plan in mesh.pipelines:
        order = [by_id[s.node_id] for s in plan.stages]
        counts = [s.num_layers for s in plan.stages]
        assert plan.stages[0].start == 0 and plan.stages[-1].end == MODEL.num_layers
        assert 1 <= plan.micro_batches <= len(plan.stages)
        if plan.rows:
            assert plan.micro_batches <= plan.rows
            assert plan.tokens_per_s == pipeline_tokens_per_s(order, counts, MODEL, plan.rows, CONTEXT, plan.micro_batches)
            assert (plan.micro_batches, plan.tokens_per_s) == best_micro_batches(order, counts, MODEL, plan.rows, CONTEXT)
        held = max(1, plan.rows)
        assert plan.metadata.workload.batch == held  # the KV it reserves: its share, at least one sequence
        for stage in plan.stages:
            assert stage.memory_bytes <= DEFAULT_RESERVE.usable_bytes(by_id[stage.node_id].memory_bytes)
    assert mesh.tokens_per_s == pytest.approx(sum(p.tokens_per_s for p in mesh.pipelines))


def _set_partitions(items: list[int]):
    """Every way to split `items` into groups, some of them left out (idle)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _set_partitions(rest):
        yield part
        yield [[first], *part]
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1:]]


def test_the_search_is_within_the_tie_margin_of_every_partition_into_pipelines():
    """Brute force over every partition of up to 5 devices into pipelines (each the DP's chain
    over its devices, water-filled rows): the search is never more than 2% below the best."""
    checked = 0
    for seed in range(200, 225):
        rng = random.Random(seed)
        devices, workload = _random_mesh(seed, rng.randint(2, 5))
        workload = dataclasses.replace(workload, batch=rng.choice([1, 2, 16, 64]))
        try:
            mesh = make_mesh_plan(devices, MODEL, workload)
        except InfeasibleError:
            continue
        eligible = eligible_profiles(devices, MODEL, Workload(context_tokens=CONTEXT), DEFAULT_RESERVE)
        search = mesh_search.MeshSearch(eligible, MODEL, workload, DEFAULT_RESERVE)
        chains = {}
        for size in range(1, len(eligible) + 1):
            for sub in itertools.combinations(range(len(eligible)), size):
                rows = search.most_rows(sub)
                chain = search.chain(sub, Objective.THROUGHPUT, rows) if rows else None
                if chain is not None and len(chain) == size:
                    chains[sub] = chain
        best = max((search.split_rows(tuple(chains[tuple(sorted(g))] for g in part))[1]
                    for part in _set_partitions(list(range(len(eligible))))
                    if part and all(tuple(sorted(g)) in chains for g in part)), default=0.0)
        assert mesh.tokens_per_s >= 0.98 * best, (seed, mesh.tokens_per_s, best)
        checked += 1
    assert checked >= 15


def test_fixed_strategies_keep_one_pipeline_over_every_device_in_order():
    devices = [node("a", 0.6), node("b", 0.6), node("c", 1.5)]
    workload = Workload(tokens_per_step=4, context_tokens=CONTEXT, batch=4)
    for strategy in ("uniform", "memory", "compute", "mixed"):
        mesh = make_mesh_plan(devices, MODEL, workload, strategy=strategy)
        assert len(mesh.pipelines) == 1 and mesh.node_ids == ("a", "b", "c")
        assert mesh.pipelines[0].strategy == strategy and mesh.pipelines[0].rows == 4
    custom = make_mesh_plan(devices, MODEL, workload, strategy="custom", boundaries=[(0, 5), (6, 11), (12, 23)])
    assert [s.num_layers for s in custom.stages] == [6, 6, 12]
    with pytest.raises(ValueError, match="unknown strategy"):
        make_mesh_plan(devices, MODEL, workload, strategy="greedy")


def test_nothing_fits_names_the_missing_memory():
    with pytest.raises(InfeasibleError, match="more than the 2 devices offer"):
        make_mesh_plan([node("a", 0.3), node("b", 0.3)], MODEL, Workload(context_tokens=CONTEXT))


def test_make_plan_is_unchanged_and_its_plan_carries_no_prediction():
    devices = [node("a", 0.6), node("b", 0.6)]
    plan = make_plan(devices, MODEL, Workload(tokens_per_step=1, context_tokens=CONTEXT, batch=1))
    assert (plan.micro_batches, plan.rows, plan.tokens_per_s) == (0, 0, 0.0)
    doc = json.loads(plan_to_json(plan))
    assert "micro_batches" not in doc and doc["format_version"] == 1


def test_step_overhead_is_validated_and_in_the_digest_only_when_set():
    base = node("a", 1.0)
    assert profile_digest(dataclasses.replace(base, step_overhead_s=0.0)) == profile_digest(base)
    assert profile_digest(dataclasses.replace(base, step_overhead_s=2e-3)) != profile_digest(base)
    for bad in (-1e-3, math.inf, "1"):
        with pytest.raises(ValueError, match="step_overhead_s"):
            dataclasses.replace(base, step_overhead_s=bad)
    slower = dataclasses.replace(base, step_overhead_s=0.05)
    assert (step_times_s([slower], [24], MODEL, 1, CONTEXT)[0]
            == pytest.approx(step_times_s([base], [24], MODEL, 1, CONTEXT)[0] - DEFAULT_STEP_OVERHEAD_S + 0.05))


# -------------------------------------------------------------------------- artifacts ----

@pytest.fixture
def mesh() -> MeshPlan:
    big = node("big", 1.5, 8)
    small = [node(f"s{i}", 0.42) for i in range(3)]
    return make_mesh_plan([big, *small], MODEL, Workload(tokens_per_step=8, context_tokens=CONTEXT, batch=8))


def test_mesh_artifact_round_trips(mesh):
    text = mesh_plan_to_json(mesh)
    doc = json.loads(text)
    assert doc["format_version"] == 2 and doc["replicas_asked"] == 0 and doc["workload"]["batch"] == 8
    assert all({"micro_batches", "rows", "tokens_per_s"} <= set(p) for p in doc["pipelines"])
    again = mesh_plan_from_json(text)
    assert again == mesh
    assert mesh_plan_to_json(again) == text


def test_a_version_1_plan_reads_as_a_mesh_of_one_pipeline():
    plan = make_plan([node("a", 0.6), node("b", 0.6)], MODEL, Workload(context_tokens=CONTEXT))
    mesh = mesh_plan_from_json(plan_to_json(plan))
    assert mesh.pipelines == (plan,) and mesh.workload == plan.metadata.workload
    assert mesh.objective is plan.objective and mesh.replicas_asked == 1


def test_a_node_in_two_pipelines_is_refused_by_name(mesh):
    doc = json.loads(mesh_plan_to_json(mesh))
    one = next(p for p in doc["pipelines"] if len(p["stages"]) == 1)
    one["stages"][0]["node_id"] = "s1"
    with pytest.raises(PlanFormatError, match="node s1 appears in pipelines"):
        mesh_plan_from_json(json.dumps(doc))
    with pytest.raises(ValueError, match=f"node {mesh.pipelines[0].node_ids[0]} appears in pipelines 0 and 1"):
        MeshPlan(pipelines=(mesh.pipelines[0], mesh.pipelines[0]), objective=mesh.objective, workload=mesh.workload,
                 tokens_per_s=0.0, replicas_asked=0)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("pipelines"), "missing 'pipelines'"),
    (lambda d: d.update(pipelines=[]), "pipelines must be a non-empty list"),
    (lambda d: d.update(format_version=3), "format_version 3"),
    (lambda d: d["workload"].update(batch=0), "workload.batch"),
    (lambda d: d.update(tokens_per_s=-1), "plan.tokens_per_s"),
    (lambda d: d["pipelines"][1].update(rows=-1), "pipelines[1].rows"),
    (lambda d: d["pipelines"][1]["stages"][0].pop("end"), "pipelines[1].stages[0] is missing 'end'"),
    (lambda d: d["pipelines"][0]["metadata"].pop("model_digest"), "pipelines[0].metadata is missing"),
])
def test_mesh_artifact_errors_name_the_field(mesh, edit, message):
    doc = json.loads(mesh_plan_to_json(mesh))
    edit(doc)
    with pytest.raises(PlanFormatError) as err:
        mesh_plan_from_json(json.dumps(doc))
    assert message in str(err.value)


def test_mesh_reuse_mismatch_names_what_changed(mesh):
    profiles = [node("big", 1.5, 8), *(node(f"s{i}", 0.42) for i in range(3))]
    workload = Workload(tokens_per_step=8, context_tokens=CONTEXT, batch=8)
    assert mesh_reuse_mismatch(mesh, MODEL, profiles, "throughput", workload, DEFAULT_RESERVE, replicas=0) is None
    why = mesh_reuse_mismatch(mesh, MODEL, profiles[:3], "latency", dataclasses.replace(workload, batch=4),
                              Reserve(0.2, 0), replicas=2)
    for part in ("node s2 is gone", "objective differs", "workload differs", "memory reserve differs", "replicas differ"):
        assert part in why


def test_mesh_table_has_a_heading_per_pipeline_and_a_footer(mesh):
    text = format_mesh_plan_table(mesh)
    for i, plan in enumerate(mesh.pipelines):
        assert (f"pipeline {i}: {len(plan.stages)} stages, {plan.micro_batches} micro-batches, {plan.rows} rows, "
                f"predicted {plan.tokens_per_s:.1f} tok/s") in text
    assert text.splitlines()[-1].startswith("objective throughput: 2 pipelines")
    assert "idle nodes: none" in text
    capped = make_mesh_plan([node(f"n{i}", 1.5, 8) for i in range(3)], MODEL, Workload(context_tokens=CONTEXT), replicas=1)
    assert "idle nodes: n" in format_mesh_plan_table(capped)


# ------------------------------------------------------------------------ search cost ----

@pytest.fixture
def dp_calls(monkeypatch) -> list[int]:
    calls = [0]
    for name in ("min_bottleneck_exact", "min_latency_exact", "heuristic_chain"):
        real = getattr(mesh_search, name)

        def counted(*args, _real=real, **kwargs):
            calls[0] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(mesh_search, name, counted)
    return calls


def test_eight_distinct_devices_take_at_most_one_dp_per_subset(dp_calls):
    devices, workload = _random_mesh(21, 8)
    devices = [dataclasses.replace(p, memory_bytes=int(whole_bytes(8) * (0.4 + 0.15 * i))) for i, p in enumerate(devices)]
    start = time.perf_counter()
    mesh = make_mesh_plan(devices, MODEL, dataclasses.replace(workload, batch=16))
    assert time.perf_counter() - start < 30  # generous: about 0.1 s on one core
    assert 1 <= dp_calls[0] <= 2**8 - 1
    assert mesh.pipelines


def test_alike_devices_are_planned_once_per_count(dp_calls):
    devices = [node(f"n{i}", 0.42) for i in range(8)]
    make_mesh_plan(devices, MODEL, Workload(tokens_per_step=32, context_tokens=CONTEXT, batch=32))
    assert dp_calls[0] <= 8  # one per subset size, not 2^8


@pytest.mark.parametrize("share", [1.5, 0.42])
def test_sixteen_devices_peel_greedily_with_few_dp_calls(dp_calls, share):
    devices = [node(f"n{i:02d}", share, 4, bandwidth=4e11 * (1 + i % 3)) for i in range(16)]
    start = time.perf_counter()
    mesh = make_mesh_plan(devices, MODEL, Workload(tokens_per_step=64, context_tokens=CONTEXT, batch=64))
    assert time.perf_counter() - start < 60  # generous: well under a second on one core
    assert dp_calls[0] <= 6 * 16 + 1
    assert len(mesh.pipelines) >= 2
    if share > 1:
        assert stage_counts(mesh) == [1] * 16
