"""This node's resource profile: what it computes in, how fast, and the memory available.

Formats. A node runs its layers in the formats it offers, preferred first (`offered_formats`):
with `--quantize int4|int8|nf4|fp4` that one format (activations, KV, embeddings and head then in its
compute dtype); else by `--dtype`: `auto` offers fp32 on a CPU (16-bit products are several times
slower there) and bf16, fp16, fp32 on a GPU (fp16, fp32 without bf16); a named dtype offers that
one. The mesh's format is the controller's --dtype; a node runs it, or upcasts a 16-bit one to fp32
(see planner.model).

Speeds are measured in those formats by short micro-benchmarks (about a second):
  * FLOP/s of a matrix product in each offered float format (prompts are compute-bound) or through
    the quantized kernel;
  * memory bandwidth of a large copy (KV, embeddings, head);
  * the weight bandwidth of a one-token product in the preferred format: weight bytes over its
    time, which is what decode costs (a quantized kernel that dequantizes slower than memory
    streams shows here), and the bytes per parameter it holds, scales included.
They are cached per host, device, format and, for int4 / int8 on a CPU, the kernel this process
chose for the format (`quant.cpu_kernel`: the native kernel or torch's, by timing at start, so the
profile measures the kernel that will run) — speeds do not change between restarts; memory is read
fresh every time — under the LogicPipe cache directory.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from logicpipe.common.paths import cache_root
from logicpipe.formats import DTYPE_FORMAT
from logicpipe.stage_node.model.ops import DECODE_ROWS, linear
from logicpipe.stage_node.kernels.quant import HEAD_FORMAT, cpu_kernel, quantize, tensor_bytes

log = logging.getLogger(__name__)

PROFILE_VERSION = 5  # 3: int4, and int8 by the packed weight-only kernel; 4: CUDA timings without launch overhead;
                     # 5: int4 / int8 by the kernel chosen at start (native or torch's), named in the cache

FORMAT_DTYPE = {f: getattr(torch, d) for d, f in DTYPE_FORMAT.items()}
CUDA_INNER = 20  # on a GPU each timing runs the kernel this many times back to back: one launch and sync
                 # would be several times a 64 MiB copy's own time, and the bandwidth would read far too low


@dataclass(frozen=True)
class HostProfile:
    device_kind: str                  # "cpu" | "cuda"
    device_name: str                  # CPU model or GPU name
    memory_bytes: int                 # memory available for weights and KV now, bytes
    flops: float                      # effective FLOP/s of a product in the preferred format
    mem_bandwidth: float              # bytes/s of a large copy (read + write counted)
    weight_formats: tuple[str, ...]   # weight formats this node runs, preferred first
    compute_format: str = "fp32"      # float format of activations and KV beside a quantized format
    weight_bandwidth: float = 0.0     # bytes/s of weights read by a one-token product, preferred format
    weight_bytes_per_param: float = 0.0  # bytes per parameter held in the preferred format
    format_flops: tuple[tuple[str, float], ...] = ()  # FLOP/s per offered format
    devices: int = 1                  # devices a stage spans (--tp N: N GPUs, or N CPU processes)
    allreduce_latency_s: float = 0.0  # ... its measured all-reduce: seconds of a small one,
    allreduce_bandwidth: float = 0.0  # ... and bytes/s of a large one (0: one device)
    kv_format: str = ""               # its KV: "" the compute format, "int8" / "fp8" (--kv-dtype; engine.kv_quant)
    full_sliding_kv: bool = False     # its sliding-window layers keep every position (--window-kv off; --tp):
                                      # the planner counts them as full layers (engine.window)
    max_devices: int = 0              # --tp-max N: devices the plan may give one stage (the figures are one
                                      # device's, the all-reduce that over all N; planner.width); 0: fixed


def tensor_parallel(profile: HostProfile, world: int, allreduce: tuple[float, float] = (0.0, 0.0)) -> HostProfile:
    """The profile of a `--tp world` stage measured on one of its ranks: on CUDA, world GPUs like the
    measured one (memory, FLOP/s and bandwidths times world); on a CPU the ranks share the host's
    memory and cores, so those stay as measured. `allreduce`: the ranks' measured all-reduce
    (latency s, bytes/s), which the planner adds to every layer of a step (issue 36)."""
    if world <= 1:
        return profile
    lat, bw = allreduce
    if profile.device_kind != "cuda":
        return replace(profile, devices=world, allreduce_latency_s=lat, allreduce_bandwidth=bw)
    return replace(profile, devices=world, allreduce_latency_s=lat, allreduce_bandwidth=bw, memory_bytes=profile.memory_bytes * world, flops=profile.flops * world,
                               mem_bandwidth=profile.mem_bandwidth * world,
                               weight_bandwidth=profile.weight_bandwidth * world,
                               format_flops=tuple((f, v * world) for f, v in profile.format_flops))


def offering(profile: HostProfile, most: int, allreduce: tuple[float, float] = (0.0, 0.0)) -> HostProfile:
    """The profile of a `--tp-max most` node: one device's figures as measured, the devices it offers and
    the all-reduce its `most` ranks measured at start; the planner makes each width of it (planner.width)."""
    if most <= 1:
        return profile
    return replace(profile, max_devices=most, allreduce_latency_s=allreduce[0], allreduce_bandwidth=allreduce[1])


def _cache_path(device: str, formats: tuple[str, ...] = ("fp32",), compute: str = "fp32", kernels: str = "") -> Path:
    return cache_root() / "profiles" / f"{socket.gethostname()}-{device}-{'.'.join(formats)}-{compute}{kernels}.json"


def cpu_kernels(device: str, formats: tuple[str, ...]) -> str:
    """The CPU kernels chosen for the quantized formats among `formats` (and their LM head's), as a
    cache-name suffix ("" for none): choosing them here, at start, is what times them."""
    if device != "cpu":
        return ""
    fmts = sorted({g for f in formats if f in HEAD_FORMAT for g in (f, HEAD_FORMAT[f])})
    return "".join(f"-{f}.{cpu_kernel(f)}" for f in fmts)


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time(fn, device: str, repeats: int, budget_s: float = 0.5) -> float:
    """Best time of one fn() over up to `repeats` runs (fewer once `budget_s` is spent: slow
    kernels); on a GPU each run is CUDA_INNER calls back to back, divided (a decode step's kernels
    run back to back too: one launch and sync per call would count the host, not the device)."""
    inner = CUDA_INNER if device == "cuda" else 1
    fn()
    _sync(device)
    best = float("inf")
    start = time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / inner)
        if time.perf_counter() - start > budget_s:
            break
    return best


def measure_flops(device: str, fmt: str = "fp32", compute: str = "fp32", repeats: int = 3) -> float:
    """FLOP/s of an n x n product (prompt-like) in float format `fmt`, or through the quantized
    kernel of `fmt` with activations in `compute`."""
    n = 4096 if device == "cuda" else 512
    dtype = FORMAT_DTYPE.get(fmt, FORMAT_DTYPE[compute])
    a = torch.randn(n, n, device=device, dtype=dtype)
    if fmt in FORMAT_DTYPE:
        b = torch.randn(n, n, device=device, dtype=dtype)
        return 2 * n**3 / _time(lambda: a @ b, device, repeats)
    m = quantize(torch.randn(n, n, device=device, dtype=dtype), fmt)
    return 2 * n**3 / _time(lambda: m(a), device, repeats)


def measure_weight_bandwidth(device: str, fmt: str, compute: str = "fp32", repeats: int = 5) -> tuple[float, float]:
    """(bytes/s, bytes per parameter) of a one-token product over a matrix larger than the caches,
    held in `fmt`: the rate at which decode reads this node's weights."""
    out_f, in_f = 8192, 8192  # 64M parameters: past any CPU cache in every format (32 MiB in nf4)
    dtype = FORMAT_DTYPE.get(fmt, FORMAT_DTYPE[compute])
    w = torch.randn(out_f, in_f, device=device, dtype=dtype)
    if fmt not in FORMAT_DTYPE:
        w = quantize(w, fmt)
    x = torch.randn(1, in_f, device=device, dtype=dtype)
    nbytes = tensor_bytes(w)
    return nbytes / _time(lambda: linear(x, w, None, DECODE_ROWS), device, repeats), nbytes / (out_f * in_f)


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


def float_formats(device: str) -> tuple[str, ...]:
    """The float formats `device` computes in, preferred first."""
    if device == "cuda":
        return ("bf16", "fp16", "fp32") if torch.cuda.is_bf16_supported() else ("fp16", "fp32")
    return ("fp32", "bf16")


def offered_formats(device: str, dtype: str = "auto", quantize: str = "none") -> tuple[tuple[str, ...], str]:
    """(weight formats this node offers, preferred first; its compute format) for its --dtype and
    --quantize (see the module docstring). ValueError for a dtype the device lacks."""
    floats = float_formats(device)
    if dtype == "auto":
        compute = floats[0]
        offered = ("fp32",) if device == "cpu" else floats
    else:
        compute = DTYPE_FORMAT.get(dtype, "")
        if compute not in floats:
            raise ValueError(f"--dtype {dtype}: this {device} computes in {', '.join(floats)} only")
        offered = (compute,)
    return ((quantize,) if quantize != "none" else offered), compute


def host_profile(device: str, *, dtype: str = "auto", quantize: str = "none", refresh: bool = False) -> HostProfile:
    """Measure (or read from the cache) this host's profile for `device`, `dtype` and `quantize`."""
    formats, compute = offered_formats(device, dtype, quantize)
    kernels = cpu_kernels(device, formats)
    path = _cache_path(device, formats, compute, kernels)
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
        wbw, per_param = measure_weight_bandwidth(device, formats[0], compute)
        speeds = {"version": PROFILE_VERSION, "torch": torch.__version__,
                  "format_flops": {f: measure_flops(device, f, compute) for f in formats},
                  "mem_bandwidth": measure_bandwidth(device), "weight_bandwidth": wbw, "weight_bytes_per_param": per_param}
        log.info("profiled %s (%s%s) in %.1f s: %s, %.1f GB/s copy, %.1f GB/s of %s weights (%.3g bytes/param)",
                 device, "/".join(formats), kernels.replace("-", " ").replace(".", ": "), time.monotonic() - t0,
                 ", ".join(f"{f} {v / 1e9:.1f} GFLOP/s" for f, v in speeds["format_flops"].items()),
                 speeds["mem_bandwidth"] / 1e9, wbw / 1e9, formats[0], per_param)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            part = path.with_name(f"{path.name}.{os.getpid()}.part")  # stages starting together read it whole
            part.write_text(json.dumps(speeds))
            os.replace(part, path)
        except OSError as exc:
            log.warning("could not cache the profile at %s: %s", path, exc)
    flops = {f: float(v) for f, v in speeds["format_flops"].items()}
    return HostProfile(device_kind=device, device_name=_device_name(device), memory_bytes=available_memory(device),
                       flops=flops[formats[0]], mem_bandwidth=float(speeds["mem_bandwidth"]), weight_formats=formats,
                       compute_format=compute, weight_bandwidth=float(speeds["weight_bandwidth"]),
                       weight_bytes_per_param=float(speeds["weight_bytes_per_param"]),
                       format_flops=tuple(flops.items()))
