"""Outline-DAG requests on the default model through 2 in-process stages: points decode as their
own sequences, forked from the outline's or a predecessor's KV, and each gives exactly the greedy
tokens of its sequence decoded from scratch on a fresh mesh (fork, single-predecessor handoff,
several predecessors); ready points share steps; the Submit API streams and reports the DAG."""
from __future__ import annotations

import asyncio

import grpc

from logicpipe.controller.jobs.job import Job
from logicpipe.sampling import SamplingParams
from logicpipe.v1 import controller_pb2

from .conftest import RPC_TIMEOUT_S, controller, stage_node

OUTLINE = "1. Pick the beans. []\n2. Grind them. []\n3. Brew with hot water. [1, 2]\n4. Serve it. [3]\n"
QUESTION = "How do I make coffee?"


async def tokens_of(scheduler, ids, n, stop_ids):
    async with scheduler.submit(Job(tuple(ids), n, SamplingParams(), stop_ids=stop_ids)) as handle:
        return [u.token_id async for u in handle]


def test_points_fork_hand_over_kv_and_match_decoding_from_scratch(runner, model_dir):
    from logicpipe.controller.jobs.outline import OutlineRun

    async def main():
        async with stage_node("o-first") as a, stage_node("o-last") as b, controller(model_dir, [a.address, b.address]) as ctl:
            run = OutlineRun(ctl.app.scheduler, ctl.app.tokenizer, QUESTION, outline_text=OUTLINE, point_tokens=12)
            seen = [pid async for pid, _, _ in run.events()]
            # 3 extends 1's sequence (outline, 1, 2, header): 1's KV is shared, 2's segment computed;
            # 4 continues from 3's full KV
            assert [p.shared for p in run.points] == ["outline", "outline", "point 1", "point 3"]
            assert all(p.tokens for p in run.points)
            last_of_1 = len(seen) - 1 - seen[::-1].index(1)
            assert 2 in seen[:last_of_1], "points 1 and 2 did not decode together"  # (in 2 micro-batches here)
            points = [(p.ids, len(p.tokens), p.tokens) for p in run.points]
            stop_ids = run.stop_ids
        # from scratch, on a fresh mesh (no prefix cache): the same tokens for every point
        async with stage_node("r-first") as a, stage_node("r-last") as b, controller(model_dir, [a.address, b.address]) as ctl:
            for ids, n, expect in points:
                got = await tokens_of(ctl.app.scheduler, ids, 12, stop_ids)
                assert [t for t in got if t not in stop_ids] == expect
    runner.run(asyncio.wait_for(main(), 300))


def test_an_outline_submit_streams_points_and_reports_the_dag(runner, model_dir):
    async def main():
        async with stage_node("s-first") as a, stage_node("s-last") as b, controller(model_dir, [a.address, b.address]) as ctl:
            call = ctl.stub.Submit(controller_pb2.SubmitRequest(prompt=QUESTION, outline=True, max_tokens=10,
                                                                max_points=4), timeout=120)
            replies = [r async for r in call]
            final = replies[-1]
            assert final.finished and 1 <= len(final.points) <= 4
            assert {r.point for r in replies[:-1]} >= {0, 1}  # the outline's tokens, then the points'
            assert all(p.tokens for p in final.points) and final.points[0].shared == "outline"
            assert [p.id for p in final.points] == list(range(1, len(final.points) + 1))
            for p in final.points:
                assert all(d < p.id for d in p.deps)
            bad = ctl.stub.Submit(controller_pb2.SubmitRequest(prompt=QUESTION, outline=True, max_points=99),
                                  timeout=RPC_TIMEOUT_S)
            try:
                [r async for r in bad]
                raise AssertionError("99 points were accepted")
            except grpc.aio.AioRpcError as err:
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "32" in err.details()
            await a_broken_outline_stream_is_resumed_by_point(ctl, replies)
    runner.run(asyncio.wait_for(main(), 300))


def by_point(replies) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for r in replies:
        out.setdefault(r.point, []).extend(r.token_ids)
    return out


async def a_broken_outline_stream_is_resumed_by_point(ctl, whole) -> None:
    """The same request again under an id of the client's, its stream cut after a few tokens: it
    stays journaled, and Resume with the tokens held of each point gives the rest of each point."""
    journal = ctl.app.scheduler.journal
    ask = controller_pb2.SubmitRequest(prompt=QUESTION, outline=True, max_tokens=10, max_points=4,
                                       request_id="outline-resumed")
    call = ctl.stub.Submit(ask, timeout=120)
    first = []
    async for r in call:
        first.append(r)
        if sum(len(x.token_ids) for x in first) >= 5:
            break
    call.cancel()
    assert journal.entries["outline-resumed"].job["outline"]["question"] == QUESTION  # kept for a resume
    held = by_point(first)
    have = [len(held.get(p, ())) for p in range(max(held) + 1)]
    call = ctl.stub.Resume(controller_pb2.ResumeRequest(request_id="outline-resumed", have_tokens=sum(have),
                                                        have_points=have), timeout=120)
    rest = [r async for r in call]
    assert rest[-1].finished and [p.text for p in rest[-1].points] == [p.text for p in whole[-1].points]
    got = by_point(first + rest[:-1])
    assert got == by_point(whole[:-1])  # every point whole, nothing twice (greedy: the same tokens)
    assert "outline-resumed" not in journal.entries  # delivered: out of the journal
    try:
        [r async for r in ctl.stub.Resume(controller_pb2.ResumeRequest(request_id="outline-resumed"), timeout=30)]
        raise AssertionError("an outline request delivered to its end was resumed again")
    except grpc.aio.AioRpcError as err:
        assert err.code() == grpc.StatusCode.NOT_FOUND
