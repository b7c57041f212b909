"""Device check of sliding windows held on a CUDA stage (issue 37 item 3): tiny random checkpoints of the
sliding-window families (Mistral: every layer slides; Qwen2 past max_window_layers, Gemma 2, Gemma 3 and
gpt-oss: sliding and full layers, the window layers in a pool of their own), each loaded as a stage loads
it (`loading.load_shard`: batch-invariant kernels, the fused layer loop where the layers are plain, CUDA
graphs captured at start-up) with --window-kv off and on, and driven as the runner drives a stage: 4
sequences' prompts one step each, then decode rows of all 4 together, every step that fits a graph bucket
replayed from its CUDA graph. Greedy tokens against transformers' (float32, on the CPU), and the KV blocks
the stage holds at the end.

    python -m bench.gpu_window [--tokens 300] [--window 40] [--families mistral,qwen2,gemma2,gemma3,gpt_oss]

It prints one line per family and mode (off graphs, on graphs, on eager):

    FAMILY window-kv MODE: tokens equal N/4, graph replays R of S steps, KV held K KiB in B blocks
    (window layers W, bound 4 x WindowBlocks.bound), whole contexts C [window, invariant, fused]

(and where a sequence first leaves transformers' tokens, and how many equal those with windows off), and
last `PASS` when, for every family, every mode's tokens equal those with windows off (4/4), the graph modes
replayed their decode steps from graphs, and with windows held the window layers hold at most their bound
(`WindowBlocks.bound` a sequence) while the whole contexts need more; else `FAIL` and the reasons. Agreement
with transformers is printed, not judged: over 300 tokens a tiny random model's near-ties can tip either way.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from logicpipe.stage_node.config import Assignment, StageOptions
from logicpipe.stage_node.engine.kv import step_kv
from logicpipe.stage_node.engine.step_graphs import GraphRow
from logicpipe.stage_node.engine.window import KVGroups, WindowBlocks, managers
from logicpipe.stage_node.weights.loading import load_shard
from tests.families import LAYERS, build, hf_greedy, hf_model

FAMILIES = ["mistral", "qwen2", "gemma2", "gemma3", "gpt_oss"]
MODES = {"off graphs": (False, True), "on graphs": (True, True), "on eager": (True, False)}  # (window_kv, graphs)


def run(path: Path, prompts: list[list[int]], tokens: int, window_kv: bool, graphs: bool, device: str = "cuda") -> dict:
    """The 4 sequences through one stage of every layer -> their tokens, the steps and graph replays, the
    KV blocks held at the end (all pools; the window layers'), and the blocks their whole contexts need."""
    a = Assignment(str(path), 0, LAYERS, LAYERS, 0, 1, "", "", dtype="float32")
    options = StageOptions(max_kv_bytes=64 * 2**20, cuda_graphs=graphs, window_kv=window_kv)
    shard, pool = load_shard(a, str(path), device, options)
    kv = managers(pool.num_blocks, pool.block_size, shard.window, pool.group.num_blocks if pool.group else 0)
    group = pool.group is not None
    ids = {f"s{i}": list(p) for i, p in enumerate(prompts)}
    out = {sid: [] for sid in ids}
    steps = 0

    def step(batch: list[tuple[str, int, list[int]]]) -> torch.Tensor:
        nonlocal steps
        steps += 1
        plans = [kv.prepare_write(sid, start, len(toks), toks) for sid, start, toks in batch]
        pool.copy_plans(plans)
        x = shard.embed(torch.tensor([t for _, _, ts in batch for t in ts], device=device))
        h = None
        if shard.graphs is not None:
            h = shard.graphs.forward(x, [
                GraphRow(start + j, p.slots[j], kv.read_span(sid, start + len(toks)),
                         p.window.slots[j] if group else -1, kv.read_window(sid, start + len(toks)))
                for (sid, start, toks), p in zip(batch, plans) for j in range(len(toks))])
        if h is None:
            slots = torch.tensor([s for p in plans for s in p.slots], device=device)
            h = shard.forward(x, step_kv(pool, shard.window, [
                (start, len(toks), kv.read_span(sid, start + len(toks)), kv.read_window(sid, start + len(toks)),
                 len(prompts[int(sid[1:])])) for sid, start, toks in batch], slots, device,
                window_slots=[s for p in plans for s in p.window.slots] if group else None))
        for sid, start, toks in batch:
            kv.commit(sid, start, toks)
        ends = torch.tensor([sum(len(t) for _, _, t in batch[: k + 1]) - 1 for k in range(len(batch))], device=device)
        return shard.logits(h[ends]).argmax(-1).tolist()

    for sid, p in ids.items():  # each prompt in a step of its own
        kv.open(sid, len(p) + tokens)
        out[sid].append(step([(sid, 0, p)])[0])
    for _ in range(tokens - 1):  # then every sequence's decode row together
        batch = [(sid, len(ids[sid]) + len(out[sid]) - 1, [out[sid][-1]]) for sid in ids]
        for sid, t in zip(ids, step(batch)):
            out[sid].append(t)
    win = kv.group if isinstance(kv, KVGroups) else kv if isinstance(kv, WindowBlocks) else None
    lengths = [kv.tables[sid].length for sid in ids]
    return dict(tokens=[out[sid] for sid in ids], steps=steps,
                replays=shard.graphs.replays if shard.graphs is not None else 0,
                blocks_held=getattr(kv, "main", kv).used + (kv.group.used if isinstance(kv, KVGroups) else 0),
                kv_kib_held=(getattr(kv, "main", kv).used * pool.block_bytes
                             + (kv.group.used * pool.group.block_bytes if isinstance(kv, KVGroups) else 0)) / 1024,
                window_blocks_held=win.used if win is not None else None,
                window_bound=win.bound * len(ids) if win is not None else None,
                whole_context_blocks=sum(-(-n // pool.block_size) for n in lengths),
                window=shard.window, window_layers=len(shard.window_layers) or (LAYERS if shard.window else 0),
                fused=shard.fused_layers, batch_invariant=shard.batch_invariant)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=300, help="greedy tokens a sequence (its context past several windows)")
    ap.add_argument("--window", type=int, default=40, help="the checkpoints' sliding window (positions)")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--work", type=Path, default=None, help="where the checkpoints go (default: a temporary folder)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--device", default="cuda", help="cuda (the check), or cpu (a dry run of the script: no graphs)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_window: needs a CUDA device")
    work = args.work or Path(tempfile.mkdtemp(prefix="lp-window-"))
    prompts = [[(37 * i + 11 * j) % 49000 for j in range(12 + 5 * i)] for i in range(4)]  # 12..27 rows: one bucket
    results, failures = {}, []
    print(f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}: window {args.window}, {args.tokens} tokens x 4 sequences")
    for family in args.families.split(","):
        path = build(family, work / family, sliding_window=args.window)
        ref = hf_model(path)
        want = [hf_greedy(ref, p, args.tokens) for p in prompts]
        results[family] = {}
        unheld = None  # the first mode's tokens (windows not held): what holding them must not change
        for mode, (window_kv, graphs) in MODES.items():
            r = run(path, prompts, args.tokens, window_kv, graphs, args.device)
            got = r.pop("tokens")
            unheld = unheld or got
            equal = sum(g == w for g, w in zip(got, want))
            r["tokens_equal"] = equal
            r["same_as_unheld"] = sum(g == u for g, u in zip(got, unheld))
            # where each sequence first leaves transformers' tokens (None: never)
            r["first_difference"] = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None)
                                     for g, w in zip(got, want)]
            results[family][mode] = r
            print(f"{family:8s} window-kv {mode:10s}: tokens equal {equal}/4 (first differences "
                  f"{r['first_difference']}), the same as windows off {r['same_as_unheld']}/4, graph replays {r['replays']} of "
                  f"{r['steps']} steps, KV held {r['kv_kib_held']:.0f} KiB in {r['blocks_held']} blocks (window layers "
                  f"{r['window_blocks_held']}, bound {r['window_bound']}), whole contexts {r['whole_context_blocks']}"
                  f" [window {r['window']} on {r['window_layers']} layers, invariant {r['batch_invariant']}, "
                  f"fused {r['fused']}]", flush=True)
            if r["same_as_unheld"] != 4:
                failures.append(f"{family} {mode}: {r['same_as_unheld']}/4 sequences equal those with windows off")
            if equal != 4:  # reported; held windows are judged against windows off, above
                print(f"  ({family} {mode}: {equal}/4 sequences equal transformers')")
            if graphs and args.device == "cuda" and r["replays"] < args.tokens - 1:
                failures.append(f"{family} {mode}: {r['replays']} graph replays, fewer than the decode steps")
            if window_kv and (r["window"] != args.window or r["window_blocks_held"] > r["window_bound"]
                              or r["window_blocks_held"] >= r["whole_context_blocks"]):
                failures.append(f"{family} {mode}: windows not held ({r})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print("PASS" if not failures else "FAIL\n" + "\n".join(failures))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
