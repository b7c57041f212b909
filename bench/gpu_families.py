"""GPU figures of the model families (issue 21), on the GPU machine:

    python -m bench.gpu_families --part tiny  --out $OUT   # every family's tiny model: greedy tokens
    python -m bench.gpu_families --part dense --out $OUT   # Qwen3-8B shape, random bf16
    python -m bench.gpu_families --part moe   --out $OUT   # Qwen3-30B-A3B shape, random bf16
    python -m bench.gpu_families --part mla   --out $OUT   # DeepSeek-V2-Lite shape (MLA), random bf16
    python -m bench.gpu_families --part gqa   --out $OUT   # its size with grouped-query attention instead
    python -m bench.gpu_families --part qwen35 --layers 16 --out $OUT  # Qwen3.5-27B shape (hybrid), random bf16

`tiny`: each family's tiny random checkpoint (tests/families.py, float32), served by one 2-stage
CUDA mesh (graphs on) whose controller restarts per family: 8 concurrent prompts longer than the
sliding window, candidates on, through 2 stages and (a stage drained) 1; greedy tokens must equal
transformers' `generate` on CUDA.

`dense` / `moe`: the model made here once with random bf16 weights (`--layers` of the shape's; the
figures per token scale with the layers, the ratio to the HBM limit hardly), served by 1 and 2
stages on the GPU with CUDA graphs on and candidates off (a step is one token): one stream's tok/s
and 8 concurrent streams' aggregate. The HBM limit is the bytes one token reads (the planner's
count: every matrix of a dense layer; a mixture's attention, router and the k experts a token routes
to; the LM head; not the indexed embedding) over the GPU's bandwidth (H100 3.35, H200 4.8 TB/s).
"""
from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench import gpu_engine
from bench.engine_bench import submit
from bench.gpu_engine import HBM_TBPS, hf_generate, make_model, mesh_rates
from logicpipe.common.modeldir import ModelConfig
from logicpipe.controller.mesh.planning import model_spec
from logicpipe.stage_node.engine.kv import kv_bytes_per_token
from logicpipe.v1 import controller_pb2, controller_pb2_grpc
from tests.localmesh import LocalMesh

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
                rope_theta=1000000.0, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None)
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                     max_position_embeddings=8192, rope_theta=1000000.0, tie_word_embeddings=False,
                     eos_token_id=None, bos_token_id=None)
# DeepSeek-V2-Lite (MLA: no q latent, a 512 + 64 latent; 64 experts, 6 a token, 2 shared; the first layer dense)
# and a model of its size with grouped-query attention in its place (Qwen2-MoE's layers: 16 heads over 4 KV
# heads of 128, the same experts and shared experts): the KV bytes a token costs, and the speed, side by side
DEEPSEEK_V2_LITE = dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_hidden_layers=27,
                        num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
                        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64,
                        num_experts_per_tok=6, n_shared_experts=2, moe_intermediate_size=1408, first_k_dense_replace=1,
                        topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
                        max_position_embeddings=8192, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None)
GQA_OF_ITS_SIZE = dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_hidden_layers=27,
                       num_attention_heads=16, num_key_value_heads=4, head_dim=128, num_experts=64, num_experts_per_tok=6,
                       moe_intermediate_size=1408, shared_expert_intermediate_size=2816, mlp_only_layers=[0],
                       norm_topk_prob=False, max_position_embeddings=8192, tie_word_embeddings=False,
                       eos_token_id=None, bos_token_id=None)
# Qwen3.5-27B (the published text config): 3 of every 4 layers gated delta-net linear attention (16 key
# heads, 48 value heads of 128, a 4-tap convolution), every 4th full attention (24 heads over 4 KV heads of
# 256, gated output, a quarter of each head rotated)
QWEN35_27B = dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                  num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                  linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                  linear_conv_kernel_dim=4, full_attention_interval=4,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
                  max_position_embeddings=8192, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None)
SHAPES = {"dense": ("qwen3", QWEN3_8B, "qwen3-8b"), "qwen35": ("qwen3_5", QWEN35_27B, "qwen3.5-27b"), "moe": ("qwen3_moe", QWEN3_30B_A3B, "qwen3-30b-a3b"),
          "mla": ("deepseek_v2", DEEPSEEK_V2_LITE, "deepseek-v2-lite"), "gqa": ("qwen2_moe", GQA_OF_ITS_SIZE, "gqa-moe")}


def read_bytes_per_token(path: Path) -> float:
    """Weight bytes one decode token reads (the planner's count, bf16)."""
    spec = model_spec(ModelConfig.from_dir(path), path.name, "", dtype="bfloat16")
    return spec.num_layers * spec.layer_read_bytes(1) + spec.lm_head_bytes


def tiny(args, results: dict, save) -> None:
    from tests.families import FAMILIES, WINDOW, build

    root = args.work / "tiny"
    names = args.families.split(",") if args.families else list(FAMILIES)
    models = {f: build(f, root / f) if not (root / f / "config.json").is_file() else root / f for f in names}
    prompts = [[(37 * i + 11 * j) % 49000 for j in range(2 * WINDOW + 3 * i)] for i in range(8)]
    want = {}
    for f, path in models.items():
        # soft-capped attention (Gemma 2) is transformers' eager attention: SDPA has no cap
        attn = "eager" if FAMILIES[f][0]().to_dict().get("attn_logit_softcapping") else None
        want[f] = hf_generate(path, torch.float32, prompts, args.tokens, 0, attn=attn)[1]
    first = next(iter(models.values()))
    with LocalMesh(2, first, args.work / "tiny-mesh", threads=4, device="cuda",
                   stage_args=("--cuda-graphs", "on", *args.stage_args.split()),
                   controller_args=("--strategy", "uniform", "--settle-s", "0.5")) as mesh:
        for f, path in models.items():
            mesh.restart_controller(path)
            row = {}
            for stages in (2, 1):
                if stages == 1:
                    with mesh.transport.sync_channel(mesh.controller_address, "controller") as ch:
                        controller_pb2_grpc.ControllerStub(ch).Drain(controller_pb2.DrainRequest(node="stage1"),
                                                                     timeout=120)
                with ThreadPoolExecutor(len(prompts)) as pool:
                    got = list(pool.map(lambda p: submit(mesh.controller_address, ids=p, tokens=args.tokens)["ids"],
                                        prompts))
                row[f"{stages}stage_equal"] = sum(g == w for g, w in zip(got, want[f]))
            results[f] = {**row, "of": len(prompts)}
            save()


def big(args, results: dict, save) -> None:
    family, shape, name = SHAPES[args.part]
    layers = args.layers or shape["num_hidden_layers"]
    path = make_model(args.work / f"{name}-{layers}", dict(shape, num_hidden_layers=layers), torch.bfloat16, family)
    results.update(model=name, layers=f"{layers} of {shape['num_hidden_layers']}")
    prompts = [[(31 * i + 7 * j) % (shape["vocab_size"] - 100) for j in range(20 + 3 * i)] for i in range(args.concurrency)]
    tbps = args.hbm_tbps or next((v for k, v in HBM_TBPS.items() if k in results["device"]), 0.0)
    read = read_bytes_per_token(path)
    config = ModelConfig.from_dir(path)
    results.update(kv_bytes_per_token=kv_bytes_per_token(config, config.num_layers, torch.bfloat16),
                   kv_bytes_per_token_per_layer=kv_bytes_per_token(config, 1, torch.bfloat16))
    results.update(read_gb_per_token=round(read / 1e9, 3), hbm_tbps=tbps,
                   hbm_limit_tps=round(tbps * 1e12 / read, 1) if tbps else None)
    save()
    runs = [(f"mesh{s}", s, {}) for s in (int(x) for x in args.stages.split(",") if x)]
    if args.tp:  # one stage over --tp GPUs: a mixture's experts split whole over them (expert parallelism)
        runs.append((f"tp{args.tp}", 1, {0: ("--tp", str(args.tp))}))
    for label, s, extra in runs:
        with LocalMesh(s, path, args.work / f"{name}-{label}", threads=4, device="cuda",
                       stage_args=("--cuda-graphs", "on", "--max-kv-mib", "4096", *args.stage_args.split()),
                       stage_extra=extra,
                       controller_args=("--dtype", "bfloat16", "--strategy", "uniform", "--speculate", "0")) as mesh:
            r = results[label] = mesh_rates(mesh.controller_address, prompts, args.tokens, args.rounds,
                                            args.concurrency, mesh.stage_addresses)
        if tbps:
            r["one_stream_of_hbm_limit"] = round(r["one_stream_tps"] / results["hbm_limit_tps"], 3)
        save()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["tiny", "dense", "moe", "mla", "gqa", "qwen35"], required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/lp-gpu"))
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--stages", default="1,2")
    ap.add_argument("--tp", type=int, default=0,
                    help="also one stage over this many GPUs (--tp N; a mixture's experts split whole: EP)")
    ap.add_argument("--families", default="", help="tiny: these families only (comma list; default all)")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers of the big shape (default: all)")
    ap.add_argument("--hbm-tbps", type=float, default=0.0, help="memory bandwidth, TB/s (default by GPU name)")
    ap.add_argument("--stage-args", default="", help="extra logicpipe-stage flags, space-separated (e.g. \"--kv-dtype fp8\")")
    ap.add_argument("--tag", default="", help="a suffix of the output file's name (runs of one part with other flags)")
    args = ap.parse_args()
    gpu_engine.DEVICE = "cuda"
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "part": args.part,
                     "stage_args": args.stage_args}

    def save():
        (args.out / f"gpu_families_{args.part}{args.tag}.json").write_text(json.dumps(results, indent=2))
        print(json.dumps(results), flush=True)

    (tiny if args.part == "tiny" else big)(args, results, save)


if __name__ == "__main__":
    main()
