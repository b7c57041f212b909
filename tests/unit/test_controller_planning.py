"""The controller's planner driver: profiles from node status, plan reuse, lpctl plan offline."""
from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from controller import planning
from logicpipe.v1 import stage_pb2
from planner import Link, Objective, Workload, plan_from_json

GIB = 2**30


def status(node_id: str, flops: float, memory: int) -> stage_pb2.StatusReply:
    return stage_pb2.StatusReply(node_id=node_id, device="cpu", profile=stage_pb2.DeviceProfile(
        device_kind="cpu", memory_bytes=memory, flops=flops, mem_bandwidth=20e9, weight_formats=["fp32"]))


@pytest.fixture()
def spec(model_dir):
    from logicpipe.modeldir import ModelConfig, model_digest

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


def test_reuse_or_plan_reuses_and_names_the_change(tmp_path, spec, caplog):
    path = str(tmp_path / "plan.json")
    fast = planning.device_profile(status("gpu", 20e12, 8 * GIB), {"cpu": Link(1e9, 1e-4)})
    slow = planning.device_profile(status("cpu", 1e11, 8 * GIB), {"gpu": Link(1e9, 1e-4)})
    wl = Workload(context_tokens=1024)
    first = planning.reuse_or_plan(path, [fast, slow], spec, wl, "dp", "throughput")
    assert plan_from_json(open(path).read()) == first
    caplog.set_level(logging.INFO, logger="controller.planning")
    again = planning.reuse_or_plan(path, [fast, slow], spec, wl, "dp", "throughput")
    assert again == first and "reusing the plan" in caplog.text
    slower = planning.device_profile(status("cpu", 1e10, 8 * GIB), {"gpu": Link(1e9, 1e-4)})
    caplog.clear()
    third = planning.reuse_or_plan(path, [fast, slower], spec, wl, "dp", "throughput")
    assert "profile of node cpu changed" in caplog.text
    assert third.metadata.profiles_digest != first.metadata.profiles_digest
    caplog.clear()
    planning.reuse_or_plan(path, [fast, slower], spec, wl, "dp", "latency")
    assert "objective differs" in caplog.text


def test_custom_boundaries_are_cut_points(spec):
    profiles = [planning.device_profile(status(n, 1e11, 8 * GIB), {}) for n in ("a", "b", "c")]
    plan = planning.plan_for(profiles, spec, Workload(), "custom", "throughput", [5, 20])
    assert [(s.start, s.end) for s in plan.stages] == [(0, 5), (5, 20), (20, 30)]
    assert plan.objective is Objective.THROUGHPUT


def test_lpctl_plan_from_profiles_file(tmp_path, model_dir):
    profiles = [
        {"node_id": "jetson", "device_kind": "cuda", "memory_bytes": 4 * GIB, "flops": 2e12, "mem_bandwidth": 50e9,
         "links": {"desktop": {"bandwidth": 1.2e8, "latency": 5e-4}}},
        {"node_id": "desktop", "device_kind": "cpu", "memory_bytes": 16 * GIB, "flops": 2e11, "mem_bandwidth": 30e9,
         "links": {"jetson": {"bandwidth": 1.2e8, "latency": 5e-4}}},
    ]
    path = tmp_path / "profiles.json"
    path.write_text(json.dumps(profiles))
    lpctl = [sys.executable, "-m", "controller.lpctl", "plan", "--profiles", str(path), "--model", str(model_dir)]
    table = subprocess.run(lpctl, capture_output=True, text=True, timeout=120, check=True).stdout
    assert "jetson" in table and "objective throughput" in table
    doc = json.loads(subprocess.run([*lpctl, "--json", "--strategy", "uniform"], capture_output=True, text=True,
                                    timeout=120, check=True).stdout)
    assert doc["strategy"] == "uniform" and len(doc["stages"]) == 2
    bad = subprocess.run([*lpctl, "--strategy", "custom"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "boundaries" in bad.stderr
