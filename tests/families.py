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
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
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
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

WINDOW = 8          # the sliding window of the families that have one: shorter than the test prompts
LAYERS = 3
VOCAB = 49152       # the default model's tokenizer
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, bos_token_id=None,
              eos_token_id=None, pad_token_id=None)
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
}


def build(family: str, path: Path, tokenizer_dir: Path | None = None, *, seed: int = 0, **overrides) -> Path:
    """A random `family` model saved (safetensors) in `path`, with the tokenizer of `tokenizer_dir`
    (`overrides`: settings of its config other than the family's test defaults)."""
    config_cls, model_cls, own = FAMILIES[family]
    config = config_cls(**{**COMMON, **own, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
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
