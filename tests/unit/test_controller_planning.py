"""The controller's planner driver: profiles from node status, plan reuse, lpctl plan offline."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import subprocess
import sys
import types

import pytest

from logicpipe.controller.mesh import planning
from logicpipe.planner import Link, Objective, Workload, mesh_plan_from_json
from logicpipe.v1 import stage_pb2

GIB = 2**30


def status(node_id: str, flops: float, memory: int) -> stage_pb2.StatusReply:
    return stage_pb2.StatusReply(node_id=node_id, device="cpu", profile=stage_pb2.DeviceProfile(
        device_kind="cpu", memory_bytes=memory, flops=flops, mem_bandwidth=20e9, weight_formats=["fp32"]))


@pytest.fixture()
def spec(model_dir):
    from logicpipe.common.modeldir import ModelConfig, model_digest

    return planning.model_spec(ModelConfig.from_dir(model_dir), "smol", model_digest(model_dir))


def test_measurements_are_bucketed_so_jitter_keeps_the_profile():
    a = planning.device_profile(status("a", 141.9e9, 22_700_000_000), {"b": Link(1e9, 1e-4)})
    b = planning.device_profile(status("a", 142.3e9, 22_800_000_000), {"b": Link(1e9, 1e-4)})
    assert a == b
    assert planning.bucket(1.1e-4) == planning.bucket(1.15e-4)
    assert planning.bucket(1e-4) != planning.bucket(4e-4)
    assert planning.memory_floor(23 * GIB + 5) == 23 * GIB


def test_profile_missing_is_a_clear_error():
    from logicpipe.errors import Unavailable

    with pytest.raises(Unavailable, match="no measured profile"):
        planning.device_profile(stage_pb2.StatusReply(node_id="x"), {})


def options(strategy: str = "dp", objective: str = "throughput", replicas: int = 0) -> types.SimpleNamespace:
    """The ControllerOptions fields the planner driver reads."""
    return types.SimpleNamespace(strategy=strategy, objective=objective, replicas=replicas, replan_gain=0.1)


def test_reuse_or_plan_reuses_and_names_the_change(tmp_path, spec, caplog):
    path = str(tmp_path / "plan.json")
    fast = planning.device_profile(status("gpu", 20e12, 8 * GIB), {"cpu": Link(1e9, 1e-4)})
    slow = planning.device_profile(status("cpu", 1e11, 8 * GIB), {"gpu": Link(1e9, 1e-4)})
    wl = Workload(context_tokens=1024)
    first = planning.reuse_or_plan(path, [fast, slow], spec, wl, options())
    assert mesh_plan_from_json(open(path).read()) == first
    caplog.set_level(logging.INFO, logger="logicpipe.controller.mesh.planning")
    again = planning.reuse_or_plan(path, [fast, slow], spec, wl, options())
    assert again == first and "reusing the plan" in caplog.text
    slower = planning.device_profile(status("cpu", 1e10, 8 * GIB), {"gpu": Link(1e9, 1e-4)})
    caplog.clear()
    third = planning.reuse_or_plan(path, [fast, slower], spec, wl, options())
    assert "profile of node cpu changed" in caplog.text
    assert third.metadata.profiles_digest != first.metadata.profiles_digest
    caplog.clear()
    planning.reuse_or_plan(path, [fast, slower], spec, wl, options(objective="latency"))
    assert "objective differs" in caplog.text
    caplog.clear()
    planning.reuse_or_plan(path, [fast, slower], spec, wl, options(objective="latency", replicas=1))
    assert "replicas differ" in caplog.text


def test_custom_boundaries_are_cut_points(spec):
    profiles = [planning.device_profile(status(n, 1e11, 8 * GIB), {}) for n in ("a", "b", "c")]
    plan = planning.plan_for(profiles, spec, Workload(), "custom", "throughput", [5, 20])
    assert [(s.start, s.end) for s in plan.stages] == [(0, 5), (5, 20), (20, 30)]
    assert plan.objective is Objective.THROUGHPUT


def profile(node_id: str, memory: int, links: dict | None = None, **kw) -> dict:
    return {"node_id": node_id, "device_kind": "cpu", "memory_bytes": memory, "flops": 2e11, "mem_bandwidth": 30e9,
            "weight_formats": ["fp32"], "links": links or {}, **kw}


def shape(tmp_path, model_dir, profiles: list[dict], objective: str = "throughput", concurrency: int = 8,
          replicas: int = 0) -> list[list[str]]:
    """The nodes of each pipeline `lpctl plan --profiles` makes of `profiles` (in-process: its code)."""
    path = tmp_path / "profiles.json"
    path.write_text(json.dumps(profiles))
    doc, table = planning.plan_from_profiles_file(str(path), str(model_dir), None, objective, None, 2048,
                                                  replicas=replicas, concurrency=concurrency)
    assert "pipeline" in table
    return [[s["node_id"] for s in p["stages"]] for p in json.loads(doc)["pipelines"]]


def test_lpctl_plan_from_profiles_shapes(tmp_path, model_dir):
    """The shapes of the issue: nodes that each hold the model -> a pipeline each; nodes too small
    -> one pipeline over them; one big node and three small -> two pipelines side by side; the
    latency objective on slow links -> the node that holds it alone, no hop."""
    whole, third = 4 * GIB, 300 * 2**20  # the default model is 0.5 GiB in fp32
    assert sorted(shape(tmp_path, model_dir, [profile(f"n{i}", whole) for i in range(4)])) == \
        [["n0"], ["n1"], ["n2"], ["n3"]]
    small = shape(tmp_path, model_dir, [profile(f"s{i}", third) for i in range(3)])
    assert len(small) == 1 and sorted(small[0]) == ["s0", "s1", "s2"]
    mixed = shape(tmp_path, model_dir, [profile("big", whole), *(profile(f"s{i}", third) for i in range(3))])
    assert sorted(map(sorted, mixed)) == [["big"], ["s0", "s1", "s2"]]
    slow = {"bandwidth": 1.25e6, "latency": 5e-3}
    nodes = [profile("big", whole, {"s0": slow, "s1": slow}), profile("s0", third, {"big": slow, "s1": slow}),
             profile("s1", third, {"big": slow, "s0": slow})]
    assert shape(tmp_path, model_dir, nodes, objective="latency", concurrency=1)[0] == ["big"]
    capped = shape(tmp_path, model_dir, [profile(f"n{i}", whole) for i in range(4)], replicas=2)
    assert len(capped) == 2 and all(len(p) == 1 for p in capped)


def test_lpctl_plan_from_profiles_file(tmp_path, model_dir):
    profiles = [
        {"node_id": "jetson", "device_kind": "cuda", "memory_bytes": 4 * GIB, "flops": 2e12, "mem_bandwidth": 50e9,
         "links": {"desktop": {"bandwidth": 1.2e8, "latency": 5e-4}}},
        {"node_id": "desktop", "device_kind": "cpu", "memory_bytes": 16 * GIB, "flops": 2e11, "mem_bandwidth": 30e9,
         "links": {"jetson": {"bandwidth": 1.2e8, "latency": 5e-4}}},
    ]
    path = tmp_path / "profiles.json"
    path.write_text(json.dumps(profiles))
    lpctl = [sys.executable, "-m", "logicpipe.controller.cli.lpctl", "plan", "--profiles", str(path), "--model", str(model_dir)]
    table = subprocess.run(lpctl, capture_output=True, text=True, timeout=120, check=True).stdout
    assert "jetson" in table and "pipeline 0" in table
    doc = json.loads(subprocess.run([*lpctl, "--json", "--strategy", "uniform"], capture_output=True, text=True,
                                    timeout=120, check=True).stdout)
    assert [p["strategy"] for p in doc["pipelines"]] == ["uniform"] and len(doc["pipelines"][0]["stages"]) == 2
    assert {"node_id", "start", "end"} <= set(doc["pipelines"][0]["stages"][0])
    bad = subprocess.run([*lpctl, "--strategy", "custom"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "boundaries" in bad.stderr
    assert planning.replicas_flag("auto") == 0 and planning.replicas_flag("3") == 3
    for bad_value in ("none", "0", "65"):
        with pytest.raises(argparse.ArgumentTypeError, match="--replicas must be auto"):
            planning.replicas_flag(bad_value)


def test_a_profile_is_costed_in_the_format_the_node_will_run(spec):
    """A GPU offers bf16, fp16 and fp32: its FLOP/s are those measured in the mesh's format; a
    quantized node reports its format, compute dtype, weight rate and bytes per parameter."""
    gpu = stage_pb2.StatusReply(node_id="gpu", device="cuda", profile=stage_pb2.DeviceProfile(
        device_kind="cuda", memory_bytes=80 * GIB, flops=700e12, mem_bandwidth=3e12,
        weight_formats=["bf16", "fp16", "fp32"], format_flops={"bf16": 700e12, "fp16": 700e12, "fp32": 50e12}))
    assert planning.device_profile(gpu, {}, spec).flops == 50e12  # spec is fp32 (the controller's default)
    bf16 = dataclasses.replace(spec, weight_format="bf16")
    assert planning.device_profile(gpu, {}, bf16).flops == 700e12
    assert planning.device_profile(gpu, {}).flops == 700e12  # no spec: the preferred format's
    q = stage_pb2.StatusReply(node_id="q", device="cpu", profile=stage_pb2.DeviceProfile(
        device_kind="cpu", memory_bytes=8 * GIB, flops=1e10, mem_bandwidth=2e10, weight_formats=["int8"],
        compute_format="fp32", weight_bandwidth=3.14e10, weight_bytes_per_param=1.0009, format_flops={"int8": 1.2e10}))
    p = planning.device_profile(q, {}, spec)
    assert (p.weight_formats, p.compute_format, p.weight_bandwidth, p.weight_bytes_per_param, p.flops) == \
        (("int8",), "fp32", 3.1e10, 1.0, 1.2e10)


def test_stage_formats_give_each_stage_its_dtype_format_and_wire(spec):
    """fp32 CPU -> nf4 GPU stage computing in bf16 -> fp32 CPU: dtypes follow the plan (the
    quantized stage its node's compute format); hidden states travel in the narrower dtype."""
    from logicpipe.planner import DeviceProfile, Stage

    profiles = [DeviceProfile(node_id=n, device_kind="cpu", memory_bytes=GIB, flops=1e10, mem_bandwidth=1e10,
                              weight_formats=f, compute_format=c)
                for n, f, c in (("a", ("fp32",), ""), ("b", ("nf4",), "bf16"), ("c", ("fp32",), ""))]
    stages = tuple(Stage(node_id=n, device_kind="cpu", weight_format=f, start=i * 10, end=i * 10 + 10, compute_s=0.0,
                         transfer_s=0.0, memory_bytes=1) for i, (n, f) in enumerate((("a", "fp32"), ("b", "nf4"), ("c", "fp32"))))
    plan = types.SimpleNamespace(stages=stages)
    assert planning.stage_formats(plan, profiles) == [("float32", "fp32", "bfloat16"), ("bfloat16", "nf4", "bfloat16"),
                                                      ("float32", "fp32", "float32")]


def test_one_table_of_format_names_and_the_planner_agree():
    """logicpipe.formats is the processes' table; the planner (which imports nothing of ours) keeps
    its own bytes per format: they must say the same."""
    from logicpipe import formats
    from logicpipe.planner import model

    assert set(formats.QUANT_FORMATS) == set(model.QUANT_FORMATS)
    assert set(formats.DTYPE_FORMAT.values()) == set(model.FLOAT_FORMATS)
    for dtype, fmt in formats.DTYPE_FORMAT.items():
        assert model.FORMAT_BYTES[fmt] == formats.DTYPE_BYTES[dtype]
    assert set(formats.WEIGHT_FORMATS) <= set(model.FORMAT_BYTES)
