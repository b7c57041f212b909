"""The forward's math: matrix products that give every row the same result whatever else is in the
batch, HF's RMSNorm, and the causal mask.

Why the matrix products are split by row kind. A BLAS picks its kernel by the shape of the
product, and different kernels round differently, so a row's result can depend on how many other
rows share the step. Measured on MKL (torch's CPU BLAS): `x @ w.T` is the same for every row
count from 4 to 512 but different for 1, 2 and 3; `w @ x.T` (x a transposed view) is the same
for 4 to 8 rows, and for those sizes reads the weights close to the memory's speed (8 rows cost
1.2x one row, where `x @ w.T` costs 2.2x). So:
  * decode rows (generated tokens, candidates; the rows that are sampled) go through `w @ x.T` in
    chunks of 4 to 8 rows, padded up to 4;
  * prompt rows go through `x @ w.T` with at least 4 rows.
A row's numbers then depend only on its own kind, never on how a step was batched: a request
gives the same tokens alone or among 64 others, and in a replay its generated tokens are
recomputed by the kernel that first computed them.

On a GPU, decode is bound by kernel launches rather than by reading weights, and one cuBLAS call
per product is what counts: `linear` is then plain `x @ w.T` for every row (cuBLAS may still pick
another kernel for another row count, so the same-tokens-in-any-batch property is the CPU's).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from logicpipe.stage_node.quant import QuantMatrix

MIN_ROWS = 4   # below this both kernels switch to another kind of product
DECODE_CHUNK = 8  # `w @ x.T` gives the same rows for 4..8 rows


@dataclass(frozen=True)
class Rows:
    """Which rows of a packed batch are decode rows (the rest are prompt rows)."""

    decode: torch.Tensor | None   # row indices, int64; None with `all_decode` / no decode rows
    prompt: torch.Tensor | None
    all_decode: bool = False
    all_prompt: bool = False

    @classmethod
    def split(cls, is_decode: list[bool], device) -> "Rows":
        if all(is_decode):
            return cls(None, None, all_decode=True)
        if not any(is_decode):
            return cls(None, None, all_prompt=True)
        idx = torch.arange(len(is_decode), device=device)
        mask = torch.tensor(is_decode, device=device)
        return cls(idx[mask], idx[~mask])


DECODE_ROWS = Rows(None, None, all_decode=True)
PROMPT_ROWS = Rows(None, None, all_prompt=True)


def _pad(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x if x.shape[0] >= rows else torch.cat([x, x[-1:].expand(rows - x.shape[0], -1)])


def decode_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x: [M, in] @ w: [out, in].T -> [M, out], as `w @ x.T` on chunks of 4 to 8 rows (CPU)."""
    if x.is_cuda:
        return F.linear(x, w)
    m = x.shape[0]
    if m <= DECODE_CHUNK:
        return torch.mm(w, _pad(x, MIN_ROWS).t()).t()[:m].contiguous()
    n = -(-m // DECODE_CHUNK)  # chunks of equal size, each within [4, 8]
    bounds = [m * i // n for i in range(n + 1)]
    return torch.cat([torch.mm(w, x[a:b].t()).t() for a, b in zip(bounds, bounds[1:])])


def prompt_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x: [M, in] @ w: [out, in].T -> [M, out], as `x @ w.T` with at least 4 rows."""
    m = x.shape[0]
    return F.linear(_pad(x, MIN_ROWS), w)[:m] if m < MIN_ROWS else F.linear(x, w)


def linear(x: torch.Tensor, w, b: torch.Tensor | None, rows: Rows) -> torch.Tensor:
    """x: [T, in], w: [out, in] (+ b: [out]) -> [T, out], each row by its kind's kernel (a
    quantized weight by its own kernel, see `stage_node.quant`)."""
    if isinstance(w, QuantMatrix):
        out = w(x)
        return out if b is None else out + b
    if x.is_cuda:
        return F.linear(x, w, b)
    if rows.all_decode:
        out = decode_mm(x, w)
    elif rows.all_prompt:
        out = prompt_mm(x, w)
    else:
        out = x.new_empty(x.shape[0], w.shape[0])
        out[rows.decode] = decode_mm(x[rows.decode], w)
        out[rows.prompt] = prompt_mm(x[rows.prompt], w)
    return out if b is None else out + b


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalise in float32, scale in the model dtype. x: [T, hidden]"""
    # F.rms_norm is one fused op, bit-identical in float32 to HF's
    # `x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)` (then scaled in the model dtype)
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def causal_mask(start_pos: int, n: int, device) -> torch.Tensor | None:
    """Bool mask [n, start_pos + n] for new rows at start_pos.., or None where SDPA needs none."""
    if n == 1 or start_pos == 0:
        return None  # one row sees everything; a fresh prefill uses is_causal
    keys = torch.arange(start_pos + n, device=device)
    return keys[None, :] <= torch.arange(start_pos, start_pos + n, device=device)[:, None]
