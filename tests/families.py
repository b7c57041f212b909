"""Tiny random-weight checkpoints of every supported family, built from the family's own transformers
config class with its special features switched on (biases, q/k norms, a mixture of experts with
top-2 routing, a sliding window shorter than the prompts, soft-capping), and transformers' greedy
tokens on them: the references the forward, the stages and the mesh are checked against. Nothing is
downloaded; a model directory gets the default model's tokenizer (so text prompts, the chat
template and the HTTP API work on it), hence the 49,152-token vocabulary."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

WINDOW = 8          # the sliding window of the families that have one: shorter than the test prompts
LAYERS = 3
VOCAB = 49152       # the default model's tokenizer
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, bos_token_id=None,
              eos_token_id=None, pad_token_id=None)
DEEPSEEK_MOE = dict(n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
                    moe_intermediate_size=32, first_k_dense_replace=1, routed_scaling_factor=2.5)
HYBRID = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
              layer_types=["linear_attention", "linear_attention", "full_attention"])
FAMILIES = {  # family -> (config class, model class, its own settings)
    "llama": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=True)),
    "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=WINDOW)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=32, tie_word_embeddings=True)),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(head_dim=16, num_experts=6, num_experts_per_tok=2,
                                                             moe_intermediate_size=32, norm_topk_prob=True,
                                                             mlp_only_layers=[1])),
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(num_local_experts=4, num_experts_per_tok=2,
                                                         sliding_window=None)),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                                      tie_word_embeddings=False,
                                                      attn_logit_softcapping=20.0, final_logit_softcapping=10.0)),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
                                                          tie_word_embeddings=False,
                                                          layer_types=["sliding_attention", "full_attention",
                                                                       "sliding_attention"],
                                                          rope_parameters={
                                                              "full_attention": {"rope_type": "default",
                                                                                 "rope_theta": 100000.0},
                                                              "sliding_attention": {"rope_type": "default",
                                                                                    "rope_theta": 10000.0}})),
    "phi3": (Phi3Config, Phi3ForCausalLM, dict(sliding_window=WINDOW)),
    # multi-head latent attention: q and kv through low-rank latents (V2-Lite's q straight from x), rotary
    # dims interleaved, V3 with YaRN and its mscale; the first layer dense, then experts routed in groups (V3:
    # sigmoid with a correction bias; V2: softmax, groups by their best) with shared experts
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM, dict(
        num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
                         "mscale": 1.0, "mscale_all_dim": 1.0}, **DEEPSEEK_MOE)),
    "deepseek_v2": (DeepseekV2Config, DeepseekV2ForCausalLM, dict(
        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, topk_method="group_limited_greedy", **dict(DEEPSEEK_MOE, n_shared_experts=2, routed_scaling_factor=1.5,
                                                                 norm_topk_prob=False))),
    # sinks (random at init), alternating sliding/full layers, YaRN, 4 experts top-2 with biases and a clamp
    # that bites (limit 3: gate/up values reach it), q/k/v/o biases
    "gpt_oss": (GptOssConfig, GptOssForCausalLM, dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                                       sliding_window=WINDOW, swiglu_limit=3.0,
                                                       layer_types=["sliding_attention", "full_attention",
                                                                    "sliding_attention"],
                                                       rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0,
                                                                        "factor": 4.0, "beta_fast": 32.0,
                                                                        "beta_slow": 1.0, "truncate": False,
                                                                        "original_max_position_embeddings": 128})),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM, dict(num_experts=6, num_experts_per_tok=2,
                                                             moe_intermediate_size=32, norm_topk_prob=False,
                                                             shared_expert_intermediate_size=48, mlp_only_layers=[1])),
    # sigmoid routing in 4 groups of 2 experts (2 groups chosen), a correction bias, a shared expert, the
    # first layer dense, q/k norms and biases, RoPE on half of each head
    "glm4_moe": (Glm4MoeConfig, Glm4MoeForCausalLM, dict(n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                                                          topk_group=2, n_shared_experts=1, moe_intermediate_size=32,
                                                          first_k_dense_replace=1, routed_scaling_factor=2.5,
                                                          use_qk_norm=True, attention_bias=True)),
    "smollm3": (SmolLM3Config, SmolLM3ForCausalLM, dict(no_rope_layers=[1, 0, 1], use_sliding_window=True,
                                                         sliding_window=WINDOW)),  # its NoPE layer slides
    # hybrids: two gated delta-net layers (a stage boundary between them through 3 stages; 2 value heads per
    # key head), then gated full attention with q/k norms and RoPE on a quarter of each head
    "qwen3_5": (Qwen3_5TextConfig, Qwen3_5ForCausalLM, dict(head_dim=16, **HYBRID)),
    # ... with 4 experts top-2 and a gated shared expert (the middle layer dense)
    "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM, dict(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        norm_topk_prob=True, mlp_only_layers=[1], **HYBRID)),
}


def _random_biases(model) -> None:
    """Every bias random (transformers initialises most to zero, which would test nothing)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "_bias")):
                p.normal_(0.0, 0.3)


AFTER_INIT = {"gpt_oss": _random_biases}  # family -> what its model needs after init


def build(family: str, path: Path, tokenizer_dir: Path | None = None, *, seed: int = 0, **overrides) -> Path:
    """A random `family` model saved (safetensors) in `path`, with the tokenizer of `tokenizer_dir`
    (`overrides`: settings of its config other than the family's test defaults)."""
    config_cls, model_cls, own = FAMILIES[family]
    config = config_cls(**{**COMMON, **own, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if family in AFTER_INIT:
        AFTER_INIT[family](model)
    with torch.no_grad():  # HF starts the routers' correction biases at zero: make them choose
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.rand(buf.shape, dtype=buf.dtype) * 0.5)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    if tokenizer_dir is not None:
        for f in Path(tokenizer_dir).iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
                shutil.copy(f, path / f.name)
    return path


def hf_model(path: Path):
    """transformers' own model of a directory `build` made, in float32."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after `prompt` by transformers' generate (no stop token: exactly n)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])  # e2m1 codes


def mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [..., K] (K a multiple of 32) -> (blocks [..., K / 32, 16] uint8, scales [..., K / 32] uint8, the
    values they hold [..., K]) as gpt-oss stores MXFP4: per block of 32 a power-of-two scale (e8m0, bias 127)
    that brings its largest magnitude to at most 6, each value the nearest e2m1 code, two codes a byte (the
    even element in the low nibble)."""
    x = w.float().reshape(*w.shape[:-1], -1, 32)
    e = torch.ceil(torch.log2(x.abs().amax(-1).clamp_min(2.0 ** -100) / 6.0)).clamp(-127, 127)
    codes = (x / torch.exp2(e)[..., None])[..., None].sub(FP4).abs().argmin(-1)  # [..., G, 32]
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (e + 127).to(torch.uint8), (FP4[codes] * torch.exp2(e)[..., None]).reshape(w.shape)


def write_mxfp4(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """A copy of gpt-oss checkpoint `src` in `dst` with its experts' matrices in MXFP4 as the released
    gpt-oss checkpoints hold them (`..._blocks` / `..._scales` of [experts, out, in], a quantization_config
    of quant_method mxfp4). -> the experts' matrices as they now are, in the checkpoint's own layout."""
    import json

    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    state, held = load_file(str(src / "model.safetensors")), {}
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = state.pop(name).transpose(1, 2)  # [experts, in, out] -> [experts, out, in]
        state[name + "_blocks"], state[name + "_scales"], values = mxfp4(w)
        held[name] = values.transpose(1, 2).contiguous()
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors") and f.is_file():
            shutil.copy(f, dst / f.name)
    return held
