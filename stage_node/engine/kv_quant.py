"""8-bit KV (issue 39 item 2): `--kv-dtype int8 | fp8` holds a stage's keys and values in one byte
an element, each (token, KV head) vector with 4 bytes of scale beside it.

- int8: 254 steps over the vector's own range [min, max], centred on its mid: mid = bf16((max + min) / 2),
  scale = max(max - mid, mid - min) / 127 rounded up to a bf16, q = round((x - mid) / scale) in
  [-127, 127]; x ~ mid + q * scale (error at most scale / 2 an element). Scale and mid are two bfloat16
  in one 32-bit word (`pack`: mid high, scale low; the pool's scales are int32), so a vector costs the
  same 4 bytes as a float32 scale did. Against the symmetric grid before (scale = max|x| / 127, no mid):
  Gaussian vectors of 16 / 64 / 128 round with relative RMS error 0.0042 / 0.0054 / 0.0060 instead of
  0.0047 / 0.0060 / 0.0065 (max - min is about 0.9 of 2 max|x|), a vector off zero much finer; the tiny MoE families' greedy agreement with
  float KV rose from 0.934 / 0.949 to above 0.95 (docs/engine.md#8-bit-kv). The bf16 rounding of mid
  and scale costs nothing systematic: the values are rounded against the stored mid and scale.
- fp8: torch.float8_e4m3fn (CUDA's 8-bit float; its storage and conversions work on a CPU too),
  scale = max|x| / 448 (e4m3's largest finite value), q = fp8(x / scale); relative error at most
  2^-4 an element (3 mantissa bits), at least the scale's 2^-9 near zero. Its error is 4 to 5 times
  int8's on a head's vector (relative RMS 0.022 against 0.0047 on Gaussian vectors), whatever the
  scale: it agrees with float KV on fewer greedy tokens (docs/engine.md#8-bit-kv), so int8 is the
  8-bit KV for every device; the attention paths dequantize either the same way.
- auto: the compute dtype (no scales), as before.

Rotation: before quantizing, each key and value vector is rotated by a fixed orthogonal matrix R (a
randomized Hadamard transform: fixed signs, then Walsh-Hadamard in blocks of the largest power of two
dividing the head dim, scaled to be orthonormal: `rotate`), and attention uses q R for the scores and
un-rotates its output (`unrotate`): q . k = (q R) . (k R) and sum_j p_j v_j = (sum_j p_j v_j R) R^T,
so float attention would give the same result; what changes is the rounding. A real model's keys
and values have a few channels much larger than the rest (the default model: a channel's RMS up to
4.7x the mean, max|x| / RMS of a vector 3.5 to 5.5), and one scale per vector spends the 8 bits on
them; rotated, every element is a mix of all channels and the vector's max|x| / RMS falls to a
Gaussian's (about 2.5): int8's relative error 0.006 to 0.013 -> 0.0053 to 0.0059 on the default
model's keys and values (`bench.kv_quant --parts error`). On a CPU by butterflies, elementwise adds
(a row's bits never depend on what shares its step); on CUDA one product with R. Only int8 is
rotated: fp8's error is relative to each element, which a rotation does not change. Multi-head latent
attention's rows (one part: the values are a slice of the keys' row) are not rotated.

Where it happens: keys and values are quantized as a step writes them to the pool (`quantize`, the
row's own vector only, so a row's stored bits never depend on what shares its step) and dequantized
as attention reads them (`dequantize`, in the compute dtype, or directly by cpu_quant.c's
`lp_attend` on a CPU: stage_node.model.shard). The scale layout is the pool's without its last
axis: [layers, parts (k, v), kv_heads, slots] float32 (`KVPool.scales`).
"""
from __future__ import annotations

import functools
import math

import torch

from logicpipe.formats import KV_FORMATS
from logicpipe.stage_node.kernels import cpu_native

KV_DTYPES = ("auto", *KV_FORMATS)  # --kv-dtype
STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
QMAX = {"int8": 127.0, "fp8": 448.0}  # the largest magnitude each format stores
SCALE_DTYPE = {"int8": torch.int32, "fp8": torch.float32}  # int8: (scale, mid) as two bfloat16 (`pack`)
SCALE_BYTES = 4  # bytes of one (token, head) vector's scale (int8: its scale and mid)


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


def _bf16_up(x: torch.Tensor) -> torch.Tensor:
    """x (float32, >= 0, finite) rounded up to the nearest bfloat16 value, as float32."""
    return ((x.view(torch.int32) + 0xFFFF) & -65536).view(torch.float32)


def _bf16_near(x: torch.Tensor) -> torch.Tensor:
    """x (float32) rounded to the nearest bfloat16 value, as float32."""
    return x.to(torch.bfloat16).to(torch.float32)


def pack(scale: torch.Tensor, mid: torch.Tensor) -> torch.Tensor:
    """int8's (scale, mid) [...] float32, both bfloat16 values -> [...] int32: mid's bits high, scale's low."""
    return (mid.view(torch.int32) & -65536) | ((scale.view(torch.int32) >> 16) & 0xFFFF)


def unpack(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[...] int32 (`pack`) -> (scale, mid) [...] float32."""
    return (packed << 16).view(torch.float32), (packed & -65536).view(torch.float32)


def quantize(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] (floats) -> (values [..., d] in the storage dtype, scales [...]), each vector on its own.
    int8: scales int32, the vector's (scale, mid) as two bfloat16 (`pack`), x ~ mid + q * scale (an
    all-zero vector: 0, 0, values 0); fp8: scales float32, x ~ q * scale."""
    if kv_dtype == "int8" and x.device.type == "cpu" and x.shape[-1] and (native := cpu_native.kv_int8(x)):
        return native  # the same bits as torch_quantize, in one call
    return torch_quantize(x, kv_dtype)


def torch_quantize(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize` by torch's operations (CUDA; a CPU without the native library)."""
    x = x.float()
    if kv_dtype == "int8":  # 254 steps over [min, max] of the vector, centred on mid
        lo, hi = torch.aminmax(x, dim=-1)  # [...]
        mid = _bf16_near((hi + lo) * 0.5)
        scale = _bf16_up(torch.maximum(hi - mid, mid - lo) / QMAX["int8"])  # rounded up: |x - mid| <= 127 scale
        # (scale 0: every element is mid, x - mid is 0 whatever it is divided by)
        q = torch.round((x - mid[..., None]) / scale.clamp_min(1e-30)[..., None]).clamp_(-127, 127).to(torch.int8)
        return q, pack(scale, mid)
    scale = x.abs().amax(-1) / QMAX[kv_dtype]  # [...]
    div = torch.where(scale > 0, scale, torch.ones_like(scale))[..., None]
    return (x / div).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn), scale


@functools.lru_cache(maxsize=None)
def _signs(d: int) -> tuple[float, ...]:
    """The rotation's fixed signs for head dim d (a 32-bit LCG's top bit: the same in every process)."""
    out, x = [], 12345
    for _ in range(d):
        x = (1103515245 * x + 12345) & 0xFFFFFFFF
        out.append(-1.0 if x >> 31 else 1.0)
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _signs_tensor(d: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(_signs(d), dtype=torch.float32, device=device)


def signs_on(x: torch.Tensor) -> torch.Tensor:
    """The signs on x's device, made once (a CUDA graph's warm-up run makes them before its capture)."""
    return _signs_tensor(x.shape[-1], x.device)


def _hadamard(x: torch.Tensor) -> torch.Tensor:
    """x [..., d] float32 -> its Walsh-Hadamard transform in blocks of b (the largest power of two dividing d),
    scaled by 1 / sqrt(b): orthonormal and its own inverse. Butterflies (elementwise adds): a row's result
    never depends on the other rows."""
    d = x.shape[-1]
    b = d & -d
    lead = x.shape[:-1]
    h = 1
    while h < b:
        y = x.reshape(*lead, d // (2 * h), 2, h)
        x = torch.stack((y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]), -2)
        h *= 2
    return x.reshape(*lead, d) * (1.0 / math.sqrt(b))


def _butterflies(x: torch.Tensor) -> torch.Tensor:
    return _hadamard(x.float() * signs_on(x))


@functools.lru_cache(maxsize=None)
def rotation(d: int, device: torch.device) -> torch.Tensor:
    """R [d, d] float32 on `device` (made once: a CUDA graph's warm-up run makes it before its capture)."""
    return _butterflies(torch.eye(d)).to(device)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., d] -> x R in float32 (R: fixed signs, then `_hadamard`), what an int8 pool stores and what
    attention's queries are multiplied by. On a CPU by butterflies (a row's bits never depend on the other
    rows); on CUDA one float32 product with R (one kernel where the butterflies launch 20-odd small ones;
    CUDA's 8-bit KV forward runs --batch-invariant off anyway)."""
    if x.is_cuda:
        return x.float() @ rotation(x.shape[-1], x.device)
    native = cpu_native.rotate(x, signs_on(x), inverse=False) if x.device.type == "cpu" else None
    return _butterflies(x) if native is None else native


def unrotate(y: torch.Tensor) -> torch.Tensor:
    """y [..., d] -> y R^T in y's dtype (computed in float32): attention's output over rotated values back in
    the model's basis."""
    if y.is_cuda:
        return (y.float() @ rotation(y.shape[-1], y.device).T).to(y.dtype)
    native = cpu_native.rotate(y, signs_on(y), inverse=True) if y.device.type == "cpu" else None
    return (_hadamard(y.float()) * signs_on(y) if native is None else native).to(y.dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(values [..., d], scales [...]) -> [..., d] in `dtype`, in float32 first: int8 mid + values x scale
    (`unpack`), fp8 values x scale."""
    if q.dtype == torch.int8:
        s, mid = unpack(scale)
        return (q.to(torch.float32) * s[..., None] + mid[..., None]).to(dtype)
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
