"""8-bit KV (issue 39 item 2: `logicpipe-stage --kv-dtype int8|fp8`, stage_node.engine.kv_quant),
float KV against int8 and fp8:

- bytes: KV bytes per token and the 8k-context sequences a fixed pool holds, for the default model
  (float32, a CPU stage) and a Llama-3-8B shape (bfloat16, a GPU stage), by the code the stage sizes
  its pool with (`loading.pool_blocks`, `kv.kv_bytes_per_token`) and by the planner's count
  (`model_spec(...)` x `kv_scale` of a profile with that `kv_format`);
- agreement: greedy tokens of 8-bit KV against float KV, N prompts x T tokens, on the default model
  and on every tiny family (tests/families.py: random weights, initializer range `--init`): free-running
  (the share of positions with the same token, each sequence decoded on its own) and teacher-forced
  (the 8-bit model's choice after each of float KV's tokens), a PASS / FAIL line per family and kind
  against `--floor` (teacher-forced); `auto`'s teacher-forced share is the control (1.0 where a step of
  many rows computes what its decode steps did). `--device cuda --dtype bfloat16` runs it on a GPU by
  the stage's CUDA code (`--graphs`: the CUDA graphs' step body, eagerly);
- error: per layer, the relative RMS error of the stored keys and values (int8 as stored, rotated;
  int8 without the rotation; fp8) and max|x| / RMS of the vectors, on one teacher-forced sequence;
- speed: decode tok/s of 8 concurrent sequences (one step of 8 decode rows, in process: the shard's
  forward over a paged pool, as the runner calls it), float32 KV against int8 (read directly by
  cpu_quant.c) and fp8 (dequantized by torch), at a few contexts; the KV kinds step by step in turn,
  medians (GOMP_SPINCOUNT=20000 as a stage process sets it).

    python -m bench.kv_quant [--parts bytes,agreement,error,speed] [--threads 2] [--out DIR]
    python -m bench.kv_quant --parts agreement --families llama,... --device cuda --dtype bfloat16 --kinds int8,fp8
"""
from __future__ import annotations

import os

os.environ.setdefault("GOMP_SPINCOUNT", "20000")  # as logicpipe-stage sets it, before torch's OpenMP starts

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from transformers import AutoTokenizer, LlamaConfig  # noqa: E402

from logicpipe.common.modeldir import ModelConfig  # noqa: E402
from logicpipe.controller.cli.model_prep import prepare_default_model  # noqa: E402
from logicpipe.controller.mesh.planning import model_spec  # noqa: E402
from logicpipe.planner.model import kv_scale  # noqa: E402
from logicpipe.planner.types import DeviceProfile  # noqa: E402
from logicpipe.stage_node.engine import kv as kv_module  # noqa: E402
from logicpipe.stage_node.engine.kv import kv_bytes_per_token  # noqa: E402
from logicpipe.stage_node.engine.kv_quant import dequantize, quantize, rotate  # noqa: E402
from logicpipe.stage_node.model.shard import Shard  # noqa: E402
from logicpipe.stage_node.weights.loading import pool_blocks  # noqa: E402
from tests.families import FAMILIES, build  # noqa: E402
from tests.unit.paged import PagedCache  # noqa: E402

KV = ("auto", "int8", "fp8")
BLOCK = 16
CONTEXT = 8192
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256)
PROMPTS = [  # ids drawn per prompt from a seeded generator for the tiny families; text for the default model
    "What is the capital of France?", "Write a haiku about the sea.", "List three uses of a paperclip.",
    "Explain photosynthesis in one sentence.", "Give me a short story about a robot who learns to paint.",
    "What are the primary colors?", "Describe the water cycle.", "Why is the sky blue?",
]


def hf_config(cfg) -> ModelConfig:
    with tempfile.TemporaryDirectory() as d:
        cfg.to_json_file(Path(d) / "config.json")
        return ModelConfig.from_dir(d, require_weights=False)


def bytes_part(pool_gib: dict[str, float]) -> dict:
    shapes = {"SmolLM2-135M (float32)": (ModelConfig.from_dir(prepare_default_model()), torch.float32),
              "Llama-3-8B shape (bfloat16)": (hf_config(LlamaConfig(**LLAMA3_8B)), torch.bfloat16)}
    out = {}
    for (name, (config, dtype)), gib in zip(shapes.items(), pool_gib.values()):
        spec = model_spec(config, name, "", str(dtype).removeprefix("torch."))
        node = DeviceProfile(node_id="n", device_kind="cpu", memory_bytes=1 << 40, flops=1e12, mem_bandwidth=1e11,
                             weight_formats=(spec.weight_format,))
        rows = {}
        for kv in KV:
            per_token = kv_bytes_per_token(config, config.num_layers, dtype, kv)
            fmt = "" if kv == "auto" else kv
            planner = spec.kv_bytes_per_token_per_layer * config.num_layers * kv_scale(
                DeviceProfile(**{**node.__dict__, "kv_format": fmt}), spec)
            blocks, _ = pool_blocks(config, config.num_layers, 0, None, dtype, int(gib * 2**30), BLOCK, CONTEXT, 0, kv)
            rows[kv] = {"kv_bytes_per_token": per_token, "planner_kv_bytes_per_token": round(planner, 1),
                        f"seqs_of_{CONTEXT}_in_{gib:g}_GiB": blocks // -(-CONTEXT // BLOCK)}
        base = rows["auto"]
        for kv in ("int8", "fp8"):
            rows[kv]["bytes_vs_float"] = round(rows[kv]["kv_bytes_per_token"] / base["kv_bytes_per_token"], 4)
        out[name] = rows
        print(name, json.dumps(rows), flush=True)
    return out


GRAPHS = [False]  # --graphs: the CUDA graphs' step body (eagerly) where a step fits its buckets


def paged(shard: Shard, blocks: int) -> PagedCache:
    """A shard's KV for several sequences (the stage's managers and pool, recurrent states, window pools)."""
    return PagedCache(shard, blocks, BLOCK, window=True, group_blocks=blocks, graphs=GRAPHS[0])


def set_kv(shard: Shard, kv: str) -> Shard:
    shard.kv_dtype, shard._native = kv, None
    return shard


def greedy(shard: Shard, prompt: list[int], steps: int) -> list[int]:
    c = paged(shard, -(-(len(prompt) + steps) // BLOCK) + 2)
    ids, pos, out = prompt, 0, []
    for _ in range(steps):
        h = c.forward(shard.embed(torch.tensor(ids)), [("s", pos, ids)], {"s": len(prompt)})
        pos += len(ids)
        ids = [int(shard.logits(h)[-1].argmax())]
        out.append(ids[0])
    return out


def teacher_forced(shard: Shard, prompt: list[int], tokens: list[int]) -> list[int]:
    ids = prompt + tokens[:-1]
    c = paged(shard, -(-len(ids) // BLOCK) + 2)
    h = c.forward(shard.embed(torch.tensor(ids)), [("s", 0, ids)], {"s": len(prompt)})
    return shard.logits(h)[len(prompt) - 1:].argmax(-1).tolist()


def agreement(shard: Shard, prompts: list[list[int]], tokens: int, kinds: list[str], floor: float, name: str) -> dict:
    refs = [greedy(set_kv(shard, "auto"), p, tokens) for p in prompts]
    n = len(prompts) * tokens
    out = {"auto": {"teacher_forced": round(sum(a == b for p, ref in zip(prompts, refs)
                                                for a, b in zip(teacher_forced(shard, p, ref), ref)) / n, 3)}}
    for kv in kinds:
        free = forced = 0
        for p, ref in zip(prompts, refs):
            free += sum(a == b for a, b in zip(greedy(set_kv(shard, kv), p, tokens), ref))
            forced += sum(a == b for a, b in zip(teacher_forced(shard, p, ref), ref))
        out[kv] = {"free_running": round(free / n, 3), "teacher_forced": round(forced / n, 3)}
        verdict = "PASS" if forced / n >= floor else "FAIL"
        print(f"{verdict} {name} {kv}: teacher-forced {forced / n:.3f} (floor {floor}; float KV's own "
              f"{out['auto']['teacher_forced']:.3f}), free-running {free / n:.3f}, {n} positions", flush=True)
    set_kv(shard, "auto")
    return out


def models(families: list[str], init: float, device: str, dtype: torch.dtype, prompts: int):
    """(name, shard, prompt ids) of the default model and the tiny families asked for."""
    if "default" in families:
        path = prepare_default_model()
        tok = AutoTokenizer.from_pretrained(path)
        shard = Shard.load(path, 0, ModelConfig.from_dir(path).num_layers, first=True, last=True, device=device,
                           dtype=dtype)
        yield "default (SmolLM2-135M)", shard, [tok.encode(p) for p in PROMPTS[:prompts]]
    gen = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, 49152, (24,), generator=gen).tolist() for _ in range(prompts)]
    with tempfile.TemporaryDirectory() as d:
        for name in (f for f in families if f != "default"):
            path = build(name, Path(d) / name, initializer_range=init)
            yield name, Shard.load(path, 0, ModelConfig.from_dir(path).num_layers, first=True, last=True,
                                   device=device, dtype=dtype), ids


def agreement_part(prompts: int, tokens: int, families: list[str], init: float, device: str = "cpu",
                   dtype: torch.dtype = torch.float32, kinds: tuple = ("int8", "fp8"), floor: float = 0.95) -> dict:
    out, broken = {}, []
    for name, shard, ids in models(families, init, device, dtype, prompts):
        try:
            out[name] = agreement(shard, ids, tokens, list(kinds), floor, name)
        except Exception as exc:  # noqa: BLE001 — one family's failure is reported, the others still run
            print(f"FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
            broken += [f"{name} {kv} ({type(exc).__name__})" for kv in kinds]
            continue
        print(name, json.dumps(out[name]), flush=True)
    failed = [f"{name} {kv}" for name, r in out.items() for kv in kinds if r[kv]["teacher_forced"] < floor] + broken
    total = len(out) * len(kinds) + len(broken)
    print(f"agreement >= {floor}: {'PASS' if not failed else 'FAIL'} ({total - len(failed)} of {total})"
          f"{'; below: ' + ', '.join(failed) if failed else ''}", flush=True)
    return out


def error_part(families: list[str], init: float, tokens: int) -> dict:
    """Per layer: relative RMS error of the stored keys and values, and max|x| / RMS of the vectors (the
    first prompt, teacher-forced after float KV's own greedy tokens)."""
    seen, store = [], kv_module.KVPool.store

    def recording(self, layer, slots, k, v):
        seen.append((k.detach().float().clone(), None if v is None else v.detach().float().clone()))
        return store(self, layer, slots, k, v)

    def stats(x: torch.Tensor) -> dict:
        rms = x.pow(2).mean().sqrt()

        def err(y):
            return round(((y - x).pow(2).mean().sqrt() / rms).item(), 5)
        r = rotate(x)
        return {"max/rms": round((x.abs().amax(-1) / x.pow(2).mean(-1).sqrt()).mean().item(), 2),
                "max/rms rotated": round((r.abs().amax(-1) / r.pow(2).mean(-1).sqrt()).mean().item(), 2),
                "int8 rotated": round((dequantize(*quantize(r, "int8"), torch.float32) - r).pow(2).mean().sqrt().item()
                                      / rms.item(), 5),
                "int8 unrotated": err(dequantize(*quantize(x, "int8"), torch.float32)),
                "fp8": err(dequantize(*quantize(x, "fp8"), torch.float32))}

    out = {}
    kv_module.KVPool.store = recording
    try:
        for name, shard, ids in models(families, init, "cpu", torch.float32, 1):
            ref = greedy(set_kv(shard, "auto"), ids[0], tokens)
            seen.clear()
            teacher_forced(shard, ids[0], ref)
            out[name] = {f"layer {i}": {"K": stats(k), **({"V": stats(v)} if v is not None else {})}
                         for i, (k, v) in enumerate(seen)}
            print(name, json.dumps(out[name]), flush=True)
    finally:
        kv_module.KVPool.store = store
    return out


def speed_part(contexts: list[int], seqs: int, steps: int, kinds: list[str]) -> dict:
    path = prepare_default_model()
    shard = Shard.load(path, 0, ModelConfig.from_dir(path).num_layers, first=True, last=True)
    out = {}
    for ctx in contexts:
        caches, pos = {}, {}
        for kv in kinds:  # each sequence's context prefilled once per KV kind (the pools persist)
            set_kv(shard, kv)
            c = paged(shard, seqs * (-(-(ctx + steps + 8) // BLOCK)))
            gen = torch.Generator().manual_seed(1)
            for s in range(seqs):
                prompt = torch.randint(0, 49152, (ctx,), generator=gen).tolist()
                for a in range(0, ctx, 512):
                    chunk = prompt[a: a + 512]
                    c.forward(shard.embed(torch.tensor(chunk)), [(f"s{s}", a, chunk)], {f"s{s}": ctx})
            caches[kv], pos[kv] = c, ctx

        def decode(kv: str) -> float:
            """One decode step of every sequence -> its seconds."""
            set_kv(shard, kv)
            c = caches[kv]
            t0 = time.perf_counter()
            h = c.forward(shard.embed(torch.tensor([7] * seqs)), [(f"s{s}", pos[kv], [7]) for s in range(seqs)],
                          {f"s{s}": 0 for s in range(seqs)})
            shard.logits(h).argmax(-1)
            pos[kv] += 1
            return time.perf_counter() - t0

        for kv in kinds:
            decode(kv)  # (warm)
        runs = {kv: [] for kv in kinds}
        for r in range(steps):  # the kinds step by step in turn (this VM's load changes by the second)
            for kv in (kinds if r % 2 == 0 else kinds[::-1]):
                runs[kv].append(decode(kv))
        row = {f"{kv} tok/s": round(seqs / statistics.median(v), 1) for kv, v in runs.items()}
        for kv in kinds[1:]:
            row[f"{kv} / {kinds[0]}"] = round(statistics.median(runs[kinds[0]]) / statistics.median(runs[kv]), 3)
        out[f"context {ctx}"] = row
        print(f"context {ctx}", json.dumps(row), flush=True)
    set_kv(shard, "auto")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="bytes,agreement,speed")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--families", default=",".join(["default", *FAMILIES]), help="default: the default model")
    ap.add_argument("--init", type=float, default=0.3,
                    help="the tiny families' initializer range (tests/families.py's: 0.3; test_kv_quant's: 0.1)")
    ap.add_argument("--device", default="cpu", help="agreement: where the shards run (cpu, cuda)")
    ap.add_argument("--dtype", default="float32", help="agreement: the compute dtype (float32, bfloat16)")
    ap.add_argument("--kinds", default="int8,fp8", help="agreement: the 8-bit KV kinds compared with float KV")
    ap.add_argument("--floor", type=float, default=0.95, help="agreement: PASS at or above this teacher-forced share")
    ap.add_argument("--graphs", action="store_true", help="agreement: the CUDA graphs' step body (eagerly)")
    ap.add_argument("--contexts", default="256,2048")
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--steps", type=int, default=24, help="decode steps timed per KV kind and context")
    ap.add_argument("--speed-kv", default="auto,int8,fp8", help="KV kinds timed (the first is the baseline)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    parts = args.parts.split(",")
    result = {}
    if "bytes" in parts:
        result["bytes"] = bytes_part({"default": 2.0, "8b": 16.0})
    if "agreement" in parts:
        GRAPHS[0] = args.graphs
        result["agreement"] = agreement_part(args.prompts, args.tokens, [f for f in args.families.split(",") if f],
                                             args.init, args.device, getattr(torch, args.dtype),
                                             tuple(args.kinds.split(",")), args.floor)
    if "error" in parts:
        result["error"] = error_part([f for f in args.families.split(",") if f], args.init, args.tokens)
    if "speed" in parts:
        result["speed"] = speed_part([int(c) for c in args.contexts.split(",")], args.seqs, args.steps,
                                     args.speed_kv.split(","))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kv_quant.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
