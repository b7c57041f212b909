"""Swapping (issue 39 item 3): a sequence given up for KV blocks keeps its KV in host memory (or in
a file) and its replay copies it back instead of computing it again.

When: a stage preempts a sequence (engine.scheduler: its pool ran short), or the sequence's owner
closes it with `swap` (CloseSession: the controller replays a request that some stage preempted,
so every stage of its pipeline keeps its part). Its positions [0, length) — in every pool of the
stage (the full layers' and the sliding-window layers' own: engine.window), with 8-bit KV's
scales, the hidden rows the pool logs (issue 34) and a linear-attention stage's recurrent-state
snapshots (engine.states) — become one entry of the swap space, known by its tokens. OpenSession
of a sequence whose prompt starts with an entry's tokens (the replay: the prompt and the tokens
generated so far) takes new blocks, copies the entry back past what the prefix cache attached, and
reports those positions as held: the controller feeds the replay from there on.

Bounded: `capacity` bytes (--swap-mib). A sequence that does not fit the room left falls back to
what happens without swap space: its KV goes, and its replay computes it again (logged and counted:
`swap_full`). An entry that no replay took back within KEEP_S (its request ended, or replayed on
another pipeline) makes room for new ones; a replay takes its entry out.

Where the copies run: the bookkeeping (which blocks, which entry) happens on the event loop with
the scheduler's; the copies are queued and run on the runner thread at the start of the next step
(`flush`, from runner.execute / launch), in order, before any write to a block a swap-out gave up
and before any read of a block a swap-in fills. (A step in flight when a session is closed writes
only past its length, which a swap-out does not copy.) On CUDA the host side is pinned memory and
the copies are asynchronous on the stage's stream, ordered with its steps; with a directory
(`--swap-dir`, meant for a CPU stage, whose pool already is host memory) an entry is a safetensors
file there.
"""
from __future__ import annotations

import itertools
import logging
import os
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from functools import partial

import torch
from safetensors.torch import load_file, save_file

from logicpipe.stage_node.engine.blocks import HOLE, KVManager
from logicpipe.stage_node.engine.kv import KVPool
from logicpipe.stage_node.engine.kv_quant import as_bytes, index_copy_, index_select
from logicpipe.stage_node.engine.stats import StageStats
from logicpipe.stage_node.engine.window import KVGroups

log = logging.getLogger(__name__)

KEEP_S = 600.0  # an entry no replay took back in this long gives way to a new one (the controller's queue timeout)
MIB = 2**20


@dataclass(eq=False)
class Entry:
    """One swapped-out sequence."""

    tokens: tuple[int, ...]                # its positions [0, len(tokens))
    blocks: tuple[tuple[int, ...], ...]    # per pool: the block of each table index at swap-out (HOLE: given back)
    meta: tuple[tuple, ...]                # per pool, per held block: (layers, logs) it held (blocks.Block)
    states: dict | None                    # position -> {local layer: (window, S)}; None: no linear layers
    nbytes: int
    since: float                           # time.monotonic() of its swap-out
    data: list | None = None               # per pool: name -> host tensor, its held blocks in order (the copy's)
    path: str = ""                         # with a directory: the file holding them
    gone: bool = False                     # dropped before its copy ran (the copy is skipped)
    broken: bool = False                   # its copy failed: a swap-in from it fails its sequence

    @property
    def holes(self) -> bool:
        return any(b == HOLE for ids in self.blocks for b in ids)


def host_block_bytes(pool: KVPool) -> int:
    """Bytes one block of `pool` takes in the swap space: keys and values (8-bit KV's scales
    included) and the rows it logs."""
    rows = sum(r.shape[1] * r.element_size() for r in pool.logs.values())
    return pool.block_bytes + rows * pool.block_size


def _slots(blocks, block_size: int, device) -> torch.Tensor:
    """The slots of `blocks`, in order: [len(blocks) * block_size] int64."""
    idx = torch.tensor(list(blocks), dtype=torch.long)[:, None] * block_size + torch.arange(block_size)
    return idx.flatten().to(device)


def _to_host(t: torch.Tensor, blocking: bool) -> torch.Tensor:
    """A host copy of device tensor `t` (pinned; asynchronous unless `blocking`); on a CPU, `t`
    itself (a fresh gather, or a state snapshot, which is never written in place)."""
    if t.device.type == "cpu":
        return t
    h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    as_bytes(h).copy_(as_bytes(t), non_blocking=not blocking)
    return h


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return t
    return as_bytes(t).to(device, non_blocking=True).view(t.dtype)


def _holds(m: KVManager, b: int) -> tuple:
    """What block b of `m` holds for its positions: its registered layers and logged rows, else
    (written by this stage's steps) the stage's."""
    blk = m.blocks[b]
    if blk.hash is not None:
        return blk.layers, blk.logs
    return m.span or (0, 0), m.logged


class SwapSpace:
    def __init__(self, pool: KVPool, capacity: int, directory: str = "", stats: StageStats | None = None):
        self.pool = pool
        self.pools = [pool] + ([pool.group] if pool.group is not None else [])
        self.capacity = max(0, capacity)  # bytes
        self.directory = directory        # "": host memory; else a file per entry there
        self.stats = stats if stats is not None else StageStats()
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # swapped out, oldest first
        self.used = 0                     # bytes the entries take
        self._ops: deque = deque()        # copies for the runner thread (flush), in order
        self._ids = itertools.count()
        self.lost: set[str] = set()       # sessions whose swap-in failed, until they close (their steps fail)
        self._device = pool.kv.device
        if directory:
            os.makedirs(directory, exist_ok=True)

    def where(self) -> str:
        return f"files in {self.directory}" if self.directory else "host memory"

    @staticmethod
    def managers(kv) -> list[KVManager]:
        """The managers of the stage's pools, in the order of `pools`."""
        return [kv.main, kv.group] if isinstance(kv, KVGroups) else [kv]

    # ---- bookkeeping (the event loop) --------------------------------------------------------
    def swap_out(self, sid: str, kv, states=None) -> bool:
        """Keep `sid`'s positions [0, length) (and its state snapshots up to there) before its blocks
        go; False where there is nothing to keep or no room (its replay computes it again)."""
        mgrs = self.managers(kv)
        t0 = mgrs[0].tables[sid]
        length = t0.length
        if not self.capacity or not length:
            return False
        snaps = None
        if states is not None:
            snaps = {p: s for p, s in states.seqs.get(sid, {}).items() if 0 < p <= length}
            if not snaps:  # its KV is of no use without a state to go on from
                return False
        blocks, meta, nbytes = [], [], 0
        for m, pool in zip(mgrs, self.pools):
            ids = tuple(m.tables[sid].blocks[: m.blocks_for(length)])
            held = [b for b in ids if b != HOLE]
            blocks.append(ids)
            meta.append(tuple(_holds(m, b) for b in held))
            nbytes += len(held) * host_block_bytes(pool)
        nbytes += sum(t.nbytes for snap in (snaps or {}).values() for pair in snap.values() for t in pair)
        self._expire()
        if self.used + nbytes > self.capacity:
            self.stats.swap_full += 1
            log.info("session %s: the swap space has no room for its %d positions (%d bytes; %d of %d held): its "
                     "replay computes them again", sid, length, nbytes, self.used, self.capacity)
            return False
        e = Entry(tuple(t0.tokens[:length]), tuple(blocks), tuple(meta), snaps, nbytes, time.monotonic())
        self.entries[next(self._ids)] = e
        self.used += nbytes
        self._ops.append(partial(self._copy_out, e))
        n = sum(len(x) for x in meta)
        st = self.stats
        st.swapped_out_seqs, st.swapped_out_blocks, st.swapped_out_bytes = \
            st.swapped_out_seqs + 1, st.swapped_out_blocks + n, st.swapped_out_bytes + nbytes
        log.info("session %s: swapped out %d positions (%d blocks, %.1f MiB) to %s", sid, length, n, nbytes / MIB,
                 self.where())
        return True

    def swap_in(self, sid: str, prompt, kv, states=None) -> int:
        """After the prefix cache attached what it holds of `prompt` to the new sequence `sid`: copy
        back the entry that gives it the most positions beyond those, if any. Returns the positions
        it holds now. Takes no more blocks than the prompt's (admission counted those)."""
        mgrs = self.managers(kv)
        have = mgrs[0].tables[sid].length
        best, best_n = None, have
        for key, e in self.entries.items():
            n = self._usable(e, prompt)
            if n > best_n:
                best, best_n = key, n
        if best is None:
            return have
        e, n, bs = self.entries[best], best_n, mgrs[0].block_size
        keeps = [0 if (e.states is not None or any(b == HOLE for b in ids)) else have // bs for ids in e.blocks]
        nb = -(-n // bs)
        for m, ids, keep in zip(mgrs, e.blocks, keeps):
            if sum(1 for b in ids[keep:nb] if b != HOLE) > m.available:  # (never, admission counted them)
                return have
        del self.entries[best]
        self.used -= e.nbytes
        moves, blocks, nbytes = [], 0, 0
        for m, pool, ids, meta, keep in zip(mgrs, self.pools, e.blocks, e.meta, keeps):
            t = m.tables[sid]
            t.resume, t.resume_tokens = 0, ()  # (blocks attached past `have` to be rewritten: given back)
            m.truncate(sid, keep * bs)
            j = sum(1 for b in ids[:keep] if b != HOLE)  # the entry's held blocks before index `keep`
            pairs = []
            for i in range(keep, nb):
                if ids[i] == HOLE:
                    t.blocks.append(HOLE)
                    continue
                b = m._alloc(t)
                t.blocks.append(b)
                pairs.append((j, b))
                j += 1
            m.commit(sid, 0, list(prompt[:n]))  # its length and tokens; whole blocks join the prefix cache
            if m.span is not None:
                for j, b in pairs:
                    if m.blocks[b].hash is not None:
                        m.blocks[b].layers, m.blocks[b].logs = meta[j]
            moves.append(pairs)
            blocks += len(pairs)
            nbytes += len(pairs) * host_block_bytes(pool)
        if states is not None:
            states.seqs[sid] = {p: s for p, s in e.states.items() if p <= n}
            nbytes += sum(t.nbytes for p, snap in e.states.items() if p <= n for pair in snap.values() for t in pair)
        self._ops.append(partial(self._copy_in, e, moves, sid, states))
        st = self.stats
        st.swapped_in_seqs, st.swapped_in_blocks, st.swapped_in_bytes = \
            st.swapped_in_seqs + 1, st.swapped_in_blocks + blocks, st.swapped_in_bytes + nbytes
        st.swapped_in_tokens += n - have
        log.info("session %s: swapped in %d positions (%d blocks, %.1f MiB) from %s; the prefix cache held %d",
                 sid, n, blocks, nbytes / MIB, self.where(), have)
        return n

    def _usable(self, e: Entry, prompt) -> int:
        """The positions of `e` a sequence of `prompt` may take: the leading ones they share (all
        of them where a window gave blocks back; up to a state snapshot with linear layers)."""
        n = min(len(e.tokens), len(prompt))
        if not n or tuple(prompt[:n]) != e.tokens[:n]:
            return 0
        if n < len(e.tokens) and e.holes:
            return 0
        if e.states is not None:
            n = max((p for p in e.states if p <= n), default=0)
        return n

    def _expire(self) -> None:
        now = time.monotonic()
        while self.entries:
            key, e = next(iter(self.entries.items()))
            if now - e.since < KEEP_S:
                return
            del self.entries[key]
            self.used -= e.nbytes
            e.gone = True
            self._ops.append(partial(self._forget, e))
            log.info("a swapped-out sequence of %d positions was not taken back in %.0f s: dropped",
                     len(e.tokens), KEEP_S)

    # ---- the copies (the runner thread) ------------------------------------------------------
    def flush(self) -> set[str]:
        """Run the queued copies, in order. Returns the open sessions whose swap-in failed (their KV
        is not there: the caller fails their rows, and their owners replay them from their prompts)."""
        while self._ops:
            op = self._ops.popleft()
            try:
                sid = op()
            except Exception:  # noqa: BLE001 — a lost entry costs its replay the recompute, not the node
                log.exception("a swap copy failed")
                sid = op.args[2] if op.func == self._copy_in else None
                if op.func == self._copy_out:
                    op.args[0].broken = True
            if sid:
                self.lost.add(sid)
        return self.lost

    def _copy_out(self, e: Entry) -> None:
        if e.gone:
            return
        blocking = bool(self.directory)  # (a file is written from the host copy at once)
        data = []
        with torch.inference_mode():
            for pool, ids in zip(self.pools, e.blocks):
                held = [b for b in ids if b != HOLE]
                d = {}
                if held:
                    idx = _slots(held, pool.block_size, pool.kv.device)
                    d["kv"] = index_select(pool.kv, 3, idx)  # [layers, parts, kv_heads, len(held) * bs, head_dim]
                    if pool.scales is not None:
                        d["scales"] = pool.scales.index_select(3, idx)
                    for boundary, rows in pool.logs.items():
                        d[f"log{boundary}"] = rows.index_select(0, idx)
                data.append({k: _to_host(v, blocking) for k, v in d.items()})
            if e.states is not None:
                e.states = {p: {layer: tuple(_to_host(x, blocking) for x in pair) for layer, pair in snap.items()}
                            for p, snap in e.states.items()}
        if blocking and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        if not self.directory:
            e.data = data
            return
        flat = {f"{i}.{k}": v.contiguous() for i, d in enumerate(data) for k, v in d.items()}
        for p, snap in (e.states or {}).items():
            for layer, pair in snap.items():
                for x, v in enumerate(pair):
                    flat[f"s.{p}.{layer}.{x}"] = v.contiguous()
        path = os.path.join(self.directory, f"swap-{os.getpid()}-{id(e):x}.safetensors")
        save_file(flat, path)
        e.path = path
        if e.states is not None:
            e.states = {p: None for p in e.states}  # (read back from the file)

    def _load(self, e: Entry) -> tuple[list, dict | None]:
        """The entry's host tensors (read from its file, which goes)."""
        if not e.path:
            return e.data, e.states
        flat = load_file(e.path)
        os.remove(e.path)
        e.path = ""
        data = [{} for _ in self.pools]
        states: dict = {}
        for key, v in flat.items():
            head, _, rest = key.partition(".")
            if head == "s":
                p, layer, x = (int(s) for s in rest.split("."))
                pair = states.setdefault(p, {}).setdefault(layer, [None, None])
                pair[x] = v
            else:
                data[int(head)][rest] = v
        states = {p: {layer: tuple(pair) for layer, pair in snap.items()} for p, snap in states.items()}
        return data, (states if e.states is not None else None)

    def _copy_in(self, e: Entry, moves: list, sid: str, states) -> str | None:
        """Copy `e` into the blocks `moves` names (per pool: (its held block's index in the entry,
        the pool's block)); its snapshots into `sid`'s state. Returns `sid` if the entry is lost."""
        if e.broken:
            return sid
        data, snaps = self._load(e)
        e.data = None
        with torch.inference_mode():
            for pool, d, pairs in zip(self.pools, data, moves):
                if not pairs:
                    continue
                bs, dev = pool.block_size, pool.kv.device
                src = [j for j, _ in pairs]
                whole = src == list(range(d["kv"].shape[3] // bs))
                src_idx = _slots(src, bs, dev)
                dst_idx = _slots([b for _, b in pairs], bs, dev)
                for name, host in d.items():
                    target, dim = ((pool.kv, 3) if name == "kv" else (pool.scales, 3) if name == "scales"
                                   else (pool.logs[int(name[3:])], 0))
                    # (the blocks it takes are picked on the device: the host side is never read by the
                    # CPU, so a CUDA copy out may still be on its way, ordered before this one)
                    part = _to_device(host, dev)
                    index_copy_(target, dim, dst_idx, part if whole else index_select(part, dim, src_idx))
            held = states.seqs.get(sid) if states is not None else None
            if held is not None and snaps:
                for p in list(held):
                    if snaps.get(p) is not None:
                        held[p] = {layer: tuple(_to_device(x, self._device) for x in pair)
                                   for layer, pair in snaps[p].items()}
        return None

    def _forget(self, e: Entry) -> None:
        e.data, e.states = None, None
        if e.path:
            os.remove(e.path)
            e.path = ""
