"""The CUDA-graph step body (stage_node.step_graphs), run eagerly on the CPU, against the forward:
same hidden states and same keys/values written, for single rows, several rows of one sequence
and scattered blocks; padding rows touch only the scratch slot."""
from __future__ import annotations

import pytest
import torch

from logicpipe.stage_node.engine.kv import StepKV, seq_slice
from logicpipe.stage_node.model.shard import Shard
from logicpipe.stage_node.engine.step_graphs import MIN_CONTEXT, ROW_BUCKETS, GraphRow, StepGraphs

from .test_shard import ROPES, assert_close, tiny_llama

BS = 4  # block size


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_llama(path, ROPES["llama3"])  # 128 positions
    return Shard.load(path, 1, 4, first=False, last=False)


def prefill(shard, pool, blocks, n, seed):
    """Write n positions of a sequence with `blocks` through the eager forward."""
    x = torch.randn(n, shard.config.hidden_size, generator=torch.Generator().manual_seed(seed))
    slots = torch.tensor([blocks[p // BS] * BS + p % BS for p in range(n)])
    shard.forward(x, StepKV(pool, slots, (seq_slice(0, n, blocks, BS),)))


def step_rows(seqs):
    """seqs: (blocks, start, rows) -> a GraphRow per new row."""
    return [GraphRow(start + j, blocks[(start + j) // BS] * BS + (start + j) % BS, blocks)
            for blocks, start, n in seqs for j in range(n)]


def test_graph_body_matches_forward(shard):
    torch.manual_seed(0)
    pool_a, pool_b = shard.new_pool(40, BS), shard.new_pool(40, BS)
    pool_b.kv.zero_()  # as on a GPU: a graph reads masked positions, which must not hold NaN
    # three sequences: consecutive blocks, scattered blocks, one longer than a block table bucket row
    seqs = [([0, 1, 2, 3], 13, 1), ([9, 4, 17, 6, 30], 17, 3), ([20, 21, 22, 5, 8, 11, 12, 13, 14], 30, 1)]
    for pool in (pool_a, pool_b):
        for i, (blocks, start, _) in enumerate(seqs):
            prefill(shard, pool, blocks, start, seed=i)
    n = sum(r for _, _, r in seqs)
    x = torch.randn(n, shard.config.hidden_size)
    slots = torch.tensor([r.write_slot for r in step_rows(seqs)])
    kv = StepKV(pool_a, slots, tuple(seq_slice(start, r, blocks, BS, decode_from=0) for blocks, start, r in seqs))
    want = shard.forward(x, kv)
    graphs = StepGraphs(shard, pool_b, capture=False)
    got = graphs.forward(x, step_rows(seqs))
    assert got.shape == want.shape
    assert_close(got, want, rtol=1e-5)
    held = torch.tensor([b * BS + p % BS for blocks, start, r in seqs
                         for p in range(start + r) for b in [blocks[p // BS]]])  # every position written
    for a, b in ((pool_a.k, pool_b.k), (pool_a.v, pool_b.v)):
        assert (a[:, :, held] - b[:, :, held]).abs().max() < 1e-5
    assert graphs.graphs.keys() == {(8, 128)}  # 5 rows -> the 8-row bucket; the model's 128 positions
    assert graphs.replays == 1


def test_padding_rows_write_only_the_scratch_slot(shard):
    pool = shard.new_pool(8, BS)
    pool.kv.zero_()  # torch.empty may hold NaNs, which never compare equal
    prefill(shard, pool, [2, 3], 6, seed=3)
    k0, v0 = pool.k[:, :, : pool.scratch_slot].clone(), pool.v[:, :, : pool.scratch_slot].clone()
    graphs = StepGraphs(shard, pool, capture=False)
    rows = step_rows([([2, 3], 6, 1)])
    out = graphs.forward(torch.randn(1, shard.config.hidden_size), rows)  # the 1-row bucket: no padding
    assert out.shape == (1, shard.config.hidden_size)
    rows3 = step_rows([([2, 3], 7, 1)]) + step_rows([([5], 0, 2)])  # 3 rows -> the 4-row bucket, 1 padding row
    graphs.forward(torch.randn(3, shard.config.hidden_size), rows3)
    written = {3 * BS + 2, 3 * BS + 3, 5 * BS, 5 * BS + 1}  # positions 6, 7 of [2, 3]; 0, 1 of [5]
    changed = {s for s in range(pool.scratch_slot) if not torch.equal(pool.k[:, :, s], k0[:, :, s])}
    assert changed <= written and changed
    assert {s for s in range(pool.scratch_slot) if not torch.equal(pool.v[:, :, s], v0[:, :, s])} <= written


def test_buckets(shard):
    graphs = StepGraphs(shard, shard.new_pool(4, BS), capture=False)
    assert graphs.max_context == 128 < MIN_CONTEXT  # buckets stop at the model's positions
    assert graphs.bucket(1, 1) == (1, 128)
    assert graphs.bucket(3, 100) == (4, 128)
    assert graphs.bucket(graphs.row_buckets[-1], 10) == (graphs.row_buckets[-1], 128)
    assert graphs.bucket(graphs.row_buckets[-1] + 1, 10) is None  # too many rows: eager
    assert graphs.bucket(1, 129) is None  # past the model's positions: eager
    assert graphs.row_buckets[-1] == 32  # without the batch-invariant kernels the body gathers keys: 32 rows at most
    shard.batch_invariant = True
    try:  # with them (CUDA's default), steps of up to 256 rows have a graph (issue 32)
        assert StepGraphs(shard, shard.new_pool(4, BS), capture=False).row_buckets == ROW_BUCKETS
    finally:
        shard.batch_invariant = False
    graphs.max_context = 4096
    assert graphs.bucket(2, 300) == (2, 512) and graphs.bucket(5, 4000) == (8, 4096)
    graphs.disabled = True
    assert graphs.bucket(1, 1) is None
