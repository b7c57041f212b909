"""Long context through a CPU mesh: a long prompt prefills beside a request that decodes.

A random-weight Llama (tests.families; small enough for this machine, its context long enough for
the prompt) on an S-stage mesh on 127.0.0.1. One request decodes a short prompt; once it runs, a
prompt of N tokens is submitted. Reported: the long prompt's time to first token, the decoding
request's longest gap between two tokens while the long prompt prefilled beside it, and from every
stage's Status the steps that held a decode row (how many, the longest, how many went over the
step-time bar, --max-step-ms on the stages); and both requests' greedy tokens against transformers'
`generate` on the same checkpoint.

    python -m bench.long_context                                  # 32,000 tokens, 3 stages
    python -m bench.long_context --prompt-tokens 8000 --max-step-ms 0   # the bar off: chunks by rows alone
    python -m bench.long_context --device cuda --shape 8b --layers 4 --stages 1 --prompt-tokens 128000 \
        --no-reference --dtype bfloat16                            # on the GPU machine: Llama-3.1-8B shapes,
                                                                   # llama3 RoPE scaling to 131,072 positions
With `--device cuda` the GPU's memory in use is sampled (nvidia-smi) while the prompt prefills.
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import threading
import time
from pathlib import Path

import subprocess

import grpc
import torch

from logicpipe.common.transport import CHANNEL_OPTIONS
from logicpipe.v1 import controller_pb2, controller_pb2_grpc, stage_pb2, stage_pb2_grpc
from tests.families import build, hf_greedy, hf_model
from tests.localmesh import LocalMesh

SHORT = [17, 423, 981, 77, 3050, 12, 640, 2211]


def submit(address: str, ids: list[int], n: int, out: list) -> None:
    """Greedy request; appends (seconds since submit, token ids) per reply to `out`."""
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        t0 = time.perf_counter()
        for r in controller_pb2_grpc.ControllerStub(ch).Submit(
                controller_pb2.SubmitRequest(prompt_token_ids=ids, max_tokens=n, ignore_eos=True), timeout=3600):
            out.append((time.perf_counter() - t0, list(r.token_ids)))


def stage_status(address: str) -> stage_pb2.StatusReply:
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        return stage_pb2_grpc.StageNodeStub(ch).Status(stage_pb2.StatusRequest(), timeout=10)


def sample_gpu(out: list[int], done: threading.Event) -> None:
    """The GPU's memory in use (MiB, nvidia-smi) every 0.5 s until `done`."""
    while not done.is_set():
        try:
            got = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10).stdout.split()
            out.append(max(int(x) for x in got))
        except (OSError, ValueError, subprocess.SubprocessError):
            return
        done.wait(0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=32000)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--max-step-ms", type=float, default=100.0, help="the stages' step-time bar (0: off)")
    ap.add_argument("--new-tokens", type=int, default=4, help="tokens the long prompt generates")
    ap.add_argument("--decode-tokens", type=int, default=0,
                    help="tokens the short request generates (default: until the long prompt is done, estimated)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per stage")
    ap.add_argument("--no-reference", action="store_true", help="skip transformers' tokens")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--shape", default="tiny", choices=["tiny", "8b"],
                    help="tiny: --hidden/--layers/--heads; 8b: Llama-3.1-8B's shapes (--layers of them), random bf16")
    ap.add_argument("--dtype", default="float32", help="the controller's --dtype")
    ap.add_argument("--max-kv-mib", type=int, default=0, help="the stages' KV pool (default: theirs)")
    ap.add_argument("--kv-dtype", default="auto", help="the stages' --kv-dtype (auto, int8, fp8)")
    ap.add_argument("--strategy", default="uniform",
                    help="the controller's --strategy: uniform (default) splits the layers evenly over --stages "
                         "stages; dp lets the planner choose (on a small model it may use fewer stages)")
    ap.add_argument("--stage-arg", action="append", default=[],
                    help="a flag for every stage, repeatable (e.g. --stage-arg=--step-log=/tmp/steps.jsonl)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    n = args.prompt_tokens
    work = Path(tempfile.mkdtemp(prefix="lp-longctx-"))
    if args.shape == "8b":
        from bench import gpu_engine
        gpu_engine.DEVICE = args.device
        shape = dict(gpu_engine.LLAMA3_8B, num_hidden_layers=args.layers, max_position_embeddings=131072,
                     rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192})
        model = gpu_engine.make_model(work / "model", shape, torch.bfloat16)
    else:
        model = build("llama", work / "model", None, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=max(1, args.heads // 2), max_position_embeddings=n + 512,
                      initializer_range=0.05)
    random.seed(0)
    long_ids = [random.randrange(100, 49000) for _ in range(n)]
    decode_n = args.decode_tokens or 20000  # cut short below once the long prompt is done
    ref_long = ref_short = None
    if not args.no_reference:
        t0 = time.perf_counter()
        hf = hf_model(model)
        ref_long = hf_greedy(hf, long_ids, args.new_tokens)
        ref_s = time.perf_counter() - t0
        print(f"transformers: {n}-token prompt's {args.new_tokens} greedy tokens in {ref_s:.1f} s")
        del hf
    stage_flags = ("--max-step-ms", str(args.max_step_ms),
                   *(("--max-kv-mib", str(args.max_kv_mib)) if args.max_kv_mib else ()), "--kv-dtype", args.kv_dtype,
                   *args.stage_arg)
    gpu_mib: list[int] = []
    with LocalMesh(args.stages, model, work / "mesh", threads=args.threads, tls=False, stage_args=stage_flags,
                   device=args.device, controller_args=("--context", str(min(n + 256, 131072)),
                                                        "--dtype", args.dtype, "--strategy", args.strategy)) as mesh:
        addr = mesh.controller_address
        short: list = []
        long: list = []
        done = threading.Event()

        def decode() -> None:
            with grpc.insecure_channel(addr, options=CHANNEL_OPTIONS) as ch:
                call = controller_pb2_grpc.ControllerStub(ch).Submit(
                    controller_pb2.SubmitRequest(prompt_token_ids=SHORT, max_tokens=decode_n, ignore_eos=True),
                    timeout=3600)
                t0 = time.perf_counter()
                for r in call:
                    short.append((time.perf_counter() - t0, list(r.token_ids)))
                    if done.is_set() and len(short) > 8:
                        call.cancel()
                        break

        t = threading.Thread(target=decode)
        t.start()
        while len(short) < 4:
            time.sleep(0.05)
        sampler = threading.Thread(target=sample_gpu, args=(gpu_mib, done), daemon=True)
        if args.device == "cuda":
            sampler.start()
        submit(addr, long_ids, args.new_tokens, long)
        done.set()
        t.join()
        ttft = long[0][0]
        stats = [stage_status(a) for a in mesh.stage_addresses]
    # the decoding request's gaps while the long prompt prefilled: its replies' times are from its own
    # submit; the long prompt went in just after its 4th reply
    s0 = short[3][0]
    window = [x for x in short if s0 <= x[0] <= s0 + ttft + 1e-3]
    gaps = [b[0] - a[0] for a, b in zip(window, window[1:])]
    short_ids = [t for _, ids in short for t in ids]
    long_out = [t for _, ids in long for t in ids]
    if not args.no_reference:
        hf = hf_model(model)
        ref_short = hf_greedy(hf, SHORT, len(short_ids))
    result = {
        "prompt_tokens": n, "stages": args.stages, "strategy": args.strategy, "hidden": args.hidden, "layers": args.layers,
        "max_step_ms_flag": args.max_step_ms, "ttft_s": round(ttft, 2),
        "decode_tokens_during_prefill": sum(len(x[1]) for x in window),
        "max_decode_gap_ms": round(1000 * max(gaps), 1) if gaps else None,
        "median_decode_gap_ms": round(1000 * sorted(gaps)[len(gaps) // 2], 1) if gaps else None,
        "stages_steps": [
            {"stage": i, "layers": [s.start_layer, s.end_layer], "steps": s.steps, "rows": s.tokens, "decode_steps": s.decode_steps,
             "max_decode_step_ms": round(1000 * s.max_decode_step_s, 1), "max_step_ms": round(1000 * s.max_step_s, 1),
             "decode_steps_over_bar": s.decode_steps_over_bar} for i, s in enumerate(stats)],
        "device": args.device, "shape": args.shape,
        "gpu_mib_used_max": max(gpu_mib) if gpu_mib else None,
        "long_tokens_equal_transformers": None if ref_long is None else long_out == ref_long,
        "short_tokens_equal_transformers": None if ref_short is None else short_ids == ref_short,
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
