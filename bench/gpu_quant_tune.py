"""Tuning int4 on CUDA (stage_node.kernels.gpu_quant): the tiles' and parts' sweep and a profile of the
one-row step, on the GPU machine (as bench/gpu_quant.py, whose helpers it uses):

    python -m bench.gpu_quant_tune --work /tmp/gpu --out $OUT --part sweep,profile

Parts (`--part`, comma list; default sweep,profile; the others: --part rows,int8):
  * sweep: each int4 matrix of the 8B shape, for K in 2, 4 and gpu_quant.quant_parts' parts: the
    one-row product (round_rows, the one-row kernel, the parts' sum) for each of SWEEP_ONE_ROW's tiles
    (BLOCK_N, warps, pipeline stages), and the product of `--prompt-rows` rows for each of
    SWEEP_PROMPT's tiles (BLOCK_M, BLOCK_N, warps, stages), a program a part and the tile adding the
    parts itself (`--prompt-rows ""`: none); us of the whole call (20 in one CUDA graph). Parts change
    the bits (a fact of the format, chosen once for every GPU: gpu_quant.PARTS); tiles and the sum's
    place do not. Also the int8 LM head's one-row product for each of SWEEP_HEAD's tiles (BLOCK_M,
    BLOCK_N, warps, stages; gpu_quant.int8_config: 16-row tiles of int8_mm's TRANS form and 64-row
    tiles of the other, which agree on a row's bits);
  * rows: int4, the one-row kernel against the 16-row tile at 1 to 8 rows (gpu_quant.GEMV_ROWS);
  * int8: int8's tiles at 1, 32 and 64 rows, the rows as the tensor cores' M (64-row tiles) against
    int8_mm's TRANS form (16- to 64-row tiles), and a row's bits among 256 as int8_config tiles them;
  * profile: one stream's one-row step (bench.gpu_quant's decode step: `--layers` layers of the 8B
    shape at `--context` positions, a CUDA-graph replay, and the LM head) per format of
    `--formats` under torch.profiler: GPU ms per kernel kind a token, their sum against the replay's time (the rest:
    the gaps between kernels).

One JSON line of the results at the end (also $OUT/gpu_quant_tune.json).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.gpu_quant import MATRICES, big_model, graph_ms, load
from bench.gpu_step import kinds_of, timed
from logicpipe.stage_node.engine.step_graphs import GraphRow, StepGraphs
from logicpipe.stage_node.kernels import gpu_quant, invariant

SWEEP_ONE_ROW = ((128, 2, 4), (128, 2, 3), (128, 2, 5), (256, 4, 4), (256, 2, 4), (64, 2, 4), (64, 1, 3), (32, 1, 4))
SWEEP_HEAD = ((16, 64, 4, 3), (16, 64, 4, 4), (16, 128, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3), (64, 256, 8, 3))  # int8
# (tiles 64 columns wide: int8_mm's TRANS form, gpu_quant.int8_trans; 128 and 256 wide: the rows as the tensor cores' M)
SWEEP_PROMPT = ((128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (64, 64, 4, 3), (64, 64, 4, 4),
                (128, 64, 4, 3), (256, 64, 8, 3))


def whole(m, x, cfg):
    """The product as a stage runs it, with the tile `cfg`: the kernels and the parts' sum."""
    return invariant.add_parts(m.mm_parts(x, cfg), x.dtype)


def sweep(args, res: dict) -> None:
    path = big_model(args)
    out = res["sweep"] = {}
    shard = load(path, "int4", 1)
    keep_parts, keep_sum = dict(gpu_quant.PARTS), dict(gpu_quant.SUM_ROWS)
    try:
        for name in MATRICES:
            m = getattr(shard.layers[0], name)
            n, k = m.shape
            r = out[name] = {"shape": [n, k], "default_parts": gpu_quant.quant_parts(n, k)}
            for parts in sorted({2, 4, gpu_quant.quant_parts(n, k)}):
                if k // 512 < parts:
                    continue
                x = torch.randn(1, k, device="cuda").bfloat16()
                r[f"one_row_p{parts}"] = {str(list(t)): round(graph_ms(
                    lambda m=m, x=x, c=(1, *t, parts): whole(m, x, c), inner=10, rounds=20) * 1e3, 2)
                    for t in SWEEP_ONE_ROW}
                for rows in [int(v) for v in args.prompt_rows.split(",") if v]:
                    x = torch.randn(rows, k, device="cuda").bfloat16()
                    times = {}
                    for summed in (False, True):
                        gpu_quant.SUM_ROWS[n, k] = 0 if summed else 1 << 30
                        for t in SWEEP_PROMPT:
                            try:
                                us = graph_ms(lambda m=m, x=x, c=(*t, parts): whole(m, x, c), inner=5, rounds=10)
                                times[f"{list(t)}{' sum' if summed else ''}"] = round(us * 1e3, 2)
                            except Exception as exc:  # noqa: BLE001 — a tile that does not compile or fit
                                print("sweep", name, t, summed, "failed:", str(exc).splitlines()[0][:120])
                    r[f"rows{rows}_p{parts}"] = dict(sorted(times.items(), key=lambda kv: kv[1]))
            print("sweep", name, json.dumps(r), flush=True)
        head = shard.lm_head  # int8 (quant.HEAD_FORMAT): its one-row tile among those of 64 rows and more
        x = torch.randn(1, head.shape[1], device="cuda").bfloat16()
        parts = gpu_quant.int8_config(*head.shape, x.dtype, 1)[4]
        out["lm_head_one_row"] = {"shape": list(head.shape), **{str(list(t)): round(graph_ms(
            lambda c=(*t, parts): whole(head, x, c), inner=10, rounds=20) * 1e3, 2) for t in SWEEP_HEAD}}
        print("sweep lm_head", json.dumps(out["lm_head_one_row"]), flush=True)
    finally:
        gpu_quant.PARTS.clear()
        gpu_quant.PARTS.update(keep_parts)
        gpu_quant.SUM_ROWS.clear()
        gpu_quant.SUM_ROWS.update(keep_sum)


def profile_step(args, res: dict) -> None:
    path = big_model(args)
    out = res["profile"] = {}
    ctx, bs = args.context, 16
    for fmt in args.formats.split(","):
        shard = load(path, fmt, args.layers)
        blocks = list(range(max(300, 2 * (ctx // bs + 1))))
        pool = shard.new_pool(len(blocks), bs)
        graphs = StepGraphs(shard, pool, warm=False)
        x = torch.randn(1, shard.config.hidden_size, device="cuda").bfloat16()
        rows = [GraphRow(ctx, ctx, blocks)]
        reps = 20
        with torch.inference_mode():
            h = graphs.forward(x, rows).clone()
            g = next(iter(graphs.graphs.values()))
            replay = timed(g.graph.replay, 100)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(reps):
                    g.graph.replay()
                torch.cuda.synchronize()
            kinds, total, launches = kinds_of(prof)
            if not total:  # a profiler that does not see a graph's kernels: the graph's body eagerly
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(reps):
                        graphs._body(g)
                    torch.cuda.synchronize()
                kinds, total, launches = kinds_of(prof)
            head = timed(lambda: shard.logits(h), 50)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(reps):
                    shard.logits(h)
                torch.cuda.synchronize()
            head_kinds, head_total, _ = kinds_of(prof)
        out[fmt] = {"replay_ms": round(replay, 4), "kernels_ms": round(total / reps, 4),
                    "kernel_launches": launches // reps, "gaps_ms": round(replay - total / reps, 4),
                    "by_kind_us": {k: round(v * 1e3 / reps, 1) for k, v in kinds.items()},
                    "lm_head_ms": round(head, 4), "lm_head_kernels_us": {k: round(v * 1e3 / reps, 1)
                                                                         for k, v in head_kinds.items()}}
        print("profile", fmt, json.dumps(out[fmt]), flush=True)
        del shard, graphs, pool, h
        torch.cuda.empty_cache()


SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (1, 2, 3, 4, 6, 8)  # the rows part's row counts
PLACES = ((1, 0), (1, 100), (5, 250), (16, 3), (17, 50), (32, 1), (33, 100), (64, 0), (65, 10), (128, 128),
          (200, 56))  # (rows, first row) among 256: the int8 part's check


def _matrix(n: int, k: int, fmt: str):
    return gpu_quant.quantize(torch.randn(n, k, device="cuda") * 0.02, fmt)


def _us(m, x, cfg) -> float:
    """us of the product of x by m with the tile `cfg` (and its parts' sum), 10 in a CUDA graph."""
    return round(graph_ms(lambda: whole(m, x, cfg), inner=10, rounds=20) * 1e3, 1)


def rows_part(args, res: dict) -> None:
    """int4, random matrices of the 8B shape: the one-row kernel (a program a row) against the 16-row
    tile at ROWS rows (gpu_quant.GEMV_ROWS: where the first stops being faster), us a product."""
    torch.manual_seed(0)
    out = res["rows"] = {}
    for name, (n, k) in SHAPES_8B.items():
        m = _matrix(n, k, "int4")
        x = torch.randn(max(ROWS), k, device="cuda").bfloat16()
        parts = gpu_quant.quant_parts(n, k)
        one = (1, *gpu_quant.qmm_config(n, k, x.dtype, 1)[1:4], parts)
        out[name] = {rows: {"one_row_kernel": _us(m, x[:rows], one), "tile_16": _us(m, x[:rows], (16, 64, 4, 3, parts))}
                     for rows in ROWS}
        print("rows", name, json.dumps(out[name]), flush=True)


def int8_part(args, res: dict) -> None:
    """int8, random matrices of the 8B shape and an LM head (128256 x 4096): the rows-as-M tiles of 64
    rows (the int8_config before int8_mm's TRANS form) against TRANS tiles at 1, 32 and 64 rows, us a
    product (gpu_quant.INT8_FORM forcing the form); and a row's bits at PLACES among 256 rows as
    int8_config picks the tiles."""
    torch.manual_seed(0)
    out = res["int8"] = {}
    for name, (n, k) in {**SHAPES_8B, "lm_head": (128256, 4096)}.items():
        m = _matrix(n, k, "int8")
        x = torch.randn(256, k, device="cuda").bfloat16()
        parts = invariant.quant_parts(n, k)
        rows_m = (64, 128, 4, 3) if n >= gpu_quant.HEAD_ROWS else (64, 64, 4, 4)
        r = out[name] = {}
        for rows, trans in ((1, ((16, 64, 4, 3), (16, 64, 4, 4), (16, 128, 4, 3))), (32, ((32, 64, 4, 3), (32, 64, 4, 4))),
                            (64, ((64, 64, 4, 3), (64, 64, 4, 4)))):
            try:
                gpu_quant.INT8_FORM = "rows"
                r[f"rows_{rows}"] = {"rows_as_m_64": _us(m, x[:rows], (*rows_m, parts))}
                gpu_quant.INT8_FORM = "trans"
                r[f"rows_{rows}"].update({f"trans_{t[0]}x{t[1]}x{t[2]}x{t[3]}": _us(m, x[:rows], (*t, parts))
                                          for t in trans})
            finally:
                gpu_quant.INT8_FORM = ""
            r[f"rows_{rows}"]["chosen"] = list(gpu_quant.int8_config(n, k, x.dtype, rows))
        full = m(x)
        r["rows_differing"] = [[rows, first] for rows, first in PLACES
                               if not torch.equal(m(x[first:first + rows]), full[first:first + rows])]
        print("int8", name, json.dumps(r), flush=True)


PARTS = {"sweep": sweep, "profile": profile_step, "rows": rows_part, "int8": int8_part}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/lp-gpu"), help="where the random models are kept")
    ap.add_argument("--out", type=Path, default=Path("."), help="where gpu_quant_tune.json is written")
    ap.add_argument("--part", default="sweep,profile", help=f"comma list of {', '.join(PARTS)}")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers of the 8B-shaped model (default 8)")
    ap.add_argument("--context", type=int, default=200, help="positions in the KV of the decode step (default 200)")
    ap.add_argument("--formats", default="int4", help="profile: comma list of int4, int8, bf16 (default int4)")
    ap.add_argument("--prompt-rows", default="256,2048", help="sweep: the prompt row counts (default 256,2048)")
    args = ap.parse_args()
    parts = [p for p in args.part.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise SystemExit(f"--part {','.join(unknown)}: use {', '.join(PARTS)}")
    if not torch.cuda.is_available():
        raise SystemExit("bench.gpu_quant_tune needs a CUDA GPU (torch.cuda.is_available() is False)")
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for part in parts:
        PARTS[part](args, res)
        (args.out / "gpu_quant_tune.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
