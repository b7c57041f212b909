"""Quantized stages on the CPU: weight memory and decode tok/s for --quantize none / int4 / int8 / nf4,
and (`--kernels`) the kernels and a decode step taken apart.

    python -m bench.quant_bench --rounds 3
    python -m bench.quant_bench --kernels
    python -m bench.quant_bench --cpu-kernels

`--cpu-kernels` (issue 35, in this process): torch's packed int4 / int8 kernels against the native
ones (stage_node.kernels.cpu_native) on each of the default model's matrices, 1 and 8 rows, 1 and
2 threads, taken in turn batch by batch (medians; the ratio torch / native beside), then a whole
int4 decode step of the default model (1 row, 1 thread, head in int8) by each; the CPU's name and
its avx2 / avx512f / neon flags first.

`--kernels` (in this process, no mesh; `--threads` torch threads): for each of the default model's
matrices (fused q/k/v, o, fused gate/up, down, the LM head) the time of one product of 1 and of 8
rows by each kernel: the float32 product by row kind (stage_node.ops), torch's packed int4 (groups
of 32) and int8 (per channel) kernels with bf16 activations, and, for reference, the earlier int8
kernel (fbgemm's dynamic-quantized linear, one call per row) and bitsandbytes' nf4. Then a whole
decode step of the default model in one shard (30 layers, LM head, argmax) per format, of 1 row
and of 8 sequences of one row each, taken apart by torch's profiler into the products and
everything else (attention, norms, RoPE, KV writes, casts, views and the Python between them).

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
import os
import statistics
import tempfile
import time
from pathlib import Path

import grpc
import torch

from bench.speculative_bench import OPEN, submit
from logicpipe.stage_node.kernels.quant import QuantError, check_format, quantize
from logicpipe.stage_node.model.shard import Shard
from logicpipe.v1 import stage_pb2, stage_pb2_grpc
from tests.localmesh import LocalMesh

FORMATS = ("none", "int4", "int8", "nf4")
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
PRODUCT_OPS = ("aten::mm", "aten::addmm", "aten::linear", "aten::_weight_int4pack_mm_for_cpu",
               "aten::_weight_int8pack_mm", "quantized::linear_dynamic", "bitsandbytes")


def _time_us(fn, repeats: int) -> float:
    """Median of 5 batches of `repeats` calls, microseconds per call."""
    for _ in range(5):
        fn()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        runs.append((time.perf_counter() - t0) / repeats * 1e6)
    return statistics.median(runs)


def fbgemm_int8(w: torch.Tensor):
    """The int8 kernel before issue 25: fbgemm's dynamic-quantized linear, one call per row."""
    import warnings

    scales = (w.abs().amax(1) / 127.0).clamp(min=1e-12).double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        q = torch.quantize_per_channel(w, scales, torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
    packed = torch.ops.quantized.linear_prepack(q, None)
    return lambda x: torch.cat([torch.ops.quantized.linear_dynamic(x[i:i + 1], packed, False) for i in range(len(x))])


def kernels(threads: int) -> dict:
    from logicpipe.stage_node.model.ops import DECODE_ROWS, linear

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, generator=g) * 0.05
        kinds = {"float32": lambda x, w=w: linear(x, w, None, DECODE_ROWS), "int4": quantize(w, "int4"),
                 "int8": quantize(w, "int8"), "int8-fbgemm (before)": fbgemm_int8(w)}
        with contextlib.suppress(QuantError):
            check_format("nf4", "cpu")
            kinds["nf4"] = quantize(w, "nf4")
        row = {}
        for kind, fn in kinds.items():
            for m in (1, 8):
                x = torch.randn(m, k, generator=g)
                row[f"{kind} {m} row{'s' if m > 1 else ''}"] = round(_time_us(lambda: fn(x), 20 if name == "lm_head" else 200), 1)
        out[name] = row
        print(name, json.dumps(row), flush=True)
    return out


def decode_step(threads: int, model_dir: Path) -> dict:
    """A decode step of the whole default model in one shard, per format, of 1 and 8 sequences:
    its time, and the part of it spent in the products."""
    from torch.profiler import ProfilerActivity, profile

    from logicpipe.stage_node.engine.kv import StepKV, seq_slice

    torch.set_num_threads(threads)
    out = {}
    for fmt in FORMATS:
        with contextlib.suppress(QuantError):
            check_format(fmt, "cpu")
        try:
            shard = Shard.load(model_dir, 0, 30, first=True, last=True, quantize=fmt)
        except QuantError as exc:
            out[fmt] = {"skipped": str(exc)}
            continue
        pool = shard.new_pool(128, 16)

        def step(m: int, pos: int = 100, shard: Shard = shard, pool=pool) -> None:
            slots = torch.tensor([i * 256 + pos for i in range(m)])
            seqs = tuple(seq_slice(pos, 1, list(range(i * 16, i * 16 + 16)), 16, "cpu", 0) for i in range(m))
            shard.logits(shard.forward(shard.embed(torch.arange(m) + 100), StepKV(pool, slots, seqs))).argmax(-1)

        row = {"weight_mib": round(shard.weight_bytes / 2**20, 1)}
        for m in (1, 8):
            total = _time_us(lambda: step(m), 10) / 1000
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(10):
                    step(m)
            events = prof.key_averages()
            everything = sum(e.self_cpu_time_total for e in events)
            products = sum(e.self_cpu_time_total for e in events if any(e.key.startswith(p) for p in PRODUCT_OPS))
            row[f"{m} row{'s' if m > 1 else ''}"] = {"step_ms": round(total, 2),
                                                     "products_ms": round(total * products / everything, 2),
                                                     "outside_products_ms": round(total * (1 - products / everything), 2)}
        out[fmt] = row
        print(fmt, json.dumps(row), flush=True)
        shard = pool = None  # freed before the next format loads
    return out


def _interleaved_us(fns: dict, repeats: int, batches: int = 7, clock=time.perf_counter) -> dict[str, float]:
    """Median over `batches` of each fn's time per call (microseconds), the fns taken in turn within
    each batch so that they see the same machine load (`clock`: time.thread_time gives the CPU time
    of this thread, which a loaded machine's waits for a core do not inflate)."""
    for fn in fns.values():
        fn()
    runs: dict[str, list[float]] = {k: [] for k in fns}
    for b in range(batches):
        for k in (list(fns) if b % 2 == 0 else list(fns)[::-1]):
            t0 = clock()
            for _ in range(repeats):
                fns[k]()
            runs[k].append((clock() - t0) / repeats * 1e6)
    return {k: statistics.median(v) for k, v in runs.items()}


def cpu_kernels(model_dir: Path, step_rounds: int) -> dict:
    """Issue 35: the int4 / int8 kernels (torch's packed vs native) on the default model's product
    shapes, 1 and 8 rows, 1 and 2 threads, then the whole int4 decode step (1 row, 1 thread)."""
    from logicpipe.stage_node.engine.kv import StepKV, seq_slice
    from logicpipe.stage_node.kernels import cpu_native
    from logicpipe.stage_node.kernels.quant import set_cpu_kernel

    flags = cpu_native.cpu_flags()
    cpu = {"model": cpu_native.cpu_name(), "avx2": "avx2" in flags, "avx512f": "avx512f" in flags,
           "neon": bool({"asimd", "neon"} & flags), "native_build": cpu_native.isa(), "cores": os.cpu_count()}
    print("cpu", json.dumps(cpu), flush=True)
    kinds = ("torch", "native") if cpu_native.library() else ("torch",)
    g = torch.Generator().manual_seed(0)
    shapes = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k, generator=g) * 0.05
            for fmt in ("int4", "int8"):
                mats = {kind: quantize(w, fmt, kind) for kind in kinds}
                for m in (1, 8):
                    x = torch.randn(m, k, generator=g)
                    us = _interleaved_us({kind: (lambda q=q: q(x)) for kind, q in mats.items()}, 10 if name == "lm_head" else 100)
                    row = {kind: round(v, 1) for kind, v in us.items()}
                    if "native" in row:
                        row["torch/native"] = round(row["torch"] / row["native"], 2)
                    shapes[f"{name} {n}x{k} {fmt} {m} row{'s' if m > 1 else ''} {threads} thread{'s' if threads > 1 else ''}"] = row
                    print(f"{name} {n}x{k} {fmt} rows={m} threads={threads}", json.dumps(row), flush=True)
    torch.set_num_threads(1)
    shards = {}
    for kind in kinds:
        set_cpu_kernel("int4", kind)
        set_cpu_kernel("int8", kind)  # the head beside int4
        shards[kind] = Shard.load(model_dir, 0, 30, first=True, last=True, quantize="int4")
    pools = {kind: s.new_pool(128, 16) for kind, s in shards.items()}

    def step(kind: str, pos: int = 100) -> None:
        shard, pool = shards[kind], pools[kind]
        seqs = (seq_slice(pos, 1, list(range(16)), 16, "cpu", 0),)
        shard.logits(shard.forward(shard.embed(torch.tensor([100])), StepKV(pool, torch.tensor([pos]), seqs))).argmax(-1)

    steps = {}
    for clock in (time.perf_counter, time.thread_time):  # wall time, and this (only) thread's CPU time
        ms = {kind: round(v / 1000, 2) for kind, v in
              _interleaved_us({k: (lambda k=k: step(k)) for k in kinds}, step_rounds, clock=clock).items()}
        if "native" in ms:
            ms["torch/native"] = round(ms["torch"] / ms["native"], 2)
        steps["wall" if clock is time.perf_counter else "cpu"] = ms
        print(f"int4 step (1 row, 1 thread, ms, {clock.__name__})", json.dumps(ms), flush=True)
    return {"cpu": cpu, "products_us": shapes, "int4_step_ms": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kernels", action="store_true", help="the kernels and a decode step, in this process")
    ap.add_argument("--cpu-kernels", action="store_true",
                    help="issue 35: torch's packed int4/int8 kernels vs the native ones, in this process")
    args = ap.parse_args()
    if args.cpu_kernels:
        from logicpipe.controller.cli.model_prep import prepare_default_model

        print(json.dumps(cpu_kernels(prepare_default_model(), step_rounds=10)))
        return
    if args.kernels:
        from logicpipe.controller.cli.model_prep import prepare_default_model

        print(json.dumps({"threads": args.threads, "kernels_us": kernels(args.threads),
                          "decode_step": decode_step(args.threads, prepare_default_model())}))
        return
    from logicpipe.controller.cli.model_prep import prepare_default_model

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
