"""The KV manager of one stage: fixed-size blocks of KV positions, a block table per sequence,
reference counts, copy on write, truncation, and a prefix cache keyed by block hashes.

Pure bookkeeping (no torch): it decides which pool slots a step writes and reads, and which blocks
must be copied first; the runner moves the tensors (`stage_node.kv.KVPool`). Shaped after
nano-vllm's block manager, grown what a pipeline stage needs:

- **fork**: a child sequence shares its parent's blocks (reference counts); the first write into a
  shared block copies it (copy on write), so a parent and its children never see each other's
  new positions.
- **truncate**: roll a sequence back (rejected candidate tokens, a rewind); whole blocks past the
  new length go back to the pool.
- **prefix cache**: a full block is registered under hash(previous block's hash, its token ids);
  a new sequence whose prompt starts with registered blocks attaches them instead of computing
  them again. A block nobody holds stays cached until its memory is needed (LRU eviction).
- **layers kept across plans** (issue 34): with `span` set (the stage's layers [start, end)), a
  registered block also records which layers' KV it holds (`Block.layers`, absolute) and at which
  layer boundaries it holds the hidden rows entering that layer (`Block.logs`: the stage's output
  rows, and rows it computed inside its range). A re-plan that moves a stage's range keeps the
  layers both ranges share (the runtime copies them into the new pool), so a replayed sequence
  attaches blocks that hold only part of its layers: its rows there are computed again only from
  the highest boundary whose rows the block holds (`resume_layer`), or not at all.
- **placement**: a sequence's blocks are placed in one run of free blocks when possible, with
  room to grow (a soft reservation other sequences use only when memory is short), so that
  attention can read its keys as one strided view instead of gathering them.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from enum import IntEnum

DEFAULT_BLOCK_SIZE = 16  # KV positions per block (tokens)
HOLE = -1  # a block table's entry for a block a sliding-window sequence gave back (engine.window)


class OutOfBlocks(Exception):
    """Not enough free blocks; `missing` says how many more a request needs."""

    def __init__(self, missing: int, message: str):
        super().__init__(message)
        self.missing = missing


class BadWrite(ValueError):
    """A write that does not continue (or roll back) the sequence's positions."""


class BlockState(IntEnum):
    FREE = 0      # nobody holds it, nothing cached in it
    RESERVED = 1  # free, but inside a live sequence's growth room (taken by others only when short)
    USED = 2      # held by one or more sequences
    CACHED = 3    # nobody holds it; kept for its prefix hash until its memory is needed


@dataclass
class Block:
    id: int
    ref_count: int = 0
    hash: int | None = None           # prefix-cache key, while registered
    tokens: tuple[int, ...] = ()      # its token ids, while registered (checked on a hit)
    layers: tuple[int, int] = (0, 0)  # absolute layers whose KV it holds for all its positions (while registered)
    logs: frozenset[int] = frozenset()  # layer boundaries whose input rows it holds for all its positions


@dataclass
class BlockTable:
    """One sequence's blocks: position p lives in slot blocks[p // bs] * bs + p % bs."""

    blocks: list[int] = field(default_factory=list)
    length: int = 0                                   # positions written and valid (tokens)
    tokens: list[int] = field(default_factory=list)   # token ids of positions [0, length)
    hashes: list[int] = field(default_factory=list)   # prefix hash of each full block, in order
    expect_blocks: int = 1                            # blocks it expects to need in all (its capacity)
    resume: int = 0                                   # attached positions below this are computed again in
                                                      # place (only the layers their blocks lack), not truncated
    resume_tokens: tuple[int, ...] = ()               # ... their token ids
    room: range = range(0)                            # its soft reservation for growth (block ids)


@dataclass(frozen=True)
class WritePlan:
    """What a step must do for one sequence before its forward: copy these blocks (copy on write),
    then write its new positions into these slots."""

    copies: tuple[tuple[int, int], ...]  # (source block, destination block)
    slots: tuple[int, ...]               # pool slot of each new position, in order
    starts: tuple[int, ...] = ()         # attached blocks written again: the absolute layer each row is
                                         # computed from (its block's resume_layer; non-increasing), one per
                                         # row from the first; () when every row is computed from the first layer
    upgraded: tuple[tuple[int, int, int], ...] = ()  # (block, first layers to, resume layer) of blocks it covers whole
    pres: tuple[int, ...] = ()           # rows of a range grown downward: they compute the stage's layers up to
                                         # this one first (the stage's start: none), one per row; () when none
    window: "WritePlan | None" = None    # a stage's sliding-window layers in a pool of their own: their
                                         # copies and slots (engine.window.KVGroups); None: they use these


def block_hash(previous: int | None, tokens) -> int:
    """Prefix-cache key of a full block: its tokens and, through `previous`, every block before it."""
    return hash((0 if previous is None else previous, tuple(tokens)))


class Blocks(dict):
    """A pool's `Block`s by id, each made on first use: a small model's KV in a big budget is
    hundreds of thousands of blocks, and making them all cost seconds at every assignment (an
    untouched block is a free one with nothing cached, what a new `Block` is)."""

    def __init__(self, num_blocks: int):
        super().__init__()
        self.num_blocks = num_blocks

    def __missing__(self, b: int) -> Block:
        if not 0 <= b < self.num_blocks:
            raise IndexError(f"block {b} of a pool of {self.num_blocks}")
        blk = self[b] = Block(b)
        return blk


class KVManager:
    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one position, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = Blocks(num_blocks)
        self.state = bytearray(num_blocks)  # BlockState per block
        self.counts = {s: 0 for s in BlockState}
        self.counts[BlockState.FREE] = num_blocks
        self.cached: OrderedDict[int, None] = OrderedDict()  # CACHED blocks, least recently used first
        self.by_hash: dict[int, int] = {}
        self.tables: dict[str, BlockTable] = {}
        self.prefix_hit_tokens = 0  # positions attached from the cache instead of computed, since start
        self.span: tuple[int, int] | None = None  # the stage's layers: blocks record what they hold (None: all)
        self.last = False                         # ... a last stage (its rows leave as tokens, not rows)
        self.logged: frozenset[int] = frozenset()  # ... the boundaries whose rows every computed row leaves in the pool
        self.partial = False  # ... its rows may run part of its layers (Shard.can_tap): a range grown downward resumes

    # ---- layers a block holds (issue 34) ----------------------------------------------------
    def carried(self, num_blocks: int, span: tuple[int, int], last: bool, logged: frozenset[int],
                logs: frozenset[int]) -> tuple["KVManager", list[int]]:
        """A manager for the next range of this stage (`span`, over a pool of `num_blocks`,
        logging `logged` and holding the rows of `logs`) that keeps this one's cached blocks (no
        sequence may be open) that hold layers both ranges share, least recently used first; and
        the ids of those blocks (their layers and rows are copied by KVPool.take_over)."""
        if self.tables:
            raise ValueError(f"{len(self.tables)} sequences are still open")
        new = KVManager(num_blocks, self.block_size)
        new.span, new.last, new.logged = span, last, logged
        kept = []
        for b in self.cached:
            blk = self.blocks[b]
            lo, hi = max(blk.layers[0], span[0]), min(blk.layers[1], span[1])
            if b >= num_blocks or blk.hash is None or lo >= hi:
                continue
            nb = new.blocks[b]
            nb.hash, nb.tokens, nb.layers = blk.hash, blk.tokens, (lo, hi)
            nb.logs = frozenset(x for x in blk.logs if x in logs and lo <= x <= hi)
            new.by_hash[blk.hash] = b
            new._set(b, BlockState.CACHED)
            new.cached[b] = None
            kept.append(b)
        return new, kept

    def holds_all(self, b: int) -> bool:
        """Block b holds the KV of every layer of the stage."""
        if self.span is None:
            return True
        lo, hi = self.blocks[b].layers
        return lo <= self.span[0] and hi >= self.span[1]

    def resume_layer(self, b: int) -> int:
        """The absolute layer from which the rows of block b must be computed again on this stage:
        its end when the block holds every layer (and, before a last stage, the output rows), else
        the highest boundary whose input rows it holds with every layer below it, else the start."""
        if self.span is None:
            return 0
        s, e = self.span
        blk = self.blocks[b]
        lo, hi = blk.layers
        if lo > s or hi <= s:
            return s
        top = min(hi, e)
        if top == e and self.last:
            return e
        return max((x for x in blk.logs if s < x <= top), default=s)

    def below(self, b: int) -> tuple[int, int] | None:
        """A block of a range grown downward (it holds layers [lo, ...) above the stage's start, and
        `partial` allows it): (lo, r) where its rows compute layers [start, lo) from the stage's
        input and then resume at r, the highest boundary whose rows it holds (its end, on a last
        stage that holds the rest); None otherwise."""
        if self.span is None or not self.partial:
            return None
        s, e = self.span
        lo, hi = self.blocks[b].layers
        if not s < lo < hi:
            return None
        top = min(hi, e)
        if top == e and self.last:
            return lo, e
        r = max((x for x in self.blocks[b].logs if lo < x <= top), default=None)
        return None if r is None else (lo, r)

    # ---- accounting -------------------------------------------------------------------------
    @property
    def available(self) -> int:
        """Blocks a new write can take: free, reserved for growth, or cached (evicted on demand)."""
        return self.num_blocks - self.counts[BlockState.USED]

    @property
    def used(self) -> int:
        return self.counts[BlockState.USED]

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def _set(self, b: int, s: BlockState) -> None:
        self.counts[BlockState(self.state[b])] -= 1
        self.state[b] = s
        self.counts[s] += 1

    # ---- sequences --------------------------------------------------------------------------
    def open(self, seq: str, capacity: int = 1) -> BlockTable:
        """An empty block table; `capacity` (positions) sizes its growth room."""
        if seq in self.tables:
            raise ValueError(f"sequence {seq} already has a block table")
        t = self.tables[seq] = BlockTable(expect_blocks=max(1, self.blocks_for(capacity)))
        return t

    def close(self, seq: str) -> None:
        t = self.tables.pop(seq)
        self._release(t.blocks)
        self._unreserve(t)

    def match_prefix(self, tokens) -> list[int]:
        """Blocks of the prefix cache holding the longest run of whole blocks `tokens` starts with."""
        out, h, bs = [], None, self.block_size
        for i in range(len(tokens) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = block_hash(h, chunk)
            b = self.by_hash.get(h)
            if b is None or self.blocks[b].tokens != chunk:
                break
            out.append(b)
        return out

    def attach_prefix(self, seq: str, tokens) -> int:
        """Give an empty sequence the cached blocks its `tokens` start with; returns the positions
        whose blocks hold every layer of the stage (a multiple of the block size: where a replay
        may start). Blocks past those that hold some layers (with `span`) are attached too: the
        replay's rows there are computed again in place, from their `resume_layer`."""
        t = self.tables[seq]
        if t.blocks:
            raise ValueError(f"sequence {seq} is not empty")
        hits = self.match_prefix(tokens)
        full = 0
        while full < len(hits) and self.holds_all(hits[full]):
            full += 1
        if self.span is not None:  # partly held blocks: worth attaching while a row skips some layers
            keep = full
            while keep < len(hits) and (self.resume_layer(hits[keep]) > self.span[0] or
                                        self.below(hits[keep]) is not None):
                keep += 1
            hits = hits[:keep]
        for b in hits:
            self._hold(b)
            t.hashes.append(self.blocks[b].hash)
        t.blocks = list(hits)
        t.length = full * self.block_size
        t.resume = len(hits) * self.block_size if self.span is not None else 0
        t.resume_tokens = tuple(tokens[: t.resume])
        t.tokens = list(tokens[: t.length])
        self.prefix_hit_tokens += t.length
        return t.length

    def fork(self, parent: str, child: str, length: int, capacity: int = 1) -> BlockTable:
        """`child` shares `parent`'s first `length` positions (its blocks, by reference)."""
        p = self.tables[parent]
        if not 0 <= length <= p.length:
            raise ValueError(f"cannot fork {length} positions of a sequence of {p.length}")
        t = self.open(child, capacity)
        t.blocks = p.blocks[: self.blocks_for(length)]
        for b in t.blocks:
            self._hold(b)
        t.length, t.tokens = length, p.tokens[:length]
        t.hashes = p.hashes[: length // self.block_size]
        return t

    def reserve(self, seq: str, upto: int) -> None:
        """Take the blocks positions [0, upto) of `seq` will need, now (all or nothing)."""
        t = self.tables[seq]
        need = self.blocks_for(upto) - len(t.blocks)
        if need > self.available:
            raise OutOfBlocks(need - self.available,
                              f"needs {need} KV blocks, {self.available} of {self.num_blocks} are free")
        for _ in range(need):
            t.blocks.append(self._alloc(t))

    def truncate(self, seq: str, length: int) -> None:
        """Forget positions [length, ...); whole blocks past it go back to the pool."""
        t = self.tables[seq]
        if not 0 <= length <= t.length:
            raise ValueError(f"cannot truncate a sequence of {t.length} positions to {length}")
        keep = self.blocks_for(length)
        self._release(t.blocks[keep:])
        del t.blocks[keep:]
        t.length = length
        del t.tokens[length:]
        del t.hashes[length // self.block_size:]

    # ---- a step's writes --------------------------------------------------------------------
    def prepare_write(self, seq: str, start: int, n: int, tokens=None) -> WritePlan:
        """Blocks for positions [start, start + n) of `seq` (start <= its length: a start below it
        rolls the sequence back first, except over attached blocks a replay writes again in place:
        `tokens`, when given, must be theirs). Copies shared blocks it will write (copy on write)
        and takes new ones. All or nothing: raises OutOfBlocks before changing anything."""
        t = self.tables[seq]
        if not 0 <= start <= t.length or n < 1:
            raise BadWrite(f"cannot write {n} positions at {start} of a sequence of {t.length}")
        if t.resume and (start >= t.resume or (tokens is not None and
                                               tuple(tokens[: t.resume - start]) != t.resume_tokens[start: start + n])):
            self.truncate(seq, t.length)  # the attached blocks past the written length go (no longer rewritten)
            t.resume, t.resume_tokens = 0, ()
        if t.resume:
            return self._prepare_resume(t, start, n)
        need = self.write_need(seq, start, n)
        if need > self.available:
            raise OutOfBlocks(need - self.available,
                              f"needs {need} KV blocks, {self.available} of {self.num_blocks} are free")
        bs = self.block_size
        first, last = start // bs, (start + n - 1) // bs
        if start < t.length:
            self.truncate(seq, start)
        copies = []
        for i in range(first, min(last + 1, len(t.blocks))):
            b = t.blocks[i]
            if self.blocks[b].ref_count > 1:  # copy on write
                new = self._alloc(t)
                copies.append((b, new))
                self._release([b])
                t.blocks[i] = new
            elif self.blocks[b].hash is not None:  # ours alone, but registered: its content changes
                self._unregister(b)
        while len(t.blocks) <= last:
            t.blocks.append(self._alloc(t))
        slots = tuple(t.blocks[p // bs] * bs + p % bs for p in range(start, start + n))
        return WritePlan(tuple(copies), slots)

    def write_need(self, seq: str, start: int, n: int) -> int:
        """New blocks a write of positions [start, start + n) takes (copies on write included)."""
        t = self.tables[seq]
        if not 0 <= start <= t.length or n < 1:
            raise BadWrite(f"cannot write {n} positions at {start} of a sequence of {t.length}")
        bs = self.block_size
        first, last = start // bs, (start + n - 1) // bs
        kept = min(len(t.blocks), self.blocks_for(start) if start < t.length else len(t.blocks))
        shared = [i for i in range(first, min(last + 1, kept)) if self.blocks[t.blocks[i]].ref_count > 1]
        return len(shared) + max(0, last + 1 - kept)

    # ---- what admission and the runner ask of every manager (engine.window answers for sliding windows)
    window: int | None = None  # positions a sliding-window layer attends back (engine.window.WindowBlocks)

    def fits(self, capacity: int) -> bool:
        """Whether one sequence of `capacity` positions fits the pool at all."""
        return self.blocks_for(capacity) <= self.num_blocks

    def shortfall(self, seq: str, upto: int, spare: int) -> int:
        """Blocks missing for `seq` to hold positions [0, upto) while `spare` more stay free (0: none)."""
        need = max(0, self.blocks_for(upto) - len(self.tables[seq].blocks))
        return max(0, need + spare - self.available)

    def held(self, seq: str) -> int:
        """The positions of `seq` a step may continue from (its length; less where a window gave blocks back)."""
        return self.tables[seq].length

    def read_window(self, seq: str, upto: int) -> tuple[int, ...] | None:
        """The blocks of `seq`'s sliding-window layers (engine.window); None: they read `read_span`'s."""
        return None

    def _prepare_resume(self, t: BlockTable, start: int, n: int) -> WritePlan:
        """A replay's rows over attached blocks: written again in place (the same tokens give the
        same KV, so a block shared with another sequence is not copied), each from its block's
        resume layer (the lowest so far: a row never reads a layer an earlier row has yet to
        write); rows past the attached blocks take new blocks and are computed whole. Leading
        blocks of a range grown downward (`below`, all over the same layers) first compute the
        layers under those they hold, then resume."""
        bs = self.block_size
        stop = start + n
        need = max(0, self.blocks_for(stop) - len(t.blocks))
        if need > self.available:
            raise OutOfBlocks(need - self.available,
                              f"needs {need} KV blocks, {self.available} of {self.num_blocks} are free")
        while len(t.blocks) < self.blocks_for(stop):
            t.blocks.append(self._alloc(t))
        s = self.span[0]
        starts, pres, low, upgraded = [], [], self.span[1], []
        down, others = None, False  # the layers the leading downward blocks compute first; any other block seen
        for i in range(start // bs, self.blocks_for(stop)):
            b = t.blocks[i]
            attached = (i + 1) * bs <= t.resume
            d = self.below(b) if attached and not others else None
            if d is not None and (down is None or d[0] == down) and d[1] <= low:
                down, pre, low = d[0], d[0], d[1]
            else:
                others, pre = True, s
                low = min(low, self.resume_layer(b) if attached else s)
            rows = min(stop, (i + 1) * bs) - max(start, i * bs)
            starts.extend([low] * rows)
            pres.extend([pre] * rows)
            if i * bs >= start and (i + 1) * bs <= min(stop, t.resume):
                upgraded.append((b, pre, low))
        slots = tuple(t.blocks[p // bs] * bs + p % bs for p in range(start, stop))
        resumed = any(x != s for x in starts) or any(x != s for x in pres)
        return WritePlan((), slots, tuple(starts) if resumed else (), tuple(upgraded),
                         tuple(pres) if down is not None else ())

    def upgrade(self, written: tuple[tuple[int, int, int], ...]) -> None:
        """Blocks a replay wrote whole (WritePlan.upgraded: each computed the stage's layers up to
        `pre`, then from `r`): they hold the stage's layers now, and the rows of the boundaries it
        logs where it computed."""
        if self.span is None:
            return
        s, e = self.span
        for b, pre, r in written:
            blk = self.blocks[b]
            lo, hi = blk.layers
            if pre > s:  # [s, pre) computed, [pre, r) held, [r, e) computed
                blk.layers = (s, max(hi, e))
            else:
                blk.layers = (min(lo, r), max(hi, e)) if lo <= r <= hi else (r, e)
            blk.logs = blk.logs | frozenset(x for x in self.logged if x > r or s < x < pre)

    def commit(self, seq: str, start: int, tokens) -> None:
        """The step wrote `tokens` at [start, start + len(tokens)): they are valid now, and every
        block that became full is registered in the prefix cache."""
        t = self.tables[seq]
        t.length = start + len(tokens)
        del t.tokens[start:]
        t.tokens.extend(tokens)
        if t.resume and t.length >= t.resume:
            t.resume, t.resume_tokens = 0, ()
        bs = self.block_size
        while len(t.hashes) < t.length // bs:
            i = len(t.hashes)
            chunk = tuple(t.tokens[i * bs:(i + 1) * bs])
            h = block_hash(t.hashes[-1] if t.hashes else None, chunk)
            t.hashes.append(h)
            if t.blocks[i] == HOLE:
                continue
            b = self.blocks[t.blocks[i]]
            if h not in self.by_hash and b.hash is None:
                b.hash, b.tokens = h, chunk
                self.by_hash[h] = b.id
                if self.span is not None:
                    b.layers, b.logs = self.span, self.logged

    def read_span(self, seq: str, upto: int) -> tuple[int, ...]:
        """The blocks holding positions [0, upto) of `seq`, in order."""
        return tuple(self.tables[seq].blocks[: self.blocks_for(upto)])

    # ---- blocks -----------------------------------------------------------------------------
    def _hold(self, b: int) -> None:
        if b == HOLE:
            return
        blk = self.blocks[b]
        if blk.ref_count == 0:
            if self.state[b] == BlockState.CACHED:
                del self.cached[b]
            self._set(b, BlockState.USED)
        blk.ref_count += 1

    def _release(self, block_ids) -> None:
        for b in block_ids:
            if b == HOLE:
                continue
            blk = self.blocks[b]
            blk.ref_count -= 1
            if blk.ref_count == 0:
                if blk.hash is not None:
                    self._set(b, BlockState.CACHED)
                    self.cached[b] = None
                else:
                    self._set(b, BlockState.FREE)

    def _unregister(self, b: int) -> None:
        blk = self.blocks[b]
        if blk.hash is not None and self.by_hash.get(blk.hash) == b:
            del self.by_hash[blk.hash]
        blk.hash, blk.tokens = None, ()
        blk.layers, blk.logs = (0, 0), frozenset()

    def _alloc(self, t: BlockTable) -> int:
        """A block for table `t`: the one after its last (so its blocks stay consecutive) when that
        is free or its own growth room, else a new run placed for its expected size, else any
        free block, else a reserved one, else the least recently used cached one."""
        b = None
        if t.blocks and t.blocks[-1] != HOLE:
            nxt = t.blocks[-1] + 1
            if nxt < self.num_blocks and (self.state[nxt] == BlockState.FREE or
                                          (self.state[nxt] == BlockState.RESERVED and nxt in t.room)):
                b = nxt
        if b is None and not t.room:
            b = self._place(t)
        if b is None:
            b = self._find(BlockState.FREE)
        if b is None:
            b = self._find(BlockState.RESERVED)
        if b is None and self.cached:
            b = next(iter(self.cached))
            del self.cached[b]
            self._unregister(b)
        if b is None:
            raise OutOfBlocks(1, f"no free KV block (all {self.num_blocks} in use)")
        self._set(b, BlockState.USED)
        self.blocks[b].ref_count = 1
        return b

    def _place(self, t: BlockTable) -> int | None:
        """Start a run of free blocks for `t`'s remaining expected size and reserve the rest of it."""
        want = max(1, t.expect_blocks - len(t.blocks))
        i = self.state.find(bytes([BlockState.FREE]) * want)
        if i < 0:
            return None
        t.room = range(i, i + want)
        for b in t.room[1:]:
            self._set(b, BlockState.RESERVED)
        return i

    def _find(self, s: BlockState) -> int | None:
        i = self.state.find(bytes([s]))
        return None if i < 0 else i

    def _unreserve(self, t: BlockTable) -> None:
        for b in t.room:
            if self.state[b] == BlockState.RESERVED:
                self._set(b, BlockState.FREE)
        t.room = range(0)
