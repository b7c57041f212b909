"""A tensor-parallel stage over several nodes (issue 36, planner/hosts.py and the controller's
--tp-group): the flag's groups checked, grouped nodes planned as one stage (its devices the member node
ids, in the plan JSON too), its profile's figures from the members and the worst link between them, and
every group that cannot be one refused naming the flag."""
from __future__ import annotations

import dataclasses
import json
from argparse import ArgumentTypeError

import pytest

from logicpipe.controller.mesh.pipeline import absent_members
from logicpipe.controller.mesh.planning import check_groups, grouped, host_of, tp_group_flag, tp_hosts_flag
from logicpipe.planner import (
    DeviceProfile,
    Link,
    ModelSpec,
    Workload,
    apply_groups,
    format_plan_table,
    group_profile,
    make_plan,
    mesh_plan_from_json,
    mesh_plan_to_json,
    parse_groups,
    plan_from_json,
    plan_to_json,
)
from logicpipe.planner.cost import allreduce_time_s
from logicpipe.planner.hosts import auto_groups, one_stream_step_s
from logicpipe.v1 import stage_pb2

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
    assert plan.node_ids == ("a", "b", "c")  # (a member is used: no other pipeline may take it)
    assert "a+b" in format_plan_table(plan) and " cpu fp32 x2 " in format_plan_table(plan)  # (`lpctl plan`)
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


# --tp-hosts auto (planner.hosts.auto_groups): the Llama-3-8B shape in bf16 on CPU boxes
L8B = ModelSpec.decoder(name="8b", hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=8,
                        vocab_size=128256, num_layers=32, weight_format="bf16")
LAN = Link(bandwidth=1.25e9, latency=20e-6)     # 10 Gbit/s, 20 us
SLOW = Link(bandwidth=1.25e8, latency=1e-3)     # 1 Gbit/s, 1 ms


def cpu_box(name: str, link: Link, others: str) -> DeviceProfile:
    return DeviceProfile(name, "cpu", 64 * GB, 1e12, 5e10, weight_formats=("bf16", "fp32"),
                         links={o: link for o in others if o != name})


def test_auto_pairs_hosts_on_a_fast_lan_where_the_one_stream_step_gets_shorter():
    boxes = [cpu_box(n, LAN, "abc") for n in "abc"]
    groups = auto_groups(boxes, L8B, 2048, {"a": "h1", "b": "h2", "c": "h3"})
    assert len(groups) == 1 and len(groups[0]) == 2  # pairs only: the third box stays a node of its own
    grouped, _ = apply_groups(boxes, groups, L8B)
    assert one_stream_step_s(grouped, L8B, 2048) < 0.9 * one_stream_step_s(boxes, L8B, 2048)


def test_auto_never_pairs_over_a_slow_link_on_one_host_or_a_model_that_does_not_split():
    assert auto_groups([cpu_box(n, SLOW, "ab") for n in "ab"], L8B, 2048, {"a": "h1", "b": "h2"}) == ()
    fast = [cpu_box(n, LAN, "ab") for n in "ab"]
    assert auto_groups(fast, L8B, 2048, {"a": "h1", "b": "h1"}) == ()  # one host: its cores, shared
    assert auto_groups(fast, L8B, 2048, {"a": "h1"}) == ()              # a host not known
    odd = ModelSpec.decoder(name="odd", hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3,
                            vocab_size=49152, num_layers=30, weight_format="bf16")
    assert auto_groups(fast, odd, 2048, {"a": "h1", "b": "h2"}) == ()


def test_the_controller_joins_the_operator_s_groups_then_with_auto_pairs_of_the_others():
    # boxes of 6 GB: the 8B shape needs three of them; a pipeline of two pairs halves the one-stream step
    boxes = [dataclasses.replace(cpu_box(n, LAN, "abcd"), memory_bytes=6 * GB) for n in "abcd"]
    hosts = {n: f"h{n}" for n in "abcd"}
    out, notes = grouped(boxes, L8B, (("a", "b"),), hosts=hosts)
    assert [(p.node_id, p.members) for p in out] == [("a", ("a", "b")), ("c", ()), ("d", ())] and not notes  # off
    # (with 64 GB boxes a second pair would not shorten the step: one pair holds the whole model)
    assert len(auto_groups([cpu_box(n, LAN, "abcd") for n in "abcd"], L8B, 2048, hosts)) == 1
    out, notes = grouped(boxes, L8B, (("a", "b"),), auto=True, hosts=hosts)
    assert [p.members for p in out] == [("a", "b"), ("c", "d")] and "--tp-hosts auto: c,d" in notes[0]
    assert host_of(stage_pb2.StatusReply(compute_id="cpu@0123abcd")) == "0123abcd"
    with pytest.raises(ArgumentTypeError, match="--tp-hosts must be auto or off"):
        tp_hosts_flag("on")


def test_a_member_that_did_not_join_is_blamed_for_the_failed_install_not_rank_0():
    members = (("a", "10.0.0.1:50061"), ("b", "10.0.0.2:50061"), ("c", "10.0.0.3:50061"))
    details = ("node a could not load layers [0, 4) of m: tensor-parallel group over a, b, c: member b, c did not "
               "join at tcp://10.0.0.1:41000 within 60 s; it stays unassigned")
    assert absent_members(details, members) == "10.0.0.2:50061, 10.0.0.3:50061"
    assert absent_members("node a could not load layers: out of memory", members) == ""
