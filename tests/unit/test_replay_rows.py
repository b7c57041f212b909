"""Unit tier, issue 34: a stage's blocks record the layers and logged rows they hold, keep them
across a re-plan that moves the stage's range (KVManager.carried, KVPool.take_over), and a replay
over them is written again in place from the highest layer it kept (blocks.resume_layer)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from logicpipe.sampling import SamplingParams
from logicpipe.stage_node.engine import runner
from logicpipe.stage_node.engine.blocks import KVManager
from logicpipe.stage_node.engine.kv import KVPool
from logicpipe.stage_node.engine.scheduler import PlannedSeq
from logicpipe.stage_node.engine.sequence import SeqSpec, Sequence, SeqWork
from logicpipe.stage_node.model.shard import Shard
from tests.unit.test_shard import ROPES, tiny_llama

BS = 16


def manager(span, last=False, logged=frozenset(), blocks=16) -> KVManager:
    kv = KVManager(blocks, BS)
    kv.span, kv.last, kv.logged, kv.partial = span, last, frozenset(logged), True
    return kv


def written(kv: KVManager, seq: str, tokens: list[int]) -> None:
    kv.open(seq, len(tokens))
    kv.prepare_write(seq, 0, len(tokens), tokens)
    kv.commit(seq, 0, tokens)


TOKENS = list(range(100, 140))  # two full blocks and 8 positions


def test_a_full_block_records_the_stage_layers_and_logged_rows():
    kv = manager((10, 20), logged={20})
    written(kv, "a", TOKENS)
    blocks = kv.tables["a"].blocks
    assert [kv.blocks[b].layers for b in blocks[:2]] == [(10, 20)] * 2
    assert [kv.blocks[b].logs for b in blocks[:2]] == [frozenset({20})] * 2
    assert kv.blocks[blocks[2]].hash is None  # not full: not registered, records nothing
    kv.close("a")
    # the same range again: every layer held, and the output rows: a replay skips the rows whole
    kv.open("b", 64)
    assert kv.attach_prefix("b", TOKENS) == 2 * BS
    plan = kv.prepare_write("b", 0, len(TOKENS), TOKENS)
    assert plan.starts == (20,) * 32 + (10,) * 8
    assert plan.slots[:32] == tuple(blocks[0] * BS + i for i in range(32))  # in place, nothing copied
    assert plan.copies == ()


def test_a_grown_range_resumes_from_its_former_end_and_then_holds_every_layer():
    kv = manager((10, 20), logged={20})
    written(kv, "a", TOKENS)
    kv.close("a")
    grown, kept = kv.carried(16, (10, 30), False, frozenset({20, 30}), frozenset({20, 30}))
    assert len(kept) == 2 and all(grown.blocks[b].layers == (10, 20) for b in kept)
    grown.open("b", 64)
    assert grown.attach_prefix("b", TOKENS) == 0  # no block holds every layer: a replay starts at 0 ...
    plan = grown.prepare_write("b", 0, 24, TOKENS[:24])  # ... a first chunk: rows of block 0, half of block 1
    assert plan.starts == (20,) * 24  # ... computing layers [20, 30) only, from the rows logged at 20
    assert plan.upgraded == ((kept[0], 10, 20),)  # block 1 is not written whole by this step
    grown.commit("b", 0, TOKENS[:24])
    grown.upgrade(plan.upgraded)
    plan = grown.prepare_write("b", 24, 16, TOKENS[24:])
    assert plan.starts == (20,) * 8 + (10,) * 8  # the rest of block 1, then a new block computed whole
    grown.commit("b", 24, TOKENS[24:])
    grown.upgrade(plan.upgraded)
    assert grown.blocks[kept[0]].layers == (10, 30) and grown.blocks[kept[0]].logs == {20, 30}
    assert grown.blocks[kept[1]].layers == (10, 20)  # written in two steps: not marked (still exact)
    grown.close("b")
    # shrunk back to [10, 20): the grown blocks hold it whole, with its output rows
    back, kept2 = grown.carried(16, (10, 20), False, frozenset({20}), frozenset({20}))
    back.open("c", 64)
    assert back.attach_prefix("c", TOKENS) == 2 * BS
    assert back.prepare_write("c", 0, 40, TOKENS).starts == (20,) * 32 + (10,) * 8


def test_the_last_stage_skips_what_it_holds_and_other_tokens_end_the_resume():
    kv = manager((20, 30), last=True)
    written(kv, "a", TOKENS)
    kv.close("a")
    kv.open("b", 64)
    assert kv.attach_prefix("b", TOKENS) == 2 * BS
    assert kv.prepare_write("b", 0, 40, TOKENS).starts == (30,) * 32 + (20,) * 8
    kv.close("b")
    kv.open("c", 64)
    assert kv.attach_prefix("c", TOKENS) == 2 * BS
    other = TOKENS[:20] + [7] * 20  # a step with other tokens: the attached blocks past it are let go
    plan = kv.prepare_write("c", 16, 24, other[16:])
    assert plan.starts == () and kv.tables["c"].length == 16 and len(kv.tables["c"].blocks) == 3
    assert len(plan.copies) == 0


def test_a_range_grown_downward_computes_the_layers_under_it_then_resumes():
    kv = manager((10, 20), logged={20})
    written(kv, "a", TOKENS)
    kv.close("a")
    down, kept = kv.carried(16, (0, 20), False, frozenset({20}), frozenset({20}))
    down.partial = True
    down.open("b", 64)
    assert down.attach_prefix("b", TOKENS) == 0 and len(down.tables["b"].blocks) == 2
    plan = down.prepare_write("b", 0, 40, TOKENS)
    # layers [0, 10) from the tokens, then the output rows logged at 20; the new block whole
    assert plan.pres == (10,) * 32 + (0,) * 8 and plan.starts == (20,) * 32 + (0,) * 8
    down.commit("b", 0, TOKENS)
    down.upgrade(plan.upgraded)
    assert all(down.blocks[b].layers == (0, 20) for b in kept)
    down.close("b")
    # where rows cannot run part of the layers (native, fused, graphs), nothing is attached
    down2, _ = kv.carried(16, (0, 20), False, frozenset({20}), frozenset({20}))
    down2.partial = False
    down2.open("c", 64)
    assert down2.attach_prefix("c", TOKENS) == 0 and down2.tables["c"].blocks == []


def test_blocks_past_the_pool_are_not_kept():
    kv = manager((10, 20), logged={20})
    written(kv, "a", TOKENS)
    kv.close("a")
    small, kept = kv.carried(1, (10, 20), False, frozenset({20}), frozenset({20}))
    assert all(b < 1 for b in kept)


def _pool(span, logs, fill) -> KVPool:
    pool = KVPool(4, 2, 8, 4, BS)
    pool.span = span
    pool.add_logs(logs, 32)
    for t in (pool.kv, *pool.logs.values()):
        fill(t)
    return pool


def test_the_pool_copies_the_shared_layers_and_rows():
    old = _pool((10, 14), [12, 14], torch.Tensor.normal_)
    new = _pool((12, 16), [14, 16], torch.Tensor.zero_)
    new.take_over(old, [1, 3])
    for b in (1, 3):
        sl = slice(b * BS, (b + 1) * BS)
        assert torch.equal(new.kv[:2, :, :, sl], old.kv[2:, :, :, sl])  # layers 12, 13
        assert torch.equal(new.logs[14][sl], old.logs[14][sl])
    assert not new.kv[:, :, :, 0: BS].any() and not new.kv[2:].any() and not new.logs[16].any()


# ---- the arithmetic: a resumed replay gives the bits a fresh one does ----------------------------
def _stage(model_dir, start, end, *, num_layers=4, logs=(), blocks=16):
    """A shard of [start, end), its pool (logging `logs`) and a manager that records layers."""
    shard = Shard.load(model_dir, start, end, first=start == 0, last=end == num_layers)
    pool = shard.new_pool(blocks, BS)
    pool.span = (start, end)
    pool.add_logs(sorted(logs), shard.config.hidden_size)
    kv = manager((start, end), last=end == num_layers, logged=frozenset(logs), blocks=blocks)
    kv.partial = shard.can_tap
    return shard, pool, kv


def _run(shard, pool, kv, sid, tokens, rows=None, chunk=64):
    """Prefill `tokens` as a stage's steps do (opening the session and attaching what it holds),
    in chunks; -> the output rows of every position (None where a last stage skipped them)."""
    spec = SeqSpec(sid, 64, SamplingParams(), 1, frozenset(), prompt=tuple(tokens))
    seq = Sequence(spec, 0, 0)
    kv.open(sid, len(tokens))
    kv.attach_prefix(sid, tokens)
    outs, _run.plans = [], []
    for a in range(0, len(tokens), chunk):
        toks = tuple(tokens[a: a + chunk])
        work = SeqWork(sid, a, toks, sample=a + chunk >= len(tokens))
        plan = kv.prepare_write(sid, a, len(toks), toks)
        if plan.starts and shard.last and work.sample:  # as the scheduler does
            plan = dataclasses.replace(plan, starts=plan.starts[:-1] + (kv.span[0],),
                                       pres=plan.pres[:-1] + (kv.span[0],) if plan.pres else ())
        _run.plans.append(plan)
        p = PlannedSeq(seq, work, plan, kv.read_span(sid, work.stop))
        x = shard.embed(torch.tensor(toks)) if shard.first else rows[a: a + len(toks)]
        outs.append(runner._forward(shard, pool, [p], {sid: x})[sid])
        kv.commit(sid, a, list(toks))
        kv.upgrade(plan.upgraded)
    return torch.cat(outs), kv.tables[sid].blocks


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_llama(path, ROPES["llama3"])
    return path


@pytest.mark.parametrize("grown", ["upward", "downward"])
def test_a_replay_over_a_grown_range_gives_the_bits_of_a_fresh_one(tiny, grown):
    """Two stages [0, 2) and [2, 4) prefill 40 tokens; then one of them is re-assigned [0, 4) (the
    other lost) and the replay resumes over what it kept: the last row's output and the KV of
    every layer and position equal a fresh [0, 4)'s, to the bit."""
    tokens = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    a = _stage(tiny, 0, 2, logs={2})
    b = _stage(tiny, 2, 4)
    rows, _ = _run(*a, "s", tokens, chunk=24)
    _run(*b, "s", tokens, rows, chunk=24)
    fresh = _stage(tiny, 0, 4)
    want, fresh_blocks = _run(*fresh, "f", tokens, chunk=24)
    old = a if grown == "upward" else b
    old[2].close("s")
    logs = frozenset({2}) if grown == "upward" else frozenset()  # a grown range logs its former end
    shard, pool, _ = _stage(tiny, 0, 4, logs=logs)
    kv, kept = old[2].carried(16, (0, 4), True, logs, logs)
    kv.partial = True
    pool.take_over(old[1], kept)
    assert len(kept) == 2
    got, blocks = _run(shard, pool, kv, "s", tokens, chunk=24)
    first = _run.plans[0]  # resumed: upward from the rows logged at 2; downward, [0, 2) and then nothing
    assert (first.starts[0], first.pres[0] if first.pres else 0) == ((2, 0) if grown == "upward" else (4, 2))
    assert torch.equal(got[-1], want[-1])
    n = len(tokens)
    slots = [bk * BS + i for bk in blocks for i in range(BS)][:n]
    fslots = [bk * BS + i for bk in fresh_blocks for i in range(BS)][:n]
    assert torch.equal(pool.kv[..., slots, :], fresh[1].kv[..., fslots, :])
    assert kv.blocks[kept[0]].layers == (0, 4)  # (block 1 was written in two steps: not marked)
