"""The fused layers' products whose parts over K their consumer adds (issue 36), on one CUDA
device: the same bits as `invariant.add_parts` then the consumer, and their time.

 1. bits: `fused.rope_kv` of a tensor-parallel rank's q/k/v product's parts against
    `invariant.add_parts` then `rope_kv`; a row's bits the same at 1 to 32 rows (the parts are the
    matrix's, not the step's);
 2. time (us a product, 200 launches in a CUDA graph, one row): a rank's q/k/v [3072, 4096] and o
    [4096, 2048] of the Llama-3-8B shape read whole (before: `invariant.SPLIT_MIN`) against in the
    parts their consumer adds (`invariant.summed_parts`);
 3. layers: two random bf16 layers of a rank's shape (hidden 4096, 16 heads of 128, 4 KV heads,
    intermediate 7168: its q/k/v and o in 2 parts) through `Shard.layers_fused` against the plain
    forward (to bf16 rounding), and a sequence's 2 decode rows computed alone against among a
    5-row prompt: the same bits.

    python -m bench.gpu_fused_parts --out $OUT

(SwiGLU computed in the down product's loads instead of by `fused.silu_mul` was tried with this
bench, the same bits, and dropped: one row 162.8 us against 31.5 on an H200 for [4096, 14336].)
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from logicpipe.stage_node.engine.kv import StepKV, seq_slice
from logicpipe.stage_node.kernels import fused, invariant
from logicpipe.stage_node.model.shard import Shard

DT = torch.bfloat16


def timed(fn, reps: int = 200) -> float:
    """us per call of fn, replayed in one CUDA graph of `reps` calls."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / reps)
    return best


def bits(dev) -> dict:
    g = torch.Generator(device=dev).manual_seed(0)
    out = {}
    heads, kvh, hd = 16, 4, 128  # a rank's q/k/v of the 8B shape: [3072, 4096]
    w = (torch.randn((heads + 2 * kvh) * hd, 4096, device=dev, generator=g) / 64).to(DT)
    x = torch.randn(32, 4096, device=dev, generator=g).to(DT)
    cos = torch.randn(512, hd, device=dev, generator=g).to(DT)
    sin = torch.randn(512, hd, device=dev, generator=g).to(DT)
    pos = torch.arange(100, 132, device=dev)
    slots = torch.arange(32, device=dev) * 3
    ws = invariant.mm_parts(x, w, summed=True)
    pools = torch.zeros(2, 2, kvh, 128, hd, device=dev, dtype=DT)
    q1 = fused.rope_kv(ws, cos, sin, pos, slots, pools[0, 0], pools[0, 1], heads, kvh, hd, DT)
    q2 = fused.rope_kv(invariant.add_parts(ws, DT), cos, sin, pos, slots, pools[1, 0], pools[1, 1], heads, kvh, hd)
    rows = all(torch.equal(invariant.mm_parts(x[:m], w, summed=True), ws[:, :m]) for m in (1, 2, 8, 31))
    out["rope_kv_qkv_3072x4096"] = {"parts": ws.shape[0], "same_bits_as_add_parts": torch.equal(q1, q2)
                                    and torch.equal(pools[0], pools[1]), "row_bits_1_to_32": rows}
    return out


def speed(dev) -> dict:
    g = torch.Generator(device=dev).manual_seed(1)
    out = {}
    for name, n, k in [("tp_qkv", 3072, 4096), ("tp_o", 4096, 2048)]:
        w = (torch.randn(n, k, device=dev, generator=g) / 64).to(DT)
        x = torch.randn(1, k, device=dev, generator=g).to(DT)
        whole = timed(lambda: invariant.mm(x, w))
        summed = timed(lambda: invariant.mm_parts(x, w, summed=True))
        out[name] = {"parts": invariant.summed_parts(n, k), "whole_us": round(whole, 2),
                     "in_parts_consumer_adds_us": round(summed, 2)}
    return out


def layers(dev, work: Path) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=4096, intermediate_size=7168, num_hidden_layers=2,
                      num_attention_heads=16, num_key_value_heads=4, head_dim=128, max_position_embeddings=256,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(DT).save_pretrained(work)
    shard = Shard.load(work, 0, 2, first=False, last=False, device=dev, dtype=DT)
    bs = 16
    pools = [shard.new_pool(8, bs) for _ in range(3)]
    g = torch.Generator(device=dev).manual_seed(3)
    held = torch.randn(6, 4096, device=dev, generator=g).to(DT)
    shard.batch_invariant = True
    for p in pools:  # the second sequence's first 6 positions, block 2
        shard.forward(held, StepKV(p, torch.arange(32, 38, device=dev), (seq_slice(0, 6, [2], bs),)))
    x = torch.randn(7, 4096, device=dev, generator=g).to(DT)
    seqs = (seq_slice(0, 5, [0], bs), seq_slice(6, 2, [2], bs))
    write = torch.tensor([0, 1, 2, 3, 4, 38, 39], device=dev)
    shard.batch_invariant = False
    want = shard.forward(x, StepKV(pools[0], write, seqs))
    shard.batch_invariant = True

    def fused_rows(pool, x, write, seqs):
        kv = StepKV(pool, write, seqs)
        table, positions, tiles, _ = shard._invariant_reads(kv)
        rope = shard.ropes["full"]

        def attend(i, q):
            return invariant.attention(q, kv.pool.k[i], kv.pool.v[i], table, positions, tiles, scale=shard._scale)

        return shard.layers_fused(x, positions, write, kv.pool.kv, {"full": (rope.cos, rope.sin_signed)}, attend)

    got = fused_rows(pools[1], x, write, seqs)
    alone = fused_rows(pools[2], x[5:], write[5:], (seq_slice(6, 2, [2], bs),))
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    return {"parts_qkv_o": [invariant.summed_parts(3072, 4096), invariant.summed_parts(4096, 2048)],
            "max_rel_diff_to_forward": err, "close_to_forward": err < 0.05,
            "decode_rows_alone_same_bits": torch.equal(alone, got[5:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--work", type=Path, default=Path("/tmp/lp-fused-parts"), help="where the random layers go")
    args = ap.parse_args()
    dev = torch.device("cuda")
    result = {"device": torch.cuda.get_device_name(0), "bits": bits(dev), "us": speed(dev),
              "layers": layers(dev, Path(args.work))}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_fused_parts.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
