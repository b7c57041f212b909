"""ModelConfig.from_dir refuses what the forward cannot run, with a message naming the fix; model_digest."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from logicpipe.common.modeldir import ModelConfig, ModelError, model_digest

LLAMA = {
    "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 16, "intermediate_size": 32,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 10, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 64, "eos_token_id": 2, "tie_word_embeddings": True,
}


def write_model(path, config=LLAMA, weights=True):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if weights:
        save_file({"model.embed_tokens.weight": torch.zeros(10, 16)}, str(path / "model.safetensors"))
    return path


def test_reads_llama_config(tmp_path):
    cfg = ModelConfig.from_dir(write_model(tmp_path / "m"))
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 16, 4, 2, 4)
    assert cfg.eos_token_ids == (2,) and cfg.tie_word_embeddings and not cfg.attention_bias
    assert cfg.rope_type == "default"


def test_eos_from_generation_config(tmp_path):
    path = write_model(tmp_path / "m")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert ModelConfig.from_dir(path).eos_token_ids == (2, 7)


def test_default_model(model_dir):
    cfg = ModelConfig.from_dir(model_dir)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152 and 2 in cfg.eos_token_ids


def test_missing_dir(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        ModelConfig.from_dir(tmp_path / "nope")


def test_no_config_json(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        ModelConfig.from_dir(tmp_path / "m")


def test_bad_json(tmp_path):
    path = write_model(tmp_path / "m")
    (path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="JSON"):
        ModelConfig.from_dir(path)


def test_non_llama_model_type(tmp_path):
    path = write_model(tmp_path / "m", {**LLAMA, "model_type": "bert"})
    with pytest.raises(ModelError, match="'bert'.*supported model types: llama"):
        ModelConfig.from_dir(path)


def test_no_safetensors(tmp_path):
    path = write_model(tmp_path / "m", weights=False)
    (path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelError, match="no \\*.safetensors.*convert"):
        ModelConfig.from_dir(path)


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0}, {"type": "dynamic", "factor": 2.0}])
def test_dynamic_rope_rejected(tmp_path, rope):
    key = "rope_parameters" if "rope_type" in rope else "rope_scaling"
    path = write_model(tmp_path / "m", {**LLAMA, key: rope})
    with pytest.raises(ModelError, match="'dynamic'.*supported RoPE types"):
        ModelConfig.from_dir(path)


def test_incomplete_config(tmp_path):
    cfg = dict(LLAMA)
    del cfg["hidden_size"]
    with pytest.raises(ModelError, match="incomplete"):
        ModelConfig.from_dir(write_model(tmp_path / "m", cfg))


def test_model_digest_stable_and_sensitive(tmp_path):
    a = write_model(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    d = model_digest(a)
    assert len(d) == 16 and set(d) <= set("0123456789abcdef")
    assert d == model_digest(a) == model_digest(b)
    (b / "config.json").write_text(json.dumps({**LLAMA, "rms_norm_eps": 1e-6}))
    assert model_digest(b) != d
    save_file({"model.embed_tokens.weight": torch.zeros(11, 16)}, str(a / "model.safetensors"))
    assert model_digest(a) != d


def test_model_digest_missing_dir(tmp_path):
    with pytest.raises(ModelError):
        model_digest(tmp_path / "nope")


def test_partial_rope_and_shared_experts_only_where_the_forward_runs_them(tmp_path):
    """A partial RoPE is run for GLM-4.5 (half of each head by default) and refused for the others;
    shared experts are run for qwen2_moe and refused in a qwen3_moe config; a NoPE layer list of the
    wrong length is refused."""
    with pytest.raises(ModelError, match="partial_rotary_factor 0.5 is not supported for llama"):
        ModelConfig.from_dir(write_model(tmp_path / "a", {**LLAMA, "partial_rotary_factor": 0.5}))
    moe = {"num_experts_per_tok": 2, "moe_intermediate_size": 8}
    glm = {**LLAMA, "model_type": "glm4_moe", "n_routed_experts": 4, **moe}
    assert ModelConfig.from_dir(write_model(tmp_path / "b", glm)).arch.rotary == 0.5
    with pytest.raises(ModelError, match="even number of rotated dims"):
        ModelConfig.from_dir(write_model(tmp_path / "c", {**glm, "partial_rotary_factor": 0.25}))
    with pytest.raises(ModelError, match="shared experts are not supported for qwen3_moe"):
        ModelConfig.from_dir(write_model(tmp_path / "d", {**LLAMA, "model_type": "qwen3_moe", "num_experts": 4, **moe,
                                                           "shared_expert_intermediate_size": 16}))
    with pytest.raises(ModelError, match="no_rope_layers"):
        ModelConfig.from_dir(write_model(tmp_path / "e", {**LLAMA, "model_type": "smollm3", "no_rope_layers": [1]}))
