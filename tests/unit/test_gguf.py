"""GGUF files as users have them (tests/gguf_files.py writes them as llama.cpp does, from tiny
checkpoints of every family GGUF carries): converted tensor by tensor, they give back the very
checkpoint (float32), or its round trip through the file's quantization (bfloat16 out), and the
stages' greedy tokens equal transformers' on the original; what cannot be converted is refused
naming why; a conversion is done once and redone when the file changes."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from logicpipe.common.modeldir import ModelConfig, ModelError
from logicpipe.controller.cli.gguf_convert import prepare_gguf
from logicpipe.controller.cli.model_prep import find_default_gguf, resolve_model
from tests.families import build as _build, hf_greedy, hf_model
from tests.gguf_files import SMALL_VOCAB, dequantized, small_tokenizer_gguf, write_gguf

from .test_families import PROMPT, RTOL, STEPS, greedy, shards_of

PROMPT = [t % SMALL_VOCAB for t in PROMPT]  # the tiny models here have the small tokenizer's vocabulary

# what llama.cpp keeps of each family (it has no sliding window for Qwen2, scales Gemma 2's queries by head_dim,
# and clamps gpt-oss's SwiGLU at its constant 7)
# (GLM: llama.cpp writes no expert groups; SmolLM3: llama.cpp's NoPE layers are every 4th, fixed; Qwen3.5 and
# Qwen3-Next: llama.cpp keeps a full_attention_interval, 4 unless the config says, not layer_types; Qwen3-Next
# has experts in every layer, llama.cpp's runtime runs none without; Qwen3.5 with its M-RoPE sections)
HYBRID_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
               "mrope_interleaved": True}
FAMILIES = {"llama": {}, "qwen2": dict(use_sliding_window=False), "qwen3": {}, "qwen3_moe": {}, "mixtral": {},
            "gemma2": dict(query_pre_attn_scalar=16), "gemma3": {}, "phi3": {}, "deepseek_v2": {}, "deepseek_v3": {},
            "gpt_oss": dict(swiglu_limit=7.0), "qwen2_moe": {}, "glm4_moe": dict(n_group=1, topk_group=1),
            "smollm3": dict(num_hidden_layers=4, no_rope_layers=None, use_sliding_window=False),
            "qwen3_5": dict(full_attention_interval=3, rope_parameters=HYBRID_ROPE),
            "qwen3_next": dict(full_attention_interval=3, mlp_only_layers=[])}
LLAMA3 = dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})


@pytest.fixture(scope="module")
def tokenizer_gguf(tmp_path_factory):
    """A small real BPE (the default model's first SMALL_VOCAB tokens): files that parse in milliseconds."""
    return small_tokenizer_gguf(find_default_gguf(), tmp_path_factory.mktemp("tok") / "tokenizer.gguf")


def build(family, path, **overrides):
    return _build(family, path, **{"vocab_size": SMALL_VOCAB, **overrides})


def quiet(_msg: str) -> None:
    pass


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_gguf_converts_back_to_its_checkpoint_and_serves_its_tokens(family, tmp_path, tokenizer_gguf):
    original = build(family, tmp_path / "hf", **FAMILIES[family])
    gguf = write_gguf(family, original, tmp_path / f"{family}.gguf", tokenizer_gguf)
    messages: list[str] = []
    out = prepare_gguf(gguf, tmp_path / "prepared", dtype="float32", progress=messages.append)
    assert any(m.startswith("[2/3]") for m in messages) and messages[-1].startswith("model ready")
    want, got = load_file(str(original / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name, x in want.items():
        if name.endswith("A_log"):  # llama.cpp stores -exp(A_log): back to within exp's rounding
            assert torch.allclose(got[name], x, rtol=0, atol=1e-6) and not torch.equal(got[name], -x.exp()), name
        else:
            assert torch.equal(got[name], x), name
    config = ModelConfig.from_dir(out)
    assert config.arch == ModelConfig.from_dir(original).arch
    if family in ("qwen3_5", "qwen3_next"):  # what the forward does not show: M-RoPE's sections (text: one position)
        assert json.loads((out / "config.json").read_text())["rope_parameters"] == json.loads(
            (original / "config.json").read_text())["rope_parameters"]
    logits, tokens = greedy(shards_of(out, [(0, 1), (1, 2), (2, config.num_layers)]), PROMPT, STEPS)
    model = hf_model(original)
    with torch.no_grad():
        want_logits = model(torch.tensor([PROMPT])).logits[0, -1]
    assert ((logits - want_logits).abs().max() / want_logits.abs().max()).item() <= RTOL
    assert tokens == hf_greedy(model, PROMPT, STEPS)


def test_an_older_qwen3next_gguf_with_ssm_in_converts_back(tmp_path, tokenizer_gguf):
    """Qwen3-Next as llama.cpp's converters wrote it before splitting in_proj_qkvz into attn_qkv and
    attn_gate: the whole projection as ssm_in, in the checkpoint's own rows (llama.cpp still reads it)."""
    original = build("qwen3_next", tmp_path / "hf", **FAMILIES["qwen3_next"])
    gguf = write_gguf("qwen3_next", original, tmp_path / "old.gguf", tokenizer_gguf, ssm_in=True)
    out = prepare_gguf(gguf, tmp_path / "p", dtype="float32", progress=quiet)
    want, got = load_file(str(original / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name in [n for n in want if "linear_attn.in_proj" in n]:
        assert torch.equal(got[name], want[name]), name


def test_llama3_rope_scaling_comes_back_from_its_rope_freqs_table(tmp_path, tokenizer_gguf):
    """Llama 3.1's RoPE scaling, which llama.cpp stores as per-frequency factors (rope_freqs) and no
    metadata, converts back to the rope_parameters that give the same frequencies and tokens."""
    from logicpipe.stage_node.model.rope import rope_parameters

    original = build("llama", tmp_path / "hf", **LLAMA3)
    out = prepare_gguf(write_gguf("llama", original, tmp_path / "l.gguf", tokenizer_gguf), tmp_path / "p",
                       dtype="float32", progress=quiet)
    assert json.loads((out / "config.json").read_text())["rope_parameters"] == {
        **LLAMA3["rope_parameters"], "rope_theta": 500000.0}
    assert torch.equal(rope_parameters(out)[0], rope_parameters(original)[0])
    tokens = greedy(shards_of(out, [(0, 1), (1, 3)]), PROMPT, STEPS)[1]
    assert tokens == hf_greedy(hf_model(original), PROMPT, STEPS)


def test_llama3_parameters_are_fitted_to_the_table_and_checked():
    """Another band than Llama 3.1's is fitted from its smoothed factors; factors no llama3 scaling
    gives are refused."""
    from logicpipe.controller.cli.gguf_convert import llama3_rope
    from tests.gguf_files import llama3_factors

    cfg = dict(hidden_size=512, num_attention_heads=4, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 16.0, "low_freq_factor": 0.5, "high_freq_factor": 8.0})
    got = llama3_rope(llama3_factors(cfg), 10000.0, 128, "t")
    assert got == {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 0.5, "high_freq_factor": 8.0,
                   "original_max_position_embeddings": 8192}
    assert llama3_rope(np.ones(64, np.float32), 10000.0, 128, "t") is None
    bad = llama3_factors(cfg)
    bad[20] *= 1.1
    with pytest.raises(ModelError, match="no llama3 scaling"):
        llama3_rope(bad, 10000.0, 128, "t")
    with pytest.raises(ModelError, match="expected 64"):
        llama3_rope(np.ones(10, np.float32), 10000.0, 128, "t")


@pytest.mark.parametrize("qtype", ["Q8_0", "F16"])
def test_quantized_tensors_come_out_as_their_values_in_bfloat16(qtype, tmp_path, tokenizer_gguf):
    original = build("qwen3_moe", tmp_path / "hf")
    gguf = write_gguf("qwen3_moe", original, tmp_path / "m.gguf", tokenizer_gguf, qtype=qtype)
    out = prepare_gguf(gguf, tmp_path / "prepared", progress=quiet)  # bfloat16 unless asked
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    got = load_file(str(out / "model.safetensors"))
    for name, x in load_file(str(original / "model.safetensors")).items():
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name], dequantized(x, qtype).to(torch.bfloat16)), name


def test_gpt_oss_mxfp4_experts_come_out_as_their_values(tmp_path, tokenizer_gguf):
    """gpt-oss with its expert matrices in GGML's MXFP4 (as llama.cpp writes the released checkpoints): they
    convert to the values the blocks hold, in transformers' fused layout; the rest exactly; and the stages
    give transformers' greedy tokens on the converted directory."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    def mxfp4(x: torch.Tensor) -> torch.Tensor:  # [experts, out, in] through MXFP4
        q = GGMLQuantizationType.MXFP4
        return torch.from_numpy(dequantize(quantize(x.numpy(), q), q).reshape(x.shape).copy())

    original = build("gpt_oss", tmp_path / "hf", **FAMILIES["gpt_oss"])
    gguf = write_gguf("gpt_oss", original, tmp_path / "m.gguf", tokenizer_gguf, experts_qtype="MXFP4")
    out = prepare_gguf(gguf, tmp_path / "prepared", dtype="float32", progress=quiet)
    got = load_file(str(out / "model.safetensors"))
    for name, x in load_file(str(original / "model.safetensors")).items():
        if name.endswith("experts.gate_up_proj"):  # each of gate and up quantized on its own, [out, in]
            t = x.transpose(1, 2)
            both = torch.stack([mxfp4(t[:, 0::2].contiguous()), mxfp4(t[:, 1::2].contiguous())], 2)
            x = both.reshape(t.shape).transpose(1, 2)
        elif name.endswith("experts.down_proj"):
            x = mxfp4(x.transpose(1, 2).contiguous()).transpose(1, 2)
        assert torch.equal(got[name], x), name
    assert not torch.equal(got["model.layers.0.mlp.experts.down_proj"],
                           load_file(str(original / "model.safetensors"))["model.layers.0.mlp.experts.down_proj"])
    tokens = greedy(shards_of(out, [(0, 2), (2, 3)]), PROMPT, STEPS)[1]
    assert tokens == hf_greedy(hf_model(out), PROMPT, STEPS)


def test_the_tokenizer_and_chat_template_come_from_the_file(tmp_path, model_dir):
    from transformers import AutoTokenizer

    original = _build("llama", tmp_path / "hf")  # the default model's whole vocabulary
    out = prepare_gguf(write_gguf("llama", original, tmp_path / "m.gguf", find_default_gguf()), tmp_path / "p",
                       progress=quiet)
    ours, default = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(model_dir)
    text = "GGUF files, as users have them: 3 + 4 = 7."
    assert ours.encode(text) == default.encode(text)
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, tokenize=False) == default.apply_chat_template(chat, tokenize=False)


def test_a_conversion_is_done_once_and_redone_when_the_file_changes(tmp_path, tokenizer_gguf):
    gguf = write_gguf("llama", build("llama", tmp_path / "hf"), tmp_path / "m.gguf", tokenizer_gguf)
    out = prepare_gguf(gguf, tmp_path / "p", progress=quiet)
    weights = out / "model.safetensors"
    first = weights.stat().st_mtime_ns
    messages: list[str] = []
    assert prepare_gguf(gguf, tmp_path / "p", progress=messages.append) == out
    assert weights.stat().st_mtime_ns == first and messages == [f"model ready: {out}"]
    # the same bytes at another path, newer (another checkout's virtualenv): the conversion serves it
    copy = tmp_path / "elsewhere" / "m.gguf"
    copy.parent.mkdir()
    shutil.copyfile(gguf, copy)
    os.utime(copy, ns=(first + 10**9, first + 10**9))
    assert prepare_gguf(copy, tmp_path / "p", progress=quiet) == out and weights.stat().st_mtime_ns == first
    write_gguf("llama", build("llama", tmp_path / "hf2", seed=1), gguf, tokenizer_gguf)  # other bytes: again
    prepare_gguf(gguf, tmp_path / "p", progress=quiet)
    assert weights.stat().st_mtime_ns != first
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".p.")]  # no temporary left behind


def test_resolve_model_takes_a_directory_as_it_is_and_converts_a_gguf(tmp_path, tokenizer_gguf, monkeypatch):
    original = build("qwen3", tmp_path / "hf")
    assert resolve_model(str(original)) == original
    monkeypatch.setenv("LOGICPIPE_CACHE", str(tmp_path / "cache"))
    gguf = write_gguf("qwen3", original, tmp_path / "q.gguf", tokenizer_gguf)
    out = resolve_model(str(gguf), dtype="float32", progress=quiet)
    assert out.is_relative_to(tmp_path / "cache") and ModelConfig.from_dir(out).model_type == "qwen3"
    with pytest.raises(ModelError, match="not a model directory or a .gguf file"):
        resolve_model(str(tmp_path / "nothing"))
    with pytest.raises(ModelError, match="bfloat16, float32"):
        resolve_model(str(gguf), dtype="float16")


def test_lpctl_model_prepare_converts_a_gguf_with_progress(tmp_path, tokenizer_gguf):
    gguf = write_gguf("gemma3", build("gemma3", tmp_path / "hf"), tmp_path / "g.gguf", tokenizer_gguf)
    run = subprocess.run([sys.executable, "-m", "logicpipe.controller.cli.lpctl", "model", "prepare", "--gguf", str(gguf),
                          "--dtype", "float32", "--out", str(tmp_path / "out")], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(tmp_path / "out") and "tensors" in run.stderr
    assert ModelConfig.from_dir(tmp_path / "out").model_type == "gemma3_text"
    bad = subprocess.run([sys.executable, "-m", "logicpipe.controller.cli.lpctl", "model", "prepare", "--dtype", "float32"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--dtype is for --gguf FILE" in bad.stderr


def test_what_cannot_be_converted_is_refused_saying_why(tmp_path, tokenizer_gguf):
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

    original = build("llama", tmp_path / "hf")
    with pytest.raises(ModelError, match="architecture 'mamba' is not supported; supported: llama, qwen2"):
        prepare_gguf(write_gguf("llama", original, tmp_path / "a.gguf", tokenizer_gguf, arch="mamba"), tmp_path / "o")
    w = GGUFWriter(str(tmp_path / "q81.gguf"), "llama")  # a quantization gguf cannot undo
    w.add_block_count(1), w.add_embedding_length(32), w.add_head_count(4)
    q81 = GGMLQuantizationType.Q8_1
    w.add_tensor("blk.0.attn_q.weight", np.zeros((32, GGML_QUANT_SIZES[q81][1]), np.uint8), raw_dtype=q81)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ModelError, match="blk.0.attn_q.weight is stored as Q8_1"):
        prepare_gguf(tmp_path / "q81.gguf", tmp_path / "o")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ModelError, match="not a readable GGUF file"):
        prepare_gguf(tmp_path / "junk.gguf", tmp_path / "o")
    with pytest.raises(ModelError, match="no such GGUF file"):
        prepare_gguf(tmp_path / "absent.gguf", tmp_path / "o")
    assert not (tmp_path / "o").exists()
