"""Candidate tokens through a 3-stage pipeline of real stage services (tiny random Llama, real
gRPC): candidates verified in one pass, rejected ones rolled back on every stage (zero, partial,
full acceptance), the last stage's own drafter (prompt lookup) giving exactly greedy's tokens and
a seeded request's sampled tokens, a draft model instead of prompt lookup, and a prompt cut into
pipelined chunks."""
from __future__ import annotations

import contextlib

import pytest

from logicpipe.v1 import stage_pb2

from .conftest import (
    RPC_TIMEOUT_S,
    TINY_LAYERS,
    Events,
    assign,
    hf_greedy,
    new_session_id,
    open_request,
    prompt_step,
    run,
    stage_node,
    three_stages,
    two_stages,
)

LONG_PROMPT = tuple((7 * i + 3) % 120 for i in range(40))
LOOPING_PROMPT = tuple([11, 22, 33, 44, 55] * 6)  # prompt lookup finds its n-grams at once


async def held(nodes, sid) -> list[int]:
    """Close the session everywhere; the KV length each stage held."""
    return [(await n.stub.CloseSession(stage_pb2.CloseSessionRequest(session_id=sid), timeout=RPC_TIMEOUT_S)).tokens_held
            for n in nodes]


async def decode(nodes, prompt, n: int, **fields) -> tuple[list[int], list[stage_pb2.TokenEvent], list[int]]:
    """Open a session on every stage, feed the prompt, read n tokens -> (tokens, their events,
    KV length per stage at the end)."""
    first, last = nodes[0], nodes[-1]
    sid = new_session_id("spec")
    async with Events(last) as events:
        for node in nodes:
            await node.stub.OpenSession(open_request(sid, len(prompt) + n + 8, max_new_tokens=n,
                                                     prompt_token_ids=list(prompt), **fields), timeout=RPC_TIMEOUT_S)
        call = first.stub.Stream(timeout=RPC_TIMEOUT_S)
        evs, tokens = [], []
        try:
            await call.write(prompt_step(sid, list(prompt)))
            while not evs or not evs[-1].finished:
                evs.append(await events.token_event(sid))
                tokens += list(evs[-1].token_ids)
        finally:
            call.cancel()
    return tokens, evs, await held(nodes, sid)


async def last_status(node) -> stage_pb2.StatusReply:
    return await node.stub.Status(stage_pb2.StatusRequest(), timeout=RPC_TIMEOUT_S)


@pytest.mark.parametrize("accepted", [0, 1, 3])
def test_rejected_candidates_are_rolled_back_on_every_stage(accepted, tiny_model, hf):
    """Zero, partial and full acceptance of 3 candidates through 3 stages: the first trip reports
    the accepted ones and greedy's next token; every stage (first, middle, last) rolls back the
    rejected positions, so the sequence goes on exactly as plain greedy and each holds only the
    accepted tokens' KV at the end."""
    expect = hf_greedy(hf, LONG_PROMPT, 8)
    candidates = expect[:3]
    if accepted < 3:
        candidates[accepted] = (candidates[accepted] + 1) % 128

    async def main():
        async with three_stages(tiny_model.path) as nodes:
            sid = new_session_id("roll")
            async with Events(nodes[-1]) as events:
                for node in nodes:
                    await node.stub.OpenSession(open_request(sid, 60, max_new_tokens=8), timeout=RPC_TIMEOUT_S)
                call = nodes[0].stub.Stream(timeout=RPC_TIMEOUT_S)
                try:
                    await call.write(prompt_step(sid, list(LONG_PROMPT) + candidates, num_candidates=3))
                    ev = await events.token_event(sid)
                    assert list(ev.token_ids) == expect[: accepted + 1] and ev.candidates == 3
                    rest = await events.tokens(sid)
                finally:
                    call.cancel()
            assert [t.token_id for t in rest] == expect[accepted + 1:]
            assert await held(nodes, sid) == [len(LONG_PROMPT) + 8 - 1] * 3
            st = await last_status(nodes[-1])
            assert (st.candidates_verified, st.candidates_accepted) == (3, accepted)
    run(main())


@pytest.mark.parametrize("prompt", [LOOPING_PROMPT, LONG_PROMPT], ids=["looping", "plain"])
def test_drafted_candidates_give_exactly_greedys_tokens(prompt, tiny_model, hf):
    """The last stage drafts by prompt lookup (speculate=4): the tokens are greedy's, one trip fewer
    per accepted candidate, and every stage ends holding exactly the real tokens."""
    n = 40
    expect = hf_greedy(hf, prompt, n)

    async def main():
        async with three_stages(tiny_model.path) as nodes:
            tokens, evs, kv = await decode(nodes, prompt, n, speculate=4)
            plain, plain_evs, _ = await decode(nodes, prompt, n)
            st = await last_status(nodes[-1])
        assert tokens == expect == plain
        assert kv == [len(prompt) + n - 1] * 3
        assert all(e.candidates == 0 for e in plain_evs) and len(plain_evs) == n
        verified = sum(e.candidates for e in evs)
        accepted = sum(len(e.token_ids) - 1 for e in evs if e.candidates)
        assert verified > 0 and st.candidates_verified == verified and st.candidates_accepted == accepted
        assert len(evs) == n - accepted  # every accepted candidate saved a trip (the random model
        # copies nothing, so few are: acceptance itself is shown above and on the real model, mesh tier)
    run(main())


def test_a_seeded_sampled_request_draws_the_same_tokens_with_candidates(tiny_model):
    """Speculative sampling with the position's own draw: the same tokens as without candidates."""
    sampling = stage_pb2.SamplingParams(temperature=0.4, top_p=0.9, seed=77)

    async def main():
        async with two_stages(tiny_model.path) as nodes:
            with_c, evs, _ = await decode(nodes, LOOPING_PROMPT, 40, sampling=sampling, speculate=4)
            without, _, _ = await decode(nodes, LOOPING_PROMPT, 40, sampling=sampling)
        assert with_c == without
        assert sum(e.candidates for e in evs) > 0
    run(main())


def test_a_prompt_in_pipelined_chunks_gives_the_same_tokens(tiny_model, hf):
    """prefill_chunk=8: stage 0 cuts the 40-token prompt into 5 steps that flow through the 3
    stages back to back; the tokens are greedy's."""
    async def main():
        async with three_stages(tiny_model.path) as nodes:
            before = (await last_status(nodes[0])).steps
            tokens, _, _ = await decode(nodes, LONG_PROMPT, 6, prefill_chunk=8, speculate=0)
            steps = (await last_status(nodes[0])).steps - before
        assert tokens == hf_greedy(hf, LONG_PROMPT, 6)
        assert steps == 5 + 5  # 5 prompt chunks, then one step per later token
    run(main())


@contextlib.asynccontextmanager
async def two_stages_drafting(model_dir, **options):
    """[0, 2) -> [2, 4), the last stage with a draft model (StageOptions draft_model/draft_layers)."""
    async with stage_node("first") as first, stage_node("last", **options) as last:
        await assign(last, model_dir, 2, TINY_LAYERS, stage_index=1, num_stages=2, first_address=first.address)
        await assign(first, model_dir, 0, 2, stage_index=0, num_stages=2, next_address=last.address)
        yield first, last


@pytest.mark.parametrize("layers", [0, 2], ids=["whole", "first2layers"])
def test_a_draft_model_drafts_and_the_output_stays_greedys(layers, tiny_model, hf):
    """--draft-model (the tiny model itself, whole or its first 2 layers: self-speculation): its
    greedy drafts are verified like any candidates; the whole model as its own drafter is accepted
    almost always, and the tokens are greedy's either way."""
    n = 30
    expect = hf_greedy(hf, LONG_PROMPT, n)

    async def main():
        async with two_stages_drafting(tiny_model.path, draft_model=str(tiny_model.path), draft_layers=layers) as nodes:
            st = await last_status(nodes[-1])
            assert st.drafter.startswith("model") and f"({layers or TINY_LAYERS} layers)" in st.drafter
            tokens, evs, kv = await decode(nodes, LONG_PROMPT, n, speculate=4)
            st = await last_status(nodes[-1])
        assert tokens == expect and kv == [len(LONG_PROMPT) + n - 1] * 2
        assert st.candidates_verified > 0
        if not layers:
            assert st.candidates_accepted >= 0.8 * st.candidates_verified
            assert len(evs) <= n // 3
    run(main())


def test_a_draft_model_of_another_vocabulary_falls_back_to_prompt_lookup(tiny_model, hf, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    other = tmp_path / "other-vocab"
    LlamaForCausalLM(LlamaConfig(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(other)

    async def main():
        async with two_stages_drafting(tiny_model.path, draft_model=str(other)) as nodes:
            st = await last_status(nodes[-1])
            assert st.drafter.startswith("prompt lookup") and "200-token vocabulary" in st.drafter
            tokens, _, _ = await decode(nodes, LONG_PROMPT, 8, speculate=4)
        assert tokens == hf_greedy(hf, LONG_PROMPT, 8)
    run(main())


def test_a_seeded_sampled_request_with_a_draft_model_keeps_its_tokens(tiny_model):
    """The draft model's greedy guesses are often what a low-temperature draw picks: candidates
    are accepted, and the tokens are the ones the seed draws without candidates."""
    sampling = stage_pb2.SamplingParams(temperature=0.3, seed=5)

    async def main():
        async with two_stages_drafting(tiny_model.path, draft_model=str(tiny_model.path)) as nodes:
            with_c, evs, _ = await decode(nodes, LONG_PROMPT, 30, sampling=sampling, speculate=4)
            without, _, _ = await decode(nodes, LONG_PROMPT, 30, sampling=sampling, speculate=0)
        assert with_c == without
        assert sum(len(e.token_ids) - 1 for e in evs if e.candidates) > 0
    run(main())


def test_a_failing_draft_model_costs_the_candidates_not_the_tokens(tiny_model, hf):
    async def main():
        async with two_stages_drafting(tiny_model.path, draft_model=str(tiny_model.path)) as nodes:
            runtime = nodes[-1].runtime

            def broken(*args, **kwargs):
                raise RuntimeError("out of memory (simulated)")
            runtime.draft_model.propose = broken
            tokens, evs, _ = await decode(nodes, LONG_PROMPT, 10, speculate=4)
            assert runtime.alive()
        assert tokens == hf_greedy(hf, LONG_PROMPT, 10) and all(e.candidates == 0 for e in evs)
    run(main())


def test_draft_caches_follow_the_open_sequences(tiny_model):
    from logicpipe.stage_node.engine.draft_model import DraftModel

    model = DraftModel(tiny_model.path)
    context = list(LONG_PROMPT)
    first = model.propose("a", context, 4)
    assert len(first) == 4 and model.propose("a", context, 4) == first  # the cache is cut back, same guess
    assert model.propose("a", context + first[:2], 2) == first[2:4]     # accepted 2: it continues
    model.propose("b", context[:10], 3)
    model.forget({"b"})
    assert model.cached() == ["b"]
