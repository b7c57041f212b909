"""The native CPU kernels of the int4 and int8 formats: cpu_quant.c, built by the host's C compiler at
first use and loaded with ctypes (nothing downloaded, no build step at install).

Build. `gcc` (else `cc`; `$LOGICPIPE_CC` names another, a path that does not exist turns the build
off) with `-O3 -mavx2 -mfma -mf16c` on an x86 CPU with AVX2, `-O3` on aarch64 (NEON is baseline
there; that path's numbers are checked by scripts/check_neon.py, built by zig's clang and run under
qemu-aarch64 emulation; its speed is never measured), plain `-O3` elsewhere (portable C);
`-fopenmp` (the threads are torch's own OpenMP runtime: the wheel's libgomp is already loaded under
the same name; a compiler without OpenMP builds one thread) and `-ffp-contract=off`. The library
is cached under <cache>/kernels/ by a hash of the source, the flags, the compiler and the CPU,
written to a temporary name and renamed into place, so processes starting together never load a
half-written file. No compiler, a failed build or a failed load: one log line, and `library()` is
None (quant.py then keeps torch's kernels).

Calls take contiguous tensors' raw pointers; the output is float32, one call per product, the
number of threads torch runs with on the calling thread.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from logicpipe.common.paths import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_quant.c")
ISA_NAMES = {2: "avx2", 1: "neon", 0: "portable C"}
TILE = 4  # output features per tile (cpu_quant.c): packed matrices are padded to a multiple


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo's `flags` or `Features`), empty where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        pass
    return set()


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def compile_flags(machine: str | None = None, flags: set[str] | None = None) -> list[str]:
    """gcc's flags for this CPU (see the module docstring)."""
    machine = machine or platform.machine()
    flags = cpu_flags() if flags is None else flags
    out = ["-O3", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off"]
    if machine in ("x86_64", "AMD64") and {"avx2", "fma", "f16c"} <= flags:
        out += ["-mavx2", "-mfma", "-mf16c"]
    return out


def compiler() -> str | None:
    cc = os.environ.get("LOGICPIPE_CC")
    if cc:
        return cc if shutil.which(cc) else None
    return shutil.which("gcc") or shutil.which("cc")


def build(cflags: list[str] | None = None) -> ctypes.CDLL | None:
    """Compile (or find in the cache) and load cpu_quant.c with `cflags` (default: compile_flags());
    None, logged once, when it cannot be built or loaded."""
    cc = compiler()
    if cc is None:
        log.warning("native CPU kernels off: no C compiler (%s); torch's kernels instead",
                    f"LOGICPIPE_CC={os.environ['LOGICPIPE_CC']}" if os.environ.get("LOGICPIPE_CC") else "gcc, cc")
        return None
    cflags = compile_flags() if cflags is None else cflags
    lib = _build(cc, cflags)
    if lib is None and "-fopenmp" in cflags:  # a compiler without OpenMP (clang without libomp): one thread
        lib = _build(cc, [f for f in cflags if f != "-fopenmp"])
    if lib is None:
        log.warning("native CPU kernels off: %s could not build %s; torch's kernels instead", cc, SOURCE.name)
    return lib


def _build(cc: str, cflags: list[str]) -> ctypes.CDLL | None:
    src = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([src, " ".join(cflags).encode(), cc.encode(), platform.machine().encode(),
                                     cpu_name().encode(), " ".join(sorted(cpu_flags())).encode()])).hexdigest()[:16]
    path = cache_root() / "kernels" / f"cpu_quant-{key}.so"
    try:
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
            os.close(fd)
            try:
                proc = subprocess.run([cc, *cflags, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True,
                                      timeout=120)
                if proc.returncode:
                    log.info("%s %s failed: %s", cc, " ".join(cflags), proc.stderr.strip().splitlines()[-1:] or proc.returncode)
                    return None
                os.replace(tmp, path)  # atomic: a process that finds the file finds it whole
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        log.info("native CPU kernels: %s", exc)
        return None
    ptr, i64, cint = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for fn in (lib.lp_int4_mm, lib.lp_int8_mm):
        fn.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, ptr, i64, cint]
        fn.restype = cint
    lib.lp_layers.argtypes = [ctypes.POINTER(Dims), ctypes.POINTER(Layer), i64, ptr, i64, ptr, ptr, ptr, i64, ptr,
                              ptr, ptr, ptr, cint]
    lib.lp_layers.restype = cint
    lib.lp_layers_pools.argtypes = [ctypes.POINTER(Dims), ctypes.POINTER(Layer), i64, ptr, i64, ptr, ptr,
                                    ctypes.POINTER(Pool), i64, ptr, ptr, ptr, cint]
    lib.lp_layers_pools.restype = cint
    lib.lp_attend.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, i64, ptr, i64, ptr, ptr, i64,
                              ctypes.c_double, ptr, cint]
    lib.lp_attend.restype = cint
    lib.lp_rotate.argtypes = [ptr, i64, i64, ptr, cint, cint]
    lib.lp_rotate.restype = cint
    lib.lp_kv_int8.argtypes = [ptr, i64, i64, ptr, ptr, cint]
    lib.lp_kv_int8.restype = cint
    lib.lp_kv_store_int8.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ptr, i64, cint]
    lib.lp_kv_store_int8.restype = cint
    log.info("native CPU kernels (%s) loaded from %s", ISA_NAMES.get(lib.lp_isa(), "?"), path)
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The library built for this CPU, once per process (None: unavailable)."""
    return build()


def isa(lib: ctypes.CDLL | None = None) -> str:
    lib = lib or library()
    return ISA_NAMES.get(lib.lp_isa(), "?") if lib else "none"


class Mat(ctypes.Structure):
    """cpu_quant.c's lp_mat: a packed matrix (fmt 4: int4, 8: int8) of n output features."""
    _fields_ = [("w", ctypes.c_void_p), ("s", ctypes.c_void_p), ("n", ctypes.c_int64), ("fmt", ctypes.c_int64)]


class Layer(ctypes.Structure):
    """cpu_quant.c's lp_layer: one decoder layer's packed matrices, biases and norms (NULL: none)."""
    _fields_ = [("qkv", Mat), ("o", Mat), ("gate_up", Mat), ("down", Mat),
                ("qkv_bias", ctypes.c_void_p), ("o_bias", ctypes.c_void_p), ("gate_up_bias", ctypes.c_void_p),
                ("down_bias", ctypes.c_void_p), ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("qk_norm", ctypes.c_void_p), ("rope", ctypes.c_int64), ("window", ctypes.c_int64)]


class Pool(ctypes.Structure):
    """cpu_quant.c's lp_pool: a KV pool a step reads and writes (kv [layers, 2, kv_heads, slots, head_dim];
    table [seqs, table_len] each sequence's slot of each position; write_slots [T])."""
    _fields_ = [("kv", ctypes.c_void_p), ("slots", ctypes.c_int64), ("table", ctypes.c_void_p),
                ("table_len", ctypes.c_int64), ("write_slots", ctypes.c_void_p)]


class Dims(ctypes.Structure):
    """cpu_quant.c's lp_dims: the model's sizes (slots: lp_layers' KV pool's slots per layer and head)."""
    _fields_ = [("hidden", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("inter", ctypes.c_int64), ("slots", ctypes.c_int64),
                ("eps", ctypes.c_double), ("scale", ctypes.c_double), ("act", ctypes.c_int64)]


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    """t: [N, ...] -> [Np, ...] with zero rows up to a multiple of TILE."""
    pad = -t.shape[0] % TILE
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] (0..15), scale and zero [N, K / group] bf16 -> cpu_quant.c's int4 layout: (bytes
    [Np / 4, K / 32, 4, 16] uint8, scales and zeros [Np / 4, K / 32, 2, 4] as bf16 bits in int16)."""
    n, k = q.shape
    g = q.to(torch.uint8).reshape(n, k // group, 2, group // 2)  # [N, G, halves, 16]
    packed = _pad_rows(g[:, :, 0] | (g[:, :, 1] << 4))  # byte j: q[j] low nibble, q[j + 16] high
    packed = packed.reshape(-1, TILE, k // group, group // 2).transpose(1, 2)  # [T, G, 4, 16]
    sz = _pad_rows(torch.stack([scale, zero], -1).to(torch.bfloat16).view(torch.int16))  # [Np, G, 2]
    sz = sz.reshape(-1, TILE, k // group, 2).permute(0, 2, 3, 1)  # [T, G, 2, 4]
    return packed.contiguous(), sz.contiguous()


def pack_int8(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] int8, scale [N] -> cpu_quant.c's int8 layout: (q [Np / 4, Kp / 32, 4, 32], k padded
    with zeros to a multiple of 32; scale [Np] float32)."""
    q = _pad_rows(torch.nn.functional.pad(q, (0, -q.shape[1] % 32)))
    q = q.reshape(-1, TILE, q.shape[1] // 32, 32).transpose(1, 2)  # [T, G, 4, 32]
    return q.contiguous(), _pad_rows(scale.float()).contiguous()


def call(fn, x: torch.Tensor, w: int, s: int, n: int) -> torch.Tensor:
    """x [..., K] @ a packed matrix of n output features by `fn` (the library's lp_int4_mm or
    lp_int8_mm; w and s the addresses of its pack_int4 / pack_int8 tensors, kept alive by the
    caller) -> [..., n] float32. On the per-token path: a 2-D contiguous float32 x goes as it is."""
    if x.dim() != 2 or x.dtype != torch.float32 or not x.is_contiguous():
        return call(fn, x.reshape(-1, x.shape[-1]).float().contiguous(), w, s, n).reshape(*x.shape[:-1], n)
    m, k = x.shape
    out = torch.empty(m, n)
    if m and fn(x.data_ptr(), k, m, k, w, s, n, out.data_ptr(), n, torch.get_num_threads()):
        raise MemoryError("native CPU kernel: no memory for the quantized activations")
    return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, row_seq: torch.Tensor,
           pos: torch.Tensor, window: int, scale: float, ks: torch.Tensor | None = None,
           vs: torch.Tensor | None = None, signs: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over one layer's paged KV, read in place (cpu_quant.c's lp_attend): q [T, heads, hd]
    float32; k, v [kv_heads, slots, hd] float32, or int8 with their scales ks, vs [kv_heads, slots]
    int32 (each the vector's scale and mid as two bfloat16: engine.kv_quant.pack; all contiguous); table [seqs, L] int64, each sequence's slot of each position; row_seq, pos
    [T] int64 (row r sees its sequence's positions <= pos[r], and > pos[r] - window; window 0: none).
    signs [hd] float32: KV stored rotated (engine.kv_quant.rotate): q is rotated first (a copy) and the output
    un-rotated, by lp_rotate, the same bits as kv_quant's rotate and unrotate around the call.
    -> [T, heads * hd] float32"""
    lib = library()
    q = q.float().contiguous()
    T, heads, hd = q.shape
    if signs is not None:
        q = rotate(q, signs, inverse=False)
    if (ks is None) != (k.dtype == torch.float32) or (ks is None) != (vs is None) or not (
            ks is None or ks.dtype == vs.dtype == torch.int32):
        raise ValueError(f"native attention reads float32 KV, or int8 with both (scale, mid) words; got {k.dtype}")
    out = torch.empty(T, heads * hd)
    rc = lib.lp_attend(q.data_ptr(), T, heads, k.shape[0], hd, k.data_ptr(), v.data_ptr(),
                       None if ks is None else ks.data_ptr(), None if vs is None else vs.data_ptr(), k.shape[1],
                       table.data_ptr(), table.shape[1], row_seq.data_ptr(), pos.data_ptr(), window, scale,
                       out.data_ptr(), torch.get_num_threads())
    if rc == -2:
        raise ValueError(f"native attention: {heads // k.shape[0]} query heads a KV head, more than it tiles")
    if rc:
        raise MemoryError("native attention: no memory for its tiles")
    if signs is not None:
        lib.lp_rotate(out.data_ptr(), T * heads, hd, signs.data_ptr(), 1, torch.get_num_threads())
    return out


def rotate(x: torch.Tensor, signs: torch.Tensor, inverse: bool) -> torch.Tensor | None:
    """engine.kv_quant's rotation of x [..., d] (float32 signs [d]) by cpu_quant.c's lp_rotate, the same
    bits as its butterflies in torch: -> a new float32 tensor (x R, or x R^T with `inverse`); None where
    the library is unavailable."""
    lib = library()
    if lib is None:
        return None
    y = torch.empty(x.shape, dtype=torch.float32)
    y.copy_(x)
    d = x.shape[-1]
    lib.lp_rotate(y.data_ptr(), y.numel() // d if d else 0, d, signs.data_ptr(), int(inverse), torch.get_num_threads())
    return y


def kv_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """engine.kv_quant.quantize(x, "int8") by cpu_quant.c's lp_kv_int8 (the same bits): x [..., d] ->
    (q [..., d] int8, packed (scale, mid) words [...] int32); None where the library is unavailable."""
    lib = library()
    if lib is None:
        return None
    x = x.float().contiguous()
    d = x.shape[-1]
    q = torch.empty(x.shape, dtype=torch.int8)
    packed = torch.empty(x.shape[:-1], dtype=torch.int32)
    lib.lp_kv_int8(x.data_ptr(), x.numel() // d if d else 0, d, q.data_ptr(), packed.data_ptr(), torch.get_num_threads())
    return q, packed


def kv_store_int8(x: torch.Tensor, slots: torch.Tensor, signs: torch.Tensor | None, dst: torch.Tensor,
                  scales: torch.Tensor) -> bool:
    """A step's new keys or values x [T, kv_heads, d] quantized to int8 (rotated first with `signs`) straight
    into one layer's part of a pool, dst [kv_heads, slots, d] int8 and scales [kv_heads, slots] int32 (both
    contiguous) at `slots` [T] int64: what kv_quant.quantize and two index copies write, the same bits.
    False (nothing written) where the library is unavailable or d is above its row buffer."""
    lib = library()
    if lib is None or not (dst.is_contiguous() and scales.is_contiguous()):
        return False
    x = x.float().contiguous()
    slots = slots.to(torch.int64).contiguous()
    T, kvh, d = x.shape
    return not lib.lp_kv_store_int8(x.data_ptr(), T, kvh, d, slots.data_ptr(),
                                    None if signs is None else signs.data_ptr(), dst.data_ptr(), scales.data_ptr(),
                                    dst.shape[1], torch.get_num_threads())
