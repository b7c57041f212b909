"""A CPU stage's decoder layers in one native call a step (cpu_quant.c's `lp_layers`).

On a small model most of a CPU decode step was not its matrix products but the twenty-odd torch
operations around them in every layer (norms, RoPE, the KV write, SDPA, the activation: 7 to 10 ms
of a 20 ms step of the default model at one thread on an AVX2 core, measured with torch's
profiler). Where a shard's layers are all quantized by the native kernels and are of plain Llama
style, the whole layer range runs in C instead: the same products (the same tiles, so a row's
result depends only on that row), and per row a float32 RMSNorm, RoPE, the KV write and attention
over its own positions. Every row is computed on its own, so prompt rows and decode rows, a chunk
of any size, a request alone or among 64 and a replay all give a row the same numbers.

What runs here (`eligible`): float32 activations and KV on the CPU, every layer's four matrices
int4 or int8 by the native kernel, RMSNorm of Llama's kind, SiLU or tanh-GELU gating, rotate-half
RoPE over whole heads (layers without RoPE too), one RoPE table for every layer kind, optional
biases, per-head q/k norms and sliding windows (held as only their window too: a pool per layer,
`lp_layers_pools`, the window layers' own where the stage has full layers beside them). Anything
else (experts, latent attention, sinks, soft-capping, Gemma's norms, partial RoPE) keeps the torch
forward. LOGICPIPE_CPU_LAYERS=torch
turns this path off (to compare).
"""
from __future__ import annotations

import ctypes
import os

import torch

from logicpipe.stage_node.engine.kv import StepKV
from logicpipe.stage_node.kernels import cpu_native
from logicpipe.stage_node.kernels.quant import Int4Packed, Int8Packed

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
MAX_HEAD_DIM = 512  # cpu_quant.c's RoPE scratch


def _native(m) -> bool:
    return isinstance(m, (Int4Packed, Int8Packed)) and m.kernel == "native"


def eligible(shard) -> str | None:
    """None when `shard`'s layers can run natively, else why not (one line)."""
    if os.environ.get("LOGICPIPE_CPU_LAYERS", "").lower() == "torch":
        return "LOGICPIPE_CPU_LAYERS=torch"
    a, c = shard.arch, shard.config
    if shard.tp is not None:
        return "tensor-parallel (its all-reduces run in torch)"
    if shard.device.type != "cpu" or shard.dtype != torch.float32:
        return "not a float32 CPU stage"
    if shard.kv_dtype != "auto":
        return f"{shard.kv_dtype} KV (--kv-dtype): the native layers keep float32 KV"
    if not shard.layers or cpu_native.library() is None:
        return "no layers" if not shard.layers else "native kernels unavailable"
    if not all(_native(m) for w in shard.layers for m in (w.qkv, w.o, w.gate_up, w.down)):
        return "layers not all quantized by the native kernels"
    if any(w.experts is not None or w.mla is not None or w.sinks is not None or w.attn_out_norm is not None
           or w.mlp_out_norm is not None for w in shard.layers):
        return "experts, latent attention, sinks or sandwich norms"
    if a.norm != "llama" or a.activation not in ACTIVATIONS or a.attn_softcap is not None or a.rotary != 1.0:
        return "Gemma norms, another activation, soft-capping or partial RoPE"
    if len({id(r) for r in shard.ropes.values()}) != 1:
        return "a RoPE table per layer kind"
    if c.head_dim > MAX_HEAD_DIM or c.head_dim % 2 or c.num_heads % c.num_kv_heads:
        return "head shape"
    return None


def _mat(m) -> cpu_native.Mat:
    return cpu_native.Mat(m._ptrs[0], m._ptrs[1], m.shape[0], 4 if isinstance(m, Int4Packed) else 8)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class NativeLayers:
    """The shard's layers as cpu_quant.c structures (built once; they point into the shard's tensors,
    which it keeps)."""

    def __init__(self, shard):
        c, a = shard.config, shard.arch
        self.shard = shard
        self._keep = []  # tensors made here that the structures point into
        layers = (cpu_native.Layer * len(shard.layers))()
        for i, w in enumerate(shard.layers):
            qk = shard._qk_norms.get(i)
            qk = None if qk is None else qk.float().contiguous()
            biases = [None if b is None else b.float().contiguous() for b in (w.qkv_bias, w.o_bias, w.gate_up_bias,
                                                                           w.down_bias)]
            norms = [w.input_norm.float().contiguous(), w.post_norm.float().contiguous()]
            self._keep += [qk, *biases, *norms]
            layers[i] = cpu_native.Layer(_mat(w.qkv), _mat(w.o), _mat(w.gate_up), _mat(w.down),
                                         *map(_ptr, biases), *map(_ptr, norms), _ptr(qk), int(shard._ropes[i]),
                                         (a.sliding_window or 0) if shard.kind(i) == "sliding" else 0)
        self.layers = layers
        self.inter = shard.layers[0].gate_up.shape[0] // 2
        self.dims = cpu_native.Dims(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, self.inter, 0,
                                    c.rms_norm_eps, shard._scale, ACTIVATIONS[a.activation])
        self.fn = cpu_native.library().lp_layers_pools

    def forward(self, hidden: torch.Tensor, kv: StepKV) -> torch.Tensor:
        """hidden [T, hidden] float32 -> [T, hidden]: every layer, as Shard.forward. Where the shard's
        sliding-window layers hold only their window (Shard.hold_windows) their rows read from the
        window's first position on (`SeqSlice.lo`), from the pool's group when it has one (`kv.window`)."""
        seqs = kv.seqs
        top = max(s.stop for s in seqs)
        rope = self.shard.rope
        rope.lookup(0, top)  # grows the tables to the step's positions; the call reads them whole
        cos, sin = rope.cos, rope.sin_signed
        if len(seqs) == 1:
            s = seqs[0]
            pos = torch.arange(s.start_pos, s.stop)
            row_seq = torch.zeros(s.num_tokens, dtype=torch.long)
        else:
            pos = torch.cat([torch.arange(s.start_pos, s.stop) for s in seqs])
            row_seq = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor([s.num_tokens for s in seqs]))
        x = hidden.clone(memory_format=torch.contiguous_format)  # float32 (Shard.forward); written in place
        reads = [kv] if kv.window is None else [kv, kv.window]
        keep = [(_slot_table(r.seqs, top), r.write_slots.contiguous()) for r in reads]
        pools = (cpu_native.Pool * len(reads))(*[
            cpu_native.Pool(r.pool.kv.data_ptr(), r.pool.kv.shape[3], t.data_ptr(), t.shape[-1], ws.data_ptr())
            for r, (t, ws) in zip(reads, keep)])
        rc = self.fn(ctypes.byref(self.dims), self.layers, len(self.shard.layers), x.data_ptr(), x.shape[0],
                     pos.data_ptr(), row_seq.data_ptr(), pools, len(reads), self._where().data_ptr(),
                     cos.data_ptr(), sin.data_ptr(), torch.get_num_threads())
        if rc:
            raise MemoryError(f"native CPU layers failed ({rc}): no memory for a step of {x.shape[0]} rows")
        return x

    def _where(self) -> torch.Tensor:
        """Per layer (its pool: 0 the StepKV's, 1 its window's; its layer in that pool) [layers * 2] int64:
        the window layers' own pool once the shard holds windows with full layers beside them."""
        sh = self.shard
        if self._where_for != sh.window_layers:
            group = set(sh.window_layers)
            self._where_of = torch.tensor([[int(i in group), sh._kv[i]] for i in range(len(sh.layers))],
                                          dtype=torch.long).flatten()
            self._where_for = sh.window_layers
        return self._where_of

    _where_for: tuple | None = None


def _slot_table(seqs, top: int) -> torch.Tensor:
    """Each sequence's slot of each position it reads [seqs, top] int64 (one sequence: [stop]); the
    positions before a sequence's first read `lo` (a window's given-back ones) are never read: zeros."""
    if len(seqs) == 1 and seqs[0].lo == 0:
        s = seqs[0]
        return torch.arange(s.span, s.span + s.stop) if s.span is not None else s.slots[: s.stop].contiguous()
    table = torch.zeros(len(seqs), top, dtype=torch.long)
    for i, s in enumerate(seqs):
        table[i, s.lo: s.stop] = torch.arange(s.span, s.span + s.stop - s.lo) if s.span is not None else s.slots
    return table
