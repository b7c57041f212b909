"""GGUF files as llama.cpp's converter (convert_hf_to_gguf.py) writes them, made in the test from a
tiny checkpoint of tests/families.py with the `gguf` package's writer: llama.cpp's tensor names,
Llama's (and SmolLM3's) q/k rows permuted for its RoPE, Gemma's norms stored as 1 + w, experts
stacked in one tensor per projection, Phi-3's fused projections kept fused, Llama 3.1's RoPE scaling
as a rope_freqs table, GLM's multi-token-prediction layer as an extra block, gpt-oss's fused experts
split into gate / up / down [experts, out, in] (its convert_hf_to_gguf.py GptOssModel; MXFP4 experts as
GGML's MXFP4), DeepSeek's kv_b_proj split per head into k_b (transposed) and v_b, Qwen3-Next's and Qwen3.5's linear
attention as `linear_attn_gguf` says (llama.cpp's conversion/qwen.py, as vendored by llama-cpp-python
0.3.36: Qwen3NextModel, _LinearAttentionVReorderBase, _Qwen35MRopeMixin, _QwenMtpMixin; the same tensor
transformations as the single-file convert_hf_to_gguf.py before it); the tokenizer (and chat template) of
the default model's GGUF. Written independently of the converter under test, from llama.cpp's
naming, so a mistake on either side shows."""
from __future__ import annotations

import functools

import json
import re
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

ARCH = {"llama": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
        "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3", "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2",
        "gpt_oss": "gpt-oss", "qwen2_moe": "qwen2moe", "glm4_moe": "glm4moe", "smollm3": "smollm3",
        "qwen3_next": "qwen3next", "qwen3_5": "qwen35"}  # gguf.MODEL_ARCH_NAMES' QWEN3NEXT and QWEN35 (gguf 0.19)
HYBRID = {"qwen3_next": "QWEN3NEXT", "qwen3_5": "QWEN35"}  # family -> its gguf.MODEL_ARCH member
LAYER = {  # checkpoint name after "model.layers.N." -> llama.cpp's after "blk.N."
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight", "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    **{f"mlp.shared_expert{s}.{x}_proj.weight": f"ffn_{x}_shexp.weight" for s in ("", "s") for x in ("gate", "up", "down")},
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",  # llama.cpp: e_score_correction.bias
}
DEEPSEEK = {  # MLA (kv_b_proj is split in two, below), shared experts, the router's correction bias
    "self_attn.q_a_proj.weight": "attn_q_a.weight", "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight", "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight", "mlp.shared_experts.up_proj.weight":
    "ffn_up_shexp.weight", "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
}
GEMMA_POST_ATTENTION = "post_attention_norm.weight"  # Gemma's post_attention_layernorm is a sandwich norm
GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}
EXPERT = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
GPT_OSS = {  # llama.cpp's names of gpt-oss's own tensors (after "model.layers.N." / "blk.N.")
    "post_attention_layernorm.weight": "post_attention_norm.weight", "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.router.bias": "ffn_gate_inp.bias"}
EXPERT_KIND = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: q/k rows from rotate-half to interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def reorder_v_heads(x: np.ndarray, dim: int, key_heads: int, per_key: int, head_dim: int) -> np.ndarray:
    """llama.cpp's _LinearAttentionVReorderBase._reorder_v_heads (convert_hf_to_gguf.py): along `dim`, the
    value heads grouped by key head ([key_heads, per_key, head_dim]) swapped to tiled ([per_key, key_heads,
    head_dim])."""
    shape = list(x.shape)
    x = x.reshape(*shape[:dim], key_heads, per_key, head_dim, *shape[dim + 1:])
    return np.ascontiguousarray(np.swapaxes(x, dim, dim + 1)).reshape(shape)


def linear_attn_gguf(family: str, cfg: dict, layer: int, rest: str, x: np.ndarray, *,
                     ssm_in: bool = False) -> list[tuple[str, np.ndarray]]:
    """The GGUF tensors llama.cpp's converter (conversion/qwen.py) writes for checkpoint tensor model.layers.`layer`.
    `rest` of a linear-attention layer: for Qwen3.5 first _LinearAttentionVReorderBase.modify_tensors (the
    value heads tiled where there are more value heads than key heads: qkv's v rows, z, b, a, A_log,
    dt_bias, conv1d's v channels, out_proj's columns), then Qwen3NextModel.modify_tensors (A_log ->
    -exp(A_log), dt_bias renamed dt_proj.bias, conv1d squeezed, in_proj_qkvz regrouped into attn_qkv
    [q of every key head, k ..., v ...] and attn_gate [z]; `ssm_in`: as older converters, kept whole
    as ssm_in), then its map_tensor_name (gguf's own TensorNameMap)."""
    from gguf import MODEL_ARCH, MODEL_TENSOR, TENSOR_NAMES, get_tensor_name_map

    kh, vh = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    kd, vd = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    r, qk = vh // kh, 2 * kh * kd
    if family == "qwen3_5" and kh != vh:
        if ".in_proj_qkv." in rest:
            x = np.concatenate([x[:qk], reorder_v_heads(x[qk:], 0, kh, r, vd)])
        elif ".in_proj_z." in rest:
            x = reorder_v_heads(x, 0, kh, r, vd)
        elif ".in_proj_b." in rest or ".in_proj_a." in rest:
            x = reorder_v_heads(x, 0, kh, r, 1)
        elif rest.endswith((".A_log", ".dt_bias")):
            x = reorder_v_heads(x[:, None], 0, kh, r, 1)[:, 0]
        elif ".conv1d" in rest:
            x = x.squeeze()
            x = np.concatenate([x[:qk], reorder_v_heads(x[qk:], 0, kh, r, vd)])
        elif ".out_proj." in rest:
            x = reorder_v_heads(x, 1, kh, r, vd)
    name = f"model.layers.{layer}.{rest}"
    if name.endswith(".A_log"):
        x = (-torch.exp(torch.from_numpy(np.ascontiguousarray(x)))).numpy()
    elif name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif "conv1d" in name:
        x = x.squeeze()
    if name.endswith("in_proj_qkvz.weight") and not ssm_in:
        hidden = cfg["hidden_size"]
        t = x.T.reshape(hidden, kh, 2 * kd + 2 * r * vd)  # (n_embd, head_count, [q + k + v + z])
        q, k, v, z = np.split(t, [kd, 2 * kd, 2 * kd + r * vd], axis=-1)
        qkv = np.concatenate([y.reshape(hidden, -1) for y in (q, k, v)], axis=-1).T
        return [(TENSOR_NAMES[MODEL_TENSOR.ATTN_QKV].format(bid=layer) + ".weight", qkv),
                (TENSOR_NAMES[MODEL_TENSOR.ATTN_GATE].format(bid=layer) + ".weight", z.reshape(hidden, -1).T)]
    names = get_tensor_name_map(MODEL_ARCH[HYBRID[family]], cfg["num_hidden_layers"])
    return [(names.get_name(name, try_suffixes=(".weight", ".bias")), x)]


def llama3_factors(cfg: dict) -> np.ndarray:
    """llama.cpp's rope_freqs of a "llama3" RoPE scaling (LlamaModel.generate_extra_tensors)."""
    import math

    rope = cfg["rope_parameters"]
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = cfg.get("original_max_position_embeddings", 8192)  # llama.cpp reads it at the top level
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


SMALL_VOCAB = 512  # tokens of `small_tokenizer_gguf`'s vocabulary


@functools.lru_cache(maxsize=4)
def tokenizer_fields(tokenizer_gguf: Path) -> dict:
    """The tokenizer fields of a GGUF (read once: a 49k-token vocabulary takes seconds to parse)."""
    from gguf import GGUFReader

    return {k: f.contents() for k, f in GGUFReader(str(tokenizer_gguf)).fields.items() if k.startswith("tokenizer.")}


def copy_tokenizer(writer, tokenizer_gguf: Path) -> None:
    """The tokenizer fields of another GGUF (the default model's: a GPT-2 BPE with a chat template)."""
    meta = tokenizer_fields(tokenizer_gguf)
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta.get("tokenizer.ggml.pre", "default"))
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    writer.add_chat_template(meta["tokenizer.chat_template"])


def small_tokenizer_gguf(tokenizer_gguf: Path, out: Path, vocab: int = SMALL_VOCAB) -> Path:
    """A GGUF of tokenizer fields only: `tokenizer_gguf`'s first `vocab` tokens (its special tokens and
    bytes come first) and the merges among them, with its chat template: a real BPE whose files parse
    in milliseconds (models built with vocab_size=`vocab` pair with it)."""
    from gguf import GGUFWriter

    meta = tokenizer_fields(tokenizer_gguf)
    tokens = meta["tokenizer.ggml.tokens"][:vocab]
    kept = set(tokens)
    merges = [m for m in meta["tokenizer.ggml.merges"]
              if (lambda a, b: a in kept and b in kept and a + b in kept)(*m.split(" ", 1))]
    w = GGUFWriter(str(out), "llama")
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_tokenizer_pre(meta.get("tokenizer.ggml.pre", "default"))
    w.add_token_list(tokens)
    w.add_token_types(meta["tokenizer.ggml.token_type"][:vocab])
    w.add_token_merges(merges)
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    w.add_chat_template(meta["tokenizer.chat_template"])
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return out


def write_gguf(family: str, model_dir: Path, out: Path, tokenizer_gguf: Path, *, qtype: str = "F32",
               arch: str | None = None, experts_qtype: str | None = None, ssm_in: bool = False) -> Path:
    """The GGUF llama.cpp would write for the checkpoint in `model_dir` (2-D weights stored as
    `qtype`: F32, F16 or Q8_0; norms, biases and conv1d F32; gpt-oss's expert matrices as `experts_qtype`,
    e.g. MXFP4, default `qtype`; `ssm_in`: Qwen3-Next's in_proj_qkvz whole, as older converters wrote it)."""
    from gguf import ExpertGatingFuncType, GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    cfg = json.loads((model_dir / "config.json").read_text())
    state = {k: v.float().numpy() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    gemma = family in ("gemma2", "gemma3")
    heads, kv_heads, layers = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    deepseek = family.startswith("deepseek")
    if deepseek:  # llama.cpp: MLA as multi-query attention over the latent
        kv_heads = 1
    w = GGUFWriter(str(out), arch or ARCH[family])
    # llama.cpp counts GLM's MTP layer among the blocks; Qwen3.5's and Qwen3-Next's too (_QwenMtpMixin: the
    # released checkpoints have one, converted unless --no-mtp)
    nextn = 1 if family in ("glm4_moe", *HYBRID) else 0
    w.add_block_count(layers + nextn)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if deepseek:
        rope_dim, kv_lora = cfg["qk_rope_head_dim"], cfg["kv_lora_rank"]
        w.add_key_length(kv_lora + rope_dim)
        w.add_value_length(kv_lora)
        w.add_key_length_mla(cfg["qk_nope_head_dim"] + rope_dim)
        w.add_value_length_mla(cfg["v_head_dim"])
        w.add_kv_lora_rank(kv_lora)
        if cfg.get("q_lora_rank"):
            w.add_q_lora_rank(cfg["q_lora_rank"])
        w.add_rope_dimension_count(rope_dim)
        w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        rope = cfg.get("rope_parameters") or {}
        if rope.get("rope_type") == "yarn":
            w.add_rope_scaling_type(gguf_rope_yarn())
            w.add_rope_scaling_factor(rope["factor"])
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
        if cfg["first_k_dense_replace"] < layers:
            w.add_expert_count(cfg["n_routed_experts"])
            w.add_expert_used_count(cfg["num_experts_per_tok"])
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
            w.add_expert_shared_count(cfg["n_shared_experts"])
            w.add_expert_weights_scale(cfg["routed_scaling_factor"])
            if cfg.get("norm_topk_prob"):
                w.add_expert_weights_norm(True)
            w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID if family == "deepseek_v3"
                                     else ExpertGatingFuncType.SOFTMAX)
            if cfg.get("n_group"):
                w.add_expert_group_count(cfg["n_group"])
                w.add_expert_group_used_count(cfg["topk_group"])
    else:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    rope = cfg.get("rope_parameters") or {}
    if family == "gemma3":
        w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    else:
        w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if cfg.get("sliding_window") and (gemma or family in ("phi3", "gpt_oss")):
        w.add_sliding_window(cfg["sliding_window"])
    if family == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0
    if experts and not deepseek:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if family == "gpt_oss":  # as GptOssModel.set_gguf_parameters: YaRN's factor and original context
            from gguf import RopeScalingType

            w.add_expert_feed_forward_length(cfg["intermediate_size"])
            w.add_rope_scaling_type(RopeScalingType.YARN)
            w.add_rope_scaling_factor(rope["factor"])
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if family in ("qwen3_moe", "qwen2_moe", "glm4_moe", "qwen3_next"):
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if family == "qwen3_moe":
            w.add_expert_weights_norm(bool(cfg.get("norm_topk_prob")))
        if family in ("qwen2_moe", "qwen3_next"):  # Qwen2MoeModel.set_gguf_parameters
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if family == "glm4_moe":  # llama.cpp's Glm4MoeModel.set_gguf_parameters
        from gguf import ExpertGatingFuncType

        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.5)))
        w.add_expert_shared_count(cfg["n_shared_experts"])
        w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        w.add_expert_weights_norm(cfg["norm_topk_prob"])
        w.add_nextn_predict_layers(nextn)
    if family in HYBRID:  # conversion/qwen.py's Qwen3NextModel.set_gguf_parameters
        w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
        w.add_ssm_state_size(cfg["linear_key_head_dim"])
        w.add_ssm_group_count(cfg["linear_num_key_heads"])
        w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
        w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
        if "layer_types" in cfg:  # add_recurrent_layers (not in gguf 0.19's writer): the MTP block is not one
            w.add_array(f"{w.arch}.attention.recurrent_layers",
                        [t == "linear_attention" for t in cfg["layer_types"]] + [False] * nextn)
        w.add_full_attention_interval(cfg.get("full_attention_interval", 4))
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.25)))
        if "mrope_section" in rope:  # TextModel.set_gguf_parameters: padded to 4
            w.add_rope_dimension_sections((list(rope["mrope_section"]) + [0, 0, 0, 0])[:4])
        elif family == "qwen3_5":  # _Qwen35MRopeMixin: llama.cpp's qwen35 loader needs the sections
            w.add_rope_dimension_sections([11, 11, 10, 0])
        w.add_nextn_predict_layers(nextn)  # _QwenMtpMixin.set_gguf_parameters
    copy_tokenizer(w, tokenizer_gguf)

    def add(name: str, x: np.ndarray, qtype: str = qtype) -> None:
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim < 2 or qtype == "F32":
            w.add_tensor(name, x)
        elif qtype == "F16":
            w.add_tensor(name, x.astype(np.float16))
        else:
            q = GGMLQuantizationType[qtype]
            w.add_tensor(name, quantize(x, q), raw_dtype=q)

    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_factors(cfg))
    if nextn:  # a few of the MTP layer's tensors (llama.cpp keeps them; nothing runs them here)
        add(f"blk.{layers}.nextn.eh_proj.weight", np.ones((cfg["hidden_size"], 2 * cfg["hidden_size"])))
        add(f"blk.{layers}.attn_norm.weight", np.ones(cfg["hidden_size"]))
    stacked: dict[str, dict[int, np.ndarray]] = {}
    for name, x in state.items():
        if gemma and name.endswith("norm.weight"):
            x = x + 1.0
        if family in HYBRID and name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            x = x + 1.0  # Qwen3NextModel.modify_tensors: the zero-centred RMSNorms
        if name in GLOBAL:
            add(GLOBAL[name], x)
            continue
        layer, rest = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name).groups()
        if family in HYBRID and rest.startswith("linear_attn."):
            for gguf_name, y in linear_attn_gguf(family, cfg, int(layer), rest, x, ssm_in=ssm_in):
                add(gguf_name, y, "F32" if ".ssm_conv1d." in gguf_name else qtype)  # llama.cpp: conv1d in F32
            continue
        if family == "gpt_oss" and rest.startswith("mlp.experts."):  # split, [experts, out, in], as GptOssModel
            q = f"blk.{layer}.ffn_"
            kind = experts_qtype or qtype
            if rest.endswith("gate_up_proj"):
                x = x.swapaxes(1, 2)
                add(q + "gate_exps.weight", x[:, 0::2], kind)
                add(q + "up_exps.weight", x[:, 1::2], kind)
            elif rest.endswith("gate_up_proj_bias"):
                add(q + "gate_exps.bias", x[:, 0::2])
                add(q + "up_exps.bias", x[:, 1::2])
            elif rest.endswith("down_proj"):
                add(q + "down_exps.weight", x.swapaxes(1, 2), kind)
            else:
                add(q + "down_exps.bias", x)
            continue
        if family == "gpt_oss" and rest in GPT_OSS:
            add(f"blk.{layer}.{GPT_OSS[rest]}", x)
            continue
        e = EXPERT.fullmatch(rest)
        if e is not None:
            stacked.setdefault(f"blk.{layer}.ffn_{EXPERT_KIND[e.group(2)]}_exps.weight", {})[int(e.group(1))] = x
            continue
        if rest.endswith("experts.gate_up_proj") or rest.endswith("experts.down_proj"):
            raise AssertionError(f"{name}: fused experts; save per expert")
        if deepseek and rest == "self_attn.kv_b_proj.weight":  # llama.cpp: k_b (transposed) and v_b per head
            nope, v = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
            kv_b = x.reshape(heads, nope + v, x.shape[-1])
            add(f"blk.{layer}.attn_k_b.weight", kv_b[:, :nope].swapaxes(1, 2))
            add(f"blk.{layer}.attn_v_b.weight", kv_b[:, nope:])
            continue
        # GLM's (and the hybrids') norm before the MLP is llama.cpp's post_attention_norm
        post_norm = gemma or family in ("glm4_moe", *HYBRID)
        target = (GEMMA_POST_ATTENTION if post_norm and rest == "post_attention_layernorm.weight"
                  else DEEPSEEK[rest] if deepseek and rest in DEEPSEEK else LAYER[rest])
        if ARCH[family] in ("llama", "smollm3") and rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
            x = permute(x, heads if "q_proj" in rest else kv_heads)
        add(f"blk.{layer}.{target}", x)
    for name, per_expert in stacked.items():
        add(name, np.stack([per_expert[i] for i in range(experts)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def gguf_rope_yarn():
    from gguf import RopeScalingType

    return RopeScalingType.YARN


def dequantized(x: torch.Tensor, qtype: str) -> torch.Tensor:
    """What a 2-D weight is after a round trip through `qtype` (F32: itself)."""
    if x.ndim < 2 or qtype == "F32":
        return x
    if qtype == "F16":
        return x.half().float()
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    q = GGMLQuantizationType[qtype]
    return torch.from_numpy(dequantize(quantize(x.float().numpy(), q), q).reshape(x.shape).copy())
