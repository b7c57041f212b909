"""int4 / int8 on CUDA (stage_node.kernels.gpu_quant): the GPU packing against the CPU format's grid,
the stage's check of the format, and the Triton kernels run on the CPU through Triton's interpreter
(TRITON_INTERPRET=1, in a child process, as tests/unit/test_fused.py does; float32 and float16: the
interpreter has no bfloat16) on small shapes: products against a float32 product with the dequantized
matrix, rows 1..n the same bits among 1 to 40 rows (decode and prompt tiles), parts of K added in
order, and the fused layer loop with quantized matrices against the plain forward. On the GPU:
bench/gpu_quant.py (speed, CUDA graphs, greedy agreement with bf16)."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from logicpipe.stage_node.engine.kv import StepKV, seq_slice
from logicpipe.stage_node.kernels import fused, gpu_quant, gpu_quant_kernels, invariant
from logicpipe.stage_node.kernels.quant import Int4Packed, Int8Packed, QuantError, check_format
from logicpipe.stage_node.kernels.quant_grid import dequantize_int4, int4_grid
from logicpipe.stage_node.model import shard as shard_module
from logicpipe.stage_node.model.shard import Shard

from .test_quant import fake_orin

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # chosen before triton is first imported: a child process

if INTERPRETED:
    # Triton 3.6's interpreter (the GPU machine's) takes a loop bound's int() of a one-element array,
    # which NumPy >= 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars"):
    # every kernel with a run-time loop bound failed there. Triton 3.7 on squeezes it first; so does this.
    from triton.runtime import interpreter as _interpreter

    _patch_tensor = _interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        _patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interpreter._patch_lang_tensor = _patch_lang_tensor


def test_kernels_in_triton_interpreter():
    pytest.importorskip("triton")
    if INTERPRETED:
        pytest.skip("this is the child process")
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)), "-k",
                        "interpreted_"], cwd=root, capture_output=True, text=True,
                       env=dict(os.environ, TRITON_INTERPRET="1"), timeout=600, check=False)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-2000:]


@pytest.fixture
def interpret():
    if not INTERPRETED:
        pytest.skip("run in Triton's interpreter by test_kernels_in_triton_interpreter")


def test_the_gpu_packing_holds_the_cpu_grid():
    """TritonInt4 holds the CPU format's integers, scales and zero points (packed its own way, at the
    same 0.625 bytes a weight); TritonInt8 the CPU's int8 matrix and scales."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=g) * 0.05
    q, scale, zero = int4_grid(w)
    m = gpu_quant.TritonInt4(w)
    assert torch.equal(gpu_quant.unpack_int4(m.q4), q.long())
    got_scale, got_zero = m.grid()
    assert torch.equal(got_scale, scale.float()) and torch.equal(got_zero, zero.float())
    cpu = Int4Packed(w, kernel="torch")
    assert [torch.equal(a, b) for a, b in zip(m.grid(), cpu.grid())] == [True, True]
    assert torch.equal(gpu_quant.dequantized(m), dequantize_int4(q, scale, zero))
    assert m.nbytes == 48 * 96 * 5 // 8 and m.q4.shape == (3, 48, 16) and m.sz.shape == (3, 48)
    assert torch.equal(m.q4[1, 5], (q[5, 32:48] + 16 * q[5, 48:64]).to(torch.uint8))  # group-major, k and k + 16
    m8, cpu8 = gpu_quant.TritonInt8(w), Int8Packed(w, kernel="torch")
    assert torch.equal(m8.q8, cpu8._q) and torch.equal(m8.grid(), cpu8.grid())
    assert m8.nbytes == 48 * 96 + 48 * 4
    with pytest.raises(QuantError, match="multiple of 32"):
        gpu_quant.TritonInt4(torch.randn(32, 48))


def test_a_cuda_stage_tries_int4_and_int8_and_says_why_it_cannot(monkeypatch):
    fake_orin(monkeypatch)
    for fmt in ("int4", "int8"):
        check_format(fmt, "cuda", trial=lambda fmt, device: "")  # no longer refused on CUDA
        with pytest.raises(QuantError, match=r"cannot run on Orin \(compute capability 8.7, sm_87\): it needs triton "
                                             r".*--quantize nf4"):
            check_format(fmt, "cuda:0", trial=lambda fmt, device: "it needs triton (...)")
    with pytest.raises(QuantError, match="on the CPU and on CUDA only"):
        check_format("int4", "mps")


def test_a_tile_that_does_not_fit_shared_memory_takes_fewer_stages(monkeypatch):
    """Triton's OutOfResources (a Jetson's smaller shared memory): the launch retries with fewer
    pipeline stages (the same sums) and remembers the fit; any other error is raised."""
    class OutOfResources(RuntimeError):
        pass

    m = gpu_quant.TritonInt8(torch.randn(32, 64))
    tried = []

    def launch(x, ws, grid, config, k_part, rounded=None, add=False):
        tried.append(config[3])
        if config[3] > 2:
            raise OutOfResources("out of resource: shared memory")
    monkeypatch.setattr(m, "_launch", launch)
    monkeypatch.setattr(gpu_quant, "_fitting", {})
    x = torch.randn(3, 64).half()
    cfg = (16, 32, 4, 4, 1)
    m.mm_parts(x, cfg)
    m.mm_parts(x, cfg)
    assert tried == [4, 3, 2, 2]

    def broken(x, ws, grid, config, k_part, rounded=None, add=False):
        raise ValueError("not a resource")
    monkeypatch.setattr(m, "_launch", broken)
    with pytest.raises(ValueError, match="not a resource"):
        m.mm_parts(x, (16, 64, 4, 4, 1))


INT4_ARGS = ("xq_ptr", "aux_ptr", "q_ptr", "sz_ptr", "y_ptr", "M", "N", "K", "k_part", "sys_", "sym")
GEMV_ARGS = ("xq_ptr", "aux_ptr", "q_ptr", "sz_ptr", "y_ptr", "cnt_ptr", "M", "N", "K", "k_part", "sys_", "sym")
INT8_ARGS = ("x_ptr", "q_ptr", "s_ptr", "y_ptr", "M", "N", "K", "k_part", "sxm", "sqn", "sys_", "sym")
SHARED_LIMIT = {90: 227 * 1024, 87: 163 * 1024}  # bytes of shared memory a program may take: H100, Jetson Orin


def compiled(kernel, signature: dict, constexprs: dict, cap: int, warps: int, stages: int) -> tuple[int, int]:
    """(shared memory bytes, spilled bytes a thread; -1 unknown) of `kernel` compiled for sm_`cap`
    by Triton ahead of time (no GPU: its bundled ptxas, and cuobjdump for the spills)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # the hints Triton's launcher gives at run time: pointers and sizes divisible by 16 (not the
    # unspecialized arguments); without them its loads are neither vectorized nor pipelined
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature) if name not in ("M", "sys_", "magic")}
    c = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                       target=GPUTarget("cuda", cap, 32), options={"num_warps": warps, "num_stages": stages})
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.is_file():
        return c.metadata.shared, -1
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(c.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    return c.metadata.shared, int(re.search(r"STACK:(\d+)", usage).group(1))


def test_the_kernels_compile_for_an_h100_and_an_orin():
    """The decode tile and the largest prompt tile of qmm_config, compiled by Triton for sm_90 (H100)
    without a GPU, and the decode tile for sm_87 (Jetson Orin; a prompt tile too large for its shared
    memory is launched with fewer stages): it compiles, its shared memory fits the GPU's, and on
    sm_90 no register spills (but the tiled kernel's running sum of the parts: at most 80 bytes); and
    fused.add_norm and fused.silu_mul with their rows' rounding (`rounded`), on both, no spill. The
    real compiler, which the interpreter tests cannot reach (ten compiles: about 12 s with an empty
    Triton cache on this shared machine, a second after)."""
    pytest.importorskip("triton")
    if INTERPRETED:
        pytest.skip("compiled in the parent process")
    try:
        from triton.compiler import ASTSource  # noqa: F401
        _, _, int4_mm, int4_gemv, int8_mm = gpu_quant_kernels.kernels()
    except Exception as exc:  # noqa: BLE001 — a Triton without the NVIDIA backend
        pytest.skip(f"no ahead-of-time CUDA compiler in this Triton: {exc}")
    kernels = {  # (one row?, format): (kernel, its arguments' names, its pointers' types, constexprs)
        (True, "int4"): (int4_gemv, GEMV_ARGS, ["*i32", "*fp32", "*i32", "*i32", "*fp32", "*i32"],
                         {"U": gpu_quant.ONE_ROW_GROUPS, "ASM": True}),
        (False, "int4"): (int4_mm, INT4_ARGS, ["*fp16", "*fp32", "*u8", "*i32", "*bf16"], {}),
        (False, "int8"): (int8_mm, INT8_ARGS, ["*bf16", "*i8", "*fp32", "*bf16"],
                          {"BK": gpu_quant.INT8_BK, "IEEE": False})}
    for cap in (90, 87):
        for fmt in ("int4", "int8"):
            one_row = gpu_quant.qmm_config(4096, 4096, torch.bfloat16, 1, fmt)
            prompt = gpu_quant.qmm_config(4096, 4096, torch.bfloat16, 200, fmt)
            assert (one_row[0] == 1) == (fmt == "int4") and prompt[0] >= 64
            tiles = [(4096, one_row), (4096, prompt)] if cap == 90 else [(4096, one_row)]
            if fmt == "int8":  # an LM head's prompt tile too (int8_mm's TRANS form, 8 warps)
                tiles += [(128256, gpu_quant.qmm_config(128256, 4096, torch.bfloat16, 200, fmt))] if cap == 90 else []
            for n, (bm, bn, warps, stages, _) in tiles:
                kernel, args, ptrs, const = kernels[bm == 1, fmt]
                if fmt == "int8":
                    const = {**const, "TRANS": gpu_quant.int8_trans(n, torch.bfloat16, bm, bn)}
                signature = dict(zip(args, ptrs + ["i32"] * (len(args) - len(ptrs))))
                # int4's tiled kernel a part a program (no spill) and adding every part itself: its running
                # sum, kept across the K loop, may spill (outside the K loop, in the SASS: 72 bytes with Triton 3.9)
                # the one-row int4 kernel as a programmatic dependent launch too (invariant.PDL: sm_90 only, an
                # Orin has none)
                # an LM head's 256-row tile (its accumulator 128 registers a thread) spills 56 bytes (Triton
                # 3.9 here), and took 517.7 us for 256 rows on the H200 (Triton 3.6) against 723.4 by 128-row ones
                for extra, allowed in (({"SUM": False}, 0), ({"SUM": True}, 80)) if (bm, fmt) == (prompt[0], "int4") \
                        else (({"PDL": False, "TRIGGER": False, "ADD": True}, 0),
                              ({"PDL": True, "TRIGGER": True, "ADD": True}, 0)) \
                        if (bm, cap) == (1, 90) else (({"PDL": False, "TRIGGER": False, "ADD": True}, 0),) if bm == 1 \
                        else (({}, 64 if n > 4096 else 0),):
                    constexprs = {"BN": bn, **const, **extra} | ({"STAGES": stages} if bm == 1 else {"BM": bm})
                    shared, spilled = compiled(kernel, signature, constexprs, cap, warps, stages)
                    what = f"{kernel.__name__} {extra} sm_{cap} {bm}x{bn} {warps} warps {stages} stages"
                    assert shared <= SHARED_LIMIT[cap], f"{what}: {shared} bytes of shared memory"
                    assert cap != 90 or spilled <= allowed, f"{what}: {spilled} bytes of registers spilled a thread"
    # add_norm and silu_mul rounding their rows for the one-row kernel in the same launch (an 8B row: 4096 wide,
    # fused.norm_warps; SiLU's blocks of fused.SILU_BLOCK)
    _, add_norm, rope_kv, silu_mul = fused._kernels()
    args = {"ws_ptr": "*fp32", **{a: "*bf16" for a in ("x_ptr", "w_ptr", "xo_ptr", "h_ptr")}, "xq_ptr": "*i8",
            "aux_ptr": "*fp32", "M": "i32", "N": "i32", "eps": "fp32", **{a: "i32" for a in ("s_part", "s_ws", "s_x",
                                                                                             "s_xo", "s_h")}}
    silu_args = {"gu_ptr": "*fp32", "o_ptr": "*bf16", "xq_ptr": "*i8", "aux_ptr": "*fp32",
                 **{a: "i32" for a in ("T", "F", "s_gu", "s_o", "s_part")}}
    for cap in (90, 87):
        for kernel, signature, constexprs, warps in (
                (add_norm, args, {"PARTS": 8, "ADD": True, "NORM": True, "F32": False, "BLOCK": 4096},
                 fused.norm_warps(4096)),
                (silu_mul, silu_args, {"BLOCK": fused.SILU_BLOCK, "PARTS": 2}, 4)):
            launch = {"TRIGGER": cap == 90, "WAIT": cap == 90, "ROUND": True}  # (an Orin has no dependent launch)
            shared, spilled = compiled(kernel, signature, {**constexprs, **launch}, cap, warps, 1)
            assert shared <= SHARED_LIMIT[cap] and spilled <= 0, f"{kernel.__name__} sm_{cap}: {shared}, {spilled}"
        # RoPE and the KV write as a dependent launch (the 8B shape: q/k/v's 6 parts)
        rope_args = {"qkv_ptr": "*fp32", **{a: "*bf16" for a in ("cos_ptr", "sin_ptr")}, "pos_ptr": "*i64",
                     "slot_ptr": "*i64", **{a: "*bf16" for a in ("q_ptr", "k_ptr", "v_ptr")},
                     **{a: "i32" for a in ("s_qkv", "s_tab", "s_qt", "s_qh", "s_kh", "s_ks", "s_vh", "s_vs", "s_part")}}
        shared, spilled = compiled(rope_kv, rope_args, {"HEADS": 32, "KVH": 8, "HD": 128, "D": 128, "PARTS": 6,
                                                        "TRIGGER": cap == 90, "WAIT": cap == 90}, cap, 1, 1)
        assert shared <= SHARED_LIMIT[cap] and spilled <= 0, f"rope_kv sm_{cap}: {shared}, {spilled}"
        # attention's merge rounding its rows for o's one-row kernel (the 8B shape: 32 heads of 128)
        merge = invariant._kernels()[4]
        merge_args = {**{a: "*fp32" for a in ("m_ptr", "l_ptr", "acc_ptr")}, "pos_ptr": "*i64", "o_ptr": "*bf16",
                      "sink_ptr": "*fp32", "xq_ptr": "*i8", "aux_ptr": "*fp32",
                      **{a: "i32" for a in ("row_base", "so_t", "so_h", "window", "chunks", "M")}}
        merge_constexprs = {"HEADS": 32, "CHUNK": invariant.ATTN_CHUNK, "D": 128, "HD": 128, "HAS_WINDOW": False,
                            "CB": invariant.ATTN_MERGE_CHUNKS, "HAS_SINK": False, "ROUND": True, "TRIGGER": cap == 90,
                            "WAIT": cap == 90}
        shared, spilled = compiled(merge, merge_args, merge_constexprs, cap, 2, 1)
        assert shared <= SHARED_LIMIT[cap] and spilled <= 0, f"attn_merge sm_{cap}: {shared}, {spilled}"


def interpreted_product(fmt, w, x):
    m = gpu_quant.quantize(w, fmt)
    return m, m(x), exact_product(m, x)


def exact_product(m, x):
    """int4: the kernels' arithmetic in float64 (gpu_quant_kernels.reference: no rounding but the
    activations' to 11-bit integers per group of 32); int8: a float32 product with the dequantized
    matrix (its weights rounded to x's dtype, as the kernel does). Float32 [M, N]."""
    if m.format == "int4":
        scale, zero = m.grid()
        return gpu_quant_kernels.reference(x, gpu_quant.unpack_int4(m.q4), scale, zero).float()
    return x.float() @ gpu_quant.dequantized(m).to(x.dtype).float().T


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_interpreted_product_is_the_dequantized_matrix_s(interpret, fmt, dtype):
    """Against the kernels' arithmetic (int4: in float64, partial sums exact, activations rounded to
    11-bit integers per group of 32; int8: the dequantized matrix's product), against a float32
    product with the dequantized matrix, and within the format's rounding of the float matrix; rows
    1..n of 40 the same bits alone as among them (int4: the one-row kernel up to GEMV_ROWS rows, 16-,
    32- and 64-row tiles past that; int8: 64-row tiles, a row at the same place in its tile)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(80, 160, generator=g) * 0.05  # 5 groups a row: steps of 1 group
    x = torch.randn(40, 160, generator=g).to(dtype)
    m, y, ref = interpreted_product(fmt, w, x)
    assert y.dtype == dtype and y.shape == (40, 80)
    bound = (1e-6 if fmt == "int4" else 1e-5) if dtype == torch.float32 else 2e-3
    assert (y.float() - ref).abs().max() <= bound * ref.abs().max()
    deq = x.float() @ gpu_quant.dequantized(m).T
    assert (y.float() - deq).abs().max() <= 2e-3 * deq.abs().max()
    exact = x.float() @ w.T
    assert (y.float() - exact).abs().max() <= (0.1 if fmt == "int4" else 0.02) * exact.abs().max()
    for rows in (1, 5, 33):  # int4: the one-row kernel, a 16-row and a 64-row tile
        assert torch.equal(m(x[:rows]), y[:rows]), f"{rows} rows"


def test_interpreted_int8_head_tiles_give_a_row_the_same_bits(interpret, monkeypatch):
    """An LM head's int8 tiles (int8_mm's TRANS form up to 32 rows and over 64, the row-major one
    between): the dequantized matrix's product, and a row's bits alone as among 200 by the TRANS form's
    tiles of 16 to 256 rows. (That the two forms give a row the same bits is a fact of the tensor cores,
    checked on the GPU by bench/gpu_quant.py --part check: the interpreter's products add in numpy's order.)"""
    monkeypatch.setattr(gpu_quant, "HEAD_ROWS", 64)  # (a vocabulary the interpreter multiplies quickly)
    g = torch.Generator().manual_seed(5)
    w = torch.randn(80, 256, generator=g) * 0.05
    x = torch.randn(200, 256, generator=g).half()
    m = gpu_quant.quantize(w, "int8")
    assert [gpu_quant.int8_trans(80, x.dtype, *gpu_quant.int8_config(80, 256, x.dtype, rows)[:2])
            for rows in (1, 20, 40, 100, 200)] == [True, True, False, True, True]
    y = m(x)
    ref = x.float() @ gpu_quant.dequantized(m).to(x.dtype).float().T
    assert (y.float() - ref).abs().max() <= 2e-3 * ref.abs().max()
    for rows in (1, 20, 100):
        assert torch.equal(m(x[:rows]), y[:rows]), f"{rows} rows"
    assert (m(x[:40]).float() - ref[:40]).abs().max() <= 2e-3 * ref.abs().max()


@pytest.mark.parametrize("fmt", ["int4"])
def test_interpreted_one_row_kernel_gives_a_row_the_tiled_kernel_s_bits(interpret, fmt, monkeypatch):
    """A row alone (the one-row kernel, CUDA cores on a GPU) and the same row among 7 others (the
    16-row tile, tensor cores): the same bits, by default and with K forced into 2 parts (steps of
    4 groups), a tile's program a part or every part (added in the tile as invariant.add_parts
    adds them), and with a 64-row tile; an outlier in a group."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(32, 512, generator=g) * 0.05
    x = torch.randn(8, 512, generator=g).half()
    x[3, 7] = 60.0  # a group whose other entries round coarser
    m = gpu_quant.quantize(w, fmt)
    assert gpu_quant.qmm_config(32, 512, x.dtype, 1, fmt)[0] == 1
    assert gpu_quant.qmm_config(32, 512, x.dtype, 8, fmt)[0] == 16
    among = m(x)
    assert torch.equal(m(x[3:4]), among[3:4])
    parts = m.mm_parts(x, (16, 32, 4, 1, 2))
    assert parts.shape[0] == 2
    monkeypatch.setattr(gpu_quant, "SUM_PARTS_ROWS", 8)  # the tile adds the 2 parts itself
    summed = m.mm_parts(x, (16, 32, 4, 1, 2))
    assert summed.shape == (1, 8, 32) and summed.dtype == x.dtype
    assert torch.equal(invariant.add_parts(parts, x.dtype), summed[0])
    monkeypatch.undo()
    assert torch.equal(m.mm_parts(x[3:4], (1, 16, 1, 1, 2)), parts[:, 3:4])
    assert torch.equal(m.mm_parts(x, (64, 32, 4, 1, 2)), parts)
    ref = exact_product(m, x)
    assert (among.float() - ref).abs().max() <= 1e-3 * ref.abs().max()


def test_interpreted_parts_of_k_are_added_in_order(interpret, monkeypatch):
    """int4: a matrix of few outputs is summed in parts of K fixed by its shape (quant_parts: 3 parts
    of 256 here), added in order (invariant.add_parts, or the tiled kernel itself), rows alike alone or
    together; int8: a matrix with few outputs and K >= 2048 (invariant.quant_parts) in two parts."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 768, generator=g) * 0.05
    x = torch.randn(3, 768, generator=g).half()
    m, _, ref = interpreted_product("int4", w, x)
    parts = m.mm_parts(x, (1, 16, 4, 1, 3))  # the one-row kernel, 3 parts of K
    assert parts.shape == (3, 3, 16) and parts.dtype == torch.float32
    assert torch.equal(m.mm_parts(x, (16, 16, 4, 1, 3)), parts)  # the tiled kernel: the same parts
    # `added` (o's and down's, for add_norm): the one-row kernel's last program of a row's column block adds
    # the parts in order, in float32, into one part; its counts back at zero for the next product
    added = m.mm_parts(x, (1, 16, 4, 1, 3), added=True)
    assert added.shape == (1, 3, 16) and added.dtype == torch.float32 and not m._counts.any()
    assert torch.equal(added[0], parts[0] + parts[1] + parts[2])
    assert torch.equal(m.mm_parts(x[1:], (1, 16, 4, 1, 3), added=True)[0], added[0, 1:])
    r, norm = torch.randn(3, 16, generator=g).half(), (1 + 0.1 * torch.randn(16, generator=g)).half()
    once, each = fused.add_norm(added, r, norm, 1e-5), fused.add_norm(parts, r, norm, 1e-5)
    assert torch.equal(once[0], each[0]) and torch.equal(once[1], each[1])
    monkeypatch.setattr(gpu_quant, "SUM_PARTS_ROWS", 3)  # or, from SUM_PARTS_ROWS rows, their sum by the tile
    summed = m.mm_parts(x, (16, 16, 4, 1, 3))
    assert summed.shape == (1, 3, 16) and torch.equal(summed[0], invariant.add_parts(parts, x.dtype))
    y = invariant.add_parts(parts, x.dtype)
    assert torch.equal(y, (parts[0] + parts[1] + parts[2]).half())
    assert (y.float() - ref).abs().max() <= 1e-3 * ref.abs().max()
    w = torch.randn(32, 2304, generator=g) * 0.05  # 2304 = 2048 + 256: parts of 1280 and 1024
    x = torch.randn(3, 2304, generator=g).half()
    assert invariant.quant_parts(32, 2304) == 2
    m, y, ref = interpreted_product("int8", w, x)
    parts = m.mm_parts(x)
    assert parts.shape == (2, 3, 32) and parts.dtype == torch.float32
    assert torch.equal(y, (parts[0] + parts[1]).half())
    assert (y.float() - ref).abs().max() <= 2e-3 * ref.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interpreted_add_norm_and_silu_mul_round_as_round_rows(interpret, dtype):
    """fused.add_norm's and fused.silu_mul's `rounded`: the rows they write rounded for the one-row
    int4 kernel, in their own launch, are round_rows' bytes, a and S exactly (an outlier in a group; a
    width whose block has groups past it: 96 of add_norm's 128, 1504 of silu_mul's 6 blocks of 256)."""
    g = torch.Generator().manual_seed(5)
    M, N = 3, 96
    x = torch.randn(M, N, generator=g).to(dtype)
    x[1, 40] = 30.0
    w = (1 + 0.1 * torch.randn(N, generator=g)).to(dtype)
    ws = torch.randn(2, M, N, generator=g)
    xo, h, (xd, aux) = fused.add_norm(ws, x, w, 1e-5, rounded=True)
    assert torch.equal((xo, h)[1], fused.add_norm(ws, x, w, 1e-5)[1])
    want = gpu_quant.round_rows(h, gpu_quant_kernels.LAYOUT_DP)
    assert torch.equal(xd, want[0]) and torch.equal(aux, want[1])
    gu = torch.randn(2, 2 * 1504, generator=g).to(dtype)
    out, (xd, aux) = fused.silu_mul(gu, True)
    assert torch.equal(out, fused.silu_mul(gu))
    want = gpu_quant.round_rows(out, gpu_quant_kernels.LAYOUT_DP)
    assert torch.equal(xd, want[0]) and torch.equal(aux, want[1])
    with pytest.raises(ValueError, match="multiple of 32"):
        fused.silu_mul(torch.zeros(1, 2 * 40, dtype=dtype), True)


def two_llama_layers(path: Path) -> Path:
    """A random 2-layer Llama's model directory (hidden 64, MLP 96, 2 heads of 32, 1 KV head), written
    directly: transformers' import alone takes longer than the kernels' tests."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
           "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
           "torch_dtype": "float32"}
    (path / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    shapes = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (32, 64), "self_attn.v_proj": (32, 64),
              "self_attn.o_proj": (64, 64), "mlp.gate_proj": (96, 64), "mlp.up_proj": (96, 64),
              "mlp.down_proj": (64, 96)}
    t = {}
    for layer in range(2):
        t |= {f"model.layers.{layer}.{k}.weight": torch.randn(*s, generator=g) * 0.1 for k, s in shapes.items()}
        for norm in ("input_layernorm", "post_attention_layernorm"):
            t[f"model.layers.{layer}.{norm}.weight"] = 1 + 0.1 * torch.randn(64, generator=g)
    save_file(t, str(path / "model.safetensors"))
    return path


def test_interpreted_fused_layers_with_quantized_matrices_match_the_forward(interpret, tmp_path, monkeypatch):
    """Two layers whose matrices are in int4 by the Triton kernels: stage_node.fused's layer loop (its
    products' parts by gpu_quant through invariant.mm / mm_parts) gives the plain forward's hidden
    states (whose products are the same matrices' own calls) and the same keys and values. (The
    default RoPE given here: reading it imports transformers, longer than the test.)"""
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float) / 32)
    monkeypatch.setattr(shard_module, "rope_parameters", lambda model_dir, kind="full": (inv_freq, 1.0))
    shard = Shard.load(two_llama_layers(tmp_path), 0, 2, first=False, last=False)
    shard.layers = [dataclasses.replace(w, **{name: gpu_quant.quantize(getattr(w, name), "int4")
                                              for name in ("qkv", "o", "gate_up", "down")}) for w in shard.layers]
    shard._plain = None
    bs = 4
    pools = [shard.new_pool(4, bs) for _ in range(2)]
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    seqs = (seq_slice(0, 5, [0, 1], bs),)
    write = torch.arange(5)
    want = shard.forward(x, StepKV(pools[0], write, seqs))
    shard.batch_invariant = True
    kv = StepKV(pools[1], write, seqs)
    table, positions, tiles, _ = shard._invariant_reads(kv)
    rope = shard.ropes["full"]

    def attend(i, q, rounded=False):
        return invariant.attention(q, kv.pool.k[i], kv.pool.v[i], table, positions, tiles, scale=shard._scale,
                                   rounded=rounded)

    got = shard.layers_fused(x, positions, write, kv.pool.kv, {"full": (rope.cos, rope.sin_signed)}, attend)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pools[1].kv[:, :, :, :5], pools[0].kv[:, :, :, :5], rtol=1e-4, atol=1e-4)
    # 2 rows (the one-row kernel): their inputs rounded by add_norm, attention's merge and silu_mul, or by
    # round_rows' pre-pass (the fused rounding off): the same bits, and the rounding is taken (no pre-pass)
    rows = StepKV(pools[1], torch.tensor([8, 9]), (seq_slice(0, 2, [2], bs),))
    table, positions, tiles, _ = shard._invariant_reads(rows)
    kv = rows
    assert shard._rounds(shard.layers[0].qkv, 2) and not shard._rounds(shard.layers[0].qkv, 4)
    calls = []
    monkeypatch.setattr(gpu_quant, "round_rows", lambda x, layout, f=gpu_quant.round_rows: calls.append(x.shape) or
                        f(x, layout))
    two = shard.layers_fused(x[:2], positions, rows.write_slots, kv.pool.kv, {"full": (rope.cos, rope.sin_signed)},
                             attend)
    assert calls == []
    monkeypatch.setattr(shard, "_rounds", lambda m, rows: False)
    calls.clear()
    again = shard.layers_fused(x[:2], positions, rows.write_slots, kv.pool.kv, {"full": (rope.cos, rope.sin_signed)},
                               attend)
    assert torch.equal(two, again) and len(calls) == 8
    shard.device = torch.device("cuda")  # (only the check: nothing runs) a CUDA stage would take the fused loop
    assert shard.fused_layers
