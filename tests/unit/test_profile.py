"""A node's resource profile: measured once per host and device, then read from the cache."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from logicpipe.stage_node import profile


def test_profile_is_measured_then_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("LOGICPIPE_CACHE", str(tmp_path))
    calls = []
    real = profile.measure_flops
    monkeypatch.setattr(profile, "measure_flops", lambda device, *a: calls.append(device) or real(device, *a))
    first = profile.host_profile("cpu")
    assert first.device_kind == "cpu" and first.flops > 1e8 and first.mem_bandwidth > 1e8
    assert first.memory_bytes > 0 and first.weight_formats == ("fp32",) and first.compute_format == "fp32"
    assert first.weight_bandwidth > 1e8 and first.weight_bytes_per_param == 4.0
    cached = list((tmp_path / "profiles").glob("*-cpu-fp32-fp32.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text())["format_flops"]["fp32"] == first.flops
    again = profile.host_profile("cpu")
    assert calls == ["cpu"] and again.flops == first.flops  # no second micro-benchmark
    profile.host_profile("cpu", refresh=True)
    assert calls == ["cpu", "cpu"]


def test_corrupt_cache_is_remeasured(tmp_path, monkeypatch):
    monkeypatch.setenv("LOGICPIPE_CACHE", str(tmp_path))
    path = profile._cache_path("cpu", ("fp32",), "fp32")
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert profile.host_profile("cpu").flops > 0
    assert json.loads(path.read_text())["version"] == profile.PROFILE_VERSION


def test_offered_formats_follow_dtype_and_quantize():
    assert profile.offered_formats("cpu") == (("fp32",), "fp32")  # 16-bit products are slow on a CPU
    assert profile.offered_formats("cpu", "bfloat16") == (("bf16",), "bf16")
    assert profile.offered_formats("cpu", quantize="int8") == (("int8",), "fp32")
    assert profile.offered_formats("cpu", "bfloat16", "nf4") == (("nf4",), "bf16")
    with pytest.raises(ValueError, match="float16"):
        profile.offered_formats("cpu", "float16")  # this CPU path offers fp32 and bf16 only


@pytest.mark.parametrize("fmt, low, high", [("int8", 1.0, 1.01), ("int4", 0.5, 0.63)])
def test_a_quantized_profile_measures_its_own_format(fmt, low, high, tmp_path, monkeypatch):
    """A quantized node's weights read at its kernel's rate and hold its format's bytes per
    parameter, scales included (int8: 1 + a bf16 scale a row; int4: 0.5 + a bf16 scale and zero per
    32); its speeds are cached apart from the float profile's."""
    monkeypatch.setenv("LOGICPIPE_CACHE", str(tmp_path))
    q = profile.host_profile("cpu", quantize=fmt)
    assert q.weight_formats == (fmt,) and q.compute_format == "fp32"
    assert low <= q.weight_bytes_per_param < high
    assert dict(q.format_flops).keys() == {fmt} and q.flops > 0 and q.weight_bandwidth > 0
    assert len(list((tmp_path / "profiles").glob(f"*-cpu-{fmt}-fp32-*.json"))) == 1  # named by its kernels too


def test_a_dtype_the_device_lacks_is_refused_at_start(tmp_path):
    """logicpipe-stage --dtype float16 on a CPU: it exits at once, saying what the device has."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "logicpipe.stage_node.main", "--device", "cpu", "--dtype", "float16", "--no-mdns",
                           "--no-profile", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=root,
                          env={**os.environ, "PYTHONPATH": f"{root}:{root / 'protos'}"})
    assert proc.returncode != 0
    assert "--dtype float16: this cpu computes in fp32, bf16 only" in proc.stderr
