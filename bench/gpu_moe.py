"""GPU figures of the grouped-expert kernel (stage_node.kernels.grouped, issue 33), on the GPU machine:

    python -m bench.gpu_moe --part kernels --out $OUT   # experts of the Qwen3-30B-A3B shape, tiles and rows
    python -m bench.gpu_moe --part step --work /tmp/lp --out $OUT   # a decode step of the bench model

`kernels`: one layer's experts (128 of width 768, hidden 2048, top 8, random bf16; 4 layers' copies
used in turn so no layer's experts sit in L2) for 1, 8, 64 and 256 rows, timed as CUDA graph
replays: the grouped kernel for each tile (BLOCK_N, BLOCK_K, warps, stages) of the sweep, the
gathered way it replaces (up to 32 rows), the alignment by torch ops and by one Triton program, and
the whole mixture (router, top-k, experts). GB/s = bytes of the distinct experts the rows route to
over the time; the HBM limit is ~3.35 TB/s on an H100.
`step`: the model `bench.gpu_families --part moe --layers N` made (under --work), one stage of it:
a one-row decode step as a graph replay (ms, and of the HBM limit of the bytes it reads) and the
GPU time per kernel kind of an eager step (torch.profiler).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from logicpipe.common.families import MoE
from logicpipe.stage_node.kernels import grouped
from logicpipe.stage_node.model import moe as moe_mod
from logicpipe.stage_node.model.ops import INVARIANT_ROWS, glu
from logicpipe.stage_node.model.weights import Experts

E, HIDDEN, INTER, TOP_K = 128, 2048, 768, 8
COPIES = 4
# (the first run, one H100: (64, 128, 4, 6), (32, 128, 4, 4), (32, 256, 4, 3) within 1% of these too)
SWEEP = [(64, 128, 4, 4), (128, 128, 4, 4)]


def graph_us(fn, reps: int = 200) -> float:
    """Median-free mean µs of fn() captured once in a CUDA graph and replayed `reps` times."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(10):
        g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e6


def kernels(args, res: dict) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)

    def r(*shape, scale):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)

    layers = [Experts(r(E, HIDDEN, scale=0.02), r(E, 2 * INTER, HIDDEN, scale=HIDDEN ** -0.5),
                      r(E, HIDDEN, INTER, scale=INTER ** -0.5)) for _ in range(COPIES)]
    moe = MoE(num_experts=E, top_k=TOP_K, intermediate_size=INTER, norm_topk_prob=True, weights_in_float=False,
              layers=())
    act = glu("silu")
    expert_bytes = 3 * HIDDEN * INTER * 2
    rows_out = []
    default = grouped.CONFIG_16
    with torch.inference_mode():
        for T in (1, 8, 64, 256):
            h = r(T, HIDDEN, scale=1.0)
            routes = [moe_mod.route(h, w, moe, INVARIANT_ROWS) for w in layers]
            distinct = sum(idx.unique().numel() for _, idx in routes) / COPIES
            row = {"rows": T, "distinct_experts": distinct}
            for cfg in SWEEP:
                grouped.CONFIG_16 = cfg
                try:
                    us = graph_us(lambda: [grouped.experts(h, w, wt, idx, act) for w, (wt, idx) in zip(layers, routes)]) / COPIES
                except Exception as exc:  # noqa: BLE001 — a tile out of resources: say so
                    row[str(cfg)] = str(exc)[:60]
                    continue
                row[str(cfg)] = {"us": round(us, 1), "gbps": round(distinct * expert_bytes / us / 1e3)}
            grouped.CONFIG_16 = default
            if T <= 32:
                us = graph_us(lambda: [moe_mod.experts_gathered(h, w, wt, idx, act) for w, (wt, idx) in zip(layers, routes)]) / COPIES
                row["gathered"] = {"us": round(us, 1), "gbps": round(distinct * expert_bytes / us / 1e3)}
            idx = routes[0][1]
            row["align_torch_us"] = round(graph_us(lambda: grouped.align_torch(idx, E)), 1)
            row["align_triton_us"] = round(graph_us(lambda: grouped.align_triton(idx, E)), 1)
            row["mixture_us"] = round(graph_us(lambda: [moe_mod.experts_forward(h, w, moe, act, INVARIANT_ROWS)
                                                        for w in layers]) / COPIES, 1)
            # the same row's bits alone and among these rows
            alone = grouped.experts(h[:1], layers[0], routes[0][0][:1], idx[:1], act)
            row["row0_equal_alone"] = bool(torch.equal(alone, grouped.experts(h, layers[0], routes[0][0], idx, act)[:1]))
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    res["kernels"] = rows_out
    print("\n| rows | experts | " + " | ".join(str(c) for c in SWEEP) + " | gathered | align torch / triton | mixture |")
    for row in rows_out:
        cells = [f"{row[str(c)]['us']} us {row[str(c)]['gbps']} GB/s" if isinstance(row.get(str(c)), dict) else "-"
                 for c in SWEEP]
        g = row.get("gathered")
        print(f"| {row['rows']} | {row['distinct_experts']} | " + " | ".join(cells) +
              f" | {g['us'] if g else '-'} | {row['align_torch_us']} / {row['align_triton_us']} | {row['mixture_us']} |")


def step(args, res: dict) -> None:
    from torch.profiler import ProfilerActivity, profile

    from bench.gpu_families import read_bytes_per_token
    from logicpipe.stage_node.engine.kv import StepKV, seq_slice
    from logicpipe.stage_node.engine.step_graphs import GraphRow, StepGraphs
    from logicpipe.stage_node.model.shard import Shard

    path = next(p for p in args.work.glob("qwen3-30b-a3b-*") if p.name.rsplit("-", 1)[1].isdigit())
    n = int(path.name.rsplit("-", 1)[1])
    shard = Shard.load(path, 0, n, first=True, last=True, device="cuda", dtype=torch.bfloat16)
    shard.batch_invariant = True
    pool = shard.new_pool(64, 16)
    graphs = StepGraphs(shard, pool, warm=False)
    x = shard.embed(torch.tensor([11], device="cuda"))
    row = [GraphRow(position=40, write_slot=40, blocks=[0, 1, 2, 3])]
    with torch.inference_mode():
        graphs.forward(x, row)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            graphs.forward(x, row)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / 50 * 1000
        head = shard.logits(x)
        t0 = time.perf_counter()
        for _ in range(50):
            head = shard.logits(x)
        torch.cuda.synchronize()
        head_ms = (time.perf_counter() - t0) / 50 * 1000
        kv = StepKV(pool, torch.tensor([40], device="cuda"), (seq_slice(40, 1, [0, 1, 2, 3], 16, "cuda", 0),))
        shard.forward(x, kv)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            shard.forward(x, kv)
            torch.cuda.synchronize()
    kinds: dict = {}
    for e in prof.key_averages():
        kinds[e.key[:70]] = (round(e.device_time_total / 1000, 3), e.count)
    top = dict(sorted(kinds.items(), key=lambda kv: -kv[1][0])[:20])
    read = read_bytes_per_token(path)
    res["step"] = {"layers": n, "graph_step_ms": round(ms, 3), "lm_head_ms": round(head_ms, 3),
                   "per_layer_us": round(ms / n * 1000, 1), "read_gb": round(read / 1e9, 3),
                   "of_hbm_limit_3_35": round(read / 3.35e12 * 1000 / (ms + head_ms), 3),
                   "eager_kernels_ms_count": top, "eager_launches": sum(c for _, c in kinds.values())}
    print(json.dumps(res["step"], indent=1), flush=True)
    del head


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", default="kernels")
    ap.add_argument("--work", type=Path, default=Path("/tmp/lp"))
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for part in args.part.split(","):
        {"kernels": kernels, "step": step}[part](args, res)
        (args.out / "gpu_moe.json").write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
