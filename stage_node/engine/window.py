"""Sliding-window layers that hold only their window (issue 37 item 3).

A sliding-window layer's row at position p attends to positions (p - window, p] and never to an
earlier one, so its keys and values before that are dead weight once the sequence has moved on.
Pure bookkeeping (no torch), beside `blocks.KVManager`:

- `WindowBlocks`: a KV manager whose sequences give back every block wholly before their last
  `window + rollback` positions (`rollback`: how far the next step may start below the length,
  at most the candidates of a step, `ROLLBACK` = net.wire.MAX_CANDIDATES). A given-back block's
  entry in the block table becomes `blocks.HOLE`; holes are always a prefix of the table. A
  registered block given back stays in the prefix cache (CACHED) until its memory is needed.
- `KVGroups`: a stage with both full-attention and sliding-window layers keeps them in two pools
  (`KVPool.group` holds the window layers), each with its own manager and block table per
  sequence; every operation goes to both, all or nothing. A stage whose KV layers all slide
  (Mistral) has one `WindowBlocks`; a stage with no sliding layer, one `KVManager`.

What each engine operation does (docs/engine.md, "Sliding windows"):
- a step's write at `start` needs the window before it: positions [start - window + 1, start);
  a write whose window was given back is refused (BadWrite -> FAILED_PRECONDITION: replay it);
  rolling back at most `rollback` positions never reaches a hole;
- fork: the child shares the parent's blocks, holes included; it holds its length where its
  window is still held there, else nothing (`held`: the scheduler truncates it and OpenSession
  reports how much it holds, so the controller computes the rest);
- prefix cache: a sequence attaches the longest prefix every group holds in its cache (the window
  group's whole chain of blocks from position 0, as the full group's), then gives back what lies
  before its window;
- admission and budgets: a sequence takes at most `bound` blocks of a window group between steps,
  so admission counts that much for a long prompt, not its length.
"""
from __future__ import annotations

from dataclasses import replace

from logicpipe.stage_node.engine.blocks import HOLE, BadWrite, BlockTable, KVManager, OutOfBlocks, WritePlan

ROLLBACK = 64  # positions a step may start below a sequence's length (net.wire.MAX_CANDIDATES candidates)


class WindowBlocks(KVManager):
    """A KV manager for sliding-window layers: a sequence keeps the blocks of its last
    `window + rollback` positions (and the block being written)."""

    def __init__(self, num_blocks: int, block_size: int, window: int, rollback: int = ROLLBACK):
        super().__init__(num_blocks, block_size)
        if window < 1 or rollback < 0:
            raise ValueError(f"a window of {window} positions and a rollback of {rollback} make no sense")
        self.window = window      # positions a row attends back, its own included
        self.rollback = rollback  # positions below its length a step may start at

    @property
    def keep(self) -> int:
        """Positions before its length a sequence keeps between steps."""
        return self.window + self.rollback

    @property
    def bound(self) -> int:
        """Blocks a sequence holds at most between steps (its window, unaligned, and its last block)."""
        return held_blocks(self.window, self.block_size, self.rollback)

    @staticmethod
    def given_back(t: BlockTable) -> int:
        """Leading blocks of `t` given back (holes)."""
        n = 0
        while n < len(t.blocks) and t.blocks[n] == HOLE:
            n += 1
        return n

    def writable(self, t: BlockTable, start: int) -> bool:
        """Whether rows from `start` find their window: positions [start - window + 1, start) held."""
        lo = max(0, start - self.window + 1)
        return self.given_back(t) <= lo // self.block_size or start == 0

    def slide(self, seq: str) -> None:
        """Give back the blocks of `seq` wholly before its last `keep` positions."""
        t = self.tables[seq]
        for i in range(max(0, t.length - self.keep) // self.block_size):
            if t.blocks[i] != HOLE:
                self._release([t.blocks[i]])
                t.blocks[i] = HOLE

    # ---- KVManager, with the window ----------------------------------------------------------
    def write_need(self, seq: str, start: int, n: int) -> int:
        t = self.tables[seq]
        if not self.writable(t, start):
            raise BadWrite(f"cannot write at {start}: the sliding window before it was given back "
                           f"(it holds positions from {self.given_back(t) * self.block_size} of {t.length})")
        return super().write_need(seq, start, n)

    def prepare_write(self, seq: str, start: int, n: int, tokens=None) -> WritePlan:
        self.write_need(seq, start, n)  # (the window check)
        return super().prepare_write(seq, start, n, tokens)

    def commit(self, seq: str, start: int, tokens) -> None:
        super().commit(seq, start, tokens)
        self.slide(seq)

    def attach_prefix(self, seq: str, tokens) -> int:
        held = super().attach_prefix(seq, tokens)
        self.slide(seq)
        return held

    def reserve(self, seq: str, upto: int) -> None:
        """Take the blocks of the first positions up to `upto` that the sequence holds at once."""
        t = self.tables[seq]
        super().reserve(seq, min(upto, (self.given_back(t) + self.bound) * self.block_size))

    def fits(self, capacity: int) -> bool:
        return min(self.blocks_for(capacity), self.bound) <= self.num_blocks

    def shortfall(self, seq: str, upto: int, spare: int) -> int:
        t = self.tables[seq]
        need = max(0, min(self.blocks_for(upto), self.given_back(t) + self.bound) - len(t.blocks))
        return max(0, need + spare - self.available)

    def held(self, seq: str) -> int:
        t = self.tables[seq]
        return t.length if self.writable(t, t.length) else 0

    def read_window(self, seq: str, upto: int) -> tuple[int, ...]:
        return self.read_span(seq, upto)


class KVGroups:
    """A stage's two KV managers: `main` (its full-attention layers) and `group` (its sliding-window
    layers, in `KVPool.group`). Every sequence has a block table in each; what is not a sequence
    operation (tables, counts, the prefix cache's statistics) is `main`'s."""

    def __init__(self, main: KVManager, group: WindowBlocks):
        if main.block_size != group.block_size:
            raise ValueError("both groups count positions in blocks of the same size")
        self.main, self.group = main, group

    def __getattr__(self, name):  # tables, block_size, blocks_for, available, used, cached, span, ...
        return getattr(self.main, name)

    @property
    def window(self) -> int:
        return self.group.window

    def open(self, seq: str, capacity: int = 1) -> BlockTable:
        self.group.open(seq, capacity)
        return self.main.open(seq, capacity)

    def close(self, seq: str) -> None:
        self.main.close(seq)
        self.group.close(seq)

    def attach_prefix(self, seq: str, tokens) -> int:
        """The longest prefix both groups hold in their caches."""
        both = len(self.group.match_prefix(tokens)) * self.block_size
        held = self.main.attach_prefix(seq, tokens[:both])
        self.group.attach_prefix(seq, tokens[:held])
        return held

    def fork(self, parent: str, child: str, length: int, capacity: int = 1) -> BlockTable:
        self.group.fork(parent, child, length, capacity)
        return self.main.fork(parent, child, length, capacity)

    def reserve(self, seq: str, upto: int) -> None:
        missing = self.shortfall(seq, upto, 0)
        if missing:
            raise OutOfBlocks(missing, f"needs {missing} more KV blocks than are free")
        self.main.reserve(seq, upto)
        self.group.reserve(seq, upto)

    def truncate(self, seq: str, length: int) -> None:
        self.main.truncate(seq, length)
        self.group.truncate(seq, length)

    def prepare_write(self, seq: str, start: int, n: int, tokens=None) -> WritePlan:
        """Both groups' blocks for the write (all or nothing); the window group's in `plan.window`."""
        need = {m: m.write_need(seq, start, n) for m in (self.main, self.group)}
        missing = max(need[m] - m.available for m in need)
        if missing > 0:
            raise OutOfBlocks(missing, f"needs {need[self.main]} + {need[self.group]} KV blocks (full, window layers), "
                                       f"{self.main.available} + {self.group.available} are free")
        plan = self.main.prepare_write(seq, start, n, tokens)
        return replace(plan, window=self.group.prepare_write(seq, start, n, tokens))

    def commit(self, seq: str, start: int, tokens) -> None:
        self.main.commit(seq, start, tokens)
        self.group.commit(seq, start, tokens)

    def fits(self, capacity: int) -> bool:
        return self.main.fits(capacity) and self.group.fits(capacity)

    def shortfall(self, seq: str, upto: int, spare: int) -> int:
        return max(self.main.shortfall(seq, upto, spare), self.group.shortfall(seq, upto, spare))

    def held(self, seq: str) -> int:
        return min(self.main.held(seq), self.group.held(seq))

    def read_window(self, seq: str, upto: int) -> tuple[int, ...]:
        return self.group.read_span(seq, upto)


def held_blocks(window: int, block_size: int, rollback: int = ROLLBACK) -> int:
    """Blocks a sequence of a window group holds at most between steps: those of its last
    `window + rollback` positions, which need not start at a block's start, and the block being written."""
    return -(-(window + rollback) // block_size) + 1


def managers(num_blocks: int, block_size: int, window: int | None = None, group_blocks: int = 0,
             rollback: int = ROLLBACK) -> KVManager | KVGroups:
    """The KV manager of a stage's pool: plain (`window` None: no layer holds only its window), one
    `WindowBlocks` (every KV layer slides), or `KVGroups` (a window group of `group_blocks` blocks too)."""
    if window is None:
        return KVManager(num_blocks, block_size)
    if not group_blocks:
        return WindowBlocks(num_blocks, block_size, window, rollback)
    return KVGroups(KVManager(num_blocks, block_size), WindowBlocks(group_blocks, block_size, window, rollback))


def split_budget(budget: int, full_bytes: int, window_bytes: int, keep: int, context: int) -> tuple[int, int]:
    """A KV budget (bytes) split between a stage's full-attention pool and its window pool
    (`full_bytes` and `window_bytes` a position, `keep` positions a window sequence holds) so that
    both hold the same number of sequences of `context` positions."""
    full, win = full_bytes * context, window_bytes * min(context, keep)
    main = budget * full // (full + win)
    return main, budget - main
