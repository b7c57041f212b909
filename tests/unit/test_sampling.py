"""Sampling: greedy is argmax; each sampled token's draw is a pure function of (seed, sequence,
position); the draws follow the distribution; filters keep what they should; candidates verify."""
from __future__ import annotations

import pytest
import torch

from stage_node.sampling import SamplingParams, draw, filter_logits, pick, sample, verify_greedy

VOCAB = 50


@pytest.fixture
def logits():
    # logits: [4, vocab], distinct values per row
    return torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))


def test_greedy_is_argmax(logits):
    assert sample(logits, [SamplingParams()] * 4, [None] * 4) == torch.argmax(logits, dim=-1).tolist()


def test_draws_depend_only_on_seed_sequence_and_position():
    assert draw(1, 0, 7) == draw(1, 0, 7)
    values = {draw(1, 0, 7), draw(2, 0, 7), draw(1, 1, 7), draw(1, 0, 8)}
    assert len(values) == 4
    assert all(0.0 <= v < 1.0 for v in values)


def test_seeded_sampling_is_reproducible_and_really_samples(logits):
    p = SamplingParams(temperature=1.5, seed=1234)

    def run(seed):
        return [sample(logits, [p] * 4, [draw(seed, row, pos) for row in range(4)]) for pos in range(20)]

    first = run(1234)
    assert first == run(1234)
    assert len({t for step in first for t in step}) > 1
    assert run(99) != first


def test_draws_follow_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    n = 20000
    counts = torch.zeros(5)
    for pos in range(n):
        counts[pick(probs, draw(7, 0, pos))] += 1
    freq = counts / n
    assert counts[4] == 0  # a token of probability 0 is never drawn
    assert torch.allclose(freq, probs, atol=0.015), freq


def test_mixed_batch_rows_use_their_own_params(logits):
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=1, seed=3)] * 2
    assert sample(logits, params, [None, 0.5, None, 0.99]) == torch.argmax(logits, dim=-1).tolist()


def test_top_k_keeps_k_tokens(logits):
    kept = torch.isfinite(filter_logits(logits[0], SamplingParams(temperature=1.0, top_k=5)))
    assert kept.sum() == 5
    assert kept[torch.topk(logits[0], 5).indices].all()


def test_tiny_top_p_keeps_only_the_top_token(logits):
    p = SamplingParams(temperature=1.0, top_p=1e-6, seed=5)
    assert torch.isfinite(filter_logits(logits[0], p)).sum() == 1
    for pos in range(10):
        assert sample(logits, [p] * 4, [draw(5, r, pos) for r in range(4)]) == torch.argmax(logits, dim=-1).tolist()


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = torch.isfinite(filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.7)))
    assert kept.tolist() == [True, True, False, False]


def test_greedy_verification_accepts_the_longest_matching_prefix():
    # logits rows: argmax 3, 5, 7, 9 (the row before the candidates, then one per candidate)
    logits = torch.full((4, 10), -1.0)
    for row, best in enumerate([3, 5, 7, 9]):
        logits[row, best] = 1.0
    assert verify_greedy(logits, [3, 5, 7]) == [3, 5, 7, 9]   # all accepted, plus the next token
    assert verify_greedy(logits, [3, 6, 7]) == [3, 5]         # second rejected: greedy's own token
    assert verify_greedy(logits, [4, 5, 7]) == [3]            # none accepted
    assert verify_greedy(logits[:1], []) == [3]


@pytest.mark.parametrize("kwargs, word", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": 1e-45}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"seed": -1}, "seed"),
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
