"""A long prompt chunk's attention by launches of how many rows (issue 39, the step-time bar at 128k).

`stage_node.kernels.invariant.attention` takes a step's rows in launches (parts) whose partial results
fit a workspace; each launch's merge is one program a (row, head), bound by latency. This times one
layer's attention of a chunk of --rows prompt rows at each of --positions (the 8B shape: 32 query
heads, 8 KV heads of 128, bf16, a paged pool of consecutive slots) with parts of at most each of
--part-rows rows (0: the product's rule, `invariant.part_rows`), and checks that every part size gives
the same bits. Needs a GPU.

    python -m bench.attn_parts --positions 32000,64000,64600,120000 --rows 256 --part-rows 4,8,16,32,0
"""
from __future__ import annotations

import argparse
import json

import torch

from logicpipe.stage_node.kernels import invariant


def run(position: int, rows: int, part_rows: list[int], heads: int = 32, kv_heads: int = 8, hd: int = 128,
        reps: int = 5) -> dict:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    slots_n = position + rows
    k_pool = torch.randn(kv_heads, slots_n, hd, device=dev, dtype=torch.bfloat16, generator=g)
    v_pool = torch.randn(kv_heads, slots_n, hd, device=dev, dtype=torch.bfloat16, generator=g)
    q = torch.randn(rows, heads, hd, device=dev, dtype=torch.bfloat16, generator=g)
    table = torch.arange(slots_n, device=dev, dtype=torch.long)[None]
    positions = torch.arange(position, position + rows, device=dev, dtype=torch.long)
    tiles = invariant.seq_tiles([rows], heads // kv_heads)
    tiles_t = invariant.tiles_tensor(tiles, dev)
    tiles_at = [t[0] for t in tiles]
    attended = rows * position + rows * (rows + 1) // 2
    out, ref = {}, None
    keep = invariant.part_rows
    for pr in part_rows:
        if pr:
            invariant.part_rows = lambda per_row, h, b, pr=pr: pr
        try:
            def call():
                return invariant.attention(q, k_pool, v_pool, table, positions, tiles_t, scale=hd ** -0.5,
                                           tiles_at=tiles_at)
            y = call()
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(reps):
                call()
            b.record()
            b.synchronize()
            ms = a.elapsed_time(b) / reps
        finally:
            invariant.part_rows = keep
        same = True if ref is None else torch.equal(y, ref)
        ref = y if ref is None else ref
        out[pr or "rule"] = dict(ms=round(ms, 3), ns_per_attended=round(ms * 1e6 / attended, 3), same_bits=same)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--positions", default="32000,64000,64600,120000",
                    help="the chunk's first position, comma-separated")
    ap.add_argument("--rows", type=int, default=256, help="the chunk's rows")
    ap.add_argument("--part-rows", default="4,8,16,32,0", help="rows a launch holds at most (0: the product's rule)")
    args = ap.parse_args()
    prs = [int(x) for x in args.part_rows.split(",")]
    res = {p: run(int(p), args.rows, prs) for p in args.positions.split(",")}
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": args.rows, "by_position": res}, indent=1))


if __name__ == "__main__":
    main()
