"""The OpenAI-compatible HTTP API against gRPC (issue 14's goal: >= 0.95 of gRPC).

One 3-stage CPU mesh with `--http`; round by round, the same streamed chat request (greedy, the
default model, `--max-tokens` new tokens, EOS ignored) through gRPC Submit with the conversation
(what `lpctl chat` sends) and through POST /v1/chat/completions with `stream: true` (the official
`openai` client). Time to first token and decode tok/s (tokens after the first ÷ their time),
medians over rounds, and each HTTP figure ÷ its gRPC one.

    python -m bench.http_bench --rounds 5
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import openai

from logicpipe.common.transport import Transport
from logicpipe.v1 import controller_pb2, controller_pb2_grpc
from tests.localmesh import LocalMesh, free_port

PROMPT = "Write a long story about a lighthouse keeper and a storm."


def grpc_stream(address: str, tokens: int) -> tuple[float, float]:
    """(TTFT s, decode tok/s) of one streamed request over gRPC."""
    with Transport(plaintext=True).sync_channel(address, "controller") as ch:
        t0 = time.perf_counter()
        first, n = None, 0
        for r in controller_pb2_grpc.ControllerStub(ch).Submit(controller_pb2.SubmitRequest(
                messages=[controller_pb2.ChatMessage(role="user", content=PROMPT)], max_tokens=tokens,
                ignore_eos=True), timeout=600):
            if r.token_ids:
                first = first or time.perf_counter()
                n += len(r.token_ids)
        end = time.perf_counter()
    return first - t0, (n - 1) / (end - first)


def http_stream(client: openai.OpenAI, model: str, tokens: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    first, n = None, 0
    for c in client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                            max_tokens=tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": False},
                                            extra_body={"ignore_eos": True}):
        if c.choices and c.choices[0].delta.content:
            first = first or time.perf_counter()
    end = time.perf_counter()
    n = tokens
    return first - t0, (n - 1) / (end - first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    from logicpipe.controller.cli.model_prep import prepare_default_model

    model = prepare_default_model()
    http = f"127.0.0.1:{free_port()}"
    with LocalMesh(3, model, Path(f"/tmp/http-bench-{free_port()}"), threads=1, tls=False,
                   controller_args=("--http", http)) as mesh:
        client = openai.OpenAI(base_url=f"http://{http}/v1", api_key="none", max_retries=0, timeout=600)
        grpc_stream(mesh.controller_address, 8)
        http_stream(client, model.name, 8)
        g, h = [], []
        for _ in range(args.rounds):
            g.append(grpc_stream(mesh.controller_address, args.tokens))
            h.append(http_stream(client, model.name, args.tokens))
    med = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
    print(f"3-stage CPU mesh, default model, streamed chat, {args.tokens} tokens x {args.rounds} rounds")
    print("| | gRPC | HTTP (OpenAI API) | HTTP ÷ gRPC |")
    print("|---|---|---|---|")
    print(f"| time to first token | {med(g, 0) * 1000:.0f} ms | {med(h, 0) * 1000:.0f} ms | "
          f"{med(g, 0) / med(h, 0):.3f} (speed) |")
    print(f"| decode tok/s | {med(g, 1):.1f} | {med(h, 1):.1f} | **{med(h, 1) / med(g, 1):.3f}** |")


if __name__ == "__main__":
    main()
