"""Multi-head latent attention (DeepSeek V2/V3, Kimi K2), absorbed: the KV cache holds each token's
latent row [c ; k_rope] (kv_lora_rank + rope_dim elements per layer, common.families.MLA) and no head
is ever expanded from it.

A head's key is [W_uk c ; k_rope] and its value W_uv c. So q·k = (W_uk^T q_nope)·c + q_rope·k_rope and
the output W_uv (sum p c): the query's no-rope part is multiplied by W_uk^T once per row (`q_lat`), the
attention is multi-query attention of every head over the one latent row (keys: the whole row,
values: its first kv_lora_rank elements), and W_uv is applied once per row to the attended latent.
Prompt and decode rows go the same way (one arithmetic for a token, however it was batched; the
latent is what a replay recomputes). transformers expands the keys and values per head instead; the
two differ by float rounding only (the same products, summed in another order).

The per-head products (`head_mm`) go through fixed-size chunks of rows, so a row's result never
depends on how many rows share its step (the batch-invariance of stage_node.model.ops, here for
products batched over heads).
"""
from __future__ import annotations

import torch

from logicpipe.common.families import MLA
from logicpipe.stage_node.model.ops import Rows, linear, rms_norm
from logicpipe.stage_node.model.rope import apply_rope
from logicpipe.stage_node.model.weights import LayerWeights

HEAD_CHUNK = 8  # rows per batched per-head product: every chunk has this shape, the last padded
LATENT_EPS = 1e-6  # the q and kv latents' RMSNorm epsilon (transformers' DeepSeek norms use their default)


def head_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, K] @ w: [heads, K, N] per head -> [T, heads, N], HEAD_CHUNK rows at a time (the
    last chunk padded with copies of its last row), so every product has one shape."""
    T = x.shape[0]
    xt = x.transpose(0, 1)  # [heads, T, K]
    outs = []
    for a in range(0, T, HEAD_CHUNK):
        part = xt[:, a: a + HEAD_CHUNK]
        n = part.shape[1]
        if n < HEAD_CHUNK:
            part = torch.cat([part, part[:, -1:].expand(-1, HEAD_CHUNK - n, -1)], 1)
        outs.append(torch.bmm(part.contiguous(), w)[:, :n])  # one layout for every chunk
    return (outs[0] if len(outs) == 1 else torch.cat(outs, 1)).transpose(0, 1)


def mla_attention(i: int, w: LayerWeights, h: torch.Tensor, mla: MLA, heads: int, cos: torch.Tensor,
                  sin: torch.Tensor, rows: Rows, attend) -> torch.Tensor:
    """Layer i's attention over h [T, hidden] (already normed) -> [T, heads * v_dim] (before o_proj).
    cos, sin: the rotary tables at the rows' positions [T, rope_dim]; attend(i, q, k, None): writes the
    rows' latent rows k [T, 1, latent] to the cache and attends q [T, heads, latent] over it with the
    latent part of each row as values -> [T, heads * (kv_lora_rank or latent)]."""
    m = w.mla
    T = h.shape[0]
    qk = mla.nope_dim + mla.rope_dim
    a = linear(h, w.qkv, w.qkv_bias, rows)  # [T, q part + kv_lora + rope]
    q_size = a.shape[1] - mla.latent
    q, c, k_rope = a[:, :q_size], a[:, q_size: q_size + mla.kv_lora_rank], a[:, q_size + mla.kv_lora_rank:]
    if m.q_b is not None:
        q = linear(rms_norm(q, m.q_norm, LATENT_EPS), m.q_b, None, rows)  # [T, heads * qk]
    q = q.view(T, heads, qk)
    c = rms_norm(c, m.kv_norm, LATENT_EPS)  # [T, kv_lora]
    q_rope = apply_rope(q[:, :, mla.nope_dim:], cos, sin)  # [T, heads, rope]
    k_rope = apply_rope(k_rope[:, None], cos, sin)  # [T, 1, rope]
    q_lat = head_mm(q[:, :, : mla.nope_dim], m.uk)  # [T, heads, kv_lora]
    out = attend(i, torch.cat([q_lat, q_rope], -1), torch.cat([c[:, None], k_rope], -1), None)
    o_lat = out.view(T, heads, -1)[:, :, : mla.kv_lora_rank]  # [T, heads, kv_lora]
    return head_mm(o_lat, m.uv).reshape(T, heads * mla.v_dim)  # [T, heads * v]
