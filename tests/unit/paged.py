"""Test helper: run sequences through a Shard's forward over a real paged KV (the stage's KV
managers + KVPool), as the runner does, without the rest of a stage."""
from __future__ import annotations

from typing import Sequence

import torch

from logicpipe.stage_node.engine.kv import step_kv
from logicpipe.stage_node.engine.step_graphs import GraphRow, StepGraphs
from logicpipe.stage_node.engine.window import ROLLBACK, managers
from logicpipe.stage_node.model.shard import Shard


class PagedCache:
    """One shard's KV for any number of sequences (opened on first use), and the recurrent states of
    its linear-attention layers (engine.states), as the runner keeps them. `window`: its
    sliding-window layers keep only their window (Shard.hold_windows, engine.window), rolling back at
    most `rollback` positions; `group_blocks`: the window layers' pool where the shard has full layers too;
    `graphs`: steps that fit a bucket run the CUDA-graph step body (engine.step_graphs; eagerly on a CPU), as
    the runner does on a GPU."""

    def __init__(self, shard: Shard, num_blocks: int = 64, block_size: int = 16, *, window: bool = False,
                 rollback: int = ROLLBACK, group_blocks: int = 64, graphs: bool = False):
        self.shard = shard
        if window:  # (a shard without sliding layers keeps every position)
            shard.hold_windows()
        group = group_blocks if shard.window_layers else 0
        self.kv = managers(num_blocks, block_size, shard.window, group, rollback)
        self.pool = shard.new_pool(num_blocks, block_size, group)
        if graphs:  # (a graph reads masked positions: none may hold a NaN)
            for p in (self.pool, self.pool.group):
                if p is not None:
                    p.kv.zero_()
        self.graphs = StepGraphs(shard, self.pool, capture=False) if graphs else None

    def forward(self, hidden: torch.Tensor, seqs: Sequence[tuple[str, int, Sequence[int]]],
                decode_from: dict[str, int] | None = None, candidates: dict[str, int] | None = None) -> torch.Tensor:
        """seqs: (sequence id, start position, token ids of its rows), packed in this order;
        decode_from: where each sequence's decode rows begin (default 0: every row is one);
        candidates: how many of each sequence's last rows are candidates (the states it keeps)."""
        decode_from, candidates = decode_from or {}, candidates or {}
        plans = []
        states = self.pool.states
        for sid, start, toks in seqs:
            if sid not in self.kv.tables:
                self.kv.open(sid, start + len(toks))
                if states is not None:
                    states.open(sid)
            plans.append(self.kv.prepare_write(sid, start, len(toks)))
        held = None if states is None else tuple(states.step(sid, start, start + len(toks), candidates.get(sid, 0))
                                                 for sid, start, toks in seqs)
        self.pool.copy_plans(plans)
        out = None
        if self.graphs is not None and states is None:
            group = self.pool.group is not None
            out = self.graphs.forward(hidden, [
                GraphRow(start + j, p.slots[j], self.kv.read_span(sid, start + len(toks)),
                         p.window.slots[j] if group else -1, self.kv.read_window(sid, start + len(toks)))
                for (sid, start, toks), p in zip(seqs, plans) for j in range(len(toks))])
        if out is None:
            out = self._forward(hidden, seqs, plans, decode_from, held)
        for (sid, start, toks), st in zip(seqs, held or [None] * len(seqs)):
            self.kv.commit(sid, start, list(toks))
            if st is not None:
                states.commit(sid, st, start)
        return out

    def _forward(self, hidden, seqs, plans, decode_from, held) -> torch.Tensor:
        device = self.shard.device
        slots = torch.tensor([s for p in plans for s in p.slots], dtype=torch.long, device=device)
        kv = step_kv(self.pool, self.shard.window,
                     [(start, len(toks), self.kv.read_span(sid, start + len(toks)),
                       self.kv.read_window(sid, start + len(toks)), decode_from.get(sid, 0)) for sid, start, toks in seqs],
                     slots, device, states=held,
                     window_slots=[s for p in plans for s in p.window.slots] if self.pool.group is not None else None)
        return self.shard.forward(hidden, kv)

    def length(self, sid: str = "s") -> int:
        return self.kv.tables[sid].length
