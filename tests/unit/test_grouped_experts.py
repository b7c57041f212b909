"""The grouped-expert kernel of a mixture on CUDA (stage_node.kernels.grouped, issue 33).

  * the alignment (pure torch, on the CPU): every (row, slot) pair once, sorted by expert in pair
    order, each expert's segment padded to whole blocks, each block's expert, fixed sizes;
  * the kernels in Triton's interpreter on the CPU (float32, float16: it has no bfloat16), in a child
    process as tests/unit/test_fused.py does: the one-program alignment equals the torch one, the
    experts equal experts_gathered to rounding, with and without per-expert biases, and a row alone
    and among other rows agree (to the CPU's rounding of glu's vectorised tail);
  * the top k by one program a row (grouped.route) against moe.route's arithmetic;
  * on CUDA (skipped without a GPU; run on the H100, results in docs/models.md): the same in bf16 at
    the Qwen3-30B-A3B expert shape, a row alone vs among 40 rows bit-equal, a CUDA graph's replay
    equal to the eager call, and the whole mixture (experts_forward) against route + gathered.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from logicpipe.stage_node.kernels import grouped
from logicpipe.stage_node.model.moe import experts_gathered
from logicpipe.stage_node.model.ops import glu
from logicpipe.stage_node.model.weights import Experts

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available() and not INTERPRETED


def routes(T: int, E: int, k: int, g: torch.Generator) -> torch.Tensor:
    return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else torch.zeros(0, k, dtype=torch.long)


@pytest.mark.parametrize("T, E, k, bm", [(0, 8, 2, 16), (1, 8, 3, 16), (13, 8, 3, 16), (40, 128, 8, 16), (7, 60, 4, 4)])
def test_align(T, E, k, bm):
    idx = routes(T, E, k, torch.Generator().manual_seed(T))
    ids, experts = grouped.align_torch(idx, E, bm)
    n = grouped.max_blocks(T * k, E, bm)
    assert ids.shape == (n * bm,) and experts.shape == (n,) and ids.dtype == experts.dtype == torch.int32
    flat = idx.reshape(-1).tolist()
    want_ids, want_experts = [], []  # the same by a loop: expert by expert, its pairs in order, padded
    for e in range(E):
        mine = [p for p, x in enumerate(flat) if x == e]
        while len(mine) % bm:
            mine.append(T * k)
        want_ids += mine
        want_experts += [e] * (len(mine) // bm)
    assert ids.tolist() == want_ids + [T * k] * (n * bm - len(want_ids))
    assert experts.tolist() == want_experts + [-1] * (n - len(want_experts))


def test_max_blocks_is_reached():
    """The bound is tight: every pair on its own expert, each a block (decode: one row, k experts)."""
    assert grouped.max_blocks(8, 128) == 8
    _, experts = grouped.align_torch(torch.arange(8)[None], 128)
    assert (experts >= 0).all()


def make_experts(E: int, hidden: int, inter: int, dtype, device, g: torch.Generator, bias: bool) -> Experts:
    def r(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(dtype).to(device)

    return Experts(r(E, hidden), r(E, 2 * inter, hidden, scale=hidden ** -0.5), r(E, hidden, inter, scale=inter ** -0.5),
                   r(E, 2 * inter) if bias else None, r(E, hidden) if bias else None)


def check(dtype, device, E=8, hidden=64, inter=48, k=3, T=13, bias=False, float_weights=False, activation="silu"):
    """grouped.experts against experts_gathered in float32 (the reference), and a row alone and
    among the others bit-equal. -> relative error"""
    g = torch.Generator().manual_seed(E + T + bias)
    w = make_experts(E, hidden, inter, dtype, device, g, bias)
    h = torch.randn(T, hidden, generator=g).to(dtype).to(device)
    idx = routes(T, E, k, g).to(device)
    weights = torch.softmax(torch.randn(T, k, generator=g), -1).to(torch.float32 if float_weights else dtype).to(device)
    act = glu(activation)
    f32 = Experts(*(None if m is None else m.float() for m in (w.router, w.gate_up, w.down, w.gate_up_bias, w.down_bias)))
    ref = experts_gathered(h.float(), f32, weights.float(), idx, act)
    out = grouped.experts(h, w, weights, idx, act)
    assert out.dtype == dtype and out.shape == h.shape
    for r in (0, T // 2, T - 1):
        alone = grouped.experts(h[r:r + 1], w, weights[r:r + 1], idx[r:r + 1], act)
        if device == "cuda":
            assert torch.equal(alone[0], out[r]), r
        else:  # the CPU's torch.silu rounds a vector's tail its own way: the kernels' part is exact, glu not
            assert torch.allclose(alone[0], out[r], rtol=1e-6, atol=1e-6), r
    return ((out.float() - ref).norm() / ref.norm()).item()


def test_kernels_in_triton_interpreter():
    pytest.importorskip("triton")
    if INTERPRETED:
        pytest.skip("this is the child process")
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)), "-k",
                        "interpreted"], check=False, cwd=root, capture_output=True, text=True,
                       env=dict(os.environ, TRITON_INTERPRET="1"), timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-2000:]


@pytest.fixture
def interpret():
    if not INTERPRETED:
        pytest.skip("run in Triton's interpreter by test_kernels_in_triton_interpreter")


@pytest.mark.parametrize("T, E, k", [(1, 8, 3), (13, 8, 3), (40, 128, 8), (300, 128, 8)])
def test_align_kernel_interpreted(interpret, T, E, k):
    idx = routes(T, E, k, torch.Generator().manual_seed(T))
    for a, b in zip(grouped.align_torch(idx, E), grouped.align_triton(idx, E)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
@pytest.mark.parametrize("bias, activation", [(False, "silu"), (True, "silu"), (True, "gelu_tanh")])
def test_experts_interpreted(interpret, dtype, tol, bias, activation):
    assert check(dtype, "cpu", bias=bias, float_weights=bias, activation=activation) <= tol


def check_route(dtype, device, T=37, E=60, k=4):
    """grouped.route (one program a row) against moe.route's arithmetic after the router's product,
    for each config: the same experts in the same order, weights to float rounding."""
    from logicpipe.common.families import MoE

    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(T)).to(dtype).to(device)
    for norm in (False, True):
        for in_float in (False, True):
            moe = MoE(num_experts=E, top_k=k, intermediate_size=8, norm_topk_prob=norm, weights_in_float=in_float,
                      layers=())
            probs = torch.softmax(logits.float(), dim=-1)
            top, want_idx = torch.topk(probs, k, dim=-1)
            if norm:
                top = top / top.sum(dim=-1, keepdim=True)
            want = top if in_float else top.to(dtype)
            weights, idx = grouped.route(logits, moe, dtype)
            assert idx.dtype == torch.int32 and weights.dtype == want.dtype
            # experts of equal logits (16-bit logits tie often) may come in another order than
            # torch.topk's (which does not say its own): the chosen probabilities are torch's top k
            chosen = probs.gather(1, idx.long())
            assert torch.allclose(chosen, probs.gather(1, want_idx), rtol=1e-5, atol=0)
            assert (idx.long() == want_idx).float().mean() > 0.9
            tol = 1e-6 if weights.dtype == torch.float32 else 1e-2
            assert torch.allclose(weights.float(), want.float(), rtol=tol, atol=tol)
            alone = grouped.route(logits[5:6], moe, dtype)
            assert torch.equal(alone[0], weights[5:6]) and torch.equal(alone[1], idx[5:6])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_route_interpreted(interpret, dtype):
    check_route(dtype, "cpu")


# ---- on the GPU -------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (run on the H100: docs/models.md)")


@cuda
@pytest.mark.parametrize("T, E, k", [(1, 128, 8), (40, 128, 8), (3000, 128, 8)])
def test_align_kernel_cuda(T, E, k):
    idx = routes(T, E, k, torch.Generator().manual_seed(T)).cuda()
    for a, b in zip(grouped.align_torch(idx, E), grouped.align_triton(idx, E)):
        assert torch.equal(a, b)


@cuda
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("bias, activation", [(False, "silu"), (True, "silu"), (True, "gelu_tanh")])
def test_experts_cuda(dtype, tol, bias, activation):
    assert check(dtype, "cuda", bias=bias, float_weights=bias, activation=activation) <= tol
    # the Qwen3-30B-A3B expert shape: 128 experts of 768, hidden 2048, top 8; 40 rows
    assert check(dtype, "cuda", E=128, hidden=2048, inter=768, k=8, T=40, bias=bias, activation=activation) <= tol


@cuda
def test_batch_invariant_cuda():
    """A row's bits alone, among 40 rows (other rows on its experts too), among 300, and in a CUDA
    graph's replay: all the same."""
    g = torch.Generator().manual_seed(5)
    E, hidden, inter, k = 128, 2048, 768, 8
    w = make_experts(E, hidden, inter, torch.bfloat16, "cuda", g, False)
    h = torch.randn(300, hidden, generator=g).to(torch.bfloat16).cuda()
    idx = routes(300, E, k, g).cuda()
    idx[1:40:3] = idx[0]  # rows sharing row 0's experts
    weights = torch.softmax(torch.randn(300, k, generator=g), -1).to(torch.bfloat16).cuda()
    act = glu("silu")
    alone = grouped.experts(h[:1], w, weights[:1], idx[:1], act)
    for T in (40, 300):
        assert torch.equal(grouped.experts(h[:T], w, weights[:T], idx[:T], act)[:1], alone), T
    x, r, p = h[:40].clone(), idx[:40].clone(), weights[:40].clone()
    eager = grouped.experts(x, w, p, r, act)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        grouped.experts(x, w, p, r, act)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grouped.experts(x, w, p, r, act)
    graph.replay()
    assert torch.equal(out, eager)
    x.copy_(h[260:300])
    r.copy_(idx[260:300])
    p.copy_(weights[260:300])
    graph.replay()
    assert torch.equal(out, grouped.experts(h[260:300], w, weights[260:300], idx[260:300], act))


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_cuda(dtype):
    check_route(dtype, "cuda")
    check_route(dtype, "cuda", T=300, E=128, k=8)


@cuda
def test_mixture_cuda():
    """experts_forward on CUDA (router by the batch-invariant product, top k and experts by the
    grouped kernels) against route + experts_gathered, and a row alone vs among 40: bit-equal."""
    from logicpipe.common.families import MoE
    from logicpipe.stage_node.model.moe import experts_forward, route
    from logicpipe.stage_node.model.ops import INVARIANT_ROWS

    g = torch.Generator().manual_seed(7)
    w = make_experts(128, 2048, 768, torch.bfloat16, "cuda", g, False)
    moe = MoE(num_experts=128, top_k=8, intermediate_size=768, norm_topk_prob=True, weights_in_float=False, layers=())
    h = torch.randn(40, 2048, generator=g).to(torch.bfloat16).cuda()
    act = glu("silu")
    out = experts_forward(h, w, moe, act, INVARIANT_ROWS)
    weights, idx = route(h, w, moe, INVARIANT_ROWS)
    ref = experts_gathered(h, w, weights, idx, act)
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() <= 1e-2
    for r in (0, 17, 39):
        assert torch.equal(experts_forward(h[r:r + 1], w, moe, act, INVARIANT_ROWS)[0], out[r]), r
