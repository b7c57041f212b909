"""The compact stage forward against transformers' own LlamaForCausalLM: same logits, any split."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, LlamaConfig, LlamaForCausalLM

import logicpipe.stage_node.model.weights as weights_mod
from logicpipe.stage_node.engine.kv import KVPool, StepKV, kv_bytes_per_token, seq_slice
from logicpipe.stage_node.model.shard import Shard

from .paged import PagedCache

RTOL = 1e-4
SPLIT3 = [(0, 10), (10, 20), (20, 30)]


def assert_close(a: torch.Tensor, b: torch.Tensor, rtol: float = RTOL) -> None:
    err = ((a - b).abs().max() / b.abs().max()).item()
    assert err <= rtol, f"relative error {err:.3g} > {rtol}"


# ----------------------------------------------------------------------------- helpers

def load_split(model_dir, bounds) -> list[Shard]:
    n = len(bounds)
    return [Shard.load(model_dir, s, e, first=i == 0, last=i == n - 1) for i, (s, e) in enumerate(bounds)]


def run_pipeline(shards: list[Shard], caches: list[PagedCache], token_ids: torch.Tensor, start_pos: int,
                 seq: str = "s") -> torch.Tensor:
    """Prefill or decode token_ids [T] of one sequence through all shards -> logits [T, vocab]."""
    h = shards[0].embed(token_ids)
    for cache in caches:
        h = cache.forward(h, [(seq, start_pos, token_ids.tolist())])
    return shards[-1].logits(h)


def caches_for(shards: list[Shard], num_blocks: int = 64) -> list[PagedCache]:
    return [PagedCache(s, num_blocks) for s in shards]


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


def check_against_hf(shards, hf_logits, tokens, ids):
    caches = caches_for(shards)
    assert_close(run_pipeline(shards, caches, ids, 0), hf_logits[0])
    pos = len(ids)
    for tok, ref in zip(tokens, hf_logits[1:]):
        assert_close(run_pipeline(shards, caches, torch.tensor([tok]), pos), ref)
        pos += 1
    assert all(c.length() == pos for c in caches)


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
    both = PagedCache(full)
    h = both.forward(full.embed(torch.cat([a, b])), [("a", 0, a.tolist()), ("b", 0, b.tolist())])
    batch_prefill = full.logits(h)
    step = both.forward(full.embed(torch.tensor([10, 20])), [("a", len(a), [10]), ("b", len(b), [20])])
    batch_step = full.logits(step)
    for i, (ids, tok, rows) in enumerate([(a, 10, slice(0, len(a))), (b, 20, slice(len(a), None))]):
        alone = [PagedCache(full)]
        assert_close(batch_prefill[rows], run_pipeline([full], alone, ids, 0))
        assert_close(batch_step[i], run_pipeline([full], alone, torch.tensor([tok]), len(ids))[0])


def test_chunked_prefill_equals_one_prefill(full, prompt_ids):
    whole = run_pipeline([full], caches_for([full]), prompt_ids, 0)
    caches = caches_for([full])
    cut = len(prompt_ids) // 3
    first = run_pipeline([full], caches, prompt_ids[:cut], 0)
    second = run_pipeline([full], caches, prompt_ids[cut:], cut)
    assert_close(torch.cat([first, second]), whole)
    assert caches[0].length() == len(prompt_ids)


def test_pipelined_chunks_through_three_stages_equal_one_prefill(split3, prompt_ids):
    """A prompt in 8-token chunks through 3 shards (as pipelined prefill sends it): every row's
    logits equal the whole prompt's in one step, and so does the greedy token."""
    whole = run_pipeline(split3, caches_for(split3), prompt_ids, 0)
    caches = caches_for(split3)
    parts = [run_pipeline(split3, caches, prompt_ids[a:a + 8], a) for a in range(0, len(prompt_ids), 8)]
    chunked = torch.cat(parts)
    assert len(parts) > 2
    assert_close(chunked, whole)
    assert chunked[-1].argmax() == whole[-1].argmax()
    assert all(c.length() == len(prompt_ids) for c in caches)


def test_truncate_rolls_back_and_a_fork_sees_the_parent(full, prompt_ids):
    caches = caches_for([full])
    run_pipeline([full], caches, prompt_ids, 0)
    n = len(prompt_ids)
    ref = run_pipeline([full], caches, torch.tensor([42]), n)
    run_pipeline([full], caches, torch.tensor([7, 8]), n + 1)  # candidates later rejected
    caches[0].kv.truncate("s", n)
    assert_close(run_pipeline([full], caches, torch.tensor([42]), n), ref)
    caches[0].kv.fork("s", "child", n + 1)
    assert_close(run_pipeline([full], caches, torch.tensor([7]), n + 1, seq="child"),
                 run_pipeline([full], caches, torch.tensor([7]), n + 1, seq="s"))


def test_a_decode_row_does_not_depend_on_its_batch(full, prompt_ids):
    """Bit for bit: a sequence's decode step gives the same logits alone and among 1 to 12 others."""
    def logits_of_a(others: int) -> torch.Tensor:
        cache = PagedCache(full, num_blocks=128)
        seqs = [("a", prompt_ids)] + [(f"o{i}", prompt_ids[i % 5:]) for i in range(others)]
        for sid, ids in seqs:
            cache.forward(full.embed(ids), [(sid, 0, ids.tolist())], {sid: len(ids)})
        toks = [42] + [7 + i for i in range(others)]
        h = cache.forward(full.embed(torch.tensor(toks)), [(sid, len(ids), [t]) for (sid, ids), t in zip(seqs, toks)])
        return full.logits(h)[0]

    alone = logits_of_a(0)
    for n in (1, 3, 4, 7, 12):
        assert torch.equal(logits_of_a(n), alone), f"decode row of 'a' changed among {n} others"


def test_prompt_rows_do_not_depend_on_decode_rows_beside_them(full, prompt_ids):
    """A prompt chunk computed in the same step as other sequences' decode rows gives the same
    hidden states as computed alone (prompt and decode rows each keep their own kernel)."""
    alone = PagedCache(full)
    ref = alone.forward(full.embed(prompt_ids), [("a", 0, prompt_ids.tolist())], {"a": len(prompt_ids)})
    mixed = PagedCache(full)
    mixed.forward(full.embed(prompt_ids[:6]), [("b", 0, prompt_ids[:6].tolist())], {"b": 6})
    h = mixed.forward(full.embed(torch.cat([torch.tensor([9]), prompt_ids])),
                      [("b", 6, [9]), ("a", 0, prompt_ids.tolist())], {"a": len(prompt_ids), "b": 6})
    assert torch.equal(h[1:], ref)


def test_scattered_blocks_equal_consecutive_ones(full, prompt_ids):
    """A sequence whose blocks are not consecutive (gathered by slot) computes what a sequence
    read as one strided view computes."""
    straight = caches_for([full])
    ref = run_pipeline([full], straight, prompt_ids, 0)
    scattered = PagedCache(full, num_blocks=64, block_size=4)
    scattered.kv.open("x", 4)  # x and s grow one block each in turn: their blocks interleave
    pos = 0
    outs = []
    for start in range(0, len(prompt_ids), 4):
        chunk = prompt_ids[start: start + 4]
        scattered.forward(full.embed(chunk), [("x", pos, chunk.tolist())])
        outs.append(full.logits(scattered.forward(full.embed(chunk), [("s", pos, chunk.tolist())])))
        pos += len(chunk)
    blocks = scattered.kv.tables["s"].blocks
    assert any(b - a != 1 for a, b in zip(blocks, blocks[1:])), blocks
    assert_close(torch.cat(outs), ref)


def test_load_reads_only_its_range(model_dir, monkeypatch):
    read = []
    real_open = weights_mod.safe_open

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

    monkeypatch.setattr(weights_mod, "safe_open", Recording)
    middle = Shard.load(model_dir, 10, 13, first=False, last=False)
    assert read and all(any(f"layers.{i}." in n for i in (10, 11, 12)) for n in read)
    assert {n.split(".")[2] for n in read} == {"10", "11", "12"}
    assert middle.embed_tokens is None and middle.lm_head is None
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
    cache = PagedCache(s)
    h = torch.zeros(3, s.config.hidden_size)
    cache.kv.open("a", 8)
    slots = torch.tensor(cache.kv.prepare_write("a", 0, 3).slots)
    blocks = cache.kv.read_span("a", 3)
    with pytest.raises(ValueError, match="rows"):
        s.forward(h, StepKV(cache.pool, slots[:2], (seq_slice(0, 2, blocks, 16),)))
    with pytest.raises(ValueError, match="layers"):
        s.forward(h, StepKV(KVPool(5, 3, 64, 4, 16), slots, (seq_slice(0, 3, blocks, 16),)))
    with pytest.raises(ValueError, match="at least one sequence"):
        s.forward(h, StepKV(cache.pool, slots, ()))
    with pytest.raises(RuntimeError):
        s.embed(torch.tensor([1]))
    with pytest.raises(RuntimeError):
        s.logits(h)
    with pytest.raises(ValueError, match="token ids"):
        split3[0].embed(torch.tensor([s.config.vocab_size]))


def test_kv_sizes(full):
    pool = full.new_pool(10, 16)
    assert pool.k.shape == (30, 3, 161, 64)  # + the scratch slot
    assert pool.block_bytes == 16 * kv_bytes_per_token(full.config, 30, torch.float32)


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
    assert shard.new_pool(2, 16).k.dtype == torch.bfloat16
    assert_close(run_pipeline([shard], caches_for([shard]), ids, 0), ref, rtol=2e-2)


def test_a_moved_range_keeps_the_layers_it_held(model_dir, split3, hf_run, prompt_ids):
    """A re-plan that moves a stage over layers it holds (3 stages -> 2 and back) reads only the
    layers it lacks: the ones it keeps are the same tensors, and the pipeline so built still
    matches HF."""
    from logicpipe.stage_node.config import Assignment, StageOptions
    from logicpipe.stage_node.weights.loading import shard_for

    def assignment(s: int, e: int, i: int, n: int) -> Assignment:
        return Assignment(str(model_dir), s, e, 30, i, n, "x" if i + 1 < n else "", "y" if i else "")

    opts = StageOptions()
    a0 = shard_for(assignment(0, 15, 0, 2), str(model_dir), "cpu", opts, old=split3[0])   # grows up
    a1 = shard_for(assignment(15, 30, 1, 2), str(model_dir), "cpu", opts, old=split3[2])  # grows down
    assert a0.layers[:10] == split3[0].layers and a0.embed_tokens is split3[0].embed_tokens
    assert all(x is y for x, y in zip(a0.layers[:10], split3[0].layers))
    assert all(x is y for x, y in zip(a1.layers[5:], split3[2].layers)) and a1.lm_head is split3[2].lm_head
    assert (a0.start, a0.end, len(a0.layers), a1.start, a1.end, len(a1.layers)) == (0, 15, 15, 15, 30, 15)
    check_against_hf([a0, a1], *hf_run, prompt_ids)
    back = shard_for(assignment(0, 10, 0, 3), str(model_dir), "cpu", opts, old=a0)  # shrinks: reads nothing
    assert all(x is y for x, y in zip(back.layers, a0.layers[:10])) and len(back.layers) == 10
    whole = shard_for(assignment(0, 30, 0, 1), str(model_dir), "cpu", opts, old=split3[1])  # both ends
    assert whole.first and whole.last and all(x is y for x, y in zip(whole.layers[10:20], split3[1].layers))
    assert sum(s.parameter_count for s in (a0, a1)) == sum(s.parameter_count for s in split3)
    check_against_hf([whole], *hf_run, prompt_ids)
