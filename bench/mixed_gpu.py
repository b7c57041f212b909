"""A mixed mesh on the GPU machine: a CUDA stage in bf16, a CUDA stage in nf4 (--quantize) and a
CPU stage, in one pipeline; greedy output and tokens/s, each stage's device, dtype and weights.

    python -m bench.mixed_gpu --work /tmp/mixed           # needs bitsandbytes and a GPU

The model has the default model's shape and random weights (made once in --work; the GPU machine
has no copy of the model), so its text is meaningless; prompts are token ids.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import grpc

from bench.speculative_bench import random_model, submit
from logicpipe.v1 import stage_pb2, stage_pb2_grpc
from tests.localmesh import LocalMesh


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/mixed"))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--strategy", default="dp", help="the controller's --strategy (default dp: the plan costs each "
                                                       "node in its own format)")
    args = ap.parse_args()
    model = random_model(args.work / "model")
    mesh = LocalMesh(3, model, args.work / "mesh", threads=4)
    out = {}
    try:
        mesh.stage_addresses = [mesh.start_stage(0, None, "--device", "cuda"),
                                mesh.start_stage(1, None, "--device", "cuda", "--quantize", "nf4"),
                                mesh.start_stage(2, None, "--device", "cpu")]
        mesh.start_controller("--dtype", "bfloat16", "--strategy", args.strategy, "--speculate", "0")
        prompt = [(17 * i) % 30000 + 100 for i in range(40)]
        rates, runs = [], []
        for _ in range(args.rounds):
            replies = submit(mesh.controller_address, prompt_token_ids=prompt, max_tokens=args.tokens,
                             ignore_eos=True, speculate=0)
            runs.append([t for r in replies for t in r.token_ids])
            rates.append(replies[-1].timings.decode_tokens_per_s)
        tokens = runs[0]
        stages = []
        for addr in mesh.stage_addresses:
            with grpc.insecure_channel(addr) as ch:
                st = stage_pb2_grpc.StageNodeStub(ch).Status(stage_pb2.StatusRequest(), timeout=10)
            p = st.profile
            stages.append({"layers": [st.start_layer, st.end_layer], "device": st.device, "dtype": st.dtype,
                           "weight_format": st.weight_format, "weight_mib": round(st.weight_bytes / 2**20, 1),
                           "offers": list(p.weight_formats), "compute_format": p.compute_format,
                           "gflops": {f: round(v / 1e9) for f, v in p.format_flops.items()},
                           "weight_gbps": round(p.weight_bandwidth / 1e9, 1),
                           "bytes_per_param": round(p.weight_bytes_per_param, 3)})
        # later runs attach the prompt from the prefix cache and compute only its last row: bf16 on
        # CUDA (not batch-invariant) and a random model's near-ties may then pick other tokens
        out = {"stages": stages, "greedy_tokens": tokens, "decode_tok_s": round(statistics.median(rates), 2),
               "same_tokens_every_run": all(r == tokens for r in runs),
               "runs_tok_s": [round(r, 2) for r in rates]}
    finally:
        mesh.stop()
        if not out:
            print(mesh.logs(3000))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
