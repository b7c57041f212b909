"""int4 and int8 weights on CUDA without bitsandbytes: the CPU formats' grids
(stage_node.kernels.quant_grid) repacked at load, multiplied by the Triton kernels of
gpu_quant_kernels (whose docstring gives their exact arithmetic: activations rounded per group of 32
to 11-bit integers times a power of two, every partial sum an exact integer).

Layout on the GPU (packed once, as each matrix is quantized):
  * int4, w [N, K]: `q4` [K/32, N, 16] uint8, group-major: byte j of output n's group g holds
    q[n, 32g + j] in its low nibble and q[n, 32g + 16 + j] in its high one (a group of a block of
    outputs is one contiguous run; the one-row kernel reads it as int32 words). `sz` [K/32, N] int32:
    a group's bf16 scale bits in the low half, its zero point's in the high half (bf16 held as bits:
    Triton's interpreter, which the CPU tests run, has no bfloat16). 0.625 bytes a weight, as on the CPU.
  * int8, w [N, K]: `q8` [N, K] int8 (the CPU's), `scales` [N] float32 (the bf16 values): 1 byte a weight.

An int4 product is up to three kernels: round_rows (the activations' integers, once per product),
then up to GEMV_ROWS rows the one-row kernel (a program per row, column block and part of K, CUDA
cores: dp4a), more rows the tiled kernel (tensor cores), then invariant.add_parts over the parts of K
(from SUM_PARTS_ROWS rows the tiled kernel adds them itself). `qmm_config` picks the tile; any tile
gives a row the same bits, so the kernel follows the row count. An int8 product is one kernel (the
activations as they are; int8_config) and add_parts.

Batch invariance, by the float path's rule (stage_node.kernels.invariant): K in parts fixed per
matrix (int4: `quant_parts`; int8: `invariant.quant_parts`; never a function of the rows), added in
order by `invariant.add_parts`; int4's sums exact, int8's tiles never under 64 rows; checked on the
H100 and the H200 by bench/gpu_quant.py --part check. Outputs are
written with no host sync and no allocation but the output's and the pre-pass's, so a CUDA graph
captures them. Triton is imported only when a matrix is multiplied.
"""
from __future__ import annotations

import logging

import torch

from logicpipe.stage_node.kernels import gpu_quant_kernels, invariant
from logicpipe.stage_node.kernels.quant_grid import GROUP_INT4, QuantMatrix, dequantize_int4, int4_grid, int8_grid

log = logging.getLogger(__name__)


# parts of K of an int4 matrix by (n, k), where the sweep chose other than quant_parts' rule (bits
# change with the parts, so this is a fact of the format on every GPU: never a function of the rows)
PARTS: dict[tuple[int, int], int] = {}  # (none: the H200 sweep found quant_parts' within 3% of the best for one
# row of every 8B matrix, with the one-row kernel loading a step ahead; fewer parts are faster prompts)


def quant_parts(n: int, k: int) -> int:
    """Parts of K an int4 product with w [n, k] sums separately (then adds in order): a function of
    the matrix alone (never of the rows): PARTS, else enough that the one-row kernel's programs (64
    columns a block) fill the GPU four times over, at most 8 and none under 512 of K (an 8B model's
    q/k/v 6, o 8, down 8, gate/up 2)."""
    if (n, k) in PARTS:
        return PARTS[n, k]
    blocks = -(-n // 64)
    return max(1, min(-(-4 * invariant.SMS // blocks), k // 512, 8))


# the one-row kernel's tile (BLOCK_N, num_warps, num_stages: its K loop's steps in flight) by (format, n, k);
# others DECODE_TILE[format]. Any tile gives the same bits (gpu_quant_kernels): speed only
# (python -m bench.gpu_quant_tune --part sweep). On the H200, a product's kernel alone over copies of
# the matrix that L2 cannot hold (us): q/k/v 7.2, o 5.5, down 12.1 (5 stages; 12.7 with 4), gate/up 21.9
# (256 x 4 warps; 23.4 with 128 x 2); the kernel that loaded one step ahead in registers (32 x 1 warp,
# 4 groups a step): 7.8, 6.6, 16.4, 24.7 (.dev sweep of 2026-11-29: 2 groups a step the best, 4 and 8 slower)
DECODE_TILE = {"int4": (128, 2, 4)}
DECODE_TILES: dict[tuple[str, int, int], tuple[int, int, int]] = {("int4", 28672, 4096): (256, 4, 4),
                                                                   ("int4", 4096, 14336): (128, 2, 5)}
ONE_ROW_GROUPS = 2  # groups of 32 a step of the one-row kernel's K loop (step_groups)
# the tiled kernel's tile (BLOCK_M, BLOCK_N, num_warps, num_stages) of a prompt (over 64 rows) by
# (format, n, k, summed: the tile adds the parts of K itself, sum_rows); others PROMPT_TILE[summed].
# (8 warps, whose 128-row tiles keep a group's a and S in the accumulator's layout as loaded, took
# 1.3-1.8x the time of 4 on the H200)
PROMPT_TILE = {False: (128, 64, 4, 3), True: (128, 64, 4, 3)}  # the H200 sweep's best for every 8B matrix
PROMPT_TILES: dict[tuple[str, int, int, bool], tuple[int, int, int, int]] = {}
# int4 products of at least this many rows: the tiled kernel adds the parts of K itself (in order, as
# invariant.add_parts: the same bits, checked on the GPU), no float32 parts written and read back, no
# second kernel, but a program does every part; by (n, k) in SUM_ROWS, else SUM_PARTS_ROWS (on the
# H100 1024 rows took 0.78-0.92 of the time a program a part takes, 256 rows 1.05-1.35 of it)
SUM_PARTS_ROWS = 1024
SUM_ROWS: dict[tuple[int, int], int] = {}
# products of up to this many rows run the one-row kernel (a program a row), more the tiled one
# (the H200, a layer of the 8B shape's four products: 2 rows 98.3 us against 139.7 by the 16-row tile, 3
# rows 134.9 against 140.3, 4 rows 170.4 against 140.1; the same bits, exact sums)
GEMV_ROWS = 3
# the one-row kernel adds its parts itself where its consumer would add them (the `added` products: o's and
# down's, whose parts fused.add_norm adds in one program a row)
ONE_ROW_ADD = True


def sum_rows(n: int, k: int) -> int:
    """Rows from which an int4 product with w [n, k] has its tiled kernel add the parts of K itself."""
    return SUM_ROWS.get((n, k), SUM_PARTS_ROWS)


def qmm_config(n: int, k: int, dtype: torch.dtype, m: int = 1, fmt: str = "int4") -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, parts of K) of an m-row product with a quantized
    w [n, k]; BLOCK_M 1: the one-row kernel (CUDA cores), else the tiled one (tensor cores). The parts
    are quant_parts(n, k), never a function of m; the tile follows m (it changes no bit)."""
    if fmt == "int8":
        return int8_config(n, k, dtype, m)
    parts = quant_parts(n, k)
    if m <= GEMV_ROWS:
        return (1, *DECODE_TILES.get((fmt, n, k), DECODE_TILE[fmt]), parts)
    if m <= 16:
        return 16, 64, 4, 3, parts
    if m <= 32:
        return 32, 64, 4, 3, parts
    if m <= 64:
        return 64, 64, 4, 3, parts
    summed = m >= sum_rows(n, k)
    return (*PROMPT_TILES.get((fmt, n, k, summed), PROMPT_TILE[summed]), parts)


INT8_BK = 128  # int8: K a chunk, the same for every tile (part of the sum's order)
HEAD_ROWS = 65536  # int8 matrices of at least this many outputs (a vocabulary: an LM head) take their own tiles


def int8_config(n: int, k: int, dtype: torch.dtype, m: int) -> tuple[int, int, int, int, int]:
    """int8's tile (the activations as they are, the float path's rule): the parts a function of the
    matrix (invariant.quant_parts); the tile follows m. Up to 64 rows the tile is int8_mm's TRANS (the
    weights the tensor cores' M, the rows their N: a row's tile is 16 rows, not 64 of which 63 are
    padding; an LM head's 33 to 64 rows excepted), as is an LM head's of over 64; the others take the
    rows as M, never under 64 rows (on the H100 a 16- or 32-row tile of those gave a row other bits
    than the 64- and 128-row tiles: bench/gpu_quant_tiles.py). Both forms give a row the same bits
    (the same products, K in the same BK chunks, each output's sum the tensor cores' own; checked on
    the H200 by bench/gpu_quant.py --part check): any tile of either gives a row the same bits. See
    int8_trans."""
    if dtype == torch.float32:  # exact float32 (no TF32): one tile
        return 16, 32, 4, 3, 1
    parts = invariant.quant_parts(n, k)
    head = n >= HEAD_ROWS
    # on the H200, one row against the 64-row tiles: an LM head 177.7 us against 208.9, the 8B shape's q/k/v
    # 17.9 against 23.1, o 11.5 / 14.5, gate/up 50.3 / 70.7, down 32.3 / 40.6 (4 stages; 35.5 with 3)
    stages = 4 if k > 8192 else 3
    if m <= 16:
        return 16, 64, 4, stages, parts
    if m <= 32:  # (32 rows: the head 204.6 us against 215.1, gate/up 54.4 / 71.3, down 34.2 / 43.0)
        return 32, 64, 4, stages, parts
    if m <= 64 and head:  # an LM head: on the H200 one row 210.8 us against 271.5 with 64 x 64
        return 64, 128, 4, 3, parts  # (TRANS 64 x 64 at 64 rows: 247.5 us against this one's 212.6)
    if m <= 64:  # TRANS (64 rows: q/k/v 23.4 us against 24.1 by the rows-as-M 64 x 64, o 15.1 / 15.8,
        return 64, 64, 4, stages, parts  # gate/up 65.6 / 67.8, down 38.2 / 45.9)
    if m <= 128:  # an LM head, TRANS: 128 rows 345.8 us against 407.8 with 64 x 128 tiles
        return (128, 128, 8, 3, parts) if head else (64, 128, 4, 3, parts)
    return (256, 128, 8, 3, parts) if head else (128, 128, 8, 3, parts)  # (TRANS 256 rows: 517.7 us against 723.4)


INT8_FORM = ""  # "": each tile's own form (int8_trans); "rows" or "trans": every int8 product of 16-bit rows in
# that form, whatever its tile (the benches' comparisons of the two forms on one tile)


def int8_trans(n: int, dtype: torch.dtype, bm: int, bn: int) -> bool:
    """Whether an int8 product with n outputs of rows in `dtype` by a `bm` x `bn` tile of int8_config
    is int8_mm's TRANS form: its tiles 64 columns wide, and an LM head's of over 64 rows."""
    if dtype == torch.float32:
        return False
    if INT8_FORM:
        return INT8_FORM == "trans"
    return bn == 64 or (n >= HEAD_ROWS and bm > 64)


_fitting: dict[tuple, tuple] = {}  # (format, shape, dtype, config) -> the config that fits this GPU


def _k_part(k: int, parts: int) -> int:
    """K a part sums, a multiple of 256 (so a part holds whole steps of the one-row kernels)."""
    k_part = -(-k // parts)
    return -(-k_part // 256) * 256


class TritonMatrix(QuantMatrix):
    """A quantized matrix multiplied by this module's kernels (CUDA; the CPU in Triton's interpreter)."""

    def _launch(self, x: torch.Tensor, ws: torch.Tensor, grid: tuple[int, int, int], config: tuple,
                k_part: int, rounded: tuple | None = None, add: bool = False) -> None:
        raise NotImplementedError

    def takes_rounded(self, rows: int) -> bool:
        """Whether a product of `rows` rows runs the one-row int4 kernel, whose rounded rows the kernel
        before it (fused.add_norm, fused.silu_mul: `rounded`) can write in its own launch instead of
        round_rows' pre-pass (`mm_parts`' `rounded`)."""
        return self.format == "int4" and 0 < rows <= GEMV_ROWS and self.shape[1] % 32 == 0

    def mm_parts(self, x: torch.Tensor, config: tuple[int, ...] | None = None,
                 rounded: tuple[torch.Tensor, torch.Tensor] | None = None, added: bool = False) -> torch.Tensor:
        """x [M, K] -> the product's parts over K, not yet added: [parts, M, N] float32 (several
        parts) or [1, M, N] in x's dtype (see invariant.mm_parts); `config` overrides qmm_config;
        `rounded`: x's rows as round_rows(x, LAYOUT_DP) gives them (takes_rounded), for the one-row
        kernel (ignored by the tiled one, which rounds x itself). `added` (int4, ONE_ROW_ADD): the
        one-row kernel adds its parts itself, in order, in float32 (not rounded): [1, M, N] float32,
        for a consumer that adds the parts and rounds (fused.add_norm: the same bits)."""
        N, K = self.shape
        M = x.shape[0]
        if x.shape[1] != K:
            raise ValueError(f"a {self.format} matrix of {N} x {K} multiplied by rows of {x.shape[1]}")
        if x.stride(1) != 1:
            x = x.contiguous()
        config = config or qmm_config(N, K, x.dtype, M, self.format)
        bm, bn, _, _, parts = config
        k_part = _k_part(K, parts)
        parts = -(-K // k_part)
        if bm > 1 and self.format == "int4" and M >= sum_rows(N, K):
            parts = 1  # the tiled kernel adds the parts (grid[2] == 1 of several parts: its SUM)
        ws = torch.empty(parts, M, N, dtype=x.dtype if parts == 1 else torch.float32, device=x.device)
        add = added and ONE_ROW_ADD and bm == 1 and parts > 1 and self.format == "int4"
        if M:
            grid = (M if bm == 1 else -(-M // bm), -(-N // bn), parts)
            self._launch_fitting(x, ws, grid, config, k_part, rounded, add)
        return ws[:1] if add else ws

    def _launch_fitting(self, x, ws, grid, config, k_part, rounded=None, add=False) -> None:
        """Launch with `config`, or with fewer pipeline stages where its tiles do not fit the GPU's
        shared memory (Triton's OutOfResources; a Jetson Orin has 164 KB an SM, an H100 228 KB).
        Stages change no sum: the bits are the same. Remembered per matrix shape and config."""
        key = (self.format, self.shape, x.dtype, config)
        fit = _fitting.get(key, config)
        while True:
            try:
                self._launch(x, ws, grid, fit, k_part, rounded, add)
            except Exception as exc:  # re-raised unless it is Triton's OutOfResources
                if type(exc).__name__ != "OutOfResources" or fit[3] <= 1:
                    raise
                fit = (*fit[:3], fit[3] - 1, fit[4])
                continue
            if fit != config and key not in _fitting:
                log.warning("%s product of a %d x %d matrix: %d pipeline stages do not fit this GPU's shared "
                            "memory; %d do", self.format, *self.shape, config[3], fit[3])
            _fitting[key] = fit
            return

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        out = invariant.add_parts(self.mm_parts(x.reshape(-1, x.shape[-1])), x.dtype)
        return out.view(*lead, self.shape[0])


class TritonInt4(TritonMatrix):
    """int4 on CUDA: the CPU's grid (groups of 32 along the input, bf16 scale and zero point), packed
    as the module's docstring says."""

    format = "int4"

    def __init__(self, w: torch.Tensor):
        q, scale, zero = int4_grid(w, GROUP_INT4)
        super().__init__(*w.shape)
        self.q4, self.sz = pack_int4(q, scale, zero)
        # the one-row kernel's counts of the parts stored (ADD), a row's column block each (blocks of 32
        # columns or more): zeros, each back to zero when its block is added; made here, not in a CUDA
        # graph's capture
        self._counts = torch.zeros(GEMV_ROWS * -(-w.shape[0] // 32), dtype=torch.int32, device=w.device)

    @property
    def nbytes(self) -> int:
        return self.q4.numel() + self.sz.numel() * self.sz.element_size()

    def grid(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, zero) of each group, float32 [out, groups]: w = (q - 8) * scale + zero."""
        sz = self.sz.t()  # [out, groups] int32
        return (sz << 16).view(torch.float32), (sz & -65536).view(torch.float32)

    def _launch(self, x, ws, grid, config, k_part, rounded=None, add=False) -> None:
        _, _, mm, gemv, _ = gpu_quant_kernels.kernels()
        bm, bn, warps, stages, _ = config
        N, K = self.shape
        M = x.shape[0]
        tail = (ws.stride(0) if ws.shape[0] > 1 else 0, ws.stride(1))
        if bm == 1:
            xd, aux = rounded if rounded is not None else round_rows(x, gpu_quant_kernels.LAYOUT_DP)
            assert not add or grid[0] * grid[1] <= self._counts.numel()
            gemv[grid](xd.view(torch.int32), aux, self.q4.view(torch.int32), self.sz, ws, self._counts, M, N, K,
                       k_part, *tail, BN=bn, ADD=add,
                       U=step_groups(K, ONE_ROW_GROUPS), STAGES=stages, ASM=x.is_cuda, num_warps=warps,
                       num_stages=stages, **invariant.pdl(x.device), **invariant.gemv_trigger(x.device))
        else:
            xq, aux = round_rows(x, gpu_quant_kernels.LAYOUT_MM)
            mm[grid](xq, aux, self.q4, self.sz, ws, M, N, K, k_part, *tail, BM=bm, BN=bn, SUM=grid[2] < -(-K // k_part),
                     num_warps=warps, num_stages=stages)


class TritonInt8(TritonMatrix):
    """int8 on CUDA: the CPU's grid (one bf16 scale per output channel), the int8 matrix as it is."""

    format = "int8"

    def __init__(self, w: torch.Tensor):
        q, scales = int8_grid(w)
        super().__init__(*w.shape)
        self.q8, self.scales = q, scales.float()

    @property
    def nbytes(self) -> int:
        return self.q8.numel() + self.scales.numel() * self.scales.element_size()

    def grid(self) -> torch.Tensor:
        """The scale of each output channel, float32 [out]: w = q * scale."""
        return self.scales

    def _launch(self, x, ws, grid, config, k_part, rounded=None, add=False) -> None:
        *_, mm = gpu_quant_kernels.kernels()
        bm, bn, warps, stages, _ = config
        N, K = self.shape
        mm[grid](x, self.q8, self.scales, ws, x.shape[0], N, K, k_part, x.stride(0), self.q8.stride(0),
                 ws.stride(0) if ws.shape[0] > 1 else 0, ws.stride(1), BM=bm, BN=bn, BK=INT8_BK,
                 IEEE=x.dtype == torch.float32, TRANS=int8_trans(N, x.dtype, bm, bn), num_warps=warps,
                 num_stages=stages)


def round_rows(x: torch.Tensor, layout: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (its integers: float16 [M, K] for the tiled kernels (LAYOUT_MM) or the bytes
    int8 [M, K/32, 2, 32] for the one-row kernels (LAYOUT_DP); a and S [2, K/32, M] float32): the
    activations' rounding, once per product (gpu_quant_kernels' docstring)."""
    triton, kernel, *_ = gpu_quant_kernels.kernels()
    m, k = x.shape
    xq, aux = gpu_quant_kernels.rounding(m, k, layout, x.device)
    gb = gpu_quant_kernels.ROUND_GROUPS
    kernel[(m, triton.cdiv(k // 32, gb))](x, xq, aux, m, k, x.stride(0), LAYOUT=layout, GB=gb, num_warps=1,
                                          **(invariant.pdl(x.device) if layout == gpu_quant_kernels.LAYOUT_DP else {}))
    return xq, aux


def step_groups(k: int, most: int) -> int:
    """Groups of 32 a step of the one-row kernels' K loop for an input of `k`: the largest power of two
    up to `most` (at most 8) that divides k / 32, so every part of K (a multiple of 256 but the last)
    is whole steps. Speed only: the groups are added in the same order."""
    return next(g for g in (8, 4, 2, 1) if g <= most and k // 32 % g == 0)


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int4 grid (q [N, K] in 0..15; scale, zero bf16 [N, K/32]) -> (q4 [K/32, N, 16] uint8,
    sz [K/32, N] int32), the GPU layout of the module's docstring."""
    n, k = q.shape
    halves = q.to(torch.uint8).reshape(n, k // 32, 2, 16)  # [n, group, half, j]: k = 32 group + 16 half + j
    q4 = (halves[:, :, 0] | (halves[:, :, 1] << 4)).transpose(0, 1).contiguous()  # [group, n, 16]
    sz = (_bf16_bits(scale) & 0xFFFF) | (_bf16_bits(zero) << 16)
    return q4, sz.t().contiguous()


def _bf16_bits(t: torch.Tensor) -> torch.Tensor:
    """A bf16 tensor's bits as int32 (sign-extended: only the low 16 bits mean anything)."""
    return t.contiguous().view(torch.int16).to(torch.int32)


def unpack_int4(q4: torch.Tensor) -> torch.Tensor:
    """q4 [K/32, N, 16] uint8 -> q [N, K] int64 in 0..15 (pack_int4's inverse, for checks)."""
    groups, n, _ = q4.shape
    q = q4.long().transpose(0, 1)  # [n, group, 16]
    return torch.stack([q & 15, q >> 4], 2).reshape(n, groups * 32)


def quantize(w: torch.Tensor, fmt: str) -> QuantMatrix:
    """w: [out, in] float on a CUDA device (or the CPU, for Triton's interpreter) -> the matrix in `fmt`."""
    return TritonInt4(w) if fmt == "int4" else TritonInt8(w)


def trial(fmt: str, device: str) -> str:
    """'' when a 64 x 256 matrix in `fmt` multiplies 1 and 20 rows right on `device`, else why not:
    triton missing, the error's first line (a GPU Triton cannot compile for), or how far the product
    is off from the dequantized matrix's."""
    if not invariant.triton_available():
        return "it needs triton (it ships with torch's CUDA wheels: pip install triton)"
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(64, 256, generator=g), torch.randn(20, 256, generator=g)
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32  # (the interpreter: no bf16)
    try:
        m = quantize(w.to(device), fmt)
        x = x.to(dtype)
        ref = x.float() @ dequantized(m).cpu().to(dtype).float().T  # the kernel rounds weights to x's dtype
        for rows in (1, 20):
            off = float((m(x[:rows].to(device)).float().cpu() - ref[:rows]).norm() / ref[:rows].norm())
            if not off < 1e-2:  # nan too
                return f"a {rows}-row product of a {fmt} matrix is off by {off:.2g} of its norm"
    except Exception as exc:  # noqa: BLE001 — a CUDA or Triton compile error: the stage refuses, saying it
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        return (lines[0] if lines else type(exc).__name__)[:200]
    return ""


def dequantized(m: QuantMatrix) -> torch.Tensor:
    """The float32 [N, K] matrix a TritonInt4 / TritonInt8 multiplies by (its grid's values)."""
    if isinstance(m, TritonInt4):
        return dequantize_int4(unpack_int4(m.q4), *m.grid())
    return m.q8.float() * m.scales[:, None]
