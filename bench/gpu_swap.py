"""Swapping on CUDA (issue 39 item 3, stage_node.engine.swap): what the CPU tests cannot show.

- pool: a Llama-3-8B-shaped stage pool on the GPU (32 layers, 8 KV heads of 128, blocks of 16), bf16
  and fp8 KV: a sequence of `--positions` swapped out to pinned host memory and back into other
  blocks comes back bit for bit (`equal`), and the copies' rate each way (GB/s, the second round:
  the first pins its host memory);
- mesh: a 2-stage CUDA mesh (real processes) of a small random fp32 Llama whose last stage's pool
  holds about 1.4 of the 2 concurrent requests, so it preempts one: with `--swap-mib` on both stages
  the two requests together give exactly the tokens each gives alone (`together_equal_alone`), the
  preempted one came back from the swap space (`swapped_in_seqs` > 0 on the last stage, `swap_full`
  0), and the same mesh without swap space (`--swap-mib 0`: recompute) gives the same tokens too.

    python -m bench.gpu_swap --work /tmp/gpuswap --out $OUT     # on the GPU machine; prints one JSON
"""
from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench import gpu_engine
from bench.engine_bench import submit
from bench.gpu_engine import SMALL, make_model, stage_status
from logicpipe.stage_node.engine.blocks import KVManager
from logicpipe.stage_node.engine.kv import KVPool
from logicpipe.stage_node.engine.kv_quant import as_bytes
from logicpipe.stage_node.engine.swap import SwapSpace
from tests.localmesh import LocalMesh

BLOCK = 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (cpu: a dry run of the pool part, no mesh)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def content(pool: KVPool, blocks: list[int], length: int) -> list[torch.Tensor]:
    idx = (torch.tensor(blocks)[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[:length].to(pool.kv.device)
    out = [as_bytes(pool.kv).index_select(3, idx)]
    if pool.scales is not None:
        out.append(pool.scales.index_select(3, idx))
    return out


def pool_round_trip(kv_dtype: str, positions: int) -> dict:
    blocks = -(-positions // BLOCK) * 2 + 8
    pool = KVPool(32, 8, 128, blocks, BLOCK, dtype=torch.bfloat16, device=DEVICE, kv_dtype=kv_dtype)
    raw = as_bytes(pool.kv)
    raw.copy_(torch.randint(0, 120, raw.shape, dtype=torch.uint8, device=DEVICE))
    if pool.scales is not None:
        pool.scales.view(torch.float32).uniform_()  # (int8: int32 words)
    swap = SwapSpace(pool, 64 << 30)
    kv = KVManager(blocks, BLOCK)
    tokens = [i % 1000 for i in range(positions)]
    out = {}
    for r in range(2):
        a, b = f"a{r}", f"b{r}"
        kv.open(a, positions)
        kv.prepare_write(a, 0, positions, tokens)
        kv.commit(a, 0, tokens)
        before = content(pool, kv.tables[a].blocks, positions)
        sync()
        t0 = time.perf_counter()
        swap.swap_out(a, kv)
        kv.close(a)
        swap.flush()
        sync()
        t_out = time.perf_counter() - t0
        raw.zero_()  # the blocks it gave up are written by others
        kv.open(b, positions)
        tokens_b = tokens + [7]  # (the replay's prompt: no prefix cache attached here, all of it comes back)
        t0 = time.perf_counter()
        held = swap.swap_in(b, tokens_b, kv)
        swap.flush()
        sync()
        t_in = time.perf_counter() - t0
        after = content(pool, kv.tables[b].blocks, positions)
        nbytes = -(-positions // BLOCK) * pool.block_bytes
        out = {"kv_dtype": kv_dtype, "positions": positions, "held": held, "mib": round(nbytes / 2**20, 1),
               "equal": held == positions and all(torch.equal(x, y) for x, y in zip(before, after)),
               "out_gbps": round(nbytes / t_out / 1e9, 2), "in_gbps": round(nbytes / t_in / 1e9, 2)}
        kv.close(b)
        raw.copy_(torch.randint(0, 120, raw.shape, dtype=torch.uint8, device=DEVICE))
    del pool, swap
    torch.cuda.empty_cache()
    return out


def mesh_check(work: Path, swap_mib: int, prompts: list[list[int]], tokens: int) -> dict:
    model = make_model(work / "small", SMALL, torch.float32)
    # the last stage: 3 layers x 4 KV heads x 32 x fp32 K and V = 3 KiB a position; 1 MiB holds ~330
    # positions, and each request grows to len(prompt) + tokens = 240
    with LocalMesh(2, model, work / f"mesh-swap{swap_mib}", threads=4 if DEVICE == "cuda" else 1, device=DEVICE,
                   stage_args=("--swap-mib", str(swap_mib)), stage_extra={1: ("--max-kv-mib", "1")},
                   controller_args=("--strategy", "uniform")) as mesh:
        alone = [submit(mesh.controller_address, ids=p, tokens=tokens)["ids"] for p in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(lambda p: submit(mesh.controller_address, ids=p, tokens=tokens)["ids"], prompts))
        st = stage_status(mesh.stage_addresses)
    return {"swap_mib": swap_mib, "together_equal_alone": together == alone and all(len(x) == tokens for x in alone),
            "preempted": [s.preempted for s in st], "swapped_out_seqs": [s.swapped_out_seqs for s in st],
            "swapped_in_seqs": [s.swapped_in_seqs for s in st], "swapped_in_tokens": [s.swapped_in_tokens for s in st],
            "swap_full": [s.swap_full for s in st], "tokens": together}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpuswap"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--positions", type=int, default=4000)
    ap.add_argument("--cpu-mesh", action="store_true", help="without CUDA: run the mesh part on CPU stages (a dry run)")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    gpu_engine.DEVICE = DEVICE  # (where its model is made)
    results = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"}
    results["pool"] = [pool_round_trip(k, args.positions) for k in ("auto", "fp8")]
    for r in results["pool"]:
        print("pool", r, flush=True)
    if DEVICE != "cuda" and not args.cpu_mesh:
        return
    prompts = [[(7 * i + 3 + 11 * j) % 500 for i in range(40)] for j in range(2)]
    swapped = mesh_check(args.work, 64, prompts, 200)
    recomputed = mesh_check(args.work, 0, prompts, 200)
    results["mesh"] = {k: v for k, v in swapped.items() if k != "tokens"}
    results["mesh_recompute"] = {k: v for k, v in recomputed.items() if k != "tokens"}
    results["mesh_swap_equals_recompute"] = swapped["tokens"] == recomputed["tokens"]
    print(json.dumps({k: v for k, v in results.items() if k != "pool"}, indent=1), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_swap.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
