"""What every int4 / int8 kernel shares, CPU (stage_node.kernels.quant) and CUDA
(stage_node.kernels.gpu_quant): the quantized matrix's interface and the grids weights are rounded to.

  * int4: 4-bit weights in groups of GROUP_INT4 along the input, each group with a bf16 scale and zero
    point: w = (q - 8) * scale + zero, q in 0..15 (llama.cpp's Q4_1 grid);
  * int8: one bf16 scale per output channel (absmax / 127): w = q * scale, q in -127..127.

Scales and zero points are rounded to bf16 (the kernels take them so) before the weights are
quantized against them, so the grid the weights are rounded to is the one the kernels use. Each
device then packs the same integers and scales its own way.
"""
from __future__ import annotations

import torch

GROUP_INT4 = 32  # int4: weights per scale and zero point, along the input (Q4_1's block)


class QuantError(ValueError):
    """A format this node cannot run, or its library missing."""


class QuantMatrix:
    """A quantized [out, in] weight: `m(x)` is x @ W.T for x [rows, in]."""

    format = ""

    def __init__(self, out_features: int, in_features: int):
        self.shape = (out_features, in_features)

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def nbytes(self) -> int:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def bf16_at_least(x: torch.Tensor) -> torch.Tensor:
    """x (float32, >= 0, finite) rounded to a bf16 value no smaller than it. (The next bf16 up of a
    positive one is its bits + 1: integer ops, which every device has for bf16's bits.)"""
    y = x.to(torch.bfloat16)
    up = (y.view(torch.int16) + 1).view(torch.bfloat16)
    return torch.where(y.float() < x, up, y)


def int8_grid(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [out, in] float -> (q int8 [out, in], scales bf16 [out]): w ~ q * scale."""
    w = w.float()
    scales = bf16_at_least((w.abs().amax(1) / 127.0).clamp(min=1e-30))  # [out] bf16
    q = (w / scales.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scales


def check_int4_shape(out: int, inp: int, group: int = GROUP_INT4) -> None:
    """The int4 shapes every kernel takes (the same rule on each device: a shape runs wherever it is placed)."""
    if inp % group or out % 16:
        raise QuantError(f"int4 needs matrices whose input size is a multiple of {group} and output size a "
                         f"multiple of 16 (the kernel's packing), got {out} x {inp}: use --quantize int8")


def int4_grid(w: torch.Tensor, group: int = GROUP_INT4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w: [out, in] float -> (q [out, in] float32 in 0..15, scale, zero bf16 [out, in // group]):
    w ~ (q - 8) * scale + zero, each weight the nearest level of its group."""
    out, inp = w.shape
    check_int4_shape(out, inp, group)
    g = w.float().reshape(out, inp // group, group)
    lo, hi = g.amin(-1), g.amax(-1)                                      # [out, groups]
    scale = bf16_at_least(((hi - lo) / 15.0).clamp(min=1e-30))
    zero = (lo + 8.0 * scale.float()).to(torch.bfloat16)
    q = ((g - zero.float()[..., None]) / scale.float()[..., None] + 8.0).round().clamp(0, 15)
    return q.reshape(out, inp), scale, zero


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The float32 [out, in] matrix of an int4 grid (q [out, in], scale and zero [out, groups])."""
    out, inp = q.shape
    groups = scale.shape[1]
    wq = (q.float().reshape(out, groups, -1) - 8.0) * scale.float()[..., None] + zero.float()[..., None]
    return wq.reshape(out, inp)
