"""Batch-invariant CUDA kernels (`--batch-invariant`): a row's result never depends on the other
rows of its step, nor on how the step was batched or padded.

Why they are needed. cuBLAS picks a kernel by the product's shape, and kernels differ in how they
tile and split the sum over K, so `x @ w.T` gives a row other bits with 1 row than with 8; SDPA
picks its backend and its split of the keys by shape too. On an H100 the same prompt then gives
other greedy tokens alone than among 8 concurrent requests. The cure is the one published by
Thinking Machines ("Defeating nondeterminism in LLM inference") and shipped by vLLM as its
batch-invariant mode: kernels whose reduction order per row is fixed, whatever the row count.

  * `mm`: x [M, K] @ w [N, K].T by one Triton kernel, float32 accumulation. Each output element's
    sum over K is taken in an order that never depends on M: K in parts fixed per matrix (added in
    order by a second kernel), each part in 16-wide slices in ascending order (the tensor cores'
    steps, whatever the tile; the tile itself follows M, see `mm_config`). The same kernel serves
    decode rows and prompt rows, so a replay (a prefill of prompt + generated tokens) recomputes
    each generated token's row with the arithmetic that first computed it.
  * `attention`: every query row attends over the keys of its own sequence read from the paged KV
    pool by slot, the positions in splits of ATTN_CHUNK at fixed places, each in blocks of
    ATTN_BLOCK_N at multiples of ATTN_BLOCK_N, softmax online in float32; then each row merges its
    own splits in order. A tile holds a few rows of one sequence (the eager forward) or one row (a
    CUDA graph); blocks past a row's own keys, or before its sliding window, are exact no-ops for
    it (its running max is unchanged and they add exact zeros). So a row's output is the same in a
    graph or eagerly, in any context bucket, alone or with its prompt.
  * RMSNorm, RoPE, activations: torch's own kernels, which are elementwise or reduce one row in one
    block; or, for plain Llama-style layers, stage_node.fused's (norm with the residual add, RoPE
    with the KV write, SwiGLU), one program per row or elementwise (checked on the H100 by
    bench/gpu_invariance.py: same bits for a row in batches of 1 to 512 rows).

A mixture of experts' products on CUDA: stage_node.kernels.grouped, by the same rules (the sum over
K in one program in ascending order, a tile fixed per dtype). Not covered: quantized matrices (their
own kernels, stage_node.quant: they scale a step's activations as a whole). Triton is imported only
when a CUDA stage turns this on.
Measured and checked on the H100: bench/gpu_invariance.py; figures in docs/engine.md.
"""
from __future__ import annotations

import functools
import logging
import os

import torch

from logicpipe.stage_node.kernels import gpu_quant_kernels

log = logging.getLogger(__name__)

SETTINGS = ("auto", "on", "off")
AUTO_ON = True  # "auto" on CUDA turns the kernels on: decode measured faster with them (docs/engine.md)


class InvariantError(RuntimeError):
    """`--batch-invariant on` where the kernels cannot run."""


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve(setting: str, device: str, *, has_triton=triton_available) -> bool:
    """Whether a stage on `device` runs the batch-invariant CUDA kernels, for `--batch-invariant
    setting` (auto / on / off). A CPU stage never does: its products are batch-invariant by their
    row kinds already (stage_node.ops), and the flag does not change them."""
    if setting not in SETTINGS:
        raise ValueError(f"--batch-invariant {setting!r}: use one of {', '.join(SETTINGS)}")
    if torch.device(device).type != "cuda" or setting == "off":
        return False
    if has_triton():
        return setting == "on" or AUTO_ON
    if setting == "on":
        raise InvariantError("--batch-invariant on needs triton (it ships with torch's CUDA wheels)")
    log.warning("triton is not installed: products on this CUDA stage may change with the batch (--batch-invariant)")
    return False


# ---- the product -----------------------------------------------------------------------------------
@functools.cache
def _kernels():
    global round_store  # (gpu_quant_kernels' helper attn_merge calls: Triton resolves it among the globals)
    import triton
    import triton.language as tl

    gpu_quant_kernels.kernels()
    round_store = gpu_quant_kernels.round_store

    @triton.jit(do_not_specialize=["M", "sys_"])
    def mm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, k_part, sxm, sxk, swn, swk, sys_, sym, syn,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
        # program (m block, n block, part of K): y[part] = x[m block, part] @ w[n block, part].T
        pid_m, pid_n, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        rk = tl.arange(0, BK)
        k0 = part * k_part
        k1 = tl.minimum(k0 + k_part, K)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(k0, k1, BK):
            kk = k + rk
            a = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :] * sxk, mask=(rm[:, None] < M) & (kk[None, :] < k1),
                        other=0.0)
            b = tl.load(w_ptr + rn[None, :] * swn + kk[:, None] * swk, mask=(rn[None, :] < N) & (kk[:, None] < k1),
                        other=0.0)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        out = y_ptr + part * sys_ + rm[:, None] * sym + rn[None, :] * syn
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit(do_not_specialize=["total"])
    def sum_parts(ws_ptr, y_ptr, total, PARTS: tl.constexpr, BLOCK: tl.constexpr):
        # y = ws[0] + ws[1] + ... in this order (float32), cast to y's dtype
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        keep = i < total
        acc = tl.load(ws_ptr + i, mask=keep, other=0.0)
        for p in tl.static_range(1, PARTS):
            acc += tl.load(ws_ptr + p * total + i, mask=keep, other=0.0)
        tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=keep)

    @triton.jit(do_not_specialize=["n_tiles", "row_base", "s_tab", "window", "scale_log2", "cap", "chunks"])
    def attn_part(q_ptr, k_ptr, v_ptr, m_ptr, l_ptr, acc_ptr, slot_ptr, pos_ptr, tiles_ptr, n_tiles, row_base,
                  sq_t, sq_h, sk_h, sk_s, sv_h, sv_s, s_tab, window, scale_log2, cap, chunks,
                  HEADS: tl.constexpr, CHUNK: tl.constexpr, GROUP: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, HD: tl.constexpr,
                  HAS_CAP: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr,
                  TRIGGER: tl.constexpr = False, WAIT: tl.constexpr = False):
        # program (tile, kv head, chunk): the tile's rows (consecutive rows of one sequence, whose slot
        # table row is `tab`) times the kv head's GROUP query heads are the BLOCK_M rows of the
        # products; the keys are those of positions [chunk * CHUNK, (chunk + 1) * CHUNK) the tile needs,
        # in blocks of BLOCK_N at multiples of BLOCK_N. Writes each row's running max, sum and
        # unnormalised output of the chunk (float32).
        if TRIGGER:  # the merge, a dependent launch, may launch now: it waits for this one's output
            tl.extra.cuda.gdc_launch_dependents()
        t, h, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        row0 = tl.load(tiles_ptr + t)
        nrows = tl.load(tiles_ptr + n_tiles + t)
        tab = tl.load(tiles_ptr + 2 * n_tiles + t).to(tl.int64)
        m = tl.arange(0, BLOCK_M)
        r = m // GROUP
        valid = r < nrows
        row = (row0 + tl.where(valid, r, 0)).to(tl.int64)
        qh = h * GROUP + m % GROUP
        pos = tl.load(pos_ptr + row, mask=valid, other=0)
        hi = tl.minimum(tl.max(tl.where(valid, pos, 0), axis=0) + 1, (c + 1) * CHUNK)
        lo = c * CHUNK
        if HAS_WINDOW:
            first = tl.min(tl.where(valid, pos, 2**30), axis=0) - window + 1
            lo = tl.maximum(lo, tl.maximum(first, 0) // BLOCK_N * BLOCK_N)
        # the tiles, positions and slot tables are the step's inputs, which no kernel of the chain before
        # this one writes: read before the wait (a dependent launch), with the first block's slots
        n_first = lo + tl.arange(0, BLOCK_N)
        slot_first = tl.load(slot_ptr + tab * s_tab + n_first, mask=n_first < hi, other=0).to(tl.int64)
        if WAIT:  # a dependent launch: the kernels before it finish (q and the new keys) before it reads them
            tl.extra.cuda.gdc_wait()
        if lo < hi:
            d = tl.arange(0, D)
            dmask = d < HD
            q = tl.load(q_ptr + row[:, None] * sq_t + qh[:, None] * sq_h + d[None, :],
                        mask=valid[:, None] & dmask[None, :], other=0.0)
            m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)  # finite: a wholly masked block leaves it
            l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
            acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
            for start in range(lo, hi, BLOCK_N):
                n = start + tl.arange(0, BLOCK_N)
                inb = n < hi
                later = n >= lo + BLOCK_N  # (past the first block, whose slots are read)
                slot = tl.load(slot_ptr + tab * s_tab + n, mask=inb & later, other=0).to(tl.int64)
                slot = tl.where(later, slot, slot_first)
                k = tl.load(k_ptr + h * sk_h + slot[:, None] * sk_s + d[None, :], mask=inb[:, None] & dmask[None, :],
                            other=0.0)
                # (v's load beside k's: both in flight at once, not v's after the scores)
                v = tl.load(v_ptr + h * sv_h + slot[:, None] * sv_s + d[None, :], mask=inb[:, None] & dmask[None, :],
                            other=0.0)
                if IEEE:
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
                if HAS_CAP:  # Gemma 2: cap * tanh(s * scale / cap), in log2 units
                    z = s * (scale_log2 / 1.4426950408889634 / cap)
                    s = (cap * 1.4426950408889634) * (1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))
                else:
                    s = s * scale_log2
                seen = (n[None, :] <= pos[:, None]) & inb[None, :]
                if HAS_WINDOW:
                    seen = seen & (n[None, :] > pos[:, None] - window)
                s = tl.where(seen, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                if IEEE:
                    pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
                else:
                    pv = tl.dot(p.to(v.dtype), v)
                acc = acc * alpha[:, None] + pv
                m_i = m_new
            at = ((row - row_base) * HEADS + qh) * chunks + c  # [BLOCK_M]
            tl.store(m_ptr + at, m_i, mask=valid)
            tl.store(l_ptr + at, l_i, mask=valid)
            tl.store(acc_ptr + at[:, None] * D + d[None, :], acc, mask=valid[:, None])

    @triton.jit(do_not_specialize=["row_base", "window", "chunks", "M"])
    def attn_merge(m_ptr, l_ptr, acc_ptr, pos_ptr, o_ptr, sink_ptr, xq_ptr, aux_ptr, row_base, so_t, so_h, window,
                   chunks, M, HEADS: tl.constexpr, CHUNK: tl.constexpr, D: tl.constexpr,
                   HD: tl.constexpr, HAS_WINDOW: tl.constexpr, CB: tl.constexpr, HAS_SINK: tl.constexpr,
                   ROUND: tl.constexpr = False, TRIGGER: tl.constexpr = False, WAIT: tl.constexpr = False):
        # program (row, query head): the row's own chunks (those holding a position it sees) merged,
        # CB chunks at a time from its first; chunks of other rows' positions are not read. HAS_SINK
        # (gpt-oss): the head's sink logit is one more split, of sum exp(sink) and no output, merged first
        # (the splits' stats are in log2 units, like the sink here), so it counts once per row, whatever
        # the splits. ROUND (HD a multiple of 32; M the step's rows): the head's output also rounded for
        # the one-row int4 product it feeds (gpu_quant.round_rows' LAYOUT_DP of the [M, HEADS * HD] rows)
        if TRIGGER:  # the next kernel, a dependent launch (that product's), may launch now: it waits for
            tl.extra.cuda.gdc_launch_dependents()  # this one's output before it reads it
        i, hq = tl.program_id(0), tl.program_id(1)
        row = row_base + i
        pos = tl.load(pos_ptr + row)  # (a step's input: read before the wait)
        if WAIT:  # a dependent launch (the attention kernel's): that kernel finishes before this reads
            tl.extra.cuda.gdc_wait()
        c_lo = 0
        if HAS_WINDOW:
            c_lo = tl.maximum(pos - window + 1, 0) // CHUNK
        c_hi = pos // CHUNK
        base = (i * HEADS + hq) * chunks
        cb = tl.arange(0, CB)
        big = tl.full((CB,), float("-inf"), dtype=tl.float32)
        for c0 in range(c_lo, c_hi + 1, CB):
            c = c0 + cb
            big = tl.maximum(big, tl.load(m_ptr + base + c, mask=c <= c_hi, other=float("-inf")))
        top = tl.max(big, axis=0)
        sink = top  # HAS_SINK: the head's sink logit in log2 units
        if HAS_SINK:
            sink = tl.load(sink_ptr + hq).to(tl.float32) * 1.4426950408889634
            top = tl.maximum(top, sink)
        d = tl.arange(0, D)
        total = tl.zeros((CB,), dtype=tl.float32)
        out = tl.zeros((D,), dtype=tl.float32)
        for c0 in range(c_lo, c_hi + 1, CB):
            c = c0 + cb
            keep = c <= c_hi
            w = tl.exp2(tl.load(m_ptr + base + c, mask=keep, other=float("-inf")) - top)  # 0 past the row's chunks
            total += tl.load(l_ptr + base + c, mask=keep, other=0.0) * w
            a = tl.load(acc_ptr + (base + c)[:, None] * D + d[None, :], mask=keep[:, None], other=0.0)
            out += tl.sum(a * w[:, None], axis=0)
        denom = tl.sum(total, axis=0)
        if HAS_SINK:
            denom = tl.exp2(sink - top) + denom
        out = (out / denom).to(o_ptr.dtype.element_ty)
        tl.store(o_ptr + row * so_t + hq * so_h + d, out, mask=d < HD)
        if ROUND:
            g = tl.arange(0, D // 32)
            round_store(tl.reshape(out.to(tl.float32), (D // 32, 32)), row, M, HEADS * HD, hq * (HD // 32) + g,
                        g < HD // 32, xq_ptr, aux_ptr, 1)

    return triton, mm_kernel, sum_parts, attn_part, attn_merge


# The sum over K of one output element is what must not change with the row count: the parts of K
# are a function of the matrix alone, and within a part the tensor cores add 16-wide slices of K in
# ascending order whatever the tile (bench/gpu_invariance.py --part tiles checks on the H100 that
# tiles of 16 to 128 rows, 32 to 256 columns and 64 to 256 of K give the same bits; --part kernels
# that a row's bits are the same in products of 1 to 512 rows). So the tile may follow the row count:
#   * up to 32 rows (decode; bound by reading the weights): 16 x 64 x 128, 4 warps, 6 stages (the
#     fastest or within 2% of it for every 8B matrix at 1 and 8 rows, in a sweep of 32 / 64 columns,
#     128 / 256 of K, 4 / 6 stages, 1 / 2 / 4 parts: bench/gpu_step.py --part sweep; 16 x 32 x 128 in 5
#     stages before, gate_up 3% slower), and where a matrix has fewer blocks of 32 columns than ~1.2
#     per SM (an 8B model's o and down), K is summed in 2 fixed parts, added in order by a second
#     kernel (or by stage_node.fused.add_norm with the residual), unless the matrix holds fewer than
#     2^24 weights (SPLIT_MIN): such a one (a tensor-parallel rank's q/k/v and o of the 8B shape)
#     reads faster whole, in blocks of 32 columns, than split and added (issue 36, one H100, one
#     row: [3072, 4096] 11.9 us against 12.8, [4096, 2048] 8.4 against 10.0; bench/gpu_tp_tiles.py);
#   * 33 to 64 rows, and up to 128 for matrices of fewer than 16,384 rows (batched decode, issue 32):
#     64 x 64 x 128, 4 warps, 4 stages: against 64 x 128 x 64 it keeps twice the column blocks in
#     flight; at 64 rows qkv 21.4 us against 35.3, o 11.3 / 17.9, down 47.8 / 68.8 (gate_up alike),
#     at 128 rows qkv 30.6 / 36.5, down 62.6 / 72.4 (bench/gpu_step.py --part rows, one H100);
#   * more rows (prompts; bound by compute): larger tiles, tensor-core products of 64 or 128 rows.
# float32 (tests on CUDA; no TF32, so no tensor cores) keeps one tile for every row count.
SMS = 132
DECODE_ROWS = 32


SPLIT_MIN = 1 << 24  # weights: a smaller float matrix is read whole (its K not split in parts)
# ... unless what takes the product adds the parts itself (fused.add_norm, tp_reduce.push_add_norm,
# fused.rope_kv: no second kernel to pay), down to this many weights (a tensor-parallel rank's q/k/v
# [3072, 4096] and o [4096, 2048] of the 8B shape; issue 36): `summed_parts`
SPLIT_SUMMED_MIN = 1 << 23


@functools.cache
def k_parts(n: int, k: int) -> int:
    """Parts of K the product with a float w [n, k] sums separately (then adds in order): never a function of M."""
    return 2 if quant_parts(n, k) == 2 and n * k >= SPLIT_MIN else 1


@functools.cache
def summed_parts(n: int, k: int) -> int:
    """Parts of K of a float product whose consumer adds them itself (see SPLIT_SUMMED_MIN): never a
    function of M, so every step of a layer sums its rows alike."""
    return 2 if quant_parts(n, k) == 2 and n * k >= SPLIT_SUMMED_MIN else 1


@functools.cache
def quant_parts(n: int, k: int) -> int:
    """The same for a quantized w (stage_node.kernels.gpu_quant, its own tiles): split wherever the
    matrix has too few column blocks, whatever its size."""
    return 2 if -(-n // 32) < 1.2 * SMS and k >= 2048 else 1


def mm_config(n: int, k: int, dtype: torch.dtype, m: int = 1,
              parts: int | None = None) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, parts of K) of an m-row product with w [n, k];
    `parts`: the parts of K the caller fixed (summed_parts; None: k_parts)."""
    if dtype == torch.float32:  # exact float32 (no TF32): one tile
        return 16, 32, 32, 4, 3, 1
    parts = k_parts(n, k) if parts is None else parts
    if m <= DECODE_ROWS:  # a small matrix read whole: 32 columns a block, twice the programs
        return 16, 32 if parts < quant_parts(n, k) else 64, 128, 4, 6, parts
    if m <= 64 or (m <= 128 and n < 16384):  # batched decode (issue 32): more column blocks in flight
        return 64, 64, 128, 4, 4, parts
    if m <= 128:
        return 64, 128, 64, 4, 3, parts
    return 128, 128, 64, 8, 3, parts


def mm_parts(x: torch.Tensor, w: torch.Tensor, config: tuple[int, ...] | None = None, *,
             summed: bool = False, rounded: tuple | None = None, added: bool = False) -> torch.Tensor:
    """x [M, K] @ w [N, K].T as its parts over K, not yet added: [parts, M, N] float32 (several
    parts), or [1, M, N] in x's dtype (one part: the product itself). `mm` adds them in order;
    `stage_node.fused.add_norm` adds them in the same order and the residual and the next norm. A
    quantized w (stage_node.kernels.gpu_quant) gives its parts by its own kernels, by the same rule
    (`rounded`: x's rows already rounded for its one-row int4 kernel, gpu_quant's mm_parts).
    `summed`: its consumer adds the parts itself (summed_parts). `added`: that consumer is add_norm,
    which takes the parts added in float32 as one part (a quantized w's one-row kernel may add them)."""
    if not isinstance(w, torch.Tensor):
        return w.mm_parts(x, rounded=rounded, added=added)
    triton, kernel, _, _, _ = _kernels()
    M, K = x.shape
    N = w.shape[0]
    bm, bn, bk, warps, stages, parts = config or mm_config(N, K, w.dtype, M,
                                                           summed_parts(N, K) if summed else None)
    k_part = -(-K // parts)
    k_part = -(-k_part // 256) * 256  # parts start at multiples of 256, whatever BK (a divisor of 256)
    parts = -(-K // k_part)
    ws = torch.empty(parts, M, N, dtype=x.dtype if parts == 1 else torch.float32, device=x.device)
    if M == 0:
        return ws
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn), parts)
    kernel[grid](x, w, ws, M, N, K, k_part, x.stride(0), x.stride(1), w.stride(0), w.stride(1),
                 M * N if parts > 1 else 0, N, 1, BM=bm, BN=bn, BK=bk, IEEE=x.dtype == torch.float32,
                 num_warps=warps, num_stages=stages)
    return ws


def mm(x: torch.Tensor, w: torch.Tensor, config: tuple[int, ...] | None = None, *,
       rounded: tuple | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K].T -> [M, N] in x's dtype, each row independent of the others (see the
    module's docstring); `config` overrides mm_config (the bench's sweep); `rounded` as mm_parts'."""
    return add_parts(mm_parts(x, w, config, rounded=rounded), x.dtype)


# Programmatic dependent launch (sm_90 on: Hopper, Blackwell): the one-row int4 product's two kernels
# (gpu_quant: the rounding, then the product) launch as dependents, so that the product's kernel starts,
# its first weights in flight (nothing before it writes them), while the kernels before it still run;
# each waits (griddepcontrol.wait) for the kernels before it to finish before it reads their output, so
# no bit changes. The kernels that feed a product (fused.add_norm, fused.silu_mul) let a dependent
# launch at their own start. On one H200, the int4 8B-shaped one-row step: 0.882 -> 0.849 ms.
# Off: every kernel starts after the one before it ends
PDL = True
# ... and the step's small kernels (fused's, attention's two: `small`) are dependent launches too, each
# letting the next launch at its start; the one-row product lets its dependent launch once every program
# has its sums, before its store (never earlier: a product that did so right after its own wait let the
# whole chain of a layer's kernels launch at once, 0.71 -> 0.93 ms a token). One H200, the int4 8B-shaped
# one-row step: 0.709 -> 0.698 ms, bf16 1.293 -> 1.286, int8 1.235 -> 1.227; every Triton kernel of the
# step letting the next launch at its start (the products too) was slower (int4 1.09 ms, bf16 1.35)
SMALL_PDL = True
_pdl: dict[int, bool] = {}


def dependent_launch(device: torch.device) -> bool:
    """Whether kernels on `device` use programmatic dependent launch (PDL on and a CUDA GPU of compute
    capability 9.0 or later; not the CPU's interpreter, not an Orin's sm_87)."""
    if not PDL or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _pdl:  # (once per device: this is asked at every launch of the kernels it concerns)
        _pdl[index] = torch.cuda.get_device_capability(index)[0] >= 9 and os.environ.get("TRITON_INTERPRET") != "1"
    return _pdl[index]


def pdl(device: torch.device) -> dict:
    """A kernel launch's arguments for programmatic dependent launch on `device` (its kernel has a PDL
    flag): none where it is off."""
    return {"PDL": True, "launch_pdl": True} if dependent_launch(device) else {}


def small(device: torch.device) -> dict:
    """A small kernel's launch arguments (fused's, attention's): where PDL is on, it lets the next
    kernel launch at its start (TRIGGER) and, SMALL_PDL, is a dependent launch itself (WAIT: it waits
    for the kernel before it before it reads or writes anything)."""
    if not dependent_launch(device):
        return {}
    return {"TRIGGER": True, "WAIT": True, "launch_pdl": True} if SMALL_PDL else {"TRIGGER": True}


def gemv_trigger(device: torch.device) -> dict:
    """The one-row int4 kernel's TRIGGER: where the kernel after it is a dependent launch (`small`)."""
    return {"TRIGGER": True} if small(device).get("WAIT") else {}


def add_parts(ws: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A product's parts over K [parts, M, N] (mm_parts) added in order -> [M, N] in `dtype`."""
    parts, M, N = ws.shape
    if parts == 1:
        return ws[0]
    triton, _, sum_parts, _, _ = _kernels()
    y = torch.empty(M, N, dtype=dtype, device=ws.device)
    if M:
        sum_parts[(triton.cdiv(M * N, 1024),)](ws, y, M * N, PARTS=parts, BLOCK=1024, num_warps=4)
    return y


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = mm(x, w)
    return out if b is None else out + b


# ---- attention ---------------------------------------------------------------------------------------
ATTN_BLOCK_N = 64
# positions per split of the keys (fixed: a row's splits depend on its own position only). One block
# a split: a decode row's splits run in parallel (at 256, 4 blocks in turn in a program were 15 us a
# layer for one row at 200 positions, the GPU mostly idle)
ATTN_CHUNK = 64
ATTN_MERGE_CHUNKS = 16  # splits the merge reads at a time
ATTN_WORKSPACE = 64 * 2**20  # bytes of partial results a launch may always take (a long prompt goes in parts)
# (row, head)s a launch merges at least, where ATTN_WORKSPACE_SHARE allows: the merge is one program a
# (row, head), walking its splits in order, bound by latency, not bytes, so its time hardly grows with
# the programs up to a few per SM. Parts of ATTN_WORKSPACE alone held fewer rows as the context grew
# (8B shape: 12 rows to 32k positions, 8 to 64.5k, 4 past it), and each such step made a prompt row's
# attention dearer at once (an H200 at 64.5k: 2.9 -> 4.5 ns an attended position), which put a stretch
# of steps over the step-time bar (docs/benchmarks.md, long context)
ATTN_MERGE_PROGRAMS = 512
ATTN_WORKSPACE_SHARE = 1 / 32  # ... and the partials of a launch take at most this share of the device's memory


def tile_rows(group: int) -> int:
    """Rows of one sequence in an attention tile: BLOCK_M (at least 16) // the heads of a group."""
    return _attn_block_m(group) // group


def _attn_block_m(group: int) -> int:
    return max(16, 1 << (group - 1).bit_length())


def attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
              positions: torch.Tensor, tiles: torch.Tensor, *, scale: float, cap: float | None = None,
              window: int | None = None, context: int | None = None, tiles_at: list[int] | None = None,
              sinks: torch.Tensor | None = None, rounded: bool = False):
    """q: [T, heads, hd] (the step's rows, packed); k_pool, v_pool: [kv_heads, slots, hd] (one layer's
    pool, new keys already written); slots: [tables, L] int64, the pool slot of each position of a
    sequence (a table per sequence or per row; L >= every row's position + 1); positions: [T] int64,
    each row's position (it sees positions <= its own, and > its own - window); tiles: [3, n] int32,
    per tile its first row, its row count (at most `tile_rows(group)`, consecutive rows of one
    sequence) and its slot table row, in row order. `context`: positions the splits cover (default
    L); `tiles_at`: the first row of each tile (host side: a long step goes in parts by it); `sinks`:
    [heads], a logit per head that joins every row's softmax with no value (gpt-oss). -> [T, heads * hd];
    `rounded` (hd a multiple of 32): -> (that, its rows rounded for the one-row int4 product it feeds,
    gpu_quant.round_rows(out, LAYOUT_DP)'s (bytes, a and S), written by the merge in its own launch)

    Two kernels: each (tile, kv head, split of ATTN_CHUNK positions) computes its rows' softmax
    statistics and output over that split's keys; then each (row, head) merges its own splits in
    order. Splits a row does not see are never read by its merge, and within a split the keys past
    a row's own (or before its window) are exact no-ops for it."""
    triton, _, _, part_kernel, merge_kernel = _kernels()
    T, heads, hd = q.shape
    kvh = k_pool.shape[0]
    group = heads // kvh
    D = max(16, 1 << (hd - 1).bit_length())
    chunks = triton.cdiv(context or slots.shape[1], ATTN_CHUNK)
    out = torch.empty(T, heads, hd, dtype=q.dtype, device=q.device)
    if rounded and hd % 32:
        raise ValueError("attention rounds its rows only for a head dim that is a multiple of 32")
    pre = gpu_quant_kernels.rounding(T, heads * hd, gpu_quant_kernels.LAYOUT_DP, q.device) if rounded else None
    assert q.stride(2) == 1 and k_pool.stride(2) == 1 and v_pool.stride(2) == 1 and slots.stride(1) == 1
    per_row = heads * chunks * (D + 2) * 4
    n = tiles.shape[1]
    launch = small(q.device)
    # (the merge lets the product after it launch only where that is a dependent launch: o's one-row kernel)
    merge = {k: v for k, v in launch.items() if k != "TRIGGER" or rounded}
    if tiles_at is None:
        parts = [(0, n)]
    else:
        parts = attn_parts(tiles_at, T, part_rows(per_row, heads, _device_bytes(q.device)))
    for a, b in parts:
        sub = tiles if (a, b) == (0, n) else tiles[:, a:b].contiguous()
        first = 0 if a == 0 else tiles_at[a]
        rows = (T if b == n else tiles_at[b]) - first
        m_ws, l_ws, acc_ws = partials(rows, heads, chunks, D, q.device, bucket=tiles_at is not None)
        part_kernel[(b - a, kvh, chunks)](
            q, k_pool, v_pool, m_ws, l_ws, acc_ws, slots, positions, sub, b - a, first, q.stride(0), q.stride(1),
            k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1), slots.stride(0), window or 0,
            scale * 1.4426950408889634, cap or 1.0, chunks, HEADS=heads, CHUNK=ATTN_CHUNK, GROUP=group,
            BLOCK_M=_attn_block_m(group), BLOCK_N=ATTN_BLOCK_N, D=D, HD=hd, HAS_CAP=cap is not None,
            HAS_WINDOW=window is not None, IEEE=q.dtype == torch.float32, num_warps=4,
            num_stages=2 if D <= 512 else 1, **launch)  # MLA's 576-wide latent rows (D 1024): one stage fits shared memory
        merge_kernel[(rows, heads)](m_ws, l_ws, acc_ws, positions, out, m_ws if sinks is None else sinks,
                                    pre[0] if rounded else out, pre[1] if rounded else out, first, out.stride(0),
                                    out.stride(1), window or 0, chunks, T, HEADS=heads, CHUNK=ATTN_CHUNK, D=D, HD=hd,
                                    HAS_WINDOW=window is not None, CB=ATTN_MERGE_CHUNKS, HAS_SINK=sinks is not None,
                                    ROUND=rounded, num_warps=2, **merge)
    return (out.view(T, heads * hd), pre) if rounded else out.view(T, heads * hd)


def part_rows(per_row: int, heads: int, device_bytes: int) -> int:
    """Rows of partial results one attention launch holds at most, each `per_row` bytes: what
    ATTN_WORKSPACE holds, or where that is fewer, up to ATTN_MERGE_PROGRAMS (row, head)s as far as
    ATTN_WORKSPACE_SHARE of the device's `device_bytes` holds them; at least 1."""
    floor = min(-(-ATTN_MERGE_PROGRAMS // heads), int(device_bytes * ATTN_WORKSPACE_SHARE) // per_row)
    return max(1, ATTN_WORKSPACE // per_row, floor)


def attn_parts(tiles_at: list[int], rows: int, cap_rows: int) -> list[tuple[int, int]]:
    """The launches of a step's attention: consecutive tiles [a, b) (tiles_at: each tile's first row,
    `rows` in all) of at most `cap_rows` rows, at least one tile each."""
    n = len(tiles_at)
    ends = [*tiles_at[1:], rows]  # each tile's end
    parts, a = [], 0
    for b in range(1, n + 1):
        if b == n or ends[b] - tiles_at[a] > cap_rows:
            parts.append((a, b))
            a = b
    return parts


def partials(rows: int, heads: int, chunks: int, D: int, device, *, bucket: bool = False):
    """One launch's partial results: each (row, head, split)'s running max and sum [rows, heads,
    chunks] and output [rows, heads, chunks, D], float32, in one allocation. `bucket` (an eager step):
    its size rounded up to a power of two. A long prompt's chunks need a few more splits every step;
    allocations of a size a little larger each time were each a new block of the caching allocator,
    the old ones kept (128,000 tokens on an H200: 120 GiB more reserved over 300 steps); by powers of two,
    those kept hold less than the newest."""
    n = rows * heads * chunks
    pad = -(-n // 16) * 16  # each part on 64 bytes
    need = pad * (D + 2)
    buf = torch.empty(1 << (need - 1).bit_length() if bucket else need, dtype=torch.float32, device=device)
    acc = buf[: n * D].view(rows, heads, chunks, D)
    m = buf[pad * D: pad * D + n].view(rows, heads, chunks)
    return m, buf[pad * (D + 1): pad * (D + 1) + n].view(rows, heads, chunks), acc


@functools.cache
def _device_bytes(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0


def seq_tiles(counts: list[int], group: int) -> list[tuple[int, int, int]]:
    """Tiles of packed sequences with `counts` rows each: (first row, rows, sequence index), at most
    tile_rows(group) rows of one sequence each."""
    per = tile_rows(group)
    out, row = [], 0
    for i, c in enumerate(counts):
        for a in range(0, c, per):
            out.append((row + a, min(per, c - a), i))
        row += c
    return out


def tiles_tensor(tiles: list[tuple[int, int, int]], device) -> torch.Tensor:
    """[3, n] int32: first rows, row counts, table rows."""
    return torch.tensor(list(zip(*tiles)), dtype=torch.int32).to(device, non_blocking=True)
