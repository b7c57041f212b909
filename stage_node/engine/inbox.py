"""A later stage's inbox: the computed steps received from the previous stage, and the order it
takes them in (stage_node.engine.scheduler forms its steps from the front).

Under the step-time bar a decoding sequence's row goes before the prompt chunks queued ahead of it
(`decode_first`): stage 0 sizes each chunk to its own model of the bar, so a later stage whose steps
run a little longer queues chunks, and a decode row behind them waited for all of them (a 32k
prompt through three 16-core CPU stages: the decoding request's longest gap 2.2-2.7 s, 0.5 s with
it). A sequence's own slices stay in order, and the KV of different sequences is independent; a
row's bits do not depend on the rows beside it (batch invariance), so the order changes no output.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from logicpipe.stage_node.engine.sequence import SeqWork
from logicpipe.tensor_codec import RawTensor


@dataclass(frozen=True)
class StepMsg:
    """A computed step received from the previous stage."""

    seqs: tuple[SeqWork, ...]
    hidden: RawTensor  # [sum of num_tokens, hidden_size]
    starts: tuple[int, ...] | None = None  # the row of `hidden` each of seqs starts at (None: one after another)

    @property
    def rows(self) -> int:
        return sum(w.num_tokens for w in self.seqs)

    def rows_at(self) -> dict[str, int]:
        if self.starts is not None:
            return {w.session_id: r for w, r in zip(self.seqs, self.starts)}
        out, row = {}, 0
        for w in self.seqs:
            out[w.session_id] = row
            row += w.num_tokens
        return out

    def split(self, keep) -> tuple[StepMsg | None, StepMsg | None]:
        """(the message of the seqs `keep` is true of, that of the others), over the same rows."""
        at = self.rows_at()
        mine = [w for w in self.seqs if keep(w)]
        rest = [w for w in self.seqs if not keep(w)]
        part = lambda ws: StepMsg(tuple(ws), self.hidden, tuple(at[w.session_id] for w in ws)) if ws else None  # noqa: E731
        return part(mine), part(rest)


def is_decode(w: SeqWork) -> bool:
    """A decoding sequence's row: one token, sampled (and its candidates)."""
    return w.sample and w.num_tokens == 1 + w.num_candidates


def decode_first(inbox: deque[StepMsg]) -> None:
    """Move the decode rows of the messages after the first to the front, each where no message
    before it holds its sequence (the chunk a row came with stays, reading its rows in place)."""
    if len(inbox) < 2:
        return
    ahead: set[str] = {w.session_id for w in inbox[0].seqs}
    jump: list[StepMsg] = []
    msgs: list[StepMsg | None] = list(inbox)
    for i in range(1, len(msgs)):
        msg = msgs[i]
        decodes = {w.session_id for w in msg.seqs if is_decode(w) and w.session_id not in ahead}
        ahead.update(w.session_id for w in msg.seqs)
        if decodes:
            mine, msgs[i] = msg.split(lambda w: w.session_id in decodes)
            jump.append(mine)
    if jump:
        inbox.clear()
        inbox.extend(jump + [m for m in msgs if m is not None])
