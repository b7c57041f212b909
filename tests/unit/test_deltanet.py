"""Gated delta-net linear attention (Qwen3.5, Qwen3-Next) and its per-sequence state: the chunked
prompt form, the row-by-row decode form and transformers' layer agree; a prompt in pieces equals it
whole; the states the engine keeps make truncation after rejected candidates and forks exact; the
scheduler holds a fork's positions only where the parent left a state."""
from __future__ import annotations

import pytest
import torch

from logicpipe.common.modeldir import ModelConfig, ModelError
from logicpipe.errors import FailedPrecondition
from logicpipe.sampling import SamplingParams
from logicpipe.stage_node.engine.blocks import KVManager
from logicpipe.stage_node.engine.kv import StepKV, seq_slice
from logicpipe.stage_node.engine.scheduler import Scheduler
from logicpipe.stage_node.engine.sequence import SeqSpec, SeqWork
from logicpipe.stage_node.engine.states import RecurrentStates
from logicpipe.stage_node.model import deltanet
from logicpipe.stage_node.model import tp as tp_split
from logicpipe.stage_node.model.ops import DECODE_ROWS, PROMPT_ROWS
from logicpipe.stage_node.model.shard import Shard
from tests.families import build, hf_model

from .paged import PagedCache

RTOL = 1e-5


def close(a: torch.Tensor, b: torch.Tensor, rtol: float = RTOL) -> None:
    err = ((a - b).abs().max() / b.abs().max()).item()
    assert err <= rtol, f"relative error {err:.3g} > {rtol}"


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def hybrid(request, tmp_path_factory):
    path = build(request.param, tmp_path_factory.mktemp(request.param) / "model")
    return path, hf_model(path), Shard.load(path, 0, 3, first=True, last=True)


def rule_inputs(n: int, heads: int = 3, kd: int = 8, vd: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = deltanet.l2norm(torch.randn(n, heads, kd, generator=g))
    k = deltanet.l2norm(torch.randn(n, heads, kd, generator=g))
    v = torch.randn(n, heads, vd, generator=g)
    decay = -torch.rand(n, heads, generator=g)
    beta = torch.rand(n, heads, generator=g)
    return q, k, v, decay, beta, torch.randn(heads, kd, vd, generator=g)


@pytest.mark.parametrize("n", [1, 5, 64, 150])
def test_the_chunked_rule_equals_the_recurrence(n):
    """From a nonzero state, over fewer rows than a chunk, exactly one chunk and several (padded)."""
    q, k, v, g, beta, s0 = rule_inputs(n)
    o1, s1 = deltanet.chunked_rule(q, k, v, g, beta, s0)
    o2, s2 = deltanet.recurrent_rule(q, k, v, g, beta, s0)
    close(o1, o2)
    close(s1, s2)


def mix_of(shard: Shard, h: torch.Tensor, start: int, decode_from: int, state: deltanet.SeqState | None,
           layer: int = 0) -> torch.Tensor:
    n = h.shape[0]
    seq = seq_slice(start, n, list(range(16)), 16, decode_from=decode_from)
    rows = PROMPT_ROWS if decode_from >= start + n else DECODE_ROWS
    return deltanet.mix(h, shard.layers[layer].linear, shard.arch.linear, (seq,), None if state is None else (state,),
                        layer, rows, shard.config.rms_norm_eps)


def test_prompt_rows_decode_rows_and_pieces_equal_transformers_layer(hybrid):
    """One linear layer over 70 rows: the chunked prompt form, the row-by-row decode form, and the
    prompt in three pieces (each from the state the one before left) equal transformers' layer."""
    _, model, shard = hybrid
    h = torch.randn(70, shard.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model.model.layers[0].linear_attn(h[None])[0]
    close(mix_of(shard, h, 0, 70, None), want)  # prompt rows, one run
    close(mix_of(shard, h, 0, 0, None), want)  # decode rows, one by one
    parts, state, start = [], None, 0
    for stop in (10, 45, 70):
        st = deltanet.SeqState(None if state is None else state, keep=(stop,))
        parts.append(mix_of(shard, h[start:stop], start, 70, st))
        state, start = st.out[stop], stop
    close(torch.cat(parts), want)


def greedy_rows(shard: Shard, cache: PagedCache, sid: str, start: int, tokens: list[int], prompt: int,
                candidates: int = 0) -> torch.Tensor:
    return shard.logits(cache.forward(shard.embed(torch.tensor(tokens)), [(sid, start, tokens)], {sid: prompt},
                                      {sid: candidates}))


def test_rejected_candidates_roll_the_state_back_exactly(hybrid):
    """A step of a token and 3 candidates, then a step from after the first accepted candidate: its
    logits are bit-identical to those of a sequence that never saw the rejected ones (decode rows go
    one by one, so a row's state is the same however its step was cut)."""
    _, _, shard = hybrid
    prompt = torch.randint(0, 49152, (21,), generator=torch.Generator().manual_seed(5)).tolist()
    a, b = PagedCache(shard), PagedCache(shard)
    greedy_rows(shard, a, "s", 0, prompt, len(prompt))
    greedy_rows(shard, b, "s", 0, prompt, len(prompt))
    greedy_rows(shard, a, "s", 21, [7, 8, 9, 10], len(prompt), candidates=3)  # token 7, candidates 8 9 10
    assert a.pool.states.positions("s") == [21, 22, 23, 24, 25]
    got = greedy_rows(shard, a, "s", 23, [11], len(prompt))  # 8 accepted, 9 and 10 rejected: 11 at position 23
    greedy_rows(shard, b, "s", 21, [7], len(prompt))
    greedy_rows(shard, b, "s", 22, [8], len(prompt))
    want = greedy_rows(shard, b, "s", 23, [11], len(prompt))
    assert torch.equal(got, want)


def test_a_fork_continues_from_its_parents_state(hybrid):
    """A child forked at the parent's length continues exactly as the parent does; one forked a row
    before it (the `n` choices compute the prompt's last row again) leaves the parent's very states
    there, and its next logits agree to rounding (its full-attention row is computed in a step of
    another shape: as for any family)."""
    _, _, shard = hybrid
    prompt = torch.randint(0, 49152, (19,), generator=torch.Generator().manual_seed(6)).tolist()
    c = PagedCache(shard)
    greedy_rows(shard, c, "p", 0, prompt, len(prompt))
    states = c.pool.states
    assert states.positions("p") == [18, 19]
    assert states.fork("p", "a", 19) == 19 and states.fork("p", "b", 18) == 18 and states.fork("p", "z", 17) == 0
    for sid, at in (("a", 19), ("b", 18)):
        c.kv.fork("p", sid, at)
    want = greedy_rows(shard, c, "p", 19, [4], len(prompt))
    assert torch.equal(greedy_rows(shard, c, "a", 19, [4], len(prompt)), want)
    close(greedy_rows(shard, c, "b", 18, [prompt[-1], 4], len(prompt))[-1:], want)
    parent, child = states.seqs["p"][19], states.seqs["b"][19]
    assert all(torch.equal(x, y) for i in shard.linear_layers for x, y in zip(parent[i], child[i]))


def spec(sid: str, prompt, parent: str = "", length: int = 0) -> SeqSpec:
    return SeqSpec(sid, 64, SamplingParams(), 8, frozenset(), prompt=tuple(prompt), parent=parent, parent_length=length)


def test_the_scheduler_holds_a_fork_up_to_its_parents_state_and_no_prefix():
    """With recurrent states: no prefix-cache attach; a fork holds the positions up to the parent's
    last state within them (0 where it has none, so the controller computes it all); a step where
    the sequence has no state is refused; closing drops the state."""
    states = RecurrentStates()
    kv = KVManager(32, 4)
    sched = Scheduler(kv, first=True, last=True, node_id="n", states=states, prefix_cache=False)
    prompt = list(range(12))
    sched.admit(spec("p", prompt))
    kv.reserve("p", 12)
    kv.commit("p", 0, prompt)
    states.seqs["p"] = {11: {}, 12: {}}  # as a step of its prompt leaves them
    assert sched.admit(spec("a", prompt + [5], "p", 12))[1] == 12
    assert sched.admit(spec("b", prompt[:11] + [5], "p", 11))[1] == 11
    assert sched.admit(spec("c", prompt[:8] + [5], "p", 8))[1] == 0 and kv.tables["c"].length == 0
    assert sched.admit(spec("d", prompt))[1] == 0  # the prefix cache would have attached 12 positions
    with pytest.raises(FailedPrecondition, match="no state at position 3"):
        sched._plan(sched.seqs["c"], SeqWork("c", 3, (1,)), set(), [])
    sched.close("a")
    assert "a" not in states.seqs


def test_a_warm_up_forward_without_states_runs(hybrid):
    """A step without states (a CUDA stage's warm-up) starts every sequence at zeros and keeps none."""
    _, _, shard = hybrid
    pool = shard.new_pool(4, 16)
    out = shard.forward(torch.randn(5, shard.config.hidden_size), StepKV(pool, torch.arange(5),
                                                                         (seq_slice(0, 5, [0], 16),)))
    assert out.shape == (5, shard.config.hidden_size) and bool(torch.isfinite(out).all())


def test_what_linear_layers_do_not_run_yet_is_refused_by_name(hybrid):
    """Tensor-parallel stages and quantized layers refuse a hybrid model, saying why."""
    path, _, _ = hybrid
    with pytest.raises(ModelError, match="linear-attention layers"):
        tp_split.check_split(ModelConfig.from_dir(path), 2)
    with pytest.raises(ValueError, match="quantized linear-attention layers"):
        Shard.load(path, 0, 1, first=True, last=False, quantize="int8")


def test_linear_layers_keep_no_kv(hybrid):
    """A stage's KV pool holds its full-attention layers only: none for a stage of linear layers."""
    path, _, shard = hybrid
    assert shard.kv_layers == (2,) and shard.new_pool(2, 16).num_layers == 1
    linear_only = Shard.load(path, 0, 2, first=True, last=False)
    pool = linear_only.new_pool(2, 16)
    assert pool.num_layers == 0 and pool.block_bytes == 0 and pool.states is not None
