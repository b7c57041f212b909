"""A node's resource profile: measured once per host and device, then read from the cache."""
from __future__ import annotations

import json

from stage_node import profile


def test_profile_is_measured_then_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("LOGICPIPE_CACHE", str(tmp_path))
    calls = []
    real = profile.measure_flops
    monkeypatch.setattr(profile, "measure_flops", lambda device: calls.append(device) or real(device))
    first = profile.host_profile("cpu")
    assert first.device_kind == "cpu" and first.flops > 1e8 and first.mem_bandwidth > 1e8
    assert first.memory_bytes > 0 and "fp32" in first.weight_formats
    cached = list((tmp_path / "profiles").glob("*-cpu.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text())["flops"] == first.flops
    again = profile.host_profile("cpu")
    assert calls == ["cpu"] and again.flops == first.flops  # no second micro-benchmark
    profile.host_profile("cpu", refresh=True)
    assert calls == ["cpu", "cpu"]


def test_corrupt_cache_is_remeasured(tmp_path, monkeypatch):
    monkeypatch.setenv("LOGICPIPE_CACHE", str(tmp_path))
    path = profile._cache_path("cpu")
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert profile.host_profile("cpu").flops > 0
    assert json.loads(path.read_text())["version"] == profile.PROFILE_VERSION
