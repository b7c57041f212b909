"""Which tiles of the int4 / int8 CUDA kernels give a row the same bits (issue 39's batch invariance):
for each tile config forced on every row count, a row's bits in sub-batches against the 256-row
product of the same config, and each config's 256-row product against the 64 x 64 tile's. Found on
an H100 (2026-11-27): each tile invariant within itself; 64 x 64, 64 x 128 and 128 x 128 agree,
16- and 32-row tiles agree with none of them (the float path's bf16 tiles, run the same way, all
agree), so qmm_config runs no tile under 64 rows.

    python -m bench.gpu_quant_tiles --work /tmp/gpu --out $OUT
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.gpu_quant import PLACES, big_model, load
from logicpipe.stage_node.kernels import invariant

CONFIGS = {"64x64": (64, 64, 4, 4), "decode 16x32": (16, 32, 4, 4), "16x64": (16, 64, 4, 4),
           "16x64 6 stages": (16, 64, 4, 6), "32x64": (32, 64, 4, 4), "64x128": (64, 128, 4, 3),
           "128x128": (128, 128, 8, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--work", type=Path, default=Path("/tmp/lp-gpu"))
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--layers", type=int, default=1)
    args = ap.parse_args()
    path = big_model(args)
    out = {}
    for fmt in ("int8", "int4"):
        shard = load(path, fmt, 1)
        for name in ("o", "gate_up"):
            m = getattr(shard.layers[0], name)
            g = torch.Generator(device="cuda").manual_seed(0)
            x = torch.randn(256, m.shape[1], generator=g, device="cuda").bfloat16()
            fulls = {}
            for label, cfg in CONFIGS.items():
                parts = (invariant.k_parts if fmt == "bf16" else invariant.quant_parts)(*m.shape)
                if fmt == "bf16":
                    bk = 128 if cfg[0] <= 64 else 64
                    c = (cfg[0], cfg[1], bk, cfg[2], cfg[3], parts)
                    run = lambda v: invariant.mm(v, m, c)  # noqa: E731
                else:
                    c = (*cfg, parts)
                    run = lambda v: invariant.add_parts(m.mm_parts(v, c), v.dtype)  # noqa: E731
                full = run(x)
                fulls[label] = full
                bad = [f"{r}@{a}" for r, a in PLACES if not torch.equal(run(x[a: a + r]), full[a: a + r])]
                out[f"{fmt} {name} {label}: rows differing within the tile"] = bad
            ref = fulls["64x64"]
            out[f"{fmt} {name}: tiles whose 256 rows differ from the 64x64 tile's"] = [
                k for k, v in fulls.items() if not torch.equal(v, ref)]
        del shard
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_quant_tiles.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
