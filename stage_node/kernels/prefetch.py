"""Weights into the GPU's L2 cache ahead of their product, while the ranks of a tensor-parallel stage
wait on each other (issue 36).

A `--tp` rank's one-row decode step is its products, which stream the weights from HBM, and two
all-reduces a layer (about 9 us each on two H100s), during which HBM sits idle. `prefetch_l2` asks
for the first bytes of the next product's matrix to be brought into L2 just before an all-reduce:
one launch of Hopper's bulk prefetch (`cp.async.bulk.prefetch.L2`, sm_90+; fire and forget, no
completion to wait for), so the product that follows finds them there. It changes no value: the
same kernels compute the same bits, in the eager forward and inside CUDA graphs alike.

`LOGICPIPE_L2_PREFETCH_MIB` (a float, default PREFETCH_MIB; 0: off) bounds the bytes a call asks for;
the benches set it to compare. A GPU older than sm_90, a quantized or non-contiguous matrix, or a
kernel that fails to build: nothing is prefetched (the last logged once).
"""
from __future__ import annotations

import functools
import logging
import os

import torch

log = logging.getLogger(__name__)

PREFETCH_MIB = 24.0  # about the bytes HBM could move while two H100s' one-shot all-reduce and the add-norm run
SUB_BYTES = 4096  # one bulk prefetch a lane; 32 lanes a program (128 KiB)


def prefetch_bytes() -> int:
    """The most bytes one call asks for (LOGICPIPE_L2_PREFETCH_MIB, else PREFETCH_MIB)."""
    return int(float(os.environ.get("LOGICPIPE_L2_PREFETCH_MIB", PREFETCH_MIB)) * (1 << 20))


LIMIT = prefetch_bytes()  # read once, at import: a step's calls cost no environment look-up


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def prefetch_l2_kernel(w_ptr, nbytes, ESIZE: tl.constexpr, SUB: tl.constexpr):
        # lane l of program p: bytes [(32 p + l) SUB, + SUB) of w (whole 16-byte units) into L2
        lane = tl.arange(0, 32)
        start = (tl.program_id(0).to(tl.int64) * 32 + lane) * SUB
        size = tl.minimum(nbytes - start, SUB)
        size = (size // 16 * 16).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [w_ptr + start // ESIZE, size], dtype=tl.int32, is_pure=False, pack=1)

    return triton, prefetch_l2_kernel


@functools.cache
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


_failed = False


def prefetch_l2(w, limit: int | None = None) -> None:
    """Ask for the first min(bytes of w, limit) of matrix w (contiguous, 16-byte aligned, on CUDA) to be
    brought into L2; returns at once (the copy goes on after the kernel ends). A no-op where it
    cannot run (module docstring)."""
    global _failed
    limit = LIMIT if limit is None else limit
    if (_failed or limit <= 0 or not isinstance(w, torch.Tensor) or w.device.type != "cuda"
            or not w.is_contiguous() or w.data_ptr() % 16 or not _hopper(w.device.index or 0)):
        return
    nbytes = min(w.numel() * w.element_size(), limit)
    triton, kernel = _kernel()
    try:
        kernel[(triton.cdiv(nbytes, 32 * SUB_BYTES),)](w, nbytes, ESIZE=w.element_size(), SUB=SUB_BYTES, num_warps=1)
    except Exception as exc:  # noqa: BLE001 — a hint only: the products run as before without it
        _failed = True
        log.warning("the L2 prefetch kernel failed (%s): no prefetch", exc)
