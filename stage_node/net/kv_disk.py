"""A stage's prefix cache kept on its own disk (issue 34, --kv-disk-mib): the full KV blocks it
computes for its open sequences and those it adopts from KV mirrors (net.mirror) are appended to
a store under its state directory (engine.kv_store) every WRITE_S, as mirrors send theirs; when
the process starts again (a SIGKILL, a crash, a restart) and is assigned the same layers of the
same model with the same KV format, the store is read back into the new pool's prefix cache
before the assignment serves, so the replays the controller sends it attach their history there
instead of computing it. A store of another key is removed when the first assignment is loaded.

Float KV only, as mirrors (`handoff.movable`). Disk I/O runs in a worker thread; only reading
blocks out of the pool (and writing them into a new one) holds the step lock. A disk error is
logged and counted: the store is an optimisation, the node serves on without it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from pathlib import Path

import torch

from logicpipe.stage_node.engine.kv_store import KvStore, ReadStats, Record
from logicpipe.stage_node.net.mirror import MIRROR_S, block_slots, still_held, unsent_blocks, why_not_movable

log = logging.getLogger(__name__)

WRITE_S = MIRROR_S         # the store takes new full blocks this often (as mirrors send theirs)
ROUND_BYTES = 64 * 2**20   # KV bytes written per round at most (the rest next round)
BATCH_BYTES = 8 * 2**20    # KV bytes read out of (or written into) the pool under one hold of the step lock
ADOPTED_CAP = 1 << 14      # adopted blocks waiting to be written at most (the oldest forgotten first)


def store_key(eng, device: str) -> dict:
    """What the blocks on disk must match to be read back: model, layers, block size, KV layout, numerics."""
    a, pool = eng.assignment, eng.pool
    return {"model_digest": a.model_digest, "start": a.start, "end": a.end, "num_layers": a.num_layers,
            "block_size": pool.block_size, "kv_dtype": str(pool.kv.dtype), "kv_shape": list(pool.kv.shape[:3]),
            "head_dim": pool.kv.shape[-1], "weight_format": eng.shard.weight_format, "device": device}


def block_bytes(pool) -> int:
    """Bytes of one block's KV over every layer of the pool."""
    return pool.kv[:, :, :, :pool.block_size].numel() * pool.kv.element_size()


def read_block_bytes(pool, block_ids) -> list[bytes]:
    """Runner thread: each block's KV as bytes, [layers, parts, kv_heads, block_size, head_dim]."""
    bs = pool.block_size
    x = pool.kv.index_select(3, block_slots(block_ids, bs).to(pool.kv.device))
    x = x.unflatten(3, (len(block_ids), bs)).movedim(3, 0).cpu().contiguous()  # [blocks, L, P, H, bs, D]
    return [x[j].reshape(-1).view(torch.uint8).numpy().tobytes() for j in range(len(block_ids))]


def write_block_bytes(pool, block_ids, data: list[bytes]) -> None:
    """Runner thread: write each block's bytes (read_block_bytes' layout) into `block_ids`."""
    bs, shape = pool.block_size, pool.kv.shape
    raw = torch.frombuffer(bytearray(b"".join(data)), dtype=torch.uint8).view(pool.kv.dtype)
    x = raw.view(len(data), shape[0], shape[1], shape[2], bs, shape[-1]).movedim(0, 3).flatten(3, 4)
    pool.kv.index_copy_(3, block_slots(block_ids, bs).to(pool.kv.device), x.to(pool.kv.device))


class DiskKv:
    """One stage node's on-disk prefix cache; `directory` None or `cap_bytes` 0: off."""

    def __init__(self, runtime, directory: Path | None, cap_bytes: int):
        self.runtime = runtime  # stage_node.runtime.StageRuntime: its engine, step lock, runner, stats
        self.store = KvStore(directory, cap_bytes) if directory is not None and cap_bytes > 0 else None
        self.engine = None       # the engine the store is bound to (its key)
        self.adopted: OrderedDict[int, tuple] = OrderedDict()  # hash -> (previous, tokens): adopted, not on disk yet

    @property
    def on(self) -> bool:
        return self.store is not None

    @property
    def bytes(self) -> int:
        """The store's bytes on disk now (0: off)."""
        return self.store.bytes if self.store is not None else 0

    def note_adopted(self, entries) -> None:
        """Blocks a mirror gave this stage's cache ((hash, previous or None, tokens)): kept on disk too."""
        if self.store is None:
            return
        for h, previous, tokens in entries:
            self.adopted[h] = (previous, tuple(tokens))
        while len(self.adopted) > ADOPTED_CAP:
            self.adopted.popitem(last=False)

    # ---- read back: a new pool (called by the runtime with the step lock held) -------------------
    async def restore(self, eng, fresh: bool) -> int:
        """Bind the store to `eng`'s key; when `fresh` (a new, empty pool) and the store holds blocks of
        that key, adopt them into its prefix cache. Returns the blocks restored."""
        if self.store is None or why_not_movable(self.runtime, eng):
            self.engine = None
            return 0
        if self.engine is not None and not fresh and store_key(self.engine, self.runtime.device) == \
                store_key(eng, self.runtime.device):
            self.engine = eng  # the pool and its cache were kept: what is on disk stays as it is
            return 0
        t0 = time.monotonic()
        self.engine, self.adopted = eng, OrderedDict()
        key, size = store_key(eng, self.runtime.device), block_bytes(eng.pool)
        stats = ReadStats()
        try:
            records = await asyncio.to_thread(self._open_and_read, key, size, stats) if fresh else \
                await asyncio.to_thread(self._open_only, key, size)
        except OSError as exc:
            self.runtime.stats.kv_disk_errors += 1
            self.engine = None  # (nothing is written for this assignment either)
            log.error("could not open the KV store in %s (%s): serving without it", self.store.dir, exc)
            return 0
        if stats.bad or stats.torn:
            log.info("KV store: skipped %d damaged block records and %d torn segment tails", stats.bad, stats.torn)
        restored = 0
        per = max(1, BATCH_BYTES // max(1, size))
        for i in range(0, len(records), per):
            batch = [r for r in records[i:i + per] if len(r.tokens) == eng.kv.block_size]
            ids = eng.kv.adopt([(r.hash, r.previous, r.tokens) for r in batch])
            rows = [j for j, b in enumerate(ids) if b is not None]
            if rows:
                await self.runtime.runner.call(write_block_bytes, eng.pool, [ids[j] for j in rows],
                                               [batch[j].kv for j in rows])
            restored += len(rows)
        self.runtime.stats.kv_disk_restored_blocks += restored
        if records:
            log.info("restored %d KV blocks (%.1f MiB) from disk in %.2f s", restored, restored * size / 2**20,
                     time.monotonic() - t0)
        return restored

    def _open_and_read(self, key: dict, size: int, stats: ReadStats) -> list[Record]:
        return self.store.read(stats) if self.store.open(key, size) else []

    def _open_only(self, key: dict, size: int) -> list[Record]:
        self.store.open(key, size)
        return []

    # ---- write: every MIRROR_S --------------------------------------------------------------------
    async def run(self) -> None:
        if self.store is None:
            return
        while True:
            await asyncio.sleep(WRITE_S)
            try:
                await self.round()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 — the store only saves replays their time; the node serves on
                self.runtime.stats.kv_disk_errors += 1
                log.exception("a KV store round failed")

    async def round(self) -> int:
        """Append the full blocks of the open sequences, and those adopted, that the store lacks. The
        KV bytes written."""
        rt, eng = self.runtime, self.engine
        if eng is None or eng.retired or rt.engine is not eng:
            return 0
        written, size = 0, block_bytes(eng.pool)
        per = max(1, BATCH_BYTES // max(1, size))
        while written < ROUND_BYTES:
            own = unsent_blocks(eng, self.store.index, per)
            adopted = [] if len(own) >= per else self._adopted_todo(eng, per - len(own))
            if not own and not adopted:
                break
            async with rt._step_lock:
                if eng.retired or rt.engine is not eng:
                    return written
                own = [x for x in own if still_held(eng, x) and eng.kv.holds_all(x[1])]  # (not a block of a grown range
                # that lacks some layers yet)
                adopted = [x for x in adopted if eng.kv.by_hash.get(x[0]) == x[3]]
                ids = [x[1] for x in own] + [x[3] for x in adopted]
                data = await rt.runner.call(read_block_bytes, eng.pool, ids) if ids else []
            records = [Record(x[3], x[4], x[5], d) for x, d in zip(own, data)] + \
                [Record(h, prev, tok, d) for (h, prev, tok, _), d in zip(adopted, data[len(own):])]
            for h, *_ in adopted:
                self.adopted.pop(h, None)
            if not records:
                break
            try:
                written += await asyncio.to_thread(self.store.append, records)
            except OSError as exc:
                rt.stats.kv_disk_errors += 1
                log.warning("could not write KV blocks to %s: %s", self.store.dir, exc)
                return written
            rt.stats.kv_disk_written_blocks += len(records)
        return written

    def _adopted_todo(self, eng, most: int) -> list[tuple]:
        """(hash, previous, tokens, block id) of adopted blocks still cached here and not on disk."""
        out = []
        for h, (prev, tok) in list(self.adopted.items()):
            b = eng.kv.by_hash.get(h)
            if b is None or h in self.store.index:
                self.adopted.pop(h, None)
                continue
            out.append((h, prev, tok, b))
            if len(out) >= most:
                break
        return out
