"""The forward's math: matrix products that give every row the same result whatever else is in the
batch, HF's RMSNorm (Llama's and Gemma's), the gated MLP's activations, masks and attention.

Why the matrix products are split by row kind. A BLAS picks its kernel by the shape of the
product, and different kernels round differently, so a row's result can depend on how many other
rows share the step. Measured on MKL (torch's CPU BLAS, torch 2.13): `x @ w.T` computes rows in
panels of 4, the rows of a last, partial panel by another kernel; `w @ x.T` (x a transposed view)
gives the same columns for 4 and 8 rows (not for 5 to 7), and for those sizes reads the weights
close to the memory's speed (8 rows cost 1.2x one row, where `x @ w.T` costs 2.2x). Within those
shapes a row's result does not depend on its place or its neighbours. So:
  * decode rows (generated tokens, candidates; the rows that are sampled) go through `w @ x.T` in
    chunks of 8, the last padded to 4 or 8;
  * prompt rows go through `x @ w.T` padded to a multiple of 4 rows.
A row's numbers then depend only on its own kind, never on how a step was batched: a request
gives the same tokens alone or among 64 others, and in a replay its generated tokens are
recomputed by the kernel that first computed them.

On a GPU the row kinds do not apply: cuBLAS picks its kernel by the whole product's shape. Rows of a
step marked `invariant` (a CUDA stage with `--batch-invariant`, the default there) go through one
Triton kernel whose tiling and order of the sum over K never depend on the row count, for every
row kind (stage_node.invariant); without it `linear` is plain `x @ w.T` by cuBLAS, and a row's bits
can change with the number of rows in its step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from logicpipe.stage_node.kernels import invariant
from logicpipe.stage_node.kernels.quant import QuantMatrix

MIN_ROWS = 4   # `x @ w.T` computes rows in panels of this many; `w @ x.T` gives the same columns for 4 and 8
DECODE_CHUNK = 8


@dataclass(frozen=True)
class Rows:
    """Which rows of a packed batch are decode rows (the rest are prompt rows)."""

    decode: torch.Tensor | None   # row indices, int64; None with `all_decode` / no decode rows
    prompt: torch.Tensor | None
    all_decode: bool = False
    all_prompt: bool = False
    flags: tuple[bool, ...] = ()  # per row: a decode row (kept when the kinds are mixed)
    invariant: bool = False       # CUDA: every row by the batch-invariant kernel (stage_node.invariant)

    @classmethod
    def split(cls, is_decode: list[bool], device, invariant: bool = False) -> "Rows":
        if invariant:  # one kernel for every kind: the kinds need not be told apart
            return INVARIANT_ROWS
        if all(is_decode):
            return cls(None, None, all_decode=True)
        if not any(is_decode):
            return cls(None, None, all_prompt=True)
        idx = torch.arange(len(is_decode), device=device)
        mask = torch.tensor(is_decode, device=device)
        return cls(idx[mask], idx[~mask], flags=tuple(is_decode))

    def subset(self, rows: list[int], device) -> "Rows":
        """The kinds of `rows` (indices into this batch), as a batch of their own."""
        if self.all_decode or self.all_prompt:
            return self
        return Rows.split([self.flags[r] for r in rows], device)


DECODE_ROWS = Rows(None, None, all_decode=True)
PROMPT_ROWS = Rows(None, None, all_prompt=True)
INVARIANT_ROWS = Rows(None, None, all_decode=True, invariant=True)  # CUDA, --batch-invariant: any kind


VECTOR = 32  # floats: a multiple of the CPU's vectorized loop (2 AVX-512 registers)


def rowwise(fn, x: torch.Tensor) -> torch.Tensor:
    """fn (an elementwise function) of x [T, n] with each row padded to a multiple of VECTOR columns:
    torch's CPU loops compute the elements past the last whole vector by a scalar path that rounds
    otherwise, which would make a row's bits depend on how many rows share its step (a router's 8
    scores a row: alone all scalar, beside two other rows vectorized). CUDA's elementwise kernels
    compute every element alike: no padding there (two kernels fewer a call in a step's graph)."""
    pad = 0 if x.is_cuda else (-x.shape[1]) % VECTOR
    return fn(F.pad(x, (0, pad)))[:, : x.shape[1]] if pad else fn(x)


def _pad(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x if x.shape[0] >= rows else torch.cat([x, x[-1:].expand(rows - x.shape[0], -1)])


def _chunk_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`w @ x.T` of up to 8 rows, padded to 4 or 8 -> [rows, out]"""
    m = x.shape[0]
    return torch.mm(w, _pad(x, MIN_ROWS if m <= MIN_ROWS else DECODE_CHUNK).t()).t()[:m]


def decode_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x: [M, in] @ w: [out, in].T -> [M, out], as `w @ x.T` on chunks of 8 rows, the last padded
    to 4 or 8 (CPU)."""
    if x.is_cuda:
        return F.linear(x, w)
    m = x.shape[0]
    if m <= DECODE_CHUNK:
        return _chunk_mm(x, w).contiguous()
    return torch.cat([_chunk_mm(x[a: a + DECODE_CHUNK], w) for a in range(0, m, DECODE_CHUNK)])


def prompt_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x: [M, in] @ w: [out, in].T -> [M, out], as `x @ w.T` padded to a multiple of 4 rows."""
    m = x.shape[0]
    return F.linear(_pad(x, -(-m // MIN_ROWS) * MIN_ROWS), w)[:m] if m % MIN_ROWS else F.linear(x, w)


def linear(x: torch.Tensor, w, b: torch.Tensor | None, rows: Rows) -> torch.Tensor:
    """x: [T, in], w: [out, in] (+ b: [out]) -> [T, out], each row by its kind's kernel (a
    quantized weight by its own kernel, see `stage_node.quant`)."""
    if isinstance(w, QuantMatrix):
        out = w(x)
        return out if b is None else out + b
    if x.is_cuda:
        return invariant.linear(x, w, b) if rows.invariant else F.linear(x, w, b)
    if rows.all_decode:
        out = decode_mm(x, w)
    elif rows.all_prompt:
        out = prompt_mm(x, w)
    else:
        out = x.new_empty(x.shape[0], w.shape[0])
        out[rows.decode] = decode_mm(x[rows.decode], w)
        out[rows.prompt] = prompt_mm(x[rows.prompt], w)
    return out if b is None else out + b


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    """HF's RMSNorm over the last dim. Llama's: normalise in float32, scale in the model dtype;
    `gemma`: normalise and scale by (1 + weight) in float32, then cast. x: [..., dim]"""
    # F.rms_norm is one fused op, bit-identical in float32 to HF's
    # `x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)` (then scaled in the model dtype)
    if gemma:
        return (F.rms_norm(x.float(), weight.shape, None, eps) * (1.0 + weight.float())).to(x.dtype)
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def head_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    """`rms_norm` of each head of x [T, heads, head_dim], head h scaled by weight[h] ([heads,
    head_dim]): the q and k norms of a layer (Qwen3, Gemma 3) in one call, element by element the
    same as one norm per head kind (fewer kernels in a CUDA graph's layer)."""
    dim = (x.shape[-1],)
    if gemma:
        return (F.rms_norm(x.float(), dim, None, eps) * (1.0 + weight.float())).to(x.dtype)
    if x.dtype == torch.float32:
        return F.rms_norm(x, dim, None, eps) * weight
    return weight * F.rms_norm(x.float(), dim, None, eps).to(x.dtype)


def activation(name: str):
    """The gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, gelu_pytorch_tanh)."""
    return F.silu if name == "silu" else _gelu_tanh


def glu(name: str, *, limit: float | None = None, alpha: float = 1.702):
    """The gated MLP's nonlinearity over its fused gate/up product: a function [rows, 2 * inter] (the
    gate's columns, then the up's) -> [rows, inter]. "silu": act(gate) * up (SwiGLU), "gelu_tanh"
    (GeGLU), "swiglu_oai" (gpt-oss's experts: gate clamped above at `limit`, up to [-limit, limit],
    then gate * sigmoid(alpha * gate) * (up + 1), HF's operations in order). Every MLP (dense,
    experts, shared experts) and every expert kernel calls it between its two products, so a
    family's own gating is written once here."""
    if name == "swiglu_oai":
        if limit is None:
            raise ValueError("the swiglu_oai activation needs its clamp limit (config.json's swiglu_limit)")

        def clamped(gate_up: torch.Tensor) -> torch.Tensor:
            gate, up = gate_up.chunk(2, -1)
            gate = gate.clamp(min=None, max=limit)
            up = up.clamp(min=-limit, max=limit)
            return (up + 1) * (gate * torch.sigmoid(gate * alpha))

        return clamped
    act = activation(name)

    def gated(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, -1)
        return act(gate) * up

    gated.activation = name  # a CUDA kernel may compute it in one launch (stage_node.kernels.grouped: "silu")
    return gated


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma's soft-capping of attention scores and logits); x without a cap."""
    return x if cap is None else torch.tanh(x / cap) * cap


def causal_mask(start_pos: int, n: int, device, window: int | None = None, lo: int = 0) -> torch.Tensor | None:
    """Bool mask [n, start_pos + n - lo] for new rows at start_pos.. over keys at positions lo..
    (with a sliding `window`: each sees only the last `window` positions, its own included), or
    None where SDPA needs none."""
    stop = start_pos + n
    if window is not None and stop > window:
        keys = torch.arange(lo, stop, device=device)
        pos = torch.arange(start_pos, stop, device=device)[:, None]
        return (keys[None, :] <= pos) & (keys[None, :] > pos - window)
    if n == 1 or start_pos == 0:
        return None  # one row sees everything; a fresh prefill uses is_causal
    keys = torch.arange(stop, device=device)
    return keys[None, :] <= torch.arange(start_pos, stop, device=device)[:, None]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *, scale: float,
              cap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [1, heads, n, hd]; k, v: [1, kv_heads, L, hd]; mask: bool [n, L], or None: the n rows see
    everything (n = 1) or are a fresh prefill (causal). -> [1, heads, n, hd]. Without a cap: SDPA
    with grouped-query attention, as HF calls it; with one (Gemma 2), the eager form HF runs:
    scores scaled, soft-capped, masked, softmax in float32. With `sinks` ([heads], gpt-oss): HF's
    eager form with a sink: each head's sink logit joins its rows' scores, the max is taken off,
    softmax in the model dtype, the sink's share dropped."""
    n = q.shape[2]
    if cap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and n > 1, scale=scale,
                                              enable_gqa=True)
    kvh, L = k.shape[1], k.shape[2]
    group = q.shape[1] // kvh
    qg = q.view(1, kvh, group, n, q.shape[3])  # [1, kv_heads, group, n, hd]: head kv * group + g, as repeat_kv orders
    scores = softcap(qg @ k[:, :, None].transpose(-1, -2) * scale, cap)  # [1, kv_heads, group, n, L]
    if mask is None and n > 1:
        mask = torch.ones(n, L, dtype=torch.bool, device=q.device).tril(L - n)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:  # the sink joins each row's scores; the max taken off, softmax in the scores' dtype, its share dropped
        sink = sinks.to(scores.dtype).view(1, kvh, group, 1, 1).expand(1, kvh, group, n, 1)
        combined = torch.cat([scores, sink], dim=-1)  # [1, kv_heads, group, n, L + 1]
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    return (probs.to(v.dtype) @ v[:, :, None]).flatten(1, 2)
