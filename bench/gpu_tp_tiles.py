"""The one-row product's time of each matrix a tensor-parallel rank holds (issue 36), against one GPU's
whole matrices, for the decode tile (BLOCK_M 16, BLOCK_K 128, 4 warps, 6 stages) with BLOCK_N 32 or 64
and K split in 1 to 4 parts: a rank's matrices are narrower, so fewer programs stream them.

Each timing runs the product over `copies` distinct copies of the matrix in one CUDA graph (at least
256 MB of them: none stays in the 50 MB L2 cache), as a step reads 32 layers' weights once each.

    python -m bench.gpu_tp_tiles --out $OUT
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton

from logicpipe.stage_node.kernels import invariant

SHAPES = {  # name -> (n, k) of w [n, k]
    "8b/qkv": (6144, 4096), "8b/o": (4096, 4096), "8b/gate_up": (28672, 4096), "8b/down": (4096, 14336),
    "8b-tp2/qkv": (3072, 4096), "8b-tp2/o": (4096, 2048), "8b-tp2/gate_up": (14336, 4096), "8b-tp2/down": (4096, 7168),
    "70b-tp4/qkv": (2560, 8192), "70b-tp4/o": (8192, 2048), "70b-tp4/gate_up": (14336, 8192),
    "70b-tp4/down": (8192, 7168),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "sms": torch.cuda.get_device_properties(0).multi_processor_count,
           "shapes": {}}
    x_cache = {}
    with torch.inference_mode():
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            copies = max(2, -(-(256 << 20) // (n * k * 2)))
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            x = x_cache.setdefault(k, torch.randn(1, k, device="cuda", dtype=torch.bfloat16))
            cur = invariant.mm_config(n, k, torch.bfloat16, 1)
            rows = []
            for bn in (32, 64):
                for parts in (1, 2, 3, 4):
                    cfg = (16, bn, 128, 4, 6, parts)

                    def run(cfg=cfg):
                        for w in ws:
                            invariant.mm(x, w, cfg)

                    try:
                        ms = triton.testing.do_bench_cudagraph(run, rep=40) / copies
                    except Exception as exc:  # noqa: BLE001 — out of resources: skip the tile
                        rows.append({"bn": bn, "parts": parts, "error": str(exc)[:80]})
                        continue
                    rows.append({"bn": bn, "parts": parts, "us": round(ms * 1000, 2),
                                 "gbps": round(n * k * 2 / ms / 1e6), "current": cfg == cur})
            best = min((r for r in rows if "us" in r), key=lambda r: r["us"])
            now = next((r for r in rows if r.get("current")), None)
            res["shapes"][name] = {"n": n, "k": k, "copies": copies, "current": now, "best": best, "all": rows}
            print(f"{name:18} n={n:6} k={k:6} current {now} best {best}", flush=True)
            del ws
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_tp_tiles.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
