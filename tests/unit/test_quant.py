"""Quantized shards (`--quantize`): the kernels against the float product, the weight memory of a
quantized stage, and the default model's quality teacher-forced against float32."""
from __future__ import annotations

import pytest
import torch

from logicpipe.stage_node.quant import QuantError, check_format, quantize, tensor_bytes
from logicpipe.stage_node.shard import Shard

from .paged import PagedCache

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
    "Explain recursion to a child in two sentences.",
    "Give me a recipe for pancakes.",
]
TOKENS = 48


@pytest.mark.parametrize("fmt, tol", [("int8", 0.02), ("nf4", 0.15), ("fp4", 0.2)])
def test_a_quantized_matrix_multiplies_like_the_float_one(fmt, tol):
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(96, 64, generator=g) * 0.05, torch.randn(5, 64, generator=g)
    q = quantize(w, fmt)
    ref = x @ w.T
    err = ((q(x) - ref).abs().max() / ref.abs().max()).item()
    assert err < tol and q.shape == (96, 64) and q.numel() == w.numel()
    assert tensor_bytes(q) < tensor_bytes(w) / (3 if fmt == "int8" else 6)


def test_formats_a_node_cannot_run_say_what_to_do(monkeypatch):
    with pytest.raises(QuantError, match="use one of"):
        check_format("int3", "cpu")
    with pytest.raises(QuantError, match="on CUDA use --quantize nf4"):
        check_format("int8", "cuda")
    import builtins

    real = builtins.__import__

    def no_bnb(name, *args, **kwargs):
        if name == "bitsandbytes":
            raise ImportError("No module named 'bitsandbytes'")
        return real(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_bnb)
    with pytest.raises(QuantError, match="needs bitsandbytes"):
        check_format("nf4", "cpu")
    check_format("none", "cpu")


@pytest.fixture(scope="module")
def middle(model_dir):
    """Layers 5-24 of the default model (no embeddings, no head), in float32 and quantized."""
    return {fmt: Shard.load(model_dir, 5, 25, first=False, last=False, quantize=fmt) for fmt in ("none", "int8", "nf4")}


def test_a_quantized_stage_holds_a_fraction_of_the_weight_memory(middle):
    full = middle["none"].weight_bytes
    assert middle["int8"].weight_bytes <= 0.30 * full
    assert middle["nf4"].weight_bytes <= 0.20 * full
    assert [middle[f].weight_format for f in middle] == ["float32", "int8", "nf4"]
    assert middle["int8"].parameter_count == middle["none"].parameter_count


def forced(shard: Shard, ids: list[int]) -> torch.Tensor:
    """Top-1 predictions after each position of `ids` in one pass (teacher forcing)."""
    cache = PagedCache(shard, num_blocks=16)
    h = cache.forward(shard.embed(torch.tensor(ids)), [("s", 0, ids)], {"s": len(ids)})
    return shard.logits(h).argmax(-1)


@pytest.fixture(scope="module")
def reference(model_dir):
    """The float32 model's greedy tokens for each prompt (its own top-1, fed back)."""
    from transformers import AutoTokenizer

    from logicpipe.controller.text import encode_prompt

    tok = AutoTokenizer.from_pretrained(model_dir)
    full = Shard.load(model_dir, 0, 30, first=True, last=True)
    out = []
    for prompt in PROMPTS:
        ids = encode_prompt(tok, prompt)
        cache = PagedCache(full, num_blocks=16)
        h = cache.forward(full.embed(torch.tensor(ids)), [("s", 0, ids)], {"s": len(ids)})
        for _ in range(TOKENS):
            ids.append(int(full.logits(h[-1:]).argmax()))
            h = cache.forward(full.embed(torch.tensor(ids[-1:])), [("s", len(ids) - 1, ids[-1:])])
        out.append((len(ids) - TOKENS, ids))
    return out


@pytest.mark.parametrize("fmt, floor", [("int8", 0.90), ("nf4", 0.65)])
def test_teacher_forced_agreement_with_float32(fmt, floor, model_dir, reference, record_property):
    """Every layer quantized (embeddings and head kept): fed the float32 model's greedy tokens,
    the quantized model predicts the same next token at >= floor of the 5 x 48 positions."""
    shard = Shard.load(model_dir, 0, 30, first=True, last=True, quantize=fmt)
    same = total = 0
    for n_prompt, ids in reference:
        pred = forced(shard, ids)[n_prompt - 1: -1]
        same += int((pred == torch.tensor(ids[n_prompt:])).sum())
        total += TOKENS
    agreement = same / total
    record_property(f"{fmt}_agreement", agreement)
    print(f"{fmt}: teacher-forced top-1 agreement {agreement:.3f} over {total} tokens")
    assert agreement >= floor
