"""Quantized stages on the CPU: weight memory and decode tok/s for --quantize none / int8 / nf4.

    python -m bench.quant_bench --rounds 3

One single-stage mesh per format (the default model, every layer in the stage; its embeddings,
norms and tied LM head stay float32), all up at once; requests go to each in turn, round by
round (open-ended prompts, 64 new tokens each, no candidates, EOS ignored), so the formats see
the same machine load. tok/s = decode tokens after the first / time after the first, medians.
Weight bytes are each stage's own count (Status.weight_bytes). Goal (issue 12): the fastest
quantized format >= 1.3x float32.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
from pathlib import Path

import grpc

from bench.speculative_bench import OPEN, submit
from logicpipe.v1 import stage_pb2, stage_pb2_grpc
from tests.localmesh import LocalMesh

FORMATS = ("none", "int8", "nf4")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from logicpipe.controller.model_prep import prepare_default_model

    model_dir = prepare_default_model()
    rates: dict[str, list[float]] = {f: [] for f in FORMATS}
    results = {"threads": args.threads, "formats": {}}
    with tempfile.TemporaryDirectory(prefix="lp-quant-") as work, contextlib.ExitStack() as stack:
        meshes = {f: stack.enter_context(LocalMesh(1, model_dir, Path(work) / f, threads=args.threads,
                                                   stage_args=("--quantize", f)))
                  for f in FORMATS}
        for f, mesh in meshes.items():
            submit(mesh.controller_address, prompt="Hello", max_tokens=4, speculate=0)  # warm-up
            with grpc.insecure_channel(mesh.stage_addresses[0]) as ch:
                st = stage_pb2_grpc.StageNodeStub(ch).Status(stage_pb2.StatusRequest(), timeout=10)
            results["formats"][f] = {"weight_format": st.weight_format, "weight_mib": round(st.weight_bytes / 2**20, 1)}
        for r in range(args.rounds):
            for prompt in OPEN:
                for f in (FORMATS if r % 2 == 0 else FORMATS[::-1]):
                    t = submit(meshes[f].controller_address, prompt=prompt, max_tokens=args.tokens, speculate=0,
                               ignore_eos=True)[-1].timings
                    rates[f].append(t.decode_tokens_per_s)
            print(f"round {r}:", {f: round(statistics.median(v), 1) for f, v in rates.items()}, flush=True)
    base = statistics.median(rates["none"])
    for f in FORMATS:
        med = statistics.median(rates[f])
        results["formats"][f].update({"decode_tok_s": round(med, 2), "vs_float32": round(med / base, 3)})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
