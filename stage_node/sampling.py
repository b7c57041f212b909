"""Next-token choice on the last stage: greedy (exactly HF's argmax) or seeded temperature/top-k/top-p."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence picks its next token."""

    temperature: float = 0.0  # softmax temperature (dimensionless); 0 means greedy argmax
    top_k: int = 0  # keep only the k most likely tokens (count); 0 keeps all
    top_p: float = 1.0  # keep the smallest set of top tokens whose probability reaches top_p (0, 1]
    seed: int | None = None  # random seed of this sequence's generator; None draws one at random

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError with a message a person can act on if a field is out of range."""
        if not self.temperature >= 0.0:  # also catches NaN
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator seeded from params.seed (or randomly when it is None); None for greedy."""
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed)
    return gen


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


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> list[int]:
    """logits: [B, vocab] float32 -> one token id per row, each row with its own params and generator."""
    if not (logits.shape[0] == len(params) == len(generators)):
        raise ValueError(f"{logits.shape[0]} logit rows, {len(params)} params, {len(generators)} generators")
    greedy = logits.argmax(-1).tolist()  # one argmax for the whole batch, exactly HF's greedy choice
    out = []
    for b, (p, gen) in enumerate(zip(params, generators)):
        if p.greedy:
            out.append(greedy[b])
            continue
        probs = filter_logits(logits[b].float(), p).softmax(-1)
        if gen is not None and probs.device != gen.device:
            probs = probs.to(gen.device)
        out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out
