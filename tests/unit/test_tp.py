"""Tensor-parallel stages (stage_node.model.tp), the forward: two processes over gloo on loopback, each
holding its part of every layer (heads, MLP columns, whole experts, vocabulary rows of the head),
give transformers' greedy tokens — a dense family, mixtures with and without a shared expert, and
gpt-oss (sinks, biases, windows) — alone, as the second stage of a 2-stage split, and with the
splits' sizes refused by name where they do not divide."""
from __future__ import annotations

import dataclasses
import json
import multiprocessing
import socket

import pytest
import torch

from logicpipe.common.modeldir import ModelConfig, ModelError
from logicpipe.controller.mesh.planning import device_profile, model_spec
from logicpipe.errors import InvalidArgument
from logicpipe.planner import ModelSpec, Workload, make_plan, plan_from_json, plan_to_json
from logicpipe.planner.cost import layer_time_s
from logicpipe.stage_node.net import wire
from logicpipe.v1 import stage_pb2
from logicpipe.stage_node.model import tp as tp_split
from logicpipe.stage_node.model.shard import Shard
from logicpipe.stage_node.model.tp import TensorParallel
from logicpipe.stage_node.profile import HostProfile, offering, tensor_parallel
from logicpipe.stage_node.engine.kv import StepKV, seq_slice
from logicpipe.stage_node.engine.step_graphs import MIN_CONTEXT, GraphRow, StepGraphs
from logicpipe.stage_node.engine import tp_group
from logicpipe.stage_node.engine.tp_group import Leader

from .. import families
from .paged import PagedCache

TP_FAMILIES = ["llama", "qwen3_moe", "qwen2_moe", "gpt_oss"]
PROMPT = [5, 17, 2000, 9, 31, 77, 4, 1200, 8, 600, 45, 3]
NEW = 8


def greedy(stages: list[Shard], prompt: list[int], n: int) -> list[int]:
    """n greedy tokens through `stages` in order (each with its own paged cache)."""
    caches = [PagedCache(s, num_blocks=16, block_size=4) for s in stages]
    ids, out = list(prompt), []
    rows = ids
    for _ in range(n):
        start = len(ids) - len(rows)
        h = stages[0].embed(torch.tensor(rows))
        for c in caches:
            h = c.forward(h, [("s", start, rows)], {"s": len(prompt)})
        tok = int(stages[-1].greedy(h[-1:])[0])  # (a rank of TP: each rank's largest logit gathered, Shard.greedy)
        out.append(tok)
        ids.append(tok)
        rows = [tok]
    return out


def _rank(rank: int, world: int, port: int, paths: dict, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        tp = TensorParallel(rank, world)
        got = {}
        for family, path in paths.items():
            n = families.LAYERS
            got[family] = greedy([Shard.load(path, 0, n, first=True, last=True, tp=tp)], PROMPT, NEW)
            # a 2-stage split whose second stage is tensor-parallel (the first whole, in this process)
            got[family, "split"] = greedy([Shard.load(path, 0, 1, first=True, last=False),
                                           Shard.load(path, 1, n, first=False, last=True, tp=tp)], PROMPT, NEW)
        results.put((rank, got))
    except BaseException as exc:  # noqa: BLE001 — reported to the test, which fails with it
        results.put((rank, repr(exc)))
        raise
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {f: families.build(f, tmp_path_factory.mktemp(f)) for f in TP_FAMILIES}


def test_two_gloo_ranks_give_transformers_greedy_tokens(checkpoints):
    expected = {f: families.hf_greedy(families.hf_model(p), PROMPT, NEW) for f, p in checkpoints.items()}
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, {f: str(p) for f, p in checkpoints.items()}, results))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=600) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    for rank, res in got.items():
        assert isinstance(res, dict), f"rank {rank} failed: {res}"
    for f in TP_FAMILIES:
        assert got[0][f] == expected[f], f
        assert got[0][f, "split"] == expected[f], f
        assert got[1][f] == got[0][f] and got[1][f, "split"] == got[0][f, "split"]  # every rank samples the same


def test_a_split_that_does_not_divide_is_refused_by_name(checkpoints):
    config = ModelConfig.from_dir(checkpoints["llama"])  # 4 heads, 2 KV heads, 96 intermediate
    with pytest.raises(ModelError, match="2 key/value heads do not divide by 3"):
        tp_split.local_config(config, 3)
    moe = ModelConfig.from_dir(checkpoints["qwen3_moe"])  # 6 experts
    with pytest.raises(ModelError, match="6 experts do not divide by 4"):
        tp_split.local_config(moe, 4)


def test_a_rank_holds_its_share_of_every_matrix(checkpoints):
    """Rank 1 of 2 of the mixture: half the heads' q/k/v rows, half the output projection's columns, 3 of
    6 whole experts starting at expert 3, the router whole, half the vocabulary's head rows."""
    path = checkpoints["qwen3_moe"]
    whole = Shard.load(path, 0, families.LAYERS, first=True, last=True)
    part = Shard.load(path, 0, families.LAYERS, first=True, last=True, tp=TensorParallel(1, 2))
    c = whole.config
    w, p = whole.layers[0], part.layers[0]
    assert p.qkv.shape[0] == w.qkv.shape[0] // 2 and p.o.shape[1] == w.o.shape[1] // 2
    assert torch.equal(p.o, w.o[:, c.num_heads * c.head_dim // 2:])
    assert p.experts.first == 3 and len(p.experts.gate_up) == 3 and torch.equal(p.experts.gate_up[0], w.experts.gate_up[3])
    assert torch.equal(p.experts.router, w.experts.router)
    assert part.lm_head.shape[0] == c.vocab_size // 2 and torch.equal(part.lm_head, whole.lm_head[c.vocab_size // 2:])
    assert part.config.num_heads == c.num_heads // 2 and part.new_pool(4, 4).k.shape[1] == c.num_kv_heads // 2


def test_a_cuda_stage_of_n_ranks_is_profiled_as_n_devices():
    """The planner sees a `--tp 2` CUDA node as two GPUs (memory, FLOP/s, bandwidths doubled); a CPU
    node's ranks share one host's memory and cores, so its profile stays as measured."""
    gpu = HostProfile("cuda", "H100", 80 * 2**30, 5e14, 3e12, ("bf16",), weight_bandwidth=2e12,
                      format_flops=(("bf16", 5e14),))
    two = tensor_parallel(gpu, 2)
    assert (two.memory_bytes, two.flops, two.mem_bandwidth, two.weight_bandwidth, two.format_flops) == \
        (160 * 2**30, 1e15, 6e12, 4e12, (("bf16", 1e15),))
    assert two.devices == 2
    cpu = HostProfile("cpu", "EPYC", 20 * 2**30, 1e11, 2e10, ("fp32",))
    assert tensor_parallel(cpu, 2) == dataclasses.replace(cpu, devices=2) and tensor_parallel(gpu, 1) == gpu


def test_a_tp_stage_lists_its_devices_in_the_plan():
    """Issue 36: `lpctl plan --json` lists a stage's devices: the node, or node:gpu for each GPU
    of a `--tp N` node (its profile says how many, through Status)."""
    gpu = HostProfile("cuda", "H100", 80 * 2**30, 5e14, 3e12, ("bf16",), weight_bandwidth=2e12)
    reply = stage_pb2.StatusReply(node_id="box", device="cuda:0")
    reply.profile.CopyFrom(wire.profile_to_proto(tensor_parallel(gpu, 2)))
    one = stage_pb2.StatusReply(node_id="pc", device="cuda:0")
    one.profile.CopyFrom(wire.profile_to_proto(gpu))
    spec = ModelSpec.llama(name="m", hidden_size=512, intermediate_size=1408, num_heads=8, num_kv_heads=4,
                           vocab_size=8000, num_layers=8, weight_format="bf16")
    profiles = [device_profile(r, {}) for r in (reply, one)]
    plan = make_plan(profiles, spec, Workload(), strategy="uniform")
    doc = json.loads(plan_to_json(plan))
    assert [s["devices"] for s in doc["stages"]] == [["box:0", "box:1"], ["pc"]]
    assert [s.devices for s in plan_from_json(plan_to_json(plan)).stages] == [2, 1]


def _tokens(leader: Leader, path: str, n: int) -> list[int]:
    """n greedy tokens of PROMPT through a whole-model stage of `leader`'s ranks (the mirrored eager forward)."""
    shard = leader.load(path, 0, families.LAYERS, first=True, last=True, dtype=torch.float32, quantize="none",
                        invariant=False)
    bs, blocks = 4, list(range(8))
    pool = leader.new_pool(shard, len(blocks) + 1, bs)
    ids, out = list(PROMPT), []
    rows = ids
    for _ in range(n):
        start = len(ids) - len(rows)
        h = shard.forward(shard.embed(torch.tensor(rows)), StepKV(pool, torch.arange(start, len(ids)),
                                                                   (seq_slice(start, len(rows), blocks, bs),)))
        tok = int(shard.greedy(h[-1:])[0])
        out.append(tok)
        ids.append(tok)
        rows = [tok]
    return out


def _graph_leader(path: str, results) -> None:
    """Rank 0 of a 2-rank CPU stage (its follower started by Leader, as a stage starts it): the prompt
    by the mirrored eager forward, then every decode row by the step graphs' body, mirrored step by
    step (tp_group's CAPTURE and GRAPH: on a GPU each rank replays its captured graph)."""
    torch.set_num_threads(1)
    leader = Leader(2, "cpu", 1)
    try:
        leader.start()
        shard = leader.load(path, 0, families.LAYERS, first=True, last=True, dtype=torch.float32, quantize="none",
                            invariant=False)
        bs, blocks = 4, list(range(8))
        pool = leader.new_pool(shard, len(blocks) + 1, bs, graphs=True)
        pool.kv.zero_()
        graphs = StepGraphs(shard, pool, capture=False, warm=False)
        ids, out = list(PROMPT), []
        n = len(ids)
        h = shard.forward(shard.embed(torch.tensor(ids)),
                          StepKV(pool, torch.arange(n), (seq_slice(0, n, blocks, bs),)))
        for i in range(NEW):  # the logits gathered (mirrored LOGITS), or each rank's largest (GREEDY), in turn
            tok = int(shard.greedy(h[-1:])[0]) if i % 2 else int(shard.logits(h[-1:]).argmax())
            out.append(tok)
            ids.append(tok)
            pos = len(ids) - 1
            h = graphs.forward(shard.embed(torch.tensor([tok])), [GraphRow(pos, pos, blocks)])
        alive = [p.poll() for p in leader.procs]
        # a --tp-max node's re-plans (tp_group.reform): the width in force kept, width 1 stops the group (its
        # follower exits, status 0), width 2 forms it again (a new process group in this process)
        followers = leader.procs
        assert tp_group.reform(leader, 2, "cpu", 1) is leader
        leader = tp_group.reform(leader, 1, "cpu", 1)
        gone = [p.poll() for p in followers]
        leader = tp_group.reform(leader, 2, "cpu", 1)
        results.put((out, graphs.replays, sorted(graphs.graphs), alive, gone, _tokens(leader, path, 3)))
        leader.stop()
    except BaseException as exc:  # noqa: BLE001 — reported to the test, which fails with it
        results.put(repr(exc))
        raise
    finally:
        if leader is not None:
            leader.close()


def test_a_tp_stage_s_step_graphs_are_replayed_by_every_rank_together(checkpoints):
    """On a GPU a `--tp 2` stage replays its decode steps as CUDA graphs with the all-reduces inside
    (issue 36: eager it was 0.15 of one GPU). Every rank makes each bucket's graph when rank 0 does and
    replays it over the same inputs, sent into its static buffers: here the graphs' body on two CPU
    processes over gloo gives transformers' greedy tokens, one replay per decode row, the follower alive.
    Then the group as a --tp-max node's width changes re-form it: stopped at width 1, formed again at 2
    (transformers' tokens again)."""
    path = checkpoints["llama"]
    expected = families.hf_greedy(families.hf_model(path), PROMPT, NEW)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_graph_leader, args=(str(path), results))
    proc.start()
    try:
        got = results.get(timeout=300)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert not isinstance(got, str), got
    tokens, replays, buckets, followers, gone, again = got
    assert tokens == expected
    assert replays == NEW and buckets == [(1, MIN_CONTEXT)] and followers == [None]
    assert gone == [0] and again == expected[:3]


def test_a_tp_stage_refuses_a_model_that_does_not_split_before_its_followers_hear_of_it(checkpoints, model_dir):
    """The default model (9 heads over 3 KV heads) on a --tp 2 stage: rank 0 refuses the load by name
    and sends nothing (a follower that failed it would take the whole stage down)."""
    leader = Leader(2, "cpu", 1)  # not started: sending anything would fail on its missing channel
    with pytest.raises(ModelError, match="3 key/value heads do not divide by 2"):
        leader.load(str(model_dir), 0, 30, first=True, last=True, dtype=torch.float32, quantize="none", invariant=False)


def test_the_planner_adds_a_tp_stage_s_measured_all_reduces_to_every_layer():
    """Issue 36: a tensor-parallel node's two all-reduces a layer, at its measured latency and
    bandwidth, are part of its step in the cost model (they were not counted)."""
    spec = ModelSpec.llama(name="m", hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=8,
                           vocab_size=128256, num_layers=32, weight_format="bf16")
    gpu = HostProfile("cuda", "H100", 80 * 2**30, 5e14, 3e12, ("bf16",), weight_bandwidth=2e12)
    free, slow = (device_profile(_status(tensor_parallel(gpu, 2, ar)), {}) for ar in ((0.0, 0.0), (20e-6, 1e11)))
    w = Workload(tokens_per_step=8)
    extra = layer_time_s(slow, spec, w) - layer_time_s(free, spec, w)
    assert extra == pytest.approx(2 * (20e-6 + 8 * 4096 * 2 / 1e11), rel=0.02)
    assert (slow.devices, free.allreduce_bandwidth) == (2, 0.0)


def _status(profile) -> stage_pb2.StatusReply:
    reply = stage_pb2.StatusReply(node_id="box", device="cuda:0")
    reply.profile.CopyFrom(wire.profile_to_proto(profile))
    return reply


def test_an_assignment_s_width_is_honoured_or_refused_by_name():
    fixed = Leader(2, "cpu", 1)  # (not started: width_for only reads its width)
    assert tp_group.width_for(0, fixed, 0, "n") == 2 and tp_group.width_for(2, fixed, 0, "n") == 2
    assert tp_group.width_for(0, None, 0, "n") == 1 and tp_group.width_for(1, None, 0, "n") == 1
    with pytest.raises(InvalidArgument, match="tp_width 1: node n has a fixed tensor-parallel width of 2"):
        tp_group.width_for(1, fixed, 0, "n")
    with pytest.raises(InvalidArgument, match="tp_width 2: node n has a fixed tensor-parallel width of 1"):
        tp_group.width_for(2, None, 0, "n")
    assert [tp_group.width_for(w, None, 4, "n") for w in (0, 1, 3, 4)] == [1, 1, 3, 4]
    with pytest.raises(InvalidArgument, match=r"tp_width 5: node n offers 1 to 4 devices \(--tp-max 4\)"):
        tp_group.width_for(5, None, 4, "n")


def test_a_tp_max_node_offers_one_device_s_figures_and_the_planner_sees_the_widths(checkpoints):
    """The profile of a --tp-max 4 GPU node: one GPU's figures, max_devices 4 and the all-reduce, through
    Status to the controller's planner profile; the controller's model spec carries the sizes a width must
    divide (the stage's own check), so the planner offers only the widths the stage would take."""
    gpu = HostProfile("cuda", "H100", 80 * 2**30, 5e14, 3e12, ("bf16",), weight_bandwidth=2e12)
    prof = device_profile(_status(offering(gpu, 4, (20e-6, 1e11))), {})
    assert (prof.devices, prof.max_devices, prof.memory_bytes, prof.allreduce_latency_s) == (1, 4, 80 * 2**30, 20e-6)
    assert offering(gpu, 1) == gpu
    for family, widths in (("llama", (1, 2)), ("qwen3_moe", (1, 2))):  # 4 heads over 2 KV heads; 6 experts
        spec = model_spec(ModelConfig.from_dir(checkpoints[family]), family, "")
        assert spec.tp_widths(4) == widths, family
        for w in range(1, 5):
            config = ModelConfig.from_dir(checkpoints[family])
            if w in widths:
                tp_split.check_split(config, w)
            else:
                with pytest.raises(ModelError):
                    tp_split.check_split(config, w)
