"""Sliding-window layers that hold only their window (engine.window): a Mistral-style model (every
layer slides) and a Gemma-3-style one (sliding and full layers: two pools) give transformers' greedy
tokens well past the window, with blocks given back as they go, through forks, rejected candidates,
the prefix cache and the CUDA-graph step body; admission counts a window's blocks as bounded; a stage
whose windows keep every position says so to the planner."""
from __future__ import annotations

import pytest
import torch

from logicpipe.controller.mesh.planning import device_profile
from logicpipe.errors import ResourceExhausted
from logicpipe.sampling import SamplingParams
from logicpipe.stage_node.engine.blocks import HOLE, BadWrite, KVManager
from logicpipe.stage_node.engine.scheduler import Scheduler
from logicpipe.stage_node.engine.sequence import SeqSpec
from logicpipe.stage_node.engine.window import KVGroups, WindowBlocks, held_blocks, managers, split_budget
from logicpipe.stage_node.model.shard import Shard
from logicpipe.stage_node.net import wire
from logicpipe.stage_node.profile import HostProfile
from logicpipe.v1 import stage_pb2
from tests.families import WINDOW, build, hf_greedy, hf_model

from .paged import PagedCache

BS, ROLL = 4, 4  # blocks of 4 positions, steps roll back at most 4: a window of 8 keeps 3 or 4 blocks
STEPS = 28
torch.manual_seed(11)
PROMPT = torch.randint(0, 49152, (3 * WINDOW + 2,)).tolist()


@pytest.fixture(scope="module", params=["mistral", "gemma3"])
def model(request, tmp_path_factory):
    path = build(request.param, tmp_path_factory.mktemp(request.param) / "model")
    return request.param, path, hf_greedy(hf_model(path), PROMPT, STEPS)


def caches(path, bounds=((0, 3),), graphs: bool = False) -> tuple[list[Shard], list[PagedCache]]:
    shards = [Shard.load(path, s, e, first=i == 0, last=i == len(bounds) - 1) for i, (s, e) in enumerate(bounds)]
    return shards, [PagedCache(s, 32, BS, window=True, rollback=ROLL, group_blocks=24, graphs=graphs) for s in shards]


def step(shards, cs, sid: str, pos: int, ids: list[int], prompt: int) -> torch.Tensor:
    """One step of `sid`'s rows through every stage -> the last stage's logits of its rows."""
    h = shards[0].embed(torch.tensor(ids))
    for c in cs:
        h = c.forward(h, [(sid, pos, ids)], decode_from={sid: prompt})
    return shards[-1].logits(h)


def decode(shards, cs, sid: str, pos: int, ids: list[int], steps: int, prompt: int, wrong: int = 0) -> list[int]:
    """`steps` greedy tokens of `sid` from `ids` at `pos`; with `wrong`, each step also carries that many
    candidates that are all rejected (their positions rolled back on every stage)."""
    out = []
    for _ in range(steps):
        rows = ids + [(ids[-1] * 7 + j + 1) % 49152 for j in range(wrong)] if len(ids) == 1 else ids
        logits = step(shards, cs, sid, pos, rows, prompt)
        pos += len(ids)
        if len(rows) > len(ids):
            for c in cs:
                c.kv.truncate(sid, pos)
        ids = [int(logits[len(ids) - 1].argmax())]
        out.append(ids[0])
    return out


def window_manager(c: PagedCache) -> WindowBlocks:
    return c.kv.group if isinstance(c.kv, KVGroups) else c.kv


@pytest.mark.parametrize("bounds", [((0, 3),), ((0, 1), (1, 2), (2, 3))], ids=["one-stage", "three-stages"])
def test_greedy_tokens_equal_transformers_past_the_window(model, bounds):
    name, path, ref = model
    shards, cs = caches(path, bounds)
    assert decode(shards, cs, "s", 0, PROMPT, STEPS, len(PROMPT)) == ref, name
    windowed = [c for c in cs if c.shard.window is not None]
    assert windowed and all(c.shard.window == WINDOW for c in windowed)
    for c in windowed:  # the window's blocks went back: the pool holds a bound, not the context
        w = window_manager(c)
        t = w.tables["s"]
        assert t.length == len(PROMPT) + STEPS - 1 and HOLE in t.blocks
        assert sum(b != HOLE for b in t.blocks) <= w.bound == held_blocks(WINDOW, BS, ROLL)
        assert w.used <= w.bound
        if isinstance(c.kv, KVGroups):  # the full layers keep everything
            assert c.kv.main.used == c.kv.blocks_for(t.length)


def test_step_graphs_read_the_window_held(model):
    """The CUDA-graph step body (engine.step_graphs, eagerly on the CPU) over windows held: every step
    (the prompt's 26 rows too) in a graph bucket, block tables starting with holes (Mistral) or the window
    layers' own tables and write slots (Gemma 3), rejected candidates among them: transformers' tokens."""
    name, path, ref = model
    shards, cs = caches(path, graphs=True)
    assert decode(shards, cs, "s", 0, PROMPT, STEPS, len(PROMPT), wrong=ROLL - 1) == ref, name
    assert cs[0].graphs.replays == STEPS  # every step ran the graph body
    w = window_manager(cs[0])
    assert HOLE in w.tables["s"].blocks and w.used <= w.bound


def test_rejected_candidates_roll_back_within_the_window(model):
    name, path, ref = model
    shards, cs = caches(path)
    assert decode(shards, cs, "s", 0, PROMPT, STEPS, len(PROMPT), wrong=ROLL - 1) == ref, name


def test_three_forks_continue_as_transformers(model):
    """n = 3: the prompt once, three children sharing its blocks (copy on write) decode on."""
    name, path, ref = model
    shards, cs = caches(path)
    first = decode(shards, cs, "p", 0, PROMPT, 1, len(PROMPT))
    n = len(PROMPT)
    for k in range(3):
        for c in cs:
            c.kv.fork("p", f"c{k}", n)
            assert c.kv.held(f"c{k}") == n
    outs = [first + decode(shards, cs, f"c{k}", n, first, STEPS - 1, n) for k in range(3)]
    assert outs == [ref] * 3, name
    # a fork far below where the parent gave its window back holds nothing: it is computed again
    w = window_manager(cs[0])
    cs[0].kv.fork("c0", "late", 4 * BS)
    assert w.tables["c0"].blocks[0] == HOLE and cs[0].kv.held("late") == 0
    with pytest.raises(BadWrite):
        cs[0].kv.prepare_write("late", 4 * BS, 1)


def test_a_cached_prompt_is_reused_twice(model):
    """A prompt past several blocks: a second and a third sequence attach what both groups still
    hold in their caches (the window group's blocks given back stay cached) and continue exactly."""
    name, path, ref = model
    shards, cs = caches(path)
    assert decode(shards, cs, "a", 0, PROMPT, STEPS, len(PROMPT)) == ref
    for c in cs:
        c.kv.close("a")
    for sid in ("b", "c"):
        held = [c.kv.attach_prefix(sid, PROMPT) if c.kv.open(sid) or True else 0 for c in cs]
        assert held[0] == len(PROMPT) // BS * BS > 2 * WINDOW, name
        pos = held[0]
        assert decode(shards, cs, sid, pos, PROMPT[pos:], STEPS, len(PROMPT)) == ref, (name, sid)
        for c in cs:
            c.kv.close(sid)


def test_a_sequence_of_any_length_takes_a_bounded_share_of_the_pool():
    w = WindowBlocks(6, BS, WINDOW, ROLL)  # 6 blocks: 24 positions
    assert w.bound == 4 and w.fits(10_000) and not KVManager(6, BS).fits(10_000)
    w.open("s")
    for pos in range(0, 400, 3):
        w.prepare_write("s", pos, 3)
        w.commit("s", pos, [1, 2, 3])
        assert w.used <= w.bound
    assert w.tables["s"].length == 402 and w.held("s") == 402
    with pytest.raises(BadWrite):  # rolled back past what it kept
        w.prepare_write("s", 402 - WINDOW - ROLL - BS, 1)
    w.close("s")
    assert w.used == 0


def spec(sid: str, n: int) -> SeqSpec:
    return SeqSpec(sid, capacity=4 * n, sampling=SamplingParams(), max_new_tokens=8, stop_ids=frozenset(),
                   prompt=tuple(range(1, n + 1)))


def test_admission_counts_a_window_as_bounded():
    """A pool of 40 blocks of 4: whole contexts admit no prompt of 400 positions; windows admit eight."""
    plain = Scheduler(KVManager(40, BS), first=True, last=True, node_id="n")
    with pytest.raises(ResourceExhausted):
        plain.admit(spec("a", 400))
    groups = Scheduler(managers(40, BS, WINDOW, 40, ROLL), first=True, last=True, node_id="n")
    with pytest.raises(ResourceExhausted):  # the full layers' pool still holds the whole context
        groups.admit(spec("a", 400))
    sliding = Scheduler(managers(40, BS, WINDOW, 0, ROLL), first=True, last=True, node_id="n")
    for i in range(8):  # 4 blocks each, and one kept free per running sequence
        sliding.admit(spec(f"s{i}", 400))
    with pytest.raises(ResourceExhausted):
        sliding.admit(spec("more", 400))


def test_a_stage_whose_windows_keep_every_position_says_so_in_its_profile():
    """--window-kv off and --tp stages keep every position of their sliding layers: their profile's
    full_sliding_kv reaches the controller's planner profile (which then counts full layers' bytes)."""
    for full in (False, True):
        host = HostProfile("cpu", "x", 1 << 30, 1e12, 1e11, ("fp32",), full_sliding_kv=full)
        reply = stage_pb2.StatusReply(node_id="n", profile=wire.profile_to_proto(host))
        assert device_profile(reply, {}).full_sliding_kv is full


def test_the_budget_split_holds_as_many_sequences_in_both_pools():
    full, win = split_budget(1 << 30, 1000, 5000, 1100, 8192)
    assert full + win == 1 << 30
    assert abs(full / (1000 * 8192) - win / (5000 * 1100)) < 1e-6 * full / (1000 * 8192)
