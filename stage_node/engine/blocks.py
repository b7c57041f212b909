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
- **placement**: a sequence's blocks are placed in one run of free blocks when possible, with
  room to grow (a soft reservation other sequences use only when memory is short), so that
  attention can read its keys as one strided view instead of gathering them.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from enum import IntEnum

DEFAULT_BLOCK_SIZE = 16  # KV positions per block (tokens)


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


@dataclass
class BlockTable:
    """One sequence's blocks: position p lives in slot blocks[p // bs] * bs + p % bs."""

    blocks: list[int] = field(default_factory=list)
    length: int = 0                                   # positions written and valid (tokens)
    tokens: list[int] = field(default_factory=list)   # token ids of positions [0, length)
    hashes: list[int] = field(default_factory=list)   # prefix hash of each full block, in order
    expect_blocks: int = 1                            # blocks it expects to need in all (its capacity)
    room: range = range(0)                            # its soft reservation for growth (block ids)


@dataclass(frozen=True)
class WritePlan:
    """What a step must do for one sequence before its forward: copy these blocks (copy on write),
    then write its new positions into these slots."""

    copies: tuple[tuple[int, int], ...]  # (source block, destination block)
    slots: tuple[int, ...]               # pool slot of each new position, in order


def block_hash(previous: int | None, tokens) -> int:
    """Prefix-cache key of a full block: its tokens and, through `previous`, every block before it."""
    return hash((0 if previous is None else previous, tuple(tokens)))


class KVManager:
    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one position, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.state = bytearray(num_blocks)  # BlockState per block
        self.counts = {s: 0 for s in BlockState}
        self.counts[BlockState.FREE] = num_blocks
        self.cached: OrderedDict[int, None] = OrderedDict()  # CACHED blocks, least recently used first
        self.by_hash: dict[int, int] = {}
        self.tables: dict[str, BlockTable] = {}
        self.prefix_hit_tokens = 0  # positions attached from the cache instead of computed, since start

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
        attached (a multiple of the block size)."""
        t = self.tables[seq]
        if t.blocks:
            raise ValueError(f"sequence {seq} is not empty")
        hits = self.match_prefix(tokens)
        for b in hits:
            self._hold(b)
            t.hashes.append(self.blocks[b].hash)
        t.blocks = list(hits)
        t.length = len(hits) * self.block_size
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
    def prepare_write(self, seq: str, start: int, n: int) -> WritePlan:
        """Blocks for positions [start, start + n) of `seq` (start <= its length: a start below it
        rolls the sequence back first). Copies shared blocks it will write (copy on write) and
        takes new ones. All or nothing: raises OutOfBlocks before changing anything."""
        t = self.tables[seq]
        if not 0 <= start <= t.length or n < 1:
            raise BadWrite(f"cannot write {n} positions at {start} of a sequence of {t.length}")
        bs = self.block_size
        first, last = start // bs, (start + n - 1) // bs
        kept = min(len(t.blocks), self.blocks_for(start) if start < t.length else len(t.blocks))
        shared = [i for i in range(first, min(last + 1, kept)) if self.blocks[t.blocks[i]].ref_count > 1]
        need = len(shared) + max(0, last + 1 - kept)
        if need > self.available:
            raise OutOfBlocks(need - self.available,
                              f"needs {need} KV blocks, {self.available} of {self.num_blocks} are free")
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

    def commit(self, seq: str, start: int, tokens) -> None:
        """The step wrote `tokens` at [start, start + len(tokens)): they are valid now, and every
        block that became full is registered in the prefix cache."""
        t = self.tables[seq]
        t.length = start + len(tokens)
        del t.tokens[start:]
        t.tokens.extend(tokens)
        bs = self.block_size
        while len(t.hashes) < t.length // bs:
            i = len(t.hashes)
            chunk = tuple(t.tokens[i * bs:(i + 1) * bs])
            h = block_hash(t.hashes[-1] if t.hashes else None, chunk)
            t.hashes.append(h)
            b = self.blocks[t.blocks[i]]
            if h not in self.by_hash and b.hash is None:
                b.hash, b.tokens = h, chunk
                self.by_hash[h] = b.id

    def read_span(self, seq: str, upto: int) -> tuple[int, ...]:
        """The blocks holding positions [0, upto) of `seq`, in order."""
        return tuple(self.tables[seq].blocks[: self.blocks_for(upto)])

    # ---- blocks -----------------------------------------------------------------------------
    def _hold(self, b: int) -> None:
        blk = self.blocks[b]
        if blk.ref_count == 0:
            if self.state[b] == BlockState.CACHED:
                del self.cached[b]
            self._set(b, BlockState.USED)
        blk.ref_count += 1

    def _release(self, block_ids) -> None:
        for b in block_ids:
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

    def _alloc(self, t: BlockTable) -> int:
        """A block for table `t`: the one after its last (so its blocks stay consecutive) when that
        is free or its own growth room, else a new run placed for its expected size, else any
        free block, else a reserved one, else the least recently used cached one."""
        b = None
        if t.blocks:
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
