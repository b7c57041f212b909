"""Sampling: greedy is argmax; each sampled token's draw is a pure function of (seed, sequence,
position); the draws follow the distribution; filters keep what they should; candidates verify."""
from __future__ import annotations

import pytest
import torch

from logicpipe.stage_node.model.sampling import SamplingParams, draw, filter_logits, pick, sample, verify, verify_greedy

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


def _plain(logits, p, draws):
    """What sampling without candidates draws at each of the positions."""
    return [sample(logits[i:i + 1], [p], [u])[0] for i, u in enumerate(draws)]


@pytest.mark.parametrize("wrong_at", [0, 1, 2, None])
def test_sampled_verification_gives_the_tokens_sampling_without_candidates_draws(logits, wrong_at):
    """Row i's token is drawn with position i's own draw, as without candidates: a candidate equal
    to it is accepted, the first other one is replaced by it; so a seeded request gives the same
    tokens with candidates as without."""
    p = SamplingParams(temperature=0.7, top_p=0.95, seed=3)
    for pos in range(20):
        draws = [draw(3, 0, pos * 4 + i) for i in range(4)]
        plain = _plain(logits, p, draws)
        candidates = plain[:3]
        if wrong_at is not None:
            candidates[wrong_at] = (candidates[wrong_at] + 1) % VOCAB
        n = 3 if wrong_at is None else wrong_at
        assert verify(logits, candidates, p, draws) == plain[: n + 1]
    assert verify(logits[:1], [], p, [0.5]) == _plain(logits, p, [0.5])
    assert verify(logits, [1, 2, 3], SamplingParams(), [None] * 4) == verify_greedy(logits, [1, 2, 3])


@pytest.mark.parametrize("candidate", [0, 3, 5])
def test_sampled_verification_keeps_the_target_distribution(candidate):
    """Speculative sampling's promise, measured: the token after verification follows the target
    distribution whatever the candidate (likely or not), a candidate is accepted with its
    probability under the target, and a rejected one is replaced from the rest renormalized."""
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.07, 0.03])
    logits = torch.log(probs)[None].repeat(2, 1)
    p = SamplingParams(temperature=1.0, seed=11)
    n = 20000
    with_c = torch.zeros(len(probs))
    without = torch.zeros(len(probs))
    replaced = torch.zeros(len(probs))
    accepted = 0
    for i in range(n):
        u = [draw(11, 0, i), draw(11, 1, i)]
        out = verify(logits, [candidate], p, u)
        with_c[out[0]] += 1
        if len(out) == 2:
            accepted += 1
        else:
            replaced[out[0]] += 1
        without[sample(logits[:1], [p], [draw(12, 0, i)])[0]] += 1  # independent draws, no candidate
    tv = lambda a, b: 0.5 * (a - b).abs().sum().item()  # noqa: E731
    assert tv(with_c / n, without / n) < 0.02
    assert tv(with_c / n, probs) < 0.02
    assert abs(accepted / n - probs[candidate].item()) < 0.02
    rest = probs.clone()
    rest[candidate] = 0
    assert replaced[candidate] == 0 and tv(replaced / replaced.sum(), rest / rest.sum()) < 0.03


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
