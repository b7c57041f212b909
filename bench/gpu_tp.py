"""Tensor-parallel stages on GPUs (issue 36), on a machine with 2 or more CUDA devices:

 1. exactness: a small random fp32 Llama and Qwen3-MoE through one `--tp 2` stage (GPUs 0 and 1,
    NCCL) give transformers' greedy tokens on CUDA;
 2. speed: the Llama-3-8B-shaped bf16 model (`--layers` of its 32 layers, full width), one stream and
    `--concurrency` at once, as one stage on GPU 0 (CUDA graphs on, and off) against one `--tp 2` stage
    over GPUs 0 and 1 (graphs on, and off); each against its HBM limit
    (the weight bytes a token reads over the GPUs' bandwidth: twice one GPU's for TP 2).

    python -m bench.gpu_tp --work /tmp/gpu --out $OUT --layers 32 --tokens 64 --rounds 2
    python -m bench.gpu_tp --skip-exactness --shape 70b --layers 40 --variants tp4,pp4,tp2x2   # 4 GPUs
    python -m bench.gpu_tp --skip-exactness --layers 32 --variants tp2,tpmax2 --tokens 64 --rounds 1   # the planner's width
    python -m bench.gpu_tp --skip-exactness --variants 1gpu,tp2 --trace /tmp/trace --profile 30   # where the time goes

The controller runs with `--speculate 0` unless told (a greedy stream then takes the overlapped step,
as in bench.gpu_engine). `--trace DIR`: bench.step_trace's timings of each variant's stage and
followers under DIR/<variant>; `--profile N`: torch.profiler over 16 one-row steps from the Nth.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

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


LLAMA3_70B = dict(LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8)
SHAPES = {"8b": LLAMA3_8B, "70b": LLAMA3_70B}


def _gpus(*ids: int) -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, ids))}


# name -> (GPUs it uses, stages, each stage's extra flags, each stage's environment)
VARIANTS = {
    "1gpu": (1, 1, {}, {}),
    "1gpu-eager": (1, 1, {0: ("--cuda-graphs", "off")}, {}),
    "tp2": (2, 1, {0: ("--tp", "2")}, {}),
    "tp2-eager": (2, 1, {0: ("--tp", "2", "--cuda-graphs", "off")}, {}),
    "tpmax2": (2, 1, {0: ("--tp-max", "2")}, {}),  # the planner picks the width (issue 36, planner/width.py)
    "tp4": (4, 1, {0: ("--tp", "4")}, {}),
    "pp4": (4, 4, {}, {i: _gpus(i) for i in range(4)}),  # a 4-stage pipeline, stage i on GPU i
    "tp2x2": (4, 2, {0: ("--tp", "2"), 1: ("--tp", "2")}, {0: _gpus(0, 1), 1: _gpus(2, 3)}),
}


def make_llama_fast(path: Path, shape: dict, device: str = "cuda") -> Path:
    """A random bf16 Llama of `shape` written tensor by tensor (each drawn on the GPU, N(0, 0.02)), a
    file of about 4 GB at a time: a 70B-wide model never exists whole in one GPU's memory or
    through transformers' init (make_model's way). Kept when it is already there."""
    if (path / "config.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    c = LlamaConfig(**shape)
    h, inter, hd = c.hidden_size, c.intermediate_size, c.hidden_size // c.num_attention_heads
    kv = c.num_key_value_heads * hd
    gen = torch.Generator(device=device).manual_seed(0)

    def tensors():
        yield "model.embed_tokens.weight", (c.vocab_size, h)
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            yield from ((p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                        (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                        (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                        (p + "mlp.down_proj.weight", (h, inter)), (p + "input_layernorm.weight", (h,)),
                        (p + "post_attention_layernorm.weight", (h,)))
        yield "model.norm.weight", (h,)
        yield "lm_head.weight", (c.vocab_size, h)

    index, part, size, n = {}, {}, 0, 0

    def flush():
        nonlocal part, size, n
        name = f"model-{n:05d}.safetensors"
        save_file(part, str(path / name), metadata={"format": "pt"})
        index.update({k: name for k in part})
        part, size, n = {}, 0, n + 1

    for name, dims in tensors():
        t = (torch.ones(dims, dtype=torch.bfloat16) if len(dims) == 1 else
             (torch.randn(dims, generator=gen, device=device, dtype=torch.float32) * 0.02).to(torch.bfloat16).cpu())
        part[name] = t
        size += t.numel() * 2
        if size > 4 << 30:
            flush()
    if part:
        flush()
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    c.torch_dtype = "bfloat16"
    c.save_pretrained(path)
    return path


def _plan(mesh) -> dict:
    """What the controller planned: `lpctl status` and `lpctl nodes` as printed, and each stage's profile
    (devices it spans, max_devices it offers, its measured all-reduce)."""
    out = {}
    for cmd in ("status", "nodes"):
        run = subprocess.run([*mesh.lpctl(), cmd], capture_output=True, text=True, timeout=60)
        out[cmd] = (run.stdout + run.stderr).strip()
    st = mesh.controller_status()
    out["stages"] = [str(s).replace("\n", " ") for s in st.stages]
    return out


def speed(work: Path, args) -> dict:
    """Each of --variants on the --shape model: one stream and --concurrency at once, against the HBM
    limit of the GPUs it uses (the weight bytes a token reads over their summed bandwidth)."""
    shape = dict(SHAPES[args.shape], num_hidden_layers=args.layers)
    path = make_llama_fast(work / f"llama3-{args.shape}-shape-{args.layers}", shape)
    name = torch.cuda.get_device_name()
    tbps = next((v for k, v in HBM_TBPS.items() if k in name), 3.35)
    limit = hbm_limit_tps(path, tbps)
    conc = [int(c) for c in args.concurrency.split(",")]
    kv = kv_mib(PROMPTS, args.tokens, shape)
    out = {"gpu": name, "shape": args.shape, "layers": args.layers, "hbm_limit_one_gpu_tps": limit}
    for label in args.variants.split(","):
        width, stages, extra, env = VARIANTS[label]
        if width > torch.cuda.device_count():
            out[label] = f"needs {width} GPUs"
            continue
        if args.trace:  # bench.step_trace's hooks in the stage and its followers (bench/trace_site)
            os.environ["LOGICPIPE_STEP_TRACE"] = str(args.trace / label)
            os.environ["LOGICPIPE_STEP_PROFILE"] = str(args.profile)
            site = str(Path(__file__).resolve().parent / "trace_site")
            if site not in os.environ.get("PYTHONPATH", ""):
                os.environ["PYTHONPATH"] = os.pathsep.join(
                    x for x in (site, str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")) if x)
        t0 = time.perf_counter()
        with LocalMesh(stages, path, work / f"mesh-{args.shape}-{label}", threads=4, device="cuda",
                       stage_args=("--max-kv-mib", str(kv), "--max-step-seqs", str(max(conc))),
                       stage_extra=extra, stage_env=env,
                       controller_args=("--dtype", "bfloat16", "--strategy", "uniform",
                                        "--speculate", str(args.speculate))) as mesh:
            up = time.perf_counter() - t0
            plan = _plan(mesh)
            print(label, "plan:", json.dumps(plan), flush=True)
            rates = mesh_rates(mesh.controller_address, PROMPTS, args.tokens, args.rounds, conc, mesh.stage_addresses)
        out[label] = {"gpus": width, "start_s": round(up, 1), "one_stream_tps": round(rates["one_stream_tps"], 1),
                      "of_hbm_limit": round(rates["one_stream_tps"] / (limit * width), 3),
                      "concurrent_tps": {c: r["concurrent_tps"] for c, r in rates["by_concurrency"].items()},
                      "one_stream_step_ms": rates["one_stream_step_ms_per_stage"], "plan": plan}
        print(label, json.dumps(out[label]), flush=True)
    ran = {k: v for k, v in out.items() if isinstance(v, dict)}
    for a, b in (("tpmax2", "tp2"), ("tp2", "1gpu"), ("tp2", "1gpu-eager"), ("tp2", "tp2-eager"), ("pp4", "tp4"), ("tp2x2", "tp4")):
        if a in ran and b in ran:
            out[f"{a}_over_{b}"] = round(ran[a]["one_stream_tps"] / ran[b]["one_stream_tps"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/lp-gpu"))
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b", help="Llama-3-8B's or -70B's width")
    ap.add_argument("--layers", type=int, default=16, help="decoder layers (8B has 32, 70B 80)")
    ap.add_argument("--variants", default="1gpu,1gpu-eager,tp2,tp2-eager",
                    help=f"comma list of {', '.join(VARIANTS)} (pp4: stage i on GPU i; tp2x2: two --tp 2 stages)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="8")
    ap.add_argument("--speculate", type=int, default=0,
                    help="the controller's --speculate (default 0, as bench.gpu_engine: a greedy stream then takes "
                         "the overlapped path; before issue 36's second sitting this bench left the controller's 4)")
    ap.add_argument("--skip-exactness", action="store_true")
    ap.add_argument("--trace", type=Path, default=None,
                    help="write bench.step_trace's timings of each variant's stage and followers under this folder")
    ap.add_argument("--profile", type=int, default=0,
                    help="with --trace: torch.profiler over 16 one-row steps from the Nth (0: none)")
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit(f"needs 2 or more CUDA devices, this machine has {torch.cuda.device_count()}")
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
