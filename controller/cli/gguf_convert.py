"""GGUF files as users have them, turned into the mesh's model directory (`lpctl model prepare
--gguf FILE`, `logicpipe-controller --model FILE.gguf`).

Tensor by tensor: the file is memory-mapped, each tensor dequantized on its own (gguf's own
dequantizers: F32, F16, BF16, Q8_0, Q4_0/1, Q5_0/1, the K quants, MXFP4, ...), undone where llama.cpp's
converter changed it (Llama's and SmolLM3's q/k rows permuted for its RoPE layout, Gemma's norms
stored as 1 + w, Llama 3.1's RoPE scaling turned into a table of per-frequency factors, gpt-oss's
experts split into gate / up / down and transposed: put back into transformers' fused [experts, in,
out] tensors with gate and up interleaved, DeepSeek's kv_b_proj split per head into k_b and v_b:
joined back; Qwen3-Next's and Qwen3.5's linear attention: gguf_hybrid), renamed to the checkpoint
names the stages read, cast to bfloat16 (or float32) and written straight into one safetensors
file whose header is laid out first: never the whole model in memory. config.json is written from
the GGUF's metadata; the tokenizer and its chat template come from the GGUF too (transformers builds
them from the metadata alone). The work happens in a temporary sibling directory renamed into place
at the end, so an interrupted conversion leaves nothing half-written; a finished one is reused while
the source file's size and mtime match.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import struct
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from logicpipe.common.modeldir import ModelError
from logicpipe.common.paths import cache_root
from logicpipe.controller.cli.gguf_hybrid import ARCHITECTURES as HYBRID_ARCHITECTURES
from logicpipe.controller.cli.gguf_hybrid import FAMILIES as HYBRID
from logicpipe.controller.cli.gguf_hybrid import NAMES as _HYBRID
from logicpipe.controller.cli.gguf_hybrid import hybrid_config, is_zero_centred, linear_tensors
from logicpipe.controller.cli.gguf_rope import llama3_rope
from logicpipe.controller.cli.gguf_tokenizer import write_tokenizer

log = logging.getLogger(__name__)

MARKER = ".logicpipe-converted.json"
DTYPES = {"bfloat16": ("BF16", 2), "float32": ("F32", 4)}
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "gemma2": "gemma2",
                 "gemma3": "gemma3", "phi3": "phi3", "gpt-oss": "gpt_oss", "deepseek2": "deepseek_v3",
                 "qwen2moe": "qwen2_moe", "glm4moe": "glm4_moe", "smollm3": "smollm3", **HYBRID_ARCHITECTURES}
"""GGUF general.architecture -> the family it converts to ("llama" with experts: Mixtral; llama.cpp
writes Mistral as "llama" too; "deepseek2" is DeepSeek V2, V3 and Kimi K2: V2 where its experts are
chosen by softmax)."""

# GGUF tensor name (after "blk.N.") -> the checkpoint's (after "model.layers.N."); per family where it differs
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
}
_GEMMA = {"ffn_norm.weight": "pre_feedforward_layernorm.weight",
          "post_attention_norm.weight": "post_attention_layernorm.weight",
          "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
_PHI3 = {"ffn_up.weight": "mlp.gate_up_proj.weight"}  # llama.cpp keeps Phi-3's gate/up fused, in ffn_up
_MIXTRAL = {"ffn_gate_inp.weight": "block_sparse_moe.gate.weight"}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_EXPERTS = re.compile(r"ffn_(gate|up|down)_exps\.weight")
_DEEPSEEK = {  # multi-head latent attention, shared experts, the router's correction bias
    "attn_q_a.weight": "self_attn.q_a_proj.weight", "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight", "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight", "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
}
_GPT_OSS = {"post_attention_norm.weight": "post_attention_layernorm.weight", "attn_sinks.weight": "self_attn.sinks",
            "ffn_gate_inp.weight": "mlp.router.weight", "ffn_gate_inp.bias": "mlp.router.bias"}
_GPT_OSS_EXPERTS = re.compile(r"ffn_(gate|up|down)_exps\.(weight|bias)")  # gate + up -> gate_up_proj, interleaved
GPT_OSS_SWIGLU = {"swiglu_limit": 7.0, "swiglu_alpha": 1.702}  # llama.cpp's constants (the GGUF holds no key)
_SHARED = {f"ffn_{x}_shexp.weight": f"{x}_proj.weight" for x in ("gate", "up", "down")}  # after mlp.shared_expert(s).
_QWEN2_MOE = {**{k: "mlp.shared_expert." + v for k, v in _SHARED.items()},
              "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight"}
_GLM4_MOE = {**{k: "mlp.shared_experts." + v for k, v in _SHARED.items()},
             "post_attention_norm.weight": "post_attention_layernorm.weight",  # GLM's norm before the MLP
             "exp_probs_b.bias": "mlp.gate.e_score_correction_bias"}
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's per-frequency RoPE factors (Llama 3.1's "llama3" scaling)
PERMUTED = ("llama", "mixtral", "smollm3")  # families whose q/k rows llama.cpp permutes


@dataclass(frozen=True)
class Out:
    """One tensor of the output: its name, shape, and how to make it from the GGUF."""

    name: str
    shape: tuple[int, ...]
    source: object        # the GGUF tensor (gguf.ReaderTensor)
    expert: int = -1      # of a stacked experts tensor: which expert (-1: the whole tensor)
    permute_heads: int = 0  # Llama's q/k: undo llama.cpp's RoPE permutation over this many heads
    minus_one: bool = False  # Gemma's norms: llama.cpp stored 1 + w
    v_b: object = None    # DeepSeek's kv_b_proj, which llama.cpp splits: source is attn_k_b [heads, kv_lora,
                          # nope] (transposed), this attn_v_b [heads, v, kv_lora]; joined back per head
                          # (permute_heads then counts the heads; there is no RoPE permutation)
    pair: object = None     # gpt-oss: the up tensor, interleaved with `source` (gate) along dim 1
    transpose: bool = False  # gpt-oss's expert matrices: GGUF's [experts, out, in] -> [experts, in, out]
    float32: bool = False   # kept in float32 whatever the dtype (the routers' correction bias, as HF keeps it)
    undo: Callable | None = None  # the checkpoint's values from the float32 values of source and of `extra`
    extra: tuple = ()             # (each in its GGUF shape): Qwen3-Next's / Qwen3.5's linear attention (gguf_hybrid)


def default_out_dir(gguf_path: Path, dtype: str) -> Path:
    return cache_root() / "models" / f"{gguf_path.stem}-{dtype}"


def _stamp(path: Path) -> dict:
    st = path.stat()
    return {"source": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def is_converted(out_dir: Path, gguf_path: Path, dtype: str) -> bool:
    """Whether `out_dir` holds a finished conversion of `gguf_path` to `dtype`: the same file (path,
    size, modification time), or the same bytes elsewhere (another checkout's or virtualenv's copy of
    a packaged GGUF: its digest), so that one conversion serves every copy of the file."""
    try:
        marker = json.loads((out_dir / MARKER).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(marker, dict) or marker.get("dtype") != dtype:
        return False
    stamp = _stamp(gguf_path)
    if marker.get("stamp") == stamp:
        return True
    return (marker.get("stamp", {}).get("size") == stamp["size"] and bool(marker.get("sha256"))
            and marker["sha256"] == _sha256(gguf_path))


def prepare_gguf(gguf_path, out_dir=None, *, dtype: str = "bfloat16", force: bool = False,
                 progress: Callable[[str], None] | None = None) -> Path:
    """Convert the GGUF at `gguf_path` into a model directory (default: in the LogicPipe cache),
    once. Returns the directory. ModelError says what cannot be converted and why."""
    say = progress or log.info
    src = Path(gguf_path)
    if not src.is_file():
        raise ModelError(f"{src}: no such GGUF file")
    if dtype not in DTYPES:
        raise ModelError(f"dtype {dtype!r}: convert to one of {', '.join(DTYPES)}")
    out = Path(out_dir) if out_dir else default_out_dir(src, dtype)
    if not force and is_converted(out, src, dtype):
        say(f"model ready: {out}")
        return out
    try:
        import gguf  # noqa: F401 — the `convert` extra
    except ImportError as exc:
        raise ModelError("converting a GGUF file needs the `gguf` package: pip install 'logicpipe[convert]'") from exc
    from gguf import GGUFReader

    t0 = time.monotonic()
    try:
        reader = GGUFReader(str(src))
    except (ValueError, OSError, struct.error) as exc:
        raise ModelError(f"{src} is not a readable GGUF file: {exc}") from exc
    meta = {name: _contents(field) for name, field in reader.fields.items()}
    arch = str(meta.get("general.architecture", ""))
    config = {**hf_config(meta, reader, src), "dtype": dtype}
    outs = plan_tensors(reader, config)
    say(f"[1/3] {src.name}: {config['model_type']} ({arch}), {config['num_hidden_layers']} layers, "
        f"{len(outs)} tensors -> {dtype}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    os.chmod(tmp, 0o755)
    try:
        write_safetensors(tmp / "model.safetensors", outs, dtype, say)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        (tmp / "generation_config.json").write_text(json.dumps(
            {k: config[k] for k in ("bos_token_id", "eos_token_id") if config.get(k) is not None}))
        say("[3/3] writing the tokenizer and its chat template")
        write_tokenizer(src, tmp)
        (tmp / MARKER).write_text(json.dumps({"stamp": _stamp(src), "sha256": _sha256(src), "dtype": dtype,
                                              "created": time.time()}))
        # the old conversion is moved aside, not deleted in place: a process reading it meanwhile (a
        # stage loading its layers) keeps its open files, and the directory is missing for a rename only
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent)) if out.exists() else None
        if old is not None:
            os.replace(out, old / out.name)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(f"model ready: {out} ({time.monotonic() - t0:.0f} s)")
    return out


def _contents(field):
    try:
        return field.contents()
    except Exception:  # noqa: BLE001 — a field gguf cannot decode is one we do not need
        return None


def hf_config(meta: dict, reader, src: Path) -> dict:
    """config.json of the model, from the GGUF's metadata (ModelError for an architecture the mesh
    does not run)."""
    arch = str(meta.get("general.architecture", ""))
    names = {t.name for t in reader.tensors}
    experts = int(meta.get(f"{arch}.expert_count") or 0)
    family = "mixtral" if arch == "llama" and experts else ARCHITECTURES.get(arch)
    if arch == "deepseek2" and experts and int(meta.get(f"{arch}.expert_gating_func") or 1) == 1:
        family = "deepseek_v2"  # softmax routing (llama.cpp's gating 1); V3 and Kimi K2 route by sigmoid (2)
    if family is None:
        raise ModelError(f"{src}: GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(ARCHITECTURES)} (and Mixtral as llama with experts)")
    if int(meta.get("split.count") or 1) > 1:
        raise ModelError(f"{src} is one part of a split GGUF; merge the parts first (llama.cpp's `llama-gguf-split "
                         "--merge`)")
    if any(n.startswith("rope_factors") for n in names):
        raise ModelError(f"{src}: LongRoPE factors (rope_factors_*, Phi-3's 128k variants) are not supported; use a "
                         "4k-context variant")
    if ROPE_FREQS in names and family not in ("llama", "smollm3"):
        raise ModelError(f"{src}: a RoPE frequency table (rope_freqs) is supported from GGUF for llama and smollm3 "
                         f"(Llama 3.1's llama3 scaling), not for {family}")

    def get(key, default=None):
        value = meta.get(f"{arch}.{key}")
        return default if value is None else value

    tokens = meta.get("tokenizer.ggml.tokens") or []
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    layers = int(get("block_count"))
    nextn = int(get("nextn_predict_layers", 0) or 0) if family in ("glm4_moe", *HYBRID) else 0
    layers -= nextn  # GLM, Qwen3.5 / Qwen3-Next: llama.cpp counts the multi-token-prediction layers among the
    # blocks (not run here)
    config = {
        "model_type": {"gemma3": "gemma3_text", "qwen3_5": "qwen3_5_text"}.get(family, family),
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                           "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                           "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                           "phi3": "Phi3ForCausalLM", "gpt_oss": "GptOssForCausalLM",
                           "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                           "qwen2_moe": "Qwen2MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
                           "smollm3": "SmolLM3ForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
                           "qwen3_5": "Qwen3_5ForCausalLM"}[family]],
        "num_hidden_layers": layers, "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", 0) or 0),
        "num_attention_heads": heads, "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim, "vocab_size": int(get("vocab_size", len(tokens))),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling not in ("linear", "yarn"):
            raise ModelError(f"{src}: RoPE scaling {scaling!r} is not supported from GGUF (linear, yarn are)")
        config["rope_scaling"] = {"rope_type": scaling, "factor": float(get("rope.scaling.factor", 1.0))}
        if scaling == "yarn":
            config["rope_scaling"]["original_max_position_embeddings"] = int(
                get("rope.scaling.original_context_length", config["max_position_embeddings"]))
    if ROPE_FREQS in names:
        tensor = next(t for t in reader.tensors if t.name == ROPE_FREQS)
        scaling = llama3_rope(tensor.data, config["rope_theta"], int(get("rope.dimension_count", head_dim)),
                              f"{src}: {ROPE_FREQS}")
        if scaling is not None:
            config["rope_parameters"] = {**scaling, "rope_theta": config.pop("rope_theta")}
    if family in HYBRID:
        return hybrid_config(config, get, family, names, src)
    window = get("attention.sliding_window")
    if family == "gpt_oss":
        return _gpt_oss_config(config, get, experts, window, names, src)
    if family in ("deepseek_v2", "deepseek_v3"):
        config.update(deepseek_config(get, family, layers, experts, config))
    if family == "qwen2_moe":
        config["num_experts"], config["num_experts_per_tok"] = experts, int(get("expert_used_count"))
        config["moe_intermediate_size"] = int(get("expert_feed_forward_length"))
        config["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length", 0) or 0)
        config["norm_topk_prob"] = bool(get("expert_weights_norm", False))  # llama.cpp: off unless the file says
        config["qkv_bias"] = "blk.0.attn_q.bias" in names
    if family == "glm4_moe":
        gating = get("expert_gating_func")
        if gating not in (None, 2):  # gguf.ExpertGatingFuncType.SIGMOID
            raise ModelError(f"{src}: expert_gating_func {gating} is not supported for glm4moe (2, sigmoid, is)")
        config.update(
            n_routed_experts=experts, num_experts_per_tok=int(get("expert_used_count")),
            moe_intermediate_size=int(get("expert_feed_forward_length")),
            n_shared_experts=int(get("expert_shared_count", 0) or 0),
            first_k_dense_replace=int(get("leading_dense_block_count", 0) or 0),
            routed_scaling_factor=float(get("expert_weights_scale", 1.0) or 1.0),
            norm_topk_prob=bool(get("expert_weights_norm", False)),
            n_group=int(get("expert_group_count", 1) or 1), topk_group=int(get("expert_group_used_count", 1) or 1),
            partial_rotary_factor=int(get("rope.dimension_count", head_dim)) / head_dim,
            use_qk_norm="blk.0.attn_q_norm.weight" in names, attention_bias="blk.0.attn_q.bias" in names,
            num_nextn_predict_layers=0)  # the MTP layers are left out of the checkpoint
    if family == "smollm3":
        config["no_rope_layer_interval"] = 4  # llama.cpp: fixed, no key in the file
    if family in ("qwen3_moe", "mixtral"):
        config["num_experts" if family == "qwen3_moe" else "num_local_experts"] = experts
        config["num_experts_per_tok"] = int(get("expert_used_count"))
        if family == "qwen3_moe":
            config["moe_intermediate_size"] = int(get("expert_feed_forward_length"))
            config["norm_topk_prob"] = bool(get("expert_weights_norm", True))
    if family in ("qwen3_moe", "mixtral", "qwen2_moe"):  # layers without a router have a dense MLP (Qwen3-MoE's mlp_only_layers)
        dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names]
        if dense and family == "mixtral":
            raise ModelError(f"{src}: Mixtral layers {dense} have no router")
        if dense:
            config["mlp_only_layers"] = dense
    if family in ("gemma2", "gemma3"):
        config["hidden_activation"] = "gelu_pytorch_tanh"
        # as llama.cpp: the 27B models scale queries by hidden/heads, the others by head_dim
        big = layers == (46 if family == "gemma2" else 62)
        config["query_pre_attn_scalar"] = hidden // heads if big else head_dim
        config["sliding_window"] = int(window or 4096)
        if family == "gemma2":
            config["attn_logit_softcapping"] = float(get("attn_logit_softcapping", 50.0))
            config["final_logit_softcapping"] = float(get("final_logit_softcapping", 30.0))
        else:  # llama.cpp: every 6th layer global unless the file says another period
            pattern = get("attention.sliding_window_pattern", 6)  # a period, or per layer: sliding or not
            sliding = ([bool(x) for x in pattern] if isinstance(pattern, (list, tuple))
                       else [(i + 1) % int(pattern) != 0 for i in range(layers)])
            config["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
            full = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
            if "rope_scaling" in config:  # Gemma 3 scales the global layers' RoPE only
                full = {**config.pop("rope_scaling"), "rope_theta": full["rope_theta"]}
            config["rope_parameters"] = {"full_attention": full, "sliding_attention": {
                "rope_type": "default", "rope_theta": float(get("rope.freq_base_swa", 10000.0))}}
    elif window:
        config["sliding_window"] = int(window)
        if family in ("qwen2", "qwen3", "qwen3_moe"):
            config["use_sliding_window"] = True
    return config


def _gpt_oss_config(config: dict, get, experts: int, window, names: set, src: Path) -> dict:
    """gpt-oss's config.json from llama.cpp's metadata: experts in every layer (with biases), sinks,
    sliding and full layers in turn (llama.cpp's swa pattern 2: the even layers slide), YaRN, and
    llama.cpp's constants for the clamped SwiGLU."""
    layers = config["num_hidden_layers"]
    if not experts or any(f"blk.{i}.ffn_gate_inp.weight" not in names for i in range(layers)):
        raise ModelError(f"{src}: a gpt-oss GGUF needs experts (and a router) in every layer")
    size = int(get("expert_feed_forward_length", 0) or config["intermediate_size"])
    theta = config.pop("rope_theta")
    rope = {"rope_type": "default", "rope_theta": theta}
    if "rope_scaling" in config:  # transformers' gpt-oss defaults for what llama.cpp does not write
        rope = {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, **config.pop("rope_scaling"), "rope_theta": theta}
    config.update(num_local_experts=experts, num_experts_per_tok=int(get("expert_used_count")), intermediate_size=size,
                  attention_bias=True, rope_parameters=rope, **GPT_OSS_SWIGLU)
    if window:
        config["sliding_window"] = int(window)
        config["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    return config


def _gpt_oss_tensor(rest: str, p: str, shape: tuple[int, ...], t, by_name: dict) -> list[Out] | None:
    """The checkpoint tensor (if any) that gpt-oss's GGUF tensor `rest` of the layer with prefix p
    (HF's, "model.layers.N.") makes: None for a name it does not know; [] for an up tensor (made with its gate)."""
    if rest in _GPT_OSS:
        return [Out(p + _GPT_OSS[rest], shape, t)]
    e = _GPT_OSS_EXPERTS.fullmatch(rest)
    if e is None:
        return None
    kind, what = e.groups()
    if kind == "up":
        return []
    if kind == "down":  # [experts, hidden, inter] -> [experts, inter, hidden]; its bias as it is
        return [Out(f"{p}mlp.experts.down_proj" + ("_bias" if what == "bias" else ""),
                    shape if what == "bias" else (shape[0], shape[2], shape[1]), t, transpose=what == "weight")]
    up = by_name.get(t.name.replace("ffn_gate_exps", "ffn_up_exps"))
    if up is None:
        raise ModelError(f"tensor {t.name} has no ffn_up_exps beside it")
    if what == "bias":
        return [Out(f"{p}mlp.experts.gate_up_proj_bias", (shape[0], 2 * shape[1]), t, pair=up)]
    return [Out(f"{p}mlp.experts.gate_up_proj", (shape[0], shape[2], 2 * shape[1]), t, pair=up, transpose=True)]


def deepseek_config(get, family: str, layers: int, experts: int, config: dict) -> dict:
    """config.json's DeepSeek fields from llama.cpp's deepseek2 metadata: MLA's ranks and head sizes
    (llama.cpp writes the attention as multi-query over the latent: key_length = kv_lora + rope,
    key_length_mla = nope + rope; files from before it split kv_b have no *_mla keys), the experts,
    and YaRN's mscale (llama.cpp keeps 0.1 * mscale_all_dim as yarn_log_multiplier; DeepSeek sets
    mscale to the same value)."""
    rope = int(get("rope.dimension_count"))
    kv_lora = int(get("attention.kv_lora_rank"))
    qk = int(get("attention.key_length_mla", 0) or 0) or int(get("attention.key_length"))
    v = int(get("attention.value_length_mla", 0) or 0) or int(get("attention.value_length"))
    out = {"num_key_value_heads": config["num_attention_heads"], "head_dim": rope, "q_lora_rank":
           int(get("attention.q_lora_rank", 0) or 0) or None, "kv_lora_rank": kv_lora, "qk_rope_head_dim": rope,
           "qk_nope_head_dim": qk - rope, "v_head_dim": v, "rope_interleave": True,
           "first_k_dense_replace": int(get("leading_dense_block_count", layers if not experts else 0))}
    if experts:
        out.update(n_routed_experts=experts, num_experts_per_tok=int(get("expert_used_count")),
                   moe_intermediate_size=int(get("expert_feed_forward_length")),
                   n_shared_experts=int(get("expert_shared_count", 0)),
                   routed_scaling_factor=float(get("expert_weights_scale", 1.0)),
                   norm_topk_prob=bool(get("expert_weights_norm", False)),
                   n_group=int(get("expert_group_count", 1)), topk_group=int(get("expert_group_used_count", 1)))
        if family == "deepseek_v2":
            out["topk_method"] = "group_limited_greedy" if out["n_group"] > 1 else "greedy"
    log_mul = get("rope.scaling.yarn_log_multiplier")
    if log_mul and "rope_scaling" in config:
        m = round(float(log_mul) / 0.1, 6)  # the file holds it in float32
        config["rope_scaling"].update(mscale=m, mscale_all_dim=m)
    return out


def plan_tensors(reader, config: dict) -> list[Out]:
    """Every output tensor in file order (experts split one per tensor), ModelError for a tensor
    whose quantization cannot be undone or whose name means nothing to the family."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    family = ARCHITECTURES.get(config["model_type"], config["model_type"])
    family = {"gemma3_text": "gemma3", "qwen3_5_text": "qwen3_5"}.get(family, family)
    layer_names = dict(_LAYER)
    if family in ("gemma2", "gemma3"):
        layer_names.update(_GEMMA)
    if family == "phi3":
        layer_names.update(_PHI3)
    if family == "mixtral":
        layer_names.update(_MIXTRAL)
    if family in ("deepseek_v2", "deepseek_v3"):
        layer_names.update(_DEEPSEEK)
    by_name = {t.name: t for t in reader.tensors}
    if family in ("qwen2_moe", "qwen3_next"):
        layer_names.update(_QWEN2_MOE)
    if family in HYBRID:
        layer_names.update(_HYBRID)
    if family == "glm4_moe":
        layer_names.update(_GLM4_MOE)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    outs: list[Out] = []
    undone: set = set()  # quantization types gguf has dequantized a row of
    for t in reader.tensors:
        if t.name == ROPE_FREQS:  # in config.json's rope_parameters (hf_config)
            continue
        m = re.fullmatch(r"blk\.(\d+)\..+", t.name)
        if m is not None and int(m.group(1)) >= config["num_hidden_layers"]:  # GLM's MTP layers: not run here
            continue
        qtype = GGMLQuantizationType(t.tensor_type)
        if qtype not in undone:
            try:
                dequantize(t.data[:1], qtype)
            except NotImplementedError:
                raise ModelError(f"tensor {t.name} is stored as {qtype.name}, a quantization gguf cannot undo; use a "
                                 "GGUF in F16, BF16, Q8_0, Q4_0/1, Q5_0/1 or a K quant") from None
            undone.add(qtype)
        shape = tuple(int(x) for x in reversed([int(s) for s in t.shape]))
        gemma_norm = (family in ("gemma2", "gemma3") and t.name.endswith("norm.weight")
                      or family in HYBRID and is_zero_centred(t.name))  # llama.cpp stored 1 + w
        if t.name in _GLOBAL:
            outs.append(Out(_GLOBAL[t.name], shape, t, minus_one=gemma_norm))
            continue
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", t.name)
        if m is None:
            raise ModelError(f"tensor {t.name} means nothing to a {family} model")
        layer, rest = m.group(1), m.group(2)
        p = f"model.layers.{layer}."
        made = _gpt_oss_tensor(rest, p, shape, t, by_name) if family == "gpt_oss" else None
        if made is not None:
            outs += made
            continue
        pieces = linear_tensors(family, rest, int(layer), shape, t, by_name, config) if family in HYBRID else None
        if pieces is not None:
            outs += [Out(x.name, x.shape, x.source, undo=x.undo, extra=x.extra) for x in pieces]
            continue
        e = _EXPERTS.fullmatch(rest)
        if e is not None:  # [experts, out, in]: one tensor per expert
            kind = e.group(1)
            w = {"gate": "w1", "up": "w3", "down": "w2"}[kind]
            for x in range(shape[0]):
                name = (f"{p}block_sparse_moe.experts.{x}.{w}.weight" if family == "mixtral"
                        else f"{p}mlp.experts.{x}.{kind}_proj.weight")
                outs.append(Out(name, shape[1:], t, expert=x))
            continue
        if rest == "attn_k_b.weight" and f"blk.{layer}.attn_v_b.weight" in by_name:  # [heads, kv_lora, nope]
            v_b = by_name[f"blk.{layer}.attn_v_b.weight"]
            h, _, nope = shape
            v_dim = int(v_b.shape[1])  # gguf's shape: [kv_lora, v, heads]
            outs.append(Out(p + "self_attn.kv_b_proj.weight", (h * (nope + v_dim), shape[1]), t, permute_heads=h,
                            v_b=v_b))
            continue
        if rest == "attn_v_b.weight":  # joined with its attn_k_b above
            continue
        if rest not in layer_names:
            raise ModelError(f"tensor {t.name} means nothing to a {family} model")
        permute = 0
        if family in PERMUTED and rest in ("attn_q.weight", "attn_k.weight"):
            permute = heads if rest == "attn_q.weight" else kv_heads
        if rest == "ffn_gate_inp_shexp.weight":  # Qwen2-MoE's shared expert gate: [1, hidden], however stored
            shape = (1, shape[-1])
        outs.append(Out(p + layer_names[rest], shape, t, permute_heads=permute, minus_one=gemma_norm,
                        float32=rest == "exp_probs_b.bias"))
    return outs


def tensor_values(o: Out):
    """The float32 values (numpy) of one output tensor, as the checkpoint had them."""
    import numpy as np
    from gguf.quants import dequantize

    t = o.source
    if o.undo is not None or o.extra:
        w = _values(t)
        return np.ascontiguousarray(o.undo(w, *[_values(x) for x in o.extra]) if o.undo is not None else w,
                                    dtype=np.float32).reshape(o.shape)
    if o.pair is not None or o.transpose:  # gpt-oss's experts: [experts, out, in] (or [experts, out]) in the file
        w = _values(t)
        if o.pair is not None:  # gate and up interleaved along out: gate rows 0, 2, ..., up rows 1, 3, ...
            w = np.stack([w, _values(o.pair)], axis=2).reshape(w.shape[0], 2 * w.shape[1], *w.shape[2:])
        return np.ascontiguousarray(w.transpose(0, 2, 1) if o.transpose else w).reshape(o.shape)
    data = t.data[o.expert] if o.expert >= 0 else t.data
    if o.v_b is not None:  # DeepSeek: [heads, kv_lora, nope] -> [heads, nope, kv_lora], then each head's v rows
        heads, kv_lora = o.permute_heads, o.shape[1]
        k_b = np.array(dequantize(data, t.tensor_type), dtype=np.float32).reshape(heads, kv_lora, -1).swapaxes(1, 2)
        v_b = np.array(dequantize(o.v_b.data, o.v_b.tensor_type), dtype=np.float32).reshape(heads, -1, kv_lora)
        return np.concatenate([k_b, v_b], axis=1).reshape(o.shape)
    w = np.array(dequantize(data, t.tensor_type), dtype=np.float32).reshape(o.shape)  # a copy: the file is read-only
    if o.permute_heads:  # llama.cpp: reshape(heads, 2, d/2, in).swapaxes(1, 2); undone
        n = o.permute_heads
        w = w.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:]).swapaxes(2, 1).reshape(o.shape)
    if o.minus_one:
        w = w - 1.0
    return w


def _values(t):
    """A GGUF tensor's float32 values (numpy) in its own shape (outermost dimension first)."""
    import numpy as np
    from gguf.quants import dequantize

    shape = tuple(int(x) for x in reversed([int(s) for s in t.shape]))
    return np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)


def write_safetensors(path: Path, outs: list[Out], dtype: str, say: Callable[[str], None]) -> None:
    """One safetensors file: the header with every tensor's place first, then each tensor's bytes
    as it is converted (one tensor in memory at a time)."""
    import numpy as np
    import torch

    header, offset = {}, 0
    for o in outs:
        tag, size = DTYPES["float32" if o.float32 else dtype]
        n = int(np.prod(o.shape)) * size
        header[o.name] = {"dtype": tag, "shape": list(o.shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    total = offset
    step = max(1, len(outs) // 20)
    say(f"[2/3] writing {total / 2**20:.0f} MiB of {dtype} weights")
    t0 = time.monotonic()
    written = 0
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for i, o in enumerate(outs):
            x = torch.from_numpy(tensor_values(o))
            data = x.to(torch.float32 if o.float32 else getattr(torch, dtype)).contiguous()
            f.write(data.view(torch.uint8).numpy())  # the raw bytes (numpy has no bfloat16), no copy
            written += data.numel() * data.element_size()
            if (i + 1) % step == 0 or i + 1 == len(outs):
                say(f"      {i + 1}/{len(outs)} tensors, {written / 2**20:.0f}/{total / 2**20:.0f} MiB "
                    f"({time.monotonic() - t0:.0f} s)")
        f.flush()
        os.fsync(f.fileno())
