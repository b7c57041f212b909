"""Planner speed: make_plan (strategy "dp") on seeded random heterogeneous meshes.

    python -m bench.plan_bench                       # 4, 8, 16, 32 devices x 32, 80 layers
    python -m bench.plan_bench --devices 16 --layers 80 --repeats 5

Each mesh mixes CUDA desktops, Jetson-class boards and CPU boxes (memory, FLOP/s and memory
bandwidth drawn per kind) joined by links of 100 Mbit/s, 1 Gbit/s or 10 Gbit/s with 0.1-2 ms
latency. The model is Llama-3-8B-shaped (fp16) with the layer count set to the row's; the
workload is 8 sequences decoding with 4096 tokens of context. Prints a markdown table: the plan's
kind (exact DP up to 8 devices, heuristic above), its gap to the lower bound, and the median
wall time over the repeats. Goal: <= 1 s for 16 devices x 80 layers.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from logicpipe.planner import (
    DeviceProfile,
    InfeasibleError,
    Link,
    ModelSpec,
    Objective,
    Workload,
    make_plan,
)

GiB = 2**30
LINK_SPEEDS = (12.5e6, 125e6, 1.25e9)  # bytes/s: 100 Mbit/s, 1 Gbit/s, 10 Gbit/s
KINDS = {  # kind: (device_kind, memory GiB range, FLOP/s range, memory bytes/s range)
    "desktop-gpu": ("cuda", (8, 24), (1e13, 6e13), (3e11, 1e12)),
    "jetson": ("cuda", (8, 32), (1e12, 5e12), (5e10, 2e11)),
    "cpu-box": ("cpu", (16, 64), (2e11, 2e12), (2e10, 1e11)),
}
WORKLOAD = Workload(tokens_per_step=8, context_tokens=4096, batch=8)


def random_mesh(seed: int, n: int) -> list[DeviceProfile]:
    """`n` seeded random devices with a measured link for every ordered pair."""
    rng = random.Random(seed)
    ids = [f"node-{i:02d}" for i in range(n)]
    mesh = []
    for node in ids:
        device_kind, memory, flops, bandwidth = KINDS[rng.choice(sorted(KINDS))]
        links = {other: Link(rng.choice(LINK_SPEEDS), rng.uniform(1e-4, 2e-3)) for other in ids if other != node}
        mesh.append(DeviceProfile(node, device_kind, int(rng.uniform(*memory) * GiB), rng.uniform(*flops),
                                  rng.uniform(*bandwidth), links=links))
    return mesh


def bench_model(num_layers: int) -> ModelSpec:
    return ModelSpec.llama(name=f"llama3-8b-shape-{num_layers}L", hidden_size=4096, intermediate_size=14336,
                           num_heads=32, num_kv_heads=8, vocab_size=128256, num_layers=num_layers, weight_format="fp16")


def run_row(n: int, layers: int, objective: Objective, repeats: int, seed: int) -> dict:
    mesh, model = random_mesh(seed * 1000 + n, n), bench_model(layers)
    times, plan, error = [], None, None
    for _ in range(repeats):
        start = time.perf_counter()
        try:
            plan = make_plan(mesh, model, WORKLOAD, objective)
        except InfeasibleError as exc:
            error = str(exc)
        times.append(time.perf_counter() - start)
    return {"devices": n, "layers": layers, "objective": objective.value, "plan": plan, "error": error,
            "median_s": statistics.median(times)}


def markdown(rows: list[dict]) -> str:
    lines = ["| devices | layers | objective | method | stages | gap | seconds (median) |",
             "|---:|---:|---|---|---:|---:|---:|"]
    for r in rows:
        plan = r["plan"]
        if plan is None:
            method, stages, gap = "infeasible", "-", "-"
        else:
            method, stages, gap = ("exact" if plan.exact else "heuristic"), str(len(plan.stages)), f"{plan.gap * 100:.1f}%"
        lines.append(f"| {r['devices']} | {r['layers']} | {r['objective']} | {method} | {stages} | {gap} | {r['median_s']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="4,8,16,32", help="comma-separated device counts (default 4,8,16,32)")
    parser.add_argument("--layers", default="32,80", help="comma-separated layer counts (default 32,80)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per row; the median is reported (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random meshes (default 0)")
    args = parser.parse_args()
    rows = [run_row(n, layers, objective, args.repeats, args.seed)
            for n in (int(x) for x in args.devices.split(","))
            for layers in (int(x) for x in args.layers.split(","))
            for objective in (Objective.THROUGHPUT, Objective.LATENCY)]
    print(markdown(rows))
    for r in rows:
        if r["error"]:
            print(f"\n{r['devices']} devices x {r['layers']} layers: {r['error']}")


if __name__ == "__main__":
    main()
