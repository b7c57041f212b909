"""A stage's view of one sequence, and the slices of it that travel in steps and feeds."""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from logicpipe.sampling import SamplingParams
from logicpipe.stage_node.engine.drafter import Drafter
from logicpipe.stage_node.net.fence import Caller

if TYPE_CHECKING:
    from logicpipe.stage_node.engine.handoff import KvImport
    from logicpipe.stage_node.model.grammar import Constraint


class SeqStatus(Enum):
    ADMITTED = "admitted"   # open, its prompt's blocks held; no step yet
    RUNNING = "running"     # steps flow
    FINISHED = "finished"   # (last stage) a stop token or its length ended it; further steps are refused


@dataclass(frozen=True)
class SeqWork:
    """One sequence's slice of a step message (between stages) or of an input feed (into stage 0)."""

    session_id: str
    start_pos: int                   # position of the first token
    token_ids: tuple[int, ...]       # one per token (row)
    sample: bool = True              # the last stage samples after these rows (False: a prompt chunk before the last)
    num_candidates: int = 0          # the last k tokens are candidates to verify
    finished: bool = False           # a feed from the last stage: the sequence ended with this token

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def stop(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class SeqSpec:
    """What OpenSession says about a sequence."""

    session_id: str
    capacity: int                          # longest it may grow (positions)
    sampling: SamplingParams
    max_new_tokens: int                    # finish with "length" once this many are generated
    stop_ids: frozenset[int]               # finish with "stop" on any of these
    owner: str = ""                        # whose Events hear of it ("" = nobody: lives while stepped)
    opener: Caller = Caller()              # who opened it (certificate name, key digest): only it may close it
    prompt: tuple[int, ...] = ()           # input from position 0 (prefix-cache lookup, admission)
    generated: int = 0                     # replay: tokens generated before
    parent: str = ""                       # fork: share the parent's first parent_length positions
    parent_length: int = 0
    index: int = 0                         # its index within its request (mixed into draws)
    priority: int = 0                      # lower is older: preempted last (0: admission order)
    prefill_rank: int = 0                  # stage 0: prefilled before the unranked, lower first (0: none)
    speculate: int = 0                     # last stage: candidates drafted per step at most (0: none)
    prefill_chunk: int = 0                 # stage 0: prompt rows of it in one step at most (0: the budget)
    top_logprobs: int | None = None        # last stage: report each token's logprob and this many top ones (None: no)
    prompt_logprobs: int | None = None     # last stage: ... each prompt token's too, with the first token (None: no)
    grammar: str = ""                      # last stage: structured output ("json_object" or a JSON schema; "": none)
    prefill_only: bool = False             # disaggregated prefill: computed into KV, nothing sampled; the last
                                           # stage reports "prefilled" once every prompt position is held
    import_length: int = 0                 # disaggregated prefill: KV of positions [0, this) comes by ImportKv
    import_key: str = ""                   # ... with this key (engine.handoff)


@dataclass
class Sequence:
    spec: SeqSpec
    order: int                             # admission order on this stage (the youngest is preempted first)
    seed: int                              # of its sampled draws (spec's, or drawn at admission)
    status: SeqStatus = SeqStatus.ADMITTED
    generated: int = 0                     # last stage: new tokens so far, replayed ones included
    rollback: int = 0                      # how far below its KV length the next step may start
    last_active: float = field(default_factory=time.monotonic)
    # stage 0 only: input waiting to be computed, and the step whose sampled row is out
    pending: list[int] = field(default_factory=list)
    pending_pos: int = 0                   # position of pending[0] (== next input position when empty)
    pending_candidates: int = 0            # the last k of pending are candidates
    more_input: bool = False               # the last feed said more input follows (a prompt in parts)
    in_flight: int | None = None           # id of the step whose token has not come back
    in_flight_since: float = 0.0
    last_step: int = 0                     # id of the last step that included it (round robin)
    draft: "Drafter | None" = None         # last stage, speculating: its drafter (made on its first token)
    counts: Counter | None = None          # last stage, penalized: how often it generated each token (made on first use)
    prompt_lps: dict[int, object] | None = None  # last stage, prompt_logprobs: position -> TokenLogprob, until reported
    grammar: "Constraint | None" = None    # last stage, structured output: its matcher (stage_node.grammar)
    kv_import: "KvImport | None" = None    # its KV still coming by ImportKv (engine.handoff); None: none, or all here

    def generated_counts(self) -> Counter:
        """Last stage: how often the sequence generated each token so far (what OpenAI's penalties
        count), starting from a replay's tokens generated before (the tail of its prompt)."""
        if self.counts is None:
            g = self.spec.generated
            self.counts = Counter(self.spec.prompt[len(self.spec.prompt) - g:] if g else ())
        return self.counts

    @property
    def id(self) -> str:
        return self.spec.session_id

    @property
    def age(self) -> tuple[int, int]:
        """Sorts oldest first: the owner's priority, then admission order on this stage."""
        return (self.spec.priority or self.order, self.order)

    @property
    def prefill_order(self) -> tuple[int, int, tuple[int, int]]:
        """Stage 0's order among the prompts waiting: a ranked one first (a replay after a move, by
        when it last had a token: SeqSpec.prefill_rank), lower first, then by age."""
        rank = self.spec.prefill_rank
        return (0 if rank else 1, rank, self.age)

    @property
    def next_pos(self) -> int:
        """Stage 0: the position after everything fed so far."""
        return self.pending_pos + len(self.pending)

    def is_decode_ready(self) -> bool:
        """Stage 0: one real token (plus candidates) waits and no sampled step of it is out."""
        return (self.in_flight is None and not self.more_input
                and len(self.pending) - self.pending_candidates == 1)

    def is_prefill_ready(self) -> bool:
        """Stage 0: a prompt (or replay) waits: more than one real token, or a part of one."""
        return len(self.pending) - self.pending_candidates > 1 or (self.more_input and bool(self.pending))
