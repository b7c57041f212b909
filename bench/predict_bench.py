"""Predicted vs measured decode step time: does the planner's round model (`planner/cost.py`,
"Decode rounds") predict what a real mesh does?

For each shape (one pipeline of S stages: `--stages 1,2,3`) and each concurrency C
(`--concurrency 1,4,8`) it starts a LocalMesh (one pipeline over all S stages: --replicas 1
--strategy uniform --speculate 0), warms it up with a round of C requests (the controller learns
the workload and may re-plan its micro-batches then), and runs `--rounds` rounds of C concurrent
greedy requests (ignore_eos, `--tokens` new tokens each, prompts of `--context` tokens). In each
round it reads every stage's Status twice *during decode* (once every request has its first tokens,
and again before the first one ends: prefill is outside the window) and takes, per stage:

  measured step ms   = delta compute_s / delta steps    (the runner's time per step)
  wall ms per step   = window seconds / delta steps      (the stage's step period, idle included)
  rows per step      = delta tokens / delta steps
  measured CPU ms    = delta CPU time of the stage process (/proc, all threads) / delta steps
                       (unlike the wall time, not inflated when other work takes the cores)
  measured tok/s     = delta tokens of the last stage / window seconds   (steady decode)

and the planner's prediction for the same stages: DeviceProfiles built the controller's way
(`controller.planning.device_profile` from each stage's Status, with the links the controller
measured: recovered exactly from the plan in force, whose node digests cover them; if that fails,
the plan's transfer_s is taken as the hop's latency and the bench says so), the ModelSpec
(`controller.planning.model_spec`), the layer split of the plan in force, the controller's
micro-batches, the measured rows per micro-batch step (fractional rows interpolated between
ceil and floor) and the window's mean context:

  predicted t_i      = `planner.cost.step_times_s` (roofline compute + hop + step overhead), with
                       its parts: roofline compute, transfer, overhead
  predicted tok/s    = C / round_s, round_s = max(m * max_i t_i, sum_i t_i) (`compose_round_s`)
                       at the rows as run; also the planner's own figure
                       (`pipeline_tokens_per_s` at R = C, m micro-batches, rows ceil(C / m))

Ratios are measured / predicted (above 1: the model is optimistic). The table sets the measured
compute ms against t_i and against its roofline part alone (compute_s excludes the hop and the host
work outside the runner); the JSON's "ring" sets the part of a round outside the runners against
the predicted hops + overheads, and tok/s is the round's check.

    python -m bench.predict_bench                                     # CPU, default model, 1 thread a stage
    python -m bench.predict_bench --stages 1,2,3 --concurrency 1,4,8 --tokens 64 --context 100 \\
        --threads 1 --rounds 3 --json predict.json
    python -m bench.predict_bench --device cuda --model-shape 8b --work /tmp/lp-predict --spread \\
        --stages 1,2,3 --concurrency 1,8,32 --tokens 128 --context 512 --rounds 3 \\
        --json $OUT/predict_gpu.json                  # on a GPU machine of 3+ GPUs (stage i on GPU i)
    python -m bench.predict_bench --fit a.json b.json  # the table and fit of runs made apart

Without --spread every stage runs on GPU 0 (they share it only when the planner runs more than one
micro-batch). After the table it prints a fit of every stage's measured time as a + L * layers +
H * [last stage] per concurrency (needs shapes 1, 2 and 3), beside the model's step overhead,
`layer_time_s` and `head_time_s`: which term is off.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from bench.engine_bench import FILLER, submit
from logicpipe.common.modeldir import ModelConfig
from logicpipe.common.transport import CHANNEL_OPTIONS
from logicpipe.controller.mesh import planning
from logicpipe.planner import cost
from logicpipe.planner.digest import canonical_json, profile_dict
from logicpipe.planner.types import Link
from logicpipe.v1 import controller_pb2, controller_pb2_grpc, stage_pb2, stage_pb2_grpc
from tests.localmesh import LocalMesh

FIRST_TOKENS = 3   # the window opens once every request has this many tokens (its prefill is done)
END_MARGIN = 3     # ... and closes when the first request is this many tokens from its end


# ------------------------------------------------------------------ the stages' and controller's view

def stage_statuses(addresses: list[str]) -> list:
    out = []
    for a in addresses:
        with grpc.insecure_channel(a) as ch:
            out.append(stage_pb2_grpc.StageNodeStub(ch).Status(stage_pb2.StatusRequest(), timeout=10))
    return out


def _grid() -> tuple[list[float], list[float]]:
    """The values `planning.bucket` can give links: half-octaves, 4 significant digits."""
    bws = [planning.bucket(2 ** (k / 2)) for k in range(110)]        # 1 B/s .. 3e16 B/s
    lats = [planning.bucket(2 ** (k / 2)) for k in range(-70, 8)]        # 3e-11 s .. 16 s
    return bws, lats


def _digest(d: dict) -> str:
    return hashlib.sha256(canonical_json(d).encode("ascii")).hexdigest()


def recover_links(statuses: list, pipeline: dict, spec, digests: dict[str, str]) -> tuple[list, str]:
    """The DeviceProfiles the controller planned with, in pipeline order, and how their links were
    found. Each stage's transfer_s in the plan fixes the link to its successor (to stage 0 for the
    last) up to a few grid pairs; the node's digest in the plan's metadata then fixes every link
    (a search over the grid `planning.bucket` rounds to). "approx" when that fails: the link to
    the successor is taken as latency = the plan's transfer_s, bandwidth unbounded."""
    by_id = {s.node_id: s for s in statuses}
    order = [st["node_id"] for st in pipeline["stages"]]
    work = pipeline["metadata"]["workload"]
    t = work["tokens_per_step"]
    base = {n: planning.device_profile(by_id[n], {}, spec) for n in order}
    bws, lats = _grid()
    out, how = [], "recovered"
    for i, n in enumerate(order):
        nxt = order[(i + 1) % len(order)]
        target = pipeline["stages"][i]["transfer_s"]
        if len(order) == 1:
            out.append(base[n])
            continue
        if i == len(order) - 1:
            per_byte = t * cost.TOKEN_ID_BYTES
        else:
            per_byte = cost.wire_scale(base[n], base[nxt], spec) * t * spec.activation_bytes_per_token
        cands = []
        for bw in bws:
            lat = target - per_byte / bw
            if lat <= 0:
                continue
            lat = planning.bucket(lat)
            if per_byte / bw + lat == target:
                cands.append(Link(bandwidth=bw, latency=lat))
        others = [o for o in order if o not in (n, nxt)]
        found = None
        for link in cands:
            if found:
                break
            if not others:
                p = dataclasses.replace(base[n], links={nxt: link})
                if _digest(profile_dict(p)) == digests.get(n):
                    found = p
                continue
            # one more node in a 3-stage ring; a full grid search beyond that is too long: skip
            if len(others) > 1:
                break
            d = profile_dict(dataclasses.replace(base[n], links={nxt: link, others[0]: Link(1.0, 1.0)}))
            pos = next(j for j, (o, _) in enumerate(d["links"]) if o == others[0])
            for bw in bws:
                for lat in lats:
                    d["links"][pos] = [others[0], {"bandwidth": bw, "latency": lat}]
                    if _digest(d) == digests.get(n):
                        found = dataclasses.replace(base[n], links={nxt: link, others[0]: Link(bw, lat)})
                        break
                if found:
                    break
        if found is None:
            how = "approx"
            found = dataclasses.replace(base[n], links={nxt: Link(bandwidth=1e15, latency=target)})
        out.append(found)
    return out, how


def controller_view(mesh: LocalMesh) -> tuple[dict, int, int]:
    """(the plan in force's pipeline 0 as JSON, micro-batches, plan generation)."""
    st = mesh.controller_status()
    plan = json.loads(st.plan_json)
    pipe = plan["pipelines"][0] if "pipelines" in plan else plan
    mb = st.pipelines[0].micro_batches if st.pipelines else st.micro_batches
    return {"plan": pipe, "digests": pipe["metadata"]["node_digests"]}, mb or 1, st.plan_generation


# ---------------------------------------------------------------------------- one measured round

def cpu_seconds(pids: list[int]) -> list[float]:
    """CPU seconds (user + system, every thread) each process has used: unlike the wall time a
    stage reports, not inflated when other processes take the cores."""
    import os

    tick = os.sysconf("SC_CLK_TCK")
    out = []
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            out.append((int(fields[11]) + int(fields[12])) / tick)
        except (OSError, IndexError, ValueError):
            out.append(float("nan"))
    return out


def run_round(addr: str, prompts: list[list[int]], tokens: int, stages: list[str], pids: list[int] | None = None) -> dict:
    """C concurrent requests; two Status reads inside their common decode phase."""
    pids = pids or []
    counts = [0] * len(prompts)
    errors: list[str] = []

    def one(i: int) -> None:
        req = controller_pb2.SubmitRequest(prompt_token_ids=prompts[i], max_tokens=tokens, ignore_eos=True)
        with grpc.insecure_channel(addr, options=CHANNEL_OPTIONS) as ch:
            try:
                for reply in controller_pb2_grpc.ControllerStub(ch).Submit(req, timeout=1800):
                    counts[i] += len(reply.token_ids)
            except grpc.RpcError as exc:
                errors.append(f"{exc.code().name}: {exc.details()}")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for th in threads:
        th.start()
    a = b = None
    while any(th.is_alive() for th in threads):
        if a is None and min(counts) >= FIRST_TOKENS:
            a = (time.perf_counter(), list(counts), stage_statuses(stages), cpu_seconds(pids))
        elif a is not None and b is None and max(counts) >= tokens - END_MARGIN:
            b = (time.perf_counter(), list(counts), stage_statuses(stages), cpu_seconds(pids))
        time.sleep(0.003)
    wall = time.perf_counter() - t0
    for th in threads:
        th.join()
    if errors or any(c != tokens for c in counts):
        raise RuntimeError(f"requests failed: {errors[:2]} counts {counts}")
    if a is None or b is None:
        raise RuntimeError("no decode window (too few tokens: raise --tokens)")
    (ta, ca, sa, pa), (tb, cb, sb, pb) = a, b
    window = tb - ta
    steps = [y.steps - x.steps for x, y in zip(sa, sb)]
    return {
        "window_s": window, "e2e_tps": len(prompts) * tokens / wall,
        "window_tps": (sb[-1].tokens - sa[-1].tokens) / window,
        "steps": steps,
        "compute_ms": [(y.compute_s - x.compute_s) / max(1, n) * 1e3 for x, y, n in zip(sa, sb, steps)],
        "wall_ms_per_step": [window / max(1, n) * 1e3 for n in steps],
        "rows": [(y.tokens - x.tokens) / max(1, n) for x, y, n in zip(sa, sb, steps)],
        "busy": [(y.compute_s - x.compute_s) / window for x, y in zip(sa, sb)],
        # the stage process's CPU time per step (all its threads: runner, event loop, gRPC)
        "cpu_ms": [(y - x) / max(1, n) * 1e3 for x, y, n in zip(pa, pb, steps)],
        # mean KV positions a row reads in the window: its prompt + the tokens it has so far
        "context": statistics.mean(len(p) for p in prompts) + (statistics.mean(ca) + statistics.mean(cb)) / 2,
        "micro_batches_stage0": sb[0].micro_batches,
    }


# ------------------------------------------------------------------------------- the prediction

def _interp(f, r: float):
    """f at fractional rows r: linear between floor and ceil (the model is piecewise linear in r)."""
    lo, hi = max(1, math.floor(r)), max(1, math.ceil(r))
    a, b = f(lo), f(hi)
    w = r - lo if hi > lo else 0.0
    return [x + (y - x) * w for x, y in zip(a, b)]


def predict(profiles, counts, spec, rows: float, context: float, concurrency: int, m: int) -> dict:
    ctx = max(1, round(context))

    def parts(r: int) -> list[float]:
        st = cost.build_stages(profiles, counts, spec, cost.micro_workload(r, ctx))
        return ([s.compute_s for s in st] + [s.transfer_s for s in st]
                + [cost.step_overhead_s(p) for p in profiles] + cost.step_times_s(profiles, counts, spec, r, ctx))

    n = len(profiles)
    v = _interp(parts, rows)
    comp, xfer, over, t = v[:n], v[n:2 * n], v[2 * n:3 * n], v[3 * n:]
    m_run = max(1, min(n, round(concurrency / max(rows, 1e-9))))  # micro-batches in flight as run
    round_s = cost.compose_round_s(t, m_run)
    return {"compute_ms": [x * 1e3 for x in comp], "transfer_ms": [x * 1e3 for x in xfer],
            "overhead_ms": [x * 1e3 for x in over], "step_ms": [x * 1e3 for x in t],
            "micro_batches_as_run": m_run, "round_ms": round_s * 1e3, "tps": concurrency / round_s,
            "planner_tps": cost.pipeline_tokens_per_s(profiles, counts, spec, concurrency, ctx,
                                                      min(m, n, concurrency))}


# ------------------------------------------------------------------------------------ the bench

def make_prompts(args, model_dir: Path, top: int) -> list[list[int]]:
    if args.model_shape == "8b":
        return [[(31 * i + 7 * j) % 128000 for j in range(args.context)] for i in range(top)]
    from transformers import AutoTokenizer

    pool = AutoTokenizer.from_pretrained(model_dir)(FILLER * 60, add_special_tokens=False)["input_ids"]
    return [pool[(i * 37) % 500: (i * 37) % 500 + args.context] for i in range(top)]


def bench_shape(args, model_dir: Path, spec_dtype: str, s: int, work: Path, prompts: list[list[int]]) -> list[dict]:
    top = max(args.concurrency)
    controller = ["--replicas", "1", "--strategy", "uniform", "--speculate", "0", "--dtype", spec_dtype,
                  "--max-requests-per-client", str(max(64, top))]
    stage_args: list[str] = []
    env = None
    if args.device == "cuda":
        from bench.gpu_engine import LLAMA3_8B, kv_mib

        shape = dict(LLAMA3_8B, num_hidden_layers=args.layers) if args.model_shape == "8b" else None
        if shape:
            stage_args += ["--max-kv-mib", str(kv_mib(prompts, args.tokens, shape))]
        stage_args += ["--max-step-seqs", str(max(64, top)), "--cuda-graphs", args.graphs]
        if args.spread:
            env = {i: {"CUDA_VISIBLE_DEVICES": str(i)} for i in range(s)}
    rows_out = []
    with LocalMesh(s, model_dir, work / f"s{s}", threads=args.threads, device=args.device, stage_env=env,
                   controller_args=tuple(controller), stage_args=tuple(stage_args)) as mesh:
        addr = mesh.controller_address
        config = ModelConfig.from_dir(model_dir)
        submit(addr, ids=prompts[0], tokens=4)  # warm-up
        for c in args.concurrency:
            # a warm-up round at this concurrency: the controller learns the workload (and may re-plan)
            with ThreadPoolExecutor(c) as pool:
                list(pool.map(lambda p: submit(addr, ids=p, tokens=8), prompts[:c]))
            mesh.wait_plan(stages=s)
            rounds = []
            for _ in range(args.rounds):
                view, _, gen = controller_view(mesh)
                r = run_round(addr, prompts[:c], args.tokens, mesh.stage_addresses,
                              [mesh.procs[f"stage{i}"].pid for i in range(s)])
                _, mb2, gen2 = controller_view(mesh)
                r["micro_batches"], r["replanned"] = mb2, gen2 != gen
                rounds.append(r)
                print(f"{s} stage(s), C={c}: window {r['window_s']:.2f} s, {r['window_tps']:.1f} tok/s, "
                      f"compute ms {[round(x, 2) for x in r['compute_ms']]}, rows {[round(x, 2) for x in r['rows']]}, "
                      f"m {mb2}{' (re-planned)' if r['replanned'] else ''}", file=sys.stderr, flush=True)
            mid = sorted(range(len(rounds)), key=lambda i: rounds[i]["window_tps"])[len(rounds) // 2]
            meas = rounds[mid]
            pipe = view["plan"]
            spec = planning.model_spec(config, model_dir.name, pipe["metadata"]["model_digest"], spec_dtype)
            statuses = stage_statuses(mesh.stage_addresses)
            profiles, how = recover_links(statuses, pipe, spec, view["digests"])
            counts = [st["end"] - st["start"] for st in pipe["stages"]]
            pred = predict(profiles, counts, spec, meas["rows"][0], meas["context"], c, meas["micro_batches"])
            row = {
                "stages": s, "concurrency": c, "context": round(meas["context"], 1), "links": how,
                "micro_batches": meas["micro_batches"], "micro_batches_as_run": pred["micro_batches_as_run"],
                "rows_per_step": [round(x, 2) for x in meas["rows"]],
                "layers": counts,
                "profile": [{"flops": p.flops, "mem_bandwidth": p.mem_bandwidth, "weight_bandwidth": p.weight_bandwidth,
                             "step_overhead_s": cost.step_overhead_s(p),
                             "links": {k: dataclasses.asdict(v) for k, v in p.links}} for p in profiles],
                "predicted": {k: ([round(x, 3) for x in v] if isinstance(v, list) else round(v, 3)) for k, v in pred.items()},
                "measured": {
                    "compute_ms": [round(x, 3) for x in meas["compute_ms"]],
                    "wall_ms_per_step": [round(x, 3) for x in meas["wall_ms_per_step"]],
                    "cpu_ms": [round(x, 3) for x in meas["cpu_ms"]],
                    "rounds_cpu_ms": [[round(v, 2) for v in x["cpu_ms"]] for x in rounds],
                    "busy": [round(x, 3) for x in meas["busy"]],
                    "window_tps": round(meas["window_tps"], 2), "e2e_tps": round(meas["e2e_tps"], 2),
                    "rounds_window_tps": [round(x["window_tps"], 2) for x in rounds],
                    "rounds_compute_ms": [[round(v, 2) for v in x["compute_ms"]] for x in rounds],
                    "replanned": any(x["replanned"] for x in rounds),
                },
            }
            # the time of a round outside the runners (hops, host work of the engines): measured
            # window / steps of stage 0 times the micro-batches, less the runners' compute, against
            # the predicted hops + overheads
            m_run = pred["micro_batches_as_run"]
            row["ring"] = {"measured_round_ms": round(meas["wall_ms_per_step"][0] * m_run, 3),
                           "measured_outside_compute_ms": round(meas["wall_ms_per_step"][0] * m_run - sum(meas["compute_ms"]), 3)
                           if m_run == 1 else None,
                           "predicted_round_ms": round(pred["round_ms"], 3),
                           "predicted_hops_and_overheads_ms": round(sum(pred["transfer_ms"]) + sum(pred["overhead_ms"]), 3)}
            # the model's terms at the rows as run, for the fit (see `fit_terms`)
            wl = cost.micro_workload(max(1, round(meas["rows"][0])), max(1, round(meas["context"])))
            row["terms_predicted_ms"] = {
                "layer": round(cost.layer_time_s(profiles[0], spec, wl) * 1e3, 4),
                "head": round(cost.head_time_s(profiles[-1], spec, wl) * 1e3, 4),
                "head_at_weight_bandwidth": round(cost.float_scale(profiles[-1], spec) * spec.lm_head_bytes
                                                  / (profiles[-1].weight_bandwidth or profiles[-1].mem_bandwidth) * 1e3, 4),
                "embed": round(cost.embed_time_s(profiles[0], spec, wl) * 1e3, 4),
                "overhead": round(cost.step_overhead_s(profiles[0]) * 1e3, 4)}
            row["ratio"] = {
                # measured / predicted; above 1: the model is optimistic
                "compute_vs_roofline": [round(a / b, 2) for a, b in zip(meas["compute_ms"], pred["compute_ms"])],
                "compute_vs_step": [round(a / b, 2) for a, b in zip(meas["compute_ms"], pred["step_ms"])],
                "wall_vs_step": [round(a / b, 2) for a, b in zip(meas["wall_ms_per_step"], pred["step_ms"])],
                "tps": round(meas["window_tps"] / pred["tps"], 2),
                "tps_vs_planner": round(meas["window_tps"] / pred["planner_tps"], 2),
            }
            rows_out.append(row)
    return rows_out


def fit_terms(rows: list[dict], key: str = "compute_ms") -> dict:
    """Per concurrency, the measured compute ms of every stage of every shape fitted (least squares)
    as a + L * layers + H * [last stage]: a per-step constant, a per-layer time and the LM head's
    time, to set beside the model's terms (overhead, layer_time_s, head_time_s). Needs three or more
    distinct (layers, last) stages: shapes 1, 2, 3."""
    import numpy as np

    out = {}
    for c in sorted({r["concurrency"] for r in rows}):
        pts = [(r["layers"][i], 1.0 if i == r["stages"] - 1 else 0.0, r["measured"][key][i])
               for r in rows if r["concurrency"] == c for i in range(r["stages"])]
        pts = [p for p in pts if math.isfinite(p[2])]
        if len({(n, h) for n, h, _ in pts}) < 3:
            continue
        a = np.array([[1.0, n, h] for n, h, _ in pts])
        y = np.array([t for _, _, t in pts])
        (k, per_layer, head), *_ = np.linalg.lstsq(a, y, rcond=None)
        resid = y - a @ np.array([k, per_layer, head])
        pred = next(r["terms_predicted_ms"] for r in rows if r["concurrency"] == c)
        out[str(c)] = {"per_step_ms": round(float(k), 2), "per_layer_ms": round(float(per_layer), 3),
                       "head_ms": round(float(head), 2), "max_residual_ms": round(float(abs(resid).max()), 2),
                       "points": len(pts), "predicted": pred}
    return out


def fit_table(fit: dict) -> str:
    out = [("| C (rows) | per-step constant ms: fit / model (overhead) | per layer ms: fit / model | "
            "LM head ms: fit / model (at weight rate) | max residual ms |"), "|---|---|---|---|---|"]
    for c, f in fit.items():
        p = f["predicted"]
        out.append(f"| {c} | {f['per_step_ms']:.1f} / {p['overhead'] + p['embed']:.2f} | {f['per_layer_ms']:.2f} / "
                   f"{p['layer']:.2f} | {f['head_ms']:.1f} / {p['head']:.1f} ({p['head_at_weight_bandwidth']:.1f}) | "
                   f"{f['max_residual_ms']:.1f} |")
    return "\n".join(out)


def table(rows: list[dict]) -> str:
    head = ("| stages | C | m | rows | stage | pred compute ms | pred step ms (comp+hop+ovh) | meas compute ms | "
            "meas/pred compute | meas/pred step | meas CPU ms | pred tok/s | meas tok/s | meas/pred tok/s |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        p, m, q = r["predicted"], r["measured"], r["ratio"]
        for i in range(r["stages"]):
            first = i == 0
            out.append("| " + " | ".join([
                str(r["stages"]) if first else "", str(r["concurrency"]) if first else "",
                str(r["micro_batches_as_run"]) if first else "", f"{r['rows_per_step'][i]:.2f}", str(i),
                f"{p['compute_ms'][i]:.2f}",
                f"{p['step_ms'][i]:.2f} ({p['compute_ms'][i]:.2f}+{p['transfer_ms'][i]:.2f}+{p['overhead_ms'][i]:.2f})",
                f"{m['compute_ms'][i]:.2f}", f"{q['compute_vs_roofline'][i]:.2f}", f"{q['compute_vs_step'][i]:.2f}",
                f"{m['cpu_ms'][i]:.2f}",
                f"{p['tps']:.1f}" if first else "", f"{m['window_tps']:.1f}" if first else "",
                f"{q['tps']:.2f}" if first else ""]) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", default="1,2,3", help="comma list of pipeline depths")
    ap.add_argument("--concurrency", default="1,4,8", help="comma list of concurrent requests")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--context", type=int, default=100, help="prompt tokens per request")
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds per concurrency (the median is kept)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads per stage (default: cpu 1, cuda 4)")
    ap.add_argument("--model", default=None, help="model dir (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--model-shape", default="", choices=["", "8b"],
                    help="8b: a Llama-3-8B-shaped random bf16 model (bench.gpu_engine.make_model), made under --work")
    ap.add_argument("--layers", type=int, default=32, help="--model-shape 8b: its decoder layers")
    ap.add_argument("--work", type=Path, default=Path("/tmp/lp-predict"), help="--model-shape 8b: where the model is kept")
    ap.add_argument("--dtype", default="", help="the controller's --dtype (default: cpu float32, cuda bfloat16)")
    ap.add_argument("--spread", action="store_true", help="cuda: stage i on GPU i (else all on GPU 0)")
    ap.add_argument("--graphs", default="on", help="cuda: the stages' --cuda-graphs")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--fit", type=Path, nargs="+", default=None, metavar="JSON",
                    help="run nothing: print the table and the fit of these earlier --json files together "
                         "(e.g. --stages 1,2 and --stages 3 run apart)")
    args = ap.parse_args()
    if args.fit:
        rows = [r for f in args.fit for r in json.loads(f.read_text())["rows"]]
        print(table(rows))
        print("\nrunner compute ms (Status compute_s):\n" + fit_table(fit_terms(rows))
              + "\n\nstage process CPU ms (all threads):\n" + fit_table(fit_terms(rows, "cpu_ms")))
        return
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.threads = args.threads or (1 if args.device == "cpu" else 4)
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    if args.model_shape == "8b":
        import torch

        from bench import gpu_engine
        from bench.gpu_engine import LLAMA3_8B, make_model

        gpu_engine.DEVICE = args.device
        model_dir = make_model(args.work / f"llama3-8b-shape-{args.layers}", dict(LLAMA3_8B, num_hidden_layers=args.layers),
                               torch.bfloat16)
    elif args.model:
        model_dir = Path(args.model)
    else:
        from logicpipe.controller.cli.model_prep import prepare_default_model

        model_dir = prepare_default_model()
    prompts = make_prompts(args, model_dir, max(args.concurrency))
    results: dict = {"device": args.device, "model": model_dir.name, "threads": args.threads, "dtype": dtype,
                     "tokens": args.tokens, "prompt_tokens": args.context, "argv": sys.argv[1:], "rows": []}
    try:
        import os
        results["loadavg_before"] = os.getloadavg()
    except OSError:
        pass
    with tempfile.TemporaryDirectory() as tmp:
        for s in (int(x) for x in args.stages.split(",")):
            results["rows"].extend(bench_shape(args, model_dir, dtype, s, Path(tmp), prompts))
            if args.json:
                args.json.write_text(json.dumps(results, indent=2))
    try:
        import os
        results["loadavg_after"] = os.getloadavg()
    except OSError:
        pass
    results["table"] = table(results["rows"])
    results["fit"] = fit_terms(results["rows"])
    results["fit_cpu"] = fit_terms(results["rows"], "cpu_ms")
    results["fit_table"] = ("runner compute ms (Status compute_s):\n" + fit_table(results["fit"])
                            + "\n\nstage process CPU ms (all threads):\n" + fit_table(results["fit_cpu"]))
    print(results["table"])
    print()
    print(results["fit_table"])
    print(json.dumps({k: v for k, v in results.items() if k not in ("table", "fit_table", "rows")}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
