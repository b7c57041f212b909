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
    runner.run(asyncio.wait_for(main(), 300))
