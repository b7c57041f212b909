"""Fused CUDA kernels of a decoder layer's small steps (a CUDA stage with batch-invariant products).

A decode step of an 8B-shaped model spent 1.7 ms of its 7.3 ms GPU time in some 500 small kernels
(norms in four kernels each, RoPE in five, the KV write in two, SwiGLU in two, the residual adds, the
sum of a product's parts). These kernels do each group in one launch:

  * `add_norm`: a product's partial sums over K added in order (the second kernel of
    `invariant.mm`), rounded to the model dtype, added to the residual stream, and the next norm of
    the sum (RMSNorm, Llama style): x' = x + y, h = norm(x'). One program per row, the row's
    reduction in one fixed block: a row's bits never depend on the other rows of its step.
  * `rope_kv`: RoPE of q and k from the qkv product at each row's position (the tables indexed in
    the kernel), q written out, k and v written into the layer's KV pool at each row's slot.
    The arithmetic is HF's rounding step by step (x*cos and roll(x)*sin rounded to the dtype, then
    their sum), so the bits equal `rope.apply_rope`'s.
  * `silu_mul`: SwiGLU's silu(gate) * up from the gate_up product (its parts over K added in order
    first, as `rope_kv` does q/k/v's), one launch.

A layer is then ten launches (qkv, rope_kv, two attention kernels, o, add_norm, gate_up, silu_mul,
down, add_norm: the next layer's input norm fused into this layer's last add). Used by
`stage_node.shard` for plain Llama-style layers (no biases, per-head norms, extra norms, experts or
Gemma norms; SwiGLU) with `batch_invariant` on, in its eager forward and in the CUDA graphs' body
alike, so a row computed eagerly and the same row in a graph still get the same bits.
"""
from __future__ import annotations

import functools

import torch

from logicpipe.stage_node.kernels import gpu_quant_kernels, invariant


@functools.cache
def _kernels():
    global round_store  # (gpu_quant_kernels' helper the kernels call: Triton resolves it among the globals)
    import triton
    import triton.language as tl

    gpu_quant_kernels.kernels()
    round_store = gpu_quant_kernels.round_store

    @triton.jit(do_not_specialize=["s_part"])
    def add_norm_kernel(ws_ptr, x_ptr, w_ptr, xo_ptr, h_ptr, xq_ptr, aux_ptr, M, N, eps, s_part, s_ws, s_x, s_xo,
                        s_h, PARTS: tl.constexpr, ADD: tl.constexpr, NORM: tl.constexpr, F32: tl.constexpr,
                        BLOCK: tl.constexpr, TRIGGER: tl.constexpr = False, ROUND: tl.constexpr = False,
                        WAIT: tl.constexpr = False):
        if TRIGGER:  # the next kernel, a dependent launch (the one-row int4 product's), may launch now:
            tl.extra.cuda.gdc_launch_dependents()  # it waits for this one's output before it reads it
        row = tl.program_id(0).to(tl.int64)
        n = tl.arange(0, BLOCK)
        mask = n < N
        if NORM:  # (the norm's weights: no kernel writes them, read before the wait)
            w = tl.load(w_ptr + n, mask=mask, other=0.0).to(tl.float32)
        if WAIT:  # a dependent launch itself: the kernels before it finish before it reads or writes
            tl.extra.cuda.gdc_wait()
        x = tl.load(x_ptr + row * s_x + n, mask=mask, other=0.0)
        if ADD:  # y = parts added in order, rounded as the product's output; x' = x + y, rounded
            y = tl.load(ws_ptr + row * s_ws + n, mask=mask, other=0.0).to(tl.float32)
            for p in tl.static_range(1, PARTS):
                y += tl.load(ws_ptr + p * s_part + row * s_ws + n, mask=mask, other=0.0).to(tl.float32)
            y = y.to(x.dtype)
            x = (x.to(tl.float32) + y.to(tl.float32)).to(x.dtype)
            tl.store(xo_ptr + row * s_xo + n, x, mask=mask)
        if NORM:  # HF's LlamaRMSNorm: normalise in float32, cast, scale in the dtype
            xf = x.to(tl.float32)
            var = tl.sum(xf * xf, axis=0) / N
            normed = xf * tl.rsqrt(var + eps)
            if F32:
                h = normed * w
            else:
                h = normed.to(x.dtype).to(tl.float32) * w
            h = h.to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + row * s_h + n, h, mask=mask)
            if ROUND:  # h's rounding for the one-row int4 product it feeds (gpu_quant.round_rows' LAYOUT_DP)
                gs = tl.arange(0, BLOCK // 32)
                round_store(tl.reshape(h.to(tl.float32), (BLOCK // 32, 32)), row, M, N, gs, gs < N // 32, xq_ptr,
                            aux_ptr, 1)

    @triton.jit
    def rope_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, s_qkv, s_tab,
                       s_qt, s_qh, s_kh, s_ks, s_vh, s_vs, s_part,
                       HEADS: tl.constexpr, KVH: tl.constexpr, HD: tl.constexpr, D: tl.constexpr,
                       PARTS: tl.constexpr, TRIGGER: tl.constexpr = False, WAIT: tl.constexpr = False):
        if TRIGGER:  # attention, a dependent launch, may launch now: it waits for this one's output
            tl.extra.cuda.gdc_launch_dependents()
        # program (row, head of q, k or v): q and k heads rotated at the row's position; k and v
        # heads stored at the row's slot of the pool. PARTS > 1: qkv holds the product's float32
        # parts over K (s_part apart), added in order and rounded first (invariant.add_parts' bits)
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        d = tl.arange(0, D)
        mask = d < HD
        dt = q_ptr.dtype.element_ty
        # the row's position and slot and the tables (the step's inputs, which no kernel of the chain before
        # this writes) read before the wait
        pos = tl.load(pos_ptr + t).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        rot = mask & (d * 0 + h < HEADS + KVH)  # (a tensor's compare: the interpreter's masks want one)
        c = tl.load(cos_ptr + pos * s_tab + d, mask=rot, other=0.0)
        s = tl.load(sin_ptr + pos * s_tab + d, mask=rot, other=0.0)
        if WAIT:  # a dependent launch itself: the product before it finishes before this reads it
            tl.extra.cuda.gdc_wait()
        src = qkv_ptr + t * s_qkv + h * HD
        x = tl.load(src + d, mask=mask, other=0.0)
        if PARTS > 1:
            for p in tl.static_range(1, PARTS):
                x += tl.load(src + p * s_part + d, mask=mask, other=0.0)
            x = x.to(dt)
        if h < HEADS + KVH:
            xr = tl.load(src + (d + HD // 2) % HD, mask=mask, other=0.0)  # roll(x, half): rotate_half up to sign
            if PARTS > 1:
                for p in tl.static_range(1, PARTS):
                    xr += tl.load(src + p * s_part + (d + HD // 2) % HD, mask=mask, other=0.0)
                xr = xr.to(dt)
            a = (x.to(tl.float32) * c.to(tl.float32)).to(x.dtype)
            b = (xr.to(tl.float32) * s.to(tl.float32)).to(x.dtype)
            out = (a.to(tl.float32) + b.to(tl.float32)).to(x.dtype)
            if h < HEADS:
                tl.store(q_ptr + t * s_qt + h * s_qh + d, out, mask=mask)
            else:
                tl.store(k_ptr + (h - HEADS) * s_kh + slot * s_ks + d, out, mask=mask)
        else:
            tl.store(v_ptr + (h - HEADS - KVH) * s_vh + slot * s_vs + d, x, mask=mask)

    @triton.jit(do_not_specialize=["s_part"])
    def silu_mul_kernel(gu_ptr, o_ptr, xq_ptr, aux_ptr, T, F, s_gu, s_o, s_part, BLOCK: tl.constexpr,
                        PARTS: tl.constexpr = 1, TRIGGER: tl.constexpr = False, ROUND: tl.constexpr = False,
                        WAIT: tl.constexpr = False):
        # PARTS > 1: gu holds the gate_up product's float32 parts over K (s_part apart), added in order
        # and rounded to o's dtype first (invariant.add_parts' bits)
        if TRIGGER:  # the next kernel, a dependent launch (the one-row int4 product's), may launch now:
            tl.extra.cuda.gdc_launch_dependents()  # it waits for this one's output before it reads it
        if WAIT:  # a dependent launch itself: the product before it finishes before this reads it
            tl.extra.cuda.gdc_wait()
        t = tl.program_id(0).to(tl.int64)
        n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = n < F
        dt = o_ptr.dtype.element_ty
        g = tl.load(gu_ptr + t * s_gu + n, mask=mask, other=0.0)
        u = tl.load(gu_ptr + t * s_gu + F + n, mask=mask, other=0.0)
        if PARTS > 1:
            for p in tl.static_range(1, PARTS):
                g += tl.load(gu_ptr + p * s_part + t * s_gu + n, mask=mask, other=0.0)
                u += tl.load(gu_ptr + p * s_part + t * s_gu + F + n, mask=mask, other=0.0)
            g, u = g.to(dt), u.to(dt)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(dt)
        o = (act.to(tl.float32) * u.to(tl.float32)).to(dt)
        tl.store(o_ptr + t * s_o + n, o, mask=mask)
        if ROUND:  # o's rounding for the one-row int4 product it feeds (gpu_quant.round_rows' LAYOUT_DP)
            gs = tl.program_id(1) * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
            round_store(tl.reshape(o.to(tl.float32), (BLOCK // 32, 32)), t, T, F, gs, gs < F // 32, xq_ptr, aux_ptr,
                        1)

    return triton, add_norm_kernel, rope_kv_kernel, silu_mul_kernel


def _block(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def _warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def norm_warps(block: int, tp: bool = False) -> int:
    """add_norm's warps: a program is a whole row, so a wide row takes many warps: 16 (one H200, the
    int4 8B-shaped one-row step, o's and down's parts added by their product: 8 layers 0.4817-0.4836
    ms against 0.4849-0.4856 with 32 warps and 0.4856-0.4864 with 8; when add_norm added their 8 parts
    itself, 32 against 8 was 0.656 against 0.679 ms and 16 no faster). A function of the row's width
    only: the norm's sum over it is the same for any row count. `tp`: a rank of a tensor-parallel stage,
    whose fused all-reduce and norm (tp_reduce) and the add_norm it falls back to take the same, 32 (their
    bits checked equal on two H200s with 32)."""
    return _warps(block) if block < 4096 else 32 if tp else 16


def add_norm(ws: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor | None,
             eps: float, rounded: bool = False, tp: bool = False) -> tuple:
    """ws: a product's output [parts, M, N] (float32 partial sums, added in order, or [1, M, N] in
    x's dtype; None: nothing to add), x: the residual stream [M, N], weight: the next norm's [N]
    (None: no norm). -> (x + the product, rounded to x's dtype; its RMSNorm or None). `rounded`
    (with a norm; N a multiple of 32): also the norm's rows rounded for the one-row int4 product
    (gpu_quant.round_rows(h, LAYOUT_DP)'s (bytes, a and S), in this launch): a third item."""
    _, kernel, _, _ = _kernels()
    M, N = x.shape
    add = ws is not None
    xo = torch.empty_like(x) if add else x
    h = torch.empty_like(x) if weight is not None else None
    if rounded and (h is None or N % 32):
        raise ValueError("add_norm rounds its norm's rows only with a norm over a multiple of 32")
    pre = gpu_quant_kernels.rounding(M, N, gpu_quant_kernels.LAYOUT_DP, x.device) if rounded else None
    if M == 0:
        return (xo, h, pre) if rounded else (xo, h)
    if add:
        assert ws.shape[1:] == (M, N) and ws.stride(2) == 1
    assert x.stride(1) == 1
    block = _block(N)
    kernel[(M,)](ws if add else x, x, weight if weight is not None else x, xo, h if h is not None else x,
                 pre[0] if rounded else x, pre[1] if rounded else x, M, N, eps,
                 ws.stride(0) if add else 0, ws.stride(1) if add else 0, x.stride(0), xo.stride(0),
                 h.stride(0) if h is not None else 0,
                 PARTS=ws.shape[0] if add else 1, ADD=add, NORM=weight is not None, F32=x.dtype == torch.float32,
                 BLOCK=block, num_warps=norm_warps(block, tp), ROUND=rounded, **invariant.small(x.device))
    return (xo, h, pre) if rounded else (xo, h)


def rope_kv(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, positions: torch.Tensor,
            slots: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, heads: int, kv_heads: int,
            head_dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """qkv: [T, (heads + 2 kv_heads) * head_dim], or the qkv product's parts over K not yet added
    ([parts, T, ...], invariant.mm_parts: float32 parts added here in order, as invariant.add_parts
    would, and rounded to `dtype`, the model's; one part: the product itself);
    cos, sin_signed: RoPE tables [positions, head_dim] (rope.RopeTables); positions, slots: [T] int64
    (each row's position and the pool slot it writes); k_pool, v_pool: the layer's [kv_heads, slots,
    head_dim]. Writes each row's rotated k and its v at its slot. -> rotated q [T, heads, head_dim]"""
    _, _, kernel, _ = _kernels()
    parts = qkv if qkv.dim() == 3 else qkv.unsqueeze(0)
    if parts.shape[0] == 1:
        dtype = parts.dtype
    assert dtype is not None, "the model's dtype, to round the parts' sum to"
    T = parts.shape[1]
    q = torch.empty(T, heads, head_dim, dtype=dtype, device=qkv.device)
    if T == 0:
        return q
    assert parts.stride(2) == 1 and cos.stride(1) == 1 and cos.stride(0) == sin_signed.stride(0)
    assert k_pool.stride(2) == 1 and v_pool.stride(2) == 1
    kernel[(T, heads + 2 * kv_heads)](parts, cos, sin_signed, positions, slots, q, k_pool, v_pool, parts.stride(1),
                                      cos.stride(0), q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1),
                                      v_pool.stride(0), v_pool.stride(1), parts.stride(0), HEADS=heads, KVH=kv_heads,
                                      HD=head_dim, D=_block(head_dim), PARTS=parts.shape[0], num_warps=1,
                                      **invariant.small(qkv.device))
    return q


# a program's columns (a multiple of 32: its groups rounded whole). On one H200, the int4 8B-shaped one-row
# step with gate/up's two float32 parts added here: 8 layers 0.524 ms with 256 or 512, 0.546 with 1024 (14
# programs a row of 14,336: too few to hide their loads' latency)
SILU_BLOCK = 256


def silu_mul(gu: torch.Tensor, rounded: bool = False, dtype: torch.dtype | None = None):
    """gu: [T, 2F] (gate, up), or the gate_up product's parts over K not yet added ([parts, T, 2F],
    invariant.mm_parts: float32 parts added here in order, as invariant.add_parts would, and rounded to
    `dtype`, the model's; one part: the product itself) -> silu(gate) * up [T, F], each rounded to the
    dtype as torch does; `rounded` (F a multiple of 32): -> (that, its rows rounded for the one-row int4
    product, as add_norm's `rounded`)."""
    triton, _, _, kernel = _kernels()
    parts = gu if gu.dim() == 3 else gu.unsqueeze(0)
    if parts.shape[0] == 1:
        dtype = parts.dtype
    assert dtype is not None, "the model's dtype, to round the parts' sum to"
    _, T, F2 = parts.shape
    F = F2 // 2
    out = torch.empty(T, F, dtype=dtype, device=gu.device)
    if rounded and F % 32:
        raise ValueError("silu_mul rounds its rows only over a multiple of 32")
    pre = gpu_quant_kernels.rounding(T, F, gpu_quant_kernels.LAYOUT_DP, gu.device) if rounded else None
    if T == 0:
        return (out, pre) if rounded else out
    assert parts.stride(2) == 1
    block = min(SILU_BLOCK, _block(F))
    kernel[(T, triton.cdiv(F, block))](parts, out, pre[0] if rounded else out, pre[1] if rounded else out, T, F,
                                       parts.stride(1), out.stride(0), parts.stride(0), BLOCK=block,
                                       PARTS=parts.shape[0], num_warps=4, ROUND=rounded, **invariant.small(gu.device))
    return (out, pre) if rounded else out
