"""--batch-invariant: the setting and where it applies (stage_node.invariant.resolve, the stage's flag,
load_shard), a CPU stage left on its own row kinds, and the host side of the CUDA kernels (tiles of
the attention, the product's configurations). The Triton kernels need a GPU, which no CI machine
has: their checks (a row's bits the same in products of 1 to 512 rows, in any attention tile or
context; closeness to torch) are bench/gpu_invariance.py's, run on the H100 (docs/engine.md)."""
from __future__ import annotations

import pytest
import torch

from logicpipe.stage_node.kernels import invariant
from logicpipe.stage_node.config import Assignment, StageOptions
from logicpipe.stage_node.kernels.invariant import InvariantError, mm_config, resolve, seq_tiles, tile_rows
from logicpipe.stage_node.weights.loading import load_shard
from logicpipe.stage_node.main import parse_args
from logicpipe.stage_node.model.ops import DECODE_ROWS, INVARIANT_ROWS, Rows

from .test_shard import ROPES, tiny_llama


def yes():
    return True


def no():
    return False


@pytest.mark.parametrize("setting", ["auto", "on", "off"])
def test_a_cpu_stage_never_runs_them(setting):
    assert resolve(setting, "cpu", has_triton=yes) is False
    assert resolve(setting, "cpu", has_triton=no) is False  # "on" too: the CPU is invariant by its row kinds


def test_cuda_settings():
    assert resolve("on", "cuda", has_triton=yes) is True
    assert resolve("off", "cuda", has_triton=yes) is False
    assert resolve("auto", "cuda", has_triton=yes) is invariant.AUTO_ON
    assert resolve("auto", "cuda:1", has_triton=no) is False  # said in the log, and the stage goes on
    assert resolve("off", "cuda", has_triton=no) is False
    with pytest.raises(InvariantError, match="needs triton"):
        resolve("on", "cuda", has_triton=no)
    with pytest.raises(ValueError, match="auto, on, off"):
        resolve("yes", "cuda", has_triton=yes)


def test_the_stage_flag():
    assert parse_args([]).batch_invariant == "auto" == StageOptions().batch_invariant
    assert parse_args(["--batch-invariant", "off"]).batch_invariant == "off"
    with pytest.raises(SystemExit):
        parse_args(["--batch-invariant", "always"])


def test_a_cpu_shard_keeps_its_row_kinds(tmp_path):
    """`--batch-invariant on` reaches load_shard; on a CPU it leaves the shard as it was: its
    products by row kind (decode rows by `w @ x.T`, prompt rows by `x @ w.T`), no CUDA kernels."""
    tiny_llama(tmp_path, ROPES["llama3"])
    a = Assignment(model_dir=str(tmp_path), start=0, end=4, num_layers=4, stage_index=0, num_stages=1,
                   next_address="", first_address="", dtype="float32")
    shard, pool = load_shard(a, str(tmp_path), "cpu", StageOptions(batch_invariant="on", max_kv_bytes=2**20))
    assert shard.batch_invariant is False and shard.graphs is None
    assert shard.decode_rows is DECODE_ROWS
    mixed = Rows.split([True, False, True, False], "cpu", invariant=shard.batch_invariant)
    assert not mixed.invariant and mixed.decode.tolist() == [0, 2] and mixed.prompt.tolist() == [1, 3]
    shard.batch_invariant = True  # as on a CUDA stage: one kernel for every kind
    assert shard.decode_rows is INVARIANT_ROWS
    assert Rows.split([True, False], "cpu", invariant=True) is INVARIANT_ROWS
    assert INVARIANT_ROWS.subset([1], "cpu") is INVARIANT_ROWS


@pytest.mark.parametrize("group", [1, 2, 4, 7, 8, 32])
def test_attention_tiles_hold_rows_of_one_sequence(group):
    counts = [1, 5, 16, 3, 40]
    tiles = seq_tiles(counts, group)
    per = tile_rows(group)
    assert per >= 1 and per * group <= max(16, 1 << (group - 1).bit_length())
    starts = [sum(counts[:i]) for i in range(len(counts))]
    covered = []
    for first, n, seq in tiles:
        assert 1 <= n <= per
        assert starts[seq] <= first and first + n <= starts[seq] + counts[seq]  # never across sequences
        covered += range(first, first + n)
    assert covered == list(range(sum(counts)))  # every row once, in order


@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096),
                                  (1000, 2200), (64, 64), (151936, 5120), (3072, 4096), (4096, 2048)])
def test_the_sum_over_k_does_not_follow_the_row_count(n, k):
    """Tiles may follow the row count; the parts of K may not (nor those a consumer adds itself),
    and every BLOCK_K divides the 256 that parts start at (so each part is summed from the same
    place in 16-wide steps)."""
    for dtype in (torch.bfloat16, torch.float16):
        configs = [mm_config(n, k, dtype, m) for m in (1, 2, 8, 16, 32, 33, 64, 100, 128, 129, 512, 4096)]
        assert len({c[5] for c in configs}) == 1
        summed = [mm_config(n, k, dtype, m, invariant.summed_parts(n, k)) for m in (1, 8, 33, 129, 4096)]
        assert {c[5] for c in summed} == {invariant.summed_parts(n, k)} and all(256 % c[2] == 0 for c in summed)
        assert all(256 % c[2] == 0 for c in configs)
        assert mm_config(n, k, dtype, 1)[0] == 16  # decode rows: the skinny tile
    assert len({mm_config(n, k, torch.float32, m) for m in (1, 8, 33, 512)}) == 1  # float32: one tile


def test_a_consumer_that_adds_the_parts_takes_them_split_down_to_half_the_size():
    """A tensor-parallel rank's q/k/v and o of the 8B shape: read whole when a second kernel adds the
    parts (issue 36's H100 figures), in 2 parts when rope_kv or add_norm adds them (H200: 7.1 against
    10.0 us, 4.7 against 5.9; bench/gpu_fused_parts.py); a matrix with column blocks for every SM, or
    a small one, stays whole either way."""
    assert [invariant.k_parts(3072, 4096), invariant.k_parts(4096, 2048)] == [1, 1]
    assert [invariant.summed_parts(3072, 4096), invariant.summed_parts(4096, 2048)] == [2, 2]
    assert invariant.summed_parts(6144, 4096) == 1 and invariant.summed_parts(2048, 2048) == 1
    assert invariant.summed_parts(4096, 14336) == invariant.k_parts(4096, 14336) == 2


def test_a_long_prompts_attention_goes_in_launches_of_enough_rows():
    """A step's attention goes in launches (parts) of whole tiles, in order, each at most part_rows
    rows (one tile where a tile is more); part_rows keeps ATTN_MERGE_PROGRAMS (row, head)s a launch
    while the device's share allows, whatever the context (the 8B shape: 32 heads, 4-row tiles)."""
    tiles = seq_tiles([1, 450], 4)
    tiles_at = [t[0] for t in tiles]
    for cap in (1, 3, 4, 8, 16, 100, 1000):
        parts = invariant.attn_parts(tiles_at, 451, cap)
        assert [a for a, _ in parts] == [0, *[b for _, b in parts[:-1]]] and parts[-1][1] == len(tiles)
        for a, b in parts:
            rows = (tiles_at[b] if b < len(tiles) else 451) - tiles_at[a]
            assert rows <= cap or b == a + 1
    per_row = lambda context: 32 * -(-context // 64) * 130 * 4  # noqa: E731 — bytes of partials a row
    h200 = 139 * 2**30
    floor = -(-invariant.ATTN_MERGE_PROGRAMS // 32)
    for context in (1000, 16_000, 32_300, 64_600, 131_072):
        rows = invariant.part_rows(per_row(context), 32, h200)
        assert rows >= floor and rows >= invariant.ATTN_WORKSPACE // per_row(context)
    assert invariant.part_rows(per_row(131_072), 32, h200) == floor  # the workspace then: 16 rows, 533 MB
    small = 4 * 2**30  # a device whose share cannot hold the floor: what the share holds (3 rows here)
    share = int(small * invariant.ATTN_WORKSPACE_SHARE)
    assert invariant.part_rows(per_row(131_072), 32, small) == share // per_row(131_072)
    assert invariant.part_rows(per_row(131_072), 32, 2**30) == 1  # ... at least one row


def test_a_launchs_partials_share_one_allocation_of_a_size_that_does_not_creep():
    """Max, sum and output of a launch's splits in one float32 allocation, apart and each on 64 bytes;
    an eager step's rounded up to a power of two (its chunks' splits grow a little every step)."""
    for rows, heads, chunks, D, bucket in [(16, 32, 1000, 128, True), (3, 9, 7, 64, True), (1, 32, 33, 128, False)]:
        m, l, acc = invariant.partials(rows, heads, chunks, D, "cpu", bucket=bucket)
        assert m.shape == l.shape == (rows, heads, chunks) and acc.shape == (rows, heads, chunks, D)
        assert m.is_contiguous() and l.is_contiguous() and acc.is_contiguous() and m.dtype == torch.float32
        spans = sorted((t.data_ptr(), t.data_ptr() + 4 * t.numel()) for t in (m, l, acc))
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no overlap
        assert all(t.data_ptr() % 64 == acc.data_ptr() % 64 for t in (m, l))
        size = m.untyped_storage().nbytes() // 4
        assert size >= rows * heads * chunks * (D + 2)
        assert not bucket or size & (size - 1) == 0
    a = invariant.partials(16, 32, 1000, 128, "cpu", bucket=True)[2].untyped_storage().nbytes()
    b = invariant.partials(16, 32, 1007, 128, "cpu", bucket=True)[2].untyped_storage().nbytes()
    assert a == b  # the next step's few more splits: the same size, the block reused
