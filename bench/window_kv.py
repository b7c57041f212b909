"""KV a sequence keeps at 8k context with sliding-window layers holding only their window (issue 37
item 3), before (every layer keeps the whole context) -> after, for a Mistral-7B-shaped and a
Gemma-3-shaped config (transformers' config classes; no weights), and how many 8k-context
sequences a fixed KV pool holds.

Every number comes from the code that accounts for it: the planner's ModelSpec (the controller's
`model_spec` of the config: `kv_bytes_per_sequence`), and the stage's own pool sizing
(`loading.pool_blocks`) and KV managers (`engine.window.managers`), filled with 8k-position
sequences written in 512-position chunks, as a stage's steps write them, until one more does not fit.

    python -m bench.window_kv [--pool-gib 16] [--context 8192] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import torch
from transformers import Gemma3TextConfig, MistralConfig

from logicpipe.common.modeldir import ModelConfig
from logicpipe.controller.mesh.planning import model_spec
from logicpipe.stage_node.engine.blocks import OutOfBlocks
from logicpipe.stage_node.engine.kv import kv_bytes_per_token
from logicpipe.stage_node.engine.window import managers
from logicpipe.stage_node.weights.loading import pool_blocks

BLOCK = 16   # positions per block (the stage's default --block-size)
CHUNK = 512  # positions a step writes (the stage's default --max-step-tokens)
SHAPES = {  # name -> a config of that shape
    # Mistral-7B-v0.1: transformers' MistralConfig defaults (32 layers, 8 KV heads of 128, window 4096)
    "Mistral-7B": lambda: MistralConfig(),
    # Gemma-3-4B: 34 layers, 4 KV heads of 256, five sliding layers (window 1024) to one full
    "Gemma-3-4B": lambda: Gemma3TextConfig(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                                           num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                                           sliding_window=1024, vocab_size=262208),
}


def model_config(hf_config) -> ModelConfig:
    with tempfile.TemporaryDirectory() as d:
        hf_config.to_json_file(Path(d) / "config.json")
        return ModelConfig.from_dir(d, require_weights=False)


def sequences_held(config: ModelConfig, budget: int, context: int, dtype: torch.dtype, window: bool) -> tuple[int, float]:
    """(sequences of `context` positions the stage's pool holds, bytes the stage keeps per sequence):
    a stage of every layer, its pool sized and its managers made as loading.load_shard and the
    runtime do (`window` False: --window-kv off, every layer keeps the whole context)."""
    kinds = config.arch.layer_types or ("full",) * config.num_layers
    sliding = sum(k == "sliding" for k in kinds) if window and config.arch.sliding_window else 0
    win = config.arch.sliding_window if sliding else None
    apart = sliding if 0 < sliding < config.num_layers else 0  # the window layers' own pool
    blocks, group = pool_blocks(config, config.num_layers - apart, apart, win, dtype, budget, BLOCK, context)
    kv = managers(blocks, BLOCK, win, group)
    n = 0
    while True:
        sid = f"s{n}"
        kv.open(sid, context)
        try:
            for pos in range(0, context, CHUNK):
                kv.prepare_write(sid, pos, CHUNK)
                kv.commit(sid, pos, list(range(pos, pos + CHUNK)))
        except OutOfBlocks:
            kv.close(sid)
            break
        n += 1
    main = getattr(kv, "main", kv)
    held = main.used * BLOCK * kv_bytes_per_token(config, config.num_layers - apart, dtype)
    if apart:
        held += kv.group.used * BLOCK * kv_bytes_per_token(config, apart, dtype)
    return n, held / max(1, n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pool-gib", type=float, default=16.0, help="the stage's KV pool (--max-kv-mib), GiB")
    ap.add_argument("--context", type=int, default=8192, help="positions per sequence")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = ap.parse_args()
    budget, c = int(args.pool_gib * 2**30), args.context
    dtype = getattr(torch, args.dtype)
    rows = []
    for name, make in SHAPES.items():
        config = model_config(make())
        spec = model_spec(config, name, "", args.dtype)
        whole = dataclasses.replace(spec, layer_kinds=(), sliding_window=0)
        before, after = whole.kv_bytes_per_sequence(c), spec.kv_bytes_per_sequence(c)
        n_before, stage_before = sequences_held(config, budget, c, dtype, window=False)
        n_after, stage_after = sequences_held(config, budget, c, dtype, window=True)
        rows.append(dict(model=name, layers=config.num_layers,
                         sliding=sum(k == "sliding" for k in config.arch.layer_types),
                         window=config.arch.sliding_window, kv_mib_before=before / 2**20, kv_mib_after=after / 2**20,
                         stage_kv_mib_before=stage_before / 2**20, stage_kv_mib_after=stage_after / 2**20,
                         sequences_before=n_before, sequences_after=n_after))
    if args.json:
        print(json.dumps(dict(pool_gib=args.pool_gib, context=c, dtype=args.dtype, block_size=BLOCK, rows=rows)))
        return
    print(f"KV pool {args.pool_gib:g} GiB, {c}-position sequences, {args.dtype}, blocks of {BLOCK}")
    print("| model | layers (sliding) | window | KV per sequence, MiB: before -> after (planner) | ... as the stage "
          "holds it | sequences the pool holds: before -> after |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['layers']} ({r['sliding']}) | {r['window']} | {r['kv_mib_before']:.0f} -> "
              f"{r['kv_mib_after']:.0f} ({r['kv_mib_after'] / r['kv_mib_before']:.2f}x) | {r['stage_kv_mib_before']:.0f} -> "
              f"{r['stage_kv_mib_after']:.0f} | {r['sequences_before']} -> "
              f"{r['sequences_after']} ({r['sequences_after'] / max(1, r['sequences_before']):.2f}x) |")


if __name__ == "__main__":
    main()
