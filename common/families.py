"""The model families the forward runs, and the small description (`Arch`) of a checkpoint that the
stage's one forward reads: where the families differ, nothing else.

    family      model_type            what differs from Llama
    llama       llama                 -
    mistral     mistral               sliding-window attention (every layer, when the config has a window)
    qwen2       qwen2                 q/k/v biases; sliding window on the layers past max_window_layers
    qwen3       qwen3                 per-head RMSNorm of q and k before RoPE
    qwen3_moe   qwen3_moe             q/k norms; a mixture of experts in place of the MLP (top-k routing)
    mixtral     mixtral               a mixture of experts (its top-k weights always renormalised)
    gemma2      gemma2                (1 + w) RMSNorm in float32; GeGLU; embeddings times sqrt(hidden); the
                                      attention and MLP outputs normed too; local/global layers; soft-capped
                                      attention scores and logits; q·k scaled by query_pre_attn_scalar
    gemma3      gemma3, gemma3_text   as gemma2, with per-head q/k norms instead of attention soft-capping,
                                      and local layers with their own RoPE base
    phi3        phi3                  q/k/v and gate/up fused in the checkpoint
    deepseek_v2 deepseek_v2,          multi-head latent attention (MLA: q and kv through low-rank latents, a
    deepseek_v3 deepseek_v3           shared rotary key; the KV cache holds the latent), a mixture of experts
                                      with shared experts past the first dense layers (Kimi K2: deepseek_v3)
    gpt_oss     gpt_oss               q/k/v/o biases; a learned sink logit per head in every softmax; alternating
                                      sliding/full layers; YaRN; experts only (router with a bias: top-k of its
                                      logits, then softmax over those k), with biases and a clamped SwiGLU
                                      (checkpoint: fused 3-D expert tensors, gate/up interleaved; or MXFP4)

Everything here is read from config.json alone (no torch, no transformers); what the forward cannot
run exactly is refused with a ModelError naming what is supported.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe",
               "mixtral": "mixtral", "gemma2": "gemma2", "gemma3": "gemma3", "gemma3_text": "gemma3", "phi3": "phi3",
               "deepseek_v2": "deepseek_v2", "deepseek_v3": "deepseek_v3", "gpt_oss": "gpt_oss"}
"""config.json's model_type -> the family that runs it."""

ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "swiglu_oai": "swiglu_oai"}
GEMMA = ("gemma2", "gemma3")
QK_NORM = ("qwen3", "qwen3_moe", "gemma3")
DEEPSEEK = ("deepseek_v2", "deepseek_v3")  # multi-head latent attention
TIED_BY_DEFAULT = GEMMA  # families whose config.json may leave tie_word_embeddings out, meaning tied


class ModelError(ValueError):
    """Model dir missing / incomplete / of an unsupported kind / corrupt; a message a person can act on."""


@dataclass(frozen=True)
class MoE:
    """A mixture-of-experts MLP: a router picks `top_k` of `num_experts` experts per token."""

    num_experts: int
    top_k: int
    intermediate_size: int      # of one expert (elements per token)
    norm_topk_prob: bool        # the top-k router probabilities renormalised to sum to 1
    weights_in_float: bool      # the routing weights scale the experts' outputs in float32 (Mixtral),
                                # else in the model dtype (Qwen3-MoE)
    layers: tuple[bool, ...]    # which decoder layers route (the others run a dense MLP)
    scoring: str = "softmax"    # "softmax": top k of the softmax of the router's logits (HF's Mixtral/Qwen3-MoE);
                                # "topk_softmax": softmax over the top k logits (gpt-oss; the router has a bias)


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention (DeepSeek V2/V3, Kimi K2). Each token's keys and values come from one
    latent: c = norm(x W_kv_a) of `kv_lora_rank` elements, plus one rotary key of `rope_dim` shared by
    every head; what the KV cache keeps per token and layer is that latent row (kv_lora_rank + rope_dim
    elements, in place of 2 * heads * head_dim). Queries come from x directly (`q_lora_rank` 0) or
    through a normed latent of q_lora_rank elements. A head's key is [W_uk c ; k_rope] and its value
    W_uv c; the forward absorbs W_uk into the query and W_uv into the output (stage_node.model.mla)."""

    q_lora_rank: int        # 0: q = x W_q (DeepSeek-V2-Lite); else q = norm(x W_q_a) W_q_b
    kv_lora_rank: int       # elements of the latent c
    nope_dim: int           # elements of a head's query/key without RoPE (qk_nope_head_dim)
    rope_dim: int           # elements of the rotary part of every query head and of the shared key
    v_dim: int              # elements of a head's value (v_head_dim)
    interleaved: bool       # the checkpoint's rotary dims are in interleaved pairs (V2 always; V3's
                            # rope_interleave): the loader reorders them to halves, exact for the dot

    @property
    def latent(self) -> int:
        """Elements a token's cache row holds per layer (the latent and the rotary key)."""
        return self.kv_lora_rank + self.rope_dim


@dataclass(frozen=True)
class Arch:
    """Where a checkpoint's forward differs from Llama's (see the module docstring)."""

    family: str
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False                   # per-head RMSNorm of q and k (before RoPE)
    norm: str = "llama"                     # "llama": normalise in float32, cast, then * w;
                                            # "gemma": normalise and * (1 + w) in float32, then cast
    sandwich: bool = False                  # the attention and MLP outputs are normed before the residual
    activation: str = "silu"                # of the gated MLP: "silu" | "gelu_tanh"
    embed_scale: float = 1.0                # embeddings are multiplied by this (gemma: sqrt(hidden))
    attn_scale: float = 0.0                 # q·k is multiplied by this (0: head_dim ** -0.5)
    attn_softcap: float | None = None       # scores -> cap * tanh(scores / cap), before the mask
    final_softcap: float | None = None      # logits -> cap * tanh(logits / cap)
    sliding_window: int | None = None       # a sliding layer attends to the last `window` positions
    layer_types: tuple[str, ...] = ()       # per decoder layer: "full" | "sliding"
    moe: MoE | None = None
    mla: MLA | None = None                  # multi-head latent attention in place of q/k/v heads
    checkpoint: str = "llama"               # tensor naming: "llama" | "phi3" (fused) | "qwen3_moe" | "mixtral"
                                            # | "gpt_oss" (fused 3-D experts, or their MXFP4 blocks/scales)
    sinks: bool = False                     # a learned logit per head joins each row's softmax (gpt-oss)
    swiglu_limit: float | None = None       # "swiglu_oai" activation: gate clamped above, up to [-limit, limit]
    swiglu_alpha: float = 1.702             # "swiglu_oai": gate * sigmoid(alpha * gate) * (up + 1)
    mxfp4_experts: bool = False             # gpt-oss: experts stored as MXFP4 blocks/scales (dequantized at load)

    def sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding"

    def routes(self, layer: int) -> bool:
        """Whether decoder `layer` runs a mixture of experts."""
        return self.moe is not None and self.moe.layers[layer]


def arch_of(raw: dict, path: Path, *, num_layers: int, hidden_size: int, head_dim: int) -> Arch:
    """The Arch of a config.json (already known to name a supported model_type)."""
    family = MODEL_TYPES[raw["model_type"]]
    where = path / "config.json"
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    if family in GEMMA and act == "gelu":  # Gemma's "gelu" is the tanh approximation (as transformers runs it)
        act = "gelu_pytorch_tanh"
    if family == "gpt_oss":  # its experts' clamped SwiGLU, whatever hidden_act says (transformers ignores it)
        act = "swiglu_oai"
    if act not in ACTIVATIONS:
        raise ModelError(f"{where}: activation {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    rotary = (raw.get("rope_parameters") or {}).get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if rotary not in (None, 1, 1.0):
        raise ModelError(f"{where}: partial_rotary_factor {rotary} is not supported (RoPE over the whole head only)")
    attention_bias = bool(raw.get("attention_bias", False))
    window = raw.get("sliding_window")
    window = int(window) if window else None
    pre_attn = raw.get("query_pre_attn_scalar")
    moe = _moe_of(family, raw, where, num_layers)
    mla = _mla_of(raw, where) if family in DEEPSEEK else None
    return Arch(
        family=family,
        qkv_bias=family == "qwen2" or attention_bias,
        o_bias=family != "qwen2" and attention_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=family in QK_NORM,
        norm="gemma" if family in GEMMA else "llama",
        sandwich=family in GEMMA,
        activation=ACTIVATIONS[act],
        embed_scale=hidden_size ** 0.5 if family in GEMMA else 1.0,
        attn_scale=(_mla_scale(raw, mla) if mla else
                    float(pre_attn) ** -0.5 if family in GEMMA and pre_attn else head_dim ** -0.5),
        attn_softcap=_cap(raw.get("attn_logit_softcapping")) if family == "gemma2" else None,
        final_softcap=_cap(raw.get("final_logit_softcapping")) if family in GEMMA else None,
        sliding_window=window,
        layer_types=_layer_types(family, raw, where, num_layers, window),
        moe=moe,
        mla=mla,
        checkpoint={"phi3": "phi3", "qwen3_moe": "qwen3_moe", "mixtral": "mixtral", "gpt_oss": "gpt_oss"}.get(family,
                                                                                                          "llama"),
        **(_gpt_oss(raw, where) if family == "gpt_oss" else {}),
    )


def _gpt_oss(raw: dict, where: Path) -> dict:
    """gpt-oss's own Arch fields: sinks and its experts' clamped SwiGLU."""
    try:
        limit, alpha = float(raw.get("swiglu_limit", 7.0)), float(raw.get("swiglu_alpha", 1.702))
    except (TypeError, ValueError) as e:
        raise ModelError(f"{where}: swiglu_limit / swiglu_alpha must be numbers: {e}") from e
    quant = raw.get("quantization_config")
    if quant and quant.get("quant_method") != "mxfp4":
        raise ModelError(f"{where}: quantization_config {quant.get('quant_method')!r} is not supported for gpt_oss; "
                         "supported: mxfp4 (its experts, dequantized at load)")
    return dict(sinks=True, swiglu_limit=limit, swiglu_alpha=alpha, mxfp4_experts=bool(quant))


def _mla_of(raw: dict, where: Path) -> MLA:
    try:
        mla = MLA(q_lora_rank=int(raw.get("q_lora_rank") or 0), kv_lora_rank=int(raw["kv_lora_rank"]),
                  nope_dim=int(raw["qk_nope_head_dim"]), rope_dim=int(raw["qk_rope_head_dim"]),
                  v_dim=int(raw["v_head_dim"]),
                  interleaved=raw["model_type"] == "deepseek_v2" or bool(raw.get("rope_interleave", True)))
    except (KeyError, TypeError, ValueError) as e:
        raise ModelError(f"{where}: an incomplete multi-head latent attention config: {e!r}") from e
    if min(mla.kv_lora_rank, mla.nope_dim, mla.rope_dim, mla.v_dim) < 1 or mla.rope_dim % 2:
        raise ModelError(f"{where}: kv_lora_rank, qk_nope_head_dim, v_head_dim must be >= 1 and qk_rope_head_dim "
                         f"even (got {mla})")
    return mla


def _mla_scale(raw: dict, mla: MLA) -> float:
    """q·k's scale: (nope + rope) ** -0.5, times yarn's mscale squared when the RoPE is YaRN with
    mscale_all_dim (as transformers' DeepSeek attention computes it)."""
    import math

    scale = (mla.nope_dim + mla.rope_dim) ** -0.5
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if (params.get("rope_type") or params.get("type") or "default") != "default" and params.get("mscale_all_dim"):
        factor = float(params["factor"])
        m = 0.1 * float(params["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= m * m
    return scale


def _cap(value) -> float | None:
    return float(value) if value else None


def _layer_types(family: str, raw: dict, where: Path, num_layers: int, window: int | None) -> tuple[str, ...]:
    """"full" or "sliding" per layer: config.json's layer_types when it has them, else the family's rule."""
    if not window:
        return ("full",) * num_layers
    named = raw.get("layer_types")
    if named:
        kinds = {"full_attention": "full", "sliding_attention": "sliding"}
        bad = sorted({t for t in named if t not in kinds})
        if bad or len(named) != num_layers:
            raise ModelError(f"{where}: layer_types must give one of {', '.join(kinds)} for each of the "
                             f"{num_layers} layers (got {len(named)}{', ' + ', '.join(map(str, bad)) if bad else ''})")
        return tuple(kinds[t] for t in named)
    if family in ("qwen2", "qwen3", "qwen3_moe"):
        first = int(raw.get("max_window_layers", num_layers))
        on = bool(raw.get("use_sliding_window", False))
        return tuple("sliding" if on and i >= first else "full" for i in range(num_layers))
    if family == "gemma2":
        return tuple("sliding" if i % 2 == 0 else "full" for i in range(num_layers))
    if family == "gemma3":
        pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
        return tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(num_layers))
    return ("sliding",) * num_layers  # mistral, phi3, llama with a window: every layer


def _moe_of(family: str, raw: dict, where: Path, num_layers: int) -> MoE | None:
    if family not in ("qwen3_moe", "mixtral", "gpt_oss"):
        return None
    try:
        experts = int(raw.get("num_experts") or raw["num_local_experts"])
        top_k = int(raw["num_experts_per_tok"])
        if family == "qwen3_moe":
            size = int(raw["moe_intermediate_size"])
            skip = set(raw.get("mlp_only_layers") or [])
            step = int(raw.get("decoder_sparse_step", 1))
            layers = tuple(i not in skip and (i + 1) % step == 0 for i in range(num_layers))
        else:  # mixtral, gpt_oss: every layer routes
            size = int(raw["intermediate_size"])
            layers = (True,) * num_layers
    except (KeyError, TypeError, ValueError) as e:
        raise ModelError(f"{where}: an incomplete mixture-of-experts config: {e!r}") from e
    if not 1 <= top_k <= experts:
        raise ModelError(f"{where}: num_experts_per_tok {top_k} must lie in [1, {experts}] (the experts)")
    if family == "qwen3_moe" and int(raw.get("shared_expert_intermediate_size") or 0):
        raise ModelError(f"{where}: shared experts are not supported")
    return MoE(num_experts=experts, top_k=top_k, intermediate_size=size,
               norm_topk_prob=family == "mixtral" or bool(raw.get("norm_topk_prob", False)),
               weights_in_float=family == "mixtral", layers=layers,
               scoring="topk_softmax" if family == "gpt_oss" else "softmax")
