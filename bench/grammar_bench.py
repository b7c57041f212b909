"""Grammar-constrained sampling libraries compared on what the last stage pays: compiling a JSON
schema against the model's vocabulary (once per schema: cached by text), and one token mask plus
one matcher advance (every sampled token), on CPU, with the default model's tokenizer.

    .venv/bin/python bench/grammar_bench.py [--model-dir DIR] [--tokens N]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city"]}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
ANSWER = '{"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "tags": ["math", "poetry"], ' \
         '"address": {"city": "London", "zip": "W1"}}'


def bench_xgrammar(tok, ids: list[int], reps: int) -> dict:
    import torch
    import xgrammar as xgr
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    t_info = time.perf_counter() - t0
    compiles = []
    for _ in range(reps):
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
        compiles.append(time.perf_counter() - t0)
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    logits = torch.zeros(1, info.vocab_size)
    masks = []
    for t in ids:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        assert matcher.accept_token(t), t
        masks.append(time.perf_counter() - t0)
    return {"tokenizer_s": t_info, "compile_s": statistics.median(compiles), "mask_us": masks}


def bench_llguidance(tok, ids: list[int], reps: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch
    import torch
    t0 = time.perf_counter()
    info = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
    t_info = time.perf_counter() - t0
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    compiles = []
    for _ in range(reps):
        t0 = time.perf_counter()
        matcher = llguidance.LLMatcher(info, grammar)
        compiles.append(time.perf_counter() - t0)
    assert not matcher.is_error(), matcher.get_error()
    bitmask = llguidance.torch.allocate_token_bitmask(1, info.vocab_size)
    logits = torch.zeros(1, info.vocab_size)
    masks = []
    for t in ids:
        t0 = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        llguidance.torch.apply_token_bitmask_inplace(logits, bitmask)
        assert matcher.consume_token(t), (t, matcher.get_error())
        masks.append(time.perf_counter() - t0)
    return {"tokenizer_s": t_info, "compile_s": statistics.median(compiles), "mask_us": masks}


def main() -> None:
    from transformers import AutoTokenizer
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=str(Path.home() / ".cache/logicpipe/models/SmolLM2-135M-Instruct"))
    ap.add_argument("--reps", type=int, default=3, help="compiles timed (median reported)")
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    ids = tok(ANSWER, add_special_tokens=False)["input_ids"]
    print(f"vocabulary {len(tok)} tokens; answer {len(ids)} tokens; schema {len(json.dumps(SCHEMA))} chars")
    for name, fn in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
        r = fn(tok, ids, args.reps)
        m = sorted(r["mask_us"])
        print(f"{name:11s} tokenizer info {r['tokenizer_s'] * 1e3:7.1f} ms  compile {r['compile_s'] * 1e3:7.1f} ms  "
              f"mask+advance per token: median {statistics.median(m) * 1e6:6.0f} us  p90 "
              f"{m[int(len(m) * 0.9)] * 1e6:6.0f} us  max {m[-1] * 1e6:6.0f} us")


if __name__ == "__main__":
    main()
