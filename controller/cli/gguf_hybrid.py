"""Qwen3-Next and Qwen3.5 GGUF files (llama.cpp's `qwen3next` and `qwen35` architectures) back into
transformers' checkpoints: config.json from the ssm.* metadata, and each tensor with what llama.cpp's
convert_hf_to_gguf.py did to it undone (Qwen3NextModel.modify_tensors; for Qwen3.5 first
_LinearAttentionVReorderBase.modify_tensors):

    checkpoint (after model.layers.N.)    GGUF (after blk.N.)         what llama.cpp did, undone here
    linear_attn.in_proj_qkvz (Next)       attn_qkv + attn_gate        rows regrouped: q, k, v of all key heads,
                                                                      z apart (HF: per key head q, k, v, z)
                                          ssm_in (older files)        nothing
    linear_attn.in_proj_ba (Next)         ssm_ba                      nothing
    linear_attn.in_proj_qkv (3.5)         attn_qkv                    the v rows' value heads tiled
    linear_attn.in_proj_z (3.5)           attn_gate                   value heads tiled
    linear_attn.in_proj_b / _a (3.5)      ssm_beta / ssm_alpha        value heads tiled
    linear_attn.A_log                     ssm_a                       stored as -exp(A_log) (3.5: tiled)
    linear_attn.dt_bias                   ssm_dt.bias                 (3.5: tiled)
    linear_attn.conv1d.weight             ssm_conv1d.weight           [C, 1, K] squeezed to [C, K] (3.5: v tiled)
    linear_attn.norm.weight               ssm_norm.weight             nothing (the gated norm's plain weight)
    linear_attn.out_proj.weight           ssm_out.weight              (3.5: input columns tiled)
    post_attention_layernorm.weight       post_attention_norm.weight  stored as 1 + w, as every other norm
    self_attn.q_proj.weight               attn_q.weight               nothing (each head's query then its gate)

"Tiled": llama.cpp's Qwen3.5 converter reorders the value heads from grouped by key head (HF: the r
value heads of key head 0, then those of key head 1, ...) to [value head 0 of every key head, value
head 1 of every key head, ...] so that ggml can broadcast q and k; its Qwen3-Next converter does not.
Experts, shared experts and the dense MLP go by gguf_convert's names.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import NamedTuple

from logicpipe.common.modeldir import ModelError

ARCHITECTURES = {"qwen3next": "qwen3_next", "qwen35": "qwen3_5"}
"""GGUF general.architecture -> family (qwen35moe, Qwen3.5's mixture, is not run by the mesh)."""
FAMILIES = tuple(ARCHITECTURES.values())
NAMES = {"post_attention_norm.weight": "post_attention_layernorm.weight"}  # the rest as gguf_convert's _LAYER
TILED = ("qwen3_5",)  # families whose value heads llama.cpp's converter tiles


class Piece(NamedTuple):
    """One checkpoint tensor made from GGUF tensors: `undo` takes the float32 values of `source` and of
    `extra` (each in its GGUF shape, outermost dimension first) and gives the checkpoint's values."""

    name: str
    shape: tuple[int, ...]
    source: object
    undo: Callable | None = None
    extra: tuple = ()


def hybrid_config(config: dict, get, family: str, names: set, src: Path) -> dict:
    """config.json of a Qwen3-Next / Qwen3.5 GGUF: `config` (gguf_convert's common fields) with the
    linear attention from llama.cpp's ssm.* keys (conv_kernel, state_size = key head dim, group_count
    = key heads, time_step_rank = value heads, inner_size = all value heads' dims), which layers are
    linear (those with an ssm_a: llama.cpp's runtime takes every full_attention_interval-th as full),
    RoPE over rope.dimension_count of a head (its M-RoPE sections kept), and Qwen3-Next's experts."""
    layers, head_dim = config["num_hidden_layers"], config["head_dim"]
    try:
        value_heads = int(get("ssm.time_step_rank"))
        lin = dict(linear_conv_kernel_dim=int(get("ssm.conv_kernel")), linear_key_head_dim=int(get("ssm.state_size")),
                   linear_num_key_heads=int(get("ssm.group_count")), linear_num_value_heads=value_heads,
                   linear_value_head_dim=int(get("ssm.inner_size")) // max(value_heads, 1))
    except TypeError:
        raise ModelError(f"{src}: a {family} GGUF needs its ssm.* keys (conv_kernel, state_size, group_count, "
                         "time_step_rank, inner_size)") from None
    linear = [f"blk.{i}.ssm_a" in names for i in range(layers)]
    rope = {"rope_type": "default", **config.pop("rope_scaling", {}), "rope_theta": config.pop("rope_theta"),
            "partial_rotary_factor": int(get("rope.dimension_count", head_dim // 4)) / head_dim}
    sections = get("rope.dimension_sections")
    if sections:  # llama.cpp pads HF's three M-RoPE sections to four; Qwen3.5 ropes them interleaved
        rope.update(mrope_section=[int(s) for s in list(sections)[:3]], mrope_interleaved=True)
    config.update(lin, layer_types=["linear_attention" if x else "full_attention" for x in linear],
                  full_attention_interval=int(get("full_attention_interval", 4)), rope_parameters=rope)
    if family == "qwen3_next":
        experts = int(get("expert_count") or 0)
        if not experts:
            raise ModelError(f"{src}: a qwen3next GGUF needs experts (llama.cpp runs none without)")
        config.update(
            num_experts=experts, num_experts_per_tok=int(get("expert_used_count")),
            moe_intermediate_size=int(get("expert_feed_forward_length")),
            # llama.cpp: the shared expert's width is feed_forward_length when the file has none; the
            # chosen experts' weights are always renormalised (its build_moe_ffn's norm_w)
            shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length", 0) or 0)
            or config["intermediate_size"], norm_topk_prob=True, decoder_sparse_step=1,
            mlp_only_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names])
    return config


def is_zero_centred(gguf_name: str) -> bool:
    """Whether llama.cpp stored this norm as 1 + w (every RMSNorm of these families but the gated one)."""
    return gguf_name.endswith("norm.weight") and not gguf_name.endswith("ssm_norm.weight")


def linear_tensors(family: str, rest: str, layer: int, shape: tuple[int, ...], t, by_name: dict,
                   config: dict) -> list[Piece] | None:
    """The checkpoint tensor(s) that GGUF tensor blk.`layer`.`rest` of a linear-attention layer makes:
    None for a name that is not one of its own, [] for one made with another (Qwen3-Next's attn_gate)."""
    kh, vh = config["linear_num_key_heads"], config["linear_num_value_heads"]
    kd, vd = config["linear_key_head_dim"], config["linear_value_head_dim"]
    a = f"model.layers.{layer}.linear_attn."
    qk = 2 * kh * kd  # conv channels (and qkv rows) before the values
    tiled = family in TILED

    def heads(dim: int, axis: int = 0, start: int = 0):
        return partial(grouped, key_heads=kh, per_key=vh // kh, dim=dim, axis=axis, start=start) if tiled else None

    if rest in ("attn_qkv.weight", "attn_gate.weight") and f"blk.{layer}.ssm_a" not in by_name:
        raise ModelError(f"tensor blk.{layer}.{rest}: a fused projection of a full-attention layer is not supported")
    if rest == "attn_qkv.weight" and family == "qwen3_next":
        gate = by_name.get(f"blk.{layer}.attn_gate.weight")
        if gate is None:
            raise ModelError(f"tensor blk.{layer}.attn_qkv.weight has no attn_gate beside it")
        rows = kh * (2 * kd + 2 * (vh // kh) * vd)
        return [Piece(a + "in_proj_qkvz.weight", (rows, shape[1]), t, partial(join_qkvz, key_heads=kh, key_dim=kd),
                      (gate,))]
    made = {
        "attn_qkv.weight": ("in_proj_qkv.weight", shape, heads(vd, start=qk)),
        "attn_gate.weight": None if family == "qwen3_next" else ("in_proj_z.weight", shape, heads(vd)),
        "ssm_in.weight": ("in_proj_qkvz.weight", shape, None),  # older Qwen3-Next files: HF's rows as they are
        "ssm_ba.weight": ("in_proj_ba.weight", shape, None),
        "ssm_beta.weight": ("in_proj_b.weight", shape, heads(1)),
        "ssm_alpha.weight": ("in_proj_a.weight", shape, heads(1)),
        "ssm_a": ("A_log", shape, partial(a_log, heads(1), t.name)),
        "ssm_dt.bias": ("dt_bias", shape, heads(1)),
        "ssm_conv1d.weight": ("conv1d.weight", (shape[0], 1, shape[-1]), heads(vd, start=qk)),
        "ssm_norm.weight": ("norm.weight", shape, None),
        "ssm_out.weight": ("out_proj.weight", shape, heads(vd, axis=1)),
    }
    if rest not in made:
        return None
    if made[rest] is None:
        return []
    name, out_shape, undo = made[rest]
    return [Piece(a + name, out_shape, t, undo)]


def grouped(x, *, key_heads: int, per_key: int, dim: int, axis: int = 0, start: int = 0):
    """x's value heads along `axis` from index `start` on, in llama.cpp's tiled order ([per_key,
    key_heads, dim]), back in HF's grouped by key head ([key_heads, per_key, dim])."""
    import numpy as np

    x = np.moveaxis(x, axis, 0)
    tail = x[start:]
    tail = tail.reshape(per_key, key_heads, dim, *tail.shape[1:]).swapaxes(0, 1).reshape(tail.shape)
    return np.moveaxis(np.concatenate([x[:start], tail]), 0, axis)


def join_qkvz(qkv, gate, *, key_heads: int, key_dim: int):
    """Qwen3-Next's in_proj_qkvz from llama.cpp's attn_qkv ([q of every key head, k of every key head,
    v of every value head]) and attn_gate (z): per key head its q, k, its value heads' v, their z."""
    import numpy as np

    q, k = (qkv[i * key_heads * key_dim:(i + 1) * key_heads * key_dim].reshape(key_heads, key_dim, -1)
            for i in (0, 1))
    v = qkv[2 * key_heads * key_dim:].reshape(key_heads, -1, qkv.shape[-1])
    return np.concatenate([q, k, v, gate.reshape(key_heads, -1, gate.shape[-1])], axis=1).reshape(-1, qkv.shape[-1])


def a_log(untile, name: str, x):
    """A_log from llama.cpp's ssm_a = -exp(A_log) (computed in float64: the float32 A_log comes back
    to within a rounding of exp's)."""
    import numpy as np

    if not (x < 0).all():
        raise ModelError(f"tensor {name}: llama.cpp stores -exp(A_log), all negative; this one is not")
    x = untile(x) if untile is not None else x
    return np.log(-x.astype(np.float64)).astype(np.float32)
