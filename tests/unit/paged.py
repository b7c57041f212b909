"""Test helper: run sequences through a Shard's forward over a real paged KV (KVManager + KVPool),
as the runner does, without the rest of a stage."""
from __future__ import annotations

from typing import Sequence

import torch

from logicpipe.stage_node.engine.blocks import KVManager
from logicpipe.stage_node.engine.kv import StepKV, seq_slice
from logicpipe.stage_node.model.shard import Shard


class PagedCache:
    """One shard's KV for any number of sequences (opened on first use), and the recurrent states of
    its linear-attention layers (engine.states), as the runner keeps them."""

    def __init__(self, shard: Shard, num_blocks: int = 64, block_size: int = 16):
        self.shard = shard
        self.kv = KVManager(num_blocks, block_size)
        self.pool = shard.new_pool(num_blocks, block_size)

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
        self.pool.copy_blocks([c for p in plans for c in p.copies])
        slots = torch.tensor([s for p in plans for s in p.slots], dtype=torch.long)
        bs = self.kv.block_size
        kv = StepKV(self.pool, slots, tuple(seq_slice(start, len(toks), self.kv.read_span(sid, start + len(toks)), bs,
                                                      decode_from=decode_from.get(sid, 0))
                                            for sid, start, toks in seqs), held)
        out = self.shard.forward(hidden, kv)
        for (sid, start, toks), st in zip(seqs, held or [None] * len(seqs)):
            self.kv.commit(sid, start, list(toks))
            if st is not None:
                states.commit(sid, st, start)
        return out

    def length(self, sid: str = "s") -> int:
        return self.kv.tables[sid].length
