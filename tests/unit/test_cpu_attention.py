"""cpu_quant.c's lp_attend over float32 KV (a CPU stage's attention, read in place from the paged pool):
the same as torch's SDPA over each sequence's gathered keys, and a row's bits independent of its step."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from logicpipe.stage_node.kernels import cpu_native

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="no C compiler: no native attention")


def case(lengths: list[int], rows: list[int], *, kvh: int = 2, heads: int = 6, hd: int = 64, seed: int = 0):
    """Sequences of `lengths` positions on scattered slots of one pool; each sequence's last `rows[i]`
    positions are the step's rows (a prompt chunk, or 1: a decode row). -> q, k, v, table, row_seq, pos"""
    g = torch.Generator().manual_seed(seed)
    slots = sum(lengths) + 7
    k = torch.randn(kvh, slots, hd, generator=g)
    v = torch.randn(kvh, slots, hd, generator=g)
    perm = torch.randperm(slots, generator=g)
    table = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    at = 0
    for i, n in enumerate(lengths):
        table[i, :n] = perm[at: at + n]
        at += n
    pos = torch.cat([torch.arange(n - r, n) for n, r in zip(lengths, rows)])
    row_seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(rows))
    q = torch.randn(len(pos), heads, hd, generator=g) * 2  # peaked softmaxes: the running max moves
    return q, k, v, table, row_seq, pos


def reference(q, k, v, table, row_seq, pos, window: int, scale: float) -> torch.Tensor:
    """Each row by torch's SDPA over its sequence's gathered keys and values (grouped-query heads)."""
    out = []
    for r in range(len(pos)):
        p = int(pos[r])
        lo = max(0, p - window + 1) if window else 0
        idx = table[row_seq[r], lo: p + 1]
        out.append(F.scaled_dot_product_attention(q[r][None, :, None], k[:, idx][None], v[:, idx][None],
                                                  scale=scale, enable_gqa=True)[0, :, 0].reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize("window", [0, 70])
def test_native_attention_equals_sdpa_on_gathered_keys(window):
    # a 40-row prompt chunk over 300 positions (causal within the chunk, several 64-position blocks), two
    # decode rows, a short prompt; 3 query heads a KV head
    q, k, v, table, row_seq, pos = case([300, 129, 5, 64], [40, 1, 5, 1])
    out = cpu_native.attend(q, k, v, table, row_seq, pos, window, 0.125)
    ref = reference(q, k, v, table, row_seq, pos, window, 0.125)
    assert torch.allclose(out, ref, atol=2e-5, rtol=1e-4), (out - ref).abs().max()


def test_native_attention_heads_without_grouping_and_odd_head_dim():
    q, k, v, table, row_seq, pos = case([90, 33], [3, 1], kvh=4, heads=4, hd=20, seed=1)  # no AVX2 lanes
    out = cpu_native.attend(q, k, v, table, row_seq, pos, 0, 0.2)
    assert torch.allclose(out, reference(q, k, v, table, row_seq, pos, 0, 0.2), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [0, 70])
def test_native_attention_row_independent_of_its_step(window):
    """A row's bits are the same alone, among other sequences' rows and inside a prompt chunk."""
    q, k, v, table, row_seq, pos = case([300, 129, 5, 64], [40, 1, 5, 1])
    out = cpu_native.attend(q, k, v, table, row_seq, pos, window, 0.125)
    for r in (0, 17, 39, 40, 44, 45):  # rows of the chunk, a decode row, the short prompt, the last decode row
        alone = cpu_native.attend(q[r: r + 1], k, v, table, row_seq[r: r + 1], pos[r: r + 1], window, 0.125)
        assert torch.equal(alone[0], out[r]), r
    with_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(cpu_native.attend(q, k, v, table, row_seq, pos, window, 0.125), out)
    finally:
        torch.set_num_threads(with_threads)


def test_native_attention_refuses_mixed_kv():
    q, k, v, table, row_seq, pos = case([10], [1])
    with pytest.raises(ValueError, match="float32 KV"):
        cpu_native.attend(q, k.to(torch.int8), v.to(torch.int8), table, row_seq, pos, 0, 0.125)
