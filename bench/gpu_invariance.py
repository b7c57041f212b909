"""Batch invariance on CUDA (issue 22, item 4), on the GPU machine:

    python -m bench.gpu_invariance --out $OUT                   # kernel checks, small model, 8B-shaped mesh
    python -m bench.gpu_invariance --part kernels,tiles,sweep   # the kernels only, tiles, the tile sweep

`kernels` (device-only checks of stage_node.invariant; no CI machine has a GPU):
  * the product: for each matrix of a Llama-3-8B layer, the LM head and a float32 one, every row of
    `mm(x[a:a + M])` equals (bit for bit) the same row of `mm(x)` for M from 1 to 512 and several
    offsets a; its distance to torch's product in float32, against cuBLAS's own distance; and how
    many row counts change cuBLAS's bits (the problem this solves);
  * attention: a sequence's rows as one prompt (tiles of several rows), one by one (a graph's tiles),
    with a longer padded slot table, and among other sequences give the same bits, also with a
    sliding window and soft-capping; distance to SDPA in float32;
  * torch's RMSNorm: a row's bits in batches of 1 to 512 rows (the kernels keep torch's norm);
  * speed: each 8B matrix at 1, 8, 32 and 512 rows, the invariant product against cuBLAS (CUDA
    graphs of 20 products, so launch costs are out), and decode attention at 1 and 8 rows.
`tiles`: other tile sizes of the product (16 to 128 rows, 32 to 256 columns, 64 to 256 of K, the same
parts of K) give the same bits as mm_config's, and their time at 512 rows (how the prompt tiles
were chosen). `sweep`: tile configurations at 1 and 8 rows per 8B matrix (how the decode tile was).
`mesh`: the Llama-3-8B-shaped model with random bf16 weights (bench.gpu_engine.make_model), one
CUDA stage, graphs on, candidates off, with `--batch-invariant on` and `off` in turn: each of 8
prompts alone and among the 8 sent at once, 64 greedy tokens, how many lead alike; a 3,000-token
prompt alone and among 7 others (32 tokens; its prefill runs eagerly, its attention in splits); a replay (the
prompt and the first 32 generated tokens as a new prompt) against the last 32; and one stream's
and 8 concurrent streams' tok/s (bench.gpu_engine.mesh_rates). `small`: the small float32 Llama of
bench.gpu_engine through one CUDA stage with the kernels on must give transformers' greedy tokens.

Prints a markdown table and the JSON (also written to OUT/gpu_invariance.json).
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

from bench import gpu_engine
from bench.engine_bench import submit
from bench.gpu_engine import LLAMA3_8B, SMALL, hf_generate, make_model, mesh_rates
from logicpipe.stage_node.kernels import invariant
from tests.localmesh import LocalMesh

SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
             "lm_head": (128256, 4096)}
ROW_COUNTS = (1, 2, 3, 5, 8, 13, 16, 17, 31, 32, 33, 64, 100, 128, 512)


def graph_time_us(fn, reps: int = 20, rounds: int = 5) -> float:
    """Median µs of one fn() call, replayed from a CUDA graph of `reps` calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / reps)
    del g
    return sorted(times)[len(times) // 2]


# ---- the product ---------------------------------------------------------------------------------
def check_mm(results: dict) -> None:
    torch.manual_seed(0)
    out = results["mm"] = {}
    cases = [(name, n, k, torch.bfloat16) for name, (n, k) in SHAPES_8B.items()]
    cases += [("odd_bf16", 1000, 2200, torch.bfloat16), ("fp32", 1024, 2048, torch.float32)]  # tails of N and K
    for name, n, k, dtype in cases:
        w = torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5
        x = torch.randn(600, k, device="cuda", dtype=dtype)
        full = invariant.mm(x, w)
        ref = x.double() @ w.double().T
        cublas = F.linear(x, w)
        scale = ref.abs().max().item()
        mismatched_rows, cublas_changed = 0, []
        for m in ROW_COUNTS:
            for a in (0, 1, 600 - m):
                got = invariant.mm(x[a: a + m].clone(), w)
                mismatched_rows += int((got != full[a: a + m]).any(dim=1).sum())
                if not torch.equal(F.linear(x[a: a + m].clone(), w), cublas[a: a + m]):
                    cublas_changed.append(m)
        out[name] = {"n": n, "k": k, "dtype": str(dtype).removeprefix("torch."),
                     "configs_1_64_512_rows": [invariant.mm_config(n, k, dtype, m) for m in (1, 64, 512)],
                     "rows_unequal_across_counts": mismatched_rows,
                     "max_err_vs_fp64_rel": round((full.double() - ref).abs().max().item() / scale, 6),
                     "cublas_max_err_vs_fp64_rel": round((cublas.double() - ref).abs().max().item() / scale, 6),
                     "cublas_row_counts_that_change_bits": sorted(set(cublas_changed))}
        print(name, out[name], flush=True)


def speed_mm(results: dict) -> None:
    out = results["mm_speed"] = {}
    for name, (n, k) in SHAPES_8B.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in (1, 8, 32, 512):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ours = graph_time_us(lambda: invariant.mm(x, w))
            theirs = graph_time_us(lambda: F.linear(x, w))
            gbs = n * k * 2 / ours / 1e3
            out[f"{name}_m{m}"] = {"invariant_us": round(ours, 1), "cublas_us": round(theirs, 1),
                                   "ratio": round(ours / theirs, 2), "invariant_weight_gbs": round(gbs)}
            print(name, m, out[f"{name}_m{m}"], flush=True)


def check_tile_configs(results: dict) -> None:
    """Do other tile sizes (the same parts of K) give the same bits as mm_config's? And their speed
    with many rows (a prompt)."""
    torch.manual_seed(3)
    out = results["tile_configs"] = {}
    for name, (n, k) in SHAPES_8B.items():
        if name == "lm_head":
            continue
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        x = torch.randn(600, k, device="cuda", dtype=torch.bfloat16)
        base_cfg = invariant.mm_config(n, k, torch.bfloat16)
        p = base_cfg[5]
        base = invariant.mm(x, w)
        x512 = x[:512].clone()
        rows = {"default": base_cfg, "cublas_m512_us": round(graph_time_us(lambda: F.linear(x512, w), reps=5), 1),
                "default_m512_us": round(graph_time_us(lambda: invariant.mm(x512, w), reps=5), 1)}
        for cfg in [(32, 32, 128, 4, 5, p), (64, 32, 128, 4, 4, p), (16, 32, 64, 4, 5, p), (16, 32, 256, 4, 3, p),
                    (64, 64, 64, 4, 4, p), (128, 64, 64, 4, 3, p), (64, 128, 64, 4, 3, p), (128, 128, 64, 8, 3, p),
                    (128, 256, 64, 8, 3, p), (128, 128, 128, 8, 3, p)]:
            try:
                same = torch.equal(invariant.mm(x, w, cfg), base)
                t = graph_time_us(lambda: invariant.mm(x512, w, cfg), reps=5)
            except Exception as exc:  # noqa: BLE001
                rows[str(cfg)] = str(exc)[:60]
                continue
            rows[str(cfg)] = {"same_bits": same, "m512_us": round(t, 1)}
        out[name] = rows
        print("tiles", name, json.dumps(rows), flush=True)


def sweep(results: dict) -> None:
    out = results["sweep"] = {}
    configs = [(16, bn, bk, warps, stages, parts) for bn, bk, warps, stages, parts in
               itertools.product((16, 32, 64), (64, 128, 256), (2, 4), (3, 5), (1, 2, 4))
               if not (warps == 2 and bn == 64)]
    for name, (n, k) in SHAPES_8B.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in (1, 8)}
        base = {m: graph_time_us(lambda: F.linear(xs[m], w)) for m in xs}
        rows = []
        for cfg in configs:
            if cfg[5] > 1 and k // cfg[5] < 1024:
                continue
            try:
                t = {m: graph_time_us(lambda: invariant.mm(xs[m], w, cfg), reps=10, rounds=3) for m in xs}
            except Exception as exc:  # noqa: BLE001 — a tile too large for shared memory
                rows.append((cfg, str(exc)[:60]))
                continue
            rows.append((cfg, round(t[1], 1), round(t[8], 1)))
        ok = sorted((r for r in rows if len(r) == 3), key=lambda r: r[1] + r[2])
        out[name] = {"cublas_us": {m: round(v, 1) for m, v in base.items()}, "best": ok[:8],
                     "default": next((r for r in ok if r[0] == invariant.mm_config(n, k, torch.bfloat16)), None)}
        print(name, json.dumps(out[name]), flush=True)


# ---- attention and norms ---------------------------------------------------------------------------
def check_attention(results: dict) -> None:
    torch.manual_seed(1)
    out = results["attention"] = {}
    heads, kvh, hd, bs = 32, 8, 128, 16
    group = heads // kvh
    for dtype, cap, window in ((torch.bfloat16, None, None), (torch.bfloat16, None, 100), (torch.bfloat16, 50.0, None),
                               (torch.float32, None, None)):
        slots_n = 64 * bs + 1
        kp = torch.randn(kvh, slots_n, hd, device="cuda", dtype=dtype)
        vp = torch.randn(kvh, slots_n, hd, device="cuda", dtype=dtype)
        blocks = torch.randperm(64, device="cuda")[:20]
        L = 300
        seq_slots = (blocks[:, None] * bs + torch.arange(bs, device="cuda")).flatten()[:L]
        q = torch.randn(L, heads, hd, device="cuda", dtype=dtype)
        pos = torch.arange(L, device="cuda")
        kw = dict(scale=hd ** -0.5, cap=cap, window=window)
        prompt = invariant.attention(q, kp, vp, seq_slots[None], pos,
                                     invariant.tiles_tensor(invariant.seq_tiles([L], group), "cuda"), **kw)
        # one row a tile, a slot table padded to 1,024 positions (a graph's bucket)
        table = torch.zeros(L, 1024, dtype=torch.long, device="cuda")
        table[:, :L] = seq_slots
        rows = torch.arange(L, dtype=torch.int32, device="cuda")
        one = invariant.attention(q, kp, vp, table, pos, torch.stack([rows, torch.ones_like(rows), rows]), **kw)
        # the sequence's last 7 rows among two other sequences' rows (eager tiles)
        other = torch.randn(9, heads, hd, device="cuda", dtype=dtype)
        mixed_q = torch.cat([other[:4], q[L - 7:], other[4:]])
        mixed_pos = torch.cat([torch.arange(4, device="cuda") + 10, pos[L - 7:], torch.arange(5, device="cuda") + 3])
        tabs = torch.zeros(3, L, dtype=torch.long, device="cuda")
        tabs[0, :14] = seq_slots[50:64]
        tabs[1] = seq_slots
        tabs[2, :8] = seq_slots[100:108]
        tiles = invariant.tiles_tensor(invariant.seq_tiles([4, 7, 5], group), "cuda")  # sequence i: table row i
        mixed = invariant.attention(mixed_q, kp, vp, tabs, mixed_pos, tiles, **kw)
        # reference: SDPA in float32 (the same scores, mask, cap)
        k = kp[:, seq_slots].float().repeat_interleave(group, 0)
        v = vp[:, seq_slots].float().repeat_interleave(group, 0)
        s = q.float().transpose(0, 1) @ k.transpose(1, 2) * kw["scale"]
        if cap:
            s = torch.tanh(s / cap) * cap
        i = torch.arange(L, device="cuda")
        seen = i[None, :] <= i[:, None]
        if window:
            seen &= i[None, :] > i[:, None] - window
        ref = (torch.softmax(s.masked_fill(~seen, float("-inf")), -1) @ v).transpose(0, 1).reshape(L, -1)
        name = f"{str(dtype).removeprefix('torch.')}" + (f"_window{window}" if window else "") + (f"_cap{cap:g}" if cap else "")
        out[name] = {"prompt_vs_one_row_per_tile_equal": torch.equal(prompt, one),
                     "among_other_sequences_equal": torch.equal(mixed.view(16, heads * hd)[4:11], prompt[L - 7:]),
                     "max_err_vs_fp32": round((prompt.float() - ref).abs().max().item(), 5)}
        print("attention", name, out[name], flush=True)


def check_norms(results: dict) -> None:
    from logicpipe.stage_node.model.ops import head_norm, rms_norm

    torch.manual_seed(2)
    out = results["norms"] = {}
    x = torch.randn(600, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    hx = torch.randn(600, 40, 128, device="cuda", dtype=torch.bfloat16)
    hw = torch.randn(40, 128, device="cuda", dtype=torch.bfloat16)
    from logicpipe.stage_node.kernels import fused

    parts = torch.randn(2, 600, 4096, device="cuda")
    gu = torch.randn(600, 2 * 14336, device="cuda", dtype=torch.bfloat16)

    def add_norm(t):  # the fused layers' residual add + norm (stage_node.fused), its two outputs side by side
        a = t.shape[0]
        rows = next(i for i in range(600 - a + 1) if torch.equal(x[i: i + a], t))
        xo, h = fused.add_norm(parts[:, rows: rows + a].contiguous(), t, w, 1e-5)
        return torch.cat([xo, h], 1)

    for name, fn, data in (("rms_norm", lambda t: rms_norm(t, w, 1e-5), x),
                           ("rms_norm_gemma", lambda t: rms_norm(t, w, 1e-6, gemma=True), x),
                           ("head_norm", lambda t: head_norm(t, hw, 1e-6), hx),
                           ("fused_norm", lambda t: fused.add_norm(None, t, w, 1e-5)[1], x),
                           ("fused_add_norm", add_norm, x),
                           ("fused_silu_mul", fused.silu_mul, gu)):
        full = fn(data)
        bad = sum(int(not torch.equal(fn(data[a: a + m].clone()), full[a: a + m]))
                  for m in ROW_COUNTS for a in (0, 1, 600 - m))
        out[name] = {"row_counts_that_change_bits": bad}
    # and what the eager path without the kernels does: SDPA over one row vs a prompt's rows
    q = torch.randn(1, 32, 64, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, 64, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 8, 64, 128, device="cuda", dtype=torch.bfloat16)
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    last = F.scaled_dot_product_attention(q[:, :, -1:], k, v, enable_gqa=True)
    out["sdpa_last_prompt_row_equals_decode_row"] = torch.equal(whole[:, :, -1:], last)
    print("norms", out, flush=True)


def speed_attention(results: dict) -> None:
    out = results["attention_speed"] = {}
    heads, kvh, hd, bs = 32, 8, 128, 16
    for ctx in (128, 1024, 8192):
        for rows in (1, 8):
            nb = ctx // bs
            kv = torch.randn(2, kvh, rows * nb * bs + 1, hd, device="cuda", dtype=torch.bfloat16)
            blocks = torch.arange(rows * nb, device="cuda").view(rows, nb)
            table = (blocks[:, :, None] * bs + torch.arange(bs, device="cuda")).view(rows, -1)
            q = torch.randn(rows, heads, hd, device="cuda", dtype=torch.bfloat16)
            pos = torch.full((rows,), ctx - 1, device="cuda")
            r = torch.arange(rows, dtype=torch.int32, device="cuda")
            tiles = torch.stack([r, torch.ones_like(r), r])
            ours = graph_time_us(lambda: invariant.attention(q, kv[0], kv[1], table, pos, tiles, scale=hd ** -0.5))

            def sdpa():  # what the graph body does without the kernels: gather, then masked SDPA
                both = kv.index_select(2, table.view(-1)).view(2, kvh, rows, ctx, hd).transpose(1, 2)
                mask = torch.ones(rows, 1, 1, ctx, dtype=torch.bool, device="cuda")
                return F.scaled_dot_product_attention(q.view(rows, kvh, 4, hd), both[0], both[1], attn_mask=mask,
                                                      scale=hd ** -0.5)
            theirs = graph_time_us(sdpa)
            out[f"ctx{ctx}_rows{rows}"] = {"invariant_us": round(ours, 1), "gather_sdpa_us": round(theirs, 1)}
            print("attention speed", ctx, rows, out[f"ctx{ctx}_rows{rows}"], flush=True)


# ---- the mesh ------------------------------------------------------------------------------------------
def lead(a: list[int], b: list[int]) -> int:
    """How many tokens a and b share before they first differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def mesh_part(args, results: dict) -> None:
    big = make_model(args.work / "llama3-8b-shape-32", LLAMA3_8B, torch.bfloat16)
    prompts = [[(31 * i + 7 * j) % 128000 for j in range(20 + 3 * i)] for i in range(args.concurrency)]
    n = args.tokens
    for setting in args.settings.split(","):
        with LocalMesh(1, big, args.work / f"inv-{setting}", threads=4, device="cuda",
                       stage_args=("--batch-invariant", setting, "--max-kv-mib", "4096"),
                       controller_args=("--dtype", "bfloat16", "--strategy", "uniform", "--speculate", "0")) as mesh:
            addr = mesh.controller_address
            submit(addr, ids=prompts[0], tokens=4)  # warm-up (graph captures, kernel compiles)
            alone = [submit(addr, ids=p, tokens=n)["ids"] for p in prompts]
            with ThreadPoolExecutor(len(prompts)) as pool:
                together = [r["ids"] for r in pool.map(lambda p: submit(addr, ids=p, tokens=n), prompts)]
            with ThreadPoolExecutor(len(prompts)) as pool:
                again = [r["ids"] for r in pool.map(lambda p: submit(addr, ids=p, tokens=n), prompts)]
            half = n // 2
            replay = [submit(addr, ids=p + a[:half], tokens=n - half)["ids"] for p, a in zip(prompts, alone)]
            # a long prompt (3,000 positions: eager prefill, attention over several splits) alone and among 7
            long = [(13 * j + 5) % 128000 for j in range(3000)]
            long_alone = submit(addr, ids=long, tokens=half)["ids"]
            with ThreadPoolExecutor(len(prompts)) as pool:
                long_among = list(pool.map(lambda p: submit(addr, ids=p, tokens=half)["ids"], [long] + prompts[1:]))[0]
            shared = [lead(a, b) for a, b in zip(alone, together)]
            r = results[f"mesh_{setting}"] = {
                "tokens": n, "shared_alone_vs_8": shared, "all_equal_alone_vs_8": alone == together,
                "shared_8_vs_8_again": [lead(a, b) for a, b in zip(together, again)],
                "replay_shared_of_last": [lead(a[half:], b) for a, b in zip(alone, replay)],
                "replay_equal": all(a[half:] == b for a, b in zip(alone, replay)),
                "long_prompt_shared_alone_vs_among_8": lead(long_alone, long_among), "long_prompt_tokens": half,
                "alone_tokens": alone}
            r.update(mesh_rates(addr, prompts, n, args.rounds, args.concurrency, mesh.stage_addresses))
            print(setting, {k: v for k, v in r.items() if k != "alone_tokens"}, flush=True)
    if "mesh_off" not in results:
        return
    on, off = results["mesh_on"], results["mesh_off"]
    results["on_vs_off"] = {"one_stream_tps_ratio": round(on["one_stream_tps"] / off["one_stream_tps"], 3),
                            "concurrent_tps_ratio": round(on["concurrent_tps"] / off["concurrent_tps"], 3),
                            "alone_tokens_shared_on_vs_off": [lead(a, b) for a, b in zip(on["alone_tokens"],
                                                                                       off["alone_tokens"])]}


def small_part(args, results: dict) -> None:
    small = make_model(args.work / "small", SMALL, torch.float32)
    prompts = [[(17 * i + 5 * j) % 500 for j in range(12 + 5 * i)] for i in range(args.concurrency)]
    _, ref = hf_generate(small, torch.float32, prompts, 48, 0)
    with LocalMesh(1, small, args.work / "small-inv", threads=4, device="cuda",
                   stage_args=("--batch-invariant", "on"), controller_args=("--strategy", "uniform")) as mesh:
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: submit(mesh.controller_address, ids=p, tokens=48)["ids"], prompts))
    results["small_fp32_invariant_greedy_equal_transformers"] = got == ref
    print("small", got == ref, flush=True)


def table(results: dict) -> str:
    lines = ["| --batch-invariant | tokens shared, alone vs among 8 (of 64) | 3,000-token prompt (of 32) | "
             "replay equal | 1-stream tok/s | 8-concurrent tok/s |", "|---|---|---|---|---|---|"]
    for s in ("on", "off"):
        r = results.get(f"mesh_{s}")
        if r:
            sh = r["shared_alone_vs_8"]
            lines.append(f"| {s} | {min(sh)}-{max(sh)} ({sum(x == r['tokens'] for x in sh)}/8 all) | "
                         f"{r['long_prompt_shared_alone_vs_among_8']} | {r['replay_equal']} | "
                         f"{r['one_stream_tps']:.1f} | {r['concurrent_tps']:.1f} |")
    if "on_vs_off" in results:
        o = results["on_vs_off"]
        lines.append(f"| on / off | | | | {o['one_stream_tps_ratio']:.3f} | {o['concurrent_tps_ratio']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", default="kernels,mesh,small", help="comma list of kernels, tiles, sweep, mesh, small")
    ap.add_argument("--work", type=Path, default=Path("/tmp/lp-gpu"))
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--settings", default="on,off", help="--part mesh: the --batch-invariant settings to run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()
    gpu_engine.DEVICE = "cuda"
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    parts = args.part.split(",")
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    import triton
    results["triton"] = triton.__version__

    def save():
        (args.out / "gpu_invariance.json").write_text(json.dumps(results, indent=2))

    t0 = time.perf_counter()
    if "kernels" in parts:
        check_mm(results)
        check_attention(results)
        check_norms(results)
        save()
        speed_mm(results)
        speed_attention(results)
        save()
    if "tiles" in parts:
        check_tile_configs(results)
        save()
    if "sweep" in parts:
        sweep(results)
        save()
    if "small" in parts:
        small_part(args, results)
        save()
    if "mesh" in parts:
        mesh_part(args, results)
        save()
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    save()
    print(table(results))
    print(json.dumps({k: v for k, v in results.items() if k != "sweep"}, indent=2, default=str))


if __name__ == "__main__":
    main()
