"""The fused all-reduce + residual + norm of a tensor-parallel rank (issue 36, tp_reduce.push_add_norm
through TensorParallel.reduce_add_norm) against the path it replaces (the product's parts added, the one-shot all-reduce, fused.add_norm), on
every GPU of the host (2 by default), inside CUDA graphs:

  * bits: for `--rows` rows and 1 or 2 parts, the fused kernel's x' and norm against the old path's;
  * the reduction alone: `--reps` of each captured in one graph and replayed (us per call);
  * a step's share: the o and down products of `--layers` layers of the 8B shape's rank (distinct
    weights, as a step reads them), each followed by its reduction, old path against fused;
  * the rank's small products (q/k/v [3072, 4096], o [4096, 2048]) over BLOCK_N 16 / 32, warps and
    stages (one GPU, distinct copies, as bench.gpu_tp_tiles), each checked for the current tile's bits.

    python -m bench.gpu_tp_fuse --out $OUT --rows 1,8,64,512
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
import triton

from logicpipe.stage_node.kernels import fused, invariant
from logicpipe.stage_node.model.tp import TensorParallel
from bench.gpu_allreduce import init_rank, run_ranks, timed_graph


def _rank(rank: int, world: int, port: int, args, queue) -> None:
    init_rank(rank, world, port)
    out = {}
    try:
        with torch.inference_mode():
            _measure(rank, world, args, out)
        queue.put((rank, out))
    except Exception as exc:  # noqa: BLE001 — reported
        queue.put((rank, {"error": repr(exc)[:2000]}))
    finally:
        dist.destroy_process_group()


def _measure(rank: int, world: int, args, out: dict) -> None:
    h, dt = args.hidden, torch.bfloat16
    tp = TensorParallel(rank, world)
    out["one_shot"] = tp.enable_one_shot(h, dt, torch.device("cuda", rank))
    out["push_on"] = tp.push is not None
    if tp.push is None:
        return
    gen = torch.Generator(device="cuda").manual_seed(7 + rank)
    w = (1 + 0.1 * torch.randn(h, generator=gen, device="cuda")).to(dt)

    def old(ws, x):
        return fused.add_norm(tp.all_reduce(invariant.add_parts(ws, dt))[None], x, w, 1e-5, tp=True)

    for rows in args.rows:
        x = torch.randn(rows, h, generator=torch.Generator(device="cuda").manual_seed(rows), device="cuda").to(dt)
        for parts in (1, 2):
            ws = torch.randn(parts, rows, h, generator=gen, device="cuda")
            ws = ws if parts > 1 else ws.to(dt)
            key = f"rows={rows} parts={parts}"
            a = old(ws, x)
            out[f"{key} old us"] = round(timed_graph(lambda ws=ws, x=x: old(ws, x), args.reps, args.replays), 2)
            b, c = tp.reduce_add_norm(ws, x, w, 1e-5, 0), tp.reduce_add_norm(ws, x, w, 1e-5, 1)
            torch.cuda.synchronize()
            out[f"{key} same bits"] = all(torch.equal(p, q) for p, q in zip(a, b)) and all(
                torch.equal(p, q) for p, q in zip(a, c))
            slots = iter(range(1 << 30))
            out[f"{key} fused us"] = round(timed_graph(
                lambda ws=ws, x=x: tp.reduce_add_norm(ws, x, w, 1e-5, next(slots) % 2), args.reps, args.replays), 2)
    # a step's o and down products with their reductions, 8B-shaped rank matrices
    L = args.layers
    o = [torch.randn(h, 4096 // world, generator=gen, device="cuda").to(dt) * 0.02 for _ in range(L)]
    down = [torch.randn(h, 14336 // world, generator=gen, device="cuda").to(dt) * 0.02 for _ in range(L)]
    a_o = torch.randn(1, 4096 // world, generator=gen, device="cuda").to(dt)
    a_d = torch.randn(1, 14336 // world, generator=gen, device="cuda").to(dt)
    x0 = torch.randn(1, h, generator=gen, device="cuda").to(dt)

    def step_old():
        x = x0
        for i in range(L):
            x, _ = fused.add_norm(tp.all_reduce(invariant.mm(a_o, o[i]))[None], x, w, 1e-5, tp=True)
            x, _ = fused.add_norm(tp.all_reduce(invariant.mm(a_d, down[i]))[None], x, w, 1e-5, tp=True)
        return x

    def step_fused():
        x = x0
        for i in range(L):
            x, _ = tp.reduce_add_norm(invariant.mm_parts(a_o, o[i]), x, w, 1e-5, 0)
            x, _ = tp.reduce_add_norm(invariant.mm_parts(a_d, down[i]), x, w, 1e-5, 1)
        return x

    out["layers"] = L
    want = step_old()
    out["step o+down old us"] = round(timed_graph(step_old, 1, args.replays), 1)
    out["step o+down same bits"] = torch.equal(want, step_fused())
    out["step o+down fused us"] = round(timed_graph(step_fused, 1, args.replays), 1)
    del o, down
    if rank == 0 and args.tiles:
        out["tiles"] = _tiles()


def _tiles() -> dict:
    """The rank's small products over tiles, bits checked against the current tile's."""
    res = {}
    for name, (n, k) in {"tp2/qkv": (3072, 4096), "tp2/o": (4096, 2048)}.items():
        copies = max(2, -(-(256 << 20) // (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        cur = invariant.mm_config(n, k, torch.bfloat16, 1)
        want = invariant.mm(x, ws[0], cur)
        rows = []
        for bn in (16, 32):
            for warps in (2, 4):
                for stages in (4, 6, 8):
                    cfg = (16, bn, 128, warps, stages, 1)

                    def run(cfg=cfg):
                        for w in ws:
                            invariant.mm(x, w, cfg)

                    try:
                        same = torch.equal(invariant.mm(x, ws[0], cfg), want)
                        ms = triton.testing.do_bench_cudagraph(run, rep=40) / copies
                    except Exception as exc:  # noqa: BLE001 — out of resources: skip the tile
                        rows.append({"cfg": cfg, "error": str(exc)[:80]})
                        continue
                    rows.append({"cfg": cfg, "us": round(ms * 1000, 2), "same_bits": same, "current": cfg == cur})
        res[name] = rows
        del ws
        torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rows", type=lambda s: [int(r) for r in s.split(",")], default=[1, 8, 64, 512])
    ap.add_argument("--reps", type=int, default=64, help="calls captured in one graph (the reduction alone)")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--layers", type=int, default=32, help="layers of the step's o and down products")
    ap.add_argument("--tiles", action="store_true", help="also sweep the rank's small products' tiles (GPU 0)")
    ap.add_argument("--timeout", type=float, default=400, help="seconds to wait for the ranks' results")
    ap.add_argument("--world", type=int, default=2, help="GPUs")
    args = ap.parse_args()
    world = args.world
    results = run_ranks(_rank, world, args, args.timeout)
    doc = {"gpu": torch.cuda.get_device_name(0), "world": world, "hidden": args.hidden, "by_rank": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_tp_fuse.json").write_text(json.dumps(doc, indent=2))
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
