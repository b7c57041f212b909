"""The all-reduce of a CUDA tensor-parallel rank fused with the residual add and the next norm, by
pushing (issue 36): `push_add_norm`.

Each rank's symmetric buffer (model.tp) has two slots used in turn (a layer's o product slot 0, its
down product slot 1), each a region per rank of ONE_SHOT_ROWS rows. A program of rank r rounds its
rows' partial sums (the product's parts added in order) to the dtype and stores them into region r
of that slot on every rank (over NVLink; no flags); then, for each rank q in rank order, it reads
its own region q until no element holds the empty mark, the bits of -0.0 (a partial sum's -0.0 is
sent as +0.0, which the sum cannot tell apart: it starts from +0.0), adds it in float32 and marks
the region empty again; one rounding, the residual, the norm (stage_node.fused.add_norm's
arithmetic). On two ranks the bits equal the one-shot all-reduce's followed by add_norm.

Why it is safe without any meeting: a region is written again only at the slot's next use, two
calls later, and a peer reaches that call only after it has read this rank's data of the call in
between, which this rank sends after it marked the region empty. The buffers start empty (filled
with the mark, every rank synchronised, before the first call).
"""
from __future__ import annotations

import functools

import torch

from logicpipe.stage_node.kernels import fused

MAX_WORLD = 8  # ranks it serves (one pointer argument each)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])
    def push_add_norm_kernel(ws_ptr, x_ptr, w_ptr, xo_ptr, h_ptr, b0, b1, b2, b3, b4, b5, b6, b7, M, N, slot_off,
                             region, eps, s_part, s_ws, s_x, s_xo, s_h, RANK: tl.constexpr, WORLD: tl.constexpr,
                             PARTS: tl.constexpr, NORM: tl.constexpr, F32: tl.constexpr, BLOCK: tl.constexpr,
                             MARK: tl.constexpr, IT: tl.constexpr):
        # program p: rows p, p + programs, ...; b<q>: rank q's buffer as mapped here; IT: the int type of
        # the dtype's width, MARK: -0.0's bits in it
        pid = tl.program_id(0)
        step = tl.num_programs(0)
        n = tl.arange(0, BLOCK)
        mask = n < N
        dt = x_ptr.dtype.element_ty
        for row in range(pid, M, step):  # my partial sum into region RANK of every rank's slot
            y = tl.load(ws_ptr + row * s_ws + n, mask=mask, other=0.0).to(tl.float32)
            for p in tl.static_range(1, PARTS):
                y += tl.load(ws_ptr + p * s_part + row * s_ws + n, mask=mask, other=0.0).to(tl.float32)
            y = y.to(dt).to(tl.float32)
            y = tl.where(y == 0.0, 0.0, y).to(dt)  # -0.0 is the empty mark: sent as +0.0
            at = slot_off + RANK * region + row * N + n
            for q in tl.static_range(WORLD):
                dst = b0
                if q == 1:
                    dst = b1
                elif q == 2:
                    dst = b2
                elif q == 3:
                    dst = b3
                elif q == 4:
                    dst = b4
                elif q == 5:
                    dst = b5
                elif q == 6:
                    dst = b6
                elif q == 7:
                    dst = b7
                tl.store(dst + at, y, mask=mask)
        mine = b0
        if RANK == 1:
            mine = b1
        elif RANK == 2:
            mine = b2
        elif RANK == 3:
            mine = b3
        elif RANK == 4:
            mine = b4
        elif RANK == 5:
            mine = b5
        elif RANK == 6:
            mine = b6
        elif RANK == 7:
            mine = b7
        bits = mine.to(tl.pointer_type(IT))
        for row in range(pid, M, step):
            acc = tl.zeros((BLOCK,), dtype=tl.float32)
            for q in tl.static_range(WORLD):  # every rank's rows in rank order, once all there
                src = bits + slot_off + q * region + row * N + n
                v = tl.load(src, mask=mask, other=0, volatile=True)
                while tl.max((v == MARK).to(tl.int32), axis=0) > 0:
                    v = tl.load(src, mask=mask, other=0, volatile=True)
                acc += v.to(dt, bitcast=True).to(tl.float32)
                tl.store(src, tl.full((BLOCK,), MARK, IT), mask=mask)  # empty for the slot's next use
            x = tl.load(x_ptr + row * s_x + n, mask=mask, other=0.0)
            x = (x.to(tl.float32) + acc.to(dt).to(tl.float32)).to(dt)
            tl.store(xo_ptr + row * s_xo + n, x, mask=mask)
            if NORM:  # as fused.add_norm_kernel
                xf = x.to(tl.float32)
                var = tl.sum(xf * xf, axis=0) / N
                normed = xf * tl.rsqrt(var + eps)
                w = tl.load(w_ptr + n, mask=mask, other=0.0).to(tl.float32)
                if F32:
                    h = normed * w
                else:
                    h = normed.to(dt).to(tl.float32) * w
                tl.store(h_ptr + row * s_h + n, h.to(h_ptr.dtype.element_ty), mask=mask)

    return triton, push_add_norm_kernel


INT_OF = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def empty_mark(dtype: torch.dtype) -> int:
    """The empty mark's bits as the signed int of the dtype's width (-0.0: the sign bit alone)."""
    return -(1 << (torch.finfo(dtype).bits - 1))


def clear(buf: torch.Tensor) -> None:
    """Mark every element of a rank's buffer empty."""
    buf.view(INT_OF[buf.dtype]).fill_(empty_mark(buf.dtype))


def push_add_norm(ws: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float, *,
                  bufs: list[torch.Tensor], slot: int, rank: int, rows: int,
                  programs: int = 1024) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fused.add_norm of this rank's product's parts `ws` [parts, M, N] summed over the ranks (see the
    module's docstring): bufs: every rank's buffer as mapped here, in rank order (2 slots x world
    regions x `rows` rows of N; at most MAX_WORLD ranks); slot: 0 or 1, used in turn. Every rank
    calls it at the same point with the same shapes. -> (x + the sum, its norm or None)"""
    triton, kernel = _kernel()
    M, N = x.shape
    xo = torch.empty_like(x)
    h = torch.empty_like(x) if weight is not None else None
    if M == 0:
        return xo, h
    world = len(bufs)
    region = rows * N
    assert 1 <= world <= MAX_WORLD and M <= rows and bufs[0].numel() >= 2 * world * region
    assert ws.shape[1:] == (M, N) and ws.stride(2) == 1 and x.stride(1) == 1 and x.dtype in INT_OF
    block = max(16, 1 << (N - 1).bit_length())
    b = [*bufs, *bufs[:1] * (MAX_WORLD - world)]
    kernel[(min(M, programs),)](ws, x, weight if weight is not None else x, xo, h if h is not None else x, *b, M, N,
                                slot * world * region, region, eps, ws.stride(0), ws.stride(1), x.stride(0),
                                xo.stride(0), h.stride(0) if h is not None else 0, RANK=rank, WORLD=world,
                                PARTS=ws.shape[0], NORM=weight is not None, F32=x.dtype == torch.float32,
                                BLOCK=block, MARK=empty_mark(x.dtype),
                                IT=getattr(triton.language, str(INT_OF[x.dtype]).removeprefix("torch.")),
                                num_warps=fused.norm_warps(block, tp=True))  # (add_norm's on a rank: the same order)
    return xo, h
