"""Why 8-bit KV changes greedy tokens (issue 39 item 2), per model: the keys and values a float pool
stores are rounded as a format would round them ("fake-quantized" in `KVPool.store`: the same rounding
as the 8-bit pool, attention then in float32), variant by variant, and the 8-bit model's teacher-forced
choice after each of float KV's greedy tokens is compared with float KV's:

- int8 / fp8 of keys and values, of the keys only, of the values only; bf16 (a 16-bit reference);
  int8 rotated (kv_quant.rotate, what `--kv-dtype int8` stores); int8 keys with fp8 values;
- per flip: float KV's top-1 / top-2 logit margin there and its rank among all positions' margins
  (near-ties flip first), the median |logit change|, and how many experts' choices changed (MoE);
- int8 rotated keys only / values only, a min/max grid with a float32 zero point ("int8 asym"), a 9-bit
  probe (one bit more: how much the rounding's size counts), fp8 rotated (`--variants` picks some);
- `--layers`: int8 in one layer at a time and everywhere but one layer, fp8 in one layer at a time
  (which layers' rounding matters). "int8 rotated" is what the stage stores (kv_quant.quantize: with a mid).

    python -m bench.kv_quant_why [--families default,llama,...] [--prompts 16] [--tokens 32] [--init 0.1]
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from transformers import AutoTokenizer

from bench.kv_quant import PROMPTS, greedy, paged, set_kv
from logicpipe.common.modeldir import ModelConfig
from logicpipe.controller.cli.model_prep import prepare_default_model
from logicpipe.stage_node.engine import kv as kv_module
from logicpipe.stage_node.engine.kv_quant import dequantize, quantize, rotate, unrotate
from logicpipe.stage_node.model import moe
from logicpipe.stage_node.model.shard import Shard
from tests.families import FAMILIES, build

VARIANTS = {  # name -> (keys' format, values' format, rotated)
    "int8": ("int8", "int8", False), "int8 K only": ("int8", None, False), "int8 V only": (None, "int8", False),
    "int8 rotated": ("int8", "int8", True), "fp8": ("fp8", "fp8", False), "fp8 K only": ("fp8", None, False),
    "fp8 V only": (None, "fp8", False), "int8 K, fp8 V": ("int8", "fp8", False), "bf16": ("bf16", "bf16", False),
    "int8 rotated K only": ("int8", None, True), "int8 rotated V only": (None, "int8", True),
    "int8 asym rotated": ("int8a", "int8a", True), "int8 asym K, sym V, rotated": ("int8a", "int8", True),
    "9-bit rotated (probe)": ("int9", "int9", True), "fp8 rotated": ("fp8", "fp8", True),
}
STATE = {"variant": None, "layers": None, "call": 0, "routes": [], "names": None}
_store, _route = kv_module.KVPool.store, moe.route


def rounded(x: torch.Tensor, fmt: str | None, rotated: bool) -> torch.Tensor:
    if fmt is None:
        return x
    if fmt == "bf16":
        return x.to(torch.bfloat16).to(x.dtype)
    y = rotate(x) if rotated else x.float()
    if fmt == "int8a":  # asymmetric: 255 steps over [min, max] of the vector, the zero point its min
        lo, hi = y.amin(-1, keepdim=True), y.amax(-1, keepdim=True)
        s = ((hi - lo) / 254).clamp_min(1e-30)
        y = torch.round((y - lo) / s) * s + lo
    elif fmt == "int9":  # a probe: 511 levels (one bit more than int8)
        s = (y.abs().amax(-1, keepdim=True) / 255).clamp_min(1e-30)
        y = torch.round(y / s) * s
    else:
        y = dequantize(*quantize(y, fmt), torch.float32)
    return (unrotate(y) if rotated else y).to(x.dtype)


def store(self, layer, slots, k, v):
    n = STATE["call"]
    STATE["call"] += 1
    if STATE["variant"] is not None and (STATE["layers"] is None or n in STATE["layers"]):
        kf, vf, rot = VARIANTS[STATE["variant"]]
        k = rounded(k, kf, rot and v is not None)
        v = None if v is None else rounded(v, vf, rot)
    return _store(self, layer, slots, k, v)


def route(*args, **kwargs):
    out = _route(*args, **kwargs)
    STATE["routes"].append(out[1].sort(-1).values.clone())
    return out


def logits(shard: Shard, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = prompt + tokens[:-1]
    STATE["call"] = 0
    h = paged(shard, -(-len(ids) // 16) + 2).forward(shard.embed(torch.tensor(ids)), [("s", 0, ids)],
                                                     {"s": len(prompt)})
    return shard.logits(h)[len(prompt) - 1:].float()


def run(shard: Shard, prompts: list[list[int]], tokens: int, layers: int) -> dict:
    set_kv(shard, "auto")
    refs = [greedy(shard, p, tokens) for p in prompts]

    def forced(variant, only=None):
        STATE["variant"], STATE["layers"], STATE["routes"] = variant, only, []
        out = torch.cat([logits(shard, p, r) for p, r in zip(prompts, refs)])
        STATE["variant"] = STATE["layers"] = None
        return out, STATE["routes"]

    base, base_routes = forced(None)
    want = torch.tensor(sum(refs, []))
    top2 = base.topk(2, -1).values
    margin = top2[:, 0] - top2[:, 1]
    out = {"float KV teacher-forced": round((base.argmax(-1) == want).float().mean().item(), 3),
           "margin median": round(margin.median().item(), 4), "margin 10th pct": round(margin.quantile(0.1).item(), 4)}
    for name in VARIANTS if STATE["names"] is None else STATE["names"]:
        got, routes = forced(name)
        flips = (got.argmax(-1) != want).nonzero().flatten()
        out[name] = {"agree": round(1 - len(flips) / len(want), 3),
                     "median |logit change|": round((got - base).abs().amax(-1).median().item(), 4),
                     "flips' margin ranks": [round((margin < margin[i]).float().mean().item(), 3) for i in flips]}
        if base_routes:
            out[name]["expert choices changed"] = (
                f"{sum(int((a != b).any(-1).sum()) for a, b in zip(base_routes, routes))} of "
                f"{sum(a.shape[0] for a in base_routes)}")
    if layers:
        out["int8 rotated in one layer"] = {n: round((forced("int8 rotated", {n})[0].argmax(-1) == want).float().mean().item(), 3)
                                            for n in range(layers)}
        out["int8 rotated, all but one layer"] = {
            n: round((forced("int8 rotated", set(range(layers)) - {n})[0].argmax(-1) == want).float().mean().item(), 3)
            for n in range(layers)}
        out["fp8 in one layer"] = {n: round((forced("fp8", {n})[0].argmax(-1) == want).float().mean().item(), 3)
                                   for n in range(layers)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(["default", *FAMILIES]), help="default: the default model")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--init", type=float, default=0.1, help="the tiny families' initializer range")
    ap.add_argument("--layers", action="store_true", help="also fp8 in one layer at a time (tiny families)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="the rounding variants compared (names above)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kv_module.KVPool.store, moe.route = store, route
    STATE["names"] = args.variants.split(",")
    gen = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, 49152, (24,), generator=gen).tolist() for _ in range(args.prompts)]
    with tempfile.TemporaryDirectory() as d:
        for name in args.families.split(","):
            if name == "default":
                path = prepare_default_model()
                prompts = [AutoTokenizer.from_pretrained(path).encode(p) for p in PROMPTS[:args.prompts]]
            else:
                path, prompts = build(name, Path(d) / name, initializer_range=args.init), ids
            shard = Shard.load(path, 0, ModelConfig.from_dir(path).num_layers, first=True, last=True)
            layers = len(shard.kv_layers) if args.layers and name != "default" else 0
            print(name, json.dumps(run(shard, prompts, args.tokens, layers)), flush=True)


if __name__ == "__main__":
    main()
