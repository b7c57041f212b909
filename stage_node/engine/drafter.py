"""Candidate tokens, drafted on the last stage: prompt lookup, and how many to send.

After the last stage samples a sequence's token it drafts up to `k` candidates for the positions
after it and feeds them to stage 0 with the token; the next trip through the pipeline computes
all of them in one step and the last stage verifies them (`stage_node.sampling.verify`), so a trip
yields 1 + (accepted) tokens instead of one.

**Prompt lookup** (the drafter, no extra model): the longest of the sequence's last 3, 2 or 1
tokens that occurred before in its own context (prompt + generated tokens) proposes what followed
its latest occurrence. Rewrites, extractions, summaries and code edits copy long runs of their
input, which it finds at once; on open-ended text it rarely matches and then drafts nothing. An
index of n-grams is kept up to date as tokens come, so a proposal costs O(k) whatever the length.

**How many** (`allocate`): each candidate verified is accepted with a per-candidate probability
`a`, estimated per sequence from its recent verifications (decayed counts, a prior of 1/2): its
j-th candidate adds a^j expected tokens. The sequences sampled in one step go back to stage 0
together and share its next step, whose cost grows with its rows (`step_cost`): rows up to
FREE_ROWS cost one step, every further row ROW_COST of one (on the CPU a fifth: eight open-ended
streams with 4 candidates each ran at 0.56x the tokens/s of none before this was accounted for).
A stage's own costs (`StepCost`, `step_cost_for`): a float CPU stage pads a lone decode row to 4,
so rows 1..4 cost one step; a quantized one computes each row on its own (int4: 1 row 6.2 ms, 2
rows 7.3, 4 rows 9.8 for the default model), so its first candidate already costs a fifth.
Candidates are handed out, the most likely first, while
they raise the step's expected tokens per unit of cost: a lone sequence on text that copies gets
many, eight sequences that share a step on open-ended text get none. Drafting also stops for a
while after repeated total misses, and starts again by itself.
"""
from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from logicpipe.stage_node.kernels.quant import FORMATS

MAX_NGRAM = 3
MIN_NGRAM = 1
FREE_ROWS = 4       # decode rows 1..4 cost one step: on the CPU a lone row is padded to 4 for the
                    # batch-invariant product (`stage_node.ops`)
ROW_COST = 0.2      # each decode row beyond that, relative to a one-row step. Measured on this CPU
                    # (10 layers of the default model + LM head, 1 thread, 200-token contexts): R rows
                    # cost 1.0 (R <= 4), 1.3 (5), 1.7-2.0 (8), 3.6 (16), 8.7 (40) one-row steps
DECAY = 0.7         # weight the acceptance record keeps per verification (recent ones count most)
PRIOR = 1.0         # pseudo-counts of acceptance and rejection before the first verification
MISSES_TO_PAUSE = 3  # verifications in a row with nothing accepted before drafting pauses
MAX_PAUSE = 32       # steps a pause lasts at most (it doubles with each pause in a row)


class PromptLookup:
    """n-grams of a sequence's tokens -> where their latest earlier occurrence was followed."""

    def __init__(self, tokens: Iterable[int] = (), max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        # n -> {n-gram: position after its latest occurrence that has a follower}
        self._next: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        t = self.tokens
        for tok in tokens:
            t.append(tok)
            end = len(t) - 1  # the n-grams ending just before the new token are now followed by it
            for n, index in self._next.items():
                if end >= n:
                    index[tuple(t[end - n:end])] = end

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the longest recurring suffix (none when nothing recurs).
        A match that runs into the present (a repeating pattern) continues with its own proposal."""
        t = self.tokens
        if k <= 0 or not t:
            return []
        for n in range(min(self.max_ngram, len(t)), self.min_ngram - 1, -1):
            pos = self._next[n].get(tuple(t[len(t) - n:]))
            if pos is None:
                continue
            out: list[int] = []
            for j in range(k):
                i = pos + j
                out.append(t[i] if i < len(t) else out[i - len(t)])
            return out
        return []


def expected_tokens(a: float, k: int) -> float:
    """Tokens a step with k candidates yields when each is accepted with probability a (in order)."""
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass(frozen=True)
class StepCost:
    """What a decode step of `rows` rows costs, relative to a step of one row: rows up to
    `free_rows` cost one step, each further one `row_cost` of one."""

    free_rows: int = FREE_ROWS
    row_cost: float = ROW_COST

    def __call__(self, rows: int) -> float:
        return 1.0 + self.row_cost * max(0, rows - self.free_rows)


STEP_COST = StepCost()
QUANTIZED_CPU_COST = StepCost(free_rows=1)  # packed int4 / int8, bitsandbytes: no padding to 4 rows


def step_cost_for(device_type: str, weight_format: str) -> StepCost:
    """The step cost of a last stage on `device_type` holding its layers in `weight_format` (a
    float dtype's name such as "float32", never in quant.FORMATS, or a quantized format)."""
    return QUANTIZED_CPU_COST if device_type == "cpu" and weight_format in FORMATS else STEP_COST


def step_cost(rows: int) -> float:
    """A decode step of `rows` rows, relative to a step of one row (a float CPU stage's)."""
    return STEP_COST(rows)


def allocate(acceptances: Sequence[float], available: Sequence[int], cost: StepCost = STEP_COST) -> list[int]:
    """Candidates for each of the sequences that share a step (at most `available[i]` for the i-th,
    whose candidates are accepted with probability `acceptances[i]` each): the most likely ones
    first, while they raise the step's expected tokens per unit of cost."""
    counts = [0] * len(acceptances)
    rows = len(acceptances)
    tokens = float(rows)
    heap = [(-a, i) for i, (a, n) in enumerate(zip(acceptances, available)) if n > 0 and a > 0]
    heapq.heapify(heap)
    while heap:
        neg_gain, i = heapq.heappop(heap)
        gain = -neg_gain
        if (tokens + gain) / cost(rows + 1) <= tokens / cost(rows) * (1 + 1e-9):
            break
        counts[i] += 1
        rows += 1
        tokens += gain
        if counts[i] < available[i]:
            heapq.heappush(heap, (-(acceptances[i] ** (counts[i] + 1)), i))
    return counts


def best_k(a: float, k_max: int) -> int:
    """Candidates for a sequence alone in its step."""
    return allocate([a], [k_max])[0]


class Drafter:
    """One sequence's drafter and its acceptance record."""

    def __init__(self, context: Sequence[int], k_max: int):
        self.k_max = k_max
        self.lookup = PromptLookup(context)
        self.accepts = self.rejects = PRIOR  # decayed counts of candidates accepted / the first rejected
        self.misses = 0       # verifications in a row that accepted nothing
        self.paused = 0       # steps left without drafting
        self.pauses = 0       # pauses in a row (each doubles the next)
        self.verified = self.accepted = 0  # totals

    @property
    def acceptance(self) -> float:
        """The estimated probability that a candidate is accepted (given those before it were)."""
        return self.accepts / (self.accepts + self.rejects)

    def observe(self, verified: int, accepted: int, tokens: Sequence[int]) -> None:
        """A step verified `verified` candidates, accepted `accepted`; `tokens` came out of it (the
        accepted candidates and the sampled token): they join the context."""
        self.lookup.extend(tokens)
        if not verified:
            return
        self.verified += verified
        self.accepted += accepted
        self.accepts = self.accepts * DECAY + accepted
        self.rejects = self.rejects * DECAY + (1 if accepted < verified else 0)
        if accepted:
            self.misses = self.pauses = 0
            return
        self.misses += 1
        if self.misses >= MISSES_TO_PAUSE:
            self.paused = min(MAX_PAUSE, 2 ** self.pauses)
            self.pauses += 1
            self.misses = 0

    def k(self) -> int:
        """Candidates worth sending were the sequence alone in its step."""
        return best_k(self.acceptance, self.k_max)

    @property
    def context(self) -> list[int]:
        """The sequence's tokens so far (prompt and generated)."""
        return self.lookup.tokens

    def budget(self, limit: int) -> int:
        """How many candidates it may draft now: at most `limit` and its K (0 while it pauses)."""
        if self.paused:
            self.paused -= 1
            return 0
        return min(limit, self.k_max)

    def propose(self, limit: int) -> list[int]:
        """Prompt lookup's candidates, alone in a step: at most `limit`, as many as pay."""
        return self.lookup.propose(min(self.budget(limit), self.k()))
