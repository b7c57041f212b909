"""The five fixed strategies of the seed library: coverage, proportions, memory checks."""
from __future__ import annotations

import pytest

from logicpipe.planner import (
    DeviceProfile,
    InfeasibleError,
    Link,
    ModelSpec,
    Objective,
    Reserve,
    Workload,
    make_plan,
    plan_cost_s,
)
from logicpipe.planner.strategies import apportion, counts_from_boundaries

GiB = 2**30
MODEL = ModelSpec.llama(name="small", hidden_size=1024, intermediate_size=2816, num_heads=16, num_kv_heads=4,
                        vocab_size=32000, num_layers=24)
WORKLOAD = Workload(tokens_per_step=4, context_tokens=1024, batch=4)


def dev(node: str, memory_gib: float, flops: float, bandwidth: float) -> DeviceProfile:
    return DeviceProfile(node, "cuda", int(memory_gib * GiB), flops, bandwidth, default_link=Link(1.25e8, 5e-4))


BIG_SLOW = dev("big-slow", 8.0, 1e12, 5e10)     # lots of memory, slow
SMALL_FAST = dev("small-fast", 1.0, 3e13, 9e11)  # little memory, fast
MID = dev("mid", 2.0, 5e12, 2e11)
DEVICES = [BIG_SLOW, SMALL_FAST, MID]


def counts(plan) -> dict[str, int]:
    return {s.node_id: s.num_layers for s in plan.stages}


def assert_covers(plan, devices):
    assert [s.node_id for s in plan.stages] == [d.node_id for d in devices]  # every device, given order
    assert plan.stages[0].start == 0 and plan.stages[-1].end == MODEL.num_layers
    assert all(a.end == b.start and a.num_layers >= 1 for a, b in zip(plan.stages, plan.stages[1:]))
    assert plan.cost_s == plan_cost_s(plan.stages, plan.objective)
    assert not plan.exact and plan.lower_bound_s <= plan.cost_s


@pytest.mark.parametrize("strategy", ["uniform", "memory", "compute", "mixed"])
@pytest.mark.parametrize("objective", list(Objective))
def test_strategies_cover_all_layers_contiguously(strategy, objective):
    plan = make_plan(DEVICES, MODEL, WORKLOAD, objective, strategy=strategy)
    assert plan.strategy == strategy and plan.objective is objective
    assert_covers(plan, DEVICES)


def test_uniform_splits_evenly():
    assert sorted(counts(make_plan(DEVICES, MODEL, WORKLOAD, strategy="uniform")).values()) == [8, 8, 8]
    five = [dev(f"d{i}", 2.0, 1e12, 1e11) for i in range(5)]
    assert sorted(counts(make_plan(five, MODEL, WORKLOAD, strategy="uniform")).values()) == [4, 5, 5, 5, 5]


def test_memory_gives_bigger_memory_more_layers():
    c = counts(make_plan(DEVICES, MODEL, WORKLOAD, strategy="memory"))
    assert c["big-slow"] > c["mid"] > c["small-fast"]


def test_compute_gives_faster_device_more_layers():
    c = counts(make_plan([BIG_SLOW, SMALL_FAST, MID], MODEL, WORKLOAD, strategy="compute", reserve=Reserve(0.0, 0)))
    assert c["small-fast"] > c["mid"] > c["big-slow"]


def test_mixed_lies_between_memory_and_compute():
    mem = counts(make_plan(DEVICES, MODEL, WORKLOAD, strategy="memory"))
    comp = counts(make_plan(DEVICES, MODEL, WORKLOAD, strategy="compute"))
    mixed = counts(make_plan(DEVICES, MODEL, WORKLOAD, strategy="mixed"))
    for node in mixed:
        assert min(mem[node], comp[node]) <= mixed[node] <= max(mem[node], comp[node])
    assert counts(make_plan(DEVICES, MODEL, WORKLOAD, strategy="mixed", mix=1.0)) == mem
    assert counts(make_plan(DEVICES, MODEL, WORKLOAD, strategy="mixed", mix=0.0)) == comp


def test_custom_uses_the_given_inclusive_boundaries():
    plan = make_plan(DEVICES, MODEL, WORKLOAD, strategy="custom", boundaries=[(0, 15), (16, 19), (20, 23)])
    assert [(s.start, s.end) for s in plan.stages] == [(0, 16), (16, 20), (20, 24)]
    assert_covers(plan, DEVICES)


@pytest.mark.parametrize("boundaries, match", [
    ([(0, 15), (16, 23)], "2 ranges for 3 devices"),
    ([(0, 15), (17, 19), (20, 23)], "starts at layer 17, expected 16"),
    ([(1, 15), (16, 19), (20, 23)], "starts at layer 1, expected 0"),
    ([(0, 15), (16, 19), (20, 22)], "end at layer 22"),
    ([(0, 15), (16, 15), (16, 23)], "ends before it starts"),
    ([(0, 15), (16, "x"), (20, 23)], "pair of layer indices"),
])
def test_custom_rejects_bad_boundaries(boundaries, match):
    with pytest.raises(ValueError, match=match):
        make_plan(DEVICES, MODEL, WORKLOAD, strategy="custom", boundaries=boundaries)


def test_custom_needs_boundaries_and_others_refuse_them():
    with pytest.raises(ValueError, match="needs boundaries"):
        make_plan(DEVICES, MODEL, WORKLOAD, strategy="custom")
    with pytest.raises(ValueError, match="only used by strategy 'custom'"):
        make_plan(DEVICES, MODEL, WORKLOAD, strategy="uniform", boundaries=[(0, 23)])
    with pytest.raises(ValueError, match="unknown strategy"):
        make_plan(DEVICES, MODEL, WORKLOAD, strategy="greedy")


@pytest.mark.parametrize("strategy", ["uniform", "compute", "custom"])
def test_memory_overflow_names_stage_and_overflow(strategy):
    tiny = dev("tiny", 0.1, 3e13, 9e11)   # cannot hold a third of the model, and it is the fastest
    boundaries = [(0, 7), (8, 15), (16, 23)] if strategy == "custom" else None
    with pytest.raises(InfeasibleError) as err:
        make_plan([BIG_SLOW, tiny, MID], MODEL, WORKLOAD, strategy=strategy, boundaries=boundaries)
    message = str(err.value)
    assert "stage 1 (node tiny" in message and "over" in message and "MiB" in message


def test_memory_strategy_fits_where_uniform_overflows():
    small = dev("small", 0.25, 1e13, 5e11)
    with pytest.raises(InfeasibleError):
        make_plan([BIG_SLOW, small], MODEL, WORKLOAD, strategy="uniform")
    plan = make_plan([BIG_SLOW, small], MODEL, WORKLOAD, strategy="memory")
    assert counts(plan)["big-slow"] > counts(plan)["small"]


def test_more_devices_than_layers_is_infeasible():
    many = [dev(f"d{i}", 2.0, 1e12, 1e11) for i in range(25)]
    with pytest.raises(InfeasibleError, match="at least one layer each"):
        make_plan(many, MODEL, WORKLOAD, strategy="uniform")


def test_device_without_weight_format_is_named():
    bf16 = DeviceProfile("npu", "npu", 8 * GiB, 1e13, 1e12, weight_formats=("bf16",))
    with pytest.raises(InfeasibleError, match="stage 1 \\(node npu\\) cannot run weight format fp16"):
        make_plan([MID, bf16], MODEL, WORKLOAD, strategy="uniform")


def test_apportion_is_proportional_with_one_layer_minimum():
    assert apportion([1, 1, 1], 24) == [8, 8, 8]
    assert apportion([3, 1], 8) == [6, 2]
    assert apportion([1000, 1, 1], 10) == [8, 1, 1]
    assert sum(apportion([0.3, 0.3, 0.4], 7)) == 7
    assert apportion([0, 0], 4) == [2, 2]


def test_counts_from_boundaries():
    assert counts_from_boundaries([(0, 15), (16, 31)], 2, 32) == [16, 16]
