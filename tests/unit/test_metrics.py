"""/metrics without a mesh: the controller's scheduler over a fake pipeline, a clock the test moves.
The inter-token histogram gets every gap between consecutive tokens as handed to the client (a
stall of seconds stays visible, up to the 30 s bucket), and a client that goes away counts as
outcome="cancelled", an error as "failed"."""
from __future__ import annotations

import asyncio
import types

import grpc
import pytest

from logicpipe.controller.jobs import scheduler as scheduler_mod
from logicpipe.controller.jobs.journal import Journal
from logicpipe.controller.api.metrics import Metrics
from logicpipe.controller.jobs.job import Job
from logicpipe.errors import Unavailable, code_number
from logicpipe.v1 import stage_pb2
from tests.unit.test_journal import scheduler, tokens, until


class Clock:
    """time.monotonic for the scheduler only (asyncio keeps the real one)."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(scheduler_mod, "time", types.SimpleNamespace(monotonic=c.monotonic))
    return c


def with_metrics():
    sched, pipe = scheduler(Journal(None, "d"))
    app = types.SimpleNamespace(scheduler=sched, pipelines=types.SimpleNamespace(stages=[]),
                                snapshot=lambda: types.SimpleNamespace(stats=sched.stats, running=0, queued=0,
                                                                       replans=0, links={}, pipelines=[], stages=[]))
    return sched, Metrics(app)


def sample(m: Metrics, name: str, **labels) -> float:
    return m.registry.get_sample_value(name, labels) or 0.0


def test_every_gap_between_tokens_is_observed_up_to_30_s(clock):
    async def main():
        sched, m = with_metrics()
        req = sched.submit(Job((1, 2, 3), 8)).request
        got = []

        async def read():
            async for u in sched._updates(req):
                got.append(u.token_id)

        reader = asyncio.create_task(read())
        await until(lambda: req.session_id, "opened")
        # (clock when the event comes, tokens): 20 ms, then a 7 s stall, then two tokens of one
        # trip (an accepted candidate: a gap of 0 as the client sees it), then 40 s
        for at, ids in [(1000.0, [4]), (1000.02, [5]), (1007.02, [6]), (1007.52, [7, 8]), (1047.52, [9])]:
            clock.now = at
            tokens(sched, req, ids, finished=ids == [9])
            await until(lambda: len(got) == len(req.received), "delivered")
        await asyncio.wait_for(reader, 5)
        return m

    m = asyncio.run(main())
    name = "logicpipe_inter_token_latency_seconds"
    assert sample(m, f"{name}_count") == 5  # six tokens, five gaps (one mean per request before)
    assert sample(m, f"{name}_sum") == pytest.approx(0.02 + 7.0 + 0.5 + 0.0 + 40.0)
    buckets = {le: sample(m, f"{name}_bucket", le=le) for le in ("0.005", "0.025", "1.0", "5.0", "10.0", "30.0", "+Inf")}
    assert buckets == {"0.005": 1, "0.025": 2, "1.0": 3, "5.0": 3, "10.0": 4, "30.0": 4, "+Inf": 5}
    assert Metrics.BUCKETS_ITL[-1] == 30
    assert sample(m, "logicpipe_requests_total", outcome="completed") == 1
    assert sample(m, "logicpipe_time_to_first_token_seconds_count") == 1


def test_a_resumed_stream_has_no_gap_across_the_tokens_it_skipped(clock):
    async def main():
        sched, m = with_metrics()
        req = sched.submit(Job((1, 2), 8, request_id="r")).request
        await until(lambda: req.session_id, "opened")
        tokens(sched, req, [4, 5, 6])
        clock.now += 50  # the client comes back later for the tokens after its first two
        got = [u.token_id async for u in _take(sched._updates(req, start=2), 1)]
        assert got == [6]
        clock.now += 0.1
        tokens(sched, req, [7], finished=True)
        got += [u.token_id async for u in _take(sched._updates(req, start=3), 1)]
        assert got == [6, 7]
        return m

    m = asyncio.run(main())
    assert sample(m, "logicpipe_inter_token_latency_seconds_count") == 1  # 6 -> 7 only, not 0 -> 6
    assert sample(m, "logicpipe_inter_token_latency_seconds_sum") == pytest.approx(0.1)


async def _take(updates, n: int):
    async for u in updates:
        yield u
        n -= 1
        if not n:
            break


def test_a_client_that_goes_away_is_cancelled_and_an_error_failed(clock):
    async def main():
        sched, m = with_metrics()
        # Ctrl-C: the client's task is cancelled while it waits for the next token
        gone = sched.submit(Job((1, 2), 8)).request
        reader = asyncio.create_task(_drain(sched._updates(gone)))
        await until(lambda: gone.session_id, "opened")
        tokens(sched, gone, [4])
        await asyncio.sleep(0.05)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        # a client that stops reading (its connection closed: the adapter closes the stream)
        closed = sched.submit(Job((1, 2), 8))
        async with closed:
            await until(lambda: closed.request.session_id, "opened")
            tokens(sched, closed.request, [4])
            async for _ in closed:
                break
        # a stage refuses the request: failed
        bad = sched.submit(Job((1, 2), 8)).request
        await until(lambda: bad.session_id, "opened")
        sched.on_event(stage_pb2.Event(session_id=bad.session_id, error=stage_pb2.SessionError(
            code=code_number(grpc.StatusCode.INVALID_ARGUMENT), message="no")))
        with pytest.raises(Exception, match="no"):
            await _drain(sched._updates(bad))
        # no token for TOKEN_TIMEOUT_S: the reader is told so, the request failed
        stuck = sched.submit(Job((1, 2), 8)).request
        await until(lambda: stuck.session_id, "opened")
        clock.now += scheduler_mod.TOKEN_TIMEOUT_S + 1
        with pytest.raises(Unavailable, match="no token"):
            await _drain(sched._updates(stuck))
        return sched, m

    sched, m = asyncio.run(main())
    assert (sched.stats.cancelled, sched.stats.failed, sched.stats.completed) == (2, 2, 0)
    assert sample(m, "logicpipe_requests_total", outcome="cancelled") == 2
    assert sample(m, "logicpipe_requests_total", outcome="failed") == 2


async def _drain(updates) -> None:
    async for _ in updates:
        pass


def test_each_pipeline_is_a_labelled_series():
    from logicpipe.controller.app import PipelineView, StageView

    sched, _ = scheduler(Journal(None, "d"))
    views = [PipelineView(0, "p0", 5, 1, 3, 412.5, True), PipelineView(1, "p1", 6, 2, 0, 0.0, False, "b")]
    stages = [StageView("a", "x:1", 0, 30, "cpu", 1, 0), StageView("b", "x:2", 0, 15, "cpu", 1, 1),
              StageView("c", "x:3", 15, 30, "cpu", 1, 1)]
    app = types.SimpleNamespace(scheduler=sched, pipelines=types.SimpleNamespace(stages=[]),
                                snapshot=lambda: types.SimpleNamespace(stats=sched.stats, running=3, queued=0, replans=2,
                                                                       links={}, pipelines=views, stages=stages))
    m = Metrics(app)
    assert sample(m, "logicpipe_pipeline_running", pipeline="0") == 3
    assert sample(m, "logicpipe_pipeline_predicted_tokens_per_second", pipeline="0") == 412.5
    assert sample(m, "logicpipe_pipeline_serving", pipeline="1") == 0.0
    assert (sample(m, "logicpipe_pipeline_silent", pipeline="0"), sample(m, "logicpipe_pipeline_silent", pipeline="1")) \
        == (0.0, 1.0)
    assert sample(m, "logicpipe_pipeline_stages", pipeline="1") == 2
