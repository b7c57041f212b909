"""A stage's prefix cache on disk (engine.kv_store, issue 34): records read back as written; a torn
tail (a SIGKILL mid-write) and damaged records are skipped, never raised; a store of another key
is removed; the cap drops the oldest segments whole."""
from __future__ import annotations

import random
from argparse import Namespace
from pathlib import Path

import torch

from logicpipe.stage_node.engine.blocks import block_hash
from logicpipe.stage_node.engine.kv import KVPool
from logicpipe.stage_node.engine.kv_store import HEADER, KvStore, ReadStats, Record
from logicpipe.stage_node.main import kv_disk_dir, kv_disk_mib
from logicpipe.stage_node.net.kv_disk import block_bytes, read_block_bytes, write_block_bytes

BS, KV = 4, 64  # positions per block, KV bytes per block
KEY = {"model_digest": "abc", "start": 0, "end": 2, "block_size": BS, "kv_dtype": "torch.float32"}


def chain(seed: int, n: int) -> list[Record]:
    """n blocks of one sequence, each with its hash over the one before and random KV bytes."""
    rng, out, prev = random.Random(seed), [], None
    for _ in range(n):
        tokens = tuple(rng.randrange(50_000) for _ in range(BS))
        h = block_hash(prev, tokens)
        out.append(Record(h, prev, tokens, rng.randbytes(KV)))
        prev = h
    return out


def reopened(tmp_path, cap: int = 1 << 20, key=KEY) -> tuple[KvStore, list[Record], ReadStats]:
    store, stats = KvStore(tmp_path, cap), ReadStats()
    return store, (store.read(stats) if store.open(key, KV) else []), stats


def test_blocks_written_are_read_back_by_a_new_process_and_it_appends_to_a_segment_of_its_own(tmp_path):
    a, b = chain(1, 5), chain(2, 3)
    store = KvStore(tmp_path, 1 << 20)
    assert not store.open(KEY, KV)  # nothing there yet
    store.append(a[:2])
    store.append(a[2:] + b)
    assert set(store.index) == {r.hash for r in a + b}
    store2, got, stats = reopened(tmp_path)
    assert got == a + b and (stats.bad, stats.torn) == (0, 0)
    assert got[0].previous is None and got[1].previous == a[0].hash
    store2.append(chain(3, 1))
    assert len(store2.segments) == 2  # (never after the first process's tail)
    _, got, _ = reopened(tmp_path)
    assert len(got) == 9


def test_a_torn_tail_is_skipped_and_the_records_before_it_kept(tmp_path):
    recs = chain(4, 4)
    store = KvStore(tmp_path, 1 << 20)
    store.open(KEY, KV)
    store.append(recs)
    seg = store._path(next(iter(store.segments)))
    data = seg.read_bytes()
    for cut in (3, HEADER.size + 2, HEADER.size + 4 * BS + KV // 2):  # inside a header, the tokens, the KV
        seg.write_bytes(data[: len(data) - (HEADER.size + 4 * BS + KV) + cut])
        _, got, stats = reopened(tmp_path)
        assert got == recs[:3] and stats.torn == 1


def test_a_record_whose_bytes_or_hash_do_not_match_is_skipped(tmp_path):
    recs = chain(5, 3)
    forged = Record(recs[1].hash, recs[1].previous, (9, 9, 9, 9), b"\0" * KV)  # a hash not of its tokens
    store = KvStore(tmp_path, 1 << 20)
    store.open(KEY, KV)
    store.append([recs[0], forged, *recs[1:]])
    seg = store._path(next(iter(store.segments)))
    data = bytearray(seg.read_bytes())
    data[-1] ^= 0xFF  # the last record's KV damaged: its checksum fails
    seg.write_bytes(bytes(data))
    _, got, stats = reopened(tmp_path)
    assert got == recs[:2] and stats.bad == 2 and stats.torn == 0


def test_a_store_of_another_model_or_layer_range_is_removed(tmp_path):
    store = KvStore(tmp_path, 1 << 20)
    store.open(KEY, KV)
    store.append(chain(6, 3))
    _, got, _ = reopened(tmp_path, key={**KEY, "end": 3})
    assert got == [] and not list(tmp_path.glob("seg-*.kv"))
    _, got, _ = reopened(tmp_path)  # (the key now on disk is the other one's)
    assert got == []


def test_the_cap_drops_the_oldest_segments_whole(tmp_path):
    record = HEADER.size + 4 * BS + KV
    store = KvStore(tmp_path, 16 * record)  # segments of 2 records
    store.open(KEY, KV)
    recs = chain(7, 40)
    for i in range(0, 40, 2):
        store.append(recs[i:i + 2])
    assert store.bytes <= 16 * record and store.dropped_segments > 0
    kept = [r.hash for r in recs[-(store.bytes // record):]]
    assert list(store.index) == kept  # the newest blocks, and the index knows which are gone
    _, got, _ = reopened(tmp_path, cap=16 * record)
    assert [r.hash for r in got] == kept


def test_a_blocks_bytes_written_into_another_pool_are_the_same_kv():
    a, b = (KVPool(3, 2, 8, 6, BS, dtype=torch.bfloat16) for _ in range(2))
    a.kv.copy_(torch.randn(a.kv.shape))
    b.kv.zero_()
    data = read_block_bytes(a, [4, 1])
    assert [len(d) for d in data] == [block_bytes(a)] * 2 == [3 * 2 * 2 * BS * 8 * 2] * 2
    write_block_bytes(b, [0, 5], data)
    for src, dst in ((4, 0), (1, 5)):
        assert torch.equal(b.kv[:, :, :, dst * BS:(dst + 1) * BS], a.kv[:, :, :, src * BS:(src + 1) * BS])
    assert not b.kv[:, :, :, BS:5 * BS].any()  # nothing else written


def test_the_store_flag_defaults_to_the_pool_size_up_to_a_cap_and_lives_per_node_in_the_state_dir():
    assert kv_disk_mib(Namespace(kv_disk_mib=None, max_kv_mib=256)) == 256
    assert kv_disk_mib(Namespace(kv_disk_mib=None, max_kv_mib=8192)) == 1024
    assert kv_disk_mib(Namespace(kv_disk_mib=0, max_kv_mib=8192)) == 0
    assert kv_disk_dir(Path("/s"), "gpu-a/../b") == Path("/s/kv-gpu-a_.._b")
