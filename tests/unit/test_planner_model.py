"""Planner domain types and the cost model: formulas, defaults, validation, purity."""
from __future__ import annotations

import ast
import dataclasses
import math
import sys
from pathlib import Path

import pytest

from logicpipe.planner import (
    DEFAULT_LINK,
    LOOPBACK,
    DeviceProfile,
    InfeasibleError,
    Link,
    ModelSpec,
    Objective,
    Reserve,
    Workload,
    build_stages,
    make_plan,
    plan_cost_s,
)
from logicpipe.planner.cost import (
    TOKEN_ID_BYTES,
    activation_transfer_s,
    head_time_s,
    layer_time_s,
    max_layers,
    return_transfer_s,
    stage_memory_bytes,
)
from logicpipe.planner.digest import profile_dict
from logicpipe.planner.units import format_bytes, format_ms

GiB = 2**30
SMOL = dict(name="SmolLM2-135M-Instruct", hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3,
            vocab_size=49152, num_layers=30, tied_embeddings=True)


def test_llama_helper_matches_smollm2_135m():
    m = ModelSpec.llama(**SMOL, weight_format="bf16")
    layer_params = 576 * 64 * (2 * 9 + 2 * 3) + 3 * 576 * 1536 + 2 * 576
    assert m.layer_weight_bytes == 2 * layer_params
    assert m.layer_flops_per_token == 2 * layer_params
    assert m.attention_flops_per_context_token == 4 * 9 * 64
    assert m.kv_bytes_per_token_per_layer == 2 * 3 * 64 * 2
    assert m.activation_bytes_per_token == 576 * 2
    assert m.embedding_bytes == 49152 * 576 * 2 and m.lm_head_bytes == (49152 * 576 + 576) * 2
    total_params = (30 * m.layer_weight_bytes + m.lm_head_bytes) / 2   # tied: the matrix once
    assert 134e6 < total_params < 135e6                                # "135M"


def test_llama_helper_formats():
    fp32 = ModelSpec.llama(**SMOL, weight_format="fp32")
    nf4 = ModelSpec.llama(**SMOL, weight_format="nf4")
    bf16 = ModelSpec.llama(**SMOL, weight_format="bf16")
    assert fp32.layer_weight_bytes == 2 * bf16.layer_weight_bytes == 8 * nf4.layer_weight_bytes
    assert fp32.kv_bytes_per_token_per_layer == 2 * nf4.kv_bytes_per_token_per_layer  # KV stays 16-bit for nf4
    with pytest.raises(ValueError, match="unknown weight format"):
        ModelSpec.llama(**SMOL, weight_format="q4_k")
    assert ModelSpec.llama(**SMOL, weight_format="q4_k", bytes_per_param=0.5625).weight_format == "q4_k"


def test_model_spec_validation():
    with pytest.raises(ValueError, match="num_layers"):
        ModelSpec.llama(**{**SMOL, "num_layers": 0})
    with pytest.raises(ValueError, match="lm_head_bytes"):
        ModelSpec(name="x", num_layers=1, layer_weight_bytes=1, layer_flops_per_token=1, attention_flops_per_context_token=0,
                  kv_bytes_per_token_per_layer=0, activation_bytes_per_token=1, embedding_bytes=10, lm_head_bytes=5,
                  lm_head_flops_per_token=1, tied_embeddings=True)


def test_links_default_and_loopback():
    p = DeviceProfile("a", "cpu", GiB, 1e12, 1e10, links={"b": Link(1e9, 1e-4)})
    assert p.link_to("b") == Link(1e9, 1e-4)
    assert p.link_to("c") == DEFAULT_LINK and DEFAULT_LINK == Link(125_000_000.0, 1e-3)
    assert p.link_to("a") is LOOPBACK
    q = DeviceProfile("a", "cpu", GiB, 1e12, 1e10, default_link=Link(1e6, 0.01))
    assert q.link_to("z") == Link(1e6, 0.01)
    assert hash(p) == hash(DeviceProfile("a", "cpu", GiB, 1e12, 1e10, links=[("b", Link(1e9, 1e-4))]))


@pytest.mark.parametrize("kwargs, match", [
    (dict(memory_bytes=-1), "memory_bytes"),
    (dict(memory_bytes=1.5), "memory_bytes"),
    (dict(flops=0.0), "flops"),
    (dict(mem_bandwidth=math.inf), "mem_bandwidth"),
    (dict(node_id=""), "node_id"),
    (dict(links={"a": Link(1.0, 0.0)}), "must not name the node itself"),
    (dict(links={"b": "fast"}), "must be a Link"),
    (dict(weight_formats=("fp16", "")), "weight_formats"),
])
def test_profile_validation(kwargs, match):
    base = dict(node_id="a", device_kind="cpu", memory_bytes=GiB, flops=1e12, mem_bandwidth=1e10)
    with pytest.raises(ValueError, match=match):
        DeviceProfile(**{**base, **kwargs})


def test_link_workload_reserve_validation():
    with pytest.raises(ValueError, match="bandwidth"):
        Link(0.0, 0.0)
    with pytest.raises(ValueError, match="latency"):
        Link(1.0, -1.0)
    with pytest.raises(ValueError, match="context_tokens"):
        Workload(context_tokens=0)
    with pytest.raises(ValueError, match="fraction"):
        Reserve(fraction=1.0)
    assert Reserve(0.25, 100).usable_bytes(1000) == 650
    assert Reserve(0.5, 1000).usable_bytes(1000) == 0


def test_duplicate_node_ids_and_empty_profiles_are_rejected():
    model = ModelSpec.llama(**SMOL)
    p = DeviceProfile("a", "cpu", GiB, 1e12, 1e10)
    with pytest.raises(ValueError, match="appears twice"):
        make_plan([p, p], model, Workload())
    with pytest.raises(ValueError, match="no device profiles"):
        make_plan([], model, Workload())
    with pytest.raises(ValueError, match="unknown objective"):
        make_plan([p], model, Workload(), objective="fast")


def test_cost_formulas():
    m = ModelSpec.llama(**SMOL, weight_format="fp16")
    w = Workload(tokens_per_step=4, context_tokens=1000, batch=2)
    slow_memory = DeviceProfile("a", "cpu", GiB, 1e15, 1e9)      # memory-bound
    slow_compute = DeviceProfile("b", "cpu", GiB, 1e9, 1e15)     # compute-bound
    read = m.layer_weight_bytes + 2 * 1000 * m.kv_bytes_per_token_per_layer
    flops = 4 * (m.layer_flops_per_token + 1000 * m.attention_flops_per_context_token)
    assert layer_time_s(slow_memory, m, w) == read / 1e9
    assert layer_time_s(slow_compute, m, w) == flops / 1e9
    assert head_time_s(slow_compute, m, w) == 4 * m.lm_head_flops_per_token / 1e9
    link = Link(1e6, 0.002)
    a = DeviceProfile("a", "cpu", GiB, 1e12, 1e10, links={"b": link})
    b = DeviceProfile("b", "cpu", GiB, 1e12, 1e10, links={"a": link})
    assert activation_transfer_s(a, b, m, w) == 4 * m.activation_bytes_per_token / 1e6 + 0.002
    assert return_transfer_s(a, b, w) == 4 * TOKEN_ID_BYTES / 1e6 + 0.002
    assert return_transfer_s(a, a, w) == 0.0
    stages = build_stages([a, b], [10, 20], m, w)
    assert [(s.start, s.end) for s in stages] == [(0, 10), (10, 30)]
    assert stages[0].transfer_s == activation_transfer_s(a, b, m, w)
    assert stages[1].transfer_s == return_transfer_s(b, a, w)
    times = [s.compute_s + s.transfer_s for s in stages]
    assert plan_cost_s(stages, Objective.THROUGHPUT) == max(times)
    assert plan_cost_s(stages, Objective.LATENCY) == sum(times)
    with pytest.raises(ValueError, match="add up to 30"):
        build_stages([a, b], [10, 10], m, w)


def test_memory_roles_and_tied_single_stage():
    m = ModelSpec.llama(**SMOL, weight_format="fp16")
    w = Workload(context_tokens=100)
    p = DeviceProfile("a", "cuda", GiB, 1e12, 1e10)
    per_layer = m.layer_weight_bytes + 100 * m.kv_bytes_per_token_per_layer
    assert stage_memory_bytes(p, m, w, 3, is_first=False, is_last=False) == 3 * per_layer
    assert stage_memory_bytes(p, m, w, 3, is_first=True, is_last=False) == 3 * per_layer + m.embedding_bytes
    assert stage_memory_bytes(p, m, w, 3, is_first=False, is_last=True) == 3 * per_layer + m.lm_head_bytes
    # one process holds the tied matrix once; two stages hold a copy each
    assert stage_memory_bytes(p, m, w, 3, is_first=True, is_last=True) == 3 * per_layer + m.lm_head_bytes
    untied = ModelSpec.llama(**{**SMOL, "tied_embeddings": False}, weight_format="fp16")
    assert stage_memory_bytes(p, untied, w, 3, is_first=True, is_last=True) == 3 * per_layer + m.embedding_bytes + m.lm_head_bytes
    exact_fit = DeviceProfile("b", "cuda", 5 * per_layer + m.embedding_bytes, 1e12, 1e10)
    assert max_layers(exact_fit, m, w, Reserve(0.0, 0), is_first=True, is_last=False) == 5
    assert max_layers(exact_fit, m, w, Reserve(0.0, 1), is_first=True, is_last=False) == 4


def test_single_device_plan_has_no_transfer():
    m = ModelSpec.llama(**SMOL)
    plan = make_plan([DeviceProfile("a", "cuda", 8 * GiB, 1e13, 5e11)], m, Workload())
    assert len(plan.stages) == 1 and plan.stages[0].transfer_s == 0.0
    assert plan.cost_s == plan.stages[0].compute_s


def test_units():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(12.3 * GiB) == "12.3 GiB"
    assert format_bytes(-3 * 2**20) == "-3.0 MiB"
    assert format_ms(0.01234) == "12.34"


def test_objective_parse():
    assert Objective.parse("Latency") is Objective.LATENCY
    assert Objective.parse(Objective.THROUGHPUT) is Objective.THROUGHPUT
    assert issubclass(InfeasibleError, ValueError)


def test_planner_is_pure():
    """Standard library only, nothing of ours, no I/O or clock modules, no open()/print()."""
    forbidden = {"os", "io", "time", "socket", "subprocess", "pathlib", "shutil", "datetime", "random", "threading",
                 "asyncio", "logicpipe", "controller", "stage_node", "torch", "grpc"}
    root = Path(__file__).resolve().parents[2] / "planner"
    files = sorted(root.glob("*.py"))
    assert len(files) >= 10
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                top = name.split(".")[0]
                ours = name == "logicpipe.planner" or name.startswith("logicpipe.planner.")
                assert ours or (top in sys.stdlib_module_names and top not in forbidden), (path.name, name)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in {"open", "print", "input", "exec", "eval"}, (path.name, node.func.id)
        assert len(path.read_text().splitlines()) < 420, path.name


# ----------------------------------------------------------------------------- formats per device

def node(node_id="n", formats=("fp32",), memory=8 * GiB, **kw) -> DeviceProfile:
    return DeviceProfile(node_id=node_id, device_kind="cpu", memory_bytes=memory, flops=1e11, mem_bandwidth=2e10,
                         weight_formats=formats, **kw)


def test_each_device_runs_its_own_format():
    from logicpipe.planner.model import (
        device_compute_format,
        device_weight_format,
        float_scale,
        weight_scale,
        wire_scale,
    )

    fp32, bf16 = ModelSpec.llama(**SMOL, weight_format="fp32"), ModelSpec.llama(**SMOL, weight_format="bf16")
    gpu = node("gpu", ("bf16", "fp16", "fp32"))
    cpu = node("cpu", ("fp32",))
    int8 = node("int8", ("int8",), compute_format="fp32", weight_bytes_per_param=1.001)
    nf4 = node("nf4", ("nf4",), compute_format="bf16")
    int4 = node("int4", ("int4",), compute_format="fp32")
    assert device_weight_format(int4, fp32) == "int4" and weight_scale(int4, fp32) == 0.5 / 4  # nominal bytes
    assert [device_weight_format(p, bf16) for p in (gpu, cpu, int8, nf4)] == ["bf16", "fp32", "int8", "nf4"]
    assert [device_weight_format(p, fp32) for p in (gpu, cpu, int8, nf4)] == ["fp32", "fp32", "int8", "nf4"]
    assert device_weight_format(node("b", ("bf16",)), fp32) is None  # fp32 -> bf16 would lose precision
    # weights: the node's measured bytes per parameter, else the nominal ones; floats: its compute format
    assert weight_scale(int8, fp32) == pytest.approx(1.001 / 4) and weight_scale(nf4, fp32) == 0.5 / 4
    assert weight_scale(cpu, bf16) == 2.0 and weight_scale(gpu, bf16) == 1.0
    assert device_compute_format(nf4, fp32) == "bf16" and float_scale(nf4, fp32) == 0.5
    assert float_scale(int8, fp32) == 1.0 and float_scale(cpu, bf16) == 2.0
    # hidden states cross in the narrower dtype of the two
    assert wire_scale(cpu, nf4, fp32) == wire_scale(nf4, cpu, fp32) == 0.5 and wire_scale(cpu, int8, fp32) == 1.0


def test_quantized_bytes_count_against_memory_and_weights_read_at_their_rate():
    fp32 = ModelSpec.llama(**SMOL, weight_format="fp32")
    w = Workload(batch=1, context_tokens=1, tokens_per_step=1)  # KV: 1.5 KB a layer beside 14 MB of weights
    memory = 40 * fp32.layer_weight_bytes
    flt, q = node("f", memory=memory), node("q", ("int8",), memory=memory, weight_bytes_per_param=1.0)
    r = Reserve(fraction=0.0)
    assert max_layers(flt, fp32, w, r, is_first=False, is_last=False) == 30  # all the model's layers
    assert stage_memory_bytes(q, fp32, w, 8, is_first=False, is_last=False) == \
        8 * (math.ceil(fp32.layer_weight_bytes / 4) + fp32.kv_bytes_per_token_per_layer)
    # decode reads a quarter of the bytes: 4x faster at the same rate, 2x at half the rate
    assert layer_time_s(flt, fp32, w) == pytest.approx(4 * layer_time_s(q, fp32, w), rel=1e-3)
    slow = node("s", ("int8",), weight_bandwidth=1e10, weight_bytes_per_param=1.0)
    assert layer_time_s(flt, fp32, w) == pytest.approx(2 * layer_time_s(slow, fp32, w), rel=1e-3)
    # a plan over a float node too small for the model and an int8 node: the int8 node takes most layers
    small = node("small", memory=12 * fp32.layer_weight_bytes + 2 * fp32.lm_head_bytes)
    big = node("big-int8", ("int8",), memory=8 * fp32.layer_weight_bytes + 2 * fp32.lm_head_bytes, weight_bytes_per_param=1.0)
    plan = make_plan([small, big], fp32, w, reserve=r)
    layers = {s.node_id: s.end - s.start for s in plan.stages}
    assert layers["big-int8"] > layers["small"] and sum(layers.values()) == 30
    assert {s.node_id: s.weight_format for s in plan.stages} == {"small": "fp32", "big-int8": "int8"}


GEMMA3_KINDS = tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(12))


def test_layers_keep_by_their_kind_full_context_window_or_state():
    """Issue 37: full layers keep C tokens of KV, sliding layers min(C, window), linear layers a fixed
    state; a range counts its own layers (prefix counts), the planner's memory and KV reads the average."""
    base = dict(name="g", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64,
                vocab_size=1000, num_layers=12, weight_format="bf16")
    full = ModelSpec.decoder(**base)
    win = ModelSpec.decoder(**base, layer_kinds=GEMMA3_KINDS, sliding_window=1024)
    kv = 2 * 2 * 64 * 2  # k and v, 2 heads of 64, bf16: bytes a token leaves in a layer
    assert full.kv_bytes_per_token_per_layer == win.kv_bytes_per_token_per_layer == kv
    assert full.kv_bytes_per_sequence(8192) == 12 * 8192 * kv
    assert win.kv_bytes_per_sequence(8192) == (2 * 8192 + 10 * 1024) * kv
    assert win.kv_bytes_per_sequence(512) == full.kv_bytes_per_sequence(512)  # within the window: alike
    assert win.kv_bytes_per_sequence(8192, 0, 5) == 5 * 1024 * kv  # sliding layers only
    assert win.kv_bytes_per_sequence(8192, 5, 6) == 8192 * kv      # the full one
    assert win.mean_kv_bytes_per_layer(8192) == win.kv_bytes_per_sequence(8192) / 12
    hybrid = ModelSpec.decoder(**base, layer_kinds=("linear", "linear", "linear", "full") * 3,
                               state_elements_per_layer=1000)
    assert hybrid.kv_bytes_per_sequence(100) == hybrid.kv_bytes_per_sequence(0) + 3 * 100 * kv == 9 * 4000 + 300 * kv
    p = DeviceProfile("n", "cpu", 64 * GiB, 1e12, 1e11, {}, weight_formats=("bf16",))
    wl = Workload(tokens_per_step=1, context_tokens=8192, batch=4)
    assert max_layers(p, win, wl, Reserve(), is_first=False, is_last=False) >= \
        max_layers(p, full, wl, Reserve(), is_first=False, is_last=False)
    assert layer_time_s(p, win, wl) < layer_time_s(p, full, wl)  # fewer KV bytes read a step
    sliding_stage = stage_memory_bytes(p, win, wl, 5, is_first=False, is_last=False, start=0)
    full_stage = stage_memory_bytes(p, win, wl, 5, is_first=False, is_last=False, start=5)
    assert full_stage - sliding_stage == 4 * (8192 - 1024) * kv  # one layer's context more, four windows less
    stages = build_stages([p, p], [6, 6], win, wl)
    assert [s.memory_bytes for s in stages] == [stage_memory_bytes(p, win, wl, 6, is_first=i == 0, is_last=i == 1,
                                                                   start=6 * i) for i in range(2)]
    with pytest.raises(ValueError, match="sliding_window"):
        ModelSpec.decoder(**base, layer_kinds=GEMMA3_KINDS)
    # a node whose windows keep every position (--window-kv off, --tp: its profile's full_sliding_kv) is
    # counted as holding them: the full model's bytes, never a window's
    whole = dataclasses.replace(p, full_sliding_kv=True)
    assert stage_memory_bytes(whole, win, wl, 5, is_first=False, is_last=False, start=0) == \
        stage_memory_bytes(p, full, wl, 5, is_first=False, is_last=False, start=0) > sliding_stage
    assert max_layers(whole, win, wl, Reserve(), is_first=False, is_last=False) == \
        max_layers(p, full, wl, Reserve(), is_first=False, is_last=False)
    assert profile_dict(whole)["full_sliding_kv"] is True
    assert "full_sliding_kv" not in profile_dict(p)  # (digests of profiles without it unchanged)
