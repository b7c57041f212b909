"""Candidate tokens and pipelined prefill on a CPU mesh of real processes on 127.0.0.1.

    python -m bench.speculative_bench                    # 3 stages, every part
    python -m bench.speculative_bench --part decode --rounds 3 --speculate 4
    python -m bench.speculative_bench --part prefill --prompt-tokens 1500
    python -m bench.speculative_bench --part concurrent --concurrency 8

decode: single-stream greedy decode tok/s with prompt-lookup candidates ÷ without, request by
request in alternation on one mesh (the same tokens come out: it checks), over input-grounded
prompts (rewrite, extract, summarize a given text) and open-ended ones, with the acceptance rate
and tokens per pipeline trip. Goals (issue 11): >= 1.5x grounded, >= 0.95x open-ended.

concurrent: C streams at once, aggregate new tokens per second with candidates ÷ without,
alternating round by round, on open-ended prompts (the worst case for candidates) and on grounded
ones: what the default (--speculate 4) does to a loaded mesh.

prefill: time to first token of a long prompt, chunked by the cost model (the controller's
choice) ÷ the prompt as one chunk, alternating; each run's prompt starts differently, so the
prefix cache never helps. Goal: <= 0.6. On a machine with cores to spare, `--pin-cores N` pins
each stage process to N cores of its own (like separate boxes), and `--random-model DIR` makes (once)
a model of the default model's shape with random weights, for a machine without the model
(prompts are then token ids; the time to first token does not depend on the weights):

    python -m bench.speculative_bench --part prefill --random-model /tmp/rnd --pin-cores 4 --threads 4
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from logicpipe.v1 import controller_pb2, controller_pb2_grpc
from tests.localmesh import LocalMesh

TEXT = ("The city council met on Tuesday to discuss the new bicycle lanes on Main Street. Residents said the "
        "lanes made the street safer for children walking to school, but several shop owners worried that "
        "removing forty parking spaces would cost them customers. The council agreed to count visitors to the "
        "shops for three months before deciding whether to keep the lanes, and asked the transport office to "
        "publish the numbers every week on the city website.")
CODE = ("def total_price(items, tax_rate):\n    total = 0\n    for item in items:\n        total = total + "
        "item.price * item.quantity\n    total = total + total * tax_rate\n    return total\n")
GROUNDED = [
    f"Rewrite this text in the passive voice where you can, keeping every fact:\n\n{TEXT}",
    f"Copy this text, correcting any mistake in it:\n\n{TEXT}",
    f"Summarize this text in three sentences, reusing its words:\n\n{TEXT}",
    f"Extract every number and what it counts from this text, one per line:\n\n{TEXT}",
    f"Add a docstring and type hints to this function and repeat the whole function:\n\n{CODE}",
]
OPEN = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the benefits of regular exercise?",
    "Explain how airplanes stay in the air.",
    "Give me five ideas for a weekend trip with children.",
    "Why is the sky blue?",
]
FILLER = ("In the early years of the railway, timetables were kept by each town's own clock, and a train that "
          "left one station at noon arrived at the next at a time that depended on who was asked. ")


def submit(address: str, **fields) -> list[controller_pb2.SubmitReply]:
    with grpc.insecure_channel(address) as ch:
        return list(controller_pb2_grpc.ControllerStub(ch).Submit(controller_pb2.SubmitRequest(**fields),
                                                                  timeout=900))


def decode(address: str, prompts: list[str], rounds: int, speculate: int, max_tokens: int) -> dict:
    """Per mode: new tokens, decode seconds (after the first token), trips, candidates."""
    sums = {mode: {"tokens": 0, "new": 0, "seconds": 0.0, "steps": 0, "candidates": 0, "accepted": 0}
            for mode in ("off", "on")}
    mismatches = 0
    for r in range(rounds):
        for prompt in prompts:
            ids = {}
            for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                replies = submit(address, prompt=prompt, max_tokens=max_tokens, speculate=speculate if mode == "on" else 0)
                t = replies[-1].timings
                ids[mode] = [i for x in replies for i in x.token_ids]
                s = sums[mode]
                s["tokens"] += t.new_tokens - 1
                s["new"] += t.new_tokens
                s["seconds"] += (t.new_tokens - 1) / t.decode_tokens_per_s if t.decode_tokens_per_s else 0.0
                s["steps"] += t.decode_steps
                s["candidates"] += t.candidates
                s["accepted"] += t.accepted
            mismatches += ids["on"] != ids["off"]
    on = sums["on"]
    tps = {m: sums[m]["tokens"] / sums[m]["seconds"] for m in sums}
    return {"tok_s_off": round(tps["off"], 2), "tok_s_on": round(tps["on"], 2),
            "ratio": round(tps["on"] / tps["off"], 3),
            "acceptance": round(on["accepted"] / on["candidates"], 3) if on["candidates"] else 0.0,
            "tokens_per_step": round(on["new"] / on["steps"], 2) if on["steps"] else 0.0,
            "candidates": on["candidates"], "output_mismatches": mismatches}


def concurrent(address: str, prompts: list[str], rounds: int, speculate: int, n: int, max_tokens: int) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    rates = {"off": [], "on": []}
    for r in range(rounds):
        for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
            k = speculate if mode == "on" else 0
            t0 = time.monotonic()
            with ThreadPoolExecutor(n) as pool:
                outs = list(pool.map(lambda i: submit(address, prompt=prompts[i % len(prompts)], max_tokens=max_tokens,
                                                      ignore_eos=True, speculate=k), range(n)))
            tokens = sum(len(x.token_ids) for replies in outs for x in replies)
            rates[mode].append(tokens / (time.monotonic() - t0))
    med = {m: statistics.median(v) for m, v in rates.items()}
    return {"streams": n, "tok_s_off": round(med["off"], 2), "tok_s_on": round(med["on"], 2),
            "ratio": round(med["on"] / med["off"], 3)}


def prefill(address: str, model_dir: Path, prompt_tokens: int, rounds: int, one_chunk: int,
            token_ids: bool = False) -> dict:
    if not token_ids:
        from transformers import AutoTokenizer

        per = len(AutoTokenizer.from_pretrained(model_dir)(FILLER)["input_ids"])
    ttft = {"chunked": [], "one": []}
    chunk = 0
    for r in range(rounds):
        for mode in (("chunked", "one") if r % 2 == 0 else ("one", "chunked")):
            # a different start each run: the prefix cache holds nothing of it
            chunk_field = one_chunk if mode == "one" else 0
            if token_ids:  # a different first token each run
                ids = [(r * 2 + (mode == "one") + 7 * i) % 30000 + 100 for i in range(prompt_tokens)]
                replies = submit(address, prompt_token_ids=ids, max_tokens=1, speculate=0, prefill_chunk=chunk_field)
            else:
                text = f"Run {r} {mode}. " + FILLER * round(prompt_tokens / per)
                replies = submit(address, prompt=text, raw=True, max_tokens=1, speculate=0, prefill_chunk=chunk_field)
            t = replies[-1].timings
            ttft[mode].append(t.first_token_s)
            if mode == "chunked":
                chunk = t.prefill_chunk
            n = t.prompt_tokens
    med = {m: statistics.median(v) for m, v in ttft.items()}
    return {"prompt_tokens": n, "chunk": chunk, "ttft_chunked_s": round(med["chunked"], 3),
            "ttft_one_chunk_s": round(med["one"], 3), "ratio": round(med["chunked"] / med["one"], 3),
            "runs": {m: [round(x, 3) for x in v] for m, v in ttft.items()}}


def random_model(path: Path, like: str = "HuggingFaceTB/SmolLM2-135M-Instruct") -> Path:
    """A model of the default model's shape with random weights (made once at `path`)."""
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         tie_word_embeddings=True, rope_theta=100000.0)
    LlamaForCausalLM(config).save_pretrained(path)
    print(f"made a random model shaped like {like} at {path}", flush=True)
    return path


def pin(mesh, cores: int) -> dict:
    """Pin stage i (every thread of it) to cores [i*cores, (i+1)*cores); the controller to the next."""
    import os

    placed = {}
    names = sorted(n for n in mesh.procs if n.startswith("stage")) + ["controller"]
    for i, name in enumerate(names):
        cpus = set(range(i * cores, (i + 1) * cores)) if name != "controller" else {i * cores}
        pid = mesh.procs[name].pid
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(tid), cpus)
        placed[name] = sorted(cpus)
    return placed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--part", choices=["decode", "prefill", "concurrent", "all"], default="all")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--speculate", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per stage process")
    ap.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    ap.add_argument("--random-model", type=Path, default=None, metavar="DIR",
                    help="prefill only: a random model of the default model's shape, made once in DIR")
    ap.add_argument("--pin-cores", type=int, default=0, metavar="N", help="pin each stage to N cores of its own")
    args = ap.parse_args()
    if args.random_model:
        model_dir = random_model(args.random_model)
    elif args.model:
        model_dir = Path(args.model)
    else:
        from logicpipe.controller.cli.model_prep import prepare_default_model

        model_dir = prepare_default_model()
    one_chunk = 4096
    results = {"stages": args.stages, "threads_per_stage": args.threads}
    with tempfile.TemporaryDirectory(prefix="lp-spec-") as work, \
            LocalMesh(args.stages, model_dir, Path(work), threads=args.threads,
                      controller_args=("--strategy", "uniform"),
                      stage_args=("--max-step-tokens", str(one_chunk))) as mesh:
        address = mesh.controller_address
        if args.pin_cores:
            results["pinned"] = pin(mesh, args.pin_cores)
        submit(address, prompt_token_ids=[100, 200, 300], max_tokens=4)  # warm-up
        if args.part in ("decode", "all"):
            results["grounded"] = decode(address, GROUNDED, args.rounds, args.speculate, args.max_tokens)
            print("grounded", json.dumps(results["grounded"]), flush=True)
            results["open_ended"] = decode(address, OPEN, args.rounds, args.speculate, args.max_tokens)
            print("open-ended", json.dumps(results["open_ended"]), flush=True)
        if args.part in ("concurrent", "all"):
            for name, prompts in (("concurrent_open_ended", OPEN), ("concurrent_grounded", GROUNDED)):
                results[name] = concurrent(address, prompts, max(args.rounds, 3), args.speculate, args.concurrency,
                                           args.max_tokens)
                print(name, json.dumps(results[name]), flush=True)
        if args.part in ("prefill", "all"):
            results["prefill"] = prefill(address, model_dir, args.prompt_tokens, max(args.rounds, 3), one_chunk,
                                         token_ids=args.random_model is not None)
            print("prefill", json.dumps(results["prefill"]), flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
