"""Where a GPU decode step's time goes: one stage of the whole 8B-shaped model (bench/gpu_engine.py
makes it), a one-row decode step eager and as a CUDA graph replay, the LM head and sampling, and
the GPU time of each kernel kind in one step (torch.profiler), beside the HBM-bandwidth limit;
with the fused layer kernels (stage_node.fused) and without (`fused_off`).

    python -m bench.gpu_step --work /tmp/gpu --out $OUT      # on the GPU machine

`--part stall` (issue 25): eager steps of 1, 20, 48 and 184 rows, each run twice, on an empty
Triton cache (point TRITON_CACHE_DIR at a new folder): the first run of a row count whose product
tile (stage_node.invariant.mm_config) has not occurred yet compiles the kernels; with `--warm`
the stage's start-up warm-up (Shard.warm_up) runs first and no step compiles.
`--part sweep`: the one-row product's time and bandwidth for tile configurations of each matrix.
`--part rows` (issue 32): decode steps of 32 to 256 rows (each row its own sequence at position
`--context`, its own blocks): the graph replay and the eager forward, the GPU time per kernel kind of
one step, and each matrix's product at those row counts for a few tiles beside `mm_config`'s.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.gpu_engine import LLAMA3_8B, make_model
from logicpipe.stage_node.engine.kv import StepKV, seq_slice
from logicpipe.stage_node.model.shard import Shard
from logicpipe.stage_node.engine.step_graphs import GraphRow, StepGraphs


def timed(fn, n: int) -> float:
    """Mean ms of fn() over n calls, GPU-synchronised."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1000


def kinds_of(prof) -> tuple[dict, float, int]:
    """(GPU ms per kernel kind, top 15; total GPU ms; kernel launches) of a profile."""
    kinds: dict[str, float] = defaultdict(float)
    launches = 0
    for e in prof.key_averages():
        kinds[e.key[:80]] += e.device_time_total / 1000  # ms
        launches += e.count if e.device_time_total else 0
    top = dict(sorted(((k, round(v, 3)) for k, v in kinds.items()), key=lambda kv: -kv[1])[:15])
    return top, round(sum(kinds.values()), 2), launches


def load(args) -> Shard:
    path = make_model(args.work / f"llama3-8b-shape-{args.layers}", dict(LLAMA3_8B, num_hidden_layers=args.layers),
                      torch.bfloat16)
    return Shard.load(path, 0, args.layers, first=True, last=True, device="cuda", dtype=torch.bfloat16)


def stall(args) -> None:
    """Eager steps of several row counts, each twice, from an empty Triton cache."""
    import os

    cache = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))

    def compiled() -> int:
        return sum(1 for _ in cache.rglob("*.cubin")) if cache.is_dir() else 0

    shard = load(args)
    shard.batch_invariant = True
    bs = 16
    pool = shard.new_pool(200, bs)
    res: dict = {"device": torch.cuda.get_device_name(), "triton_cache": str(cache), "cubins_at_start": compiled(),
                 "steps": []}
    with torch.inference_mode():
        if args.warm:
            res["warm_up_s"] = round(shard.warm_up(pool), 2)
            res["cubins_after_warm_up"] = compiled()
        # (first position, rows): prompts of 1 to 184 rows, and the last 512-row chunk of a 3,000-token
        # prompt (the stage's step budget, --max-step-tokens 512)
        for start, m in ((0, 1), (0, 20), (0, 48), (0, 184), (0, 7), (0, 100), (2488, 512)):
            for attempt in (1, 2):
                nb = -(-(start + m) // bs)
                kv = StepKV(pool, torch.arange(start, start + m, device="cuda"),
                            (seq_slice(start, m, list(range(nb)), bs, "cuda", 0),))
                x = shard.embed(torch.arange(m, device="cuda") % 1000)
                before = compiled()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = shard.forward(x, kv)
                shard.logits(out[-1:])
                torch.cuda.synchronize()
                ms = round((time.perf_counter() - t0) * 1000, 1)
                res["steps"].append({"rows": m, "first_position": start, "run": attempt, "ms": ms,
                                     "kernels_compiled": compiled() - before})
                print(res["steps"][-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"gpu_stall{'_warm' if args.warm else ''}.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res))


def sweep(args) -> None:
    """The one-row (and 8-row) product of each matrix of a layer and the LM head for tile
    configurations (BLOCK_M 16; BLOCK_N, BLOCK_K, warps, stages, parts of K), timed in a CUDA graph."""
    import triton

    from logicpipe.stage_node.kernels import invariant

    shard = load(args)
    w = shard.layers[0]
    mats = {"qkv": w.qkv, "o": w.o, "gate_up": w.gate_up, "down": w.down, "lm_head": shard.lm_head}
    res: dict = {"device": torch.cuda.get_device_name(), "matrices": {}}
    with torch.inference_mode():
        for name, m in mats.items():
            n, k = m.shape
            rows = []
            for bn in (32, 64):
                for bk in (128, 256):
                    for warps, stages in ((4, 4), (4, 6)):
                        for parts in (1, 2, 4):
                            if parts > 1 and k < 2048 * parts // 2:
                                continue
                            cfg = (16, bn, bk, warps, stages, parts)
                            for M in (1, 8):
                                x = torch.randn(M, k, device="cuda", dtype=torch.bfloat16)
                                try:
                                    ms = triton.testing.do_bench_cudagraph(lambda: invariant.mm(x, m, cfg), rep=30)
                                except Exception as exc:  # noqa: BLE001 — out of resources: skip the tile
                                    rows.append({"cfg": cfg, "M": M, "error": str(exc)[:80]})
                                    continue
                                rows.append({"cfg": cfg, "M": M, "us": round(ms * 1000, 1),
                                             "gbps": round(m.numel() * 2 / ms / 1e6)})
            cur = invariant.mm_config(n, k, m.dtype, 1)
            best = {M: min((r for r in rows if r["M"] == M and "us" in r), key=lambda r: r["us"]) for M in (1, 8)}
            now = {M: next((r for r in rows if r["M"] == M and tuple(r["cfg"]) == cur), None) for M in (1, 8)}
            res["matrices"][name] = {"shape": [n, k], "current": now, "best": best, "all": rows}
            print(name, "current", now, "best", best, flush=True)
        x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
        res["cublas_gbps"] = {name: round(m.numel() * 2 / triton.testing.do_bench_cudagraph(
            lambda: torch.nn.functional.linear(x, m), rep=30) / 1e6) for name, m in mats.items() if m.shape[1] == 4096}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_sweep.json").write_text(json.dumps(res, indent=2))
    print(json.dumps({k: {"current": v["current"], "best": v["best"]} for k, v in res["matrices"].items()}))
    print("cublas", res["cublas_gbps"])


def rows_part(args) -> None:
    """Where a step of many decode rows goes (issue 32)."""
    import triton

    from logicpipe.stage_node.kernels import invariant

    shard = load(args)
    shard.batch_invariant = True
    bs, pos = 16, args.context
    nb = -(-(pos + 1) // bs)
    top = 256
    pool = shard.new_pool(top * nb + 1, bs)
    res: dict = {"device": torch.cuda.get_device_name(), "context": pos, "steps": {}, "products": {}}
    with torch.inference_mode():
        graphs = StepGraphs(shard, pool, warm=False)
        for R in (1, 32, 64, 128, 256):
            rows = [GraphRow(pos, r * nb * bs + pos % bs + (pos // bs) * bs, list(range(r * nb, (r + 1) * nb)))
                    for r in range(R)]
            x = shard.embed(torch.arange(R, device="cuda") % 1000)
            one = {"graph_forward_ms": round(timed(lambda: graphs.forward(x, rows), 20), 2)}
            g = graphs.graphs[graphs.bucket(R, pos + 1)]
            one["graph_replay_ms"] = round(timed(g.graph.replay, 20), 2)
            kv = StepKV(pool, torch.tensor([r.write_slot for r in rows], device="cuda"),
                        tuple(seq_slice(pos, 1, r.blocks, bs, "cuda", 0) for r in rows))
            one["eager_forward_ms"] = round(timed(lambda: shard.forward(x, kv), 5), 2)
            h = graphs.forward(x, rows)
            one["lm_head_argmax_ms"] = round(timed(lambda: shard.logits(h).argmax(-1), 20), 2)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                graphs._body(g)
                torch.cuda.synchronize()
            one["kernels_ms"], one["kernels_total_ms"], one["launches"] = kinds_of(prof)
            res["steps"][R] = one
            print(R, "rows", {k: v for k, v in one.items() if k != "kernels_ms"}, flush=True)
        w = shard.layers[0]
        for name in ("qkv", "o", "gate_up", "down"):
            m = getattr(w, name)
            n, k = m.shape
            parts = invariant.k_parts(n, k)
            for M in (32, 64, 128, 256):
                xin = torch.randn(M, k, device="cuda", dtype=torch.bfloat16)
                cur = invariant.mm_config(n, k, m.dtype, M)
                got = {}
                for cfg in {cur, (16, 64, 128, 4, 6, parts), (32, 64, 128, 4, 4, parts), (64, 64, 128, 4, 4, parts),
                            (64, 128, 64, 4, 3, parts), (128, 128, 64, 8, 3, parts), (32, 128, 64, 4, 4, parts)}:
                    try:
                        us = triton.testing.do_bench_cudagraph(lambda: invariant.mm(xin, m, cfg), rep=20) * 1000
                    except Exception as exc:  # noqa: BLE001 — out of resources: skip the tile
                        got[str(cfg)] = str(exc)[:60]
                        continue
                    got[str(cfg)] = round(us, 1)
                res["products"][f"{name}_{M}"] = {"current": str(cur), "us": got}
                print(name, M, "current", cur, got, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_rows.json").write_text(json.dumps(res, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/lp-gpu"))
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--context", type=int, default=200, help="positions already in the KV (default %(default)s)")
    ap.add_argument("--part", default="step", choices=("step", "stall", "sweep", "rows"))
    ap.add_argument("--warm", action="store_true", help="--part stall: the start-up warm-up first")
    args = ap.parse_args()
    if args.part != "step":
        return {"stall": stall, "sweep": sweep, "rows": rows_part}[args.part](args)
    shard = load(args)
    bs = 16
    pool = shard.new_pool(300, bs)
    blocks = list(range(300))
    res: dict = {"device": torch.cuda.get_device_name(), "weight_gb": round(shard.weight_bytes / 1e9, 2)}
    with torch.inference_mode():
        x = shard.embed(torch.tensor([5], device="cuda"))
        pos = args.context
        kv = StepKV(pool, torch.tensor([pos], device="cuda"), (seq_slice(pos, 1, blocks, bs, "cuda", 0),))
        shard.batch_invariant = True
        rows = [GraphRow(pos, pos, blocks)]
        outs = {}
        for fused in (False, True):  # the fused layer kernels (stage_node.fused) off, then on
            shard.use_fused = fused
            tag = "" if fused else "fused_off_"
            res[tag + "eager_forward_ms"] = timed(lambda: shard.forward(x, kv), 20)
            graphs = StepGraphs(shard, pool, warm=False)
            res[tag + "graph_forward_ms"] = timed(lambda: graphs.forward(x, rows), 50)
            g = graphs.graphs[(1, 256)]
            res[tag + "graph_replay_only_ms"] = timed(g.graph.replay, 50)
            g8 = graphs._new(8, 256)
            res[tag + "graph_replay_8rows_ms"] = timed(g8.graph.replay, 50)
            far = [GraphRow(4000, 4000, blocks)]  # one row at 4,000 positions (bucket 4,096)
            res[tag + "graph_forward_ctx4000_ms"] = timed(lambda: graphs.forward(x, far), 50)
            h = graphs.forward(x, rows)
            res[tag + "lm_head_ms"] = timed(lambda: shard.logits(h), 50)
            outs[fused] = (shard.forward(x, kv).float(), h.float())
            if not fused:
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    graphs._body(g)
                    torch.cuda.synchronize()
                res["fused_off_kernels_ms"], res["fused_off_kernels_total_ms"], res["fused_off_launches"] = kinds_of(prof)
                del graphs, g, g8
        # the fused layers against the unfused (bf16 rounding apart), and a row's bits eagerly and in a graph
        off, on = outs[False][0], outs[True][0]
        res["fused_vs_unfused_rel_err"] = float((on - off).norm() / off.norm())
        res["fused_eager_equals_graph"] = torch.equal(outs[True][0], outs[True][1])
        res["unfused_eager_equals_graph"] = torch.equal(outs[False][0], outs[False][1])
        logits = shard.logits(h)
        res["argmax_tolist_ms"] = timed(lambda: logits.argmax(-1).tolist(), 50)
        # matrix products alone, at one row: effective bandwidth of the weight read
        w = shard.layers[0]
        prods = {}
        for name in ("qkv", "o", "gate_up", "down"):
            m = getattr(w, name)
            xin = torch.randn(1, m.shape[1], device="cuda", dtype=torch.bfloat16)
            ms_lin = timed(lambda: torch.nn.functional.linear(xin, m), 100)
            ms_mv = timed(lambda: torch.mv(m, xin[0]), 100)
            prods[name] = {"shape": list(m.shape), "linear_gbps": round(m.numel() * 2 / ms_lin / 1e6),
                           "mv_gbps": round(m.numel() * 2 / ms_mv / 1e6)}
        res["products"] = prods
        src = torch.empty(2**28, dtype=torch.bfloat16, device="cuda")
        dst = torch.empty_like(src)
        res["copy_gbps"] = round(2 * src.numel() * 2 / timed(lambda: dst.copy_(src), 20) / 1e6)
        # GPU time per kernel kind in one eager step of the graph body
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graphs._body(g)
            torch.cuda.synchronize()
        res["kernels_ms"], res["kernels_total_ms"], res["launches"] = kinds_of(prof)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_step.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
