"""The int4 / int8 CPU kernels (stage_node.kernels.cpu_native, quant): each available kernel against
the float product of its own dequantized weights, a row's bits whatever its batch, odd shapes, the
portable C build, the fallback without a compiler, the choice by timing, and the default model's
greedy tokens through the native int4 kernel against float32.

Error bounds. Both kernels multiply by exactly the dequantized weights W; what they round is the
activations. The native kernel quantizes each block of 32 activations to int16 with the step
dx = max|x| / 32767 (round to nearest), so each x[k] moves by at most dx / 2 and a product by at most
sum_k |W[n, k]| * dx(k) / 2; then it sums in float32 (integer within a group, exact), whose own error
is below what we allow besides (1e-5 of sum |W| |x|). torch's kernels round x to bf16 (8 bits: at
most 2^-9 relative) and their output to bf16: sum |W| |x| * 2^-9 + |y| * 2^-9, with the same slack.
"""
from __future__ import annotations

import logging

import pytest
import torch

from logicpipe.stage_node.kernels import cpu_native, quant
from logicpipe.stage_node.kernels.quant import Int4Packed, Int8Packed, QuantError, choose_cpu_kernel, quantize
from logicpipe.stage_node.model.shard import Shard

from .test_quant import TOKENS, forced  # (the `reference` fixture, the float32 model's greedy tokens: conftest)

NATIVE = pytest.mark.skipif(cpu_native.library() is None, reason="no native CPU kernels here (no C compiler)")
KERNELS = [pytest.param("torch"), pytest.param("native", marks=NATIVE)]


@pytest.fixture(scope="module")
def portable(tmp_path_factory):
    """The library built as portable C (no SIMD flags), as on a CPU without AVX2 or NEON."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOGICPIPE_CACHE", str(tmp_path_factory.mktemp("cache")))
        lib = cpu_native.build(cpu_native.compile_flags(machine="other"))
    if lib is None:
        pytest.skip("no C compiler here")
    assert cpu_native.isa(lib) == "portable C"
    return lib


def dequantized(m, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, the float [out, in] weights m multiplies by) of m = quantize(w, ...), from its grid: the
    quantizer's own rounding of w to it."""
    out, inp = m.shape
    if isinstance(m, Int4Packed):
        scale, zero = (t[..., None] for t in m.grid())  # [out, groups, 1]
        g = w.reshape(out, -1, m.group)
        q = ((g - zero) / scale + 8.0).round().clamp(0, 15)
        return q.reshape(out, inp), ((q - 8) * scale + zero).reshape(out, inp)
    scale = m.grid()[:, None]
    q = (w / scale).round().clamp(-127, 127)
    return q.to(torch.int8), q * scale


def bound(kernel: str, w: torch.Tensor, x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """The largest |error| the activations' rounding allows, per output (module docstring)."""
    w = w.reshape(w.shape[0], -1)
    mag = x.abs() @ w.abs().T  # [rows, out]
    if kernel == "torch":
        return mag * 2**-9 + ref.abs() * 2**-9 + 1e-5 * mag + 1e-6
    xp = torch.nn.functional.pad(x, (0, -x.shape[1] % 32))
    step = (xp.abs().reshape(x.shape[0], -1, 32).amax(-1) / 32767).repeat_interleave(32, 1)[:, : x.shape[1]]  # [rows, in]
    return step @ w.abs().T / 2 + 1e-5 * mag + 1e-6


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("fmt, shape", [("int4", (208, 96)), ("int4", (16, 32)), ("int4", (48, 1536)),
                                        ("int8", (203, 70)), ("int8", (5, 33)), ("int8", (203, 72)), ("int8", (96, 64))])
def test_a_kernel_multiplies_by_its_dequantized_weights(fmt, shape, kernel):
    """Within the activations' rounding (module docstring), for every row, on shapes that are and are
    not multiples of the tiles (4 features, 2 rows, 32 inputs). torch's int8 kernel takes input
    sizes that are multiples of 16 only (it crashes on others: refused; 72 on an AVX-512 CPU)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(*shape, generator=g) * 0.05
    if kernel == "torch" and fmt == "int8" and shape[1] % 16:
        with pytest.raises(QuantError, match="multiple of 16"):
            quantize(w, fmt, kernel)
        return
    m = quantize(w, fmt, kernel)
    assert m.kernel == kernel
    _, deq = dequantized(m, w)
    assert (deq - w).abs().max() <= 0.6 * w.abs().max() / (7 if fmt == "int4" else 127)  # the format's own error
    for rows in (1, 2, 3, 17):
        x = torch.randn(rows, shape[1], generator=g)
        ref = x.double() @ deq.double().T
        err = (m(x).double() - ref).abs()
        assert (err <= bound(kernel, deq.double(), x.double(), ref)).all(), f"{fmt} {shape} {rows} rows"
        assert err.max() <= 0.02 * ref.abs().max()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_a_row_has_the_same_bits_among_1_3_17_or_64_rows(fmt, kernel):
    g = torch.Generator().manual_seed(4)
    m = quantize(torch.randn(112, 160, generator=g) * 0.05, fmt, kernel)
    x = torch.randn(64, 160, generator=g)
    full = m(x)
    for rows in (1, 3, 17, 64):
        for at in {0, 64 - rows, (64 - rows) // 2}:
            assert torch.equal(m(x[at: at + rows]), full[at: at + rows]), f"{rows} rows at {at}"


def test_the_portable_c_build_computes_the_same_products(portable):
    """The build for CPUs without AVX2 or NEON: within the same bound, rows invariant, and any
    number of output features (the kernel pads to tiles of 4; int4 via pack_int4 directly)."""
    g = torch.Generator().manual_seed(5)
    for fmt, (n, k) in (("int4", (30, 64)), ("int8", (203, 70))):
        w = torch.randn(n, k, generator=g) * 0.05
        if fmt == "int4":
            m = Int4Packed(torch.cat([w, w[:2]]), kernel="native")  # 32 rows (int4's rule), then 30 of them
            q, deq = (t[:n] for t in dequantized(m, torch.cat([w, w[:2]])))
            packed, s = cpu_native.pack_int4(q, *(t[:n].to(torch.bfloat16) for t in m.grid()))
            fn = portable.lp_int4_mm
        else:
            m = Int8Packed(w, kernel="native")
            q, deq = dequantized(m, w)
            packed, s = cpu_native.pack_int8(q, m.grid())
            fn = portable.lp_int8_mm
        x = torch.randn(17, k, generator=g)
        y = cpu_native.call(fn, x, packed.data_ptr(), s.data_ptr(), n)
        ref = x.double() @ deq.double().T
        assert ((y.double() - ref).abs() <= bound("native", deq.double(), x.double(), ref)).all(), fmt
        for rows in (1, 3):
            assert torch.equal(cpu_native.call(fn, x[5: 5 + rows], packed.data_ptr(), s.data_ptr(), n), y[5: 5 + rows]), fmt


@pytest.fixture
def fresh_choice(monkeypatch):
    """The process's kernel choice and library forgotten for the test, restored after."""
    monkeypatch.setattr(quant, "_chosen", {})
    cpu_native.library.cache_clear()
    yield
    cpu_native.library.cache_clear()


@pytest.mark.parametrize("cc", ["/nonexistent/cc", "false"])
def test_without_a_working_compiler_torch_kernels_run(cc, fresh_choice, monkeypatch, tmp_path, caplog):
    """No compiler, or one that fails: one log line, and int4 / int8 run on torch's kernels."""
    monkeypatch.setenv("LOGICPIPE_CACHE", str(tmp_path))
    monkeypatch.setenv("LOGICPIPE_CC", cc)
    with caplog.at_level(logging.INFO, logger="logicpipe.stage_node.kernels"):
        assert cpu_native.library() is None
        assert choose_cpu_kernel("int4", force="native") == "torch"
    off = [r for r in caplog.records if "native CPU kernels off" in r.getMessage()]
    assert len(off) == 1 and ("no C compiler" if cc.startswith("/") else "could not build") in off[0].getMessage()
    assert quantize(torch.randn(16, 32), "int4").kernel == "torch" and quantize(torch.randn(4, 16), "int8").kernel == "torch"
    assert not list((tmp_path / "kernels").glob("*.so"))


@NATIVE
def test_the_kernel_is_chosen_by_timing_unless_forced(fresh_choice, monkeypatch, caplog):
    monkeypatch.setenv("LOGICPIPE_CPU_KERNEL", "torch")
    assert choose_cpu_kernel("int4") == "torch" and quant.cpu_kernel("int4") == "torch"
    monkeypatch.setenv("LOGICPIPE_CPU_KERNEL", "native")
    assert choose_cpu_kernel("int8") == "native" and quantize(torch.randn(4, 8), "int8").kernel == "native"
    monkeypatch.setenv("LOGICPIPE_CPU_KERNEL", "fastest")
    with pytest.raises(QuantError, match="use native, torch or auto"):
        choose_cpu_kernel("int4")
    monkeypatch.delenv("LOGICPIPE_CPU_KERNEL")
    with caplog.at_level(logging.INFO, logger="logicpipe.stage_node.kernels.quant"):
        chosen = choose_cpu_kernel("int4")
    times = quant.time_cpu_kernels("int4", rounds=1)
    assert chosen in ("native", "torch") and set(times) == {"native", "torch"}
    assert any("int4 CPU kernel: " + chosen in r.getMessage() and "torch" in r.getMessage() for r in caplog.records)


@pytest.fixture(scope="module")
def int4_by_kernel(model_dir):
    """The default model in one int4 shard (head in int8) per kernel."""
    out = {}
    for kernel in ("torch", "native"):
        if kernel == "native" and cpu_native.library() is None:
            continue
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(quant, "_chosen", {"int4": kernel, "int8": kernel})
            out[kernel] = Shard.load(model_dir, 0, 30, first=True, last=True, quantize="int4")
    return out


@NATIVE
def test_native_int4_agrees_with_float32_as_well_as_torchs(int4_by_kernel, reference, record_property):  # noqa: F811
    """Teacher-forced on the float32 model's greedy tokens (test_quant's 5 prompts x 48 tokens), the
    int4 model through the native kernels predicts the same next token at least as often as through
    torch's, but for one position of the 240 (either may win a near-tie)."""
    agreement = {}
    for kernel, shard in int4_by_kernel.items():
        assert shard.layers[0].qkv.kernel == kernel and shard.lm_head.kernel == kernel
        same = sum(int((forced(shard, ids)[n - 1: -1] == torch.tensor(ids[n:])).sum()) for n, ids in reference)
        agreement[kernel] = same / (TOKENS * len(reference))
        record_property(f"int4_{kernel}_agreement", agreement[kernel])
    print("int4 teacher-forced agreement with float32:", agreement)
    assert agreement["native"] >= 0.75 and agreement["native"] >= agreement["torch"] - 1 / 240


@NATIVE
def test_a_matrix_torchs_int8_kernel_cannot_take_runs_on_the_native_one_when_torch_was_only_chosen(fresh_choice):
    """torch's int8 kernel crashes on an input size not a multiple of 16 (72 on an AVX-512 CPU): where the
    process chose it by timing, such a matrix takes the native kernel; asked for by name, it is refused."""
    quant.set_cpu_kernel("int8", "torch")
    w = torch.randn(40, 72, generator=torch.Generator().manual_seed(5)) * 0.05
    m = quantize(w, "int8")
    assert m.kernel == "native" and quantize(torch.randn(40, 64), "int8").kernel == "torch"
    x = torch.randn(17, 72)
    _, deq = dequantized(m, w)
    assert (m(x).double() - x.double() @ deq.double().T).abs().max() <= 0.02 * (x @ deq.T).abs().max()
    with pytest.raises(QuantError, match="multiple of 16"):
        quantize(w, "int8", "torch")
