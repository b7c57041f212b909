"""The Triton kernels of stage_node.kernels.gpu_quant (int4 / int8 weights on CUDA), and the torch
reference of their arithmetic.

Exact partial sums, so that any kernel gives a row the same bits. Each row's activations are rounded,
per group of 32 along K, to integers of at most 11 bits times a power of two: a = 2^(E - 10) where
2^E <= max |x| < 2^(E + 1), i = rint(x / a), |i| <= 2048 (so i is exact in float16, and x = a i to
within a / 2, finer than bf16 for the group's large entries). Then for output n and group g:
  * int4: A = sum_k i_k (q_k - 8) and S = sum_k i_k are integers under 2^20, exact in float32 whatever
    the order (|i (q - 8)| <= 2^14, 32 of them), on the tensor cores (float16 operands, float32 sums)
    or on the CUDA cores (there as sum_k i_k q_k - 8 S: the same integer); then, elementwise and in
    this order, t = fma(scale, A, zero * S) and acc = fma(a, t, acc), group after group in ascending
    order;
  * int8: A = sum_k i_k q_k (|i q| <= 2^18, 32 of them: under 2^23, exact; on the CUDA cores as
    sum_k i_k (q_k + 128) - 128 S, partial sums under 2^24: the same integer); acc = fma(a, A, acc),
    group after group; the output channel's scale on the part's sum (acc * scale).
Nothing in a row's arithmetic then depends on the tile, the instruction (mma, wgmma, FMA) or the other
rows: the one-row GEMV kernels (CUDA cores, decode) and the tiled GEMM kernels (tensor cores, prompts)
give a row the same bits, so the kernel may follow the row count. K in parts fixed per matrix (added in
order by invariant.add_parts), each part's groups in ascending order.

The rounding is done once per product by `round_rows` (a row's i, a and S, each group's 32 i in the
order the next kernel reads them), not in every program of the product:
  * LAYOUT_MM: i in K's order, float16 (the tensor cores' operands);
  * LAYOUT_INT4 / LAYOUT_INT8: float32, permuted and pre-scaled for the one-row kernels, which read a
    group's weights as int32 words (int4: 4 words of 8 nibbles; int8: 8 words of 4 bytes) and take
    the same nibble (byte) e of every word with one mask, in place: (w & 15 << s) | 0x4B000000 read
    as a float is 2^23 + q 2^s exactly (s <= 19), so q 2^s costs a LOP3 and a FADD, and the
    activation it meets is stored as i 2^-s (exact) at position 4e + t (int4) or 8e + t (int8), t
    the word: one 16-byte load brings the activations of a nibble of 4 words.
Triton is imported only when a matrix is multiplied.
"""
from __future__ import annotations

import functools

import torch

MAGIC_BITS = 0x4B000000  # the float 2^23
MAGIC = 8388608.0  # 2^23: an integer v < 2^23 or'd into 0x4B000000 reads as the float 2^23 + v
ROUND = 12582912.0  # 1.5 * 2^23: (v + ROUND) - ROUND rounds a float32 |v| < 2^22 to the nearest integer (ties even)
LAYOUT_MM, LAYOUT_INT4, LAYOUT_INT8 = 0, 4, 8
ROUND_GROUPS = 4  # groups of 32 a program of round_rows


@functools.cache
def kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def round_rows(x_ptr, xq_ptr, aux_ptr, K, sxm, LAYOUT: tl.constexpr, GB: tl.constexpr):
        # program (row, block of GB groups): i (permuted, pre-scaled as LAYOUT says), then a and S
        row, pid = tl.program_id(0), tl.program_id(1)
        groups = K // 32
        gs = pid * GB + tl.arange(0, GB)
        d = tl.arange(0, 32)
        if LAYOUT == 4:  # position d = 4e + t: word t's nibble e, k = 16 (e % 2) + 4 t + e // 2; times 2^-s
            nib = d // 4
            src = 16 * (nib % 2) + 4 * (d % 4) + nib // 2
            shift = tl.where(nib < 5, 4 * nib, 4 * nib - 12)
        elif LAYOUT == 8:  # position d = 8e + t: word t's byte e, k = 4 t + e; times 2^-s
            nib = d // 8
            src = 4 * (d % 8) + nib
            shift = 8 * (nib % 2)
        else:
            src = d
            shift = d * 0
        g_in = gs < groups
        base = row.to(tl.int64) * sxm
        x = tl.load(x_ptr + base + gs[:, None] * 32 + src[None, :], mask=g_in[:, None], other=0.0).to(tl.float32)
        e = tl.maximum(tl.max(tl.abs(x), axis=1).to(tl.int32, bitcast=True) >> 23 & 255, 11)  # 2^(e-127) <= max |x|
        inv = ((264 - e) << 23).to(tl.float32, bitcast=True)  # 1 / a
        a = ((e - 10) << 23).to(tl.float32, bitcast=True)  # a = 2^(E - 10)
        i = (x * inv[:, None] + 12582912.0) - 12582912.0
        s = tl.sum(i, axis=1)
        i = i * ((127 - shift) << 23).to(tl.float32, bitcast=True)[None, :]
        out = row.to(tl.int64) * K + gs[:, None] * 32 + d[None, :]
        tl.store(xq_ptr + out, i.to(xq_ptr.dtype.element_ty), mask=g_in[:, None])
        aux = aux_ptr + row.to(tl.int64) * 2 * groups + gs
        tl.store(aux, a, mask=g_in)
        tl.store(aux + groups, s, mask=g_in)

    @triton.jit(do_not_specialize=["M", "sys_"])
    def int4_mm(xq_ptr, aux_ptr, q_ptr, sz_ptr, y_ptr, M, N, K, k_part, s_qc, s_qn, s_sn, sys_, sym,
                BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr):
        # program (m block, n block, part of K), tensor cores: a group's A and S as in the docstring
        pid_m, pid_n, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        j = tl.arange(0, 16)
        h = tl.arange(0, G)
        rows_in, cols_in = rm < M, rn < N
        groups = K // 32
        x_rows = xq_ptr + rm.to(tl.int64)[:, None] * K
        aux_rows = aux_ptr + rm.to(tl.int64) * 2 * groups
        c_lo = part * (k_part // (32 * G))
        c_hi = tl.minimum(c_lo + k_part // (32 * G), K // (32 * G))
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for c in range(c_lo, c_hi):
            szc = tl.load(sz_ptr + rn[:, None] * s_sn + c * G + h[None, :], mask=cols_in[:, None], other=0)
            for hh in tl.static_range(G):
                k = (c * G + hh) * 32
                p = tl.load(q_ptr + c * s_qc + rn[:, None] * s_qn + 16 * hh + j[None, :], mask=cols_in[:, None],
                            other=0).to(tl.int32)  # [BN, 16]: weights k + j (low nibbles), k + 16 + j (high)
                ia = tl.load(x_rows + k + j[None, :], mask=rows_in[:, None], other=0.0)
                ib = tl.load(x_rows + k + 16 + j[None, :], mask=rows_in[:, None], other=0.0)
                a = tl.load(aux_rows + c * G + hh, mask=rows_in, other=0.0)
                s_x = tl.load(aux_rows + groups + c * G + hh, mask=rows_in, other=0.0)
                wa = ((p & 15 | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0).to(tl.float16)
                wb = ((p >> 4 | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0).to(tl.float16)
                A = tl.dot(ia, tl.trans(wa), out_dtype=tl.float32)
                A = tl.dot(ib, tl.trans(wb), A)
                sz = tl.sum(tl.where(h[None, :] == hh, szc, 0), axis=1)  # [BN]: group hh's scale | zero << 16
                scale = (sz << 16).to(tl.float32, bitcast=True)
                zero = (sz & -65536).to(tl.float32, bitcast=True)
                t = tl.fma(scale[None, :], A, zero[None, :] * s_x[:, None])
                acc = tl.fma(a[:, None], t, acc)
        out = y_ptr + part * sys_ + rm.to(tl.int64)[:, None] * sym + rn[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=rows_in[:, None] & cols_in[None, :])

    @triton.jit(do_not_specialize=["sys_", "magic"])
    def int4_gemv(xq_ptr, aux_ptr, q_ptr, sz_ptr, y_ptr, N, K, k_part, s_qc, s_qn, s_sn, sys_, sym, magic,
                  BN: tl.constexpr, G: tl.constexpr):
        # program (row, n block, part of K), CUDA cores: the same sums as int4_mm, one row; q_ptr the
        # packing as int32 words (s_qc, s_qn in words), xq in LAYOUT_INT4 (the docstring); magic
        # 0x4B000000 as an argument, so that (w & mask) | magic is one LOP3 (mask immediate)
        row, pid_n, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        t4 = tl.arange(0, 4)
        h = tl.arange(0, G)
        cols_in = rn < N
        groups = K // 32
        x_row = xq_ptr + row.to(tl.int64) * K
        aux_row = aux_ptr + row.to(tl.int64) * 2 * groups
        c_lo = part * (k_part // (32 * G))
        c_hi = tl.minimum(c_lo + k_part // (32 * G), K // (32 * G))
        acc = tl.zeros((BN,), dtype=tl.float32)
        for c in range(c_lo, c_hi):
            szc = tl.load(sz_ptr + rn[:, None] * s_sn + c * G + h[None, :], mask=cols_in[:, None], other=0)
            for hh in tl.static_range(G):
                g = c * G + hh
                w = tl.load(q_ptr + c * s_qc + rn[:, None] * s_qn + 4 * hh + t4[None, :], mask=cols_in[:, None],
                            other=0)  # [BN, 4] int32: 8 nibbles a word
                wh = w >> 12
                xg = x_row + g * 32 + t4[None, :]
                s4 = tl.zeros((BN, 4), dtype=tl.float32)
                for e in tl.static_range(8):
                    if e < 5:
                        v = ((w & (15 << (4 * e))) | magic).to(tl.float32, bitcast=True) - 8388608.0
                    else:
                        v = ((wh & (15 << (4 * e - 12))) | magic).to(tl.float32, bitcast=True) - 8388608.0
                    s4 += v * tl.load(xg + 4 * e)  # q 2^s times i 2^-s: i q, exact
                a = tl.load(aux_row + g)
                s_x = tl.load(aux_row + groups + g)
                A = tl.sum(s4, axis=1) - 8.0 * s_x  # sum i (q - 8), exactly
                sz = tl.sum(tl.where(h[None, :] == hh, szc, 0), axis=1)
                scale = (sz << 16).to(tl.float32, bitcast=True)
                zero = (sz & -65536).to(tl.float32, bitcast=True)
                t = tl.fma(scale, A, zero * s_x)
                acc = tl.fma(a, t, acc)
        tl.store(y_ptr + part * sys_ + row.to(tl.int64) * sym + rn, acc.to(y_ptr.dtype.element_ty), mask=cols_in)

    @triton.jit(do_not_specialize=["M", "sys_"])
    def int8_mm(xq_ptr, aux_ptr, q_ptr, s_ptr, y_ptr, M, N, K, k_part, sqn, sys_, sym,
                BM: tl.constexpr, BN: tl.constexpr):
        # program (m block, n block, part of K), tensor cores: a group's A as in the docstring
        pid_m, pid_n, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        r32 = tl.arange(0, 32)
        rows_in, cols_in = rm < M, rn < N
        groups = K // 32
        x_rows = xq_ptr + rm.to(tl.int64)[:, None] * K
        aux_rows = aux_ptr + rm.to(tl.int64) * 2 * groups
        k0 = part * k_part
        k1 = tl.minimum(k0 + k_part, K)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(k0, k1, 32):
            kk = k + r32
            xi = tl.load(x_rows + kk[None, :], mask=rows_in[:, None], other=0.0)
            a = tl.load(aux_rows + k // 32, mask=rows_in, other=0.0)
            b = tl.load(q_ptr + rn[None, :] * sqn + kk[:, None], mask=cols_in[None, :],
                        other=0).to(tl.float16)  # [32, BN]: exact (|q| <= 127)
            A = tl.dot(xi, b, out_dtype=tl.float32)
            acc = tl.fma(a[:, None], A, acc)
        acc = acc * tl.load(s_ptr + rn, mask=cols_in, other=0.0)[None, :]
        out = y_ptr + part * sys_ + rm.to(tl.int64)[:, None] * sym + rn[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=rows_in[:, None] & cols_in[None, :])

    @triton.jit(do_not_specialize=["sys_", "magic"])
    def int8_gemv(xq_ptr, aux_ptr, q_ptr, s_ptr, y_ptr, N, K, k_part, sqn, sys_, sym, magic,
                  BN: tl.constexpr, U: tl.constexpr):
        # program (row, n block, part of K), CUDA cores: the same sums as int8_mm, one row, U groups a
        # step; q_ptr the matrix as int32 words (sqn in words), xq in LAYOUT_INT8 (the docstring)
        row, pid_n, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        t8 = tl.arange(0, 8)
        cols_in = rn < N
        groups = K // 32
        x_row = xq_ptr + row.to(tl.int64) * K
        aux_row = aux_ptr + row.to(tl.int64) * 2 * groups
        g0 = part * (k_part // 32)
        g1 = tl.minimum(g0 + k_part // 32, groups)
        acc = tl.zeros((BN,), dtype=tl.float32)
        for gu in range(g0, g1, U):
            for u in tl.static_range(U):
                g = gu + u
                w = tl.load(q_ptr + rn[:, None] * sqn + 8 * g + t8[None, :], mask=cols_in[:, None], other=0)
                w = w ^ -2139062144  # 0x80808080: each byte q + 128, in 1..255
                wh = w >> 16
                xg = x_row + g * 32 + t8[None, :]
                s8 = tl.zeros((BN, 8), dtype=tl.float32)
                for e in tl.static_range(4):
                    if e < 2:
                        v = ((w & (255 << (8 * e))) | magic).to(tl.float32, bitcast=True) - 8388608.0
                    else:
                        v = ((wh & (255 << (8 * e - 16))) | magic).to(tl.float32, bitcast=True) - 8388608.0
                    s8 += v * tl.load(xg + 8 * e)  # (q + 128) 2^s times i 2^-s, exact
                A = tl.sum(s8, axis=1) - 128.0 * tl.load(aux_row + groups + g)  # sum i q, exactly
                acc = tl.fma(tl.load(aux_row + g), A, acc)
        acc = acc * tl.load(s_ptr + rn, mask=cols_in, other=0.0)
        tl.store(y_ptr + part * sys_ + row.to(tl.int64) * sym + rn, acc.to(y_ptr.dtype.element_ty), mask=cols_in)

    return triton, round_rows, int4_mm, int4_gemv, int8_mm, int8_gemv


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' rounding of activations, in torch (the tests' reference): x [M, K] (K a multiple
    of 32) -> (i [M, K/32, 32] float64 integers, a [M, K/32] float64 powers of two), x ~ a i."""
    m, k = x.shape
    xg = x.float().reshape(m, k // 32, 32)
    amax = xg.abs().amax(-1)
    e = ((amax.view(torch.int32) >> 23) & 255).clamp(min=11)
    inv = ((264 - e) << 23).view(torch.float32)
    a = ((e - 10) << 23).view(torch.float32)
    i = torch.round(xg * inv[..., None])  # round half to even, as the kernels' (v + 1.5 2^23) - 1.5 2^23
    return i.double(), a.double()


def reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """The kernels' product in float64 (no rounding but the activations'): x [M, K]; int4: q [N, K]
    in 0..15, scale and zero [N, K/32]; int8 (zero None): q [N, K] in -127..127, scale [N]."""
    i, a = quantize_rows(x)
    n = q.shape[0]
    if zero is None:
        A = torch.einsum("mgk,ngk->mng", i, q.double().reshape(n, -1, 32))
        return (A * a[:, None, :]).sum(-1) * scale.double()[None, :]
    A = torch.einsum("mgk,ngk->mng", i, (q.double() - 8).reshape(n, -1, 32))
    t = scale.double()[None] * A + zero.double()[None] * i.sum(-1)[:, None, :]
    return (t * a[:, None, :]).sum(-1)
