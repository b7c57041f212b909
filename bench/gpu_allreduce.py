"""The all-reduce of a tensor-parallel stage's decode step, timed inside a CUDA graph (issue 36): a
layer adds two all-reduces of [rows, hidden] to its step, so a 32-layer model 64 of them a token.
NCCL's, and PyTorch's symmetric-memory one-shot (each GPU reads its peers' buffers over NVLink;
no multicast), each captured `--reps` times in one graph and replayed, on every GPU of the host.

    python -m bench.gpu_allreduce --out $OUT --hidden 4096 --rows 1,8
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

try:
    import torch.distributed._symmetric_memory as symm_mem
except ImportError:  # an older PyTorch: NCCL only
    symm_mem = None

from tests.localmesh import free_port


def timed_graph(fn, reps: int, replays: int) -> float:
    """Microseconds one call of fn takes, captured `reps` times in one CUDA graph, over `replays` replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (replays * reps) * 1e6


def init_rank(rank: int, world: int, port: int) -> None:
    """This process as rank `rank` of `world` on GPU `rank`, NCCL over TCP on loopback `port`."""
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))


def run_ranks(rank_main, world: int, args, timeout_s: float) -> dict:
    """`rank_main(rank, world, port, args, queue)` in one spawned process a GPU, each putting (rank,
    result) on the queue: rank -> result. Symmetric memory without NVLink multicast."""
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=timeout_s) for _ in procs)
    for p in procs:
        p.join(30)
    return results


def _rank(rank: int, world: int, port: int, args, queue) -> None:
    init_rank(rank, world, port)
    out = {}
    try:
        for rows in args.rows:
            x = torch.ones(rows, args.hidden, dtype=torch.bfloat16, device="cuda")
            dist.all_reduce(x)
            out[f"nccl rows={rows}"] = timed_graph(lambda: dist.all_reduce(x), args.reps, args.replays)
            if symm_mem is not None:
                try:
                    group = dist.group.WORLD
                    buf = symm_mem.empty(rows, args.hidden, dtype=torch.bfloat16, device="cuda")
                    symm_mem.rendezvous(buf, group.group_name)
                    y = torch.ones(rows, args.hidden, dtype=torch.bfloat16, device="cuda")

                    def one_shot():
                        buf.copy_(y)
                        return torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group.group_name)

                    got = one_shot()
                    torch.cuda.synchronize()
                    out[f"one_shot rows={rows} correct"] = bool((got == world).all())
                    out[f"one_shot rows={rows}"] = timed_graph(one_shot, args.reps, args.replays)
                except Exception as exc:  # noqa: BLE001 — reported, NCCL's figure still stands
                    out[f"one_shot rows={rows} error"] = repr(exc)[:300]
        queue.put((rank, out))
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rows", type=lambda s: [int(r) for r in s.split(",")], default=[1, 8])
    ap.add_argument("--reps", type=int, default=64)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--world", type=int, default=0, help="GPUs (default: all)")
    args = ap.parse_args()
    world = args.world or torch.cuda.device_count()
    results = run_ranks(_rank, world, args, 300)
    doc = {"gpu": torch.cuda.get_device_name(0), "world": world, "hidden": args.hidden, "us_per_all_reduce": results[0]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_allreduce.json").write_text(json.dumps(doc, indent=2))
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
