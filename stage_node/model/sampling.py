"""Next-token choice on the last stage: greedy (exactly HF's argmax), seeded temperature / top-k /
top-p sampling, and verification of candidate tokens (greedy: the longest prefix greedy would
have produced; sampled: speculative sampling, see `verify`).

Every sampled token's random draw is a pure function of (seed, sequence, position): no generator
state is carried from token to token, so a sequence replayed from its tokens (after a re-plan, a
preemption, a lost node) draws exactly what it drew the first time.
"""
from __future__ import annotations

import hashlib
import struct
from collections import Counter
from typing import Sequence

import torch

from logicpipe.sampling import SamplingParams, TokenLogprob

__all__ = ["SamplingParams", "draw", "filter_logits", "penalize", "pick", "sample", "token_logprobs", "verify",
           "verify_greedy"]


def draw(seed: int, sequence: int, position: int) -> float:
    """The uniform random number in [0, 1) of the token at `position` of `sequence` under `seed`."""
    digest = hashlib.blake2b(struct.pack("<QQQ", seed % 2**64, sequence % 2**64, position % 2**64),
                             digest_size=8, person=b"logicpipe-draw").digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


def penalize(logits: torch.Tensor, params: SamplingParams, counts: Counter, candidates: Sequence[int] = ()) -> torch.Tensor:
    """OpenAI's logit_bias and penalties on a copy of a sequence's rows of logits: each token's
    logit plus its bias, minus frequency_penalty x how often the sequence generated it and
    presence_penalty if it did. `counts`: the sequence's generated tokens before row 0; row i also
    counts candidates[:i] (the candidates before it, which its context holds). A function of the
    tokens so far only, so a replay penalizes exactly as the first run did. logits: [rows, vocab]"""
    out = logits.float().clone()
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], device=out.device)
        out[:, ids] += torch.tensor([b for _, b in params.logit_bias], device=out.device)
    if params.presence_penalty or params.frequency_penalty:
        seen = Counter(counts)
        for i in range(out.shape[0]):
            if i:
                seen[candidates[i - 1]] += 1
            if seen:
                ids = torch.tensor(list(seen), device=out.device)
                n = torch.tensor(list(seen.values()), dtype=out.dtype, device=out.device)
                out[i, ids] -= n * params.frequency_penalty + params.presence_penalty
    return out


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (keeping at least one token). logits: [vocab] float32"""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens strictly before it already reach top_p; the top one always stays
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        drop[0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def pick(probs: torch.Tensor, u: float) -> int:
    """The token whose cumulative-probability interval holds u (inverse CDF). probs: [vocab]"""
    cdf = probs.double().cumsum(-1)
    i = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype, device=cdf.device),
                               right=True))
    return min(i, probs.shape[-1] - 1)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], draws: Sequence[float | None]) -> list[int]:
    """logits: [B, vocab] float32 -> one token id per row, each row with its own params and draw
    (None for greedy rows)."""
    if not (logits.shape[0] == len(params) == len(draws)):
        raise ValueError(f"{logits.shape[0]} logit rows, {len(params)} params, {len(draws)} draws")
    greedy = logits.argmax(-1).tolist()  # one argmax for the whole batch, exactly HF's greedy choice
    out = []
    for b, (p, u) in enumerate(zip(params, draws)):
        if p.greedy:
            out.append(greedy[b])
        else:
            out.append(pick(filter_logits(logits[b].float(), p).softmax(-1), u))
    return out


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """Each token's log-probability in the row of logits it was chosen from, and the `top` most
    likely tokens of that row (most likely first): the model's own distribution, log-softmax of
    the raw logits (before temperature, top-k, top-p), as OpenAI reports it. logits: [len(tokens), vocab]"""
    logp = torch.log_softmax(logits.float(), -1)
    chosen = logp[torch.arange(len(tokens)), torch.tensor(list(tokens), device=logp.device)].tolist()
    if not top:
        return [TokenLogprob(c) for c in chosen]
    values, ids = logp.topk(min(top, logp.shape[-1]), -1)
    return [TokenLogprob(c, tuple(zip(i, v))) for c, i, v in zip(chosen, ids.tolist(), values.tolist())]


def verify_greedy(logits: torch.Tensor, candidates: Sequence[int]) -> list[int]:
    """Greedy verification: logits [k + 1, vocab] of the row before the k candidates and of each
    candidate row -> the accepted candidates (the longest prefix greedy would have produced) and
    then greedy's own next token."""
    best = logits.argmax(-1).tolist()
    out = []
    for i, c in enumerate(candidates):
        if best[i] != c:
            break
        out.append(c)
    out.append(best[len(out)])
    return out


def verify(logits: torch.Tensor, candidates: Sequence[int], params: SamplingParams,
           draws: Sequence[float | None]) -> list[int]:
    """Verify k candidates: logits [k + 1, vocab] (the row before each candidate, and the last),
    draws: the random draw of each of those k + 1 positions -> the accepted candidates, then the
    token sampled after them.

    Sampled rows use speculative sampling for a drafter that proposes one token with certainty (a
    point-mass draft distribution q, as prompt lookup's): row i's token x_i is drawn from the
    target p_i with the position's own draw, exactly as it is drawn without candidates, and the
    candidate c_i is accepted when x_i == c_i. That is the rejection rule: c_i is accepted with
    probability p_i(c_i) = min(1, p_i(c_i) / q(c_i)), and a rejected one is replaced by x_i, which
    then follows p_i over the tokens other than c_i, renormalized = norm(max(0, p_i - q)). So the
    output distribution is the target's, and more: a seeded request gives the same tokens with
    candidates as without (and a replay the same tokens whatever was drafted)."""
    if params.greedy:
        return verify_greedy(logits, candidates)
    if not (logits.shape[0] == len(candidates) + 1 == len(draws)):
        raise ValueError(f"{logits.shape[0]} logit rows, {len(candidates)} candidates, {len(draws)} draws")
    out = []
    for i, u in enumerate(draws):
        x = pick(filter_logits(logits[i].float(), params).softmax(-1), u)
        out.append(x)
        if i == len(candidates) or x != candidates[i]:
            break
    return out
