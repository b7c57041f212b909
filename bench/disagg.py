"""Disaggregated prefill (issue 39 item 1): the time to first token of a long prompt prefilled on
one pipeline and decoded on another (its KV handed over stage to stage), against the same prompt
prefilled by the decode pipeline itself, and by the prefill pipeline alone.

Stage processes are started here (`logicpipe-stage`, one per device listed), and this process
drives them as the controller does (controller.jobs.scheduler over two installed pipelines, each
request greedy, a fresh random prompt each round so no prefix cache helps):

- `local`: the prompt prefilled and decoded by the decode pipeline (--disaggregate off, routed there);
- `disaggregated`: prefilled on the prefill pipeline, KV moved, decoded on the decode pipeline
  (--disaggregate on), TTFT split into prefill / transfer / first decode step;
- `prefill-only pipeline`: prefilled and decoded on the prefill pipeline (for reference).

    python -m bench.disagg [--prefill cuda] [--decode cpu,cpu] [--prompt-tokens 4096] [--rounds 3]
                           [--model default|8b] [--layers 32] [--new-tokens 8] [--out FILE]

Devices: "cpu", "cuda" or "cuda:N" (CUDA_VISIBLE_DEVICES=N); a pipeline of several devices is split
into equal layer ranges. On the H100 host: `--prefill cuda --decode cpu` (the CPU hosts a decode
stage of the default model) or `--prefill cuda:0 --decode cuda:1,cuda:1` (two GPU pipelines of
different splits, nvidia-h100-x2). A CPU run with small numbers shows it works:
`--prefill cpu --decode cpu,cpu --prompt-tokens 256 --rounds 2`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from logicpipe.common.modeldir import ModelConfig, model_digest
from logicpipe.common.transport import PLAINTEXT
from logicpipe.controller.cli.model_prep import prepare_default_model
from logicpipe.controller.jobs.door import request_timings
from logicpipe.controller.jobs.handoff import HandoffPolicy
from logicpipe.controller.jobs.job import Job
from logicpipe.controller.jobs.scheduler import Scheduler, SchedulerConfig
from logicpipe.controller.mesh.pipeline import Pipeline, StageAssignment
from logicpipe.controller.mesh.pipelines import PipelineSet
from logicpipe.controller.mesh.state import MeshState, Phase
from logicpipe.sampling import SamplingParams
from tests.localmesh import LocalMesh

import torch

from bench.gpu_engine import LLAMA3_8B, make_model


def split(num_layers: int, n: int) -> list[tuple[int, int]]:
    """n contiguous, nearly equal layer ranges."""
    bounds = [round(i * num_layers / n) for i in range(n + 1)]
    return list(zip(bounds, bounds[1:]))


def stage_flags(device: str, threads: int, kv_mib: int) -> tuple[tuple[str, ...], dict[str, str]]:
    """A stage's extra flags and environment for `device` ("cpu", "cuda", "cuda:N")."""
    kind, _, index = device.partition(":")
    env = {"CUDA_VISIBLE_DEVICES": index} if index else {}
    return ("--device", kind, "--threads", str(threads), "--max-kv-mib", str(kv_mib), "--no-profile"), env


async def install(pipelines: PipelineSet, model_dir: Path, devices: list[str], addresses: list[str]) -> Pipeline:
    cfg = ModelConfig.from_dir(model_dir)
    p = pipelines.new()
    dtypes = ["bfloat16" if d.startswith("cuda") else "float32" for d in devices]
    await p.install(str(model_dir), model_digest(model_dir), cfg.num_layers,
                    [StageAssignment(a, s, e, dtype=dt, wire_dtype="float32")
                     for a, (s, e), dt in zip(addresses, split(cfg.num_layers, len(devices)), dtypes)],
                    micro_batches=1)
    return p


async def one(sched: Scheduler, prompt: list[int], new_tokens: int) -> dict:
    t0 = time.perf_counter()
    async with sched.submit(Job(tuple(prompt), new_tokens, SamplingParams(), ignore_eos=True)) as handle:
        tokens = [u.token_id async for u in handle]
    t = request_timings(handle.request)
    return {"ttft_s": t.first_token_s, "queue_s": t.queue_s, "total_s": time.perf_counter() - t0,
            "disaggregated": t.disaggregated, "prefill_s": t.prefill_s, "transfer_s": t.transfer_s,
            "first_step_s": t.first_step_s, "kv_mib": (handle.request.handoff.bytes / 2**20
                                                       if handle.request.handoff else 0.0), "tokens": tokens}


async def run(args, model_dir: Path, addresses: dict[str, list[str]]) -> dict:
    cfg = ModelConfig.from_dir(model_dir)
    current: list[Scheduler] = []
    pipelines = PipelineSet(PLAINTEXT, lambda ev: current[0].on_event(ev), lambda address, why: None)
    prefill = await install(pipelines, model_dir, args.prefill.split(","), addresses["prefill"])
    decode = await install(pipelines, model_dir, args.decode.split(","), addresses["decode"])
    state = MeshState()
    state.set(Phase.READY)
    config = SchedulerConfig(cfg.max_position_embeddings, frozenset(), cfg.vocab_size, speculate=0)
    rng = random.Random(39)

    def prompts() -> list[list[int]]:  # fresh ones: no prefix cache holds them
        return [[rng.randrange(100, cfg.vocab_size) for _ in range(args.prompt_tokens)] for _ in range(args.rounds)]

    # local and disaggregated decode the same prompts (the decode pipeline's imports bypass its prefix
    # cache); the prefill pipeline alone gets fresh ones (it holds those it prefilled for the handoffs)
    shared = prompts()
    results: dict[str, list[dict]] = {}
    modes = (("local (decode pipeline prefills)", [decode], "off", shared),
             ("disaggregated", [prefill, decode], "on", shared),
             ("prefill pipeline alone", [prefill], "off", prompts()))
    try:
        for name, serving, mode, batch in modes:
            pipelines.replace(serving)
            sched = Scheduler(pipelines, state, config, handoffs=HandoffPolicy(mode))
            current[:] = [sched]
            await one(sched, [rng.randrange(cfg.vocab_size) for _ in range(64)], 2)  # warm-up (graphs, caches)
            rows = [await one(sched, prompt, args.new_tokens) for prompt in batch]
            results[name] = rows
            await sched.shutdown()
            med = {k: statistics.median(r[k] for r in rows) for k in ("ttft_s", "prefill_s", "transfer_s",
                                                                         "first_step_s", "kv_mib")}
            split_s = (f" = prefill {med['prefill_s'] * 1000:.0f} + transfer {med['transfer_s'] * 1000:.0f} + first step "
                       f"{med['first_step_s'] * 1000:.0f} ms ({med['kv_mib']:.0f} MiB of KV)"
                       if all(r["disaggregated"] for r in rows) else "")
            each = ", ".join(f"{r['ttft_s'] * 1000:.0f}" for r in rows)
            print(f"{name:34s} TTFT median {med['ttft_s'] * 1000:8.0f} ms{split_s}   [{each}]", flush=True)
    finally:
        pipelines.replace([prefill, decode])
        await pipelines.close()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", default="cuda", help="devices of the prefill pipeline, comma-separated")
    ap.add_argument("--decode", default="cpu", help="devices of the decode pipeline, comma-separated")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default="default", choices=["default", "8b"],
                    help="default: SmolLM2-135M (float32 on CPU, bf16 on CUDA); 8b: a Llama-3-8B shape, random bf16")
    ap.add_argument("--layers", type=int, default=32, help="--model 8b: its decoder layers")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per CPU stage (0: its choice)")
    ap.add_argument("--max-kv-mib", type=int, default=4096, help="KV pool per stage")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "logicpipe-disagg")
    ap.add_argument("--out", type=Path, default=None, help="write the rounds as JSON here")
    args = ap.parse_args()
    if args.model == "8b":
        model_dir = make_model(args.work / f"llama3-8b-shape-{args.layers}",
                               dict(LLAMA3_8B, num_hidden_layers=args.layers), torch.bfloat16)
    else:
        model_dir = prepare_default_model()
    devices = {"prefill": args.prefill.split(","), "decode": args.decode.split(",")}
    flat = [d for role in ("prefill", "decode") for d in devices[role]]
    extra, env = {}, {}
    for i, d in enumerate(flat):
        extra[i], env[i] = stage_flags(d, args.threads, args.max_kv_mib)
    mesh = LocalMesh(len(flat), model_dir, args.work / "mesh", stage_env=env, tls=False)
    try:
        addresses = mesh.start_stages(extra)
        n = len(devices["prefill"])
        print(f"prefill pipeline {args.prefill} ({n} stages), decode pipeline {args.decode}; "
              f"{args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, {args.rounds} rounds; "
              f"model {model_dir.name}", flush=True)
        results = asyncio.run(run(args, model_dir, {"prefill": addresses[:n], "decode": addresses[n:]}))
    finally:
        mesh.stop()
    local, moved = (results[k] for k in ("local (decode pipeline prefills)", "disaggregated"))
    same = sum(a["tokens"] == b["tokens"] for a, b in zip(local, moved))
    print(f"greedy tokens, disaggregated = local: {same} of {len(local)} prompts (the same when both pipelines "
          "compute in one dtype)")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                       indent=1))


if __name__ == "__main__":
    main()
