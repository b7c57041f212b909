"""GPU figures of the stage engine: a Llama-3-8B-shaped model with random bf16 weights (made here,
once), transformers `generate` against the 1- and 2-stage mesh, one stream and C concurrent
requests; and a small random fp32 Llama whose greedy tokens through 1 and 2 CUDA stages must equal
transformers' on CUDA.

    python -m bench.gpu_engine --work /tmp/gpu --out $OUT      # on the GPU machine

Single-stream decode is also given as a fraction of the HBM-bandwidth limit: the weight bytes a
token reads (every matrix; the embedding table is only indexed, so it is left out) over the GPU's
memory bandwidth (`--hbm-tbps`, default by GPU name: H100 3.35, H200 4.8 TB/s). Variants:
`--graphs on,off` (the stages' --cuda-graphs), `--spread` (stage i on GPU i: a mesh over GPUs),
`--speculate K` (the controller's candidates; 0 by default here, so a step is one token).
Issue 32: `--concurrency 32,64,128,256` measures each concurrency in turn (tok/s, the stages' mean
step ms and rows a step), `--context N` gives every 8B prompt N tokens, `--replicas N` is passed to
the controller; the stages get a KV pool with room for every prompt at once (`--max-kv-mib`) and
take up to the largest concurrency in one step (`--max-step-seqs`), and the controller lets one
client have that many requests (`--max-requests-per-client`).

Prompts are token ids (the random models have no tokenizer); every request decodes `--tokens`
new tokens (no EOS stop). tok/s = new tokens of all requests / wall time from the first submit to
the last token, prefill included, medians over rounds.

The compiled baseline (issue 25; `--skip-compiled` leaves it out): transformers `generate` with a
static cache, which compiles its decode step by itself (torch.compile), one stream and a batch of
the same `--concurrency` prompts (left-padded), greedy, timed after a compiling warm-up. Every
concurrent round of the mesh also records each token's arrival: the P99 gap between consecutive
tokens of a request, the longest time to a first token, and the longest stretch in which no request
got a token (the longest step, prefill included, plus its hop to the client), per round.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench.engine_bench import submit
from logicpipe.common.transport import CHANNEL_OPTIONS
from tests.localmesh import LocalMesh

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
                 tie_word_embeddings=False, eos_token_id=None, bos_token_id=None)
SMALL = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=True, eos_token_id=None,
             bos_token_id=None, initializer_range=0.2)


DEVICE = "cuda"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def make_model(path: Path, shape: dict, dtype: torch.dtype, family: str = "llama") -> Path:
    """A random model of `family` (tests/families.py) and `shape` saved as safetensors at `path`
    (kept when it is already there)."""
    if (path / "config.json").is_file():
        return path
    from tests.families import FAMILIES

    config_cls, model_cls, _ = FAMILIES[family]
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in its dtype: an 8B model never exists in float32
    try:
        with torch.device(DEVICE):
            model = model_cls(config_cls(**shape))
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(path, max_shard_size="4GB")
    del model
    if DEVICE == "cuda":
        torch.cuda.empty_cache()  # the stages started next measure the GPU's free memory
    return path


def hf_generate(path: Path, dtype: torch.dtype, prompts: list[list[int]], tokens: int, rounds: int,
                attn: str | None = None) -> tuple[float, list]:
    """(median tok/s of one stream, greedy tokens of each prompt) with transformers on CUDA
    (`attn`: its attention implementation, default its own choice)."""
    from transformers import AutoModelForCausalLM

    extra = {"attn_implementation": attn} if attn else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **extra).to(DEVICE).eval()
    model.generation_config.eos_token_id = None
    outs, rates = [], []
    with torch.inference_mode():
        for i in range(rounds + 1):
            x = torch.tensor([prompts[0]], device=DEVICE)
            sync()
            t0 = time.perf_counter()
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=tokens, do_sample=False)
            sync()
            if i:
                rates.append(tokens / (time.perf_counter() - t0))
        for p in prompts:
            x = torch.tensor([p], device=DEVICE)
            outs.append(model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=tokens,
                                       do_sample=False)[0, len(p):].tolist())
    del model
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(rates) if rates else 0.0, outs


def hf_compiled(path: Path, dtype: torch.dtype, prompts: list[list[int]], tokens: int, rounds: int) -> dict:
    """transformers `generate` with a static cache (its decode step compiled by torch.compile): tok/s
    of one stream (prompts[0]) and of a batch of all `prompts` (left-padded), medians after a
    compiling warm-up each."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(DEVICE).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    out: dict = {}
    width = max(len(p) for p in prompts)
    batches = {"one_stream": ([prompts[0]], [[1] * len(prompts[0])]),
               f"batch{len(prompts)}": ([[0] * (width - len(p)) + p for p in prompts],
                                        [[0] * (width - len(p)) + [1] * len(p) for p in prompts])}
    with torch.inference_mode():
        for name, (ids, mask) in batches.items():
            x = torch.tensor(ids, device=DEVICE)
            m = torch.tensor(mask, device=DEVICE)
            rates = []
            for i in range(rounds + 2):  # two warm-ups: the compile, and its first graph replays
                sync()
                t0 = time.perf_counter()
                y = model.generate(x, attention_mask=m, max_new_tokens=tokens, do_sample=False,
                                   cache_implementation="static")
                sync()
                took = time.perf_counter() - t0
                assert y.shape[1] == x.shape[1] + tokens
                if i == 0:
                    out[f"{name}_first_call_s"] = round(took, 1)
                if i >= 2:
                    rates.append(len(ids) * tokens / took)
            out[f"{name}_tps"] = round(statistics.median(rates), 1)
            out[f"{name}_rounds_tps"] = [round(r, 1) for r in rates]
            print("compiled transformers", name, out[f"{name}_tps"], flush=True)
    del model
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return out


def stream(address: str, ids: list[int], tokens: int) -> dict:
    """One request to its end: {"ids", "times": seconds from the submit at which each token came,
    "error"}."""
    import grpc

    from logicpipe.v1 import controller_pb2, controller_pb2_grpc

    req = controller_pb2.SubmitRequest(prompt_token_ids=ids, max_tokens=tokens, ignore_eos=True)
    out: dict = {"ids": [], "times": [], "error": "", "t0": time.perf_counter()}
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        try:
            for reply in controller_pb2_grpc.ControllerStub(ch).Submit(req, timeout=1800):
                now = time.perf_counter() - out["t0"]
                out["ids"].extend(reply.token_ids)
                out["times"].extend([now] * len(reply.token_ids))
        except grpc.RpcError as exc:
            out["error"] = f"{exc.code().name}: {exc.details()}"
    return out


def gaps(results: list[dict], t0: float) -> dict:
    """Of one concurrent round: the median (about one decode step), P99 and largest gap between consecutive tokens of a request,
    the longest time to a first token, and the longest stretch from the round's start to its last
    token in which no request got a token (ms)."""
    per = [b - a for r in results for a, b in zip(r["times"], r["times"][1:])]
    events = sorted(r["t0"] - t0 + t for r in results for t in r["times"])
    quiet = max(b - a for a, b in zip([0.0] + events, events))
    per.sort()
    # decode alone: tokens from the moment every request has its first one (all prompts prefilled)
    # until the first request ends (all still decoding), over that time (issue 32: the cost model's figure)
    start = max((r["t0"] - t0 + r["times"][0] for r in results if r["times"]), default=0.0)
    end = min((r["t0"] - t0 + r["times"][-1] for r in results if r["times"]), default=0.0)
    window = sum(1 for t in events if start < t <= end)
    decode = round(window / (end - start), 1) if end - start > 0.05 else None
    return {"decode_tps": decode, "p50_gap_ms": round(per[len(per) // 2] * 1000, 2) if per else None,  # ~ a decode step
            "p99_gap_ms": round(per[min(len(per) - 1, int(0.99 * len(per)))] * 1000, 1) if per else None,
            "max_gap_ms": round(per[-1] * 1000, 1) if per else None,
            "max_first_token_ms": round(max(r["times"][0] for r in results) * 1000, 1),
            "longest_quiet_ms": round(quiet * 1000, 1)}


def plan_shape(mesh, model_dir: Path, context: int, concurrency: list[int]) -> dict:
    """The plan the controller made (issue 32): its pipelines (node ids per stage), and the
    planner's predicted tok/s for them at each measured concurrency (the pipelines in force costed
    at that workload with the controller's profiles and measured links: planner.evaluate_mesh)."""
    from logicpipe.common.modeldir import ModelConfig, model_digest
    from logicpipe.controller.mesh import planning
    from logicpipe.planner import Link, Workload, evaluate_mesh, mesh_plan_from_json

    st = mesh.controller_status()
    mesh_plan = mesh_plan_from_json(st.plan_json)
    links: dict[str, dict] = {}
    for link in st.links:
        links.setdefault(link.src, {})[link.dst] = Link(link.bandwidth, link.latency_s)
    spec = planning.model_spec(ModelConfig.from_dir(model_dir), model_dir.name, model_digest(model_dir), "bfloat16")
    profiles = [planning.device_profile(n.status, links.get(n.status.node_id, {}), spec) for n in st.nodes if n.reachable]
    predicted = {}
    for c in [1, *concurrency]:
        wl = Workload(context_tokens=context, batch=c)
        predicted[str(c)] = round(evaluate_mesh(mesh_plan.pipelines, profiles, spec, wl).tokens_per_s, 1)
    return {"pipelines": [[s.node_id for s in p.stages] for p in mesh_plan.pipelines],
            "micro_batches": [p.micro_batches for p in st.pipelines], "predicted_tps": predicted,
            "links": {f"{x.src}->{x.dst}": [x.bandwidth, x.latency_s] for x in st.links}}


def stage_status(stages: list[str]) -> list:
    import grpc

    from logicpipe.v1 import stage_pb2, stage_pb2_grpc

    out = []
    for a in stages:
        with grpc.insecure_channel(a) as ch:
            out.append(stage_pb2_grpc.StageNodeStub(ch).Status(stage_pb2.StatusRequest(), timeout=10))
    return out


def step_ms(stages: list[str], before: list) -> list[float]:
    """Each stage's mean compute time per step (ms) since `before` (its Status then)."""
    return [round((st.compute_s - b.compute_s) / max(1, st.steps - b.steps) * 1000, 2)
            for st, b in zip(stage_status(stages), before)]


def mesh_rates(addr: str, prompts: list[list[int]], tokens: int, rounds: int, concurrency: list[int],
               stages: list[str]) -> dict:
    """One stream's rounds, then each concurrency's (issue 32: a list): tok/s, the mean step time and
    rows a step (stage Status), and the gaps of each round. `concurrency`: a list, or one count."""
    concurrency = [concurrency] if isinstance(concurrency, int) else concurrency
    submit(addr, ids=prompts[0], tokens=4)  # warm-up
    one, ms = [], []
    for _ in range(rounds):
        before = stage_status(stages)
        r = submit(addr, ids=prompts[0], tokens=tokens)
        assert not r["error"], r["error"]
        ms.append(step_ms(stages, before))
        one.append(tokens / r["total_s"])
        print("one stream", round(one[-1], 1), "tok/s, step ms", ms[-1], flush=True)
    out = {"one_stream_tps": statistics.median(one), "one_stream_rounds_tps": [round(x, 1) for x in one],
           "one_stream_step_ms_per_stage": ms[-1], "by_concurrency": {}}
    for c in concurrency:
        many, rounds_ = [], []
        for _ in range(rounds):
            before = stage_status(stages)
            t0 = time.perf_counter()
            with ThreadPoolExecutor(c) as pool:
                res = list(pool.map(lambda p: stream(addr, p, tokens), prompts[:c]))
            wall = time.perf_counter() - t0
            assert all(not x["error"] and len(x["ids"]) == tokens for x in res), [x["error"] for x in res][:4]
            many.append(c * tokens / wall)
            after = stage_status(stages)
            steps = [a.steps - b.steps for a, b in zip(after, before)]
            rounds_.append(dict(gaps(res, t0), concurrent_tps=round(many[-1], 1), steps=steps,
                                step_ms=[round((a.compute_s - b.compute_s) / max(1, n) * 1000, 2)
                                         for a, b, n in zip(after, before, steps)],
                                rows_per_step=[round((a.tokens - b.tokens) / max(1, n), 1)
                                               for a, b, n in zip(after, before, steps)],
                                seqs_per_step=[round((a.seq_rows - b.seq_rows) / max(1, n), 1)
                                               for a, b, n in zip(after, before, steps)]))
            print("concurrency", c, "round", rounds_[-1], flush=True)
        mid = sorted(range(rounds), key=lambda i: many[i])[rounds // 2]  # the median round
        out["by_concurrency"][str(c)] = {"concurrent_tps": round(statistics.median(many), 1),
                                         "decode_tps": rounds_[mid]["decode_tps"],
                                         "step_ms_per_stage": rounds_[mid]["step_ms"],
                                         "p50_gap_ms": rounds_[mid]["p50_gap_ms"],
                                         # the longest gap between two tokens of a request, each round
                                         # (after the one-stream warm-up and rounds; issue 33: a stall)
                                         "max_gap_ms": [r["max_gap_ms"] for r in rounds_],
                                         "rows_per_step": rounds_[mid]["rows_per_step"], "rounds": rounds_}
    first = out["by_concurrency"][str(concurrency[0])]
    out["concurrent_tps"] = first["concurrent_tps"]  # (the first concurrency's, as before issue 32)
    out["rounds"] = first["rounds"]
    out["concurrent_steps_per_stage"] = first["rounds"][-1]["steps"]  # (the keys before issue 32: its last round)
    out["concurrent_step_ms_per_stage"] = first["rounds"][-1]["step_ms"]
    return out


def kv_mib(prompts: list[list[int]], tokens: int, shape: dict, dtype_bytes: int = 2) -> int:
    """A stage's KV pool for every prompt at once with its new tokens (a fifth more for blocks'
    rounding), at least 4096 MiB (the bench's fixed size before issue 32)."""
    per = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * (
        shape["hidden_size"] // shape["num_attention_heads"]) * dtype_bytes
    need = sum(len(p) + tokens + 16 for p in prompts) * per * 1.2 / 2**20
    return max(4096, int(need))


HBM_TBPS = {"H100": 3.35, "H200": 4.8}


def read_bytes_per_token(path: Path) -> int:
    """Bytes of weights one decode token reads: all tensors but the (indexed) embedding table."""
    from safetensors import safe_open

    total = 0
    for f in path.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for name in st.keys():
                if "embed_tokens" not in name:
                    t = st.get_slice(name)
                    total += int(torch.tensor(t.get_shape()).prod()) * 2  # bf16
    return total


def hbm_limit_tps(path: Path, tbps: float) -> float:
    return tbps * 1e12 / read_bytes_per_token(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/lp-gpu"))
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="8",
                    help="comma list of concurrent requests, each measured in turn (e.g. 32,64,128,256)")
    ap.add_argument("--context", type=int, default=0,
                    help="every 8B prompt this many tokens (default: 20 + 3 i tokens for prompt i)")
    ap.add_argument("--replicas", default="", help="the controller's --replicas (auto or N; default: not passed)")
    ap.add_argument("--max-kv-mib", type=int, default=0,
                    help="each stage's --max-kv-mib (default: room for every prompt at once, at least 4096)")
    ap.add_argument("--max-step-seqs", type=int, default=0,
                    help="each stage's --max-step-seqs (default: the largest concurrency, at least 64)")
    ap.add_argument("--stages", default="1,2", help="comma list of stage counts of the mesh runs (none: no mesh)")
    ap.add_argument("--skip-8b", action="store_true")
    ap.add_argument("--skip-small", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-compiled", action="store_true", help="no compiled-transformers baseline")
    ap.add_argument("--baseline-json", type=Path, help="take compiled_transformers from this gpu_engine.json")
    ap.add_argument("--label", default="", help="a suffix for the mesh results' names (before/after runs)")
    ap.add_argument("--device", default="cuda", help="cuda (default); cpu only to try the script")
    ap.add_argument("--graphs", default="on", help="comma list of --cuda-graphs settings to run (on,off)")
    ap.add_argument("--spread", action="store_true", help="stage i on GPU i (CUDA_VISIBLE_DEVICES)")
    ap.add_argument("--speculate", type=int, default=0, help="the controller's --speculate (default 0)")
    ap.add_argument("--layers", type=int, default=32, help="decoder layers of the 8B-shaped model (32; fewer to try)")
    ap.add_argument("--hbm-tbps", type=float, default=0.0, help="memory bandwidth, TB/s (default by GPU name)")
    args = ap.parse_args()
    concurrency = [int(c) for c in str(args.concurrency).split(",")]
    top = max(concurrency)
    global DEVICE
    DEVICE = args.device
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__}

    def save():
        (args.out / "gpu_engine.json").write_text(json.dumps(results, indent=2))
        print(json.dumps(results, indent=2), flush=True)

    # correctness: small fp32 model, greedy tokens through CUDA stages == transformers on CUDA
    small = make_model(args.work / "small", SMALL, torch.float32)
    prompts = [[(17 * i + 5 * j) % 500 for j in range(12 + 5 * i)] for i in range(8)]
    _, ref = hf_generate(small, torch.float32, prompts, 48, 0) if not args.skip_small else (0, [])
    for s in (int(x) for x in args.stages.split(",") if not args.skip_small):
        with LocalMesh(s, small, args.work / f"small{s}", threads=4, device=DEVICE,
                       controller_args=("--strategy", "uniform")) as mesh:
            with ThreadPoolExecutor(len(prompts)) as pool:
                got = list(pool.map(lambda p: submit(mesh.controller_address, ids=p, tokens=48)["ids"], prompts))
        results[f"small_fp32_{s}stage_greedy_equal"] = got == ref
        save()
    if args.skip_8b:
        return
    big = make_model(args.work / f"llama3-8b-shape-{args.layers}", dict(LLAMA3_8B, num_hidden_layers=args.layers),
                     torch.bfloat16)
    prompts = [[(31 * i + 7 * j) % 128000 for j in range(args.context or 20 + 3 * i)] for i in range(top)]
    if not args.skip_hf:
        results["transformers_tps"], _ = hf_generate(big, torch.bfloat16, prompts, args.tokens, args.rounds)
        save()
    if args.baseline_json:
        results["compiled_transformers"] = json.loads(args.baseline_json.read_text())["compiled_transformers"]
    elif not args.skip_compiled:
        results["compiled_transformers"] = hf_compiled(big, torch.bfloat16, prompts[:concurrency[0]], args.tokens,
                                                       args.rounds)
        save()
    tbps = args.hbm_tbps or next((v for k, v in HBM_TBPS.items() if k in results["device"]), 0.0)
    if tbps:
        results["hbm_tbps"] = tbps
        results["read_gb_per_token"] = round(read_bytes_per_token(big) / 1e9, 2)
        results["hbm_limit_tps"] = round(hbm_limit_tps(big, tbps), 1)
    for s in (int(x) for x in args.stages.split(",") if args.stages != "none"):
        for graphs in args.graphs.split(","):
            name = (f"mesh{s}" + ("" if graphs == "on" else "-eager") + ("-spread" if args.spread and s > 1 else "")
                    + args.label)
            env = {i: {"CUDA_VISIBLE_DEVICES": str(i)} for i in range(s)} if args.spread else None
            kv = args.max_kv_mib or kv_mib(prompts, args.tokens, dict(LLAMA3_8B, num_hidden_layers=args.layers))
            seqs = args.max_step_seqs or max(64, top)
            # with --replicas the planner chooses the shape (the dp strategy); else one pipeline over every stage
            controller = ["--dtype", "bfloat16", "--strategy", "dp" if args.replicas else "uniform",
                          "--speculate", str(args.speculate), "--max-requests-per-client", str(max(64, top))]
            if args.replicas:
                controller += ["--replicas", args.replicas]
                name += f"-replicas-{args.replicas}"
            with LocalMesh(s, big, args.work / f"big{s}{graphs}", threads=4, device=DEVICE, stage_env=env,
                           stage_args=("--cuda-graphs", graphs, "--max-kv-mib", str(kv), "--max-step-seqs", str(seqs)),
                           controller_args=tuple(controller)) as mesh:
                r = results[name] = mesh_rates(mesh.controller_address, prompts, args.tokens, args.rounds,
                                               concurrency, mesh.stage_addresses)
                r["plan"] = plan_shape(mesh, big, (args.context or 20) + args.tokens // 2, concurrency)
                print("plan", r["plan"], flush=True)
                r["max_kv_mib"], r["max_step_seqs"] = kv, seqs
            if tbps:
                r["one_stream_of_hbm_limit"] = round(r["one_stream_tps"] / results["hbm_limit_tps"], 3)
            if results.get("transformers_tps"):
                r["one_stream_vs_transformers"] = round(r["one_stream_tps"] / results["transformers_tps"], 2)
            ct = results.get("compiled_transformers")
            if ct:
                r["one_stream_vs_compiled"] = round(r["one_stream_tps"] / ct["one_stream_tps"], 2)
                key = f"batch{concurrency[0]}_tps"
                r["concurrent_vs_compiled_batch"] = round(r["concurrent_tps"] / ct[key], 2)
                r["concurrent_vs_compiled_batch_by_round"] = [round(x["concurrent_tps"] / ct[key], 2)
                                                              for x in r["rounds"]]
            save()


if __name__ == "__main__":
    main()
