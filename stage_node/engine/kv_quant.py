"""8-bit KV (issue 39 item 2): `--kv-dtype int8 | fp8` holds a stage's keys and values in one byte
an element, each (token, KV head) vector with its own float32 scale beside it.

- int8: symmetric, scale = max|x| / 127 over the head's vector, q = round(x / scale) in [-127, 127];
  x ~ q * scale (error at most scale / 2 an element).
- fp8: torch.float8_e4m3fn (CUDA's 8-bit float; its storage and conversions work on a CPU too),
  scale = max|x| / 448 (e4m3's largest finite value), q = fp8(x / scale); relative error at most
  2^-4 an element (3 mantissa bits), at least the scale's 2^-9 near zero.
- auto: the compute dtype (no scales), as before.

Where it happens: keys and values are quantized as a step writes them to the pool (`quantize`, the
row's own vector only, so a row's stored bits never depend on what shares its step) and dequantized
as attention reads them (`dequantize`, in the compute dtype, or directly by cpu_quant.c's
`lp_attend` on a CPU: stage_node.model.shard). The scale layout is the pool's without its last
axis: [layers, parts (k, v), kv_heads, slots] float32 (`KVPool.scales`).
"""
from __future__ import annotations

import torch

from logicpipe.formats import KV_FORMATS

KV_DTYPES = ("auto", *KV_FORMATS)  # --kv-dtype
STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
QMAX = {"int8": 127.0, "fp8": 448.0}  # the largest magnitude each format stores
SCALE_DTYPE = torch.float32
SCALE_BYTES = 4  # bytes of one (token, head) vector's scale


def check_kv_dtype(kv_dtype: str) -> None:
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"--kv-dtype {kv_dtype[:40]!r}: use one of {', '.join(KV_DTYPES)}")


def quantized(kv_dtype: str) -> bool:
    """Whether `kv_dtype` stores 8-bit values with scales (not the compute dtype)."""
    check_kv_dtype(kv_dtype)
    return kv_dtype != "auto"


def storage_dtype(kv_dtype: str, compute: torch.dtype) -> torch.dtype:
    """The dtype of the pool's values."""
    return STORAGE[kv_dtype] if quantized(kv_dtype) else compute


def vector_bytes(kv_dtype: str, compute: torch.dtype, elements: int) -> int:
    """Bytes one stored vector of `elements` (a token's key or value of one head) costs, its scale included."""
    if not quantized(kv_dtype):
        return elements * compute.itemsize
    return elements + SCALE_BYTES


def quantize(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] (floats) -> (values [..., d] in the storage dtype, scales [...] float32), each
    vector on its own (an all-zero vector: scale 0, values 0)."""
    x = x.float()
    scale = x.abs().amax(-1) / QMAX[kv_dtype]  # [...]
    div = torch.where(scale > 0, scale, torch.ones_like(scale))[..., None]
    if kv_dtype == "int8":
        q = torch.round(x / div).clamp_(-127, 127).to(torch.int8)
    else:
        q = (x / div).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(values [..., d], scales [...]) -> [..., d] in `dtype`: values x scale, in float32 first."""
    return (q.to(torch.float32) * scale[..., None]).to(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 values as their bytes (torch's CPU index_copy_ / index_select have no float8 kernels)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def index_copy_(dst: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor) -> None:
    """dst.index_copy_(dim, index, src) for any KV storage dtype."""
    as_bytes(dst).index_copy_(dim, index, as_bytes(src))


def index_select(t: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """t.index_select(dim, index) for any KV storage dtype."""
    return as_bytes(t).index_select(dim, index).view(t.dtype)
