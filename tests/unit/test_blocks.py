"""The KV manager: block tables, reference counts, fork and copy on write, truncate, the prefix
cache (hit, miss, eviction), placement; after every test the pool is back to all blocks free."""
from __future__ import annotations

import pytest

from logicpipe.stage_node.engine.blocks import BlockState, KVManager, OutOfBlocks

BS = 4


@pytest.fixture
def kv():
    m = KVManager(16, BS)
    yield m
    for seq in list(m.tables):
        m.close(seq)
    assert m.used == 0 and m.available == m.num_blocks, "blocks leaked"
    assert all(b.ref_count == 0 for b in m.blocks.values())
    assert m.counts[BlockState.RESERVED] == 0, "growth room left reserved"


def write(kv: KVManager, seq: str, start: int, tokens: list[int]):
    plan = kv.prepare_write(seq, start, len(tokens))
    kv.commit(seq, start, tokens)
    return plan


def test_a_sequence_grows_block_by_block_in_consecutive_blocks(kv):
    kv.open("a", capacity=12)
    plan = write(kv, "a", 0, [1, 2, 3])
    assert len(kv.tables["a"].blocks) == 1 and plan.copies == ()
    write(kv, "a", 3, [4, 5, 6, 7, 8])
    t = kv.tables["a"]
    assert t.length == 8 and len(t.blocks) == 2 and t.blocks[1] == t.blocks[0] + 1
    assert kv.used == 2
    # positions map to slots block * BS + offset
    assert kv.prepare_write("a", 8, 1).slots == (t.blocks[2] * BS,)
    kv.commit("a", 8, [9])
    assert kv.read_span("a", 9) == tuple(t.blocks[:3])


def test_growth_room_keeps_sequences_apart(kv):
    kv.open("a", capacity=4 * BS)
    kv.open("b", capacity=4 * BS)
    write(kv, "a", 0, [1])
    write(kv, "b", 0, [2])
    for i in range(1, 4 * BS):  # both grow in turn; each still gets consecutive blocks
        write(kv, "a", i, [1])
        write(kv, "b", i, [2])
    for seq in "ab":
        blocks = kv.tables[seq].blocks
        assert blocks == list(range(blocks[0], blocks[0] + 4)), blocks


def test_fork_shares_blocks_and_copies_on_write(kv):
    kv.open("p")
    write(kv, "p", 0, list(range(6)))  # one full block, one half block
    p_blocks = list(kv.tables["p"].blocks)
    kv.fork("p", "c", 6)
    assert kv.tables["c"].blocks == p_blocks
    assert [kv.blocks[b].ref_count for b in p_blocks] == [2, 2]
    assert kv.used == 2
    plan = write(kv, "c", 6, [100])  # into the shared half block: copied first
    c_blocks = kv.tables["c"].blocks
    assert c_blocks[0] == p_blocks[0] and c_blocks[1] != p_blocks[1]
    assert plan.copies == ((p_blocks[1], c_blocks[1]),)
    assert [kv.blocks[b].ref_count for b in p_blocks] == [2, 1]
    plan = write(kv, "p", 6, [200])  # the parent's block is its own again: no copy
    assert plan.copies == () and kv.tables["p"].blocks == p_blocks
    kv.close("p")
    assert kv.blocks[p_blocks[0]].ref_count == 1  # the child still holds the full block
    kv.close("c")


def test_fork_of_part_of_a_sequence(kv):
    kv.open("p")
    write(kv, "p", 0, list(range(10)))
    kv.fork("p", "c", 5)
    assert kv.tables["c"].length == 5 and kv.tables["c"].tokens == list(range(5))
    with pytest.raises(ValueError):
        kv.fork("p", "d", 11)


def test_truncate_rolls_back_and_frees_whole_blocks(kv):
    kv.open("a")
    write(kv, "a", 0, list(range(10)))
    assert kv.used == 3
    kv.truncate("a", 4)
    assert kv.tables["a"].length == 4 and kv.used == 1 and kv.tables["a"].tokens == [0, 1, 2, 3]
    # a write below the length rolls back too (rejected candidates)
    write(kv, "a", 4, [7, 8, 9])
    write(kv, "a", 5, [1])
    assert kv.tables["a"].tokens == [0, 1, 2, 3, 7, 1]
    with pytest.raises(ValueError):
        kv.truncate("a", 7)


def test_prefix_cache_hit_and_miss(kv):
    prompt = list(range(10, 21))  # 11 tokens: two full blocks and three more
    kv.open("a")
    write(kv, "a", 0, prompt)
    kv.close("a")  # its two full blocks stay cached
    assert kv.counts[BlockState.CACHED] == 2 and kv.used == 0
    kv.open("b")
    assert kv.attach_prefix("b", prompt + [99]) == 2 * BS
    assert kv.used == 2 and kv.counts[BlockState.CACHED] == 0
    kv.open("c")
    assert kv.attach_prefix("c", prompt[:BS] + [0] * BS) == BS  # first block hits, the second differs
    assert kv.blocks[kv.tables["c"].blocks[0]].ref_count == 2
    kv.open("d")
    assert kv.attach_prefix("d", [5] + prompt) == 0  # same tokens at other positions: a miss
    assert kv.prefix_hit_tokens == 3 * BS


def test_writing_into_a_cached_block_unregisters_it(kv):
    kv.open("a")
    write(kv, "a", 0, [1, 2, 3, 4, 5])
    b0 = kv.tables["a"].blocks[0]
    assert kv.blocks[b0].hash is not None
    write(kv, "a", 2, [9])  # roll back into the full block and change it
    assert kv.blocks[b0].hash is None
    kv.close("a")
    kv.open("b")
    assert kv.attach_prefix("b", [1, 2, 3, 4, 5]) == 0


def test_cached_blocks_are_evicted_least_recently_used_first(kv):
    for i, seq in enumerate("abcd"):  # four cached blocks, each 4 positions of different tokens
        kv.open(seq)
        write(kv, seq, 0, [i] * BS)
        kv.close(seq)
    assert kv.counts[BlockState.CACHED] == 4
    kv.open("big", capacity=12 * BS)
    write(kv, "big", 0, [7] * (13 * BS))  # 13 blocks: the 12 free ones and the oldest cached one
    assert kv.counts[BlockState.CACHED] == 3
    kv.open("x")
    assert kv.attach_prefix("x", [0] * BS) == 0   # "a" was evicted
    kv.close("x")
    kv.open("y")
    assert kv.attach_prefix("y", [1] * BS) == BS  # "b" is still there


def test_out_of_blocks_is_all_or_nothing(kv):
    kv.open("a")
    write(kv, "a", 0, [1] * (15 * BS))
    kv.open("b")
    with pytest.raises(OutOfBlocks) as err:
        kv.prepare_write("b", 0, 2 * BS + 1)
    assert err.value.missing == 2
    assert kv.tables["b"].blocks == [] and kv.used == 15
    with pytest.raises(OutOfBlocks):
        kv.reserve("b", 3 * BS)
    kv.reserve("b", BS)
    assert kv.available == 0


def test_reserve_then_write_uses_the_reserved_blocks(kv):
    kv.open("a", capacity=3 * BS)
    kv.reserve("a", 2 * BS + 1)
    reserved = list(kv.tables["a"].blocks)
    assert len(reserved) == 3 and kv.tables["a"].length == 0
    write(kv, "a", 0, [1] * (2 * BS + 1))
    assert kv.tables["a"].blocks == reserved


def test_a_big_pool_makes_its_blocks_on_first_use():
    """A pool of millions of blocks (a small model's KV in a big budget) starts at once: a block is
    made when first used, a fresh one free and empty, and a block past the pool is an error."""
    m = KVManager(4_000_000, BS)
    assert len(m.blocks) == 0
    m.open("a", capacity=3 * BS)
    write(m, "a", 0, [1] * (3 * BS))
    assert len(m.blocks) == 3 and [m.blocks[b].ref_count for b in m.tables["a"].blocks] == [1, 1, 1]
    assert m.blocks[3_999_999].ref_count == 0 and m.blocks[3_999_999].hash is None
    with pytest.raises(IndexError):
        m.blocks[4_000_000]
