"""Single-stream greedy decode through the mesh vs single-process transformers `generate`.

Everything runs on this machine in one run, interleaved round by round so that noise from other
load hits both sides alike:
  * baseline: transformers `generate` in this process (same model, dtype, device, thread count);
  * mesh S: a controller and S stage processes on 127.0.0.1, one request at a time.
Reported: tokens/s (new tokens / wall time from submit to last token, prefill included, same for
both), the ratio mesh / baseline, and the added latency per hop for a decode-size activation,
hop = median over rounds of (per-token time of the S-stage mesh - per-token time of the 1-stage
mesh, same round) / S, since a token
crosses S links for S stages (S-1 between stages plus the last stage back to stage 0) and the
1-stage mesh runs the same code with none.

    python -m bench.mesh_bench                     # CPU, 2 and 3 stages
    python -m bench.mesh_bench --device cuda --stages 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch

from logicpipe.common.transport import CHANNEL_OPTIONS
from logicpipe.controller.jobs.text import encode_prompt
from logicpipe.v1 import controller_pb2, controller_pb2_grpc
from tests.localmesh import LocalMesh as Mesh

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def baseline_run(model, ids: list[int], tokens: int, device: str) -> tuple[float, list[int]]:
    """(seconds, new tokens) of transformers' greedy generate of exactly `tokens` new tokens
    (no EOS stop, as the mesh runs with ignore_eos)."""
    x = torch.tensor([ids], device=device)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        # an explicit mask: otherwise generate masks prompt tokens equal to pad (<|im_end|>) once EOS is unset
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=tokens, do_sample=False)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    new = out[0, len(ids):].tolist()
    assert len(new) == tokens
    return elapsed, new


def mesh_run(address: str, prompt: str, tokens: int) -> tuple[float, list[int]]:
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = controller_pb2_grpc.ControllerStub(ch)
        t0 = time.perf_counter()
        replies = list(stub.Submit(controller_pb2.SubmitRequest(prompt=prompt, max_tokens=tokens, ignore_eos=True),
                                   timeout=600))
        elapsed = time.perf_counter() - t0
    ids = [t for r in replies for t in r.token_ids]
    assert len(ids) == tokens, f"{len(ids)} tokens, expected {tokens}"
    return elapsed, ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model dir (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--stages", default="2,3", help="mesh sizes to measure (a 1-stage mesh is always run)")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians are reported")
    ap.add_argument("--threads", type=int, default=2, help="torch threads, baseline and every stage")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from logicpipe.controller.cli.model_prep import prepare_default_model

    model_dir = Path(args.model) if args.model else prepare_default_model()
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(args.device).eval()
    model.generation_config.eos_token_id = None  # run the full length, like the mesh's ignore_eos
    model.generation_config.pad_token_id = tok.pad_token_id
    ids = encode_prompt(tok, PROMPT)
    sizes = sorted({1, *(int(s) for s in args.stages.split(","))})

    with tempfile.TemporaryDirectory() as work:
        meshes = {}
        try:
            for s in sizes:
                meshes[s] = Mesh(s, model_dir, Path(work) / f"m{s}", threads=args.threads, device=args.device)
                (Path(work) / f"m{s}").mkdir()
                meshes[s].__enter__()
            times: dict[str, list[float]] = {"baseline": [], **{f"mesh{s}": [] for s in sizes}}
            # warm-up: first requests pay one-time costs (allocator, connections)
            baseline_run(model, ids, 8, args.device)
            for s in sizes:
                mesh_run(meshes[s].controller_address, PROMPT, 8)
            equal = {s: True for s in sizes}
            for r in range(args.rounds):
                elapsed, ref = baseline_run(model, ids, args.tokens, args.device)
                times["baseline"].append(elapsed)
                for s in sizes:
                    elapsed, out = mesh_run(meshes[s].controller_address, PROMPT, args.tokens)
                    times[f"mesh{s}"].append(elapsed)
                    if out != ref:
                        equal[s] = False
                        first = next(i for i, (a, b) in enumerate(zip(out, ref)) if a != b)
                        print(f"mesh{s} tokens differ from transformers' at token {first} in round {r}",
                              file=sys.stderr)
                print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                    f"{k} {args.tokens / v[-1]:.1f} tok/s" for k, v in times.items()), file=sys.stderr)
        finally:
            for m in meshes.values():
                m.stop()

    med = {k: statistics.median(v) for k, v in times.items()}
    base_tps = args.tokens / med["baseline"]
    rows = []
    for s in sizes:
        tps = args.tokens / med[f"mesh{s}"]
        # paired per round (same moment of machine load), then the median over rounds
        diffs = [(a - b) / args.tokens / s * 1000 for a, b in zip(times[f"mesh{s}"], times["mesh1"])]
        hop_ms = statistics.median(diffs) if s > 1 else 0.0
        rows.append({"stages": s, "tokens_per_s": tps, "ratio": tps / base_tps, "hop_ms": hop_ms,
                     "tokens_equal": equal[s]})
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"\nmodel {model_dir.name}, {args.device} ({device_name}), {args.threads} threads, "
          f"{args.tokens} new tokens, median of {args.rounds} rounds")
    print(f"baseline transformers generate: {base_tps:.1f} tok/s\n")
    print("| stages | mesh tok/s | mesh / transformers | added latency per hop | greedy tokens = transformers |")
    print("|---|---|---|---|---|")
    for r in rows:
        hop = f"{r['hop_ms']:.2f} ms" if r["stages"] > 1 else "-"
        same = "yes" if r["tokens_equal"] else "NO"
        print(f"| {r['stages']} | {r['tokens_per_s']:.1f} | {r['ratio']:.2f} | {hop} | {same} |")
    if args.json:
        args.json.write_text(json.dumps({"baseline_tokens_per_s": base_tps, "rows": rows, "device": device_name,
                                         "tokens": args.tokens, "rounds": args.rounds, "raw": times}, indent=2))


if __name__ == "__main__":
    main()
