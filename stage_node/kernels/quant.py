"""Quantized linear weights for a stage started with `--quantize int4|int8|nf4|fp4`.

Each of a layer's matrices (fused q/k/v, o, fused gate/up, down) is quantized right after it is
read and fused, so the shard never holds more than one layer in float at a time. Embeddings and
norms stay in the compute dtype; the LM head stays there too, except beside int4 and int8, whose
stages hold it in int8 (`HEAD_FORMAT`) as llama.cpp's Q4_1 files do (Q8_0): in float32 it is a
third of a small model's decode time.

Kernels, by format and device (chosen by `python -m bench.quant_bench --kernels`, docs/engine.md):
- **int4 on the CPU**: 4-bit weights in groups of 32 along the input, each group with a scale and a
  zero point (w = (q - 8) * scale + zero: llama.cpp's Q4_1 grid), by one of two kernels:
  * native (cpu_quant.c, built by the host's gcc at first use: cpu_native): as llama.cpp does, each
    row of activations is quantized in blocks of 32 (one scale a block, and the block's sum for the
    zero-point term), every group is an integer dot product (AVX2 madd; NEON; or portable C), scaled
    and summed in float32. The blocks are int16, not llama.cpp's int8: as fast here, and int8 lost 3%
    of the default model's greedy agreement. Threads (torch's count) split output features only.
  * torch's weight-only packed kernel (`_weight_int4pack_mm_for_cpu`), bf16 activations: fast
    with AVX-512 only (issue 35: on an AVX2-only EPYC it was 0.38x llama.cpp).
- **int8 on the CPU**: int8 weights, one scale per output channel, by the native kernel (activations
  as above) or torch's `_weight_int8pack_mm` (bf16 activations; input sizes multiples of 8).
  A process picks one kernel per format at start (`choose_cpu_kernel`): the faster on a 1024 x 1024
  product of 1 and 8 rows, logged with both times; LOGICPIPE_CPU_KERNEL=native|torch forces one,
  and without a C compiler it is torch's. The profile (stage_node.profile) measures the chosen one.
  Activations in int16 blocks round each value by at most half a step (block max / 65534), torch's
  bf16 by 2^-9 of it (tests/unit/test_cpu_kernels.py bounds both).
- **nf4 / fp4**: bitsandbytes 4-bit (blocks of 64 weights, one absmax each), on the CPU and CUDA;
  a stage tries a small product at start-up and refuses the format, saying why, where it fails.
- **int4 and int8 on CUDA** (stage_node.kernels.gpu_quant; no bitsandbytes, so a Jetson Orin's sm_87
  runs them): the same grids, repacked at load (int4 group-major, [K/32, N, 16] bytes, each byte two
  weights 16 apart in a group; scale and zero point as bf16 bits in one int32 a group), multiplied by
  Triton kernels. int4's sums are exact (activations rounded per group of 32 to 11-bit integers
  times a power of two): one row by dp4a on the CUDA cores, more rows by tensor-core tiles, the same
  bits; int8 dequantizes in registers and multiplies on the tensor cores, float32 accumulation, 64-row
  tiles and up. They run in the fused layer loop (stage_node.fused) and in CUDA graphs (no host
  sync). A stage tries a small product at start-up (`gpu_quant.trial`) and refuses the format,
  saying why, where it fails (no triton; a GPU Triton cannot compile for).

The grids live in quant_grid: scales and zero points are rounded to bf16 (the kernels take them so)
before the weights are quantized against them, so the grid the weights are rounded to is the one
every kernel uses, on either device.

Batch invariance. The int4 and int8 kernels (native and torch's) compute each row of a product on its
own, in an order that does not depend on the number of rows (checked for 1 to 64 rows by
tests/unit/test_quant.py): a request gives the same greedy tokens alone or among others, as the
float path does (`stage_node.ops`). The CUDA kernels follow the float CUDA path's rule
(stage_node.kernels.invariant: parts of K fixed per matrix, added in order; int4's per-group sums
exact whatever the tile or instruction, int8's 16-wide slices of K in order in tiles of 64 rows and
up; rows 1..n in Triton's interpreter by tests/unit/test_gpu_quant.py, any row at any place on the
GPU by bench/gpu_quant.py --part check). bitsandbytes' nf4/fp4 does not promise that: one row takes its
matrix-vector kernel, several rows a dequantized product, so greedy tokens on such a stage are
deterministic for a given batch but may differ between a request alone and one among others.
"""
from __future__ import annotations

import functools
import logging
import os
import time

import torch

from logicpipe.stage_node.kernels import cpu_native, gpu_quant
from logicpipe.stage_node.kernels.quant_grid import (
    GROUP_INT4,
    QuantError,
    QuantMatrix,
    check_int4_shape,
    int4_grid,
    int8_grid,
)

log = logging.getLogger(__name__)

FORMATS = ("none", "int4", "int8", "nf4", "fp4")
BLOCK_4BIT = 64       # bitsandbytes' block
HEAD_FORMAT = {"int4": "int8", "int8": "int8"}  # the LM head of a stage in these formats; others keep it float


def check_format(fmt: str, device: str, *, trial=None) -> None:
    """Raise QuantError unless `fmt` can run on `device` here. int4 / int8 on CUDA need triton and a
    small product right on the device (`trial`, default `gpu_quant.trial` once per process, format
    and device). nf4 / fp4 need bitsandbytes importable,
    on a CUDA device its CUDA library loaded, and a small product of the format right on the device
    (`trial`, default `trial_4bit` once per process, format and device). Whether bitsandbytes runs on
    a GPU is known only by trying: its aarch64 wheels hold kernels for sm_75, sm_80 and sm_90 only,
    built against server Arm's CUDA, and a Jetson Orin is sm_87 on JetPack's CUDA. A stage refuses at
    start-up, naming the GPU's compute capability, rather than failing at its first step."""
    if fmt not in FORMATS:
        raise QuantError(f"unknown weight format {fmt!r}: use one of {', '.join(FORMATS)}")
    kind = torch.device(device).type
    if fmt in ("int4", "int8") and kind != "cpu":
        if kind != "cuda":
            raise QuantError(f"--quantize {fmt} runs on the CPU and on CUDA only, not on {kind}")
        reason = (trial or _trial_triton_once)(fmt, device)
        if reason:
            raise QuantError(f"--quantize {fmt} cannot run on {device_words(device)}: {reason} "
                             "(--quantize nf4 takes bitsandbytes' kernels instead, or run the stage on the CPU)")
    if fmt in ("nf4", "fp4"):
        try:
            import bitsandbytes
        except Exception as exc:  # not installed, or a build that fails as it loads
            raise QuantError(f"--quantize {fmt} needs bitsandbytes: pip install 'logicpipe[quant]' "
                             f"(or bitsandbytes>=0.45) ({first_line(exc)})") from exc
        reason = bnb_library_error(bitsandbytes, device) or (trial or _trial_once)(fmt, device)
        if reason:
            raise QuantError(f"bitsandbytes {getattr(bitsandbytes, '__version__', '?')} cannot run {fmt} on "
                             f"{device_words(device)}: {reason}")


def first_line(exc: BaseException | str, limit: int = 200) -> str:
    """An error's first non-empty line, cut at `limit` characters (bitsandbytes' run to a page)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def device_words(device: str) -> str:
    """'this cpu', or a GPU's name and compute capability: 'Orin (compute capability 8.7, sm_87)'."""
    d = torch.device(device)
    if d.type != "cuda":
        return f"this {d.type}"
    major, minor = torch.cuda.get_device_capability(d)
    return f"{torch.cuda.get_device_name(d)} (compute capability {major}.{minor}, sm_{major}{minor})"


def bnb_library_error(bnb, device: str) -> str:
    """Why bitsandbytes' CUDA library did not load, for a CUDA device ('' when it did, or on the CPU):
    where it fails, bitsandbytes keeps a stand-in that raises a page of advice at the first call."""
    if torch.device(device).type != "cuda":
        return ""
    lib = getattr(getattr(bnb, "cextension", None), "lib", None)
    if type(lib).__name__ == "ErrorHandlerMockBNBNativeLibrary":
        return f"its CUDA library did not load ({first_line(getattr(lib, 'error_msg', '') or 'no reason given')})"
    return ""


def trial_4bit(fmt: str, device: str) -> str:
    """'' when a 128 x 64 matrix in `fmt` multiplies 1 row and 3 rows (bitsandbytes' two paths) right
    on `device`, else why not: the error's first line, or how far the product is off (a kernel that
    never ran leaves zeros or garbage; 4-bit rounding is about 0.1 of the norm)."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(128, 64, generator=g), torch.randn(3, 64, generator=g)
    dtype = torch.float16 if torch.device(device).type == "cuda" else torch.float32
    try:
        m = Bnb4bit(w.to(device, dtype), fmt)
        for rows in (1, 3):
            ref = x[:rows] @ w.T
            off = float((m(x[:rows].to(device, dtype)).float().cpu() - ref).norm() / ref.norm())
            if not off < 0.5:  # nan too
                return f"a {rows}-row product of a {fmt} matrix is off by {off:.2g} of its norm"
    except Exception as exc:  # a CUDA error ("no kernel image is available ..."), or bitsandbytes' own
        return first_line(exc)
    return ""


_trial_once = functools.cache(trial_4bit)
_trial_triton_once = functools.cache(gpu_quant.trial)  # int4 / int8 on CUDA


# torch 2.13's _weight_int8pack_mm reads past its rows (a segmentation fault) for an input size not a multiple of
# 8, and on an AVX-512 CPU also of 16 with more than one row (K = 72, 17 rows; 2026-11-28, an AMD EPYC VM)
TORCH_INT8_K = 16


class Int8Packed(QuantMatrix):
    """int8 weights, one bf16 scale per output channel (absmax / 127), by `kernel` ("native":
    cpu_quant.c; "torch": `_weight_int8pack_mm`; None: this CPU's choice, `cpu_kernel`)."""

    format = "int8"

    def __init__(self, w: torch.Tensor, kernel: str | None = None):
        super().__init__(*w.shape)
        self.kernel = kernel or cpu_kernel("int8")
        if self.kernel == "torch" and kernel is None and w.shape[1] % TORCH_INT8_K and cpu_native.library() is not None:
            self.kernel = "native"  # (this CPU's choice, but a matrix torch's kernel cannot take: the other one)
        q, scales = int8_grid(w)
        self._scales, self._q = scales, q
        if self.kernel == "native":
            self._q, self._scales = cpu_native.pack_int8(q, scales)
            self._native = cpu_native.library().lp_int8_mm
            self._ptrs = (self._q.data_ptr(), self._scales.data_ptr())  # the tensors stay: they own the memory
        elif self.shape[1] % TORCH_INT8_K:  # torch 2.13's kernel reads past such rows (a segmentation fault)
            raise QuantError(f"int8 by torch's kernel needs an input size that is a multiple of {TORCH_INT8_K}, got "
                             f"{self.shape[1]}")
        self._mm = torch._weight_int8pack_mm  # the direct binding: torch.ops.aten.* boxes each call (+2.5 µs)

    def grid(self) -> torch.Tensor:
        """The scale of each output channel, float32 [out]: w = q * scale."""
        return self._scales.float()[: self.shape[0]]

    @property
    def nbytes(self) -> int:
        return self._q.numel() + self._scales.numel() * self._scales.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "native":
            out = cpu_native.call(self._native, x, *self._ptrs, self.shape[0])
            return out if x.dtype == torch.float32 else out.to(x.dtype)
        return self._mm(x.to(torch.bfloat16), self._q, self._scales).to(x.dtype)


class Int4Packed(QuantMatrix):
    """4-bit weights in groups of GROUP_INT4 along the input, each group with a bf16 scale and zero
    point (w = (q - 8) * scale + zero, q in 0..15), by `kernel` ("native": cpu_quant.c; "torch":
    `_weight_int4pack_mm_for_cpu`; None: this CPU's choice, `cpu_kernel`)."""

    format = "int4"

    def __init__(self, w: torch.Tensor, group: int = GROUP_INT4, kernel: str | None = None):
        out, inp = w.shape
        check_int4_shape(out, inp, group)  # the same rule for every kernel: a shape runs whichever is chosen
        super().__init__(out, inp)
        self.kernel = kernel or cpu_kernel("int4")
        q, scale, zero = int4_grid(w, group)
        self.group = group
        if self.kernel == "native":
            self._packed, self._scale_zero = cpu_native.pack_int4(q.reshape(out, inp), scale, zero, group)
            self._native = cpu_native.library().lp_int4_mm
            self._ptrs = (self._packed.data_ptr(), self._scale_zero.data_ptr())  # the tensors stay: they own the memory
        else:
            self._scale_zero = torch.stack([scale, zero], -1).transpose(0, 1).contiguous()  # [groups, out, 2] bf16
            self._packed = torch._convert_weight_to_int4pack_for_cpu(q.reshape(out, inp).to(torch.int32), 1)
        self._mm = torch._weight_int4pack_mm_for_cpu

    def grid(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, zero) of each group, float32 [out, groups]: w = (q - 8) * scale + zero."""
        if self.kernel == "native":  # [tiles, groups, 2, 4] bf16 bits -> [out, groups, 2]
            sz = self._scale_zero.view(torch.bfloat16).float().permute(0, 3, 1, 2).reshape(-1, *self._scale_zero.shape[1:3])
            sz = sz[: self.shape[0]]
        else:
            sz = self._scale_zero.float().transpose(0, 1)
        return sz[..., 0], sz[..., 1]

    @property
    def nbytes(self) -> int:
        return self._packed.numel() * self._packed.element_size() + 2 * self._scale_zero.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "native":
            out = cpu_native.call(self._native, x, *self._ptrs, self.shape[0])
            return out if x.dtype == torch.float32 else out.to(x.dtype)
        return self._mm(x.to(torch.bfloat16), self._packed, self.group, self._scale_zero).to(x.dtype)


CPU_KERNELS = ("native", "torch")  # the int4 / int8 kernels on a CPU (LOGICPIPE_CPU_KERNEL forces one)
_chosen: dict[str, str] = {}        # format -> the kernel this process's new matrices use


def cpu_kernel(fmt: str) -> str:
    """The kernel new `fmt` matrices use in this process: chosen once (`choose_cpu_kernel`)."""
    if fmt not in _chosen:
        choose_cpu_kernel(fmt)
    return _chosen[fmt]


def set_cpu_kernel(fmt: str, kernel: str) -> None:
    """Make new `fmt` matrices of this process use `kernel` (benchmarks and tests; a stage chooses)."""
    if kernel not in CPU_KERNELS:
        raise QuantError(f"unknown CPU kernel {kernel!r}: use native or torch")
    _chosen[fmt] = kernel


def time_cpu_kernels(fmt: str, kernels: tuple[str, ...] = CPU_KERNELS, shape: tuple[int, int] = (1024, 1024),
                     rounds: int = 5) -> dict[str, float]:
    """Seconds of one 1-row product plus one 8-row product (decode and a small batch) of a [out, in]
    `shape` through each of `kernels`, best of `rounds` taken in turn (the same machine load)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=g) * 0.05
    mats = {k: quantize(w, fmt, k) for k in kernels}
    xs = [torch.randn(rows, shape[1], generator=g) for rows in (1, 8)]
    best = dict.fromkeys(kernels, float("inf"))
    for r in range(rounds + 1):  # the first round warms up
        for k, m in mats.items():
            t0 = time.perf_counter()
            for x in xs:
                m(x)
            if r:
                best[k] = min(best[k], time.perf_counter() - t0)
    return best


def choose_cpu_kernel(fmt: str, force: str | None = None) -> str:
    """Pick the int4 / int8 kernel of this process for `fmt`: `force` or $LOGICPIPE_CPU_KERNEL
    (native | torch) if set, else the faster of the two on a representative product (a few ms;
    the native one only where it builds, see cpu_native). Logged with the times."""
    force = force or os.environ.get("LOGICPIPE_CPU_KERNEL", "") or "auto"
    if force not in (*CPU_KERNELS, "auto"):
        raise QuantError(f"LOGICPIPE_CPU_KERNEL={force}: use native, torch or auto")
    native_ok = force != "torch" and cpu_native.library() is not None  # (forced torch: no build at all)
    if not native_ok:
        if force == "native":
            log.warning("%s CPU kernel: native asked for but not available; torch's", fmt)
        _chosen[fmt] = "torch"
        log.info("%s CPU kernel: torch (%s)", fmt, "forced" if force == "torch" else "native kernels unavailable")
        return "torch"
    if force == "native":
        _chosen[fmt] = "native"
        log.info("%s CPU kernel: native, %s (forced)", fmt, cpu_native.isa())
        return "native"
    times = time_cpu_kernels(fmt)
    _chosen[fmt] = min(times, key=times.get)
    log.info("%s CPU kernel: %s (1 + 8 rows of a 1024 x 1024 product with %d threads: %s; native built for %s)",
             fmt, _chosen[fmt], torch.get_num_threads(),
             ", ".join(f"{k} {t * 1e3:.2f} ms" for k, t in times.items()), cpu_native.isa())
    return _chosen[fmt]


class Bnb4bit(QuantMatrix):
    def __init__(self, w: torch.Tensor, quant_type: str):
        import bitsandbytes as bnb
        from bitsandbytes.functional import quantize_4bit

        super().__init__(*w.shape)
        self._matmul = bnb.matmul_4bit  # bound once: __call__ is on the per-token path
        self.format = quant_type
        self._dtype = w.dtype
        self._q, self._state = quantize_4bit(w.contiguous(), quant_type=quant_type, blocksize=BLOCK_4BIT)
        self._bytes = self._q.numel() * self._q.element_size() + self._state.absmax.numel() * self._state.absmax.element_size()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x.to(self._dtype), self._q.t(), quant_state=self._state).to(x.dtype)


def quantize(w: torch.Tensor, fmt: str, kernel: str | None = None) -> QuantMatrix:
    """w: [out, in] float, on its device -> the quantized matrix (int4 / int8: on CUDA by the Triton
    kernels, on the CPU by `kernel`, else this CPU's choice)."""
    if fmt in ("int4", "int8") and w.device.type == "cuda":
        return gpu_quant.quantize(w, fmt)
    if fmt == "int4":
        return Int4Packed(w, kernel=kernel)
    if fmt == "int8":
        return Int8Packed(w, kernel=kernel)
    if fmt in ("nf4", "fp4"):
        return Bnb4bit(w, fmt)
    raise QuantError(f"cannot quantize to {fmt!r}")


def tensor_bytes(x) -> int:
    """Bytes a weight takes: a tensor's storage, a quantized matrix's, a list's or a dataclass's
    (a layer's experts) in all."""
    if x is None:
        return 0
    if isinstance(x, QuantMatrix):
        return x.nbytes
    if isinstance(x, (list, tuple)):
        return sum(tensor_bytes(m) for m in x)
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (int, float)):  # a field that is not a weight (Experts.first)
        return 0
    return sum(tensor_bytes(v) for v in vars(x).values())
