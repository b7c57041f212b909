"""Sampling: greedy is argmax, seeded sampling is reproducible, filters keep what they should."""
from __future__ import annotations

import pytest
import torch

from stage_node.sampling import SamplingParams, filter_logits, make_generator, sample

VOCAB = 50


@pytest.fixture
def logits():
    # logits: [4, vocab], distinct values per row
    return torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))


def test_greedy_is_argmax(logits):
    params = [SamplingParams()] * 4
    gens = [make_generator(p) for p in params]
    assert gens == [None] * 4
    assert sample(logits, params, gens) == torch.argmax(logits, dim=-1).tolist()


def test_seeded_sampling_is_reproducible(logits):
    p = SamplingParams(temperature=1.5, seed=1234)

    def draw():
        gens = [make_generator(p) for _ in range(4)]
        return [sample(logits, [p] * 4, gens) for _ in range(20)]

    first = draw()
    assert first == draw()
    assert len({t for step in first for t in step}) > 1  # it really samples
    other = SamplingParams(temperature=1.5, seed=99)
    gens = [make_generator(other) for _ in range(4)]
    assert [sample(logits, [other] * 4, gens) for _ in range(20)] != first


def test_mixed_batch_rows_use_their_own_params(logits):
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=1, seed=3)] * 2
    gens = [make_generator(p) for p in params]
    assert sample(logits, params, gens) == torch.argmax(logits, dim=-1).tolist()


def test_top_k_one_is_greedy(logits):
    p = SamplingParams(temperature=2.0, top_k=1, seed=7)
    gens = [make_generator(p) for _ in range(4)]
    for _ in range(10):
        assert sample(logits, [p] * 4, gens) == torch.argmax(logits, dim=-1).tolist()


def test_top_k_keeps_k_tokens(logits):
    kept = torch.isfinite(filter_logits(logits[0], SamplingParams(temperature=1.0, top_k=5)))
    assert kept.sum() == 5
    assert kept[torch.topk(logits[0], 5).indices].all()


def test_tiny_top_p_keeps_only_the_top_token(logits):
    p = SamplingParams(temperature=1.0, top_p=1e-6, seed=5)
    assert torch.isfinite(filter_logits(logits[0], p)).sum() == 1
    gens = [make_generator(p) for _ in range(4)]
    for _ in range(10):
        assert sample(logits, [p] * 4, gens) == torch.argmax(logits, dim=-1).tolist()


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = torch.isfinite(filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.7)))
    assert kept.tolist() == [True, True, False, False]


@pytest.mark.parametrize("kwargs, word", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
])
def test_invalid_params_raise(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs).validate()


def test_valid_params_pass():
    SamplingParams().validate()
    SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=1).validate()


def test_mismatched_lengths_raise(logits):
    with pytest.raises(ValueError):
        sample(logits, [SamplingParams()] * 3, [None] * 3)
