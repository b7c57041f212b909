"""A tensor-parallel stage over several nodes (issue 36, planner/hosts.py and the controller's
--tp-group): the flag's groups checked, grouped nodes planned as one stage (its devices the member node
ids, in the plan JSON too), its profile's figures from the members and the worst link between them, and
every group that cannot be one refused naming the flag."""
from __future__ import annotations

import json
from argparse import ArgumentTypeError

import pytest

from logicpipe.controller.mesh.planning import check_groups, tp_group_flag
from logicpipe.planner import (
    DeviceProfile,
    Link,
    ModelSpec,
    Workload,
    apply_groups,
    group_profile,
    make_plan,
    mesh_plan_from_json,
    mesh_plan_to_json,
    parse_groups,
    plan_from_json,
    plan_to_json,
)
from logicpipe.planner.cost import allreduce_time_s

GB = 10**9
# 8 query heads over 4 KV heads: splits in 2 and 4, never in 3
SPEC = ModelSpec.decoder(name="tiny", hidden_size=512, intermediate_size=1536, num_heads=8, num_kv_heads=4,
                         vocab_size=32000, num_layers=12, weight_format="fp32")


def box(name: str, memory: int = 8 * GB, flops: float = 1e11, links: dict | None = None) -> DeviceProfile:
    return DeviceProfile(name, "cpu", memory, flops, 1e10, links=links or {})


def test_the_flag_parses_groups_and_refuses_bad_ones_by_name():
    assert parse_groups("a,b") == (("a", "b"),)
    assert parse_groups(" a , b ; c,d,e ") == (("a", "b"), ("c", "d", "e"))
    for bad, why in (("a", "one node"), ("a,b;b,c", "node b is in two groups"), ("a,a", "node a is in two"),
                     ("a,,b", "empty node id")):
        with pytest.raises(ArgumentTypeError, match=f"--tp-group.*{why}"):
            tp_group_flag(bad)


def test_a_group_is_one_profile_of_its_slowest_member_times_n_over_its_worst_link():
    fast, slow = Link(bandwidth=1e9, latency=1e-4), Link(bandwidth=2e8, latency=5e-4)
    a = box("a", memory=8 * GB, links={"b": fast, "c": fast})
    b = box("b", memory=6 * GB, flops=5e10, links={"a": slow, "c": fast})
    g = group_profile([a, b], SPEC)
    assert (g.node_id, g.devices, g.members) == ("a", 2, ("a", "b"))
    assert (g.memory_bytes, g.flops, g.mem_bandwidth) == (12 * GB, 1e11, 2e10)
    assert g.links == a.links  # the mesh talks to rank 0
    # a ring of 2 over the slower direction: 2 (n - 1) latencies, n / (2 (n - 1)) of its bandwidth
    assert (g.allreduce_latency_s, g.allreduce_bandwidth) == pytest.approx((2 * 5e-4, 2e8))
    assert allreduce_time_s(g, SPEC, Workload()) > allreduce_time_s(group_profile([a, box("b", links={"a": fast})], SPEC),
                                                                    SPEC, Workload())


def test_grouped_nodes_are_one_stage_whose_devices_are_their_ids():
    profiles, notes = apply_groups([box("a"), box("c"), box("b")], [("a", "b")], SPEC)
    assert [p.node_id for p in profiles] == ["a", "c"] and not notes
    plan = make_plan(profiles, SPEC, Workload(), strategy="uniform")
    assert [s.device_ids for s in plan.stages] == [("a", "b"), ("c",)]
    assert [s.devices for s in plan.stages] == [2, 1]
    # the plan JSON lists them, and reads back to the same stage
    back = plan_from_json(plan_to_json(plan))
    assert [s.members for s in back.stages] == [("a", "b"), ()]
    mesh = mesh_plan_from_json(plan_to_json(plan))  # (a version-1 plan reads as a mesh of it)
    doc = mesh_plan_to_json(mesh)  # what `lpctl plan --json` prints
    assert [s["devices"] for s in json.loads(doc)["pipelines"][0]["stages"]] == [["a", "b"], ["c"]]
    assert mesh_plan_from_json(doc).pipelines[0].stages[0].device_ids == ("a", "b")


def test_a_group_with_a_member_down_plans_its_others_one_by_one():
    profiles, notes = apply_groups([box("a"), box("c")], [("a", "b")], SPEC, known={"b"})
    assert [(p.node_id, p.devices) for p in profiles] == [("a", 1), ("c", 1)]
    assert notes and "--tp-group a,b: b not usable" in notes[0]


@pytest.mark.parametrize("groups, why", [
    ([("a", "x")], "--tp-group a,x: no stage node x in the mesh"),
    ([("a", "b", "c")], "--tp-group a,b,c: 3 nodes do not divide model tiny"),
])
def test_a_group_that_cannot_be_one_is_refused_naming_the_flag(groups, why):
    with pytest.raises(ValueError, match=why):
        apply_groups([box("a"), box("b"), box("c")], groups, SPEC)


def test_the_controller_refuses_a_width_that_does_not_divide_the_model_at_start():
    check_groups((("a", "b"), ("c", "d", "e", "f")), SPEC)
    with pytest.raises(ValueError, match="--tp-group a,b,c: 3 nodes do not divide model tiny .*8, 4, 1536, 32000"):
        check_groups((("a", "b", "c"),), SPEC)


def test_a_node_of_several_devices_or_another_kind_cannot_join_a_group():
    gpu = DeviceProfile("g", "cuda", 8 * GB, 1e12, 1e11)
    with pytest.raises(ValueError, match="--tp-group a,g: the nodes compute on different kinds"):
        group_profile([box("a"), gpu], SPEC)
    wide = DeviceProfile("w", "cpu", 8 * GB, 1e11, 1e10, max_devices=2)
    with pytest.raises(ValueError, match="--tp-group a,w: node w spans several devices itself"):
        group_profile([box("a"), wide], SPEC)
