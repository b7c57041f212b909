"""Stage-engine figures: concurrency, llama.cpp as a peer, prefix reuse, KV admission.

Every scenario talks to real processes on 127.0.0.1 through the Controller's Submit only, so the
same script measures any version of the mesh. Scenarios (all by default):

  single       one stream on a 1-stage mesh (every layer in one process), new tokens per second
               (wall time from the submit to the last token, prefill included), medians; the ratio
               printed is it / llama.cpp's one stream.
  concurrency  C concurrent requests / 1 stream, aggregate new tokens per second (new tokens of
               all requests / wall time from the first submit to the last token), S-stage mesh,
               interleaved round by round, medians.
  llamacpp_batched
               llama.cpp decoding the C requests' sequences in one batch (prefill counted): the
               ratio printed is the mesh's C-concurrent aggregate / it (not run by default)
  llamacpp     llama.cpp (llama-cpp-python, optional: `pip install llama-cpp-python`) single stream
               on the same GGUF the default model comes from, same thread count, same token count;
               the ratio printed is the mesh's C-concurrent aggregate / llama.cpp's one stream.
  overhead     the mesh's own cost per token: one stream's decode wall time per token on a 1-stage
               mesh (token arrival times at the client, past the first 8) less the bare step (embed,
               every layer, head, argmax) of the same shard in this process with the same threads and
               format, the mesh stopped; with the controller's and the stage's CPU time per token.
  prefix       two requests sharing a ~500-token system prompt (a fresh one every round): time to
               first token of the second / of the first.
  microbatches the S-stage mesh with --micro-batches 1..S, C concurrent requests, interleaved
               (not run by default).
  admission    N requests of 200 tokens submitted at once to a 2-stage mesh with --max-kv-mib K: the
               most sequences open on both stages at once (sampled every 20 ms), how many completed,
               how many failed; three kinds of request (ADMISSION_VARIANTS): 200-token prompts and
               16 new tokens, the same with 160 prompt tokens shared by all (and seen once before
               the burst, as a system prompt in use is), and 40-token prompts with 160 new tokens.

`--quantize int4|int8|...` starts every stage of every mesh with that --quantize (issue 25 compares
int4 stages with llama.cpp on the Q4_1 file).

    python -m bench.engine_bench --stages 3 --concurrency 8 --tokens 64 --rounds 5 --threads 2
    python -m bench.engine_bench --scenarios llamacpp,single,concurrency --quantize int4 --rounds 5
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from logicpipe.common.transport import CHANNEL_OPTIONS
from logicpipe.v1 import controller_pb2, controller_pb2_grpc, stage_pb2, stage_pb2_grpc
from tests.localmesh import LocalMesh

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works.",
    "List ten fruits and say one thing about each.",
    "What are the main causes of the French Revolution? Answer in detail.",
    "Describe your ideal weekend.",
    "Write a poem about autumn leaves falling in a quiet park at dusk.",
    "How do airplanes stay in the air?",
    "Give me a recipe for pancakes with step by step instructions.",
    "Why is the sky blue?",
    "Summarize the plot of a detective novel you invent.",
]
FILLER = ("The committee met on a grey morning to review the harbour plans, the budget for the new "
          "school, the state of the northern road, and the proposal to plant trees along the river. ")


def submit(address: str, *, prompt: str = "", ids: list[int] | None = None, tokens: int,
           ignore_eos: bool = True) -> dict:
    """One request to its end: {"ids", "first_token_s", "total_s", "error"}."""
    req = controller_pb2.SubmitRequest(prompt=prompt, prompt_token_ids=ids or [], max_tokens=tokens,
                                       ignore_eos=ignore_eos)
    out = {"ids": [], "first_token_s": None, "total_s": None, "error": ""}
    t0 = time.perf_counter()
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        try:
            for reply in controller_pb2_grpc.ControllerStub(ch).Submit(req, timeout=1800):
                if reply.token_ids and out["first_token_s"] is None:
                    out["first_token_s"] = time.perf_counter() - t0
                out["ids"].extend(reply.token_ids)
        except grpc.RpcError as exc:
            out["error"] = f"{exc.code().name}: {exc.details()}"
    out["total_s"] = time.perf_counter() - t0
    return out


def concurrent(address: str, prompts: list[str], tokens: int) -> tuple[float, list[dict]]:
    """(wall seconds, results) of len(prompts) requests submitted at once."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: submit(address, prompt=p, tokens=tokens), prompts))
    wall = time.perf_counter() - t0
    bad = [r["error"] for r in results if r["error"] or len(r["ids"]) != tokens]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(prompts)} requests failed: {bad[:2]}")
    return wall, results


def stage_open_sessions(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return stage_pb2_grpc.StageNodeStub(ch).Status(stage_pb2.StatusRequest(), timeout=5).open_sessions


class PeakSampler:
    """The largest value of `probe()` seen, sampled every `period` seconds in a thread."""

    def __init__(self, probe, period: float = 0.02):
        self.probe, self.period, self.peak = probe, period, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.probe())
            except grpc.RpcError:
                pass
            time.sleep(self.period)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


# ----------------------------------------------------------------------------- scenarios

def stage_args(args) -> tuple[str, ...]:
    return (("--quantize", args.quantize) if args.quantize != "none" else ()) + tuple(args.stage_arg)


def scenario_single(args, model_dir, work) -> dict:
    with LocalMesh(1, model_dir, work / "single", threads=args.threads, device=args.device,
                   controller_args=tuple(args.controller_arg), stage_args=stage_args(args)) as mesh:
        addr = mesh.controller_address
        submit(addr, prompt=PROMPTS[0], tokens=8)  # warm-up
        rates = []
        for r in range(args.rounds):
            res = submit(addr, prompt=PROMPTS[0], tokens=args.tokens)
            if res["error"]:
                raise RuntimeError(res["error"])
            rates.append(args.tokens / res["total_s"])
            print(f"round {r + 1}/{args.rounds}: 1 stage, 1 stream {rates[-1]:.1f} tok/s", file=sys.stderr)
    return {"quantize": args.quantize, "tps": statistics.median(rates), "raw": rates}


def _stream_times(address: str, prompt: str, tokens: int) -> list[float]:
    """One greedy stream: the arrival time of each new token."""
    req = controller_pb2.SubmitRequest(prompt=prompt, max_tokens=tokens, ignore_eos=True)
    times = []
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        for reply in controller_pb2_grpc.ControllerStub(ch).Submit(req, timeout=1800):
            times += [time.perf_counter()] * len(reply.token_ids)
    return times


def bare_step_ms(model_dir, args, prompt_ids: list[int]) -> float:
    """Median ms of one decode step of the whole model in this process (embed, forward over the paged
    KV, head, argmax), `args.threads` threads, the stages' format, after the prompt's prefill."""
    import torch

    from logicpipe.common.modeldir import ModelConfig
    from logicpipe.stage_node.model.shard import Shard
    from tests.unit.paged import PagedCache

    torch.set_num_threads(args.threads)
    layers = ModelConfig.from_dir(Path(model_dir)).num_layers
    shard = Shard.load(model_dir, 0, layers, first=True, last=True, device=args.device,
                       quantize=args.quantize)
    cache = PagedCache(shard, num_blocks=-(-(len(prompt_ids) + args.tokens + 16) // 16), block_size=16)
    ids = list(prompt_ids)
    h = cache.forward(shard.embed(torch.tensor(ids)), [("s", 0, ids)], {"s": len(ids)})
    tok = int(shard.logits(h[-1:]).argmax())
    times = []
    for _ in range(args.tokens - 1):
        t0 = time.perf_counter()
        h = cache.forward(shard.embed(torch.tensor([tok])), [("s", len(ids), [tok])], {"s": len(prompt_ids)})
        ids.append(tok)
        tok = int(shard.logits(h).argmax())
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def scenario_overhead(args, model_dir, work) -> dict:
    from transformers import AutoTokenizer

    from bench.llamacpp_rpc import proc_cpu_s
    from logicpipe.controller.jobs.text import encode_prompt

    walls, ctl_cpu, stage_cpu = [], [], []
    with LocalMesh(1, model_dir, work / "overhead", threads=args.threads, device=args.device,
                   controller_args=tuple(args.controller_arg), stage_args=stage_args(args)) as mesh:
        addr = mesh.controller_address
        submit(addr, prompt=PROMPTS[0], tokens=8)  # warm-up
        ctl, stage = mesh.procs["controller"].pid, mesh.procs["stage0"].pid
        for r in range(args.rounds):
            c0, s0 = proc_cpu_s(ctl), proc_cpu_s(stage)
            times = _stream_times(addr, PROMPTS[0], args.tokens)
            c1, s1 = proc_cpu_s(ctl), proc_cpu_s(stage)
            walls.append(1000 * (times[-1] - times[8]) / (len(times) - 9))
            ctl_cpu.append(1000 * (c1 - c0) / len(times))
            stage_cpu.append(1000 * (s1 - s0) / len(times))
            print(f"round {r + 1}/{args.rounds}: mesh decode {walls[-1]:.2f} ms/token, CPU per token: controller "
                  f"{ctl_cpu[-1]:.2f} ms, stage {stage_cpu[-1]:.2f} ms", file=sys.stderr)
    ids = encode_prompt(AutoTokenizer.from_pretrained(model_dir), PROMPTS[0])
    bare = bare_step_ms(model_dir, args, ids)
    wall = statistics.median(walls)
    print(f"bare step {bare:.2f} ms; the mesh's own cost {wall - bare:.2f} ms/token", file=sys.stderr)
    return {"quantize": args.quantize, "threads": args.threads, "mesh_ms_per_token": wall, "bare_step_ms": bare,
            "mesh_cost_ms": wall - bare, "controller_cpu_ms_per_token": statistics.median(ctl_cpu),
            "stage_cpu_ms_per_token": statistics.median(stage_cpu), "raw": [walls, ctl_cpu, stage_cpu]}


def scenario_concurrency(args, model_dir, work) -> dict:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.concurrency)]
    with LocalMesh(args.stages, model_dir, work / "conc", threads=args.threads, device=args.device,
                   controller_args=tuple(args.controller_arg), stage_args=stage_args(args)) as mesh:
        addr = mesh.controller_address
        submit(addr, prompt=PROMPTS[0], tokens=8)  # warm-up
        concurrent(addr, prompts, 8)
        one, many = [], []
        for r in range(args.rounds):
            res = submit(addr, prompt=PROMPTS[0], tokens=args.tokens)
            if res["error"]:
                raise RuntimeError(res["error"])
            one.append(args.tokens / res["total_s"])
            wall, _ = concurrent(addr, prompts, args.tokens)
            many.append(args.concurrency * args.tokens / wall)
            print(f"round {r + 1}/{args.rounds}: 1 stream {one[-1]:.1f} tok/s, {args.concurrency} concurrent "
                  f"{many[-1]:.1f} tok/s aggregate", file=sys.stderr)
    ratios = [m / o for m, o in zip(many, one)]
    return {"stages": args.stages, "quantize": args.quantize, "concurrency": args.concurrency,
            "one_stream_tps": statistics.median(one),
            "concurrent_tps": statistics.median(many), "ratio": statistics.median(ratios), "raw": [one, many]}


def scenario_llamacpp(args, model_dir, work) -> dict:
    try:
        from llama_cpp import Llama
    except ImportError:
        return {"skipped": "llama-cpp-python is not installed (pip install llama-cpp-python)"}
    from transformers import AutoTokenizer

    from logicpipe.controller.cli.model_prep import find_default_gguf

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], tokenize=False,
                                   add_generation_prompt=True)
    llm = Llama(model_path=str(find_default_gguf()), n_threads=args.threads, n_ctx=1024, verbose=False)
    ids = llm.tokenize(text.encode(), add_bos=False, special=True)
    rates = []
    for _ in range(args.rounds + 1):
        llm.reset()
        t0 = time.perf_counter()
        n = 0
        for _tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            n += 1
            if n == args.tokens:
                break
        rates.append(args.tokens / (time.perf_counter() - t0))
    rates = rates[1:]  # the first run warms up
    print(f"llama.cpp: {statistics.median(rates):.1f} tok/s", file=sys.stderr)
    return {"gguf": find_default_gguf().name, "tps": statistics.median(rates), "raw": rates}


def scenario_llamacpp_batched(args, model_dir, work) -> dict:
    """llama.cpp decoding `--concurrency` sequences in one batch (its own multi-sequence KV), greedy:
    the prompts prefilled in one batch, then one token of every sequence per decode; aggregate new
    tokens per second over the whole (prefill counted), medians over rounds."""
    try:
        import llama_cpp
        from llama_cpp import Llama
    except ImportError:
        return {"skipped": "llama-cpp-python is not installed (pip install llama-cpp-python)"}
    import numpy as np
    from transformers import AutoTokenizer

    from logicpipe.controller.cli.model_prep import find_default_gguf

    tok = AutoTokenizer.from_pretrained(model_dir)
    n = args.concurrency
    prompts = [tok.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], tokenize=False,
                                       add_generation_prompt=True) for i in range(n)]
    llm = Llama(model_path=str(find_default_gguf()), n_threads=args.threads, n_ctx=256, verbose=False)
    ids = [llm.tokenize(p.encode(), add_bos=False, special=True) for p in prompts]
    params = llama_cpp.llama_context_default_params()  # (Llama's own context holds one sequence)
    total = sum(map(len, ids))
    params.n_ctx, params.n_batch, params.n_ubatch = n * (max(map(len, ids)) + args.tokens + 16), total, total
    params.n_seq_max, params.kv_unified = n, True
    params.n_threads = params.n_threads_batch = args.threads
    ctx, vocab = llama_cpp.llama_init_from_model(llm._model.model, params), llm.n_vocab()
    if not ctx:
        return {"skipped": "llama.cpp could not make a context of that many sequences"}
    batch = llama_cpp.llama_batch_init(total, 0, n)

    def put(i: int, token: int, pos: int, seq: int, logits: bool) -> None:
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
        batch.seq_id[i][0], batch.logits[i] = seq, logits

    def argmax(i: int) -> int:
        row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(vocab,))
        return int(row.argmax())

    rates = []
    try:
        for _ in range(args.rounds + 1):
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
            t0 = time.perf_counter()
            k, last = 0, []
            for seq, p in enumerate(ids):
                for pos, t in enumerate(p):
                    put(k, t, pos, seq, pos == len(p) - 1)
                    k += 1
                last.append(k - 1)
            batch.n_tokens = k
            if llama_cpp.llama_decode(ctx, batch):
                raise RuntimeError("llama_decode failed on the prompts")
            nxt = [argmax(i) for i in last]
            lengths = [len(p) for p in ids]
            for step in range(1, args.tokens):
                for seq in range(n):
                    put(seq, nxt[seq], lengths[seq] + step - 1, seq, True)
                batch.n_tokens = n
                if llama_cpp.llama_decode(ctx, batch):
                    raise RuntimeError("llama_decode failed on a decode step")
                nxt = [argmax(i) for i in range(n)]
            rates.append(n * args.tokens / (time.perf_counter() - t0))
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
    rates = rates[1:]  # the first run warms up
    print(f"llama.cpp, {n} sequences batched: {statistics.median(rates):.1f} tok/s aggregate", file=sys.stderr)
    return {"gguf": find_default_gguf().name, "concurrency": n, "tps": statistics.median(rates), "raw": rates}


def cpu_description() -> dict:
    """The CPU the figures come from: its model name and the vector extensions that matter here."""
    import platform

    from logicpipe.stage_node.kernels.cpu_native import cpu_flags, cpu_name

    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "asimd", "asimddp", "sve")
    flags = cpu_flags()
    return {"model": cpu_name(), "machine": platform.machine(), "flags": [f for f in wanted if f in flags]}


def scenario_prefix(args, model_dir, work) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)

    def ids_for(system: str, question: str) -> list[int]:
        text = tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": question}],
                                       tokenize=False, add_generation_prompt=True)
        return tok(text, add_special_tokens=False)["input_ids"]

    filler_ids = tok(FILLER * 40, add_special_tokens=False)["input_ids"]
    ratios, firsts, seconds, lengths = [], [], [], []
    with LocalMesh(args.stages, model_dir, work / "prefix", threads=args.threads, device=args.device,
                   controller_args=tuple(args.controller_arg)) as mesh:
        addr = mesh.controller_address
        submit(addr, prompt=PROMPTS[0], tokens=4)  # warm-up
        for r in range(args.rounds):
            system = f"Session {r} of the harbour committee. " + tok.decode(filler_ids[r: r + args.system_tokens])
            a = submit(addr, ids=ids_for(system, "What did the committee review?"), tokens=4)
            b = submit(addr, ids=ids_for(system, "Where should the trees be planted?"), tokens=4)
            if a["error"] or b["error"]:
                raise RuntimeError(a["error"] or b["error"])
            lengths.append(len(ids_for(system, "What did the committee review?")))
            firsts.append(a["first_token_s"])
            seconds.append(b["first_token_s"])
            ratios.append(b["first_token_s"] / a["first_token_s"])
            print(f"round {r + 1}/{args.rounds}: first {a['first_token_s'] * 1000:.0f} ms, second "
                  f"{b['first_token_s'] * 1000:.0f} ms", file=sys.stderr)
    return {"prompt_tokens": statistics.median(lengths), "first_ttft_s": statistics.median(firsts),
            "second_ttft_s": statistics.median(seconds), "ratio": statistics.median(ratios)}


ADMISSION_VARIANTS = {
    # name: (prompt tokens, of them shared by every request, new tokens)
    "distinct": (200, 0, 16),
    "shared": (200, 160, 16),
    "short-prompt": (40, 0, 160),
}


def scenario_admission(args, model_dir, work) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    pool = tok(FILLER * 200, add_special_tokens=False)["input_ids"]
    out = {}
    for variant, (length, shared, new) in ADMISSION_VARIANTS.items():
        prompts = []
        for i in range(args.requests):
            own = pool[(i * 37) % 1000: (i * 37) % 1000 + length]
            # a per-request token right after the shared part makes every prompt distinct from there on
            prompts.append((pool[:shared] + tok(f" {i}", add_special_tokens=False)["input_ids"] + own)[:length])
        with LocalMesh(2, model_dir, work / f"adm-{variant}", threads=1, device=args.device,
                       stage_args=("--max-kv-mib", str(args.kv_mib)), controller_args=tuple(args.controller_arg)) as mesh:
            addr = mesh.controller_address
            if shared:  # the shared part has been seen before (a system prompt in use)
                submit(addr, ids=pool[:shared] + [pool[shared]], tokens=1)
            with PeakSampler(lambda: min(stage_open_sessions(a) for a in mesh.stage_addresses)) as peak:
                t0 = time.perf_counter()
                with ThreadPoolExecutor(len(prompts)) as ex:
                    results = list(ex.map(lambda p: submit(addr, ids=p, tokens=new), prompts))
                wall = time.perf_counter() - t0
        done = sum(1 for r in results if not r["error"] and len(r["ids"]) == new)
        errors = sorted({r["error"].split(":")[0] for r in results if r["error"]})
        out[variant] = {"prompt_tokens": length, "shared_tokens": shared, "new_tokens": new,
                        "requests": len(prompts), "peak_running": peak.peak, "completed": done,
                        "failed": len(prompts) - done, "errors": errors, "wall_s": wall}
        print(f"admission ({variant}): peak {peak.peak} running, {done}/{len(prompts)} completed, "
              f"errors {errors}", file=sys.stderr)
    return out


def scenario_microbatches(args, model_dir, work) -> dict:
    """The same S-stage mesh with --micro-batches 1, 2, ... S, C concurrent requests, interleaved."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.concurrency)]
    meshes = {}
    try:
        for m in range(1, args.stages + 1):
            meshes[m] = LocalMesh(args.stages, model_dir, work / f"mb{m}", threads=args.threads, device=args.device,
                                  controller_args=("--micro-batches", str(m))).__enter__()
        for mesh in meshes.values():
            concurrent(mesh.controller_address, prompts, 8)
        rates = {m: [] for m in meshes}
        for r in range(args.rounds):
            for m, mesh in meshes.items():
                wall, _ = concurrent(mesh.controller_address, prompts, args.tokens)
                rates[m].append(args.concurrency * args.tokens / wall)
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{m} micro-batches {v[-1]:.1f} tok/s"
                                                              for m, v in rates.items()), file=sys.stderr)
    finally:
        for mesh in meshes.values():
            mesh.stop()
    return {str(m): statistics.median(v) for m, v in rates.items()}


SCENARIOS = {"single": scenario_single, "concurrency": scenario_concurrency, "llamacpp": scenario_llamacpp,
             "llamacpp_batched": scenario_llamacpp_batched, "prefix": scenario_prefix,
             "admission": scenario_admission, "microbatches": scenario_microbatches,
             "overhead": scenario_overhead}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default="concurrency,llamacpp,prefix,admission",
                    help=f"comma-separated, of: {', '.join(SCENARIOS)}")
    ap.add_argument("--model", default=None, help="model dir (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="torch threads per stage (and llama.cpp)")
    ap.add_argument("--system-tokens", type=int, default=480, help="prefix: filler tokens in the system prompt")
    ap.add_argument("--requests", type=int, default=64, help="admission: requests submitted at once")
    ap.add_argument("--kv-mib", type=int, default=256, help="admission: --max-kv-mib of each stage")
    ap.add_argument("--controller-arg", action="append", default=[], help="extra controller flag (repeatable)")
    ap.add_argument("--quantize", default="none", help="every stage's --quantize (single, concurrency; default none)")
    ap.add_argument("--stage-arg", action="append", default=[],
                    help="extra logicpipe-stage flag of the single / concurrency / overhead meshes (repeatable; "
                         "e.g. --stage-arg=--tp --stage-arg=2)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()

    from logicpipe.controller.cli.model_prep import prepare_default_model

    model_dir = Path(args.model) if args.model else prepare_default_model()
    results = {"cpu": cpu_description()}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.scenarios.split(","):
            results[name] = SCENARIOS[name](args, model_dir, Path(tmp))
    peer = results.get("llamacpp", {}).get("tps")
    if "concurrency" in results and peer:
        results["mesh_concurrent_over_llamacpp"] = results["concurrency"]["concurrent_tps"] / peer
    if "single" in results and peer:
        results["single_stage_one_stream_over_llamacpp"] = results["single"]["tps"] / peer
    batched = results.get("llamacpp_batched", {}).get("tps")
    if "concurrency" in results and batched:
        results["mesh_concurrent_over_llamacpp_batched"] = results["concurrency"]["concurrent_tps"] / batched
    print(json.dumps({k: ({kk: vv for kk, vv in v.items() if kk != "raw"} if isinstance(v, dict) else v)
                      for k, v in results.items()}, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
