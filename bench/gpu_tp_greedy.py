"""Shard.greedy on CUDA ranks over NCCL (issue 36): each rank's largest logit and its index gathered
give torch.argmax of the whole gathered logits, ties and NaN included, on 2 GPUs.

    python -m bench.gpu_tp_greedy
"""
from __future__ import annotations

import socket
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from logicpipe.stage_node.model.shard import Shard
from logicpipe.stage_node.model.tp import TensorParallel

VOCAB = 128256


def _cases(device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, VOCAB, generator=g)
    base[1, 7] = base[1, VOCAB - 3] = base[1].max() + 1  # a tie across the ranks: the first wins
    base[2, VOCAB // 2 + 5] = base[2, VOCAB // 2 + 9] = base[2].max() + 1  # a tie within rank 1
    base[3, VOCAB - 1] = float("nan")  # a NaN counts as the largest
    base[4, 100] = base[4, VOCAB - 100] = float("nan")  # the first NaN
    base[5] = 0.0  # all equal: index 0
    return [base.to(device)]


def _rank(rank: int, world: int, port: int, results) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        tp = TensorParallel(rank, world)
        a, b = tp.span(VOCAB)
        ok = True
        for logits in _cases(torch.device("cuda", rank)):
            fake = SimpleNamespace(tp=tp, config=SimpleNamespace(vocab_size=VOCAB),
                                   _own_logits=lambda h, part=logits[:, a:b]: part)
            got = Shard._greedy(fake, torch.empty(logits.shape[0], 1, device=logits.device))
            want = logits.argmax(-1)
            ok = ok and torch.equal(got, want)
            if rank == 0:
                print("greedy", got.tolist(), "argmax", want.tolist(), flush=True)
        results.put((rank, ok))
    finally:
        dist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    print("Shard.greedy over NCCL == torch.argmax of the whole logits:", all(got.values()), got)


if __name__ == "__main__":
    main()
