"""The Triton kernels of stage_node.kernels.gpu_quant (int4 / int8 weights on CUDA), and the torch
reference of int4's arithmetic.

int4: exact partial sums, so that any kernel gives a row the same bits. Each row's activations are
rounded, per group of 32 along K, to integers of at most 11 bits times a power of two: a = 2^(E - 10)
where 2^E <= max |x| < 2^(E + 1), i = rint(x / a), |i| <= 2048 (so i is exact in float16, and x = a i
to within a / 2, finer than bf16 for the group's large entries). Then for output n and group g,
A = sum_k i_k (q_k - 8) (an integer under 2^20) and S = sum_k i_k; then, elementwise and in this
order, t = fma(scale, A, zero * S) and acc = fma(a, t, acc), group after group in ascending order.
A is the same integer on every instruction that computes it exactly, and both kernels do:
  * the tiled kernel (prompts, tensor cores): float16 operands i and q - 8, float32 sums: every product
    and partial sum an integer under 2^24, so exact whatever the order;
  * the one-row kernel (decode, CUDA cores): integer dot products of 4 bytes (dp4a): i = 128 h + l,
    h = i >> 7 in -16..16 and l = i & 127 in 0..127 as bytes, so sum i q = 128 sum h q + sum l q in
    int32 (q the unsigned nibble), then A = float(that) - 8 S exactly.
Nothing in a row's arithmetic then depends on the tile, the instruction (mma, wgmma, dp4a) or the other
rows: the kernel may follow the row count. K in parts fixed per matrix, each part's groups in
ascending order, the parts added in order (invariant.add_parts, or the tiled kernel itself).

The rounding is done once per product by `round_rows` (a row's i, a and S):
  * LAYOUT_MM (the tiled kernel): i in K's order, float16 [M, K];
  * LAYOUT_DP (the one-row kernel): int8 [M, K/32, 2, 32], a group's 32 l then its 32 h, read as
    int32 words of 4 bytes (bytes k = 4m..4m+3 in word m);
  * both: a and S as float32 [2, K/32, M] (a group's values contiguous over the rows).
The weights (gpu_quant's docstring): group-major [K/32, N, 16] bytes, byte j holding q of k = j (low
nibble) and k = 16 + j (high nibble), so word t's low nibbles meet activation word t and its high
nibbles word 4 + t. On the CPU (Triton's interpreter, which has no inline PTX) the one-row kernel
takes the same sums by byte arithmetic (`ASM` off): the same integers.

int8 (int8_mm) takes the activations as they are: float32 sums on the tensor cores, batch-invariant by
the float path's rule (K in parts fixed per matrix, each in BK chunks, whose 16-wide steps the
tensor cores add in order; gpu_quant.int8_config): the rows as the tensor cores' M in tiles of 64 rows
and up, or (TRANS) the weights as their M and the rows as their N in tiles of 16 rows and up; the
two give a row the same bits on the H200 (the same products, each output's sum the tensor cores'
own), which mma tiles under 64 rows of the first form did not. Exact sums' kernels for int8 were no
faster for one row and half as fast for prompts on the H100 (docs/engine.md).
Triton is imported only when a matrix is multiplied.
"""
from __future__ import annotations

import functools

import torch

LAYOUT_MM, LAYOUT_DP = 0, 1
ROUND_GROUPS = 4  # groups of 32 a program of round_rows


def rounding(m: int, k: int, layout: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The buffers of m rows of k rounded (the docstring's layouts): (i as LAYOUT says, a and S)."""
    xq = (torch.empty(m, k, dtype=torch.float16, device=device) if layout == LAYOUT_MM
          else torch.empty(m, k // 32, 2, 32, dtype=torch.int8, device=device))
    return xq, torch.empty(2, k // 32, m, dtype=torch.float32, device=device)


@functools.cache
def kernels():
    # (helpers the kernels call, and tl: Triton resolves them among the module's globals; its interpreter
    # wants tl there too when a kernel of another module calls round_store)
    global dp4, round_store, tl
    import triton
    import triton.language as tl

    @triton.jit
    def round_store(x, row, M, K, gs, g_in, xq_ptr, aux_ptr, LAYOUT: tl.constexpr):
        # x [G, 32] float32: groups gs of a row (g_in: those < K / 32) -> i stored as LAYOUT says, then a
        # and S: round_rows' body, and fused.add_norm's and fused.silu_mul's (their output's rounding
        # for the one-row product after them, in the same launch)
        d = tl.arange(0, 32)
        groups = K // 32
        e = tl.maximum(tl.max(tl.abs(x), axis=1).to(tl.int32, bitcast=True) >> 23 & 255, 11)  # 2^(e-127) <= max |x|
        inv = ((264 - e) << 23).to(tl.float32, bitcast=True)  # 1 / a
        a = ((e - 10) << 23).to(tl.float32, bitcast=True)  # a = 2^(E - 10)
        i = (x * inv[:, None] + 12582912.0) - 12582912.0  # rint (ties even): |x / a| < 2^11 + 1/2
        s = tl.sum(i, axis=1)
        if LAYOUT == 0:
            out = row.to(tl.int64) * K + gs[:, None] * 32 + d[None, :]
            tl.store(xq_ptr + out, i.to(tl.float16), mask=g_in[:, None])
        else:
            ii = i.to(tl.int32)
            out = row.to(tl.int64) * 2 * K + gs[:, None] * 64 + d[None, :]
            tl.store(xq_ptr + out, (ii & 127).to(tl.int8), mask=g_in[:, None])
            tl.store(xq_ptr + out + 32, (ii >> 7).to(tl.int8), mask=g_in[:, None])
        tl.store(aux_ptr + gs * M + row, a, mask=g_in)
        tl.store(aux_ptr + (groups + gs) * M + row, s, mask=g_in)

    @triton.jit
    def round_rows(x_ptr, xq_ptr, aux_ptr, M, K, sxm, LAYOUT: tl.constexpr, GB: tl.constexpr,
                   PDL: tl.constexpr = False):
        # program (row, block of GB groups): i as LAYOUT says, then a and S. PDL (a programmatic
        # dependent launch, invariant.PDL): the product's kernel may launch at once (its weights do not
        # depend on this), and this waits for the kernels before it to finish before it reads x
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        row, pid = tl.program_id(0), tl.program_id(1)
        gs = pid * GB + tl.arange(0, GB)
        d = tl.arange(0, 32)
        g_in = gs < K // 32
        x = tl.load(x_ptr + row.to(tl.int64) * sxm + gs[:, None] * 32 + d[None, :], mask=g_in[:, None],
                    other=0.0).to(tl.float32)
        round_store(x, row, M, K, gs, g_in, xq_ptr, aux_ptr, LAYOUT)

    @triton.jit
    def dp4(a, b, c, ASM: tl.constexpr):
        # c + sum over the 4 bytes of a (unsigned) times those of b (signed): dp4a
        if ASM:
            return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=tl.int32, is_pure=True, pack=1)
        for j in tl.static_range(4):
            c += ((a >> (8 * j)) & 255) * ((b << (24 - 8 * j)) >> 24)
        return c

    @triton.jit(do_not_specialize=["M", "sys_"])
    def int4_mm(xq_ptr, aux_ptr, q_ptr, sz_ptr, y_ptr, M, N, K, k_part, sys_, sym, BM: tl.constexpr, BN: tl.constexpr,
                SUM: tl.constexpr):
        # program (m block, n block, part of K; with SUM every part, added in order as invariant.add_parts
        # does, the sum written in y's dtype), tensor cores, weights as the dot's first operand (out^T =
        # W x^T: the int4 weights dequantized in registers, the activations from shared memory)
        pid_m, pid_n, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        j = tl.arange(0, 16)
        k32 = tl.arange(0, 32)
        rows_in, cols_in = rm < M, rn < N
        groups = K // 32
        x_cols = xq_ptr + rm.to(tl.int64)[None, :] * K
        p_lo = 0 if SUM else part
        p_hi = tl.cdiv(K, k_part) if SUM else part + 1
        total = tl.zeros((BN, BM), dtype=tl.float32)
        for pk in range(p_lo, p_hi):
            g0 = pk * (k_part // 32)
            g1 = tl.minimum(g0 + k_part // 32, groups)
            acc = tl.zeros((BN, BM), dtype=tl.float32)
            # a group's scales, zero points, a and S (not the dot's operands, which Triton's pipeline
            # brings ahead) loaded a group ahead, so that their latency hides behind a group's work
            sz_n = tl.load(sz_ptr + g0 * N + rn, mask=cols_in, other=0)
            a_n = tl.load(aux_ptr + g0 * M + rm, mask=rows_in, other=0.0)
            s_n = tl.load(aux_ptr + (groups + g0) * M + rm, mask=rows_in, other=0.0)
            for g in range(g0, g1):
                sz, a, s_x = sz_n, a_n, s_n
                gn = tl.minimum(g + 1, g1 - 1)
                sz_n = tl.load(sz_ptr + gn * N + rn, mask=cols_in, other=0)
                a_n = tl.load(aux_ptr + gn * M + rm, mask=rows_in, other=0.0)
                s_n = tl.load(aux_ptr + (groups + gn) * M + rm, mask=rows_in, other=0.0)
                p = tl.load(q_ptr + g * N * 16 + rn[:, None] * 16 + j[None, :], mask=cols_in[:, None], other=0)
                p = p.to(tl.int16)  # [BN, 16]: q of k = 32 g + j (low nibble), 32 g + 16 + j (high)
                wa = ((p & 15) | 0x6400).to(tl.float16, bitcast=True) - 1032.0  # 1024 + q - 1032: q - 8, exact
                wb = ((p >> 4) | 0x6400).to(tl.float16, bitcast=True) - 1032.0
                w = tl.reshape(tl.permute(tl.join(wa, wb), (0, 2, 1)), (BN, 32))  # [BN, 32]: k = 32 g + 0..31
                xg = tl.load(x_cols + g * 32 + k32[:, None], mask=rows_in[None, :], other=0.0)  # [32, BM]
                A = tl.dot(w, xg, out_dtype=tl.float32)  # one dot of K 32: one wait a group
                scale = (sz << 16).to(tl.float32, bitcast=True)
                zero = (sz & -65536).to(tl.float32, bitcast=True)
                t = tl.fma(scale[:, None], A, zero[:, None] * s_x[None, :])
                acc = tl.fma(a[None, :], t, acc)
            if SUM:
                total = tl.where(pk == p_lo, acc, total + acc)
            else:
                total = acc
        out = y_ptr + (0 if SUM else part) * sys_ + rm.to(tl.int64)[None, :] * sym + rn[:, None]
        tl.store(out, total.to(y_ptr.dtype.element_ty), mask=rows_in[None, :] & cols_in[:, None])

    @triton.jit(do_not_specialize=["sys_"])
    def int4_gemv(xq_ptr, aux_ptr, q_ptr, sz_ptr, y_ptr, cnt_ptr, M, N, K, k_part, sys_, sym, BN: tl.constexpr,
                  U: tl.constexpr, STAGES: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr = False,
                  TRIGGER: tl.constexpr = False, ADD: tl.constexpr = False):
        # program (row, n block, part of K), CUDA cores: the same sums as int4_mm by dp4a, U groups a step,
        # each step's loads at its start and Triton's pipeliner bringing them STAGES - 1 steps ahead
        # (through shared memory: a warp's bytes in flight without registers to hold them); xd the row's
        # bytes as int32 words [M, K/32, 16] (LAYOUT_DP), q_ptr the weights as int32 words [K/32, N, 4]:
        # word t's low nibbles are q of k = 4t..4t+3, its high nibbles of k = 16+4t..
        row, pid_n, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rn = pid_n * BN + tl.arange(0, BN)
        t4 = tl.arange(0, 4)
        us = tl.arange(0, U)
        cols_in = rn < N
        groups = K // 32
        x_row = xq_ptr + row.to(tl.int64) * groups * 16
        g0 = part * (k_part // 32)
        g1 = tl.minimum(g0 + k_part // 32, groups)
        acc = tl.zeros((BN,), dtype=tl.float32)
        # [U, BN, 4] (U outermost: each thread holds its columns' U groups, so the groups' sums below
        # stay in the thread)
        w_ptrs = q_ptr + us[:, None, None] * N * 4 + rn[None, :, None] * 4 + t4[None, None, :]
        # (the scales' columns written as (2 j) // 2: Triton then sees no contiguity along them, and loads
        # them in the layout the sums are in rather than 4 columns a thread: no move between layouts)
        sz_ptrs = sz_ptr + us[:, None] * N + (pid_n * BN + tl.arange(0, BN) * 2 // 2)[None, :]
        xw = x_row + us[:, None] * 16 + t4[None, :]  # [U, 4]: the row's words (the same for every column)
        a_ptrs = aux_ptr + us * M + row  # [U]
        if PDL:  # launched while the kernel before it runs: the weights of the steps the pipeline loads first
            # (nothing before this writes them) brought into L2 meanwhile, then wait for that kernel, and all
            # before it, to finish (its output is this one's row)
            if ASM:
                first = q_ptr + us[:, None] * N * 4 + rn[None, :] * 4  # [U, BN]: a column's group, its first word
                for s in tl.static_range(STAGES - 1):
                    ok = (cols_in[None, :] & (g0 + s * U + us[:, None] < g1)).to(tl.int32)
                    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; "
                                              "mov.u32 $0, 0; }", "=r,l,r", [first + (g0 + s * U) * N * 4, ok],
                                              dtype=tl.int32, is_pure=False, pack=1)
            tl.extra.cuda.gdc_wait()
        for gu in tl.range(g0, g1, U, num_stages=STAGES):  # this step's groups gu .. gu + U - 1
            w = tl.load(w_ptrs + gu * N * 4, mask=cols_in[None, :, None], other=0)
            sz = tl.load(sz_ptrs + gu * N, mask=cols_in[None, :], other=0)
            xl0, xl1 = tl.load(xw + gu * 16)[:, None, :], tl.load(xw + gu * 16 + 4)[:, None, :]
            xh0, xh1 = tl.load(xw + gu * 16 + 8)[:, None, :], tl.load(xw + gu * 16 + 12)[:, None, :]
            s_x = tl.load(a_ptrs + (groups + gu) * M)[:, None]
            a_x = tl.load(a_ptrs + gu * M)
            lo = w & 0x0F0F0F0F  # bytes q of k = 4t + b
            hi = (w >> 4) & 0x0F0F0F0F  # k = 16 + 4t + b
            h = dp4(hi, xh1, dp4(lo, xh0, tl.zeros((U, BN, 4), dtype=tl.int32), ASM), ASM)
            low = dp4(hi, xl1, dp4(lo, xl0, tl.zeros((U, BN, 4), dtype=tl.int32), ASM), ASM)
            iq = tl.sum(h, axis=2) * 128 + tl.sum(low, axis=2)  # [U, BN]: sum i q, exactly
            A = tl.fma(s_x, -8.0, iq.to(tl.float32))  # sum i (q - 8), exactly
            scale = (sz << 16).to(tl.float32, bitcast=True)
            zero = (sz & -65536).to(tl.float32, bitcast=True)
            t = tl.fma(scale, A, zero * s_x)  # [U, BN]
            for u in tl.static_range(U):  # the groups added in order: a sum with zeros takes group u exactly
                t_u = tl.sum(tl.where(us[:, None] == u, t, 0.0), axis=0)
                a_u = tl.sum(tl.where(us == u, a_x, 0.0), axis=0)
                acc = tl.fma(a_u, t_u, acc)
        if TRIGGER:  # the kernel after it, a dependent launch (invariant.small), may launch once every
            tl.extra.cuda.gdc_launch_dependents()  # program has its sums (it waits for their store)
        tl.store(y_ptr + part * sys_ + row.to(tl.int64) * sym + rn, acc.to(y_ptr.dtype.element_ty), mask=cols_in)
        if ADD:  # the last program of the row's column block to store its part adds every part in order (as
            # invariant.add_parts, in float32) into part 0: its consumer reads one part, not all (cnt_ptr: a
            # count a row's column block, zero before, zero again after)
            tl.debug_barrier()  # (every thread's part stored before the count)
            at = cnt_ptr + row * tl.num_programs(1) + pid_n
            done = tl.atomic_add(at, 1, sem="acq_rel", scope="gpu")
            if done == tl.num_programs(2) - 1:
                out0 = y_ptr + row.to(tl.int64) * sym + rn
                total = tl.load(out0, mask=cols_in, other=0.0, cache_modifier=".cg")  # (from L2: other SMs' parts)
                for p in range(1, tl.num_programs(2)):
                    total += tl.load(out0 + p * sys_, mask=cols_in, other=0.0, cache_modifier=".cg")
                tl.store(out0, total, mask=cols_in)
                tl.store(at, 0)

    @triton.jit(do_not_specialize=["M", "sys_"])
    def int8_mm(x_ptr, q_ptr, s_ptr, y_ptr, M, N, K, k_part, sxm, sqn, sys_, sym,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, TRANS: tl.constexpr = False):
        # program (m block, n block, part of K): y[part] = (x[m block, part] @ q[n block, part].T) * scale;
        # TRANS (gpu_quant.int8_trans: up to 64 rows, and an LM head's over 64): out^T = q x^T, the weights
        # as the dot's first operand (the tensor cores' M: BN, taken from registers as converted) and the
        # rows its N (down to 16: a row's tile is not 64 rows of which 63 are padding)
        pid_m, pid_n, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        rk = tl.arange(0, BK)
        rows_in, cols_in = rm < M, rn < N
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * sxm
        k0 = part * k_part
        k1 = tl.minimum(k0 + k_part, K)
        if TRANS:
            acc_t = tl.zeros((BN, BM), dtype=tl.float32)
            x_cols = x_ptr + rm.to(tl.int64)[None, :] * sxm
            for k in range(k0, k1, BK):
                kk = k + rk
                w = tl.load(q_ptr + rn[:, None] * sqn + kk[None, :], mask=cols_in[:, None] & (kk[None, :] < k1),
                            other=0)  # [BN, BK]
                xt = tl.load(x_cols + kk[:, None], mask=rows_in[None, :] & (kk[:, None] < k1), other=0.0)  # [BK, BM]
                acc_t = tl.dot(w.to(xt.dtype), xt, acc_t)
            acc_t = acc_t * tl.load(s_ptr + rn, mask=cols_in, other=0.0)[:, None]
            out = y_ptr + part * sys_ + rm.to(tl.int64)[None, :] * sym + rn[:, None]
            tl.store(out, acc_t.to(y_ptr.dtype.element_ty), mask=rows_in[None, :] & cols_in[:, None])
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k in range(k0, k1, BK):
                kk = k + rk
                a = tl.load(x_rows + kk[None, :], mask=rows_in[:, None] & (kk[None, :] < k1), other=0.0)  # [BM, BK]
                b = tl.load(q_ptr + rn[None, :] * sqn + kk[:, None], mask=cols_in[None, :] & (kk[:, None] < k1),
                            other=0).to(a.dtype)  # [BK, BN]: exact (|q| <= 127)
                if IEEE:
                    acc = tl.dot(a, b, acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, b, acc)
            acc = acc * tl.load(s_ptr + rn, mask=cols_in, other=0.0)[None, :]
            out = y_ptr + part * sys_ + rm.to(tl.int64)[:, None] * sym + rn[None, :]
            tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=rows_in[:, None] & cols_in[None, :])

    return triton, round_rows, int4_mm, int4_gemv, int8_mm


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


def reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The int4 kernels' product in float64 (no rounding but the activations'): x [M, K]; q [N, K] in
    0..15, scale and zero [N, K/32]."""
    i, a = quantize_rows(x)
    n = q.shape[0]
    A = torch.einsum("mgk,ngk->mng", i, (q.double() - 8).reshape(n, -1, 32))
    t = scale.double()[None] * A + zero.double()[None] * i.sum(-1)[:, None, :]
    return (t * a[:, None, :]).sum(-1)
