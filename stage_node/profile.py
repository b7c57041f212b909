"""This node's resource profile: effective FLOP/s and memory bandwidth from a short
micro-benchmark (about a second), and the memory available (OS or CUDA).

The measured speeds are cached per host and device (speeds do not change between restarts; memory
is read fresh every time) under the LogicPipe cache directory.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from logicpipe.paths import cache_root

log = logging.getLogger(__name__)

PROFILE_VERSION = 1


@dataclass(frozen=True)
class HostProfile:
    device_kind: str                  # "cpu" | "cuda"
    device_name: str                  # CPU model or GPU name
    memory_bytes: int                 # memory available for weights and KV now, bytes
    flops: float                      # effective FLOP/s of a float32 (CPU) / float16 (CUDA) matmul
    mem_bandwidth: float              # bytes/s of a large copy (read + write counted)
    weight_formats: tuple[str, ...]   # weight formats this device computes with


def _cache_path(device: str) -> Path:
    return cache_root() / "profiles" / f"{socket.gethostname()}-{device}.json"


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time(fn, device: str, repeats: int) -> float:
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def measure_flops(device: str, n: int = 512, repeats: int = 5) -> float:
    dtype = torch.float16 if device == "cuda" else torch.float32
    n = 4096 if device == "cuda" else n
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / _time(lambda: a @ b, device, repeats)


def measure_bandwidth(device: str, nbytes: int = 64 * 2**20, repeats: int = 5) -> float:
    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * nbytes / _time(lambda: dst.copy_(src), device, repeats)


def available_memory(device: str) -> int:
    if device == "cuda":
        free, _total = torch.cuda.mem_get_info()
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def compute_id(device: str) -> str:
    """What this node computes on: its host (machine id, else hostname) and, for CUDA, the GPU.
    Stages that report the same id share their compute, so micro-batching across them gains nothing."""
    host = socket.gethostname()
    try:
        host = Path("/etc/machine-id").read_text().strip() or host
    except OSError:
        pass
    where = hashlib.sha256(host.encode()).hexdigest()[:12]
    if device == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return f"cuda:{getattr(props, 'uuid', torch.cuda.current_device())}@{where}"
    return f"cpu@{where}"


def weight_formats(device: str) -> tuple[str, ...]:
    if device == "cuda":
        return ("fp32", "fp16", "bf16") if torch.cuda.is_bf16_supported() else ("fp32", "fp16")
    return ("fp32", "bf16")


def host_profile(device: str, *, refresh: bool = False) -> HostProfile:
    """Measure (or read from the cache) this host's profile for `device`."""
    path = _cache_path(device)
    speeds = None
    if not refresh and path.is_file():
        try:
            cached = json.loads(path.read_text())
            if cached.get("version") == PROFILE_VERSION and cached.get("torch") == torch.__version__:
                speeds = cached
        except (OSError, ValueError):
            speeds = None
    if speeds is None:
        t0 = time.monotonic()
        speeds = {"version": PROFILE_VERSION, "torch": torch.__version__,
                  "flops": measure_flops(device), "mem_bandwidth": measure_bandwidth(device)}
        log.info("profiled %s in %.1f s: %.1f GFLOP/s, %.1f GB/s", device, time.monotonic() - t0,
                 speeds["flops"] / 1e9, speeds["mem_bandwidth"] / 1e9)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(speeds))
        except OSError as exc:
            log.warning("could not cache the profile at %s: %s", path, exc)
    return HostProfile(device_kind=device, device_name=_device_name(device), memory_bytes=available_memory(device),
                       flops=float(speeds["flops"]), mem_bandwidth=float(speeds["mem_bandwidth"]),
                       weight_formats=weight_formats(device))
