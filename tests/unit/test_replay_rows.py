"""Unit tier, issue 34: a stage's blocks record the layers and logged rows they hold, keep them
across a re-plan that moves the stage's range (KVManager.carried, KVPool.take_over), and a replay
over them is written again in place from the highest layer it kept (blocks.resume_layer)."""
from __future__ import annotations

import torch

from logicpipe.stage_node.engine.blocks import KVManager
from logicpipe.stage_node.engine.kv import KVPool

BS = 16


def manager(span, last=False, logged=frozenset(), blocks=16) -> KVManager:
    kv = KVManager(blocks, BS)
    kv.span, kv.last, kv.logged = span, last, frozenset(logged)
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
    assert plan.upgraded == ((kept[0], 20),)  # block 1 is not written whole by this step
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


def test_a_range_grown_below_its_layers_and_blocks_past_the_pool_are_not_kept():
    kv = manager((10, 20), logged={20})
    written(kv, "a", TOKENS)
    kv.close("a")
    down, kept = kv.carried(16, (0, 20), False, frozenset({20}), frozenset({20}))
    down.open("b", 64)
    assert down.attach_prefix("b", TOKENS) == 0 and down.tables["b"].blocks == []  # layers [0, 10) are missing
    small, kept = kv.carried(1, (10, 20), False, frozenset({20}), frozenset({20}))
    assert all(b < 1 for b in kept)


def test_the_pool_copies_the_shared_layers_and_rows():
    old = KVPool(4, 2, 8, 4, BS)
    old.span = (10, 14)
    old.add_logs([12, 14], 32)
    old.kv.normal_()
    for rows in old.logs.values():
        rows.normal_()
    new = KVPool(4, 2, 8, 4, BS)
    new.span = (12, 16)
    new.add_logs([14, 16], 32)
    new.kv.zero_()
    for rows in new.logs.values():
        rows.zero_()
    new.take_over(old, [1, 3])
    for b in (1, 3):
        sl = slice(b * BS, (b + 1) * BS)
        assert torch.equal(new.kv[:2, :, :, sl], old.kv[2:, :, :, sl])  # layers 12, 13
        assert torch.equal(new.logs[14][sl], old.logs[14][sl])
    assert not new.kv[:, :, :, 0: BS].any() and not new.kv[2:].any() and not new.logs[16].any()
