"""The planner chooses a stage's tensor-parallel width (issue 36, planner/width.py): a node that offers
up to N devices (`max_devices`, --tp-max) is planned at every width that divides the model; TP where it
shortens a token (fast all-reduce), width 1 where the all-reduce costs more than the split saves (a
CPU's gloo on loopback), the width that fits where a narrower one cannot hold the model."""
from __future__ import annotations

import dataclasses

import pytest

from logicpipe.planner import (
    DeviceProfile,
    InfeasibleError,
    ModelSpec,
    Objective,
    Workload,
    evaluate_mesh,
    format_mesh_plan_table,
    make_mesh_plan,
    make_plan,
    mesh_plan_from_json,
    mesh_plan_to_json,
    mesh_reuse_mismatch,
    profile_digest,
)
from logicpipe.planner.cost import layer_time_s
from logicpipe.planner.width import as_planned, at_width, width_choices, width_combinations

GB = 10**9
WORK = Workload(batch=8, context_tokens=2048)
# Llama-3 shapes in bf16 (the benches' --model 8b / 70b)
L8B = ModelSpec.decoder(name="8b", hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=8,
                        vocab_size=128256, num_layers=32, weight_format="bf16")
L70B = ModelSpec.decoder(name="70b", hidden_size=8192, intermediate_size=28672, num_heads=64, num_kv_heads=8,
                         vocab_size=128256, num_layers=80, weight_format="bf16")
# the default model's shape: 9 query heads over 3 KV heads split in 1 or 3, never in 2 or 4
SMOL = ModelSpec.decoder(name="smol", hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3,
                         vocab_size=49152, num_layers=30, weight_format="fp32")


def h100(max_devices: int, *, latency: float = 20e-6, bandwidth: float = 50 * GB, name: str = "box") -> DeviceProfile:
    """One H100's figures (80 GB, ~2.8 TB/s read) offering `max_devices` of them, with the all-reduce
    between them as measured: NVLink-like by default."""
    return DeviceProfile(name, "cuda", 80 * GB, 7e14, 2.8e12, weight_formats=("bf16", "fp16", "fp32"),
                         step_overhead_s=0.5e-3, max_devices=max_devices, allreduce_latency_s=latency,
                         allreduce_bandwidth=bandwidth)


def cpu(max_devices: int, name: str = "cpu") -> DeviceProfile:
    """A CPU box whose ranks share its cores, with gloo's all-reduce on loopback (~0.5 ms, docs/engine.md)."""
    return DeviceProfile(name, "cpu", 16 * GB, 1e11, 1e10, max_devices=max_devices, allreduce_latency_s=5e-4,
                         allreduce_bandwidth=1 * GB)


def widths(mesh) -> list[list[tuple[str, int]]]:
    return [[(s.node_id, s.devices) for s in p.stages] for p in mesh.pipelines]


@pytest.mark.parametrize("objective", ["latency", "throughput"])
def test_fast_links_give_the_8b_shape_a_tp_stage_over_every_gpu(objective):
    for n in (2, 4):
        mesh = make_mesh_plan([h100(n)], L8B, WORK, objective)
        assert widths(mesh) == [[("box", n)]]
        assert mesh.pipelines[0].stages[0].device_ids == tuple(f"box:{i}" for i in range(n))
        one = make_mesh_plan([dataclasses.replace(h100(n), max_devices=0)], L8B, WORK, objective)
        assert mesh.tokens_per_s > one.tokens_per_s  # what the choice was made on


@pytest.mark.parametrize("objective", ["latency", "throughput"])
def test_slow_all_reduce_keeps_width_1(objective):
    slow = h100(4, latency=2e-3, bandwidth=1 * GB)  # an all-reduce of 2 ms: 128 a token cost more than a GPU saves
    assert widths(make_mesh_plan([slow], L8B, WORK, objective)) == [[("box", 1)]]
    assert widths(make_mesh_plan([cpu(2)], SMOL, WORK, objective)) == [[("cpu", 1)]]
    t1, t2 = (layer_time_s(at_width(cpu(2), w), SMOL, Workload()) for w in (1, 2))
    assert t2 > t1  # a CPU's ranks share its cores: the all-reduce is all a second rank adds


def test_a_model_too_big_for_fewer_devices_takes_the_width_that_holds_it():
    slow = h100(4, latency=2e-3, bandwidth=1 * GB)
    assert widths(make_mesh_plan([slow], L70B, WORK, "throughput")) == [[("box", 4)]]
    with pytest.raises(InfeasibleError, match="GiB"):  # what is missing even at the widest
        make_mesh_plan([h100(1)], L70B, WORK)


def test_a_width_that_does_not_divide_the_model_is_never_a_candidate():
    assert SMOL.tp_widths(4) == (1, 3)
    assert width_choices(h100(4), SMOL) == (1, 3)
    assert width_choices(h100(8), L8B) == (1, 2, 4, 8)
    assert ModelSpec.decoder(name="mla", hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=4,
                             vocab_size=256, num_layers=2, tp_sizes=()).tp_widths(4) == (1,)
    mesh = make_mesh_plan([h100(2)], SMOL, WORK, "latency")  # fast links, but 9 heads do not split in 2
    assert widths(mesh) == [[("box", 1)]]
    # 24 heads over 6 KV heads split in 1, 2, 3 or 6: on 4 GPUs TP 3, never 4
    odd = ModelSpec.decoder(name="odd", hidden_size=3072, intermediate_size=12288, num_heads=24, num_kv_heads=6,
                            vocab_size=96000, num_layers=48, weight_format="bf16")
    assert odd.tp_widths(4) == (1, 2, 3)
    assert widths(make_mesh_plan([h100(4, latency=10e-6)], odd, WORK, "latency")) == [[("box", 3)]]


def test_a_fixed_width_is_kept_and_profiles_are_checked():
    fixed = dataclasses.replace(h100(0), devices=2, memory_bytes=160 * GB, flops=1.4e15, mem_bandwidth=5.6e12)
    assert width_choices(fixed, L8B) == (2,)
    assert widths(make_mesh_plan([fixed, h100(1, name="other")], L8B, WORK, "latency"))[0] == [("box", 2)]
    with pytest.raises(ValueError, match="max_devices"):
        dataclasses.replace(fixed, max_devices=4)
    with pytest.raises(ValueError, match="1 to 2"):
        at_width(h100(2), 3)


def test_at_width_multiplies_separate_devices_only():
    g = at_width(h100(4), 4)
    assert (g.devices, g.max_devices, g.memory_bytes, g.flops, g.mem_bandwidth) == (4, 0, 320 * GB, 2.8e15, 11.2e12)
    c = at_width(cpu(2), 2)
    assert (c.devices, c.memory_bytes, c.flops, c.mem_bandwidth) == (2, 16 * GB, 1e11, 1e10)
    assert as_planned(h100(4), 2) == at_width(h100(4), 2) and as_planned(h100(0), 1) == h100(0)


def test_two_flexible_nodes_are_planned_over_every_width_combination():
    combos = width_combinations([h100(2, name="a"), h100(4, name="b")], L8B)
    assert sorted(tuple(p.devices for p in c) for c in combos) == [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4)]
    assert [sum(p.devices for p in c) for c in combos] == sorted(sum(p.devices for p in c) for c in combos)
    mesh = make_mesh_plan([h100(2, name="a"), h100(4, name="b")], L8B, WORK, "latency")
    assert widths(mesh)[0] == [("b", 4)]  # the one stream on the widest TP stage


def test_the_classic_planner_chooses_the_width_too():
    assert [(s.node_id, s.devices) for s in make_plan([h100(2)], L8B, WORK, Objective.LATENCY).stages] == [("box", 2)]
    assert [(s.node_id, s.devices) for s in make_plan([cpu(2)], SMOL, WORK).stages] == [("cpu", 1)]


def test_the_plan_records_the_profiles_as_given_and_is_costed_again_at_its_widths():
    box = h100(2)
    mesh = make_mesh_plan([box], L8B, WORK, "throughput")
    assert dict(mesh.metadata.node_digests) == {"box": profile_digest(box)}
    assert mesh_reuse_mismatch(mesh, L8B, [box], "throughput", WORK) is None
    assert "box" in (mesh_reuse_mismatch(mesh, L8B, [h100(4)], "throughput", WORK) or "")
    again = evaluate_mesh(mesh.pipelines, [box], L8B, WORK, "throughput")
    assert again.tokens_per_s == pytest.approx(mesh.tokens_per_s)
    read = mesh_plan_from_json(mesh_plan_to_json(mesh))
    assert widths(read) == [[("box", 2)]]
    assert "cuda bf16 x2" in format_mesh_plan_table(mesh)  # lpctl plan's table shows the width
    assert profile_digest(h100(2)) != profile_digest(h100(4)) != profile_digest(dataclasses.replace(h100(4), max_devices=0))
