"""The compact stage forward against transformers' own LlamaForCausalLM: same logits, any split."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, LlamaConfig, LlamaForCausalLM

import stage_node.shard as shard_mod
from stage_node.kv import SeqSlice, SessionKV, kv_bytes_per_token
from stage_node.shard import Shard

RTOL = 1e-4
SPLIT3 = [(0, 10), (10, 20), (20, 30)]


def assert_close(a: torch.Tensor, b: torch.Tensor, rtol: float = RTOL) -> None:
    err = ((a - b).abs().max() / b.abs().max()).item()
    assert err <= rtol, f"relative error {err:.3g} > {rtol}"


# ----------------------------------------------------------------------------- helpers

def load_split(model_dir, bounds) -> list[Shard]:
    n = len(bounds)
    return [Shard.load(model_dir, s, e, first=i == 0, last=i == n - 1) for i, (s, e) in enumerate(bounds)]


def run_pipeline(shards: list[Shard], caches: list, token_ids: torch.Tensor, start_pos: int) -> torch.Tensor:
    """Prefill or decode token_ids [T] of one sequence through all shards -> logits [T, vocab]."""
    h = shards[0].embed(token_ids)
    for shard, cache in zip(shards, caches):
        h = shard.forward(h, [SeqSlice(cache, start_pos, len(token_ids))])
    return shards[-1].logits(h)


def hf_greedy_steps(model, ids: torch.Tensor, steps: int) -> tuple[list[torch.Tensor], list[int]]:
    """HF logits of the prefill's last row and of each decode step, feeding back argmax tokens."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(ids[None], past_key_values=cache, use_cache=True)
        logits, tokens = [out.logits[0]], []
        for _ in range(steps):
            tokens.append(int(logits[-1][-1].argmax()))
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
            logits.append(out.logits[0])
    return logits, tokens


def check_against_hf(shards, hf_logits, tokens, ids, capacity=256):
    caches = [s.new_cache(capacity) for s in shards]
    assert_close(run_pipeline(shards, caches, ids, 0), hf_logits[0])
    pos = len(ids)
    for tok, ref in zip(tokens, hf_logits[1:]):
        assert_close(run_pipeline(shards, caches, torch.tensor([tok]), pos), ref)
        pos += 1
    assert all(c.length == pos for c in caches)


# ----------------------------------------------------------------------------- default model

@pytest.fixture(scope="module")
def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(model_dir) -> torch.Tensor:
    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   tokenize=False, add_generation_prompt=True)
    return torch.tensor(tok(text).input_ids)


@pytest.fixture(scope="module")
def full(model_dir) -> Shard:
    return Shard.load(model_dir, 0, 30, first=True, last=True)


@pytest.fixture(scope="module")
def split3(model_dir) -> list[Shard]:
    return load_split(model_dir, SPLIT3)


@pytest.fixture(scope="module")
def hf_run(hf_model, prompt_ids):
    return hf_greedy_steps(hf_model, prompt_ids, steps=6)


def test_prefill_and_decode_match_hf(full, hf_run, prompt_ids):
    check_against_hf([full], *hf_run, prompt_ids)


def test_three_shards_match_hf(split3, hf_run, prompt_ids):
    check_against_hf(split3, *hf_run, prompt_ids)


def test_parameter_counts(model_dir, hf_model, full, split3):
    total = hf_model.num_parameters()
    half = load_split(model_dir, [(0, 15), (15, 30)])
    for shards in ([full], half, split3):
        assert sum(s.parameter_count for s in shards) == total
        for s in shards:
            assert (s.tied_copy_count > 0) == (s.last and not s.first)
    assert split3[-1].tied_copy_count == hf_model.config.vocab_size * hf_model.config.hidden_size


def test_batch_of_two_equals_each_alone(full, prompt_ids):
    a, b = prompt_ids, prompt_ids[5:-3]
    ca, cb = full.new_cache(64), full.new_cache(64)
    h = full.forward(full.embed(torch.cat([a, b])), [SeqSlice(ca, 0, len(a)), SeqSlice(cb, 0, len(b))])
    batch_prefill = full.logits(h)
    step = full.forward(full.embed(torch.tensor([10, 20])), [SeqSlice(ca, len(a), 1), SeqSlice(cb, len(b), 1)])
    batch_step = full.logits(step)
    for i, (ids, tok, rows) in enumerate([(a, 10, slice(0, len(a))), (b, 20, slice(len(a), None))]):
        cache = full.new_cache(64)
        assert_close(batch_prefill[rows], run_pipeline([full], [cache], ids, 0))
        assert_close(batch_step[i], run_pipeline([full], [cache], torch.tensor([tok]), len(ids))[0])


def test_chunked_prefill_equals_one_prefill(full, prompt_ids):
    whole = run_pipeline([full], [full.new_cache(64)], prompt_ids, 0)
    cache = full.new_cache(64)
    cut = len(prompt_ids) // 3
    first = run_pipeline([full], [cache], prompt_ids[:cut], 0)
    second = run_pipeline([full], [cache], prompt_ids[cut:], cut)
    assert_close(torch.cat([first, second]), whole)
    assert cache.length == len(prompt_ids)


def test_truncate_rolls_back(full, prompt_ids):
    cache = full.new_cache(64)
    run_pipeline([full], [cache], prompt_ids, 0)
    n = len(prompt_ids)
    ref = run_pipeline([full], [cache], torch.tensor([42]), n)
    run_pipeline([full], [cache], torch.tensor([7, 8]), n + 1)  # candidates later rejected
    cache.truncate(n)
    assert_close(run_pipeline([full], [cache], torch.tensor([42]), n), ref)
    fork = cache.fork()
    assert fork.length == cache.length and torch.equal(fork.k[:, :, : n + 1], cache.k[:, :, : n + 1])


def test_load_reads_only_its_range(model_dir, monkeypatch):
    read = []
    real_open = shard_mod.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.f = real_open(*args, **kwargs)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_tensor(self, name):
            read.append(name)
            return self.f.get_tensor(name)

    monkeypatch.setattr(shard_mod, "safe_open", Recording)
    middle = Shard.load(model_dir, 10, 13, first=False, last=False)
    assert read and all(any(f"layers.{i}." in n for i in (10, 11, 12)) for n in read)
    assert {n.split(".")[2] for n in read} == {"10", "11", "12"}
    assert middle.embed_tokens is None and middle.lm_head_t is None
    read.clear()
    tail = Shard.load(model_dir, 29, 30, first=False, last=True)
    assert set(read) - {n for n in read if "layers.29." in n} == {"model.embed_tokens.weight", "model.norm.weight"}
    assert tail.tied_copy_count > 0


@pytest.mark.parametrize("start, end", [(-1, 5), (5, 5), (10, 5), (0, 31), (30, 31)])
def test_bad_ranges_raise(model_dir, start, end):
    with pytest.raises(ValueError, match="layer range"):
        Shard.load(model_dir, start, end, first=False, last=False)


def test_bad_forward_calls_raise(split3):
    s = split3[1]
    cache = s.new_cache(8)
    h = torch.zeros(3, s.config.hidden_size)
    with pytest.raises(ValueError, match="past the cached length"):
        s.forward(h, [SeqSlice(cache, 1, 3)])
    with pytest.raises(ValueError, match="capacity"):
        s.forward(torch.zeros(9, s.config.hidden_size), [SeqSlice(cache, 0, 9)])
    with pytest.raises(ValueError, match="rows"):
        s.forward(h, [SeqSlice(cache, 0, 2)])
    with pytest.raises(ValueError, match="layers"):
        s.forward(h, [SeqSlice(SessionKV(5, 3, 8, 64), 0, 3)])
    assert cache.length == 0
    with pytest.raises(RuntimeError):
        s.embed(torch.tensor([1]))
    with pytest.raises(RuntimeError):
        s.logits(h)
    with pytest.raises(ValueError, match="token ids"):
        split3[0].embed(torch.tensor([s.config.vocab_size]))


def test_kv_sizes(full):
    cache = full.new_cache(100)
    assert cache.k.shape == (30, 3, 100, 64)
    assert cache.nbytes == 100 * kv_bytes_per_token(full.config, 30, torch.float32)


# ----------------------------------------------------------------------------- tiny random Llamas

ROPES = {
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0},
}


def tiny_llama(path, rope: dict, **overrides):
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, attention_bias=True, mlp_bias=True,
                      rope_parameters=rope, **overrides)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # biases and norms start as 0 / 1: randomise so loading them is tested
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, max_shard_size="200KB")  # several files + model.safetensors.index.json
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("rope", list(ROPES))
def test_tiny_llama_matches_hf(tmp_path, rope):
    hf = tiny_llama(tmp_path, ROPES[rope])
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(1))  # past original 16 positions
    hf_logits, tokens = hf_greedy_steps(hf, ids, steps=4)
    shards = load_split(tmp_path, [(0, 1), (1, 4)])
    assert sum(s.parameter_count for s in shards) == hf.num_parameters()
    assert all(s.tied_copy_count == 0 for s in shards)
    check_against_hf(shards, hf_logits, tokens, ids)
    full = Shard.load(tmp_path, 0, 4, first=True, last=True)
    check_against_hf([full], hf_logits, tokens, ids)


def test_tiny_llama_bfloat16_matches_hf(tmp_path):
    tiny_llama(tmp_path, ROPES["llama3"])
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 96, (24,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    shard = Shard.load(tmp_path, 0, 4, first=True, last=True, dtype=torch.bfloat16)
    assert shard.new_cache(8).k.dtype == torch.bfloat16
    assert_close(run_pipeline([shard], [shard.new_cache(32)], ids, 0), ref, rtol=2e-2)
