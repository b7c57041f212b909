"""int4 and int8 weights on CUDA (stage_node.kernels.gpu_quant, issue 39 item 0) against bf16, on the GPU.

    python -m bench.gpu_quant --work /tmp/gpu --out $OUT      # on the GPU machine (docs/engine.md)

Parts (`--part`, comma list; default check,decode,matrices,agreement):
  * check: each matrix of layer 0 of the 8B-shaped model (and the int8 LM head) in int4 and int8,
    256 rows against a float32 product with the dequantized matrix, and a row's bits at any place
    among 1 to 256 rows (the one-row kernel up to gpu_quant.GEMV_ROWS rows, 16- to 128-row tiles past
    that: the kernels' batch invariance on the GPU's own instructions); and the int4 step at 1 to 3
    rows with its inputs rounded by add_norm / silu_mul against round_rows' pre-pass (the same bits);
  * decode: one stream of the 8B-shaped layer set (bench.gpu_engine's model, `--layers`, default 8,
    with the final norm and the LM head: int8 beside int4 and int8 layers, as a stage holds it) in
    bf16, int4 and int8: the one-row step at `--context` positions as a CUDA-graph replay (the
    stage's StepGraphs, batch-invariant kernels on, as a CUDA stage runs by default) plus the LM head;
    ms a token, tok/s, the weight bytes a token reads and their HBM limit (bytes over the GPU's peak:
    a table by name, H100 SXM 3.35 TB/s, else `--hbm-tbps`, else a large copy's rate), the graph
    against the eager step (same bits), the output against bf16's;
  * matrices: each matrix's one-row (and 8- and 256-row) product alone, 20 calls in one CUDA graph, GB/s of
    its bytes: bf16 by invariant.mm against int4 and int8;
  * agreement: greedy decoding of a small random Llama (bench.gpu_engine's SMALL shape, `AGREE`, or
    `--model DIR`, e.g. the default model's safetensors directory) in int4 and int8 against bf16:
    the share of greedy tokens equal teacher-forced on bf16's tokens, the logits' relative error,
    and the tokens equal before the first difference decoding freely, over `--prompts` prompts x
    `--tokens` tokens; float32 beside them, for scale (a random model's top logits are close, and
    its layers amplify rounding: a real model's figure needs `--model`);
  * prompt: each matrix's product of `--prompt-rows` rows (default 256 and 2048) in int4 and int8 as
    chosen, int4's also with the tiled kernel adding the parts of K itself and with a program a part
    and invariant.add_parts (the same bits, checked), bf16 beside them (not run by default).
  * pdl: the decode step in int4 and bf16 with programmatic dependent launch (invariant.PDL) off and
    on in turn, twice, in one process (not run by default).
The tiles' sweep and a profile of the one-row step are bench/gpu_quant_tune.py.

Prints progress lines, then one JSON line of every result (also written to $OUT/gpu_quant.json, after
each part). A part that fails records {"error": ...} with the part's name, writes what it has, and
the script exits non-zero with the traceback.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import sys
import time
import traceback
from pathlib import Path

import torch

try:
    from bench.gpu_engine import LLAMA3_8B, SMALL, make_model
    from bench.gpu_step import timed
except ImportError as exc:  # bench.gpu_engine imports the mesh's side (grpc, protobuf) too
    raise SystemExit(f"bench.gpu_quant reuses bench.gpu_engine's helpers, which need the mesh's dependencies "
                     f"installed and this repository's root on PYTHONPATH: {exc}") from exc
from logicpipe.stage_node.engine.kv import StepKV, seq_slice
from logicpipe.stage_node.engine.step_graphs import GraphRow, StepGraphs
from logicpipe.stage_node.kernels import gpu_quant, invariant
from logicpipe.stage_node.kernels.quant import tensor_bytes
from logicpipe.stage_node.model.shard import Shard

FORMATS = ("bf16", "int4", "int8")
# the agreement's random model: bench.gpu_engine's SMALL shape with weights of std 0.05, not its 0.2,
# whose layers amplify any rounding (on the CPU here: float32 against bf16 logits 6% apart at 0.2,
# 1% at 0.05; int4 0.79 / 0.31, int8 0.12 / 0.03)
AGREE = dict(SMALL, initializer_range=0.05)
MATRICES = ("qkv", "o", "gate_up", "down")
PEAK_TBPS = (("H100 PCIe", 2.0), ("H100 NVL", 3.9), ("H100", 3.35), ("H200", 4.8))  # first match by name
PLACES = ((1, 0), (1, 100), (2, 7), (5, 250), (8, 64), (16, 3), (17, 50), (32, 1), (33, 100), (64, 0), (65, 10),
          (128, 128), (129, 5), (200, 56), (256, 0))  # (rows, first row) among 256


def load(path: Path, fmt: str, layers: int, *, first: bool = False) -> Shard:
    """Layers [0, layers) with the final norm and LM head, on CUDA in bf16 (fp32: float32) or
    quantized (bf16 activations), with the batch-invariant kernels on (a CUDA stage's default)."""
    shard = Shard.load(path, 0, layers, first=first, last=True, device="cuda",
                       dtype=torch.float32 if fmt == "fp32" else torch.bfloat16,
                       quantize=fmt if fmt in ("int4", "int8") else "none")
    shard.batch_invariant = True
    if fmt in ("int4", "int8"):
        kinds = {type(getattr(w, m)).__name__ for w in shard.layers for m in MATRICES}
        if kinds != {f"Triton{fmt.capitalize()}"}:
            raise RuntimeError(f"a {fmt} shard holds {kinds}, not gpu_quant's Triton matrices")
    return shard


def graph_ms(fn, inner: int = 20, rounds: int = 50) -> float:
    """ms of one fn() on the GPU: `inner` calls captured in one CUDA graph (no launch overhead),
    the replay timed. Capturing is itself the check that fn is capturable."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compiled and loaded outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    return timed(graph.replay, rounds) / inner


def peak_tbps(args, device: str) -> tuple[float, str]:
    """(the GPU's memory bandwidth in TB/s, where it comes from)."""
    if args.hbm_tbps:
        return args.hbm_tbps, "--hbm-tbps"
    for name, tbps in PEAK_TBPS:
        if name in device:
            return tbps, f"table ({name})"
    return copy_tbps(), "measured copy (GPU not in the table)"


def copy_tbps() -> float:
    src = torch.empty(2**28, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / timed(lambda: dst.copy_(src), 20) / 1e9


def check(args, res: dict) -> None:
    """Each matrix against its dequantized float32 product, and a row's bits at any place among 256."""
    path = big_model(args)
    out = res["check"] = {}
    for fmt in ("int4", "int8"):
        shard = load(path, fmt, 1)
        mats = {m: getattr(shard.layers[0], m) for m in MATRICES} | {"lm_head": shard.lm_head}
        for name, m in mats.items():
            g = torch.Generator(device="cuda").manual_seed(0)
            x = torch.randn(256, m.shape[1], generator=g, device="cuda").bfloat16()
            full = m(x)
            ref = x.float() @ gpu_quant.dequantized(m).bfloat16().float().T
            err = float((full.float() - ref).norm() / ref.norm())
            bad = [f"{r}@{a}" for r, a in PLACES if not torch.equal(m(x[a: a + r]), full[a: a + r])]
            out[f"{fmt}_{name}"] = {"shape": list(m.shape), "rel_err_vs_dequantized": round(err, 6),
                                    "rows_invariant": not bad, "rows_differing": bad}
            print(fmt, name, out[f"{fmt}_{name}"], flush=True)
            if not err < 1e-2:
                raise RuntimeError(f"{fmt} {name}: the product is off the dequantized matrix's by {err:.3g} of its norm")
        del shard, mats
        torch.cuda.empty_cache()
    res["check_rows_invariant"] = all(v["rows_invariant"] for v in out.values())
    res["check_fused_rounding"] = fused_rounding(path)


def fused_rounding(path: Path) -> dict:
    """The int4 step's inputs rounded by add_norm, attention's merge and silu_mul in their launch
    (Shard._rounds) against round_rows' pre-pass (off): the eager step of 2 layers at 1, 2 and 3 rows,
    the same bits."""
    shard = load(path, "int4", 2)
    bs, blocks = 16, list(range(40))
    pool = shard.new_pool(len(blocks), bs)
    g = torch.Generator(device="cuda").manual_seed(1)
    out = {}
    with torch.inference_mode():
        for rows in (1, 2, 3):
            x = torch.randn(rows, shard.config.hidden_size, generator=g, device="cuda").bfloat16()
            seqs = tuple(seq_slice(100 + r, 1, blocks[10 * r: 10 * r + 10], bs, "cuda", 100 + r) for r in range(rows))
            write = torch.tensor([160 * r + 100 + r for r in range(rows)], device="cuda")
            fused = shard.forward(x, StepKV(pool, write, seqs)).clone()
            shard._rounds = lambda m, rows: False  # (an instance attribute over the method: the pre-pass)
            try:
                plain = shard.forward(x, StepKV(pool, write, seqs))
            finally:
                del shard._rounds
            out[rows] = torch.equal(fused, plain)
    print("int4 inputs rounded by add_norm / the merge / silu_mul, the same bits as by round_rows:", out, flush=True)
    if not all(out.values()):
        raise RuntimeError(f"the fused rounding changed a row's bits: {out}")
    return out


def decode(args, res: dict) -> None:
    """One-row decode of the 8B-shaped layer set per format: graph replay + LM head."""
    path = big_model(args)
    tbps, source = peak_tbps(args, res["device"])
    res["hbm_tbps"], res["hbm_source"] = tbps, source
    out = res["decode"] = {}
    ref = None
    for fmt in FORMATS:
        shard = load(path, fmt, args.layers)
        r, h = one_row_step(shard, args.context, tbps)
        if ref is None:
            ref = h.float()
        else:
            r["rel_err_vs_bf16"] = round(float((h.float() - ref).norm() / ref.norm()), 4)
        out[fmt] = r
        print(fmt, r, flush=True)
        del shard, h
        torch.cuda.empty_cache()
    for fmt in ("int4", "int8"):
        out[f"{fmt}_speedup_vs_bf16"] = round(out["bf16"]["ms_per_token"] / out[fmt]["ms_per_token"], 2)


def one_row_step(shard: Shard, ctx: int, tbps: float) -> tuple[dict, torch.Tensor]:
    """(the figures of a one-row decode step at `ctx` positions: its layers as a CUDA-graph replay
    plus the LM head eagerly, its output [1, hidden])."""
    bs = 16
    blocks = list(range(max(300, 2 * (ctx // bs + 1))))  # (as bench.gpu_step: room past the graph's bucket)
    pool = shard.new_pool(len(blocks), bs)
    graphs = StepGraphs(shard, pool, warm=False)
    x = torch.randn(1, shard.config.hidden_size, generator=torch.Generator(device="cuda").manual_seed(1),
                    device="cuda").bfloat16()
    rows = [GraphRow(ctx, ctx, blocks)]
    with torch.inference_mode():
        h = graphs.forward(x, rows)
        if h is None or graphs.disabled or not graphs.graphs:
            raise RuntimeError("the one-row step was not captured in a CUDA graph (the stage's warning above says why)")
        h = h.clone()
        g = next(iter(graphs.graphs.values()))
        replay = timed(g.graph.replay, 200)
        host = timed(lambda: graphs.forward(x, rows), 100)
        head = timed(lambda: shard.logits(h), 100)
        kv = StepKV(pool, torch.tensor([ctx], device="cuda"), (seq_slice(ctx, 1, blocks, bs, "cuda", ctx),))
        eager = shard.forward(x, kv)
    layer_bytes = sum(tensor_bytes(v) for w in shard.layers for v in vars(w).values())
    total = shard.weight_bytes  # layers, final norm, LM head (no embedding: a token only indexes it)
    ms = replay + head
    return {"fused_layers": shard.fused_layers, "weight_gb": round(total / 1e9, 3),
            "layer_gb": round(layer_bytes / 1e9, 3), "layers_graph_ms": round(replay, 4),
            "layers_graph_forward_ms": round(host, 4), "lm_head_ms": round(head, 4), "ms_per_token": round(ms, 4),
            "tokens_per_s": round(1000 / ms, 1), "hbm_limit_ms": round(total / tbps / 1e9, 4),
            "of_hbm_limit": round(total / tbps / 1e9 / ms, 3),
            "layers_of_hbm_limit": round(layer_bytes / tbps / 1e9 / replay, 3),
            "graph_equals_eager": torch.equal(eager, h)}, h


def matrices(args, res: dict) -> None:
    """Each matrix's product alone, 1, 8 and 256 rows (a prompt's), GB/s of its bytes."""
    path = big_model(args)
    out = res["matrices"] = {}
    for fmt in FORMATS:
        shard = load(path, fmt, 1)
        mats = {m: getattr(shard.layers[0], m) for m in MATRICES} | {"lm_head": shard.lm_head}
        for name, m in mats.items():
            mul = (lambda x, m=m: invariant.mm(x, m)) if fmt == "bf16" else m
            for rows in (1, 8, 256):
                x = torch.randn(rows, m.shape[1], device="cuda").bfloat16()
                ms = graph_ms(lambda x=x, mul=mul: mul(x))
                nbytes = tensor_bytes(m)
                out[f"{fmt}_{name}_{rows}"] = {"us": round(ms * 1000, 2), "gbps": round(nbytes / ms / 1e6)}
        print(fmt, {k: v for k, v in out.items() if k.startswith(fmt)}, flush=True)
        del shard, mats
        torch.cuda.empty_cache()


def prompt(args, res: dict) -> None:
    """Each int4 / int8 matrix's product of `--prompt-rows` rows (a prompt's) as a whole call, 20 calls in
    one CUDA graph (`us`: the tile and the parts' sum gpu_quant chooses); on a tree with
    gpu_quant.sum_rows also int4's tiled kernel adding the parts of K itself against a program a part
    and invariant.add_parts (the same bits, checked); bf16 beside them."""
    path = big_model(args)
    out = res["prompt"] = {}
    keep = getattr(gpu_quant, "SUM_ROWS", None)
    rows_list = [int(r) for r in args.prompt_rows.split(",")]
    for fmt in FORMATS:
        shard = load(path, fmt, 1)
        for name in MATRICES:
            m = getattr(shard.layers[0], name)
            for rows in rows_list:
                x = torch.randn(rows, m.shape[1], device="cuda").bfloat16()
                if fmt == "bf16":
                    out[f"{fmt}_{name}_{rows}"] = {"us": round(graph_ms(lambda m=m, x=x: invariant.mm(x, m)) * 1e3, 2)}
                    continue
                r = {"us": round(graph_ms(lambda m=m, x=x: m(x)) * 1e3, 2)}
                if fmt == "int4" and keep is not None:
                    ys = []
                    for mode, rows_from in (("summed", 0), ("parts", 1 << 30)):
                        gpu_quant.SUM_ROWS = dict.fromkeys([tuple(m.shape)], rows_from)
                        r[f"{mode}_us"] = round(graph_ms(lambda m=m, x=x: m(x)) * 1e3, 2)
                        ys.append(m(x))
                    gpu_quant.SUM_ROWS = keep
                    r["same_bits"] = torch.equal(ys[0], ys[1]) and torch.equal(ys[0], m(x))
                out[f"{fmt}_{name}_{rows}"] = r
        print(fmt, {k: v for k, v in out.items() if k.startswith(fmt)}, flush=True)
        del shard
        torch.cuda.empty_cache()
    if not all(v.get("same_bits", True) for v in out.values()):
        raise RuntimeError("the tiled kernel's own sum of the parts differs from invariant.add_parts'")


def greedy(shard: Shard, prompt: list[int], tokens: int) -> list[int]:
    """`tokens` greedy tokens after `prompt` (one sequence, eager steps)."""
    bs = 16
    blocks = list(range(-(-(len(prompt) + tokens) // bs) + 1))
    pool = shard.new_pool(len(blocks) + 1, bs)
    ids = list(prompt)
    n = len(ids)
    with torch.inference_mode():
        h = shard.forward(shard.embed(torch.tensor(ids, device="cuda")),
                          StepKV(pool, torch.arange(n, device="cuda"), (seq_slice(0, n, blocks, bs, "cuda", n),)))
        for _ in range(tokens):
            ids.append(int(shard.logits(h[-1:]).argmax(-1)))
            p = len(ids) - 1
            h = shard.forward(shard.embed(torch.tensor(ids[-1:], device="cuda")),
                              StepKV(pool, torch.tensor([p], device="cuda"), (seq_slice(p, 1, blocks, bs, "cuda", p),)))
    return ids[len(prompt):]


def teacher_forced(shard: Shard, prompt: list[int], answer: list[int]) -> tuple[int, torch.Tensor]:
    """(how many of `answer`'s tokens are the greedy token after the prompt and the answer before
    them, the logits of those positions [len(answer), vocab] float32)."""
    ids = prompt + answer
    n = len(ids)
    bs = 16
    blocks = list(range(-(-n // bs) + 1))
    pool = shard.new_pool(len(blocks) + 1, bs)
    with torch.inference_mode():
        h = shard.forward(shard.embed(torch.tensor(ids, device="cuda")),
                          StepKV(pool, torch.arange(n, device="cuda"), (seq_slice(0, n, blocks, bs, "cuda", n),)))
        logits = shard.logits(h[len(prompt) - 1: n - 1])
    return sum(a == b for a, b in zip(logits.argmax(-1).tolist(), answer)), logits


def agreement(args, res: dict) -> None:
    """Greedy tokens of int4 and int8 against bf16 on a small model; float32 beside them shows how
    much a small random model's greedy tokens move with rounding alone (its logits are close)."""
    path = args.model or make_model(args.work / "small-bf16-agree", AGREE, torch.bfloat16)
    config = json.loads((Path(path) / "config.json").read_text())
    layers, vocab = config["num_hidden_layers"], config["vocab_size"]
    prompts = [[(31 * i + 7 * j + 3) % min(vocab, 500) for j in range(8 + 5 * i)] for i in range(args.prompts)]
    shard = load(path, "bf16", layers, first=True)
    ref = [greedy(shard, p, args.tokens) for p in prompts]
    ref_logits = [teacher_forced(shard, p, a)[1] for p, a in zip(prompts, ref)]
    del shard
    out = res["agreement"] = {"model": str(path), "prompts": args.prompts, "tokens": args.tokens}
    for fmt in ("fp32", "int4", "int8"):
        shard = load(path, fmt, layers, first=True)
        forced, errs, same = 0, [], []
        for p, a, want in zip(prompts, ref, ref_logits):
            hits, logits = teacher_forced(shard, p, a)
            forced += hits
            errs.append(float((logits - want).norm() / want.norm()))
            got = greedy(shard, p, args.tokens)
            same.append(next((i for i, (x, y) in enumerate(zip(got, a)) if x != y), len(a)))
        out[fmt] = {"teacher_forced": round(forced / (len(prompts) * args.tokens), 3),
                    "logits_rel_err": round(sum(errs) / len(errs), 4),
                    "equal_before_first_difference": same, "all_equal": sum(s == args.tokens for s in same)}
        print(fmt, out[fmt], flush=True)
        del shard
        torch.cuda.empty_cache()


def pdl(args, res: dict) -> None:
    """The one-row step with invariant.PDL off and on in turn (twice), int4 and bf16."""
    path = big_model(args)
    tbps, _ = peak_tbps(args, res["device"])
    out = res["pdl"] = []
    keep = invariant.PDL
    try:
        for on in (False, True, False, True):
            invariant.PDL = on
            for fmt in ("int4", "bf16"):
                shard = load(path, fmt, args.layers)
                r, _ = one_row_step(shard, args.context, tbps)
                row = {"pdl": on, "format": fmt, **{k: r[k] for k in ("layers_graph_ms", "lm_head_ms", "ms_per_token",
                                                                       "of_hbm_limit", "graph_equals_eager")}}
                out.append(row)
                print("pdl", row, flush=True)
                del shard
                torch.cuda.empty_cache()
    finally:
        invariant.PDL = keep


def big_model(args) -> Path:
    return make_model(args.work / f"llama3-8b-shape-{args.layers}", dict(LLAMA3_8B, num_hidden_layers=args.layers),
                      torch.bfloat16)


PARTS = {"check": check, "decode": decode, "matrices": matrices, "agreement": agreement, "prompt": prompt, "pdl": pdl}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/lp-gpu"), help="where the random models are kept")
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--part", default="check,decode,matrices,agreement", help=f"comma list of {', '.join(PARTS)}")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers of the 8B-shaped model (default 8)")
    ap.add_argument("--context", type=int, default=200, help="positions in the KV of the decode step (default 200)")
    ap.add_argument("--hbm-tbps", type=float, default=0.0, help="memory bandwidth, TB/s (default: by GPU name)")
    ap.add_argument("--model", type=Path, help="agreement: this model directory instead of a small random one")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompt-rows", default="256,2048", help="prompt: the row counts timed (default 256,2048)")
    args = ap.parse_args()
    parts = [p for p in args.part.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise SystemExit(f"--part {','.join(unknown)}: use {', '.join(PARTS)}")
    if not torch.cuda.is_available():
        raise SystemExit("bench.gpu_quant needs a CUDA GPU (torch.cuda.is_available() is False)")
    if not invariant.triton_available():
        raise SystemExit("bench.gpu_quant needs triton (it ships with torch's CUDA wheels)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "triton": importlib.metadata.version("triton"),
                 "layers": args.layers, "context": args.context}

    def save() -> None:
        (args.out / "gpu_quant.json").write_text(json.dumps(res, indent=2))

    for part in parts:
        t0 = time.perf_counter()
        try:
            PARTS[part](args, res)
        except Exception as exc:  # noqa: BLE001 — recorded with what the other parts measured, then re-raised
            res["error"] = f"part {part}: {type(exc).__name__}: {exc}"
            save()
            traceback.print_exc()
            print(json.dumps(res), flush=True)
            sys.exit(f"bench.gpu_quant failed in part {part}: {type(exc).__name__}: {exc}")
        res.setdefault("seconds", {})[part] = round(time.perf_counter() - t0, 1)
        save()
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
