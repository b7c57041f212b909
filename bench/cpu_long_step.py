"""One step of a CPU stage at long context: torch's gathered SDPA (main before lp_attend) against
cpu_quant.c's lp_attend reading the paged pool in place.

Stage 0 of bench.long_context's mesh (layers [0, 3) of the 256-wide 6-layer random Llama, 4 heads, 2 KV
heads, float32, one thread) over a paged pool of 16-position blocks holding a sequence of 31,999
positions and one of 16,000 (random keys; the step's cost does not depend on them). Reported: the
process's CPU seconds of the step (best of 3; robust to a shared VM's load) and its wall seconds.
Then one layer's attention alone (`--part kernel`): one sequence of 14,000 positions on scattered
16-slot blocks, 1 to 128 rows at its end, lp_attend against the gather and SDPA, CPU milliseconds.

    python -m bench.cpu_long_step [--part step|kernel|all]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from logicpipe.stage_node.kernels import cpu_native
from logicpipe.stage_node.model.shard import Shard
from tests.families import build
from tests.unit.paged import PagedCache

CASES = {"decode row at 31,999": [("a", 31999, [5])],
         "2 decode rows (31,999 and 16,000)": [("a", 31999, [5]), ("b", 16000, [5])],
         "decode row + 64-row chunk at 16,000": [("a", 31999, [5]), ("b", 16000, list(range(64)))]}


def cpu_ms(fn, reps: int = 3) -> float:
    fn()
    best = None
    for _ in range(reps):
        t0 = time.process_time()
        fn()
        best = min(best or 1e9, time.process_time() - t0)
    return best * 1e3


def kernel() -> None:
    kvh, heads, hd, slots, n = 2, 4, 64, 40000, 14000
    k, v = torch.randn(kvh, slots, hd), torch.randn(kvh, slots, hd)
    blocks = torch.randperm(slots // 16)
    order = (blocks[:, None] * 16 + torch.arange(16)).reshape(-1)[:n]  # the sequence's slots, block by block
    for rows in (1, 4, 8, 16, 32, 128):
        pos, row_seq, q = torch.arange(n - rows, n), torch.zeros(rows, dtype=torch.long), torch.randn(rows, heads, hd)
        mask = torch.ones(rows, n, dtype=torch.bool).tril(n - rows)
        native = cpu_ms(lambda: cpu_native.attend(q, k, v, order[None], row_seq, pos, 0, 0.125))
        torch_ms = cpu_ms(lambda: F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.index_select(1, order)[None], v.index_select(1, order)[None], attn_mask=mask,
            scale=0.125, enable_gqa=True))
        print(f"one layer, {rows} rows at 14,000: lp_attend {native:.1f} ms CPU, gather + SDPA {torch_ms:.1f} ms CPU",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", default="all", choices=["step", "kernel", "all"])
    part = ap.parse_args().part
    torch.set_num_threads(1)
    if part in ("kernel", "all"):
        kernel()
    if part == "kernel":
        return
    model = build("llama", Path(tempfile.mkdtemp(prefix="lp-longstep-")) / "m", None, hidden_size=256,
                  intermediate_size=512, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=33000, initializer_range=0.05)
    shard = Shard.load(model, 0, 3, first=True, last=False, device=torch.device("cpu"), dtype=torch.float32)
    pc = PagedCache(shard, 4200, 16)
    for sid, n in (("a", 31999), ("b", 16000)):  # positions held, their KV random
        pc.kv.open(sid, n)
        pc.pool.copy_plans([pc.kv.prepare_write(sid, 0, n)])
        pc.kv.commit(sid, 0, list(range(n)))
    pc.pool.kv.normal_()
    native = Shard._reads_native
    for name, seqs in CASES.items():
        for label, reads in (("torch (gathered SDPA)", lambda self, pool: False), ("lp_attend", native)):
            Shard._reads_native = reads
            best = None
            for _ in range(3):  # the same step again (its rows' KV rewritten in place)
                plans = [pc.kv.prepare_write(sid, s, len(t)) for sid, s, t in seqs]
                h = torch.randn(sum(len(t) for _, _, t in seqs), 256)
                t0, w0 = time.process_time(), time.perf_counter()
                pc._forward(h, seqs, plans, {}, None)
                got = (time.process_time() - t0, time.perf_counter() - w0)
                best = got if best is None or got < best else best
            print(f"{name}: {label}: {best[0] * 1e3:.1f} ms CPU ({best[1] * 1e3:.1f} ms wall)", flush=True)
    Shard._reads_native = native


if __name__ == "__main__":
    main()
