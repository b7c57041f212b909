"""Tensor-parallel stages on GPUs (issue 36), on a machine with 2 or more CUDA devices:

 1. exactness: a small random fp32 Llama and Qwen3-MoE through one `--tp 2` stage (GPUs 0 and 1,
    NCCL) give transformers' greedy tokens on CUDA;
 2. speed: the Llama-3-8B-shaped bf16 model (`--layers` of its 32 layers, full width), one stream and
    `--concurrency` at once, as one stage on GPU 0 (CUDA graphs on, and off: the tensor-parallel
    stage runs eager today) against one `--tp 2` stage over GPUs 0 and 1; each against its HBM limit
    (the weight bytes a token reads over the GPUs' bandwidth: twice one GPU's for TP 2).

    python -m bench.gpu_tp --work /tmp/gpu --out $OUT --layers 16 --tokens 128 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.engine_bench import submit
from bench.gpu_engine import HBM_TBPS, LLAMA3_8B, SMALL, hbm_limit_tps, kv_mib, make_model, mesh_rates
from tests.localmesh import LocalMesh

PROMPTS = [[(i * 7919 + j * 104729) % 500 + 1 for j in range(20 + 3 * i)] for i in range(32)]


def exactness(work: Path) -> dict:
    """fp32 greedy tokens of a --tp 2 stage against transformers on CUDA, a dense and a MoE model."""
    from transformers import AutoModelForCausalLM

    from tests.families import hf_greedy

    out = {}
    shapes = {"llama": SMALL, "qwen3_moe": dict(SMALL, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                                                 head_dim=32, norm_topk_prob=True)}
    for family, shape in shapes.items():
        path = make_model(work / f"small-{family}", shape, torch.float32, family)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
        want = [hf_greedy(model, p, 16) for p in PROMPTS[:4]]
        del model
        torch.cuda.empty_cache()
        with LocalMesh(1, path, work / f"mesh-small-{family}", threads=4, device="cuda",
                       stage_extra={0: ("--tp", "2")}, controller_args=("--dtype", "float32")) as mesh:
            got = [submit(mesh.controller_address, ids=p, tokens=16)["ids"] for p in PROMPTS[:4]]
        out[family] = {"equal": got == want, "got": got, "want": want}
        print(family, "tp 2 greedy == transformers:", got == want, flush=True)
    return out


def speed(work: Path, args) -> dict:
    shape = dict(LLAMA3_8B, num_hidden_layers=args.layers)
    path = make_model(work / f"llama3-8b-shape-{args.layers}", shape, torch.bfloat16)
    name = torch.cuda.get_device_name()
    tbps = next((v for k, v in HBM_TBPS.items() if k in name), 3.35)
    limit = hbm_limit_tps(path, tbps)
    conc = [int(c) for c in args.concurrency.split(",")]
    kv = kv_mib(PROMPTS, args.tokens, shape)
    out = {"gpu": name, "layers": args.layers, "hbm_limit_one_gpu_tps": limit}
    variants = {"1 GPU, graphs on": (), "1 GPU, graphs off": ("--cuda-graphs", "off"), "tp 2": ("--tp", "2")}
    for label, extra in variants.items():
        t0 = time.perf_counter()
        with LocalMesh(1, path, work / f"mesh-{label.replace(' ', '-').replace(',', '')}", threads=4, device="cuda",
                       stage_args=("--max-kv-mib", str(kv), "--max-step-seqs", str(max(conc))),
                       stage_extra={0: extra}, controller_args=("--dtype", "bfloat16")) as mesh:
            up = time.perf_counter() - t0
            rates = mesh_rates(mesh.controller_address, PROMPTS, args.tokens, args.rounds, conc, mesh.stage_addresses)
        width = 2 if "tp" in label else 1
        out[label] = {"start_s": round(up, 1), "one_stream_tps": round(rates["one_stream_tps"], 1),
                      "of_hbm_limit": round(rates["one_stream_tps"] / (limit * width), 3),
                      "concurrent_tps": {c: r["concurrent_tps"] for c, r in rates["by_concurrency"].items()},
                      "one_stream_step_ms": rates["one_stream_step_ms_per_stage"]}
        print(label, json.dumps(out[label]), flush=True)
    base = out["1 GPU, graphs on"]["one_stream_tps"]
    out["tp2_over_one_gpu"] = round(out["tp 2"]["one_stream_tps"] / base, 3)
    out["tp2_over_one_gpu_eager"] = round(out["tp 2"]["one_stream_tps"] / out["1 GPU, graphs off"]["one_stream_tps"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/lp-gpu"))
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="8")
    ap.add_argument("--skip-exactness", action="store_true")
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit(f"needs 2 CUDA devices, this machine has {torch.cuda.device_count()}")
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    if not args.skip_exactness:
        results["exactness"] = exactness(args.work)
    results["speed"] = speed(args.work, args)
    (args.out / "gpu_tp.json").write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v for k, v in results.items()}, indent=2)[:4000])


if __name__ == "__main__":
    main()
