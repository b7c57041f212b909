"""A mixture of experts against a dense model of the same active size, through the same CPU mesh.

Two random Qwen3 checkpoints made here (ids only, no tokenizer): a dense one, and a Qwen3-MoE one
whose experts (E experts, top-k, expert width f) run as many MLP parameters per token as the dense
model's MLP (width k * f), everything else equal; the mixture holds E / k times the MLP weights.
Both are served in turn by one mesh of `--stages` stage processes (the controller restarted with
the other model), interleaved round by round so that machine noise hits both alike: one stream,
then `--concurrency` streams at once, each of `--tokens` new tokens (greedy, no EOS stop).
tok/s = new tokens / wall time from the first submit to the last token; medians over rounds, and
the MoE / dense ratio of each.

    python -m bench.moe_bench                     # 2 stages, 8 concurrent
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench.engine_bench import submit
from logicpipe.common.modeldir import ModelConfig
from logicpipe.controller.mesh.planning import model_spec
from tests.localmesh import LocalMesh

BASE = dict(vocab_size=49152, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
            head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=None,
            eos_token_id=None, initializer_range=0.1)


def make(path: Path, moe: bool, experts: int, top_k: int, width: int) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    if moe:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**BASE, intermediate_size=top_k * width, num_experts=experts,
                                                   num_experts_per_tok=top_k, moe_intermediate_size=width,
                                                   norm_topk_prob=True))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**BASE, intermediate_size=top_k * width))
    model.save_pretrained(path)
    return path


def rates(address: str, prompts: list[list[int]], tokens: int) -> tuple[float, float]:
    r = submit(address, ids=prompts[0], tokens=tokens)
    assert not r["error"] and len(r["ids"]) == tokens, r["error"]
    one = tokens / r["total_s"]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        res = list(pool.map(lambda p: submit(address, ids=p, tokens=tokens), prompts))
    assert all(not x["error"] and len(x["ids"]) == tokens for x in res), [x["error"] for x in res]
    return one, len(prompts) * tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--width", type=int, default=512, help="an expert's intermediate size")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per stage")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="lp-moe-bench-") as tmp:
        root = Path(tmp)
        models = {name: make(root / name, name == "moe", args.experts, args.top_k, args.width)
                  for name in ("dense", "moe")}
        sizes = {}
        for name, path in models.items():
            spec = model_spec(ModelConfig.from_dir(path), name, "")
            sizes[name] = {"held_mb": round(spec.num_layers * spec.layer_weight_bytes / 1e6, 1),
                           "read_mb_per_token": round(spec.num_layers * spec.layer_read_bytes(1) / 1e6, 1)}
        prompts = [[(29 * i + 13 * j) % 49000 for j in range(24 + 4 * i)] for i in range(args.concurrency)]
        got: dict = {name: {"one": [], "many": []} for name in models}
        ratio_one, ratio_many = [], []
        with LocalMesh(args.stages, models["dense"], root / "mesh", threads=args.threads,
                       controller_args=("--strategy", "uniform", "--settle-s", "0.5", "--speculate", "0")) as mesh:
            for rnd in range(args.rounds):
                row = {}
                for name, path in models.items():
                    mesh.restart_controller(path)
                    submit(mesh.controller_address, ids=prompts[0], tokens=4)  # warm-up
                    row[name] = rates(mesh.controller_address, prompts, args.tokens)
                    got[name]["one"].append(row[name][0])
                    got[name]["many"].append(row[name][1])
                ratio_one.append(row["moe"][0] / row["dense"][0])
                ratio_many.append(row["moe"][1] / row["dense"][1])
                print(f"round {rnd + 1}: " + "  ".join(f"{n} {o:.1f} / {m:.1f} tok/s" for n, (o, m) in row.items()),
                      flush=True)
    result = {"stages": args.stages, "experts": args.experts, "top_k": args.top_k, "threads": args.threads,
              "tokens": args.tokens, "concurrency": args.concurrency, "sizes": sizes,
              **{f"{n}_one_stream_tps": round(statistics.median(v["one"]), 1) for n, v in got.items()},
              **{f"{n}_concurrent_tps": round(statistics.median(v["many"]), 1) for n, v in got.items()},
              "moe_over_dense_one_stream": round(statistics.median(ratio_one), 3),
              "moe_over_dense_concurrent": round(statistics.median(ratio_many), 3)}
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
