"""The Triton kernels of stage_node.kernels.gpu_quant (int4 / int8 weights on CUDA), and the torch
reference of their arithmetic.

Exact partial sums, so that any kernel gives a row the same bits. Each row's activations are rounded,
per group of 32 along K, to integers of at most 11 bits times a power of two: a = 2^(E - 10) where
2^E <= max |x| < 2^(E + 1), i = rint(x / a), |i| <= 2048 (so i is exact in float16, and x = a i to
within a / 2, finer than bf16 for the group's large entries). Then for output n and group g:
  * int4: A = sum_k i_k (q_k - 8) and S = sum_k i_k are integers under 2^20, exact in float32 whatever
    the order (|i (q - 8)| <= 2^14, 32 of them), on the tensor cores (float16 operands, float32 sums)
    or on the CUDA cores; then, elementwise and in this order, t = fma(scale, A, zero * S) and
    acc = fma(a, t, acc), group after group in ascending order;
  * int8: A = sum_k i_k q_k (|i q| <= 2^18, 32 of them: under 2^23, exact); acc = fma(a, A, acc), group
    after group; the output channel's scale on the part's sum (acc * scale).
Nothing in a row's arithmetic then depends on the tile, the instruction (mma, wgmma, FMA) or the other
rows: the one-row GEMV kernel (CUDA cores, decode) and the tiled GEMM kernel (tensor cores, prompts)
give a row the same bits, so the kernel may follow the row count. K in parts fixed per matrix (added in
order by invariant.add_parts), each part's groups in ascending order.
Triton is imported only when a matrix is multiplied.
"""
from __future__ import annotations

import functools

import torch

MAGIC = 8388608.0  # 2^23: an integer v < 2^23 or'd into 0x4B000000 reads as the float 2^23 + v
ROUND = 12582912.0  # 1.5 * 2^23: (v + ROUND) - ROUND rounds a float32 |v| < 2^22 to the nearest integer (ties even)


@functools.cache
def kernels():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M", "sys_"])
    def int4_mm(x_ptr, q_ptr, sz_ptr, y_ptr, M, N, K, k_part, sxm, s_qc, s_qn, s_sn, sys_, sym,
                BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr):
        # program (m block, n block, part of K), tensor cores: a group's A and S as in the docstring
        pid_m, pid_n, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        j = tl.arange(0, 16)
        h = tl.arange(0, G)
        rows_in, cols_in = rm < M, rn < N
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * sxm
        c_lo = part * (k_part // (32 * G))
        c_hi = tl.minimum(c_lo + k_part // (32 * G), K // (32 * G))
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for c in range(c_lo, c_hi):
            szc = tl.load(sz_ptr + rn[:, None] * s_sn + c * G + h[None, :], mask=cols_in[:, None], other=0)
            for hh in tl.static_range(G):
                k = (c * G + hh) * 32
                p = tl.load(q_ptr + c * s_qc + rn[:, None] * s_qn + 16 * hh + j[None, :], mask=cols_in[:, None],
                            other=0).to(tl.int32)  # [BN, 16]: weights k + j (low nibbles), k + 16 + j (high)
                xa = tl.load(x_rows + k + j[None, :], mask=rows_in[:, None], other=0.0).to(tl.float32)
                xb = tl.load(x_rows + k + 16 + j[None, :], mask=rows_in[:, None], other=0.0).to(tl.float32)
                e = tl.maximum((tl.maximum(tl.max(tl.abs(xa), axis=1), tl.max(tl.abs(xb), axis=1))).to(tl.int32, bitcast=True) >> 23 & 255, 11)  # 2^(e-127) <= max |x|
                inv = ((264 - e) << 23).to(tl.float32, bitcast=True)  # 1 / a
                a = ((e - 10) << 23).to(tl.float32, bitcast=True)  # a = 2^(E - 10)
                ia = ((xa * inv[:, None] + 12582912.0) - 12582912.0)
                ib = ((xb * inv[:, None] + 12582912.0) - 12582912.0)
                s_x = tl.sum(ia, axis=1) + tl.sum(ib, axis=1)
                wa = ((p & 15 | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0).to(tl.float16)
                wb = ((p >> 4 | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0).to(tl.float16)
                A = tl.dot(ia.to(tl.float16), tl.trans(wa), out_dtype=tl.float32)
                A = tl.dot(ib.to(tl.float16), tl.trans(wb), A)
                sz = tl.sum(tl.where(h[None, :] == hh, szc, 0), axis=1)  # [BN]: group hh's scale | zero << 16
                scale = (sz << 16).to(tl.float32, bitcast=True)
                zero = (sz & -65536).to(tl.float32, bitcast=True)
                t = tl.fma(scale[None, :], A, zero[None, :] * s_x[:, None])
                acc = tl.fma(a[:, None], t, acc)
        out = y_ptr + part * sys_ + rm.to(tl.int64)[:, None] * sym + rn[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=rows_in[:, None] & cols_in[None, :])

    @triton.jit(do_not_specialize=["sys_"])
    def int4_gemv(x_ptr, q_ptr, sz_ptr, y_ptr, N, K, k_part, sxm, s_qc, s_qn, s_sn, sys_, sym,
                  BN: tl.constexpr, G: tl.constexpr):
        # program (row, n block, part of K), CUDA cores: the same sums as int4_mm, one row
        row, pid_n, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        j = tl.arange(0, 16)
        h = tl.arange(0, G)
        cols_in = rn < N
        x_row = x_ptr + row.to(tl.int64) * sxm
        c_lo = part * (k_part // (32 * G))
        c_hi = tl.minimum(c_lo + k_part // (32 * G), K // (32 * G))
        acc = tl.zeros((BN,), dtype=tl.float32)
        for c in range(c_lo, c_hi):
            szc = tl.load(sz_ptr + rn[:, None] * s_sn + c * G + h[None, :], mask=cols_in[:, None], other=0)
            for hh in tl.static_range(G):
                k = (c * G + hh) * 32
                p = tl.load(q_ptr + c * s_qc + rn[:, None] * s_qn + 16 * hh + j[None, :], mask=cols_in[:, None],
                            other=0).to(tl.int32)
                xa = tl.load(x_row + k + j).to(tl.float32)
                xb = tl.load(x_row + k + 16 + j).to(tl.float32)
                e = tl.maximum((tl.maximum(tl.max(tl.abs(xa), axis=0), tl.max(tl.abs(xb), axis=0))).to(tl.int32, bitcast=True) >> 23 & 255, 11)  # 2^(e-127) <= max |x|
                inv = ((264 - e) << 23).to(tl.float32, bitcast=True)  # 1 / a
                a = ((e - 10) << 23).to(tl.float32, bitcast=True)  # a = 2^(E - 10)
                ia = ((xa * inv + 12582912.0) - 12582912.0)
                ib = ((xb * inv + 12582912.0) - 12582912.0)
                s_x = tl.sum(ia, axis=0) + tl.sum(ib, axis=0)
                A = tl.sum(((p & 15 | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0) * ia[None, :], axis=1) + tl.sum(((p >> 4 | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0) * ib[None, :], axis=1)
                sz = tl.sum(tl.where(h[None, :] == hh, szc, 0), axis=1)
                scale = (sz << 16).to(tl.float32, bitcast=True)
                zero = (sz & -65536).to(tl.float32, bitcast=True)
                t = tl.fma(scale, A, zero * s_x)
                acc = tl.fma(a, t, acc)
        tl.store(y_ptr + part * sys_ + row.to(tl.int64) * sym + rn, acc.to(y_ptr.dtype.element_ty), mask=cols_in)

    @triton.jit(do_not_specialize=["M", "sys_"])
    def int8_mm(x_ptr, q_ptr, s_ptr, y_ptr, M, N, K, k_part, sxm, sqn, sys_, sym,
                BM: tl.constexpr, BN: tl.constexpr):
        # program (m block, n block, part of K), tensor cores: a group's A as in the docstring
        pid_m, pid_n, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        r32 = tl.arange(0, 32)
        rows_in, cols_in = rm < M, rn < N
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * sxm
        k0 = part * k_part
        k1 = tl.minimum(k0 + k_part, K)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(k0, k1, 32):
            kk = k + r32
            x = tl.load(x_rows + kk[None, :], mask=rows_in[:, None] & (kk[None, :] < k1), other=0.0).to(tl.float32)
            e = tl.maximum((tl.max(tl.abs(x), axis=1)).to(tl.int32, bitcast=True) >> 23 & 255, 11)  # 2^(e-127) <= max |x|
            inv = ((264 - e) << 23).to(tl.float32, bitcast=True)  # 1 / a
            a = ((e - 10) << 23).to(tl.float32, bitcast=True)  # a = 2^(E - 10)
            xi = ((x * inv[:, None] + 12582912.0) - 12582912.0)
            b = tl.load(q_ptr + rn[None, :] * sqn + kk[:, None], mask=cols_in[None, :] & (kk[:, None] < k1),
                        other=0).to(tl.float16)  # [32, BN]: exact (|q| <= 127)
            A = tl.dot(xi.to(tl.float16), b, out_dtype=tl.float32)
            acc = tl.fma(a[:, None], A, acc)
        acc = acc * tl.load(s_ptr + rn, mask=cols_in, other=0.0)[None, :]
        out = y_ptr + part * sys_ + rm.to(tl.int64)[:, None] * sym + rn[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=rows_in[:, None] & cols_in[None, :])

    @triton.jit(do_not_specialize=["sys_"])
    def int8_gemv(x_ptr, q_ptr, s_ptr, y_ptr, N, K, k_part, sxm, sqn, sys_, sym,
                  BN: tl.constexpr, U: tl.constexpr):
        # program (row, n block, part of K), CUDA cores: the same sums as int8_mm, one row, U groups a step
        row, pid_n, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        r32 = tl.arange(0, 32)
        cols_in = rn < N
        x_row = x_ptr + row.to(tl.int64) * sxm
        k0 = part * k_part
        k1 = tl.minimum(k0 + k_part, K)
        acc = tl.zeros((BN,), dtype=tl.float32)
        for k in range(k0, k1, 32 * U):
            for u in tl.static_range(U):
                kk = k + 32 * u + r32
                keep = kk < k1
                x = tl.load(x_row + kk, mask=keep, other=0.0).to(tl.float32)
                e = tl.maximum((tl.max(tl.abs(x), axis=0)).to(tl.int32, bitcast=True) >> 23 & 255, 11)  # 2^(e-127) <= max |x|
                inv = ((264 - e) << 23).to(tl.float32, bitcast=True)  # 1 / a
                a = ((e - 10) << 23).to(tl.float32, bitcast=True)  # a = 2^(E - 10)
                xi = ((x * inv + 12582912.0) - 12582912.0)
                p = tl.load(q_ptr + rn[:, None] * sqn + kk[None, :], mask=cols_in[:, None] & keep[None, :],
                            other=0).to(tl.int32)  # [BN, 32] in -127..127
                w = ((p + 128) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0  # q, exactly
                acc = tl.fma(a, tl.sum(w * xi[None, :], axis=1), acc)
        acc = acc * tl.load(s_ptr + rn, mask=cols_in, other=0.0)
        tl.store(y_ptr + part * sys_ + row.to(tl.int64) * sym + rn, acc.to(y_ptr.dtype.element_ty), mask=cols_in)

    return triton, int4_mm, int4_gemv, int8_mm, int8_gemv


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
