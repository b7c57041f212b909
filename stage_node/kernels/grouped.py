"""A mixture of experts' top k and products on CUDA by grouped Triton kernels (issue 33): each chosen expert's
matrices are read once per step, whatever the number of rows routed to it, and a row's bits never
depend on the other rows of its step.

Why. The gathered way (stage_node.model.moe.experts_gathered) copies each (row, slot)'s expert
matrices before a batched product of one row each: about 3x the bytes a token must read, in small
kernels; the grouped way runs expert by expert with host syncs (no CUDA graph, ~1 s for a prefill of
a few hundred rows of the Qwen3-30B-A3B shape). Here, as vLLM's fused MoE does (our own code):

  0. `route`: after the router's product, the softmax, top k and renormalisation of
     stage_node.model.moe.route by one program a row (one launch instead of six).
  1. `align`: the step's T * k (row, slot) pairs sorted by expert (stable: pair order within an
     expert), each expert's segment padded to BLOCK_M, as `sorted_ids` (pair index t * k + j, or
     T * k in the padding) and the expert of each block of BLOCK_M (-1 past the used blocks). Fixed
     output sizes (the most blocks T * k pairs can need), no host sync: a CUDA graph replays it. One
     Triton program on CUDA (one launch, not twenty small torch ops; `align_torch` is the same
     function in torch ops, for the CPU and for long prompts).
  2. `grouped_mm`: program (block, N tile) multiplies its block's rows (gathered from x by pair)
     by its expert's [N, K] matrix: a decode step reads each chosen expert's weights once, the
     bytes the HBM limit counts. Optional per-expert bias (gpt-oss), and the routing weight of
     the pair multiplied into the second product's rows.
  3. the gated nonlinearity between the two products is the `glu` passed in (ops.glu), SwiGLU on
     CUDA by stage_node.kernels.fused.silu_mul (one launch; computed in the second product's loads
     instead it was slower on the H100: the mixture at 1 row 78.5 us against 68.6, at 64 rows 588
     against 471; bench/gpu_moe.py, one run); then `combine` sums each row's k slots in the
     router's order (float32, rounded once), as experts_gathered does.

Batch invariance (as stage_node.kernels.invariant): each output element's sum over K is taken by
one program in BLOCK_K steps in ascending order (the tensor cores' 16-wide slices in order), and the
tiling (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) is a function of the dtype only, never of T or
of which rows share a block; rows of a tile are independent in tl.dot. So a row gets the same bits
alone, among 40 rows, or sharing its experts with other rows (checked on the H100:
tests/unit/test_grouped_experts.py's CUDA tests, bench/gpu_moe.py).
"""
from __future__ import annotations

import functools

import torch

from logicpipe.stage_node.kernels import fused

BLOCK_M = 16  # rows of a tile: pairs of one expert (decode routes ~1 row per expert)
ALIGN_MAX_PAIRS = 8192  # more (row, slot) pairs (long prompts, eager) are aligned by torch ops: same output
# (BLOCK_N, BLOCK_K, num_warps, num_stages) of each dtype's products: never a function of the rows
CONFIGS = {torch.float32: (32, 32, 4, 3)}  # exact float32 (IEEE, no TF32): the tests' dtype
CONFIG_16 = (64, 128, 4, 4)  # bf16 / fp16 (bench/gpu_moe.py: tiles within 1% of each other, one H100)


def config(dtype: torch.dtype) -> tuple[int, int, int, int]:
    return CONFIGS.get(dtype, CONFIG_16)


def max_blocks(pairs: int, experts: int, block_m: int = BLOCK_M) -> int:
    """The most blocks of `block_m` that `pairs` (row, slot) pairs over `experts` experts can fill,
    each expert's segment padded to whole blocks: sum over the used experts of ceil(count / block_m)
    <= (pairs + used * (block_m - 1)) / block_m, with used <= min(experts, pairs)."""
    return (pairs + min(experts, pairs) * (block_m - 1)) // block_m


def align_torch(idx: torch.Tensor, experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """idx: [T, k] expert ids -> (sorted_ids [max_blocks * block_m] int32: the pairs t * k + j sorted
    by expert, pair order within an expert, each expert's segment padded to a multiple of block_m
    with T * k; block_expert [max_blocks] int32: each block's expert, -1 for blocks past the used
    ones). Torch ops of fixed output sizes, no host sync."""
    pairs = idx.numel()
    dev = idx.device
    n = max_blocks(pairs, experts, block_m)
    flat = idx.reshape(-1).long()
    counts = torch.zeros(experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = torch.cumsum(counts, 0) - counts  # of each expert among the sorted pairs
    by_expert, order = torch.sort(flat, stable=True)
    dest = (ends - padded)[by_expert] + torch.arange(pairs, device=dev) - starts[by_expert]
    sorted_ids = torch.full((n * block_m,), pairs, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    which = torch.searchsorted(ends // block_m, torch.arange(n, device=dev), right=True)
    return sorted_ids, torch.where(which < experts, which, -1).to(torch.int32)


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["P", "n_slots", "n_blocks"])
    def align_kernel(idx_ptr, ids_ptr, bexp_ptr, P, n_slots, n_blocks, E: tl.constexpr, E_PAD: tl.constexpr,
                     BM: tl.constexpr, CH: tl.constexpr):
        # one program: align_torch's output. Pass 0 fills the padding, 1 counts each expert's pairs,
        # then each block's expert; 2 writes each pair at its expert's start + its rank among them
        ex = tl.arange(0, E_PAD)
        ch = tl.arange(0, CH)
        for s in range(0, n_slots, CH):
            tl.store(ids_ptr + s + ch, tl.zeros((CH,), dtype=tl.int32) + P, mask=s + ch < n_slots)
        counts = tl.zeros((E_PAD,), dtype=tl.int32)
        for p0 in range(0, P, CH):
            e = tl.load(idx_ptr + p0 + ch, mask=p0 + ch < P, other=-1).to(tl.int32)
            counts += tl.sum((e[:, None] == ex[None, :]).to(tl.int32), axis=0)
        padded = (counts + BM - 1) // BM * BM
        ends = tl.cumsum(padded, 0)
        starts = ends - padded
        bends = ends // BM
        for b0 in range(0, n_blocks, CH):
            b = b0 + ch
            which = tl.sum((bends[None, :] <= b[:, None]).to(tl.int32), axis=1)
            tl.store(bexp_ptr + b, tl.where(which < E, which, -1), mask=b < n_blocks)
        tl.debug_barrier()  # the padding's stores before the pairs' own
        seen = tl.zeros((E_PAD,), dtype=tl.int32)
        for p0 in range(0, P, CH):
            p = p0 + ch
            e = tl.load(idx_ptr + p, mask=p < P, other=-1).to(tl.int32)
            hot = (e[:, None] == ex[None, :]).to(tl.int32)  # [CH, E_PAD]
            dest = tl.sum(hot * (tl.cumsum(hot, 0) - 1 + seen[None, :] + starts[None, :]), axis=1)
            tl.store(ids_ptr + dest, p, mask=p < P)
            seen += tl.sum(hot, axis=0)

    @triton.jit(do_not_specialize=["P"])
    def grouped_kernel(x_ptr, w_ptr, b_ptr, rw_ptr, y_ptr, ids_ptr, bexp_ptr, P, N, K, sxm, swe, swn, sbe, sym,
                       ROW_DIV: tl.constexpr, HAS_BIAS: tl.constexpr, WEIGHTED: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
        # program (block, N tile): y[pair] = x[pair // ROW_DIV] @ w[e, N tile].T (+ b[e]) (* rw[pair])
        # for the block's pairs, e the block's expert; K in BK steps in ascending order
        pid_b, pid_n = tl.program_id(0), tl.program_id(1)
        e = tl.load(bexp_ptr + pid_b)
        if e >= 0:
            pair = tl.load(ids_ptr + pid_b * BM + tl.arange(0, BM))
            valid = pair < P
            row = (tl.where(valid, pair, 0) // ROW_DIV).to(tl.int64)
            rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
            rk = tl.arange(0, BK)
            wb = w_ptr + e.to(tl.int64) * swe
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k in range(0, K, BK):
                kk = k + rk
                a = tl.load(x_ptr + row[:, None] * sxm + kk[None, :], mask=valid[:, None] & (kk[None, :] < K), other=0.0)
                b = tl.load(wb + rn[None, :] * swn + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
                if IEEE:
                    acc = tl.dot(a, b, acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, b, acc)
            y = acc.to(y_ptr.dtype.element_ty)  # rounded as the product's own output, then as torch adds
            if HAS_BIAS:
                bias = tl.load(b_ptr + e.to(tl.int64) * sbe + rn, mask=rn < N, other=0.0)
                y = (y.to(tl.float32) + bias.to(tl.float32)[None, :]).to(y_ptr.dtype.element_ty)
            if WEIGHTED:
                rw = tl.load(rw_ptr + pair, mask=valid, other=0.0)
                y = (y.to(tl.float32) * rw.to(tl.float32)[:, None]).to(y_ptr.dtype.element_ty)
            out = y_ptr + pair.to(tl.int64)[:, None] * sym + rn[None, :]
            tl.store(out, y, mask=valid[:, None] & (rn[None, :] < N))

    @triton.jit(do_not_specialize=["T"])
    def combine_kernel(y_ptr, o_ptr, T, H, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
        # o[t] = y[t * k] + y[t * k + 1] + ... in this order, float32, rounded once
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        keep = h < H
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            acc += tl.load(y_ptr + (t * TOP_K + j) * H + h, mask=keep, other=0.0).to(tl.float32)
        tl.store(o_ptr + t * H + h, acc.to(o_ptr.dtype.element_ty), mask=keep)

    @triton.jit
    def route_kernel(l_ptr, w_ptr, i_ptr, E, s_l, TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                     NORM: tl.constexpr):
        # program (row): softmax of the row's logits in float32, its TOP_K largest in descending
        # order (the lowest expert first among equals), renormalised with NORM, cast to w's dtype
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, E_PAD)
        x = tl.load(l_ptr + t * s_l + e, mask=e < E, other=float("-inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, 0))
        p = p / tl.sum(p, 0)
        p = tl.where(e < E, p, -1.0)
        j = tl.arange(0, K_PAD)
        top = tl.zeros((K_PAD,), dtype=tl.float32)
        idx = tl.zeros((K_PAD,), dtype=tl.int32)
        for n in tl.static_range(TOP_K):
            v = tl.max(p, 0)
            i = tl.min(tl.where(p == v, e, E_PAD), 0)
            top = tl.where(j == n, v, top)
            idx = tl.where(j == n, i, idx)
            p = tl.where(e == i, -2.0, p)
        if NORM:
            top = top / tl.sum(top, 0)
        tl.store(w_ptr + t * TOP_K + j, top.to(w_ptr.dtype.element_ty), mask=j < TOP_K)
        tl.store(i_ptr + t * TOP_K + j, idx, mask=j < TOP_K)

    return triton, align_kernel, grouped_kernel, combine_kernel, route_kernel


def align(idx: torch.Tensor, experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_torch`'s output; on CUDA up to ALIGN_MAX_PAIRS pairs by one Triton program."""
    if not idx.is_cuda or idx.numel() > ALIGN_MAX_PAIRS or idx.numel() == 0:
        return align_torch(idx, experts, block_m)
    return align_triton(idx, experts, block_m)


def align_triton(idx: torch.Tensor, experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_torch`'s output by one Triton program (one launch: a CUDA graph's decode step)."""
    triton, kernel, _, _, _ = _kernels()
    pairs = idx.numel()
    n = max_blocks(pairs, experts, block_m)
    sorted_ids = torch.empty(n * block_m, dtype=torch.int32, device=idx.device)
    block_expert = torch.empty(n, dtype=torch.int32, device=idx.device)
    e_pad = triton.next_power_of_2(experts)
    kernel[(1,)](idx.contiguous(), sorted_ids, block_expert, pairs, n * block_m, n, E=experts, E_PAD=e_pad,
                 BM=block_m, CH=max(16, min(64, 8192 // e_pad)), num_warps=4)
    return sorted_ids, block_expert


def grouped_mm(x: torch.Tensor, w: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor, pairs: int,
               row_div: int, bias: torch.Tensor | None = None, route_weights: torch.Tensor | None = None) -> torch.Tensor:
    """y [pairs, N]: y[p] = x[p // row_div] @ w[e(p)].T (+ bias[e(p)]) (* route_weights[p]), e(p)
    the expert `align` put pair p under. x: [rows, K]; w: [E, N, K]; bias: [E, N]; route_weights:
    [pairs] (float32 or x's dtype). Each rounding as torch's: the product to x's dtype, then the
    bias added, then the weight multiplied."""
    triton, _, kernel, _, _ = _kernels()
    N, K = w.shape[1], w.shape[2]
    y = torch.empty(pairs, N, dtype=x.dtype, device=x.device)
    if pairs == 0:
        return y
    assert x.stride(1) == 1 and w.stride(2) == 1 and (bias is None or bias.stride(1) == 1)
    bn, bk, warps, stages = config(w.dtype)
    kernel[(block_expert.shape[0], triton.cdiv(N, bn))](
        x, w, bias if bias is not None else w, route_weights if route_weights is not None else w, y, sorted_ids,
        block_expert, pairs, N, K, x.stride(0), w.stride(0), w.stride(1), bias.stride(0) if bias is not None else 0,
        y.stride(0), ROW_DIV=row_div, HAS_BIAS=bias is not None, WEIGHTED=route_weights is not None, BM=BLOCK_M,
        BN=bn, BK=bk, IEEE=x.dtype == torch.float32, num_warps=warps, num_stages=stages)
    return y


def combine(y: torch.Tensor, top_k: int) -> torch.Tensor:
    """y [T * k, H] -> [T, H]: each row's k slots summed in slot order in float32, rounded once."""
    triton, _, _, kernel, _ = _kernels()
    T, H = y.shape[0] // top_k, y.shape[1]
    out = torch.empty(T, H, dtype=y.dtype, device=y.device)
    if T:
        kernel[(T, triton.cdiv(H, 1024))](y, out, T, H, TOP_K=top_k, BLOCK=1024, num_warps=4)
    return out


def route(logits: torch.Tensor, moe, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """stage_node.model.moe.route's arithmetic after the router's product, one program a row (one
    launch, not six): logits [T, E] -> (weights [T, k] in `dtype`, or float32 where the family
    scales in float32; expert ids [T, k] int32). Softmax in float32, top k, renormalised if the
    config says; equal to torch's to float rounding (its own exp and sum order)."""
    triton, _, _, _, kernel = _kernels()
    T, E = logits.shape
    k = moe.top_k
    weights = torch.empty(T, k, dtype=torch.float32 if moe.weights_in_float else dtype, device=logits.device)
    idx = torch.empty(T, k, dtype=torch.int32, device=logits.device)
    if T:
        assert logits.stride(1) == 1
        kernel[(T,)](logits, weights, idx, E, logits.stride(0), TOP_K=k, K_PAD=triton.next_power_of_2(k),
                     E_PAD=triton.next_power_of_2(E), NORM=bool(moe.norm_topk_prob), num_warps=1)
    return weights, idx


def experts(h: torch.Tensor, experts, weights: torch.Tensor, idx: torch.Tensor, glu) -> torch.Tensor:
    """The mixture's output for h [T, hidden] routed to idx [T, k] with weights [T, k]; `experts`:
    stage_node.model.weights.Experts with stacked matrices; glu: ops.glu's function. -> [T, hidden]"""
    T, k = idx.shape
    h = h.contiguous()
    sorted_ids, block_expert = align(idx, experts.gate_up.shape[0])
    gate_up = grouped_mm(h, experts.gate_up, sorted_ids, block_expert, T * k, k, experts.gate_up_bias)
    if h.is_cuda and getattr(glu, "activation", None) == "silu":  # SwiGLU in one launch, not two
        act = fused.silu_mul(gate_up)  # [T * k, inter]
    else:
        act = glu(gate_up).contiguous()
    y = grouped_mm(act, experts.down, sorted_ids, block_expert, T * k, 1, experts.down_bias,
                   weights.reshape(-1).contiguous())
    return combine(y, k)
