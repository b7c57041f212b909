"""Mutual TLS against plaintext on the 3-stage CPU mesh (issue 13's goal: >= 0.95 of plaintext).

Two figures, each with a plaintext and a TLS mesh up at once and measured alternately, round by
round, so both see the same machine:
  * single-stream decode tok/s of the default model through 3 stage processes (--speculate 0);
  * the added latency per hop (bench/hop_bench.py's synthetic model with the real hidden size:
    (per-token time of 3 stages - of 1 stage) / 3), plaintext and TLS.

    python -m bench.tls_bench --rounds 5
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from bench.hop_bench import make_model, run
from logicpipe.common.security.bundle import Bundle
from tests.localmesh import LocalMesh, mesh_bundle


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per decode request (default %(default)s)")
    ap.add_argument("--hop-tokens", type=int, default=200)
    args = ap.parse_args()
    from logicpipe.controller.cli.model_prep import prepare_default_model

    client = Bundle.load(mesh_bundle("client", "client"))
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        synthetic = make_model(work / "synthetic", layers=6)
        meshes = {}
        try:
            for key, model, n, secure in (("decode", prepare_default_model(), 3, False),
                                          ("decode", prepare_default_model(), 3, True),
                                          ("hop1", synthetic, 1, False), ("hop1", synthetic, 1, True),
                                          ("hop3", synthetic, 3, False), ("hop3", synthetic, 3, True)):
                m = LocalMesh(n, model, work / f"{key}-{secure}", threads=1, tls=secure,
                              controller_args=("--strategy", "uniform", "--speculate", "0"))
                m.__enter__()
                meshes[key, secure] = m
            bundles = {False: None, True: client}
            for (key, secure), m in meshes.items():  # warm-up
                run(m.controller_address, 16, bundles[secure])
            tps = {False: [], True: []}
            per_token = {(k, s): [] for k, s in meshes}
            for _ in range(args.rounds):
                for secure in (False, True):
                    m = meshes["decode", secure]
                    tps[secure].append(args.tokens / run(m.controller_address, args.tokens, bundles[secure]))
                    for key in ("hop1", "hop3"):
                        m = meshes[key, secure]
                        per_token[key, secure].append(
                            run(m.controller_address, args.hop_tokens, bundles[secure]) / args.hop_tokens)
        finally:
            for m in meshes.values():
                m.stop()
    hop = {s: statistics.median((a - b) / 3 * 1000 for a, b in zip(per_token["hop3", s], per_token["hop1", s]))
           for s in (False, True)}
    ratio = statistics.median(t / p for t, p in zip(tps[True], tps[False]))
    print(f"3-stage CPU mesh, default model, {args.tokens} tokens x {args.rounds} rounds, 1 thread per stage")
    print("| | plaintext | mutual TLS | TLS ÷ plaintext |")
    print("|---|---|---|---|")
    print(f"| decode tok/s (one stream) | {statistics.median(tps[False]):.1f} | {statistics.median(tps[True]):.1f} | "
          f"**{ratio:.3f}** |")
    print(f"| added latency per hop | {hop[False]:.3f} ms | {hop[True]:.3f} ms | "
          f"{hop[False] / hop[True] if hop[True] > 0 else float('nan'):.3f} (plaintext ÷ TLS: the speed ratio) |")


if __name__ == "__main__":
    main()
