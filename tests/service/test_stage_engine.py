"""The stage engine through the StageNode service (tiny random Llama, in-process, real gRPC):
the prefix cache, replay and fork through OpenSession, candidate tokens with their KV rollback on
every stage, stale plan generations, a bad sequence failing alone, session leases, and an event
loop that keeps answering while a step computes."""
from __future__ import annotations

import asyncio
import math
import time

import grpc
import pytest
import torch

from logicpipe.v1 import stage_pb2, tensor_pb2

from .conftest import (
    RPC_TIMEOUT_S,
    TINY_HIDDEN,
    Events,
    assign,
    assign_pipeline,
    expect_status,
    hf_greedy,
    new_session_id,
    open_request,
    prompt_step,
    run,
    single_stage,
    stage_node,
    two_stages,
)

FP = grpc.StatusCode.FAILED_PRECONDITION
LONG_PROMPT = tuple((7 * i + 3) % 120 for i in range(40))  # 2 whole blocks of 16, and 8 more


async def status(node) -> stage_pb2.StatusReply:
    return await node.stub.Status(stage_pb2.StatusRequest(), timeout=RPC_TIMEOUT_S)


async def generate(first, last, prompt, n: int, *, sid: str | None = None, feed_from: int | None = None,
                   close: bool = True, **fields) -> tuple[list[int], int]:
    """Open a session on every stage, feed `prompt` from `feed_from` (default: what every stage
    already holds), read n tokens. Returns (tokens, cached positions)."""
    sid = sid or new_session_id("gen")
    nodes = [first] if last is first else [first, last]
    async with Events(last) as events:
        cached = []
        for node in nodes:
            reply = await node.stub.OpenSession(open_request(sid, len(prompt) + n, max_new_tokens=n,
                                                             prompt_token_ids=list(prompt), **fields),
                                                timeout=RPC_TIMEOUT_S)
            cached.append(reply.cached_tokens)
        start = min(min(cached), len(prompt) - 1) if feed_from is None else feed_from
        call = first.stub.Stream(timeout=RPC_TIMEOUT_S)
        try:
            await call.write(prompt_step(sid, prompt[start:], start))
            tokens = [t.token_id for t in await events.tokens(sid)]
        finally:
            call.cancel()
    if close:
        for node in nodes:
            await node.stub.CloseSession(stage_pb2.CloseSessionRequest(session_id=sid), timeout=RPC_TIMEOUT_S)
    return tokens, min(cached)


# ----------------------------------------------------------------------------- prefix cache, replay, fork

def test_a_repeated_prompt_is_attached_from_the_prefix_cache(tiny_model, hf):
    expect = hf_greedy(hf, LONG_PROMPT, 6)

    async def main():
        async with two_stages(tiny_model.path) as (first, last):
            tokens, cached = await generate(first, last, LONG_PROMPT, 6)
            assert tokens == expect and cached == 0
            tokens, cached = await generate(first, last, LONG_PROMPT, 6)
            assert tokens == expect and cached == 32  # its two whole blocks, on both stages
            for node in (first, last):
                st = await status(node)
                assert st.prefix_hit_tokens == 32 and st.kv_blocks_used == 0 and st.kv_blocks_cached > 0
            # another prompt sharing the first block only
            other = LONG_PROMPT[:16] + tuple(reversed(LONG_PROMPT[16:]))
            tokens, cached = await generate(first, last, other, 4)
            assert cached == 16 and tokens == hf_greedy(hf, other, 4)
    run(main())


def test_a_replay_continues_exactly_where_the_sequence_was(tiny_model, hf):
    """OpenSession with the prompt plus the tokens generated so far (`generated`) gives the same
    continuation, with token indexes continuing; sampled draws too."""
    async def main():
        async with two_stages(tiny_model.path) as (first, last):
            for sampling in (stage_pb2.SamplingParams(), stage_pb2.SamplingParams(temperature=1.0, seed=11)):
                whole, _ = await generate(first, last, LONG_PROMPT, 10, sampling=sampling)
                sid = new_session_id("replay")
                async with Events(last) as events:
                    for node in (first, last):
                        await node.stub.OpenSession(open_request(
                            sid, len(LONG_PROMPT) + 10, max_new_tokens=10, sampling=sampling, generated=4,
                            prompt_token_ids=list(LONG_PROMPT) + whole[:4]), timeout=RPC_TIMEOUT_S)
                    call = first.stub.Stream(timeout=RPC_TIMEOUT_S)
                    try:
                        await call.write(prompt_step(sid, list(LONG_PROMPT) + whole[:4]))
                        rest = await events.tokens(sid)
                    finally:
                        call.cancel()
                assert [t.token_id for t in rest] == whole[4:]
                assert [t.index for t in rest] == list(range(4, 10)) and rest[-1].finish_reason == "length"
                for node in (first, last):
                    await node.stub.CloseSession(stage_pb2.CloseSessionRequest(session_id=sid), timeout=RPC_TIMEOUT_S)
    run(main())


@pytest.mark.parametrize("swap_bytes,held", [(1 << 20, 43), (1, 32)], ids=["swapped", "swap-full"])
def test_a_session_closed_for_its_replay_comes_back_from_the_swap_space(swap_bytes, held, tiny_model, hf):
    """Closed with `swap` (as the controller closes a preempted request), a session's KV waits in each
    stage's swap space; its replay (the prompt and the tokens generated so far) holds all of it at
    once, computes only its last input row and goes on with exactly the tokens of a session never
    swapped. A swap space too small for it falls back to the prefix cache (its two whole blocks)."""
    expect = hf_greedy(hf, LONG_PROMPT, 10)

    async def main():
        async with stage_node("first", swap_bytes=swap_bytes) as first, \
                stage_node("last", swap_bytes=swap_bytes) as last:
            await assign_pipeline(first, last, tiny_model.path)
            sid = new_session_id("swapped")
            head, _ = await generate(first, last, LONG_PROMPT, 4, sid=sid, close=False)
            assert head == expect[:4]
            for node in (first, last):  # its 40 prompt positions and 3 of its tokens (the 4th was never fed)
                reply = await node.stub.CloseSession(stage_pb2.CloseSessionRequest(session_id=sid, swap=True),
                                                     timeout=RPC_TIMEOUT_S)
                assert reply.tokens_held == 43
            rows = [(await status(node)).tokens for node in (first, last)]
            replay, sid = list(LONG_PROMPT) + head, new_session_id("replay")
            async with Events(last) as events:
                cached = [(await node.stub.OpenSession(open_request(
                    sid, len(replay) + 6, max_new_tokens=10, generated=4, prompt_token_ids=replay),
                    timeout=RPC_TIMEOUT_S)).cached_tokens for node in (first, last)]
                assert cached == [held, held]
                call = first.stub.Stream(timeout=RPC_TIMEOUT_S)
                try:
                    await call.write(prompt_step(sid, replay[held:], held))
                    rest = [t.token_id for t in await events.tokens(sid)]
                finally:
                    call.cancel()
            assert rest == expect[4:]
            for node, before in zip((first, last), rows):
                st = await status(node)
                assert st.tokens - before == len(replay) - held + 5  # its input rows from `held`, then 5 decode rows
                assert st.swap_bytes_total == swap_bytes and st.swap_bytes_used == 0
                if held == 43:
                    assert (st.swapped_out_seqs, st.swapped_in_seqs, st.swapped_in_tokens, st.swap_full) == (1, 1, 11, 0)
                    # out: its 3 blocks; in: the third alone (the prefix cache holds the 2 whole ones)
                    assert (st.swapped_out_blocks, st.swapped_in_blocks) == (3, 1) and st.swapped_in_bytes > 0
                else:
                    assert (st.swapped_out_seqs, st.swapped_in_seqs, st.swap_full) == (0, 0, 1)
    run(main())


def test_a_fork_shares_its_parent_positions(tiny_model, hf):
    child_prompt = LONG_PROMPT[:24] + (5, 9, 77)
    expect = hf_greedy(hf, child_prompt, 5)

    async def main():
        async with two_stages(tiny_model.path) as (first, last):
            parent = new_session_id("parent")
            await generate(first, last, LONG_PROMPT, 3, sid=parent, close=False)
            used = (await status(first)).kv_blocks_used
            tokens, cached = await generate(first, last, child_prompt, 5, parent_session_id=parent, parent_length=24)
            assert cached == 24 and tokens == expect
            assert (await status(first)).kv_blocks_used == used  # the child is closed; the parent holds its own
            await expect_status(first.stub.OpenSession(open_request(
                "orphan", 40, prompt_token_ids=list(child_prompt), parent_session_id="nobody", parent_length=4),
                timeout=RPC_TIMEOUT_S), grpc.StatusCode.NOT_FOUND, "nobody")
    run(main())


# ----------------------------------------------------------------------------- candidates

@pytest.mark.parametrize("accepted", [0, 2, 3])
def test_candidates_are_verified_and_rejected_ones_rolled_back_on_every_stage(accepted, tiny_model, hf):
    """Stage 0 gets the prompt with 3 candidates: the last stage accepts the longest greedy prefix
    and then gives greedy's own next token; every stage rolls back the rest, and the sequence goes
    on exactly as plain greedy decoding."""
    expect = hf_greedy(hf, LONG_PROMPT, 8)
    candidates = expect[:3]
    if accepted < 3:
        candidates[accepted] = (candidates[accepted] + 1) % 128

    async def main():
        async with two_stages(tiny_model.path) as (first, last):
            sid = new_session_id("cand")
            async with Events(last) as events:
                for node in (first, last):
                    await node.stub.OpenSession(open_request(sid, 60, max_new_tokens=8), timeout=RPC_TIMEOUT_S)
                call = first.stub.Stream(timeout=RPC_TIMEOUT_S)
                try:
                    await call.write(prompt_step(sid, list(LONG_PROMPT) + candidates, num_candidates=3))
                    ev = await events.token_event(sid)
                    assert list(ev.token_ids) == expect[: accepted + 1] and ev.index == 0 and ev.candidates == 3
                    rest = await events.tokens(sid)
                finally:
                    call.cancel()
            assert [t.token_id for t in rest] == expect[accepted + 1:]
            assert rest[0].index == accepted + 1
            for node in (first, last):  # rolled back, then grown by the accepted tokens only
                held = await node.stub.CloseSession(stage_pb2.CloseSessionRequest(session_id=sid), timeout=RPC_TIMEOUT_S)
                assert held.tokens_held == len(LONG_PROMPT) + 8 - 1
    run(main())


# ----------------------------------------------------------------------------- plan generation, bad rows

def test_a_step_of_another_plan_generation_is_refused(tiny_model):
    async def main():
        async with stage_node("gen") as node:
            await assign(node, tiny_model.path, generation=7)
            assert (await status(node)).generation == 7
            sid = new_session_id("stale")
            await node.stub.OpenSession(open_request(sid), timeout=RPC_TIMEOUT_S)
            async with Events(node) as events:
                call = node.stub.Stream(timeout=RPC_TIMEOUT_S)
                try:
                    stale = prompt_step(sid)
                    stale.generation = 6
                    await call.write(stale)
                    reply = await call.read()
                    assert reply.session_id == sid and reply.code == FP.value[0]
                    assert "generation 7" in reply.message and "generation 6" in reply.message
                    assert (await events.error(sid)).code == FP.value[0]
                    current = prompt_step(sid)
                    current.generation = 7
                    await call.write(current)
                    assert len(await events.tokens(sid)) == 4
                finally:
                    call.cancel()
    run(main())


def test_non_finite_hidden_states_fail_that_sequence_only(tiny_model):
    async def main():
        async with two_stages(tiny_model.path) as (first, last):
            good, bad = new_session_id("good"), new_session_id("bad")
            for sid in (good, bad):
                await last.stub.OpenSession(open_request(sid, 20, max_new_tokens=1), timeout=RPC_TIMEOUT_S)
            hidden = torch.randn(4, TINY_HIDDEN)
            hidden[3, 5] = math.nan
            batch = stage_pb2.StepBatch(seqs=[
                stage_pb2.SeqStep(session_id=good, start_pos=0, num_tokens=2, token_ids=[1, 2]),
                stage_pb2.SeqStep(session_id=bad, start_pos=0, num_tokens=2, token_ids=[1, 2])],
                hidden=tensor_pb2.Tensor(dtype="float32", shape=[4, TINY_HIDDEN], data=hidden.numpy().tobytes()))
            async with Events(last) as events:
                call = last.stub.Stream(timeout=RPC_TIMEOUT_S)
                try:
                    await call.write(batch)
                    err = await events.error(bad)
                    assert err.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "NaN" in err.message
                    assert (await events.token_event(good)).finished
                finally:
                    call.cancel()
    run(main())


# ----------------------------------------------------------------------------- leases

def test_sessions_of_a_gone_owner_are_freed_after_the_ttl(tiny_model):
    async def main():
        async with single_stage(tiny_model.path, "leased", session_ttl_s=0.5) as node:
            owner_events = Events(node, owner="ctl-1")
            async with owner_events:
                await node.stub.OpenSession(open_request("mine", 40, owner="ctl-1", prompt_token_ids=list(range(20))),
                                            timeout=RPC_TIMEOUT_S)
                await asyncio.sleep(1.0)  # owner listening: the session stays however long it idles
                st = await status(node)
                assert (st.open_sessions, st.orphaned_sessions, st.sessions_expired) == (1, 0, 0)
            # the owner's subscription ended (a controller gone): orphaned, then freed
            await asyncio.sleep(0.2)
            st = await status(node)
            assert st.orphaned_sessions == 1 and st.kv_blocks_used > 0
            deadline = time.monotonic() + 5
            while (await status(node)).open_sessions and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            st = await status(node)
            assert (st.open_sessions, st.kv_blocks_used, st.sessions_expired) == (0, 0, 1)
            assert st.session_ttl_s == 0.5
            # a session of no owner lives while it is stepped, and the TTL after
            await node.stub.OpenSession(open_request("anon", 40), timeout=RPC_TIMEOUT_S)
            await asyncio.sleep(1.5)
            await expect_status(node.stub.CloseSession(stage_pb2.CloseSessionRequest(session_id="anon"),
                                                       timeout=RPC_TIMEOUT_S), grpc.StatusCode.NOT_FOUND, "anon")
    run(main())


# ----------------------------------------------------------------------------- responsiveness

def test_the_node_answers_while_a_long_generation_computes(tiny_model, monkeypatch):
    """Regression (DEADLINE_EXCEEDED under load): steps used to run on the event loop, so a long
    generation on one stage starved every other call. With every step on the runner thread,
    OpenSession and Status answer within a short deadline while steps compute."""
    import logicpipe.stage_node.engine.engine as engine_mod

    real = engine_mod.execute

    def slow_execute(*args):
        time.sleep(0.02)  # a slow model: 20 ms of compute per step, on the runner thread
        return real(*args)

    monkeypatch.setattr(engine_mod, "execute", slow_execute)

    async def main():
        async with single_stage(tiny_model.path, "busy") as node:
            sid = new_session_id("long")
            async with Events(node) as events:
                await node.stub.OpenSession(open_request(sid, 205, max_new_tokens=200), timeout=RPC_TIMEOUT_S)
                call = node.stub.Stream(timeout=60)
                try:
                    await call.write(prompt_step(sid))
                    await events.token_event(sid)  # generating
                    for i in range(20):
                        other = f"probe-{i}"
                        await node.stub.OpenSession(open_request(other), timeout=1.0)
                        await node.stub.Status(stage_pb2.StatusRequest(), timeout=1.0)
                        await node.stub.CloseSession(stage_pb2.CloseSessionRequest(session_id=other), timeout=1.0)
                    st = await status(node)
                    assert st.steps < 150, "the probes only finished after the generation"
                    assert len(await events.tokens(sid)) > 0
                finally:
                    call.cancel()
    run(main(), timeout=120)


# ----------------------------------------------------------------------------- overlapped greedy steps
def test_overlapped_greedy_steps_give_the_same_tokens_and_stops(tiny_model, hf, monkeypatch):
    """Issue 32: a one-stage pipeline launches its next greedy step before reading this one's
    tokens back (on CUDA; here forced on the CPU). Concurrent sequences of other lengths still get
    transformers' greedy tokens, one ends at its stop token (its launched row past the end is
    dropped, never committed), another at its length, and a sampled sequence beside them goes the
    plain way; afterwards no KV block is left in use."""
    from logicpipe.stage_node.engine import engine
    from logicpipe.stage_node.engine.engine import Engine

    monkeypatch.setattr(Engine, "OVERLAP_DEVICES", ("cuda", "cpu"))
    launched = []  # whether each launched step took its input tokens from the previous one's, on the device

    def counted(shard, pool, step, source=None):
        launched.append(source is not None)
        return launch(shard, pool, step, source)

    launch = engine.launch
    monkeypatch.setattr(engine, "launch", counted)
    prompts = [LONG_PROMPT[:9], LONG_PROMPT[3:20], LONG_PROMPT[:5]]
    expect = [hf_greedy(hf, p, 40 if i == 0 else 12) for i, p in enumerate(prompts)]
    stop = expect[1][4]

    async def later(delay: float, coro):  # a prompt that arrives while others' chains run
        await asyncio.sleep(delay)
        return await coro

    async def main():
        async with single_stage(tiny_model.path) as node:
            assert node.runtime.engine.overlap
            runs = [generate(node, node, prompts[0], 40),
                    later(0.05, generate(node, node, prompts[1], 12, stop_token_ids=[stop])),
                    later(0.1, generate(node, node, prompts[2], 7)),
                    later(0.15, generate(node, node, prompts[0], 6,
                                         sampling=stage_pb2.SamplingParams(temperature=0.8, seed=3)))]
            got = await asyncio.gather(*runs)
            assert got[0][0] == expect[0]
            cut = expect[1].index(stop) + 1
            assert got[1][0] == expect[1][:cut]
            assert got[2][0] == expect[2][:7]
            assert len(got[3][0]) == 6
            alone, _ = await generate(node, node, prompts[2], 12)
            assert alone == expect[2]
            st = await status(node)
            assert st.kv_blocks_used == 0 and st.steps > 0
        assert sum(launched) >= 10 and not all(launched)  # chains formed, and began from scheduled steps
    run(main())
