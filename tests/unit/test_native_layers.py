"""A CPU stage's layers in one native call (stage_node.model.native_layers, cpu_quant.c's lp_layers):
which shards take it, the same numbers as the torch forward over the same quantized weights (up to
float rounding), and every row computed on its own: a sequence's rows have the same bits alone or
among others, in one prompt chunk or several, as decode rows and in a replay.

Tolerance against the torch forward. Both run the same native products on the same packed weights;
they differ in the float order of the norms, RoPE and attention (SDPA's blocked softmax against a
row's plain one), about 1e-6 relative, which can move an activation across an int16 rounding step of
the products (1 / 32767 of its block's largest value). Through 3 layers that stays far below 1e-3 of
the hidden states' scale; a wrong RoPE, mask, window, bias or norm moves them by 1e-1 and more.
"""
from __future__ import annotations

import pytest
import torch

from logicpipe.stage_node.engine.blocks import HOLE
from logicpipe.stage_node.kernels import cpu_native, quant
from logicpipe.stage_node.model import native_layers
from logicpipe.stage_node.model.shard import Shard

from .. import families
from .paged import PagedCache

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="no native CPU kernels here (no C compiler)")

# the plain families (the others keep the torch forward): biases (qwen2), q/k norms (qwen3), windows shorter
# than the prompt (mistral, qwen2 on its first layer, phi3, smollm3) and a layer without RoPE (smollm3)
PLAIN = ["llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3"]
PROMPT = [5, 17, 2000, 9, 31, 77, 4, 1200, 8, 600, 45, 3, 900, 12]  # longer than the window (8)


@pytest.fixture(autouse=True)
def native_kernels(monkeypatch):
    """The native kernels, whatever the start-up timing would choose on a busy machine (it picked
    torch's int4 kernel once, beside other work, and these shards then kept the torch forward)."""
    monkeypatch.setattr(quant, "_chosen", {})
    monkeypatch.setenv("LOGICPIPE_CPU_KERNEL", "native")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(family: str):
        if family not in made:
            made[family] = families.build(family, tmp_path_factory.mktemp(family))
        return made[family]
    return get


def run(shard: Shard, native: bool, steps: list[list[tuple[str, int, list[int]]]], blocks: int = 64) -> list[torch.Tensor]:
    """Each step's output rows through a fresh paged cache (block size 4: sequences span several blocks,
    interleaved when several sequences grow together)."""
    shard.use_native = native
    cache = PagedCache(shard, num_blocks=blocks, block_size=4)
    out = []
    for seqs in steps:
        ids = [t for _, _, toks in seqs for t in toks]
        out.append(cache.forward(shard.embed(torch.tensor(ids)), seqs))
    shard.use_native = True
    return out


def two_sequences() -> list[list[tuple[str, int, list[int]]]]:
    """A prompt, a second prompt beside the first's decode row, then both decoding (non-consecutive blocks)."""
    p, q = PROMPT, PROMPT[::-1][:11]
    steps = [[("a", 0, p)], [("a", len(p), [7]), ("b", 0, q)]]
    for k in range(6):
        steps.append([("a", len(p) + 1 + k, [100 + k]), ("b", len(q) + k, [300 + k])])
    return steps


@pytest.mark.parametrize("family", PLAIN)
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_native_layers_match_the_torch_forward(family, fmt, checkpoints):
    shard = Shard.load(checkpoints(family), 0, families.LAYERS, first=True, last=True, quantize=fmt)
    assert native_layers.eligible(shard) is None and shard.native is not None
    steps = two_sequences()
    ref, got = run(shard, False, steps), run(shard, True, steps)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-3 * float(r.abs().max()))
    assert sum(float((r - g).abs().max()) for r, g in zip(ref, got)) > 0  # two forwards, not the same one twice


@pytest.mark.parametrize("family", ["mistral", "qwen3"])
def test_a_row_has_the_same_bits_however_its_steps_are_cut(family, checkpoints):
    """One sequence: prompt in one chunk then decode rows; the prompt in chunks of 5, 5, 4; the same
    sequence among another's rows; and a replay (prompt and generated rows recomputed as one chunk)."""
    shard = Shard.load(checkpoints(family), 0, families.LAYERS, first=True, last=True, quantize="int4")
    p, gen = PROMPT, [7, 100, 101, 102]
    alone = [[("a", 0, p)]] + [[("a", len(p) + k, [t])] for k, t in enumerate(gen)]
    ref = torch.cat(run(shard, True, alone))
    chunked = [[("a", 0, p[:5])], [("a", 5, p[5:10])], [("a", 10, p[10:])]] + alone[1:]
    assert torch.equal(torch.cat(run(shard, True, chunked)), ref)
    other = PROMPT[3:12]
    among = [[("x", 0, other), ("a", 0, p)]] + [[("a", len(p) + k, [t]), ("x", len(other) + k, [50 + k])]
                                                 for k, t in enumerate(gen)]
    rows = run(shard, True, among)
    mine = torch.cat([rows[0][len(other):]] + [r[:1] for r in rows[1:]])
    assert torch.equal(mine, ref)
    replay = run(shard, True, [[("a", 0, p + gen)]])[0]
    assert torch.equal(replay, ref)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_windows_held_give_the_same_bits_and_give_blocks_back(family, checkpoints):
    """Sliding-window layers that hold only their window (engine.window) in the native call: Mistral (every
    layer slides: one pool whose tables start with holes) and Qwen2 past max_window_layers (a full layer
    and two sliding ones: two pools). Two sequences of prompts past three windows, then decode rows beside
    each other: the same bits as with every position held, and the window layers' blocks given back."""
    steps = [[("a", 0, PROMPT + PROMPT[:12])], [("a", 26, [7]), ("b", 0, PROMPT[::-1] * 2)]]
    steps += [[("a", 27 + k, [100 + k]), ("b", 28 + k, [300 + k])] for k in range(8)]
    outs, caches = {}, {}
    for held in (False, True):
        shard = Shard.load(checkpoints(family), 0, families.LAYERS, first=True, last=True, quantize="int8")
        assert shard.native is not None
        cache = caches[held] = PagedCache(shard, num_blocks=40, block_size=4, window=held, rollback=4, group_blocks=24)
        assert (shard.window == families.WINDOW) == held
        outs[held] = [cache.forward(shard.embed(torch.tensor([t for _, _, ts in seqs for t in ts])), seqs)
                      for seqs in steps]
    assert all(torch.equal(a, b) for a, b in zip(outs[False], outs[True]))
    kv = caches[True].kv
    w = kv.group if caches[True].shard.window_layers else kv
    assert (w is kv) == (family == "mistral")
    for sid in "ab":
        t = w.tables[sid]
        assert t.blocks[0] == HOLE and sum(b != HOLE for b in t.blocks) <= w.bound
    assert w.used <= 2 * w.bound < caches[False].kv.used


def test_other_shards_keep_the_torch_forward(checkpoints, monkeypatch):
    """Float weights, torch's int4 kernel, a family the C path does not do (Gemma 2: soft-capping and its
    norms around attention and MLP), or LOGICPIPE_CPU_LAYERS=torch: the torch forward, with the reason."""
    path = checkpoints("llama")
    assert "not all quantized" in native_layers.eligible(Shard.load(path, 0, 3, first=True, last=True))
    monkeypatch.setattr(quant, "_chosen", {})  # the process's choice forgotten: chosen again, as forced
    monkeypatch.setenv("LOGICPIPE_CPU_KERNEL", "torch")
    assert "not all quantized" in native_layers.eligible(Shard.load(path, 0, 3, first=True, last=True, quantize="int4"))
    monkeypatch.setenv("LOGICPIPE_CPU_KERNEL", "native")  # (by timing, torch's kernel may win: on an AVX-512 CPU
    monkeypatch.setattr(quant, "_chosen", {})              # under the suite's load it did, and the reason was that)
    gemma = Shard.load(checkpoints("gemma2"), 0, 3, first=True, last=True, quantize="int8")
    assert "sandwich norms" in native_layers.eligible(gemma) and gemma.native is None
    monkeypatch.delenv("LOGICPIPE_CPU_KERNEL")
    monkeypatch.setenv("LOGICPIPE_CPU_LAYERS", "torch")
    assert native_layers.eligible(Shard.load(path, 0, 3, first=True, last=True, quantize="int8")) == "LOGICPIPE_CPU_LAYERS=torch"
