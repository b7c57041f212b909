"""Every family's forward against transformers' own model of it (tiny random checkpoints, special
features on; tests/families.py): the same logits and greedy tokens in one shard and split in three,
for a prompt longer than the sliding window; and a row's result does not depend on what shares its
step (prompt rows and decode rows, experts included)."""
from __future__ import annotations

import pytest
import torch

from logicpipe.common.modeldir import ModelConfig
from logicpipe.stage_node.model.rope import PLAIN_ROPE_FAMILIES, plain_rope
from logicpipe.stage_node.model.shard import Shard
from tests.families import FAMILIES, WINDOW, build, hf_greedy, hf_model

from .paged import PagedCache

RTOL = 1e-4
STEPS = 8
torch.manual_seed(7)
PROMPT = torch.randint(0, 49152, (3 * WINDOW - 3,)).tolist()  # past the sliding window
OTHER = torch.randint(0, 49152, (WINDOW + 5,)).tolist()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    path = build(request.param, tmp_path_factory.mktemp(request.param) / "model")
    model = hf_model(path)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0, -1]
    return request.param, path, model, logits, hf_greedy(model, PROMPT, STEPS)


def shards_of(path, bounds) -> list[Shard]:
    return [Shard.load(path, s, e, first=i == 0, last=i == len(bounds) - 1) for i, (s, e) in enumerate(bounds)]


def greedy(shards: list[Shard], prompt: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """The prompt's last logits and `steps` greedy tokens through the shards, on a paged KV each."""
    caches = [PagedCache(s) for s in shards]
    ids, pos, out, first = prompt, 0, [], None
    for _ in range(steps):
        h = shards[0].embed(torch.tensor(ids))
        for c in caches:
            h = c.forward(h, [("s", pos, ids)], decode_from={"s": len(prompt)})
        logits = shards[-1].logits(h)[-1]
        first = logits if first is None else first
        pos += len(ids)
        ids = [int(logits.argmax())]
        out.append(ids[0])
    return first, out


@pytest.mark.parametrize("bounds", [[(0, 3)], [(0, 1), (1, 2), (2, 3)]], ids=["one-shard", "three-shards"])
def test_logits_and_greedy_tokens_equal_transformers(family, bounds):
    name, path, _, ref_logits, ref_tokens = family
    logits, tokens = greedy(shards_of(path, bounds), PROMPT, STEPS)
    err = ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item()
    assert err <= RTOL, f"{name}: relative logit error {err:.3g}"
    assert tokens == ref_tokens, name


def test_a_row_does_not_depend_on_its_step(family):
    """The prompt alone, then packed with another sequence; a decode row alone, then among others:
    bit-identical rows (what makes replays and concurrency exact)."""
    name, path, *_ = family
    shard = shards_of(path, [(0, 3)])[0]
    alone, both = PagedCache(shard), PagedCache(shard)
    a = alone.forward(shard.embed(torch.tensor(PROMPT)), [("a", 0, PROMPT)], {"a": len(PROMPT)})
    ab = both.forward(shard.embed(torch.tensor(PROMPT + OTHER)), [("a", 0, PROMPT), ("b", 0, OTHER)],
                      {"a": len(PROMPT), "b": len(OTHER)})
    assert torch.equal(a, ab[: len(PROMPT)]), name
    t = [int(shard.logits(a)[-1].argmax())]
    one = alone.forward(shard.embed(torch.tensor(t)), [("a", len(PROMPT), t)], {"a": len(PROMPT)})
    three = both.forward(shard.embed(torch.tensor(t + [5, 6])),
                         [("a", len(PROMPT), t), ("b", len(OTHER), [5]), ("c", 0, [6])],
                         {"a": len(PROMPT), "b": len(OTHER), "c": 0})
    assert torch.equal(one, three[:1]), name


def test_a_plain_rope_read_without_transformers_is_transformers_own(family):
    """`plain_rope` (config.json alone) for the families it takes: transformers' inv_freq exactly;
    None (transformers decides) for every other family."""
    name, path, model, *_ = family
    plain = plain_rope(path)
    assert (plain is not None) == (name in PLAIN_ROPE_FAMILIES), name
    if plain is not None:
        assert torch.equal(plain[0], model.model.rotary_emb.inv_freq) and plain[1] == 1.0, name


def test_the_description_says_what_the_forward_runs(family):
    name, path, model, *_ = family
    arch = ModelConfig.from_dir(path).arch
    assert arch.family == name
    assert arch.qk_norm == (name in ("qwen3", "qwen3_moe", "gemma3", "glm4_moe", "qwen3_5", "qwen3_next"))
    assert (arch.moe is not None) == (name in ("qwen3_moe", "mixtral", "gpt_oss", "qwen2_moe", "glm4_moe",
                                               "deepseek_v2", "deepseek_v3", "qwen3_next"))
    assert arch.hybrid == arch.attn_gate == (name in ("qwen3_5", "qwen3_next"))
    assert (arch.mla is not None) == name.startswith("deepseek")
    assert (arch.norm == "gemma") == (name.startswith("gemma") or arch.hybrid)
    sliding = [t == "sliding" for t in arch.layer_types]
    hf_types = getattr(model.config, "layer_types", None)
    if hf_types:
        assert sliding == [t == "sliding_attention" for t in hf_types]
    if name in ("mistral", "phi3"):
        assert all(sliding) and arch.sliding_window == WINDOW
    if name == "qwen3_moe":
        assert arch.moe.layers == (True, False, True) and arch.moe.top_k == 2 and arch.moe.norm_topk_prob
    if name == "gpt_oss":
        assert arch.sinks and arch.qkv_bias and arch.o_bias and arch.activation == "swiglu_oai"
        assert arch.moe.scoring == "topk_softmax" and arch.moe.top_k == 2 and sliding == [True, False, True]
        assert arch.swiglu_limit == 3.0 and ModelConfig.from_dir(path).rope_type == "yarn"
        from logicpipe.stage_node.model.rope import rope_parameters

        inv_freq, scaling = rope_parameters(path)  # YaRN with truncate off and its betas, as transformers has it
        assert torch.equal(inv_freq, model.model.rotary_emb.inv_freq) and scaling == model.model.rotary_emb.attention_scaling
        assert scaling != 1.0
    if name == "qwen2_moe":
        assert arch.moe.layers == (True, False, True) and arch.moe.shared_gate and arch.qkv_bias
    if name == "glm4_moe":
        m = arch.moe
        assert m.layers == (False, True, True) and (m.scoring, m.n_group, m.topk_group) == ("sigmoid", 4, 2)
        assert m.correction_bias and m.shared_intermediate_size == 32 and m.routed_scaling_factor == 2.5
        assert arch.rotary == 0.5 and arch.qkv_bias and not arch.o_bias
    if arch.hybrid:
        assert arch.layer_types == ("linear", "linear", "full") and arch.rotary == 0.25
        assert (arch.linear.key_heads, arch.linear.value_heads, arch.linear.conv_kernel) == (2, 4, 4)
    if name == "qwen3_next":
        m = arch.moe
        assert m.layers == (True, False, True) and m.shared_gate and m.shared_intermediate_size == 48 and m.norm_topk_prob
    if name == "smollm3":
        assert arch.rope_layers == (True, False, True) and [arch.ropes(i) for i in range(3)] == [True, False, True]
        assert arch.layer_types == ("full", "sliding", "full") and arch.sliding_window == WINDOW


def test_the_graph_step_body_equals_the_forward(family):
    """The CUDA-graph body (run eagerly here) of every family: sliding masks, soft-capping, q/k
    norms and gathered experts give the forward's rows and keys, past the window."""
    from logicpipe.stage_node.engine.kv import StepKV, seq_slice
    from logicpipe.stage_node.engine.step_graphs import GraphRow, StepGraphs

    name, path, *_ = family
    if name in ("qwen3_5", "qwen3_next"):
        pytest.skip("linear-attention layers run eagerly (no CUDA graphs yet)")
    shard = shards_of(path, [(0, 3)])[0]
    bs = 4
    pool_a, pool_b = shard.new_pool(40, bs), shard.new_pool(40, bs)
    pool_b.kv.zero_()
    seqs = [([0, 1, 2, 3, 4, 5], 2 * WINDOW + 1, 1), ([9, 14, 17, 6, 30, 31], WINDOW + 3, 3)]  # (blocks, start, rows)
    g = torch.Generator().manual_seed(0)
    for pool in (pool_a, pool_b):
        for blocks, start, _ in seqs:
            x = torch.randn(start, shard.config.hidden_size, generator=torch.Generator().manual_seed(start))
            slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(start)])
            shard.forward(x, StepKV(pool, slots, (seq_slice(0, start, blocks, bs),)))
    rows = [GraphRow(start + j, blocks[(start + j) // bs] * bs + (start + j) % bs, blocks)
            for blocks, start, n in seqs for j in range(n)]
    x = torch.randn(len(rows), shard.config.hidden_size, generator=g)
    kv = StepKV(pool_a, torch.tensor([r.write_slot for r in rows]),
                tuple(seq_slice(start, n, blocks, bs) for blocks, start, n in seqs))
    want = shard.forward(x, kv)
    got = StepGraphs(shard, pool_b, capture=False).forward(x, rows)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= 1e-5, f"{name}: relative error {err:.3g}"


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "gpt_oss", "qwen2_moe", "glm4_moe", "deepseek_v2",
                                  "deepseek_v3"])
def test_gathered_experts_equal_grouped_experts(name, tmp_path):
    """The CUDA graphs' way to the experts (each row's gathered, fixed shapes) computes what the
    grouped way does (here on the CPU)."""
    from logicpipe.stage_node.model.moe import experts_gathered, experts_grouped, route
    from logicpipe.stage_node.model.ops import Rows

    shard = shards_of(build(name, tmp_path / name), [(0, 3)])[0]
    w = shard.layers[2].experts
    h = torch.randn(11, shard.config.hidden_size, generator=torch.Generator().manual_seed(1))
    rows = Rows(None, None, all_decode=True)
    weights, idx = route(h, w, shard.arch.moe, rows)
    act = shard._glu  # the family's gating (gpt-oss: clamped, with its limit)
    grouped = experts_grouped(h, w, weights, idx, act, rows)
    gathered = experts_gathered(h, w, weights, idx, act)
    assert ((grouped - gathered).abs().max() / grouped.abs().max()).item() <= 1e-5


def test_the_planner_counts_every_parameter_and_a_mixture_reads_its_active_share(family):
    """The planner's model of each family holds exactly the checkpoint's parameters; a mixture's
    layer holds every expert while a token reads only its top-k (`lpctl plan` says both)."""
    from logicpipe.controller.mesh.planning import model_spec
    from logicpipe.planner import format_model_note

    name, path, model, *_ = family
    config = ModelConfig.from_dir(path)
    spec = model_spec(config, name, "d" * 16, "float32")
    held = spec.num_layers * spec.layer_weight_bytes + spec.embedding_bytes + (
        4 * config.hidden_size if config.tie_word_embeddings else spec.lm_head_bytes)
    # the routers' correction biases are buffers in HF, parameters of the checkpoint here
    params = model.num_parameters() + sum(b.numel() for n, b in model.named_buffers() if "correction_bias" in n)
    # the KV a token costs: what the planner counts is what a stage's pool allocates (MLA: one latent row)
    from logicpipe.stage_node.engine.kv import kv_bytes_per_token

    # (MLA: one latent row; a hybrid: its full-attention layers only, its linear layers a state each by their kind)
    kv_layers = sum(1 for i in range(3) if not config.arch.is_linear(i))
    pool = shards_of(path, [(0, 3)])[0].new_pool(2, 16)
    assert pool.block_bytes == 16 * kv_bytes_per_token(config, kv_layers, torch.float32)
    assert abs(pool.block_bytes - 16 * kv_layers * spec.kv_bytes_per_token_per_layer) <= 16 * 3, name
    if config.arch.linear is not None:  # (the state a sequence keeps whatever its length: float32)
        assert spec.kv_bytes_per_sequence(0) == (3 - kv_layers) * 4 * config.arch.linear.state_elements()
    if config.arch.mla is not None:
        assert spec.kv_bytes_per_token_per_layer == 4 * (config.arch.mla.kv_lora_rank + config.arch.mla.rope_dim)
    assert abs(held - 4 * params) <= 4 * spec.num_layers, name
    note = format_model_note(spec)
    if config.arch.moe is None:
        assert spec.layer_read_bytes(1) == spec.layer_read_bytes(64) == spec.layer_weight_bytes and not note
        return
    moe = config.arch.moe
    assert spec.layer_read_bytes(1) < spec.layer_read_bytes(8) < spec.layer_weight_bytes
    biases = 2 * moe.intermediate_size + config.hidden_size if name == "gpt_oss" else 0  # gpt-oss's expert biases
    one_expert = (3 * config.hidden_size * moe.intermediate_size + biases) * 4 * sum(moe.layers) / config.num_layers
    dense_part = spec.layer_weight_bytes - moe.num_experts * spec.expert_bytes
    assert abs(spec.layer_read_bytes(1) - (dense_part + moe.top_k * one_expert)) <= moe.num_experts
    assert "experts per layer" in note and f"{moe.top_k} per token" in note


@pytest.mark.parametrize("fmt, floor, share", [("int4", 0.9, 0.25), ("int8", 0.99, 0.35), ("nf4", 0.5, 0.2)])
def test_quantized_experts(fmt, floor, share, tmp_path):
    """--quantize holds each expert's matrices quantized (the router stays float): their bytes shrink
    to the format's and the logits stay close to the float model's."""
    from logicpipe.stage_node.kernels.quant import QuantMatrix, tensor_bytes

    path = build("qwen3_moe", tmp_path / "moe")
    full = shards_of(path, [(0, 3)])[0]
    quant = Shard.load(path, 0, 3, first=True, last=True, quantize=fmt)
    experts = quant.layers[0].experts
    assert all(isinstance(m, QuantMatrix) for m in [*experts.gate_up, *experts.down])
    assert not isinstance(experts.router, QuantMatrix)
    assert tensor_bytes(experts) < share * tensor_bytes(full.layers[0].experts)

    def last_logits(shard):
        return shard.logits(PagedCache(shard).forward(shard.embed(torch.tensor(PROMPT)), [("s", 0, PROMPT)]))[-1]

    cos = torch.nn.functional.cosine_similarity(last_logits(full), last_logits(quant), dim=0).item()
    assert cos >= floor, f"{fmt}: cosine {cos:.3f}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gemma", [False, True])
def test_one_head_norm_call_equals_a_norm_per_head_kind(dtype, gemma):
    """The layer's q and k norms in one call (ops.head_norm) give the bits of one norm each."""
    from logicpipe.stage_node.model.ops import head_norm, rms_norm

    torch.manual_seed(3)
    heads, kv_heads, hd = 8, 2, 32
    x = (torch.randn(7, heads + kv_heads, hd) * 3).to(dtype)
    q_norm, k_norm = torch.randn(hd).to(dtype), torch.randn(hd).to(dtype)
    both = torch.cat([q_norm.expand(heads, -1), k_norm.expand(kv_heads, -1)])
    apart = torch.cat([rms_norm(x[:, :heads], q_norm, 1e-6, gemma), rms_norm(x[:, heads:], k_norm, 1e-6, gemma)], 1)
    assert torch.equal(head_norm(x, both, 1e-6, gemma), apart)


def test_gpt_oss_mxfp4_experts_are_dequantized_at_load(tmp_path):
    """A gpt-oss checkpoint whose experts are MXFP4 blocks and scales (as released): the stage holds
    exactly the values they encode (gate and up de-interleaved), transformers reads the same values
    from it, and the greedy tokens equal transformers' on that dequantized model."""
    from transformers import Mxfp4Config, AutoModelForCausalLM

    from tests.families import write_mxfp4

    path = tmp_path / "mxfp4"
    held = write_mxfp4(build("gpt_oss", tmp_path / "float"), path)
    assert ModelConfig.from_dir(path).arch.mxfp4_experts
    shard = shards_of(path, [(0, 3)])[0]
    for i, w in enumerate(shard.layers):
        gate_up = held[f"model.layers.{i}.mlp.experts.gate_up_proj"].transpose(1, 2)  # [experts, out, in], interleaved
        assert torch.equal(w.experts.gate_up, torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], 1))
        assert torch.equal(w.experts.down, held[f"model.layers.{i}.mlp.experts.down_proj"].transpose(1, 2))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 quantization_config=Mxfp4Config(dequantize=True)).eval()
    assert torch.equal(model.model.layers[1].mlp.experts.gate_up_proj, held["model.layers.1.mlp.experts.gate_up_proj"])
    logits, tokens = greedy(shards_of(path, [(0, 2), (2, 3)]), PROMPT, STEPS)
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0, -1]
    assert ((logits - ref).abs().max() / ref.abs().max()).item() <= RTOL
    assert tokens == hf_greedy(model, PROMPT, STEPS)


def test_gpt_oss_refuses_a_quantization_it_cannot_read(tmp_path):
    """A gpt-oss config.json quantized other than MXFP4 is refused, naming what is supported."""
    import json

    from logicpipe.common.modeldir import ModelError

    path = build("gpt_oss", tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="supported: mxfp4"):
        ModelConfig.from_dir(path)
@pytest.mark.parametrize("name", ["qwen2_moe", "glm4_moe"])
def test_bfloat16_mixtures_equal_transformers(name, tmp_path):
    """In bfloat16 the casts count: the float32 router and correction bias (GLM), the routing weights'
    dtype, the shared expert added to the routed output. The same logits as transformers with its
    experts run as its modeling file writes them (experts_implementation="eager"; its default,
    grouped_mm, sums a row's weighted experts in float32 before casting)."""
    from transformers import AutoModelForCausalLM

    path = build(name, tmp_path / name)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, experts_implementation="eager").eval()
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0, -1].float()
    shard = Shard.load(path, 0, 3, first=True, last=True, dtype=torch.bfloat16)
    got = shard.logits(PagedCache(shard).forward(shard.embed(torch.tensor(PROMPT)), [("s", 0, PROMPT)]))[-1]
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= 1e-3 and int(got.argmax()) == int(want.argmax()), f"{name}: relative error {err:.3g}"
