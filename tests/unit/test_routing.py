"""The controller's router over its pipelines (replicas): the least loaded by predicted speed, the
pipeline that holds a request's prefix when it is not much busier, never one that cannot serve, nor
one with a silent stage while another answers; a feed to a stage that never takes its stream fails
in bounded time."""
from __future__ import annotations

import asyncio
import socket
import time
from types import SimpleNamespace

import grpc
import pytest

from logicpipe.controller.mesh import pipeline as pipeline_mod
from logicpipe.controller.mesh.pipeline import Pipeline, StageHandle
from logicpipe.errors import Unavailable, code_number
from logicpipe.v1 import stage_pb2, stage_pb2_grpc
from logicpipe.controller.mesh.pipelines import PipelineSet, prefix_keys


def pipelines(*speeds: float) -> PipelineSet:
    ps = PipelineSet(None, lambda ev: None, lambda a, r: None)
    made = []
    for i, speed in enumerate(speeds):
        p = ps.new()
        p.stages = [StageHandle(f"127.0.0.1:{9000 + i}", None, None, node_id=f"n{i}")]
        p.plan = SimpleNamespace(tokens_per_s=speed)
        made.append(p)
    ps.replace(made)
    return ps


def test_the_least_loaded_relative_to_its_predicted_speed():
    ps = pipelines(100.0, 300.0)
    a, b = ps.all
    load = {id(a): 0, id(b): 0}
    counts = {id(a): 0, id(b): 0}
    for i in range(8):
        p = ps.route([i, 1000 + i], 10, lambda p: load[id(p)])
        load[id(p)] += 1
        counts[id(p)] += 1
    assert counts[id(b)] == 6 and counts[id(a)] == 2  # 3x the speed, 3x the requests


def test_a_prefix_goes_back_to_the_pipeline_that_holds_it_unless_that_one_is_much_busier():
    ps = pipelines(100.0, 100.0)
    a, b = ps.all
    prompt = list(range(300))
    ps.remember(prompt, b)
    load = {id(a): 0, id(b): 1}
    assert ps.route(prompt + [7], 10, lambda p: load[id(p)]) is b and ps.routed_by_prefix == 1
    # a replay (tokens of its own past the shared prefix) goes to the least loaded
    assert ps.route(prompt + [7], 10, lambda p: load[id(p)], affinity=False) is a and ps.routed_by_prefix == 1
    load[id(b)] = 6
    assert ps.route(prompt + [7], 10, lambda p: load[id(p)]) is a  # too busy: the cache is not worth the wait
    assert ps.route(list(range(1000, 1300)), 10, lambda p: 0) is a  # another prefix: the least loaded


def test_only_serving_pipelines_that_hold_the_request_are_chosen():
    ps = pipelines(100.0, 100.0, 100.0)
    a, b, c = ps.all
    a.retired = True
    b.stages[0].lost, b.stages[0].down_reason = True, "its event stream ended"
    assert ps.serving() == [c] and ps.route([1, 2], 10, lambda p: 0) is c
    c.why_down = lambda address: "drained"  # membership's word: that node is out
    assert ps.serving() == [] and c.down == [(c.stages[0].address, "drained")]
    c.why_down = lambda address: ""
    assert ps.route([1, 2], 10, lambda p: 0, exclude=frozenset({id(c)})) is None
    c.stages[0].status = SimpleNamespace(kv_blocks_total=4, block_size=16)  # 64 positions in all
    assert ps.route([1, 2], 65, lambda p: 0) is None and ps.route([1, 2], 64, lambda p: 0) is c
    ps.replace([c])
    assert c.index == 0 and ps.stages == c.stages


def test_prefix_keys_are_whole_lengths_of_the_prompt_and_leave_the_last_token_out():
    assert prefix_keys(list(range(16))) == []
    assert len(prefix_keys(list(range(17)))) == 1
    assert len(prefix_keys(list(range(300)))) == 3
    assert prefix_keys(list(range(17))) == prefix_keys(list(range(16)) + [99])


def test_a_new_pipeline_shares_the_controllers_identity():
    ps = pipelines(1.0)
    ps.epoch = 7
    ps.revoked = ["x"]
    p = ps.new()
    assert isinstance(p, Pipeline) and p.owner == ps.owner and p.metadata == ps.metadata
    assert p.epoch == 7 and p.revoked == ["x"]
    assert ps.next_generation() < ps.next_generation()


def test_a_pipeline_with_a_silent_stage_takes_no_request_while_another_answers():
    ps = pipelines(100.0, 100.0)
    a, b = ps.all
    load = {id(a): 0, id(b): 3}
    assert ps.route([1, 2], 10, lambda p: load[id(p)]) is a  # the least loaded
    h = a.stages[0]
    h.misses, h.answered, a.heard = 1, time.monotonic() - 5, time.monotonic() - 5  # SIGSTOPped, say
    assert a.silent_stage() is h and b.silent_stage() is None
    assert ps.route([1, 2], 10, lambda p: load[id(p)]) is b
    a.heard = time.monotonic()  # its tokens still arrive: only its probe was slow, it is not silent
    assert a.silent_stage() is None and ps.route([1, 2], 10, lambda p: load[id(p)]) is a
    a.heard = time.monotonic() - 5
    h.misses = 0  # it answers again
    assert a.silent_stage() is None
    h.misses = 1
    c = b.stages[0]
    c.misses, c.answered, b.heard = 1, time.monotonic() - 5, time.monotonic() - 5
    assert ps.route([1, 2], 10, lambda p: load[id(p)]) is a  # every one silent: the least loaded still


def test_a_feed_to_a_stage_that_never_takes_its_stream_fails_in_bounded_time(monkeypatch):
    """A stage that accepted the connection and says nothing (its process stopped, say): grpc's
    write waits for the stream's start with no deadline; the feed is refused within OPEN_TIMEOUT_S
    (it held up every admission for good before)."""
    monkeypatch.setattr(pipeline_mod, "OPEN_TIMEOUT_S", 0.5)

    async def main():
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            address = f"127.0.0.1:{listener.getsockname()[1]}"
            channel = grpc.aio.insecure_channel(address)
            p = Pipeline(None, lambda ev: None, lambda a, r: None)
            p.stages = [StageHandle(address, channel, stage_pb2_grpc.StageNodeStub(channel), node_id="n0")]
            t0 = time.monotonic()
            with pytest.raises(Unavailable, match="took no input in"):
                await p.send_feed(stage_pb2.StepBatch(seqs=[stage_pb2.SeqStep(session_id="s", num_tokens=1,
                                                                               token_ids=[1])]))
            assert time.monotonic() - t0 < 5
            assert p._prompt_call is None  # the next feed starts a new stream
            await channel.close()

    asyncio.run(main())


class _Stub:
    """A stage's stub for the prompt stream tests: each Stream() a new `call()` (kept in .calls), and
    Events() an `events()`."""

    def __init__(self, call, events=None):
        self.calls, self._call, self._events = [], call, events

    def Stream(self):
        self.calls.append(self._call())
        return self.calls[-1]

    def Events(self, request):
        return self._events()


def _feed(sid: str) -> stage_pb2.StepBatch:
    return stage_pb2.StepBatch(seqs=[stage_pb2.SeqStep(session_id=sid, num_tokens=1, token_ids=[1])])


def test_feeds_dropped_with_a_prompt_stream_that_took_no_input_are_reported(monkeypatch):
    """A feed that times out drops the shared prompt stream to stage 0: the sessions whose last feed
    went on it and of which nothing was heard since get an UNAVAILABLE error event (their requests
    replay at once; they waited for the 120 s token watchdog before); a session heard of since, or
    closed, or the one whose own write failed (its caller is told), gets none."""
    monkeypatch.setattr(pipeline_mod, "OPEN_TIMEOUT_S", 0.3)

    class Call:  # a stream that takes three writes, then none (its stage stopped taking input)
        def __init__(self):
            self.writes, self.ended = 0, asyncio.Event()

        async def write(self, batch):
            self.writes += 1
            if self.writes > 3:
                await asyncio.sleep(3600)

        def cancel(self):
            self.ended.set()

        def __aiter__(self):
            return self

        async def __anext__(self):
            await self.ended.wait()
            raise StopAsyncIteration

    class Events:  # the stage's event stream: a token of "heard", then nothing
        async def initial_metadata(self):
            return ()

        def __aiter__(self):
            return self.batches()

        async def batches(self):
            yield stage_pb2.EventBatch(events=[stage_pb2.Event(session_id="heard", token=stage_pb2.TokenEvent(
                token_ids=[5], index=0))])
            await asyncio.sleep(3600)

        def cancel(self):
            pass

    async def main():
        events = []
        p = Pipeline(None, events.append, lambda a, r: None)
        stub = _Stub(Call, Events)
        p.stages = [StageHandle("127.0.0.1:1", None, stub, node_id="n0")]
        for sid in ("heard", "closed", "lost"):
            await p.send_feed(_feed(sid))
        watch = asyncio.create_task(p._watch_events(p.stages[0], asyncio.get_running_loop().create_future()))
        for _ in range(100):
            if events:
                break
            await asyncio.sleep(0.01)
        assert [e.session_id for e in events] == ["heard"]  # its token: its input arrived
        await p.close_session_many(["closed"], [])
        with pytest.raises(Unavailable, match="took no input in"):
            await p.send_feed(_feed("own"))
        errors = [e for e in events if e.HasField("error")]
        assert [(e.session_id, e.error.code) for e in errors] == [("lost", code_number(grpc.StatusCode.UNAVAILABLE))]
        assert "dropped with the prompt stream" in errors[0].error.message and errors[0].error.node_id == "n0"
        watch.cancel()
        await p.send_feed(_feed("next"))  # a new stream
        assert len(stub.calls) == 2 and p._unheard == {"next": stub.calls[1]}

    asyncio.run(main())


def test_feeds_on_a_prompt_stream_that_ended_are_reported_unless_the_stage_was_lost(monkeypatch):
    """The prompt stream to a stage 0 that still serves ends by an error (its events go on): after
    ENDED_FEED_GRACE_S, each session whose feed went on it and of which nothing was heard since gets
    an UNAVAILABLE error event (it replays; it waited for the 120 s token watchdog before), the one
    heard of gets none; when the stage was lost within the grace (its re-plan moves its requests), none."""
    monkeypatch.setattr(pipeline_mod, "ENDED_FEED_GRACE_S", 0.2)

    class Call:  # a stream that takes every write, then ends with UNAVAILABLE when told
        def __init__(self):
            self.end = asyncio.Event()

        async def write(self, batch):
            pass

        def cancel(self):
            pass

        def __aiter__(self):
            return self

        async def __anext__(self):
            await self.end.wait()
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details="Socket closed")

    async def one(lose_stage: bool) -> list:
        events = []
        p = Pipeline(None, events.append, lambda a, r: None)
        stub = _Stub(Call)
        p.stages = [StageHandle("127.0.0.1:1", None, stub, node_id="n0")]
        for sid in ("heard", "lost"):
            await p.send_feed(_feed(sid))
        p._unheard.pop("heard")  # (what a token event of it does)
        stub.calls[0].end.set()
        await asyncio.sleep(0.05)
        assert p._prompt_call is None  # the next feed starts a new stream
        assert not events  # (the grace first)
        if lose_stage:
            p.stages[0].lost = True
        await asyncio.sleep(0.4)
        return [(e.session_id, e.error.code, e.error.message) for e in events]

    errors = asyncio.run(one(False))
    assert [e[:2] for e in errors] == [("lost", code_number(grpc.StatusCode.UNAVAILABLE))]
    assert "prompt stream to stage 0 at 127.0.0.1:1, which ended: UNAVAILABLE Socket closed" in errors[0][2]
    assert asyncio.run(one(True)) == []


def test_a_failing_report_of_silence_does_not_end_the_health_probes(monkeypatch):
    """The health loop reports a silent stage again each check; the owner's failure is logged and
    the probes go on (an exception there used to end the loop for good)."""
    monkeypatch.setattr(pipeline_mod, "PROBE_INTERVAL_S", 0.05)
    monkeypatch.setattr(pipeline_mod, "PROBE_TIMEOUT_S", 0.3)
    monkeypatch.setattr(pipeline_mod, "SILENT_S", 0.1)
    monkeypatch.setattr(pipeline_mod, "SILENT_PROBE_S", 0.1)
    monkeypatch.setattr(pipeline_mod, "SILENT_TICK_S", 0.05)

    class Stopped:  # a stage process that takes the call and never answers
        async def Status(self, request, timeout):
            await asyncio.sleep(timeout)
            raise asyncio.TimeoutError()

    async def main():
        calls = []

        def on_silent(p):
            calls.append(p)
            raise RuntimeError("the owner failed")

        p = Pipeline(None, lambda ev: None, lambda a, r: None)
        p.stages = [StageHandle("127.0.0.1:1", None, Stopped(), node_id="n0")]
        p.heard = time.monotonic() - 5
        p.on_silent = on_silent
        task = asyncio.create_task(p._watch_health())
        await asyncio.sleep(1.0)
        assert not task.done() and len(calls) >= 3, (task, calls)
        task.cancel()

    asyncio.run(main())


def test_the_silent_stage_named_is_the_one_that_does_not_answer(monkeypatch):
    """Two stages, the first answering at once and the second stopped: while the round waits, the
    second is the silent one (each stage's answer counts as it comes, not at the round's end)."""
    monkeypatch.setattr(pipeline_mod, "PROBE_TIMEOUT_S", 2.0)
    monkeypatch.setattr(pipeline_mod, "SILENT_S", 0.2)
    monkeypatch.setattr(pipeline_mod, "SILENT_PROBE_S", 0.2)
    monkeypatch.setattr(pipeline_mod, "SILENT_TICK_S", 0.05)

    class Answers:
        async def Status(self, request, timeout):
            return stage_pb2.StatusReply()

    class Stopped:
        async def Status(self, request, timeout):
            await asyncio.sleep(timeout)
            raise asyncio.TimeoutError()

    async def main():
        named = []
        p = Pipeline(None, lambda ev: None, lambda a, r: None)
        p.stages = [StageHandle("127.0.0.1:1", None, Answers(), node_id="s0"),
                    StageHandle("127.0.0.1:2", None, Stopped(), node_id="s1")]
        p.heard = time.monotonic() - 5
        for h in p.stages:
            h.answered, h.asked = time.monotonic() - 5, time.monotonic()
        p.on_silent = lambda q: named.append(q.silent_stage().node_id)
        round_ = asyncio.create_task(p._probe_round(p.stages))
        await asyncio.sleep(0.6)
        round_.cancel()
        assert named and set(named) == {"s1"}, named

    asyncio.run(main())
