"""One step of a CPU stage at long context: torch's gathered SDPA (main before lp_attend) against
cpu_quant.c's lp_attend reading the paged pool in place.

Stage 0 of bench.long_context's mesh (layers [0, 3) of the 256-wide 6-layer random Llama, 4 heads, 2 KV
heads, float32, one thread) over a paged pool of 16-position blocks holding a sequence of 31,999
positions and one of 16,000 (random keys; the step's cost does not depend on them). Reported: the
process's CPU seconds of the step (best of 3; robust to a shared VM's load) and its wall seconds.

    python -m bench.cpu_long_step
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from logicpipe.stage_node.model.shard import Shard
from tests.families import build
from tests.unit.paged import PagedCache

CASES = {"decode row at 31,999": [("a", 31999, [5])],
         "2 decode rows (31,999 and 16,000)": [("a", 31999, [5]), ("b", 16000, [5])],
         "decode row + 64-row chunk at 16,000": [("a", 31999, [5]), ("b", 16000, list(range(64)))]}


def main() -> None:
    torch.set_num_threads(1)
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
