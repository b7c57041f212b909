"""Gated delta-net linear attention (Qwen3.5, Qwen3-Next; common.families.LinearAttn) over packed rows.

A linear-attention layer keeps no KV: per sequence it keeps a state of fixed size, the last
`conv_kernel - 1` inputs of its causal depthwise convolution (`window`, [conv_dim, K - 1]) and, per
value head, a matrix S ([value_heads, key_dim, value_dim], float32). A row at position t:

    q, k, v = split(SiLU(conv(window ++ x_t W_qkv)))      q, k L2-normed per head, q times key_dim ** -0.5
    g = -exp(A_log) softplus(x_t W_a + dt_bias)            beta = sigmoid(x_t W_b)
    S = exp(g) S ;  S += k (beta (v - S^T k))^T            (the delta rule, per value head)
    o = S^T q ;  out = (RMSNorm(o) w) SiLU(x_t W_z) W_out

Prompt rows go by the chunked form (64 rows a chunk: the within-chunk part as matrix products through
the UT transform, the state carried between chunks), decode rows (generated tokens, candidates) one
by one by the recurrence above, as transformers does for prefill and for decode. Each sequence is
computed on its own rows and state, so a row never depends on what else is in its step, and a decode
row goes by the same arithmetic with or without candidates, alone or in a replay.

The states a step starts from and those it must leave behind come with the step (`SeqState`, one per
sequence: the engine keeps them by position, stage_node.engine.states): a step leaves the state at
each position it is asked to `keep` (where the next step may start: after its last row, after each
candidate's row and before its last row), computing its rows in runs split at those positions.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from logicpipe.common.families import LinearAttn
from logicpipe.stage_node.model.ops import Rows, linear, rowwise

CHUNK = 64  # rows of the chunked form's blocks (transformers' chunk_size)


@dataclass
class SeqState:
    """One sequence's recurrent state in one step: what its linear layers start from, and the positions
    whose state the step must leave (filled into `out` by the forward)."""

    start: dict | None                     # local layer -> (window [conv_dim, K - 1], S [value_heads, key_dim,
                                           # value_dim] float32) at the step's first position; None: zeros (position 0)
    keep: tuple[int, ...] = ()             # absolute positions (after that many tokens) in (start_pos, stop]
    out: dict = field(default_factory=dict)  # position -> {local layer: (window, S)}
    low: int = 0                           # the lowest position the next step may start at (engine.states)


def zeros(lin: LinearAttn, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The state of a sequence at position 0."""
    return (torch.zeros(lin.conv_dim, lin.conv_kernel - 1, dtype=dtype, device=device),
            torch.zeros(lin.value_heads, lin.key_dim, lin.value_dim, dtype=torch.float32, device=device))


def conv(x: torch.Tensor, window: torch.Tensor, taps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal depthwise convolution and its SiLU over a sequence's new rows x [n, conv_dim], after the
    inputs `window` [conv_dim, K - 1] before them; taps [conv_dim, K]. -> ([n, conv_dim], the new window)."""
    k = taps.shape[1]
    xs = torch.cat([window, x.t().to(window.dtype)], dim=1).to(taps.dtype)  # [conv_dim, K - 1 + n]
    out = F.conv1d(xs[None], taps[:, None], groups=taps.shape[0])[0]  # [conv_dim, n]
    return F.silu(out).t().to(x.dtype), xs[:, xs.shape[1] - (k - 1):].to(window.dtype).contiguous()


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule row by row. q, k: [n, heads, key_dim] (L2-normed, q not yet scaled), v: [n, heads,
    value_dim], g, beta: [n, heads], all float32; state [heads, key_dim, value_dim]. -> (o [n, heads,
    value_dim], the state after the last row)"""
    q = q / (q.shape[-1] ** 0.5)
    outs = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        kv_mem = (state * k[t][:, :, None]).sum(-2)  # [heads, value_dim]: what S already predicts for k
        delta = (v[t] - kv_mem) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        outs.append((state * q[t][:, :, None]).sum(-2))
    return torch.stack(outs), state


def chunked_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule over n rows in blocks of `chunk` (same arguments and result as `recurrent_rule`).
    Within a block, the updates' interactions are one lower-triangular solve (the UT transform); the
    state crosses from block to block."""
    n, heads = q.shape[0], q.shape[1]
    q = q * q.shape[-1] ** -0.5
    pad = (-n) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))

    def blocks(x: torch.Tensor) -> torch.Tensor:  # [n + pad, heads, ...] -> [heads, blocks, chunk, ...]
        return x.transpose(0, 1).reshape(heads, -1, chunk, *x.shape[2:])

    k_beta, v_beta = blocks(k * beta[..., None]), blocks(v * beta[..., None])
    q, k = blocks(q), blocks(k)
    decay = blocks(g).cumsum(-1)  # [heads, blocks, chunk]: log of the decay from the block's start
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pair = (decay[..., :, None] - decay[..., None, :]).masked_fill(upper, float("-inf")).exp()  # row i from j
    ut = (k_beta @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(ut, k_beta * decay.exp()[..., None], upper=False, unitriangular=True)
    q = q * decay.exp()[..., None]
    k = k * (decay[..., -1:] - decay).exp()[..., None]
    block_decay = decay[..., -1].exp()[..., None, None]  # [heads, blocks, 1, 1]
    out = torch.empty_like(new_values)
    for i in range(q.shape[1]):
        v_new = new_values[:, i] - k_decayed[:, i] @ state
        out[:, i] = q[:, i] @ state + intra[:, i] @ v_new
        state = state * block_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(heads, -1, out.shape[-1])[:, :n].transpose(0, 1), state


def runs(start: int, stop: int, decode_from: int, keep) -> list[tuple[int, int]]:
    """A sequence's rows [start, stop) cut where the prompt rows end and at every position to keep."""
    cuts = sorted({start, stop} | {p for p in (decode_from, *keep) if start < p < stop})
    return list(zip(cuts, cuts[1:]))


def mix(h: torch.Tensor, w, lin: LinearAttn, seqs, states, layer: int, rows: Rows, eps: float) -> torch.Tensor:
    """The token mixer of linear-attention layer `layer` (local) over the normed rows h [T, hidden] of
    `seqs` (kv.SeqSlice, packed in order), each from its `states` entry (SeqState; None: zeros, nothing
    kept: a warm-up); w: DeltaNetWeights; eps: the output norm's. -> [T, hidden]"""
    kh, vh, kd, vd = lin.key_heads, lin.value_heads, lin.key_dim, lin.value_dim
    proj = linear(h, w.in_proj, None, rows)  # [T, q + k + v + z + b + a]
    c = lin.conv_dim
    z = proj[:, c: c + vh * vd]
    beta = rowwise(torch.sigmoid, proj[:, c + vh * vd: c + vh * vd + vh])
    g = -w.a_log.float().exp() * rowwise(F.softplus, proj[:, c + vh * vd + vh:].float() + w.dt_bias)  # [T, value_heads]
    group = vh // kh
    outs, row = [], 0
    for j, s in enumerate(seqs):
        st = states[j] if states is not None else None
        window, state = st.start[layer] if st is not None and st.start is not None else zeros(lin, h.dtype, h.device)
        for a, b in runs(s.start_pos, s.stop, s.decode_from, st.keep if st is not None else ()):
            r = slice(row + a - s.start_pos, row + b - s.start_pos)
            x, window = conv(proj[r, :c], window, w.conv)
            n = b - a
            q = l2norm(x[:, : kh * kd].float().view(n, kh, kd))
            k = l2norm(x[:, kh * kd: 2 * kh * kd].float().view(n, kh, kd))
            if group > 1:  # each key head serves `group` consecutive value heads
                q, k = q.repeat_interleave(group, 1), k.repeat_interleave(group, 1)
            v = x[:, 2 * kh * kd:].float().view(n, vh, vd)
            rule = recurrent_rule if a >= s.decode_from else chunked_rule
            o, state = rule(q, k, v, g[r], beta[r].float(), state)
            outs.append(o.to(h.dtype))
            if st is not None and b in st.keep:
                st.out.setdefault(b, {})[layer] = (window, state)
        row += s.num_tokens
    o = torch.cat(outs) if len(outs) > 1 else outs[0]  # [T, value_heads, value_dim]
    normed = w.norm * F.rms_norm(o.float(), (vd,), None, eps).to(h.dtype)  # transformers' RMSNormGated
    gated = (normed * F.silu(z.float().view(-1, vh, vd))).to(h.dtype)
    return linear(gated.reshape(h.shape[0], vh * vd), w.out, None, rows)
