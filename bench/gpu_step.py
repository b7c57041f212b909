"""Where a GPU decode step's time goes: one stage of the whole 8B-shaped model (bench/gpu_engine.py
makes it), a one-row decode step eager and as a CUDA graph replay, the LM head and sampling, and
the GPU time of each kernel kind in one step (torch.profiler), beside the HBM-bandwidth limit.

    python -m bench.gpu_step --work /tmp/gpu --out $OUT      # on the GPU machine
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench.gpu_engine import LLAMA3_8B, make_model
from logicpipe.stage_node.kv import StepKV, seq_slice
from logicpipe.stage_node.shard import Shard
from logicpipe.stage_node.step_graphs import GraphRow, StepGraphs


def timed(fn, n: int) -> float:
    """Mean ms of fn() over n calls, GPU-synchronised."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/lp-gpu"))
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--context", type=int, default=200, help="positions already in the KV (default %(default)s)")
    args = ap.parse_args()
    path = make_model(args.work / f"llama3-8b-shape-{args.layers}", dict(LLAMA3_8B, num_hidden_layers=args.layers),
                      torch.bfloat16)
    shard = Shard.load(path, 0, args.layers, first=True, last=True, device="cuda", dtype=torch.bfloat16)
    bs = 16
    pool = shard.new_pool(64, bs)
    blocks = list(range(64))
    res: dict = {"device": torch.cuda.get_device_name(), "weight_gb": round(shard.weight_bytes / 1e9, 2)}
    with torch.inference_mode():
        x = shard.embed(torch.tensor([5], device="cuda"))
        pos = args.context
        kv = StepKV(pool, torch.tensor([pos], device="cuda"), (seq_slice(pos, 1, blocks, bs, "cuda", 0),))
        res["eager_forward_ms"] = timed(lambda: shard.forward(x, kv), 20)
        graphs = StepGraphs(shard, pool)
        rows = [GraphRow(pos, pos, blocks)]
        res["graph_forward_ms"] = timed(lambda: graphs.forward(x, rows), 50)
        g = graphs.graphs[(1, 256)]
        res["graph_replay_only_ms"] = timed(g.graph.replay, 50)
        h = graphs.forward(x, rows)
        res["lm_head_ms"] = timed(lambda: shard.logits(h), 50)
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
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graphs._body(g)
            torch.cuda.synchronize()
        kinds: dict[str, float] = defaultdict(float)
        for e in prof.key_averages():
            kinds[e.key[:80]] += e.device_time_total / 1000  # ms
        res["kernels_ms"] = dict(sorted(((k, round(v, 3)) for k, v in kinds.items()), key=lambda kv: -kv[1])[:15])
        res["kernels_total_ms"] = round(sum(kinds.values()), 2)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_step.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
