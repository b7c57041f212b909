"""The DP partitioner against brute force, and its placement behaviour on clear-cut cases."""
from __future__ import annotations

import itertools
import math
import random

import pytest

from logicpipe.planner import (
    DeviceProfile,
    InfeasibleError,
    Link,
    ModelSpec,
    Objective,
    Reserve,
    Workload,
    build_stages,
    make_plan,
    plan_cost_s,
)
from logicpipe.planner.bounds import lower_bound_s
from logicpipe.planner.cost import memory_overflow_bytes
from logicpipe.planner.dp import min_bottleneck_exact, min_latency_exact
from logicpipe.planner.heuristic import heuristic_chain
from logicpipe.planner.instance import eligible_profiles, make_instance
from logicpipe.planner.model import device_weight_format

GiB = 2**30
REL = 1e-9


# ------------------------------------------------------------------ random small instances ---

def random_model(rng: random.Random, num_layers: int) -> ModelSpec:
    embedding = rng.choice([0, 150, 400])
    head = rng.choice([150, 400, 600])
    return ModelSpec(
        name=f"rand-{num_layers}", num_layers=num_layers, layer_weight_bytes=rng.choice([100, 200, 300]),
        layer_flops_per_token=rng.uniform(1e3, 1e5), attention_flops_per_context_token=rng.uniform(0, 10),
        kv_bytes_per_token_per_layer=rng.choice([0, 1, 2]), activation_bytes_per_token=rng.choice([10, 100, 1000]),
        embedding_bytes=embedding, lm_head_bytes=head, lm_head_flops_per_token=rng.uniform(0, 1e5),
        tied_embeddings=head >= embedding and rng.random() < 0.3, weight_format="fp16")


def random_profiles(rng: random.Random, n: int, model: ModelSpec, workload: Workload) -> list[DeviceProfile]:
    """Mixed memory (from too small for one layer to the whole model), speed, links, formats."""
    ids = [f"n{i}" for i in range(n)]
    per_layer = model.layer_weight_bytes + workload.batch * workload.context_tokens * model.kv_bytes_per_token_per_layer
    whole = per_layer * model.num_layers + model.embedding_bytes + model.lm_head_bytes
    out = []
    for node in ids:
        links = {other: Link(rng.choice([1e3, 1e4, 1e5, 1e6]), rng.uniform(0, 1e-2))
                 for other in ids if other != node and rng.random() < 0.8}
        formats = rng.choice([("fp16", "fp32")] * 4 + [("fp16",), ("fp32", "bf16"), ("bf16",)])
        memory = 0 if rng.random() < 0.1 else int(whole * rng.uniform(0.2, 1.1))
        out.append(DeviceProfile(
            node, rng.choice(["cpu", "cuda"]), memory,
            rng.uniform(1e6, 1e8), rng.uniform(1e5, 1e7), links=links, weight_formats=formats,
            default_link=Link(rng.choice([1e3, 1e5]), rng.uniform(0, 1e-2))))
    return out


def brute_force(profiles, model, workload, reserve) -> dict[Objective, float | None]:
    """Optimum of each objective over all subsets, orders and contiguous splits (None: nothing fits)."""
    L = model.num_layers
    runnable = [p for p in profiles if device_weight_format(p, model) is not None]
    best: dict[Objective, float | None] = {o: None for o in Objective}
    for r in range(1, min(len(runnable), L) + 1):
        for order in itertools.permutations(runnable, r):
            for cuts in itertools.combinations(range(1, L), r - 1):
                bounds = (0, *cuts, L)
                counts = [bounds[i + 1] - bounds[i] for i in range(r)]
                stages = build_stages(order, counts, model, workload)
                if any(memory_overflow_bytes(s, p, reserve) > 0 for s, p in zip(stages, order)):
                    continue
                for objective in Objective:
                    cost = plan_cost_s(stages, objective)
                    if best[objective] is None or cost < best[objective]:
                        best[objective] = cost
    return best


def _cases(count: int, seed: int):
    rng = random.Random(seed)
    for index in range(count):
        n = rng.randint(1, 6)
        L = rng.randint(1, 10 if n <= 3 else 8 if n <= 4 else 6)  # (brute force: n! orders x C(L-1, n-1) cuts)
        workload = Workload(tokens_per_step=rng.randint(1, 4), context_tokens=rng.randint(1, 8), batch=rng.randint(1, 3))
        model = random_model(rng, L)
        reserve = Reserve(rng.choice([0.0, 0.1]), rng.choice([0, 50]))
        yield index, random_profiles(rng, n, model, workload), model, workload, reserve


def test_dp_matches_brute_force_on_random_instances():
    """>= 200 instances of 1-6 devices, both objectives: same optimum, same infeasibility, plans fit."""
    checked = feasible = multi_stage = 0
    for index, profiles, model, workload, reserve in _cases(240, seed=20240601):
        expected = brute_force(profiles, model, workload, reserve)
        by_id = {p.node_id: p for p in profiles}
        for objective in Objective:
            want = expected[objective]
            if want is None:
                with pytest.raises(InfeasibleError):
                    make_plan(profiles, model, workload, objective, reserve=reserve)
                continue
            plan = make_plan(profiles, model, workload, objective, reserve=reserve)
            assert plan.exact and plan.lower_bound_s == plan.cost_s
            assert math.isclose(plan.cost_s, want, rel_tol=REL), (index, objective, plan.cost_s, want)
            assert plan.cost_s == plan_cost_s(plan.stages, objective)
            assert plan.stages[0].start == 0 and plan.stages[-1].end == model.num_layers
            assert all(a.end == b.start for a, b in zip(plan.stages, plan.stages[1:]))
            for stage in plan.stages:
                assert memory_overflow_bytes(stage, by_id[stage.node_id], reserve) <= 0
            feasible += 1
            multi_stage += len(plan.stages) > 1
        checked += 1
    assert checked >= 200
    assert feasible >= 200 and multi_stage >= 100  # the cases exercise real multi-device placements


def test_lower_bounds_never_exceed_the_optimum():
    for _, profiles, model, workload, reserve in _cases(120, seed=7):
        expected = brute_force(profiles, model, workload, reserve)
        inst = make_instance(eligible_profiles(profiles, model, workload, reserve), model, workload, reserve)
        for objective in Objective:
            if expected[objective] is not None:
                assert lower_bound_s(inst, objective) <= expected[objective]


def test_heuristic_is_never_better_than_exact_and_often_equal():
    equal = total = 0
    for _, profiles, model, workload, reserve in _cases(120, seed=11):
        inst = make_instance(eligible_profiles(profiles, model, workload, reserve), model, workload, reserve)
        if inst.n == 0:
            continue
        for objective in Objective:
            exact = min_bottleneck_exact(inst) if objective is Objective.THROUGHPUT else min_latency_exact(inst)
            heur = heuristic_chain(inst, objective, lower_bound_s(inst, objective))
            assert (exact is None) == (heur is None)
            if exact is None:
                continue
            assert inst.chain_fits(heur)
            e, h = inst.chain_cost(exact, objective), inst.chain_cost(heur, objective)
            assert h >= e * (1 - REL)
            equal += math.isclose(h, e, rel_tol=REL)
            total += 1
    assert equal >= 0.9 * total


# --------------------------------------------------------------------------- clear-cut cases ---

def llama_small(num_layers: int = 24) -> ModelSpec:
    return ModelSpec.llama(name="small", hidden_size=1024, intermediate_size=2816, num_heads=16, num_kv_heads=4,
                           vocab_size=32000, num_layers=num_layers, weight_format="fp16")


def device(node: str, kind: str, memory_gib: float, flops: float, bandwidth: float, link_bw: float = 1.25e9,
           latency: float = 2e-4) -> DeviceProfile:
    return DeviceProfile(node, kind, int(memory_gib * GiB), flops, bandwidth,
                         default_link=Link(link_bw, latency), weight_formats=("fp32", "fp16", "bf16"))


WORKLOAD = Workload(tokens_per_step=8, context_tokens=2048, batch=8)


def layers_of(plan, node: str) -> int:
    return sum(s.num_layers for s in plan.stages if s.node_id == node)


@pytest.mark.parametrize("objective", list(Objective))
def test_fast_gpu_beside_slow_cpu_gets_more_layers(objective):
    model = llama_small()
    gpu = device("gpu", "cuda", 0.8, 30e12, 900e9)   # the model needs ~1.1 GiB: the GPU holds ~3/4 of it
    cpu = device("cpu", "cpu", 16, 5e11, 40e9)
    plan = make_plan([cpu, gpu], model, WORKLOAD, objective)
    assert layers_of(plan, "gpu") > layers_of(plan, "cpu") >= 1
    assert plan.exact


@pytest.mark.parametrize("objective", list(Objective))
def test_device_too_small_or_too_slow_is_left_out(objective):
    model = llama_small()
    a = device("a", "cuda", 0.8, 30e12, 900e9)   # a and b hold the ~1.1 GiB model together
    b = device("b", "cuda", 0.8, 30e12, 900e9)
    tiny = device("tiny", "cuda", 0.005, 30e12, 900e9)                    # not even one layer
    slow = device("slow", "cpu", 64, 1e9, 1e9, link_bw=1e6, latency=0.05)  # everything fits, but crawls
    plan = make_plan([tiny, a, slow, b], model, WORKLOAD, objective)
    assert set(plan.node_ids) == {"a", "b"}


def test_infeasible_model_names_missing_memory():
    model = llama_small()   # ~1.1 GiB with this workload
    devices = [device("a", "cuda", 0.2, 30e12, 900e9), device("b", "cpu", 0.2, 1e12, 50e9)]
    with pytest.raises(InfeasibleError) as err:
        make_plan(devices, model, WORKLOAD)
    message = str(err.value)
    assert "more than the 2 devices offer" in message and "MiB" in message
    assert isinstance(err.value, ValueError)


def test_infeasible_when_no_device_holds_the_embedding():
    model = ModelSpec.llama(name="big-vocab", hidden_size=1024, intermediate_size=2816, num_heads=16, num_kv_heads=4,
                            vocab_size=256000, num_layers=4)
    devices = [device(f"d{i}", "cuda", 0.3, 30e12, 900e9) for i in range(4)]
    with pytest.raises(InfeasibleError, match="embedding"):
        make_plan(devices, model, Workload(), reserve=Reserve(0.0, 0))


def test_device_without_the_weight_format_is_left_out_and_fp32_upcast_counts_double():
    model = llama_small(8)
    gpu = device("gpu", "cuda", 8, 30e12, 900e9)
    bf16_only = DeviceProfile("npu", "npu", 8 * GiB, 1e14, 2e12, weight_formats=("bf16",))
    plan = make_plan([bf16_only, gpu], model, WORKLOAD)
    assert plan.node_ids == ("gpu",)
    cpu32 = DeviceProfile("cpu", "cpu", 8 * GiB, 1e12, 50e9, weight_formats=("fp32",))
    cpu16 = DeviceProfile("cpu", "cpu", 8 * GiB, 1e12, 50e9, weight_formats=("fp16",))
    up = make_plan([cpu32], model, WORKLOAD).stages[0]
    native = make_plan([cpu16], model, WORKLOAD).stages[0]
    assert up.weight_format == "fp32" and native.weight_format == "fp16"
    assert up.memory_bytes == 2 * native.memory_bytes


@pytest.mark.parametrize("objective", list(Objective))
@pytest.mark.parametrize("n", [9, 12, 16])
def test_heuristic_above_eight_devices_is_valid_and_bounded(objective, n):
    rng = random.Random(n)
    model = ModelSpec.llama(name="mid", hidden_size=2048, intermediate_size=5632, num_heads=16, num_kv_heads=4,
                            vocab_size=32000, num_layers=40)
    ids = [f"node-{i}" for i in range(n)]
    devices = [DeviceProfile(node, "cuda", int(rng.uniform(0.3, 2.0) * GiB), rng.uniform(1e12, 3e13),
                             rng.uniform(5e10, 9e11),
                             links={o: Link(rng.choice([1.25e7, 1.25e8, 1.25e9]), rng.uniform(1e-4, 2e-3))
                                    for o in ids if o != node})
               for node in ids]
    plan = make_plan(devices, model, WORKLOAD, objective)
    assert not plan.exact
    assert 0 < plan.lower_bound_s <= plan.cost_s and plan.gap >= 0
    assert plan.stages[0].start == 0 and plan.stages[-1].end == model.num_layers
    assert all(a.end == b.start for a, b in zip(plan.stages, plan.stages[1:]))
    assert len(set(plan.node_ids)) == len(plan.stages)
    by_id = {p.node_id: p for p in devices}
    assert all(memory_overflow_bytes(s, by_id[s.node_id], Reserve()) <= 0 for s in plan.stages)
    assert plan.cost_s == plan_cost_s(plan.stages, objective)
