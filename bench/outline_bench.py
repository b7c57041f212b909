"""Outline-DAG requests: parallel point decoding ÷ the same points decoded one after another, for
a fixed outline (so runs compare), on CPU meshes of real processes on 127.0.0.1; and, beside it,
what a plain request answers to the same question (its length, and how many of the outline's
points it touches), honestly.

    python -m bench.outline_bench                      # 2 and 4 stages
    python -m bench.outline_bench --stages 2 --rounds 3

Greedy decoding: both modes decode exactly the same tokens (each point's sequence is the same),
so the ratio is the wall time of the same work. Goal (issue 10): <= 0.5.
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

from logicpipe.v1 import controller_pb2, controller_pb2_grpc
from tests.localmesh import LocalMesh

QUESTION = "How does a city keep its drinking water safe?"
OUTLINES = {  # name: a fixed outline
    "dag": ("1. Water sources and protection. []\n2. Treatment at the plant. []\n3. Testing and monitoring. []\n"
            "4. Distribution pipes and pressure. []\n5. Why treatment and testing together work. [2, 3]\n"
            "6. What residents can do. [4]\n"),
    "flat": ("1. Water sources. []\n2. Filtration. []\n3. Disinfection. []\n4. Testing. []\n5. Storage. []\n"
             "6. Pipes. []\n7. Regulations. []\n8. Residents. []\n"),
}
POINT_TOKENS = 48


def submit(address: str, **fields) -> tuple[float, list[controller_pb2.SubmitReply]]:
    """Seconds the request took, and its replies."""
    t0 = time.monotonic()
    with grpc.insecure_channel(address) as ch:
        replies = list(controller_pb2_grpc.ControllerStub(ch).Submit(controller_pb2.SubmitRequest(**fields),
                                                                     timeout=900))
    return time.monotonic() - t0, replies


def bench(stages: int, model_dir: Path, work: Path, rounds: int, threads: int) -> list[dict]:
    with LocalMesh(stages, model_dir, work / f"s{stages}", threads=threads,
                   controller_args=("--strategy", "uniform")) as mesh:
        rows = []
        for name, text in OUTLINES.items():
            rows.append(compare(mesh.controller_address, stages, name, text, rounds))
        _, plain = submit(mesh.controller_address, prompt=QUESTION, max_tokens=POINT_TOKENS * 6)
        answer = "".join(r.text for r in plain)
        keywords = [line.split(".", 1)[1].split()[0].lower() for line in OUTLINES["dag"].splitlines()]
        for row in rows:
            row.update(plain_tokens=sum(len(r.token_ids) for r in plain), plain_words=len(answer.split()),
                       plain_covers=f"{sum(1 for k in keywords if k in answer.lower())} of {len(keywords)}")
        return rows


def compare(address: str, stages: int, name: str, text: str, rounds: int) -> dict:
    outline = dict(prompt=QUESTION, outline=True, outline_text=text, max_tokens=POINT_TOKENS)
    submit(address, **outline)  # warm-up (and the prefix cache, for both modes alike)
    par, seq, same = [], [], True
    for _ in range(rounds):
        tp, par_replies = submit(address, **outline)
        ts, seq_replies = submit(address, **outline, sequential_points=True)
        rp, rs = par_replies[-1], seq_replies[-1]
        par.append(tp)
        seq.append(ts)
        same &= [p.text for p in rp.points] == [p.text for p in rs.points]
        print(f"{stages} stages, {name}: parallel {tp:.1f} s, sequential {ts:.1f} s", file=sys.stderr, flush=True)
    return {"stages": stages, "outline": name, "points": len(rp.points), "parallel_s": statistics.median(par),
            "sequential_s": statistics.median(seq), "ratio": statistics.median(par) / statistics.median(seq),
            "identical_points": same, "outline_tokens": rp.timings.new_tokens,
            "outline_words": sum(len(p.text.split()) for p in rp.points)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", default="2,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    from logicpipe.controller.cli.model_prep import prepare_default_model

    model = Path(args.model) if args.model else prepare_default_model()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [r for n in args.stages.split(",") for r in bench(int(n), model, Path(tmp), args.rounds, args.threads)]
    print(json.dumps(rows), file=sys.stderr)
    print("| stages | outline | parallel points | one after another | ratio (goal <= 0.5) | same points |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['stages']} | {r['outline']} ({r['points']} points) | {r['parallel_s']:.1f} s | "
              f"{r['sequential_s']:.1f} s | {r['ratio']:.2f} | {r['identical_points']} |")
    for r in rows:
        print(f"{r['stages']} stages, {r['outline']}: outline answer {r['outline_words']} words ({r['outline_tokens']} "
              f"tokens); plain answer {r['plain_words']} words ({r['plain_tokens']} tokens), touching "
              f"{r['plain_covers']} of the dag outline's point keywords")


if __name__ == "__main__":
    main()
