"""The KV pool of one stage (the tensors behind `stage_node.blocks.KVManager`'s bookkeeping) and
what one forward needs to read and write it.

Layout: keys and values are each [layers_local, kv_heads, num_blocks * block_size + 1, head_dim]
(views of one tensor with keys and values side by side per layer, so a CUDA graph writes and
gathers both with one kernel each): a
position of a sequence lives in one slot of the third axis, so a sequence whose blocks are
consecutive is read as one strided view (as a contiguous cache would be), and any other is
gathered by slot index. The pool is allocated once, for the stage's whole KV budget (on a GPU too:
CUDA graphs hold its address); its last slot is a scratch slot that no block owns.

Logged rows (issue 34): `logs` maps a layer boundary (absolute) to a [slots, hidden] tensor of the
hidden rows entering that layer, per slot: the stage's output rows (its end) and rows inside its
range (written by the torch forward). A replay after a re-plan that moved this stage's range resumes
its rows from them instead of computing the layers it kept (stage_node.engine.blocks).

8-bit KV (`kv_dtype` int8 / fp8, engine.kv_quant): the values in one byte and `scales`
[layers, parts, kv_heads, slots] float32 beside them, one per (token, head) vector; `store` rotates
(`rotated`: int8 keys and values in two parts) and quantizes what a step writes, and attention dequantizes
what it reads with its queries rotated and its output un-rotated (stage_node.model.shard, kv_quant.rotate).

Multi-head latent attention (DeepSeek) keeps one tensor, not two: `parts` 1, one "head" whose row is a
token's latent and rotary key ([layers, 1, 1, slots, kv_lora_rank + rope_dim]); `k` is that row and
`v` the latent part of it (a view: the values are read from the same bytes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from logicpipe.stage_node.engine.kv_quant import (
    SCALE_DTYPE,
    index_copy_,
    index_select,
    quantize,
    quantized,
    rotate,
    signs_on,
    storage_dtype,
    vector_bytes,
)
from logicpipe.stage_node.kernels import cpu_native


class KVPool:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", parts: int = 2,
                 value_dim: int | None = None, kv_dtype: str = "auto"):
        # one slot past the blocks: the scratch slot, where a CUDA graph's padding rows write
        shape = (num_layers, parts, num_kv_heads, num_blocks * block_size + 1, head_dim)
        # torch.empty on a CPU: its pages are only touched (and counted) as blocks are first written.
        # Zeros on a GPU: a CUDA graph's step reads whole blocks and masks the positions past a
        # row's own, and a NaN left there by a former allocation would survive the mask.
        alloc = torch.zeros if torch.device(device).type == "cuda" else torch.empty
        self.dtype = dtype  # the compute dtype (what attention reads; the logged rows')
        self.kv_dtype = kv_dtype  # "auto" (values in `dtype`) or "int8" / "fp8" (engine.kv_quant)
        # kv: [layers, 2 (k, v), kv_heads, slots, head_dim]
        self.kv = alloc(shape, dtype=storage_dtype(kv_dtype, dtype), device=device)
        self.k = self.kv[:, 0]  # k: [layers, kv_heads, slots, head_dim] (a view)
        # v: [layers, kv_heads, slots, head_dim]; with one part, the first value_dim elements of k's rows
        self.v = self.kv[:, 1] if parts == 2 else self.k[..., : value_dim or head_dim]
        # 8-bit KV: scales [layers, parts, kv_heads, slots] (int8: int32, the vector's scale and mid as two
        # bfloat16, kv_quant.pack; fp8: float32), a (token, head) vector's each (zeros:
        # a never-written slot reads as zeros, as a CUDA graph's masked positions need); None: float KV
        self.scales = torch.zeros(shape[:-1], dtype=SCALE_DTYPE[kv_dtype], device=device) if quantized(kv_dtype) else None
        self.ks = None if self.scales is None else self.scales[:, 0]  # [layers, kv_heads, slots]
        self.vs = None if self.scales is None else self.scales[:, -1]  # (one part: the latent row's own)
        self.parts = parts
        # int8 keys and values stored rotated (kv_quant.rotate; not fp8, whose error is relative to each
        # element, nor MLA's one-part latent rows)
        self.rotated = kv_dtype == "int8" and parts == 2
        self.num_blocks = num_blocks
        self.block_size = block_size  # positions per block (tokens)
        self.scratch_slot = num_blocks * block_size  # belongs to no block: written, never read
        self.logs: dict[int, torch.Tensor] = {}  # layer boundary -> [slots, hidden]: the rows entering it
        self.span = (0, num_layers)             # the absolute layers it holds (set by the loader)
        self.states = None  # a stage with linear-attention layers: their per-sequence states (engine.states)
        self.group: KVPool | None = None  # a stage with full and sliding-window layers: the window layers' pool
                                          # (its own blocks: engine.window.KVGroups)

    def add_logs(self, boundaries, hidden_size: int) -> None:
        """Room for the rows entering each of `boundaries` (absolute), one per slot."""
        alloc = torch.zeros if self.kv.device.type == "cuda" else torch.empty
        for b in boundaries:
            self.logs[b] = alloc((self.num_blocks * self.block_size + 1, hidden_size), dtype=self.dtype,
                                 device=self.kv.device)

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def quantized(self) -> bool:
        return self.scales is not None

    @property
    def block_bytes(self) -> int:
        """Bytes of keys and values one block holds (all local layers; 8-bit KV's scales included)."""
        vectors = self.parts * self.num_layers * self.k.shape[1] * self.block_size
        return vectors * vector_bytes(self.kv_dtype, self.dtype, self.kv.shape[-1])

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """Write a step's new keys and values of local `layer` (k, v: [T, kv_heads, head_dim]; v None:
        MLA, whose values are part of k's rows) at `slots` [T], quantized with 8-bit KV."""
        for part, x in ((0, k), (1, v)):
            if x is None:
                continue
            dst = self.kv[layer, part]  # [kv_heads, slots, head_dim]
            if self.scales is None:
                dst.index_copy_(1, slots, x.transpose(0, 1))
            elif self.kv_dtype == "int8" and x.device.type == "cpu" and x.shape[0] and cpu_native.kv_store_int8(
                    x, slots, signs_on(x) if self.rotated else None, dst, self.scales[layer, part]):
                continue  # the same bits, quantized straight into the pool (cpu_quant.c)
            else:
                q, s = quantize(rotate(x) if self.rotated else x, self.kv_dtype)  # [T, kv_heads, hd], [T, kv_heads]
                index_copy_(dst, 1, slots, q.transpose(0, 1))
                self.scales[layer, part].index_copy_(1, slots, s.transpose(0, 1))

    def copy_plans(self, plans) -> None:
        """Copy on write for a step's blocks.WritePlans: this pool's copies, and its group's."""
        self.copy_blocks([c for p in plans for c in p.copies])
        if self.group is not None:
            self.group.copy_blocks([c for p in plans if p.window is not None for c in p.window.copies])

    mirror = None  # a tensor-parallel stage's rank 0: engine.tp_group.Leader, the other ranks copy too
    swap = None    # its swap space (engine.swap.SwapSpace; None: none), kept with the pool across assignments

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy on write: block src's positions into block dst, every layer, keys and values."""
        if copies and self.mirror is not None:
            self.mirror.copy(copies)
        bs = self.block_size
        for src, dst in copies:
            self.kv[..., dst * bs:(dst + 1) * bs, :] = self.kv[..., src * bs:(src + 1) * bs, :]
            if self.scales is not None:
                self.scales[..., dst * bs:(dst + 1) * bs] = self.scales[..., src * bs:(src + 1) * bs]
            for rows in self.logs.values():
                rows[dst * bs:(dst + 1) * bs] = rows[src * bs:(src + 1) * bs]

    def take_over(self, old: "KVPool", blocks: Sequence[int]) -> None:
        """Copy `blocks` (ids below both pools' sizes, of the same block size) from the pool a
        re-plan replaces: the layers both hold, and the rows of the boundaries both log."""
        lo, hi = max(self.span[0], old.span[0]), min(self.span[1], old.span[1])
        if old.kv_dtype != self.kv_dtype:  # (a stage's --kv-dtype is fixed: never, but never mix them)
            lo = hi
        if not blocks or (lo >= hi and not (self.logs.keys() & old.logs.keys())):
            return
        bs = self.block_size
        idx = (torch.tensor(list(blocks), dtype=torch.long)[:, None] * bs + torch.arange(bs)).flatten()
        idx = idx.to(self.kv.device)
        if lo < hi:
            src = index_select(old.kv[lo - old.span[0]: hi - old.span[0]], 3, idx.to(old.kv.device))
            index_copy_(self.kv[lo - self.span[0]: hi - self.span[0]], 3, idx, src.to(self.kv.device))
            if self.scales is not None:
                src = old.scales[lo - old.span[0]: hi - old.span[0]].index_select(3, idx.to(old.kv.device))
                self.scales[lo - self.span[0]: hi - self.span[0]].index_copy_(3, idx, src.to(self.kv.device))
        for b in self.logs.keys() & old.logs.keys():
            self.logs[b].index_copy_(0, idx, old.logs[b].index_select(0, idx.to(old.kv.device)).to(self.kv.device))


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's rows in a packed forward and where its keys live."""

    start_pos: int                 # position of the sequence's first new row
    num_tokens: int                # its rows in the packed hidden states
    span: int | None               # first slot of positions [lo, start_pos + num_tokens) when consecutive
    slots: torch.Tensor | None     # else the slot of each of those positions: [start_pos + num_tokens - lo] int64
    decode_from: int = 0           # rows at positions >= this are decode rows (see stage_node.ops)
    lo: int = 0                    # first position read (sliding-window layers: start_pos - window + 1)

    @property
    def stop(self) -> int:
        return self.start_pos + self.num_tokens


@dataclass(frozen=True)
class StepKV:
    """The KV side of one forward: the pool, the slot each new row writes, each sequence's reads (and,
    for linear-attention layers, each sequence's recurrent state: model.deltanet.SeqState)."""

    pool: KVPool
    write_slots: torch.Tensor  # [rows] int64, packed in the order of `seqs`
    seqs: tuple[SeqSlice, ...]
    states: tuple | None = None  # per sequence a deltanet.SeqState (None: every state starts at zeros, none kept)
    window: "StepKV | None" = None  # the sliding-window layers' own pool and reads (KVPool.group); None: these


def seq_slice(start_pos: int, num_tokens: int, blocks: Sequence[int], block_size: int,
              device: torch.device | str = "cpu", decode_from: int = 0, lo: int = 0) -> SeqSlice:
    """A SeqSlice reading positions [lo, start_pos + num_tokens) from `blocks` (the sequence's
    block table, at least that long; those positions' blocks held); its rows at positions >=
    decode_from are decode rows."""
    stop = start_pos + num_tokens
    nb = -(-stop // block_size)
    first = lo // block_size
    blocks = list(blocks[first:nb])
    if len(blocks) < nb - first or min(blocks, default=0) < 0:
        raise ValueError(f"blocks {blocks} cannot hold positions [{lo}, {stop}) of {block_size}")
    skip = lo - first * block_size
    if blocks[-1] - blocks[0] == len(blocks) - 1 and all(b - a == 1 for a, b in zip(blocks, blocks[1:])):
        return SeqSlice(start_pos, num_tokens, blocks[0] * block_size + skip, None, decode_from, lo)
    idx = torch.tensor(blocks, dtype=torch.long)[:, None] * block_size + torch.arange(block_size)
    return SeqSlice(start_pos, num_tokens, None, idx.flatten()[skip: stop - first * block_size].to(device),
                    decode_from, lo)


def window_reads(pool: KVPool, window: int, seqs, device: torch.device | str = "cpu") -> tuple[SeqSlice, ...]:
    """What a stage's sliding-window layers read: per sequence (start_pos, num_tokens, its window
    blocks, decode_from), positions [start_pos - window + 1, stop) (from 0 at most) of `pool`."""
    return tuple(seq_slice(start, n, blocks, pool.block_size, device, decode_from, max(0, start - window + 1))
                 for start, n, blocks, decode_from in seqs)


def kv_bytes_per_token(config, num_layers_local: int, dtype: torch.dtype, kv_dtype: str = "auto") -> int:
    """Bytes of K and V (MLA: the latent row) one token costs on a stage with `num_layers_local` layers
    that keep KV (a linear-attention layer keeps none), computing in `dtype` with `kv_dtype` KV
    (8-bit: a byte an element and a float32 scale a head's vector)."""
    vectors = config.kv_parts * num_layers_local * config.num_kv_heads
    return vectors * vector_bytes(kv_dtype, dtype, config.head_dim)


def step_kv(pool: KVPool, window: int | None, seqs, write_slots: torch.Tensor, device: torch.device | str = "cpu",
            states: tuple | None = None, window_slots=None) -> StepKV:
    """The KV side of a forward over `pool`: per sequence (start_pos, num_tokens, its blocks, its
    window layers' blocks (engine.window; None: its blocks), decode_from), packed in order, and
    the slots its rows write. `window`: the shard's sliding-window layers hold only their window
    (Shard.window): they read the last `window` positions of each row, from the pool's group (with
    `window_slots`, [rows]) where the stage has full layers too, else from `pool` itself."""
    bs = pool.block_size
    wseqs = [(start, n, blocks if wblocks is None else wblocks, df) for start, n, blocks, wblocks, df in seqs]
    if window is not None and pool.group is None:  # every KV layer slides
        return StepKV(pool, write_slots, window_reads(pool, window, wseqs, device), states)
    main = tuple(seq_slice(start, n, blocks, bs, device, df) for start, n, blocks, _, df in seqs)
    group = None
    if window is not None:
        slots = torch.tensor(window_slots, dtype=torch.long, device=device)
        group = StepKV(pool.group, slots, window_reads(pool.group, window, wseqs, device))
    return StepKV(pool, write_slots, main, states, group)
