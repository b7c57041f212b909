"""Added latency per hop for a decode-size activation, with the compute taken out of the way.

A synthetic Llama (random weights, seeded, no tokenizer: prompts go in as token ids) with SmolLM2-135M's hidden size (576, so each hop
carries the same 1 x 576 activation as the real model) but tiny layers and a 64-token vocabulary,
so a step's compute is small and fits in cache. The same code runs as a 1-stage mesh and as an
S-stage mesh on 127.0.0.1, interleaved round by round; per round,
hop = (per-token time of S stages - per-token time of 1 stage) / S  (a token crosses S links),
and the median over rounds is reported. The hop includes everything the mesh adds: encoding,
gRPC on loopback, decoding and validation, the receiving stage's queue.

    python -m bench.hop_bench --stages 2,3 --tokens 200 --rounds 7
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from logicpipe.common.transport import Transport
from logicpipe.v1 import controller_pb2, controller_pb2_grpc
from tests.localmesh import LocalMesh as Mesh

HIDDEN = 576


def make_model(path: Path, layers: int = 6) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=4096,
                         tie_word_embeddings=True, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def run(address: str, tokens: int, bundle=None) -> float:
    """Seconds for one request of `tokens` new tokens (over TLS with `bundle`)."""
    with Transport(bundle).sync_channel(address, "controller") as ch:
        stub = controller_pb2_grpc.ControllerStub(ch)
        t0 = time.perf_counter()
        n = sum(len(r.token_ids) for r in stub.Submit(controller_pb2.SubmitRequest(
            prompt_token_ids=[1, 2, 3, 4], max_tokens=tokens, ignore_eos=True), timeout=600))
        elapsed = time.perf_counter() - t0
    assert n == tokens, n
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()
    sizes = sorted({1, *(int(s) for s in args.stages.split(","))})
    with tempfile.TemporaryDirectory() as work:
        model = make_model(Path(work) / "model", layers=6)
        meshes = {}
        try:
            for s in sizes:
                (Path(work) / f"m{s}").mkdir()
                meshes[s] = Mesh(s, model, Path(work) / f"m{s}", threads=1, device=args.device,
                                 controller_args=("--strategy", "uniform"))
                meshes[s].__enter__()
            for s in sizes:
                run(meshes[s].controller_address, 20)  # warm-up
            per_token = {s: [] for s in sizes}
            for _ in range(args.rounds):
                for s in sizes:
                    per_token[s].append(run(meshes[s].controller_address, args.tokens) / args.tokens)
        finally:
            for m in meshes.values():
                m.stop()
    print(f"synthetic model, hidden {HIDDEN} (a {HIDDEN * 4}-byte fp32 activation per hop), {args.device}, "
          f"{args.tokens} tokens x {args.rounds} rounds")
    print(f"1 stage: {statistics.median(per_token[1]) * 1000:.2f} ms per token\n")
    print("| stages | ms per token | added latency per hop (median) |")
    print("|---|---|---|")
    for s in sizes[1:]:
        hops = [(a - b) / s * 1000 for a, b in zip(per_token[s], per_token[1])]
        print(f"| {s} | {statistics.median(per_token[s]) * 1000:.2f} | {statistics.median(hops):.3f} ms |")


if __name__ == "__main__":
    main()
