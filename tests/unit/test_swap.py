"""The swap space (engine.swap) on small real pools: a sequence swapped out and taken back by a
replay gets the same bytes in its new blocks (float, int8 and fp8 KV with their scales, the rows
a pool logs, a window pool's blocks with holes, linear-attention snapshots; in host memory and in
files), past what the prefix cache attached; the fall back when it is full; the scheduler swapping
the sequence it preempts."""
from __future__ import annotations

from argparse import Namespace

import pytest
import torch

from logicpipe.errors import ResourceExhausted
from logicpipe.sampling import SamplingParams
from logicpipe.stage_node.engine.blocks import HOLE, KVManager
from logicpipe.stage_node.engine.kv import KVPool
from logicpipe.stage_node.engine.kv_quant import as_bytes
from logicpipe.stage_node.engine.scheduler import Scheduler
from logicpipe.stage_node.engine.sequence import SeqSpec, SeqWork
from logicpipe.stage_node.engine.states import RecurrentStates
from logicpipe.stage_node.engine.stats import StageStats
from logicpipe.stage_node.engine.swap import SwapSpace, host_block_bytes
from logicpipe.stage_node.engine.window import KVGroups, WindowBlocks
from logicpipe.stage_node.main import swap_mib as swap_mib_for

BS = 4


def pool_of(blocks: int = 16, kv_dtype: str = "auto", logs: bool = False) -> KVPool:
    pool = KVPool(2, 2, 8, blocks, BS, kv_dtype=kv_dtype)
    g = torch.Generator().manual_seed(0)
    as_bytes(pool.kv).copy_(torch.randint(0, 120, as_bytes(pool.kv).shape, generator=g, dtype=torch.uint8))
    if pool.scales is not None:
        pool.scales.view(torch.float32).copy_(torch.rand(pool.scales.shape, generator=g))  # (int8: int32 words)
    if logs:
        pool.add_logs([2], 6)
        pool.logs[2].copy_(torch.rand(pool.logs[2].shape, generator=g))
    return pool


def written(kv: KVManager, sid: str, tokens) -> None:
    """`sid` holds `tokens` (as a step that wrote them would leave it)."""
    kv.prepare_write(sid, 0, len(tokens), tokens)
    kv.commit(sid, 0, tokens)


def content(pool: KVPool, blocks, length: int) -> list[torch.Tensor]:
    """The bytes of positions [0, length) held in `blocks` (HOLEs skipped)."""
    slots = [b * BS + p % BS for p in range(length) for b in [blocks[p // BS]] if b != HOLE]
    idx = torch.tensor(slots, dtype=torch.long)
    out = [as_bytes(pool.kv).index_select(3, idx)]
    if pool.scales is not None:
        out.append(pool.scales.index_select(3, idx))
    out += [rows.index_select(0, idx) for rows in pool.logs.values()]
    return out


def scrub(pool: KVPool) -> None:
    """Whatever the freed blocks held is gone (another sequence wrote them)."""
    as_bytes(pool.kv).zero_()
    if pool.scales is not None:
        pool.scales.zero_()
    for rows in pool.logs.values():
        rows.zero_()


@pytest.mark.parametrize("kv_dtype,disk", [("auto", False), ("int8", False), ("fp8", True)])
def test_a_swapped_out_sequence_comes_back_bit_for_bit(kv_dtype, disk, tmp_path):
    pool = pool_of(kv_dtype=kv_dtype, logs=True)
    kv = KVManager(pool.num_blocks, BS)
    stats = StageStats()
    swap = SwapSpace(pool, 1 << 20, str(tmp_path) if disk else "", stats)
    tokens = list(range(1, 11))  # 10 positions: 2 whole blocks and 2 positions of a third
    kv.open("a", 16)
    written(kv, "a", tokens)
    before = content(pool, kv.tables["a"].blocks, 10)
    assert swap.swap_out("a", kv)
    kv.close("a")
    assert swap.used == 3 * host_block_bytes(pool) and stats.swapped_out_blocks == 3
    swap.flush()
    assert list(tmp_path.iterdir()) if disk else not list(tmp_path.iterdir())
    scrub(pool)  # (the prefix cache's blocks included: the replay must not lean on them)
    kv.open("b", 16)
    assert swap.swap_in("b", tokens + [11, 12], kv) == 10  # the replay: the prompt and the tokens since
    assert swap.used == 0 and not swap.entries
    kv.reserve("b", 12)
    assert not swap.flush()
    after = content(pool, kv.tables["b"].blocks, 10)
    assert all(torch.equal(x, y) for x, y in zip(before, after))
    assert (stats.swapped_in_seqs, stats.swapped_in_blocks, stats.swapped_in_tokens) == (1, 3, 10)
    assert not list(tmp_path.iterdir())  # the file went with the entry
    kv.prepare_write("b", 10, 2)  # it goes on from there
    kv.commit("b", 10, [11, 12])
    assert kv.tables["b"].length == 12 and len(kv.tables["b"].hashes) == 3


def test_the_swap_space_adds_to_what_the_prefix_cache_attached():
    pool = pool_of()
    kv = KVManager(pool.num_blocks, BS)
    swap = SwapSpace(pool, 1 << 20)
    tokens = list(range(1, 11))
    kv.open("a", 16)
    written(kv, "a", tokens)
    before = content(pool, kv.tables["a"].blocks, 10)
    swap.swap_out("a", kv)
    kv.close("a")  # its 2 whole blocks stay in the prefix cache
    swap.flush()
    kv.open("b", 16)
    assert kv.attach_prefix("b", tokens) == 8
    cached = list(kv.tables["b"].blocks)
    assert swap.swap_in("b", tokens, kv) == 10
    assert kv.tables["b"].blocks[:2] == cached and swap.stats.swapped_in_blocks == 1  # the third block alone
    swap.flush()
    assert all(torch.equal(x, y) for x, y in zip(before, content(pool, kv.tables["b"].blocks, 10)))


def test_a_full_swap_space_falls_back_to_computing_again():
    pool = pool_of()
    kv = KVManager(pool.num_blocks, BS)
    swap = SwapSpace(pool, 2 * host_block_bytes(pool))  # room for 2 blocks
    kv.open("a", 16)
    written(kv, "a", list(range(1, 11)))  # 3 blocks
    assert not swap.swap_out("a", kv) and swap.stats.swap_full == 1 and not swap.entries
    kv.close("a")
    kv.open("b", 16)
    assert swap.swap_in("b", list(range(1, 11)), kv) == 0  # nothing: the replay computes it
    kv.open("c", 16)
    written(kv, "c", [9, 9, 9, 9, 9])  # 2 blocks fit
    assert swap.swap_out("c", kv) and swap.used == 2 * host_block_bytes(pool)
    assert swap.swap_in("b", [1, 2], kv) == 0  # another prompt takes nothing


def test_a_window_pool_and_recurrent_states_come_back():
    """A stage with full and sliding-window layers (two pools, holes where the window gave blocks
    back) and linear layers (state snapshots) swaps all of it."""
    pool = pool_of()
    pool.group = pool_of(blocks=8)
    kv = KVGroups(KVManager(pool.num_blocks, BS), WindowBlocks(8, BS, window=4, rollback=0))
    states = RecurrentStates()
    swap = SwapSpace(pool, 1 << 20)
    tokens = list(range(1, 15))  # 14 positions: the window pool gives back its first 2 blocks
    kv.open("a", 16)
    states.open("a")
    written(kv, "a", tokens)
    snap = {0: (torch.rand(3, 2), torch.rand(2, 2, 2))}
    states.seqs["a"] = {14: snap, 13: {0: (torch.rand(3, 2), torch.rand(2, 2, 2))}}
    main, group = list(kv.main.tables["a"].blocks), list(kv.group.tables["a"].blocks)
    assert group[:2] == [HOLE, HOLE]
    before = content(pool, main, 14), content(pool.group, group, 14)
    assert swap.swap_out("a", kv, states)
    kv.close("a")
    states.drop("a")
    swap.flush()
    scrub(pool)
    scrub(pool.group)
    kv.open("b", 16)
    states.open("b")
    assert swap.swap_in("b", tokens + [7], kv, states) == 14
    kv.reserve("b", 15)
    swap.flush()
    assert kv.group.tables["b"].blocks[:2] == [HOLE, HOLE] and kv.held("b") == 14
    after = content(pool, kv.main.tables["b"].blocks, 14), content(pool.group, kv.group.tables["b"].blocks, 14)
    assert all(torch.equal(x, y) for b, a in zip(before, after) for x, y in zip(b, a))
    assert sorted(states.seqs["b"]) == [13, 14] and torch.equal(states.seqs["b"][14][0][1], snap[0][1])


def test_the_scheduler_swaps_the_sequence_it_preempts_and_its_replay_takes_it_back():
    pool = pool_of(blocks=6)  # 24 positions
    kv = KVManager(pool.num_blocks, BS)
    swap = SwapSpace(pool, 1 << 20)
    sched = Scheduler(kv, first=True, last=True, node_id="n", swap=swap)

    def spec(sid, prompt, priority):
        return SeqSpec(session_id=sid, capacity=24, sampling=SamplingParams(), max_new_tokens=100,
                       stop_ids=frozenset(), prompt=tuple(prompt), priority=priority)

    for sid, prio, prompt in (("old", 1, range(8)), ("young", 2, range(10, 18))):
        sched.admit(spec(sid, prompt, prio))
        sched.feed(SeqWork(sid, 0, tuple(prompt)))
    failures, held = [], {}
    for _ in range(12):
        step, f = sched.schedule()
        failures += f
        if step is None:
            break
        for p in sched.complete(step, set()):
            held[p.seq.id] = list(kv.tables[p.seq.id].tokens)
            sched.feed(SeqWork(p.seq.id, p.work.stop, (5,)))
    assert [f.session_id for f in failures] == ["young"] and isinstance(failures[0].error, ResourceExhausted)
    assert swap.stats.swapped_out_seqs == 1 and len(swap.entries) == 1
    assert kv.match_prefix(held["young"]) == []  # its first block went to "old": the prefix cache lost it
    sched.close("old")  # room again; the replay of "young": its tokens and the one it was to be fed
    seq, cached = sched.admit(spec("young2", held["young"] + [5], 2))
    assert cached == len(held["young"]) == 12 and swap.stats.swapped_in_seqs == 1
    assert swap.stats.swapped_in_tokens == 12 and seq.pending_pos == 12


def test_the_default_swap_space_by_device():
    """A GPU stage: half its pool, at most a quarter of the host's memory; a CPU stage: none (its pool
    is host memory), or its pool's size on a disk; a tensor-parallel stage: none; a flag wins."""
    def mib(device, swap_mib=None, swap_dir="", tp=1, host=64 << 30, tp_max=0):
        return swap_mib_for(Namespace(swap_mib=swap_mib, swap_dir=swap_dir, tp=tp, tp_max=tp_max, max_kv_mib=8192),
                            device, host)

    assert mib("cuda") == 4096 and mib("cuda", host=8 << 30) == 2048 and mib("cuda", tp=2) == 0
    assert mib("cuda", tp_max=2) == 0  # (a --tp-max node may run tensor-parallel: no swap either)
    assert mib("cpu") == 0 and mib("cpu", swap_dir="/var/tmp/lp") == 8192
    assert mib("cpu", swap_mib=100) == 100 and mib("cuda", swap_mib=0) == 0


def test_a_swap_in_whose_copy_fails_leaves_its_session_lost_until_it_closes(tmp_path):
    """A file gone from --swap-dir: the replay's blocks cannot be filled, so its session is reported
    lost (the runner fails its rows and the owner replays it from its prompt), never the node."""
    pool = pool_of()
    kv = KVManager(pool.num_blocks, BS)
    swap = SwapSpace(pool, 1 << 20, str(tmp_path))
    sched = Scheduler(kv, first=True, last=True, node_id="n", swap=swap)
    kv.open("a", 16)
    written(kv, "a", list(range(1, 11)))
    swap.swap_out("a", kv)
    kv.close("a")
    swap.flush()
    for f in tmp_path.iterdir():
        f.unlink()
    seq, cached = sched.admit(SeqSpec(session_id="b", capacity=16, sampling=SamplingParams(), max_new_tokens=4,
                                      stop_ids=frozenset(), prompt=tuple(range(1, 12))))
    assert cached == 10 and swap.flush() == {"b"}
    sched.close("b")
    assert not swap.lost
