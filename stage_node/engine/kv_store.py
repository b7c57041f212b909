"""A stage's prefix cache on its own disk (issue 34): full KV blocks, each with its prefix-cache
identity, appended to segment files in one directory, read back when the process starts again.

Layout: `key.json` (what the blocks are of: model digest, layers, block size, KV dtype and
shape, device, weight format; a store of another key is removed whole when opened) and segments
`seg-NNNNNNNN.kv`, each a run of records:

    header  <4s q q B 3x I I Q>  magic b"LPKB", hash, previous hash (0 for a first block), first
                                  (1/0), tokens n, CRC-32 of everything after the header's CRC
                                  field, KV bytes
    tokens  n x uint32 (little-endian)
    kv      the block's KV, raw bytes of the pool's dtype, [layers, parts, kv_heads, block_size, head_dim]

Nothing is unpickled: raw bytes and a struct header. A record is taken only when its checksum
matches and its hash is `block_hash(previous, tokens)`; a segment's torn tail (a SIGKILL during a
write) or a damaged record ends that segment's read (counted, never raised). A process appends to a
new segment of its own (never after another's tail); once the segments hold more than `cap_bytes`,
the oldest are dropped whole. Pure file I/O: no torch, no asyncio (the caller runs it off its loop).
"""
from __future__ import annotations

import json
import logging
import os
import struct
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from logicpipe.stage_node.engine.blocks import block_hash

log = logging.getLogger(__name__)

MAGIC = b"LPKB"
HEADER = struct.Struct("<4sqqB3xIIQ")
KEY_FILE = "key.json"
SEGMENT_GLOB = "seg-*.kv"
SEGMENTS_PER_CAP = 8   # a segment is closed at about cap / this (old data leaves in that step)
MAX_TOKENS = 1 << 16   # tokens of one record at most (a block's size; a larger count is a damaged header)


@dataclass(frozen=True)
class Record:
    hash: int
    previous: int | None   # None: the sequence's first block
    tokens: tuple[int, ...]
    kv: bytes


@dataclass
class ReadStats:
    records: int = 0        # records taken
    bad: int = 0            # records skipped: a checksum or hash that does not match
    torn: int = 0           # segments whose read ended at a short or damaged tail


def encode(r: Record) -> bytes:
    tokens = struct.pack(f"<{len(r.tokens)}I", *r.tokens)
    crc = zlib.crc32(r.kv, zlib.crc32(tokens, zlib.crc32(struct.pack("<qqB", r.hash, r.previous or 0,
                                                                       r.previous is None))))
    return HEADER.pack(MAGIC, r.hash, r.previous or 0, r.previous is None, len(r.tokens), crc, len(r.kv)) + tokens + r.kv


def decode_segment(data: bytes, kv_bytes: int, stats: ReadStats) -> list[Record]:
    """The valid records of one segment's bytes, in order: a short tail or a header that makes no
    sense ends it (torn); a record whose checksum or hash does not match is skipped (bad)."""
    out, at = [], 0
    while at < len(data):
        if len(data) - at < HEADER.size:
            stats.torn += 1
            break
        magic, h, prev, first, n, crc, nkv = HEADER.unpack_from(data, at)
        end = at + HEADER.size + 4 * n + nkv
        if magic != MAGIC or n > MAX_TOKENS or nkv != kv_bytes or end > len(data):
            stats.torn += 1
            break
        tokens = data[at + HEADER.size: at + HEADER.size + 4 * n]
        kv = data[end - nkv: end]
        at = end
        previous = None if first else prev
        if zlib.crc32(kv, zlib.crc32(tokens, zlib.crc32(struct.pack("<qqB", h, prev, first)))) != crc:
            stats.bad += 1
            continue
        toks = struct.unpack(f"<{n}I", tokens)
        if block_hash(previous, toks) != h:
            stats.bad += 1
            continue
        out.append(Record(h, previous, toks, bytes(kv)))
    return out


class KvStore:
    """One node's on-disk blocks: `open` with the key of the assignment in force, `read` what an
    earlier process left, `append` rounds of records. `index` (hash -> segment number) says which
    blocks are on disk now."""

    def __init__(self, directory: Path, cap_bytes: int):
        self.dir = Path(directory)
        self.cap = max(1, cap_bytes)
        self.key: dict | None = None
        self.kv_bytes = 0
        self.segments: OrderedDict[int, int] = OrderedDict()  # segment number -> bytes, oldest first
        self.index: dict[int, int] = {}                       # block hash -> the newest segment holding it
        self._current: int | None = None                      # the segment this process appends to
        self.written_blocks = 0
        self.written_bytes = 0
        self.dropped_segments = 0

    def _path(self, n: int) -> Path:
        return self.dir / f"seg-{n:08d}.kv"

    def open(self, key: dict, kv_bytes: int) -> bool:
        """Bind the store to `key` (blocks of `kv_bytes` each): True when the segments on disk are
        of this key (for `read`); otherwise they are removed and the store starts empty."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.key, self.kv_bytes, self._current = dict(key), kv_bytes, None
        self.segments.clear()
        self.index.clear()
        try:
            same = json.loads((self.dir / KEY_FILE).read_text()) == {**key, "kv_bytes": kv_bytes}
        except (OSError, ValueError):
            same = False
        found = sorted(self._number(p) for p in self.dir.glob(SEGMENT_GLOB) if self._number(p) is not None)
        if not same:
            for n in found:
                self._path(n).unlink(missing_ok=True)
            tmp = self.dir / (KEY_FILE + ".tmp")
            tmp.write_text(json.dumps({**key, "kv_bytes": kv_bytes}, sort_keys=True))
            os.replace(tmp, self.dir / KEY_FILE)
            if found:
                log.info("removed %d KV segments of another model, layer range or KV format from %s", len(found), self.dir)
            return False
        for n in found:
            self.segments[n] = self._path(n).stat().st_size
        return bool(found)

    @staticmethod
    def _number(p: Path) -> int | None:
        try:
            return int(p.stem.split("-", 1)[1])
        except (IndexError, ValueError):
            return None

    def read(self, stats: ReadStats | None = None) -> list[Record]:
        """Every valid record on disk, oldest segment first (the newest copy of a hash last)."""
        stats = stats if stats is not None else ReadStats()
        out = []
        for n in list(self.segments):
            try:
                data = self._path(n).read_bytes()
            except OSError:
                self.segments.pop(n, None)
                continue
            for r in decode_segment(data, self.kv_bytes, stats):
                self.index[r.hash] = n
                out.append(r)
        stats.records = len(out)
        return out

    def append(self, records: list[Record]) -> int:
        """Write `records` at the end of this process's segment (a new one when it is full), then drop
        the oldest segments while the store holds more than its cap. Returns the bytes written."""
        if self.key is None:
            raise RuntimeError("the KV store is not open")
        if not records:
            return 0
        if self._current is None or self.segments.get(self._current, 0) >= self.cap // SEGMENTS_PER_CAP:
            self._current = max(self.segments, default=0) + 1
            self.segments[self._current] = 0
        data = b"".join(encode(r) for r in records)
        with open(self._path(self._current), "ab") as f:
            f.write(data)
        self.segments[self._current] += len(data)
        for r in records:
            self.index[r.hash] = self._current
        self.written_blocks += len(records)
        self.written_bytes += len(data)
        self._trim()
        return len(data)

    def _trim(self) -> None:
        while sum(self.segments.values()) > self.cap and len(self.segments) > 1:
            n, _ = self.segments.popitem(last=False)
            self._path(n).unlink(missing_ok=True)
            self.dropped_segments += 1
            for h in [h for h, s in self.index.items() if s == n]:
                del self.index[h]

    @property
    def bytes(self) -> int:
        return sum(self.segments.values())
