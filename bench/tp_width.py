"""Which tensor-parallel width the planner picks (issue 36, planner/width.py), for synthetic profiles:
one H100's figures (80 GB, 2.8 TB/s, 700 TFLOP/s bf16, 0.5 ms a step) offered as `--tp-max N` with an
NVLink-like or a slow all-reduce, and a CPU node with gloo's on loopback; Llama-3 shapes in bf16, 8
requests of 2048 tokens. Predictions of the cost model, not measurements.

    python -m bench.tp_width
"""
from __future__ import annotations

import dataclasses

from logicpipe.planner import DeviceProfile, InfeasibleError, ModelSpec, Workload, make_mesh_plan

GB = 10**9
WORK = Workload(batch=8, context_tokens=2048)
L8B = ModelSpec.decoder(name="8b", hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=8,
                        vocab_size=128256, num_layers=32, weight_format="bf16")
L70B = ModelSpec.decoder(name="70b", hidden_size=8192, intermediate_size=28672, num_heads=64, num_kv_heads=8,
                         vocab_size=128256, num_layers=80, weight_format="bf16")
SMOL = ModelSpec.decoder(name="135m 8/4 heads", hidden_size=576, intermediate_size=1536, num_heads=8, num_kv_heads=4,
                         vocab_size=49152, num_layers=30, weight_format="fp32")


def h100(n: int, latency: float = 20e-6, bandwidth: float = 50 * GB) -> DeviceProfile:
    return DeviceProfile("box", "cuda", 80 * GB, 7e14, 2.8e12, weight_formats=("bf16", "fp16", "fp32"),
                         step_overhead_s=0.5e-3, max_devices=n, allreduce_latency_s=latency,
                         allreduce_bandwidth=bandwidth)


CPU = DeviceProfile("cpu", "cpu", 16 * GB, 1e11, 1e10, max_devices=2, allreduce_latency_s=5e-4,
                    allreduce_bandwidth=1 * GB)
CASES = [("2 H100, all-reduce 20 us 50 GB/s", h100(2), L8B), ("2 H100, all-reduce 20 us 50 GB/s", h100(2), L70B),
         ("4 H100, all-reduce 20 us 50 GB/s", h100(4), L8B), ("4 H100, all-reduce 20 us 50 GB/s", h100(4), L70B),
         ("4 H100, all-reduce 2 ms 1 GB/s", h100(4, 2e-3, 1 * GB), L8B),
         ("4 H100, all-reduce 2 ms 1 GB/s", h100(4, 2e-3, 1 * GB), L70B),
         ("CPU --tp-max 2, gloo 0.5 ms 1 GB/s", CPU, SMOL)]


def pick(profile: DeviceProfile, model: ModelSpec, objective: str) -> tuple[str, str]:
    """(width, predicted tokens/s) of the plan, or ("-", why not)."""
    try:
        mesh = make_mesh_plan([profile], model, WORK, objective)
    except InfeasibleError as exc:
        return "-", "does not fit (" + str(exc).split(":")[0] + ")"
    return str(mesh.pipelines[0].stages[0].devices), f"{mesh.tokens_per_s:.1f}"


def main() -> None:
    print(f"{'node':36s} {'model':15s} {'objective':10s} width  tok/s  (width 1: tok/s)")
    for label, profile, model in CASES:
        for objective in ("latency", "throughput"):
            width, rate = pick(profile, model, objective)
            _, one = pick(dataclasses.replace(profile, max_devices=0), model, objective)
            print(f"{label:36s} {model.name:15s} {objective:10s} {width:5s}  {rate}  (width 1: {one})")


if __name__ == "__main__":
    main()
