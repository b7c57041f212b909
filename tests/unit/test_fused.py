"""The fused CUDA kernels of a decoder layer (stage_node.fused) and the fused layer loop
(Shard.layers_fused), run on the CPU through Triton's interpreter (TRITON_INTERPRET=1; float32 and
float16: the interpreter has no bfloat16) against torch: RoPE and the KV write bit for bit, the
residual add bit for bit, the norm and SwiGLU to rounding, the layers against the plain forward.
On the GPU they are checked by bench/gpu_invariance.py and bench/gpu_engine.py (docs/engine.md).
Also the warm-up's bucket list (StepGraphs.buckets) against the buckets steps fall in."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from logicpipe.stage_node.engine.kv import StepKV, seq_slice
from logicpipe.stage_node.model.rope import apply_rope
from logicpipe.stage_node.model.shard import Shard

DTYPES = [torch.float32, torch.float16]
# Triton's interpreter must be chosen before triton is first imported: the kernel tests run in a
# child process started with it (test_kernels_in_triton_interpreter), not in the suite's own
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def test_kernels_in_triton_interpreter():
    pytest.importorskip("triton")
    if INTERPRETED:
        pytest.skip("this is the child process")
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)), "-k",
                        "not in_triton_interpreter and not every_bucket"], cwd=root, capture_output=True, text=True,
                       env=dict(os.environ, TRITON_INTERPRET="1"), timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-2000:]


@pytest.fixture
def interpret():
    if not INTERPRETED:
        pytest.skip("run in Triton's interpreter by test_kernels_in_triton_interpreter")
    from logicpipe.stage_node.kernels import fused

    return fused


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("parts", [1, 2])
def test_add_norm(interpret, dtype, parts):
    g = torch.Generator().manual_seed(parts)
    M, N = 5, 96
    x = torch.randn(M, N, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(N, generator=g)).to(dtype)
    ws = torch.randn(parts, M, N, generator=g).to(torch.float32 if parts > 1 else dtype)
    xo, h = interpret.add_norm(ws, x, w, 1e-5)
    want = x + ws.float().sum(0).to(dtype) if parts > 1 else x + ws[0]
    assert torch.equal(xo, want)  # the parts added in order, rounded, then the residual: as torch does
    ref = (F.rms_norm(want, (N,), w, 1e-5) if dtype == torch.float32
           else w * F.rms_norm(want.float(), (N,), None, 1e-5).to(dtype))
    torch.testing.assert_close(h, ref, rtol=2e-3 if dtype == torch.float16 else 1e-5, atol=1e-5)
    same, h2 = interpret.add_norm(None, x, w, 1e-5)  # a norm alone (a stage's first layer)
    assert same is x
    assert torch.equal(h2[:2], interpret.add_norm(None, x[:2].clone(), w, 1e-5)[1])  # a row's bits: its own
    out, none = interpret.add_norm(ws, x, None, 1e-5)  # an add alone (the last layer)
    assert none is None and torch.equal(out, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_kv_is_apply_rope_and_the_write(interpret, dtype):
    g = torch.Generator().manual_seed(0)
    T, H, KV, HD = 3, 4, 2, 16
    qkv = torch.randn(T, (H + 2 * KV) * HD, generator=g).to(dtype)
    pos, slots = torch.tensor([7, 3, 11]), torch.tensor([5, 0, 9])
    cos, sin = torch.randn(20, HD, generator=g).to(dtype), torch.randn(20, HD, generator=g).to(dtype)
    pool = torch.full((2, KV, 12, HD), float("nan"), dtype=dtype)
    q = interpret.rope_kv(qkv, cos, sin, pos, slots, pool[0], pool[1], H, KV, HD)
    ref = apply_rope(qkv[:, :(H + KV) * HD].view(T, H + KV, HD), cos[pos], sin[pos])
    assert torch.equal(q, ref[:, :H])
    assert torch.equal(pool[0][:, slots].transpose(0, 1), ref[:, H:])
    assert torch.equal(pool[1][:, slots].transpose(0, 1), qkv[:, (H + KV) * HD:].view(T, KV, HD))
    untouched = [s for s in range(12) if s not in slots.tolist()]
    assert pool[:, :, untouched].isnan().all()  # only the rows' slots are written


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_kv_adds_the_products_parts_as_add_parts_would(interpret, dtype):
    from logicpipe.stage_node.kernels import invariant

    g = torch.Generator().manual_seed(1)
    T, H, KV, HD = 3, 4, 2, 16
    ws = torch.randn(2, T, (H + 2 * KV) * HD, generator=g)  # a product's two float32 parts over K
    pos, slots = torch.tensor([7, 3, 11]), torch.tensor([5, 0, 9])
    cos, sin = torch.randn(20, HD, generator=g).to(dtype), torch.randn(20, HD, generator=g).to(dtype)
    pools = torch.full((2, 2, KV, 12, HD), float("nan"), dtype=dtype)
    q = interpret.rope_kv(ws, cos, sin, pos, slots, pools[0, 0], pools[0, 1], H, KV, HD, dtype)
    want = interpret.rope_kv(invariant.add_parts(ws, dtype), cos, sin, pos, slots, pools[1, 0], pools[1, 1], H, KV, HD)
    assert q.dtype == dtype and torch.equal(q, want)
    assert torch.equal(pools[0][:, :, slots], pools[1][:, :, slots])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(interpret, dtype):
    gu = torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(0)).to(dtype)  # several blocks a row
    gate, up = gu.chunk(2, -1)
    torch.testing.assert_close(interpret.silu_mul(gu), F.silu(gate) * up, rtol=2e-3 if dtype == torch.float16 else 1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_adds_the_products_parts_as_add_parts(interpret, dtype):
    """The gate_up product's float32 parts over K (invariant.mm_parts) added in silu_mul's launch: the
    bits of silu_mul over invariant.add_parts' sum (the kernel it replaces), -0.0 included."""
    from logicpipe.stage_node.kernels import invariant

    ws = torch.randn(3, 2, 2 * 1500, generator=torch.Generator().manual_seed(1))
    ws[:, 0, 7] = -0.0
    out = interpret.silu_mul(ws, dtype=dtype)
    assert out.dtype == dtype and torch.equal(out, interpret.silu_mul(invariant.add_parts(ws, dtype)))
    assert not torch.equal(out, interpret.silu_mul(ws[:2].sum(0).to(dtype)))  # (every part counts)


@pytest.mark.parametrize("dtype", DTYPES)
def test_push_add_norm_as_rank_0_of_2(interpret, dtype):
    """tp_reduce.push_add_norm as rank 0 of two whose peer already pushed its rows: the sum in rank
    order rounded once, the residual and the norm bit for bit as add_norm over that sum; its own rows
    pushed into the peer's buffer (-0.0, the empty mark, sent as +0.0); its own regions marked empty
    again after reading, in either slot."""
    from logicpipe.stage_node.kernels import tp_reduce

    g = torch.Generator().manual_seed(3)
    M, N, R, W = 3, 96, 4, 2
    x, peer = torch.randn(M, N, generator=g).to(dtype), torch.randn(M, N, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(N, generator=g)).to(dtype)
    ws = torch.randn(2, M, N, generator=g)
    ws[:, 0, 5] = -0.0
    mine = ws.sum(0).to(dtype)
    want = interpret.add_norm((mine.float() + peer.float()).to(dtype)[None], x, w, 1e-5)
    bufs = [torch.empty(2 * W * R * N, dtype=dtype) for _ in range(W)]
    for b in bufs:
        tp_reduce.clear(b)
    mark = tp_reduce.empty_mark(dtype)
    for slot in (0, 1):
        at = slot * W * R * N
        bufs[0][at + R * N: at + R * N + M * N] = peer.reshape(-1)  # rank 1's region of rank 0's slot
        got = tp_reduce.push_add_norm(ws, x, w, 1e-5, bufs=bufs, slot=slot, rank=0, rows=R)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        sent = bufs[1][at: at + M * N].view(M, N)
        assert torch.equal(sent, mine) and sent[0, 5].item() == 0 and (sent.view(tp_reduce.INT_OF[dtype]) != mark).all()
        assert (bufs[0].view(tp_reduce.INT_OF[dtype]) == mark).all()
        tp_reduce.clear(bufs[1])


def test_attention_rounds_its_rows_for_the_one_row_int4_kernel(interpret):
    """invariant.attention's `rounded`: the merge also writes its output's rounding for the one-row int4
    product after it (o's), round_rows' bytes, a and S exactly, in its own launch; a head dim of 96 (three
    groups of 32 in a block of 128); the output itself unchanged; a head dim off groups of 32 refused."""
    from logicpipe.stage_node.kernels import gpu_quant, gpu_quant_kernels, invariant

    g = torch.Generator().manual_seed(4)
    heads, kvh, hd, L = 2, 1, 96, 70
    kp, vp = torch.randn(kvh, L, hd, generator=g), torch.randn(kvh, L, hd, generator=g)
    q = torch.randn(3, heads, hd, generator=g)
    q[1, 0, 5] = 40.0  # (a large entry: its group's power of two apart from the others')
    pos = torch.tensor([3, 64, 69])
    r = torch.arange(3, dtype=torch.int32)
    tiles = torch.stack([r, torch.ones_like(r), torch.zeros_like(r)])
    args = (q, kp, vp, torch.arange(L)[None], pos, tiles)
    out, (xd, aux) = invariant.attention(*args, scale=hd ** -0.5, rounded=True)
    assert torch.equal(out, invariant.attention(*args, scale=hd ** -0.5))
    want = gpu_quant.round_rows(out, gpu_quant_kernels.LAYOUT_DP)
    assert torch.equal(xd, want[0]) and torch.equal(aux, want[1])
    with pytest.raises(ValueError, match="multiple of 32"):
        invariant.attention(q[:, :, :16].contiguous(), kp[:, :, :16].contiguous(), vp[:, :, :16].contiguous(),
                            *args[3:], scale=0.25, rounded=True)


@pytest.mark.parametrize("window, sinks, chunk", [(None, False, None), (40, True, None), (None, False, 128)])
def test_attention_over_several_splits(interpret, window, sinks, chunk, monkeypatch):
    """stage_node.invariant.attention over 130 positions (three splits of ATTN_CHUNK, merged CB at a time; the
    window skips the last rows' first split) against softmax attention in float64; a row's bits the same
    alone in a tile with its sequence's slot table and with a longer one (a graph's: splits past its own are
    not read), and as the first row of a prompt's tile; with `sinks` (gpt-oss), a logit per head that joins
    every row's softmax once, whatever the splits; `chunk`, splits of two blocks of keys (the kernel reads a
    split's first block's slots before its dependent launch's wait, the others' in its loop). (Rows further
    down a prompt's tile are checked on the GPU, bench/gpu_invariance.py: the interpreter's numpy products
    give rows of one tile other bits by their place in it.)"""
    from logicpipe.stage_node.kernels import invariant

    if chunk:
        monkeypatch.setattr(invariant, "ATTN_CHUNK", chunk)
    g = torch.Generator().manual_seed(0)
    heads, kvh, hd, L = 4, 2, 16, 130  # (the interpreter: ~60 ms a row, most in the merge of its 4 heads)
    assert L > (1 if chunk else 2) * invariant.ATTN_CHUNK and invariant.ATTN_CHUNK == (chunk or invariant.ATTN_BLOCK_N)
    kp, vp = torch.randn(kvh, L + 40, hd, generator=g), torch.randn(kvh, L + 40, hd, generator=g)
    slots = torch.randperm(L + 40, generator=g)[:L]
    q = torch.randn(L, heads, hd, generator=g)
    pos = torch.arange(L)
    sink = torch.randn(heads, generator=g) * 2 if sinks else None
    kw = dict(scale=hd ** -0.5, window=window, sinks=sink)
    per = invariant.tile_rows(heads // kvh)
    prompt = invariant.attention(q, kp, vp, slots[None], pos, invariant.tiles_tensor(
        invariant.seq_tiles([L], heads // kvh), "cpu"), **kw)
    rows = torch.tensor([0, 63, 64, 100, 129])
    r = torch.arange(len(rows), dtype=torch.int32)
    alone = torch.stack([r, torch.ones_like(r), torch.zeros_like(r)])
    exact = invariant.attention(q[rows], kp, vp, slots[None], pos[rows], alone, **kw)
    table = torch.zeros(len(rows), 256, dtype=torch.long)
    table[:, :L] = slots
    padded = invariant.attention(q[rows], kp, vp, table, pos[rows], torch.stack([r, torch.ones_like(r), r]), **kw)
    assert torch.equal(exact, padded)
    first = [i for i, row in enumerate(rows.tolist()) if row % per == 0]
    assert first and torch.equal(exact[first], prompt[rows[first]])
    k = kp[:, slots].double().repeat_interleave(heads // kvh, 0)
    v = vp[:, slots].double().repeat_interleave(heads // kvh, 0)
    s = q.double().transpose(0, 1) @ k.transpose(1, 2) * kw["scale"]
    seen = pos[None, :] <= pos[:, None]
    if window:
        seen &= pos[None, :] > pos[:, None] - window
    s = s.masked_fill(~seen, float("-inf"))
    if sinks:  # the sink's column joins the softmax, its share then dropped
        s = torch.cat([s, sink.double()[:, None, None].expand(-1, L, 1)], -1)
    ref = (torch.softmax(s, -1)[..., :L] @ v).transpose(0, 1).reshape(L, -1)
    torch.testing.assert_close(prompt.double(), ref, rtol=1e-5, atol=1e-5)


def plain_llama(path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)


def test_layers_fused_match_the_forward(interpret, tmp_path):
    """Two sequences (a prompt of 5 rows from position 0, 2 rows after 6 positions already held)
    through the fused layers and through the plain forward: the same hidden states (to float32
    rounding) and the same keys and values in the pool."""
    from logicpipe.stage_node.kernels import invariant

    plain_llama(tmp_path)
    shard = Shard.load(tmp_path, 0, 3, first=False, last=False)
    shard.batch_invariant = True
    assert not shard.fused_layers  # a CPU shard never runs them
    bs = 4
    pools = [shard.new_pool(8, bs) for _ in range(2)]
    g = torch.Generator().manual_seed(3)
    held = torch.randn(6, 64, generator=g)
    for p in pools:  # the second sequence's first 6 positions, blocks 4, 5
        shard.forward(held, StepKV(p, torch.tensor([16, 17, 18, 19, 20, 21]), (seq_slice(0, 6, [4, 5], bs),)))
    x = torch.randn(7, 64, generator=g)
    seqs = (seq_slice(0, 5, [0, 1], bs), seq_slice(6, 2, [4, 5], bs))
    write = torch.tensor([0, 1, 2, 3, 4, 22, 23])
    shard.batch_invariant = False
    want = shard.forward(x, StepKV(pools[0], write, seqs))
    shard.batch_invariant = True
    kv = StepKV(pools[1], write, seqs)
    table, positions, tiles, tiles_at = shard._invariant_reads(kv)
    rope = shard.ropes["full"]

    def attend(i, q):
        return invariant.attention(q, kv.pool.k[i], kv.pool.v[i], table, positions, tiles, scale=shard._scale)

    got = shard.layers_fused(x, positions, write, kv.pool.kv, {"full": (rope.cos, rope.sin_signed)}, attend)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    used = write.tolist() + list(range(16, 22))
    torch.testing.assert_close(pools[1].kv[:, :, :, used], pools[0].kv[:, :, :, used], rtol=1e-4, atol=1e-4)


def test_gpt_oss_with_the_invariant_attention_matches_the_forward(interpret, tmp_path):
    """gpt-oss (sinks, sliding and full layers, experts) with the batch-invariant attention (its
    kernels in the interpreter; the products stay the CPU's row kinds): a prompt past the window and a
    second sequence's two rows after 11 held positions give the eager forward's hidden states."""
    from tests.families import WINDOW, build

    shard = Shard.load(build("gpt_oss", tmp_path / "m"), 0, 3, first=False, last=False)
    bs, hidden = 4, shard.config.hidden_size
    pools = [shard.new_pool(16, bs) for _ in range(2)]
    g = torch.Generator().manual_seed(3)
    held = torch.randn(11, hidden, generator=g)
    for p in pools:  # the second sequence's first 11 positions, blocks 8, 9, 10
        shard.forward(held, StepKV(p, torch.arange(32, 43), (seq_slice(0, 11, [8, 9, 10], bs),)))
    n = 2 * WINDOW + 1
    x = torch.randn(n + 2, hidden, generator=g)
    seqs = (seq_slice(0, n, [0, 1, 2, 3, 4], bs), seq_slice(11, 2, [8, 9, 10, 11], bs))
    write = torch.tensor(list(range(n)) + [43, 44])
    outs = []
    for on, pool in zip((False, True), pools):
        shard.batch_invariant = on
        outs.append(shard.forward(x, StepKV(pool, write, seqs)))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_windows_held_with_the_invariant_attention(interpret, tmp_path, family):
    """Sliding-window layers that hold only their window (engine.window) read by the batch-invariant
    attention, eagerly and in the step-graph body: decode rows after a prompt past two windows give the
    torch forward's logits over the same windows, block tables starting with holes (Mistral) or the
    window layers' own pool (Gemma 3). (The fused layer loop reads through the same tables.)"""
    from tests.families import WINDOW, build
    from tests.unit.paged import PagedCache

    path = build(family, tmp_path / "m")
    prompt = [(7 * i + 3) % 500 for i in range(2 * WINDOW + 2)]

    def run(invariant: bool, graphs: bool) -> torch.Tensor:
        """The prompt by the torch forward (the interpreter's attention over 18 rows takes seconds), then
        3 decode rows by the kernels under test -> their logits."""
        shard = Shard.load(path, 0, 3, first=True, last=True)
        cache = PagedCache(shard, 24, 4, window=True, rollback=4, group_blocks=16, graphs=graphs)
        body, cache.graphs = cache.graphs, None
        ids, pos, logits = prompt, 0, []
        for _ in range(4):
            h = cache.forward(shard.embed(torch.tensor(ids)), [("s", pos, ids)], decode_from={"s": len(prompt)})
            pos += len(ids)
            logits.append(shard.logits(h[-1:]))
            ids = [int(logits[-1].argmax())]
            shard.batch_invariant, cache.graphs = invariant, body
        assert shard.window == WINDOW and -1 in (cache.kv.group if shard.window_layers else cache.kv).tables["s"].blocks
        assert body is None or body.replays == 3
        return torch.cat(logits[1:])

    want = run(False, False)
    for graphs in (False, True):
        torch.testing.assert_close(run(True, graphs), want, rtol=1e-4, atol=1e-4)


def test_every_bucket_is_warmed(tmp_path):
    """StepGraphs.buckets (what the start-up captures) holds the bucket of every step that has one."""
    from logicpipe.stage_node.engine.step_graphs import StepGraphs

    plain_llama(tmp_path)
    shard = Shard.load(tmp_path, 0, 3, first=True, last=True)
    graphs = StepGraphs(shard, shard.new_pool(40, 16), capture=False)
    buckets = graphs.buckets()
    assert len(buckets) == len(set(buckets))
    for rows in range(1, graphs.row_buckets[-1] + 1):
        for stop in range(1, graphs.max_context + 1, 7):
            assert graphs.bucket(rows, stop) in buckets
    assert graphs.bucket(graphs.row_buckets[-1] + 1, 1) is None
