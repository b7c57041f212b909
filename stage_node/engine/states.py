"""The recurrent state of a stage's linear-attention layers (gated delta-net: model.deltanet), per
sequence, beside the paged KV of its other layers.

A sequence's state does not grow with it, and cannot be rolled back: a position's state is what the
sequence's whole past left. So it is kept as snapshots by position, the state after the sequence's
first p tokens, for the positions where its next step may start: after its last step's last row, and
before it (a fork that computes its prompt's last row again: `n` choices), and after each of that
step's candidate rows (the next step starts after the accepted ones: truncation is choosing a
snapshot). A step leaves those (deltanet.SeqState.keep) and the older ones go. Snapshots are
never written in place: a fork shares its parent's by reference.

How each engine operation treats it (docs/engine.md):
- fork (outline points, `n`): the child takes the parent's snapshots up to the fork's length and
  holds the positions up to the highest of them (the scheduler reports that, so the controller
  computes the rest: all of it, from position 0, where the parent holds no state there);
- truncation after rejected candidates: the next step starts from the snapshot of its position;
- prefix cache: off for such models (a cached block's KV would come without the state before it);
- replay, preemption, a re-plan: a new session starts at zeros and recomputes from its prompt.

Bookkeeping on the event loop (open, fork, drop) and the runner thread (`step`, `commit`) touch only
Python dicts: no torch operation runs here.
"""
from __future__ import annotations

from logicpipe.stage_node.model.deltanet import SeqState


class RecurrentStates:
    def __init__(self):
        # session id -> position -> {local linear layer: (window, S)}: the state after that many tokens
        self.seqs: dict[str, dict[int, dict]] = {}

    def open(self, seq: str) -> None:
        self.seqs[seq] = {}

    def fork(self, parent: str, child: str, length: int) -> int:
        """`child` shares `parent`'s snapshots at positions <= length. -> the highest position it holds a
        state for (0: none but the start)."""
        snaps = {p: s for p, s in self.seqs.get(parent, {}).items() if p <= length}
        self.seqs[child] = snaps
        return max(snaps, default=0)

    def drop(self, seq: str) -> None:
        self.seqs.pop(seq, None)

    def holds(self, seq: str, position: int) -> bool:
        """Whether a step of `seq` may start at `position` (its state there is known)."""
        return position == 0 or position in self.seqs.get(seq, {})

    def positions(self, seq: str) -> list[int]:
        return sorted(self.seqs.get(seq, {}))

    def step(self, seq: str, start: int, stop: int, num_candidates: int) -> SeqState:
        """The state a step of `seq`'s rows [start, stop) (its last `num_candidates` candidates) starts
        from, and the positions it must leave: after each candidate's row, after the row before them and
        after the one before that (a fork recomputing a prompt's last row)."""
        snaps = self.seqs.get(seq, {})
        if start and start not in snaps:
            raise KeyError(f"session {seq} holds no recurrent state at position {start} "
                           f"(it holds {sorted(snaps) or 'none'})")
        low = stop - num_candidates - 1
        return SeqState(snaps[start] if start else None, tuple(range(max(start + 1, low), stop + 1)), low=low)

    def commit(self, seq: str, state: SeqState, start: int) -> None:
        """After a step's forward: `seq`'s snapshots are those it left, and those it started from
        within reach of its next step (`state.low`); the others go."""
        snaps = self.seqs.get(seq)
        if snaps is None:  # closed while it computed
            return
        kept = {p: s for p, s in snaps.items() if state.low <= p <= start}
        kept.update(state.out)
        snaps.clear()
        snaps.update(kept)
