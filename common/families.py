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
    qwen2_moe   qwen2_moe             q/k/v biases; experts (softmax top-k) plus a shared expert scaled by a sigmoid gate
    glm4_moe    glm4_moe              q/k/v biases, q/k norms (as configured); RoPE on the first half of each head
                                      (partial_rotary_factor); dense first layers, then experts routed by sigmoid
                                      scores with a correction bias, in groups ("noaux_tc"), plus shared experts
    smollm3     smollm3               no RoPE on every 4th layer (no_rope_layers)
    qwen3_5     qwen3_5_text          hybrid: gated delta-net linear-attention layers (a recurrent state per
                                      sequence, stage_node.model.deltanet) and full-attention layers (per
                                      layer_types) whose output is gated by sigmoid(x W_gate); (1 + w) RMSNorm
                                      in float32, q/k norms, RoPE on the first partial_rotary_factor of a head
    qwen3_next  qwen3_next            as qwen3_5 (the linear layers' projections fused by key head), with
                                      experts (softmax top-k) plus a shared expert scaled by a sigmoid gate

The mixture-of-experts description (`MoE`, `moe_of_config`) serves DeepSeek V2 / V3 too.

Everything here is read from config.json alone (no torch, no transformers); what the forward cannot
run exactly is refused with a ModelError naming what is supported.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe",
               "mixtral": "mixtral", "gemma2": "gemma2", "gemma3": "gemma3", "gemma3_text": "gemma3", "phi3": "phi3",
               "deepseek_v2": "deepseek_v2", "deepseek_v3": "deepseek_v3", "gpt_oss": "gpt_oss",
               "qwen2_moe": "qwen2_moe", "glm4_moe": "glm4_moe", "smollm3": "smollm3", "qwen3_5_text": "qwen3_5",
               "qwen3_next": "qwen3_next"}
"""config.json's model_type -> the family that runs it."""

ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "swiglu_oai": "swiglu_oai"}
GEMMA = ("gemma2", "gemma3")
HYBRID = ("qwen3_5", "qwen3_next")  # gated delta-net linear attention beside gated full attention
QK_NORM = ("qwen3", "qwen3_moe", "gemma3") + HYBRID
DEEPSEEK = ("deepseek_v2", "deepseek_v3")  # multi-head latent attention
PARTIAL_ROTARY = {"glm4_moe": 0.5, "qwen3_5": 0.25, "qwen3_next": 0.25}  # families whose RoPE may cover only part of a head -> their default share
TIED_BY_DEFAULT = GEMMA + ("smollm3",)  # families whose config.json may leave tie_word_embeddings out, meaning tied


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
    # The general router (DeepSeek V2 / V3, GLM-4.5); the defaults are Qwen3-MoE's and Mixtral's.
    scoring: str = "softmax"    # the experts' scores from the router logits: "softmax" | "sigmoid" (in float32)
                                # | "topk_softmax": softmax over the top k logits (gpt-oss; the router has a bias)
    router_in_float: bool = False  # the router (held in float32) multiplies the rows cast to float32
                                # (DeepSeek, GLM); else the model dtype's rows and router
    correction_bias: bool = False  # a per-expert bias (e_score_correction_bias) added to the scores to
                                # choose the experts only; their weights stay the plain scores
    n_group: int = 1            # experts split into this many groups; a token picks topk_group groups,
    topk_group: int = 1         # then its top_k experts among theirs
    group_score: str = "top2"   # a group's score: "top2": the sum of its two best (V3, GLM; masked -inf)
                                # | "max": its best (V2's group_limited_greedy; masked to 0)
    norm_eps: float = 0.0       # added to the top-k sum when renormalising (1e-20: DeepSeek V3, GLM)
    routed_scaling_factor: float = 1.0  # the routing weights multiplied by this
    shared_intermediate_size: int = 0  # a shared expert every token runs (0: none), added to the routed output
    shared_gate: bool = False   # the shared expert's output scaled by sigmoid(h . gate) (Qwen2-MoE)


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
class LinearAttn:
    """Gated delta-net linear attention (Qwen3.5, Qwen3-Next): per token, q/k/v from x through a causal
    depthwise convolution of `conv_kernel` taps (SiLU), q and k L2-normed per head; per value head a
    matrix state S [key_dim, value_dim] decays by exp(g) and takes the delta-rule update
    S += k (beta (v - S^T k))^T; the output S^T q is normed per head and gated by SiLU(z). What a
    sequence keeps per layer is that state and the convolution's last conv_kernel - 1 inputs, whatever
    its length (stage_node.model.deltanet)."""

    key_heads: int          # linear_num_key_heads (q and k heads)
    value_heads: int        # linear_num_value_heads, a multiple of key_heads (each k head serves a group)
    key_dim: int            # linear_key_head_dim (elements)
    value_dim: int          # linear_value_head_dim (elements)
    conv_kernel: int        # linear_conv_kernel_dim (taps)
    fused: bool             # Qwen3-Next's checkpoint: in_proj_qkvz / in_proj_ba, rows grouped by key head

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v of every head (elements per token)."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    def state_elements(self) -> int:
        """Elements a sequence's state holds in one layer (the convolution window and the matrices)."""
        return self.conv_dim * (self.conv_kernel - 1) + self.value_heads * self.key_dim * self.value_dim


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
    layer_types: tuple[str, ...] = ()       # per decoder layer: "full" | "sliding" | "linear" (LinearAttn)
    moe: MoE | None = None
    mla: MLA | None = None                  # multi-head latent attention in place of q/k/v heads
    rotary: float = 1.0                     # RoPE on the first rotary * head_dim dims of each head (rotate-half)
    rope_layers: tuple[bool, ...] = ()      # per decoder layer: RoPE applied (empty: every layer; SmolLM3's NoPE)
    checkpoint: str = "llama"               # tensor naming: "llama" | "phi3" (fused) | "qwen3_moe" | "mixtral"
                                            # | "gpt_oss" (fused 3-D experts, or their MXFP4 blocks/scales)
    sinks: bool = False                     # a learned logit per head joins each row's softmax (gpt-oss)
    swiglu_limit: float | None = None       # "swiglu_oai" activation: gate clamped above, up to [-limit, limit]
    swiglu_alpha: float = 1.702             # "swiglu_oai": gate * sigmoid(alpha * gate) * (up + 1)
    mxfp4_experts: bool = False             # gpt-oss: experts stored as MXFP4 blocks/scales (dequantized at load)
    linear: LinearAttn | None = None        # the "linear" layers' gated delta-net (Qwen3.5, Qwen3-Next)
    attn_gate: bool = False                 # full attention's output times sigmoid(x W_gate), W_gate's rows
                                            # interleaved per head with q_proj's in the checkpoint

    def is_linear(self, layer: int) -> bool:
        """Whether decoder `layer` is a linear-attention layer (a recurrent state, no KV)."""
        return bool(self.layer_types) and self.layer_types[layer] == "linear"

    @property
    def hybrid(self) -> bool:
        """Some layers keep a recurrent state per sequence instead of KV (the engine's forks, truncation,
        prefix cache and replays treat it: docs/engine.md)."""
        return self.linear is not None

    def sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding"

    def routes(self, layer: int) -> bool:
        """Whether decoder `layer` runs a mixture of experts."""
        return self.moe is not None and self.moe.layers[layer]

    def ropes(self, layer: int) -> bool:
        """Whether decoder `layer` rotates q and k (SmolLM3 leaves some layers without position encoding)."""
        return not self.rope_layers or self.rope_layers[layer]


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
    rotary = (raw.get("rope_parameters") or {}).get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    rotary = float(PARTIAL_ROTARY.get(family, 1.0) if rotary is None else rotary)
    if rotary != 1.0 and family not in PARTIAL_ROTARY:
        raise ModelError(f"{where}: partial_rotary_factor {rotary} is not supported for {family} (RoPE over the "
                         f"whole head; partial RoPE for: {', '.join(PARTIAL_ROTARY)})")
    if not 0 < rotary <= 1 or int(head_dim * rotary) % 2:
        raise ModelError(f"{where}: partial_rotary_factor {rotary} must give an even number of rotated dims "
                         f"in (0, head_dim {head_dim}]")
    attention_bias = bool(raw.get("attention_bias", False))
    window = raw.get("sliding_window")
    window = int(window) if window else None
    if family in ("smollm3", "qwen2_moe") and not raw.get("use_sliding_window", False):
        window = None  # the window is used only when use_sliding_window says so
    pre_attn = raw.get("query_pre_attn_scalar")
    moe = _moe_of(family, raw, where, num_layers)
    mla = _mla_of(raw, where) if family in DEEPSEEK else None
    linear = _linear_of(family, raw, where)
    qkv_bias = {"qwen2": True, "qwen2_moe": bool(raw.get("qkv_bias", True))}.get(family, attention_bias)
    return Arch(
        family=family,
        qkv_bias=qkv_bias,
        o_bias=family not in ("qwen2", "qwen2_moe", "glm4_moe") and attention_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=family in QK_NORM or (family == "glm4_moe" and bool(raw.get("use_qk_norm", False))),
        norm="gemma" if family in GEMMA + HYBRID else "llama",
        sandwich=family in GEMMA,
        activation=ACTIVATIONS[act],
        embed_scale=hidden_size ** 0.5 if family in GEMMA else 1.0,
        attn_scale=(_mla_scale(raw, mla) if mla else
                    float(pre_attn) ** -0.5 if family in GEMMA and pre_attn else head_dim ** -0.5),
        attn_softcap=_cap(raw.get("attn_logit_softcapping")) if family == "gemma2" else None,
        final_softcap=_cap(raw.get("final_logit_softcapping")) if family in GEMMA else None,
        sliding_window=window,
        layer_types=_hybrid_layers(raw, where, num_layers) if linear else _layer_types(family, raw, where, num_layers,
                                                                                       window),
        moe=moe,
        mla=mla,
        rotary=rotary,
        rope_layers=_rope_layers(family, raw, where, num_layers),
        checkpoint={"phi3": "phi3", "qwen3_moe": "qwen3_moe", "mixtral": "mixtral", "qwen2_moe": "qwen3_moe",
                    "glm4_moe": "qwen3_moe", "deepseek_v2": "qwen3_moe", "deepseek_v3": "qwen3_moe",
                    "gpt_oss": "gpt_oss", "qwen3_next": "qwen3_moe"}.get(family, "llama"),
        **(_gpt_oss(raw, where) if family == "gpt_oss" else {}),
        linear=linear,
        attn_gate=family in HYBRID,
    )


def _linear_of(family: str, raw: dict, where: Path) -> LinearAttn | None:
    """The gated delta-net of a hybrid family's config (None for the others)."""
    if family not in HYBRID:
        return None
    try:
        lin = LinearAttn(key_heads=int(raw["linear_num_key_heads"]), value_heads=int(raw["linear_num_value_heads"]),
                         key_dim=int(raw["linear_key_head_dim"]), value_dim=int(raw["linear_value_head_dim"]),
                         conv_kernel=int(raw.get("linear_conv_kernel_dim", 4)), fused=family == "qwen3_next")
    except (KeyError, TypeError, ValueError) as e:
        raise ModelError(f"{where}: an incomplete linear-attention config: {e!r}") from e
    if min(lin.key_heads, lin.value_heads, lin.key_dim, lin.value_dim) < 1 or lin.conv_kernel < 2 or (
            lin.value_heads % lin.key_heads):
        raise ModelError(f"{where}: linear_num_value_heads must be a multiple of linear_num_key_heads, the head "
                         f"dims >= 1 and linear_conv_kernel_dim >= 2 (got {lin})")
    if raw.get("attention_bias"):
        raise ModelError(f"{where}: attention_bias is not supported for {family}")
    return lin


def _hybrid_layers(raw: dict, where: Path, num_layers: int) -> tuple[str, ...]:
    """"linear" or "full" per layer: layer_types, or every full_attention_interval-th layer full."""
    named = raw.get("layer_types")
    if not named:
        interval = int(raw.get("full_attention_interval") or 4)
        return tuple("full" if (i + 1) % interval == 0 else "linear" for i in range(num_layers))
    kinds = {"linear_attention": "linear", "full_attention": "full"}
    bad = sorted({t for t in named if t not in kinds})
    if bad or len(named) != num_layers:
        raise ModelError(f"{where}: layer_types must give one of {', '.join(kinds)} for each of the {num_layers} "
                         f"layers (got {len(named)}{', ' + ', '.join(map(str, bad)) if bad else ''})")
    return tuple(kinds[t] for t in named)


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
    scale = (mla.nope_dim + mla.rope_dim) ** -0.5
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if (params.get("rope_type") or params.get("type") or "default") != "default" and params.get("mscale_all_dim"):
        factor = float(params["factor"])
        m = 0.1 * float(params["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= m * m
    return scale


def _cap(value) -> float | None:
    return float(value) if value else None


def _rope_layers(family: str, raw: dict, where: Path, num_layers: int) -> tuple[bool, ...]:
    """SmolLM3: which layers rotate (no_rope_layers: 1 = RoPE, 0 = none; by default every
    no_rope_layer_interval-th layer has none); () for the other families (every layer)."""
    if family != "smollm3":
        return ()
    named = raw.get("no_rope_layers")
    if named is None:
        interval = int(raw.get("no_rope_layer_interval") or 4)
        return tuple((i + 1) % interval != 0 for i in range(num_layers))
    if len(named) != num_layers or any(v not in (0, 1) for v in named):
        raise ModelError(f"{where}: no_rope_layers must give 0 or 1 for each of the {num_layers} layers")
    return tuple(bool(v) for v in named)


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
    if family in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe"):
        first = int(raw.get("max_window_layers", num_layers))
        on = bool(raw.get("use_sliding_window", False))
        return tuple("sliding" if on and i >= first else "full" for i in range(num_layers))
    if family == "smollm3":  # its NoPE layers slide
        ropes = _rope_layers(family, raw, where, num_layers)
        return tuple("full" if r else "sliding" for r in ropes)
    if family == "gemma2":
        return tuple("sliding" if i % 2 == 0 else "full" for i in range(num_layers))
    if family == "gemma3":
        pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
        return tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(num_layers))
    return ("sliding",) * num_layers  # mistral, phi3, llama with a window: every layer


MOE_FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe", "glm4_moe", "deepseek_v2", "deepseek_v3", "gpt_oss", "qwen3_next")
_DEEPSEEK_DEFAULTS = {  # transformers' config defaults where config.json leaves a key out (or null)
    "glm4_moe": dict(first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=1.0, n_group=1, topk_group=1,
                     norm_topk_prob=True),
    "deepseek_v3": dict(first_k_dense_replace=3, n_shared_experts=1, routed_scaling_factor=2.5, n_group=8,
                        topk_group=4, norm_topk_prob=True),
    "deepseek_v2": dict(first_k_dense_replace=0, n_shared_experts=2, routed_scaling_factor=1.0, n_group=1,
                        topk_group=1, norm_topk_prob=False),
}


def _moe_of(family: str, raw: dict, where: Path, num_layers: int) -> MoE | None:
    if family not in MOE_FAMILIES or (family == "qwen3_next" and not int(raw.get("num_experts") or 0)):
        return None
    return moe_of_config(raw, family, num_layers=num_layers, where=where)


def moe_of_config(raw: dict, family: str, *, num_layers: int | None = None, where: Path | str = "config.json") -> MoE:
    """The MoE of a raw config.json dict of a mixture family (MOE_FAMILIES: the families run here, and
    DeepSeek V2 / V3, whose MoE blocks are HF's DeepseekV2Moe / DeepseekV3MoE), as HF 5.24 runs it:

        qwen3_moe, mixtral  softmax top-k (renormalised if norm_topk_prob; Mixtral always)
        qwen2_moe           as qwen3_moe, plus a shared expert (shared_expert_intermediate_size) scaled
                            by sigmoid(shared_expert_gate); mlp_only_layers / decoder_sparse_step
        deepseek_v2         softmax in float32; topk_method "greedy" or "group_limited_greedy" (groups
                            scored by their best expert); times routed_scaling_factor; no renormalising
        deepseek_v3,        sigmoid scores + e_score_correction_bias to choose ("noaux_tc"); groups scored
        glm4_moe            by their two best; renormalised (+1e-20) if norm_topk_prob; times routed_scaling_factor
        (DeepSeek, GLM)     n_shared_experts * moe_intermediate_size of shared experts; dense first
                            first_k_dense_replace layers; the router in float32

    A setting HF does not run the same way is refused with a ModelError."""
    where = Path(where)
    deepseek = family in _DEEPSEEK_DEFAULTS

    def get(key):
        return raw[key] if raw.get(key) is not None else _DEEPSEEK_DEFAULTS[family][key]
    try:
        num_layers = int(raw["num_hidden_layers"]) if num_layers is None else num_layers
        experts = int(raw.get("num_experts") or raw.get("n_routed_experts") or raw["num_local_experts"])
        top_k = int(raw["num_experts_per_tok"])
        if family in ("qwen3_moe", "qwen2_moe", "qwen3_next"):
            size = int(raw["moe_intermediate_size"])
            skip = set(raw.get("mlp_only_layers") or [])
            step = int(raw.get("decoder_sparse_step", 1))
            layers = tuple(i not in skip and (i + 1) % step == 0 for i in range(num_layers))
        elif deepseek:
            size = int(raw["moe_intermediate_size"])
            dense = int(get("first_k_dense_replace"))
            layers = tuple(i >= dense for i in range(num_layers))
        else:  # mixtral, gpt_oss: every layer routes
            size = int(raw["intermediate_size"])
            layers = (True,) * num_layers
        shared = int(raw.get("shared_expert_intermediate_size") or 0) if family in ("qwen2_moe", "qwen3_next") else (
            size * int(get("n_shared_experts")) if deepseek else 0)
        scaling = float(get("routed_scaling_factor")) if deepseek else 1.0
        n_group = int(get("n_group")) if deepseek else 1
        topk_group = int(get("topk_group")) if deepseek else 1
    except (KeyError, TypeError, ValueError) as e:
        raise ModelError(f"{where}: an incomplete mixture-of-experts config: {e!r}") from e
    if not 1 <= top_k <= experts:
        raise ModelError(f"{where}: num_experts_per_tok {top_k} must lie in [1, {experts}] (the experts)")
    if family == "qwen3_moe" and int(raw.get("shared_expert_intermediate_size") or 0):
        raise ModelError(f"{where}: shared experts are not supported for qwen3_moe (they are for qwen2_moe)")
    norm = family == "mixtral" or bool(get("norm_topk_prob") if deepseek else raw.get("norm_topk_prob", False))
    scoring, group_score, bias = "softmax", "top2", False
    if family == "deepseek_v2":
        method = raw.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy") or raw.get("scoring_func", "softmax") != "softmax":
            raise ModelError(f"{where}: topk_method {method!r} / scoring_func {raw.get('scoring_func')!r} are not "
                             "supported for deepseek_v2; supported: greedy, group_limited_greedy with softmax scores")
        if norm:
            raise ModelError(f"{where}: norm_topk_prob true is not supported for deepseek_v2 (transformers "
                             "does not renormalise its top-k weights)")
        group_score = "max"
        if method == "greedy":
            n_group = topk_group = 1
    elif family in ("deepseek_v3", "glm4_moe"):
        scoring, bias = "sigmoid", True
        method = raw.get("topk_method", "noaux_tc")
        if method != "noaux_tc" or raw.get("scoring_func", "sigmoid") != "sigmoid":
            raise ModelError(f"{where}: topk_method {method!r} / scoring_func {raw.get('scoring_func')!r} are "
                             f"not supported for {family}; supported: noaux_tc with sigmoid scores")
    elif family == "gpt_oss":
        scoring = "topk_softmax"
    if deepseek and int(raw.get("moe_layer_freq") or 1) != 1:
        raise ModelError(f"{where}: moe_layer_freq {raw.get('moe_layer_freq')} is not supported (experts on every "
                         "layer from first_k_dense_replace on)")
    per_group = experts // max(n_group, 1)
    if n_group < 1 or experts % n_group or not 1 <= topk_group <= n_group or (
            n_group > 1 and (group_score == "top2" and per_group < 2 or topk_group * per_group < top_k)):
        raise ModelError(f"{where}: n_group {n_group} / topk_group {topk_group} must split the {experts} experts "
                         f"into equal groups (of at least 2 for noaux_tc) that hold num_experts_per_tok {top_k}")
    return MoE(num_experts=experts, top_k=top_k, intermediate_size=size, norm_topk_prob=norm,
               weights_in_float=family == "mixtral" or deepseek, layers=layers,
               scoring=scoring, router_in_float=deepseek, correction_bias=bias, n_group=n_group,
               topk_group=topk_group, group_score=group_score, norm_eps=1e-20 if bias else 0.0,
               routed_scaling_factor=scaling, shared_intermediate_size=shared,
               shared_gate=family in ("qwen2_moe", "qwen3_next"))
