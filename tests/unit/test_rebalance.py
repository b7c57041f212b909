"""A pipeline that joins while others serve takes its share of the running requests (issue 34): the
choice (controller.jobs.rebalance) and the controller scheduler's move, over fake pipelines: the
moved requests replay on the new one from their prompt and tokens, the others go on untouched. A
pipeline whose stage went silent gives up every request to the others that answer (evacuate)."""
from __future__ import annotations

import asyncio
import time

import grpc

from logicpipe.controller.jobs.job import Job
from logicpipe.controller.jobs.rebalance import Movable, moves_onto
from logicpipe.controller.jobs.scheduler import Scheduler, SchedulerConfig
from logicpipe.controller.mesh import mirrors as kv_mirrors
from logicpipe.controller.mesh.pipeline import StageHandle
from logicpipe.controller.mesh.pipelines import PipelineSet
from logicpipe.controller.mesh.state import MeshState, Phase
from logicpipe.errors import Unavailable, code_number
from logicpipe.v1 import stage_pb2

from .fake_pipeline import FakePipeline, until


def serving_one(first) -> tuple[PipelineSet, Scheduler]:
    """A scheduler over a set of one (fake) pipeline, KV mirrors off (no stages to tell)."""
    pipelines = PipelineSet(None, lambda ev: None, lambda addr, why: None)
    pipelines.kv_mirror = False
    pipelines.all = [first]
    return pipelines, Scheduler(pipelines, MeshState(Phase.READY), SchedulerConfig(1024, frozenset({0}), 100))


def test_the_busiest_give_their_cheapest_replays_up_to_the_even_share():
    running = [Movable(f"a{i}", "A", 100 + i) for i in range(9)] + [Movable("b0", "B", 5), Movable("b1", "B", 6)]
    # 11 running over 3 pipelines: the newcomer's share is 4; A gives its 3 cheapest (then A 6, B 2, new 3:
    # the 4th from A), B nothing (2 is not 2 more than the newcomer's 3)
    assert moves_onto("N", running, ["A", "B", "N"]) == ["a0", "a1", "a2", "a3"]
    # what may not move stays, and still counts as load (b1 stays: B is not 2 busier than the newcomer's 2)
    assert moves_onto("N", running, ["A", "B", "N"], movable={"a6", "a5", "b1"}) == ["a5", "a6"]
    # nothing to spread: 1 and 1 and 0 (a move would only swap which one is busier)
    assert moves_onto("N", [Movable("x", "A", 1), Movable("y", "B", 1)], ["A", "B", "N"]) == []
    assert moves_onto("N", [], ["A", "N"]) == []


def test_requests_waiting_for_their_replay_move_first_the_longest_wait_first():
    # A holds 6 decoding (cheap replays) and 4 waiting for their replay since 5, 3, 4 and 3 (dear
    # ones); the newcomer's share is 4 (10 over 3): the waiting ones, oldest first (ties in order)
    running = [Movable(f"a{i}", "A", 10 + i) for i in range(6)]
    running += [Movable(f"w{i}", "A", 500, since) for i, since in enumerate((5.0, 3.0, 4.0, 3.0))]
    assert moves_onto("N", running, ["A", "B", "N"]) == ["w1", "w3", "w2", "w0"]
    # those that may not move skipped: then the cheapest decoding ones
    assert moves_onto("N", running, ["A", "B", "N"], movable={"w2", "a3", "a1", "w0"}) == ["w2", "w0", "a1", "a3"]


def test_a_pipeline_that_joins_takes_the_cheapest_replays_and_they_resume_from_their_tokens():
    async def main():
        a, b = FakePipeline(0), FakePipeline(1)
        pipelines = PipelineSet(None, lambda ev: None, lambda addr, why: None)
        pipelines.kv_mirror = False  # (fake stages: nobody to tell)
        pipelines.all = [a]
        sched = Scheduler(pipelines, MeshState(Phase.READY), SchedulerConfig(1024, frozenset({0}), 100))
        reqs = [sched.submit(Job((1, 2, 3 + i), 20, request_id=f"r{i}")).request for i in range(6)]
        await until(lambda: all(r.session_id for r in reqs), "all six opened on the one pipeline", tries=300)
        for i, r in enumerate(reqs):  # r0 has the most tokens (the dearest replay), r5 the fewest
            ids = [10 + i] * (6 - i)
            sched.on_event(stage_pb2.Event(session_id=r.session_id, token=stage_pb2.TokenEvent(token_ids=ids, index=0)))
        old = {r.id: r.session_id for r in reqs}
        assert sched.rebalance(b) == []  # not serving yet: nothing moves
        pipelines.replace([a, b])
        moved = sched.rebalance(b)
        assert sorted(moved) == sorted(old[f"r{i}"] for i in (3, 4, 5)), "the three cheapest replays move"
        assert sorted(a.closed) == sorted(moved)
        await until(lambda: len(b.opened) == 3, "the moved ones opened on the pipeline that joined", tries=300)
        replayed = {tuple(o.prompt_token_ids): o.generated for o in b.opened}
        assert replayed == {(1, 2, 3 + i, *[10 + i] * (6 - i)): 6 - i for i in (3, 4, 5)}, replayed
        assert [r.replays for r in reqs] == [0, 0, 0, 1, 1, 1] and all(reqs[i].catching_up for i in (3, 4, 5))
        assert [r.session_id == old[r.id] for r in reqs] == [True, True, True, False, False, False]
        # a late token of a moved request's old session is not taken; its new session's is
        sched.on_event(stage_pb2.Event(session_id=old["r5"], token=stage_pb2.TokenEvent(token_ids=[99], index=1)))
        sched.on_event(stage_pb2.Event(session_id=reqs[5].session_id, token=stage_pb2.TokenEvent(token_ids=[15], index=1)))
        assert reqs[5].received == [15, 15] and not reqs[5].catching_up
        # balanced now (3 and 3): another call moves nothing
        assert sched.rebalance(b) == []
        await sched.shutdown()

    asyncio.run(main())


def test_a_pipeline_that_joins_takes_requests_still_catching_up_from_the_last_fault():
    async def main():
        a, b = FakePipeline(0), FakePipeline(1)
        pipelines, sched = serving_one(a)
        reqs = [sched.submit(Job((1, 2, 3 + i) + (5,) * (3 - i), 20, request_id=f"r{i}")).request for i in range(4)]
        await until(lambda: all(r.session_id for r in reqs), "all four opened on the one pipeline", tries=300)
        base = time.monotonic()
        for r, heard in zip(reqs, (3.0, 1.0, 4.0, 2.0)):  # every one moved here by the last fault: replaying,
            r.catching_up = True  # no token yet; each last had one at `heard` (r1 longest ago, then r3, r0, r2)
            r.times.heard = base - 10 + heard
        old = {r.id: r.session_id for r in reqs}
        pipelines.replace([a, b])
        moved = sched.rebalance(b)
        # its even share, 2: the longest waits (r1, r3; not by arrival, not the cheapest) start over there
        assert moved == [old["r1"], old["r3"]] and sorted(a.closed) == sorted(moved)
        await until(lambda: len(b.opened) == 2, "the two replays opened on the pipeline that joined", tries=300)
        assert sorted(tuple(o.prompt_token_ids) for o in b.opened) == [(1, 2, 4, 5, 5), (1, 2, 6)]
        assert [r.replays for r in reqs] == [0, 1, 0, 1] and all(r.catching_up for r in reqs)
        # another join moves neither of those two again before they catch up (no restart at every
        # join), though b copies its KV to it (`sources`): from a, the longest wait still catching up
        # from the fault (r0, not the cheaper r2), as the share allows
        c = FakePipeline(2)
        pipelines.replace([a, b, c])
        assert sched.rebalance(c, [b]) == [old["r0"]]
        await sched.shutdown()

    asyncio.run(main())


def test_a_join_takes_the_mirrored_first_then_the_others_up_to_its_share():
    """KV mirrors: a pipeline that joins takes the requests of the pipelines that copy to it first
    (their replays attach their histories), then others' while it holds less than its share (it took
    none before when the requests sat on a pipeline that copies elsewhere)."""
    async def main():
        a, b, c, d = FakePipeline(0), FakePipeline(1), FakePipeline(2), FakePipeline(3)
        pipelines, sched = serving_one(a)
        reqs = [sched.submit(Job((1, 2, 3 + i) + (5,) * i, 20, request_id=f"r{i}")).request for i in range(6)]
        await until(lambda: all(r.session_id for r in reqs), "all six opened on the one pipeline", tries=300)
        for r in reqs:  # each has a token: none catching up
            sched.on_event(stage_pb2.Event(session_id=r.session_id, token=stage_pb2.TokenEvent(token_ids=[7], index=0)))
        on_a = {r.session_id for r in reqs}
        pipelines.replace([a, b, c])
        # c's only source, b, holds nothing: a gives c its share, 2 (its cheapest: r0, r1)
        moved = sched.rebalance(c, [b])
        assert len(moved) == 2 and set(moved) <= on_a, moved
        await until(lambda: len(c.opened) == 2, "two reopened on c", tries=300)
        assert sorted(len(o.prompt_token_ids) for o in c.opened) == [4, 5]  # r0's, r1's (+ their token)
        for r in reqs[:2]:
            sched.on_event(stage_pb2.Event(session_id=r.session_id, token=stage_pb2.TokenEvent(token_ids=[8], index=1)))
        on_a, on_c = {r.session_id for r in reqs[2:]}, {r.session_id for r in reqs[:2]}
        pipelines.replace([a, b, c, d])
        # d's source c (2 requests) first, up to where a move would only swap which one is busier,
        # then a (4) gives one more: share 2
        moved = sched.rebalance(d, [c])
        assert len(moved) == 2 and moved[0] in on_c and moved[1] in on_a, (moved, on_c, on_a)
        await sched.shutdown()

    asyncio.run(main())


def test_a_silent_pipelines_requests_move_to_one_that_answers_catching_up_or_not():
    async def main():
        a, b, c = FakePipeline(0), FakePipeline(1), FakePipeline(2)
        pipelines = PipelineSet(None, lambda ev: None, lambda addr, why: None)
        pipelines.kv_mirror = False  # (no stages to tell: mirrors set by hand below)
        pipelines.all = [a]
        sched = Scheduler(pipelines, MeshState(Phase.READY), SchedulerConfig(1024, frozenset({0}), 100))
        reqs = [sched.submit(Job((1, 2, 3 + i), 20, request_id=f"r{i}")).request for i in range(4)]
        await until(lambda: all(r.session_id for r in reqs), "all four opened on the one pipeline", tries=300)
        for r in reqs[:3]:  # r3 has no token yet since it opened: still catching up from a move, say
            sched.on_event(stage_pb2.Event(session_id=r.session_id, token=stage_pb2.TokenEvent(token_ids=[7], index=0)))
        reqs[3].catching_up = True
        old = {r.id: r.session_id for r in reqs}
        a.silent = StageHandle("127.0.0.1:1", None, None, node_id="s0")
        assert sched.evacuate(a) == []  # no other pipeline: they wait for it
        pipelines.replace([a, b, c])
        c.silent = StageHandle("127.0.0.1:3", None, None, node_id="s2")  # silent too: it takes none
        pipelines.mirrors = {id(a): [c]}  # its KV mirror is silent: the router picks instead
        moved = sched.evacuate(a)
        assert sorted(moved) == sorted(old.values()) and sorted(a.closed) == sorted(moved)
        await until(lambda: len(b.opened) == 4, "every request of the silent pipeline opened on the one that answers",
                    tries=300)
        assert not c.opened and len(a.opened) == 4, "none opened on a silent pipeline"
        replayed = sorted(tuple(o.prompt_token_ids) for o in b.opened)
        assert replayed == [(1, 2, 3, 7), (1, 2, 4, 7), (1, 2, 5, 7), (1, 2, 6)], replayed
        assert [r.replays for r in reqs] == [1, 1, 1, 1] and sched.stats.evacuated == 4
        # a new request goes to an answering pipeline, whatever their loads
        new = sched.submit(Job((9, 9), 20, request_id="new")).request
        await until(lambda: new.session_id, "the new request opened", tries=300)
        assert len(b.opened) == 5 and len(a.opened) == 4 and not c.opened
        # a pipeline that joins takes the silent one's requests first (here: b's, once b is silent)
        c.silent, b.silent = None, StageHandle("127.0.0.1:2", None, None, node_id="s1")
        pipelines.mirrors = {}
        sched.rebalance(c)
        await until(lambda: len(c.opened) == 5, "the silent pipeline's five onto the one that joined", tries=300)
        assert sched.stats.evacuated == 9
        await sched.shutdown()

    asyncio.run(main())


def test_a_feed_that_fails_after_its_request_moved_leaves_the_new_session_alone():
    """A request moved off a silent pipeline while its feed there still waits (the admission waits
    with it, up to OPEN_TIMEOUT_S): when that feed fails, the request opens once on the pipeline that
    answers and goes on there."""

    class Stuck(FakePipeline):
        def __init__(self, index):
            super().__init__(index)
            self.release = asyncio.Event()

        async def send_feed(self, batch) -> None:
            await self.release.wait()
            raise Unavailable("stage 0 took no input in 5 s")

    async def main():
        a, b = Stuck(0), FakePipeline(1)
        pipelines, sched = serving_one(a)
        req = sched.submit(Job((1, 2, 3), 20, request_id="r0")).request
        await until(lambda: req.session_id, "opened on the stuck pipeline", tries=300)
        pipelines.replace([a, b])
        a.silent = StageHandle("127.0.0.1:1", None, None, node_id="s0")
        assert len(sched.evacuate(a)) == 1 and not req.session_id
        a.release.set()  # the old feed fails now
        await until(lambda: len(b.opened) == 1 and req.session_id, "reopened on the pipeline that answers", tries=300)
        moved_to = req.session_id
        await asyncio.sleep(0.1)
        assert req.session_id == moved_to and req.replays == 1 and len(b.opened) == 1 and len(a.opened) == 1
        await sched.shutdown()

    asyncio.run(main())


def test_a_silent_pipelines_requests_spread_its_mirror_taking_the_dearest_up_to_its_share():
    async def main():
        a, b, c = FakePipeline(0), FakePipeline(1), FakePipeline(2)
        pipelines = PipelineSet(None, lambda ev: None, lambda addr, why: None)
        pipelines.all = [a]
        sched = Scheduler(pipelines, MeshState(Phase.READY), SchedulerConfig(1024, frozenset({0}), 100))
        reqs = [sched.submit(Job((1, 2, 3 + i) + (5,) * i, 20, request_id=f"r{i}")).request for i in range(6)]
        await until(lambda: all(r.session_id for r in reqs), "all six opened on the one pipeline", tries=300)
        pipelines.kv_mirror = False
        pipelines.replace([a, b, c])
        pipelines.mirrors = {id(a): [b]}  # b holds a's KV mirror
        a.silent = StageHandle("127.0.0.1:1", None, None, node_id="s0")
        assert len(sched.evacuate(a)) == 6
        await until(lambda: len(b.opened) + len(c.opened) == 6, "the six reopened", tries=300)
        # the even share is 3: the mirror takes the 3 dearest replays (r3, r4, r5: the longest inputs),
        # the router puts the rest where the load is lowest (c)
        assert sorted(len(o.prompt_token_ids) for o in b.opened) == [6, 7, 8], [o.prompt_token_ids for o in b.opened]
        assert sorted(len(o.prompt_token_ids) for o in c.opened) == [3, 4, 5]
        await sched.shutdown()

    asyncio.run(main())


def test_replays_after_a_move_are_ranked_by_how_long_they_waited_for_a_token():
    """Stage 0 prefills a ranked sequence first (OpenSessionRequest.prefill_rank): a request replaying
    after a move is ranked by when it last had a token (the longest wait first, whatever its arrival),
    and opens first; its priority (preemption: arrival order) is unchanged; one not moved has no rank."""
    async def main():
        a, b = FakePipeline(0), FakePipeline(1)
        pipelines, sched = serving_one(a)
        reqs = [sched.submit(Job((1, 2, 3 + i), 20, request_id=f"r{i}")).request for i in range(4)]
        await until(lambda: all(r.session_id for r in reqs), "all four opened on the one pipeline", tries=300)
        assert [o.prefill_rank for o in a.opened] == [0, 0, 0, 0]
        arrival = [o.priority for o in a.opened]
        assert arrival == sorted(arrival) and arrival[0] > 0
        for r in (reqs[2], reqs[0], reqs[1], reqs[3]):  # r2's token first: it then waits longest
            sched.on_event(stage_pb2.Event(session_id=r.session_id, token=stage_pb2.TokenEvent(token_ids=[7], index=0)))
            await asyncio.sleep(0.01)
        pipelines.replace([b])
        sched.detach([a])
        await until(lambda: len(b.opened) == 4, "the four replayed on the other pipeline", tries=300)
        rank = {tuple(o.prompt_token_ids)[2]: o.prefill_rank for o in b.opened}  # (3 + i: request i)
        assert all(rank.values()) and sorted(rank, key=rank.get) == [5, 3, 4, 6], rank  # r2, r0, r1, r3
        assert [tuple(o.prompt_token_ids)[2] for o in b.opened] == [5, 3, 4, 6], "the longest wait opens first"
        assert {tuple(o.prompt_token_ids)[2]: o.priority for o in b.opened} == dict(zip((3, 4, 5, 6), arrival))
        new = sched.submit(Job((9, 9), 20, request_id="new")).request
        await until(lambda: new.session_id, "a new request opened", tries=300)
        assert b.opened[-1].prefill_rank == 0 and b.opened[-1].priority > max(arrival)
        await sched.shutdown()

    asyncio.run(main())


def test_each_pipeline_copies_to_the_next_two_of_its_kind_and_a_move_finds_one_that_serves(monkeypatch):
    """KV mirrors over more than two replicas: each pipeline copies to the next FANOUT (2) of the same
    numerics in the ring, so a request whose first mirror is down or silent when it moves still
    replays where its history was copied; a move picks the least loaded of those that serve."""
    ps = [FakePipeline(i) for i in range(6)]
    kinds = {id(p): k for p, k in zip(ps, ("x", "x", "x", "x", "y", None))}  # (None: not probed yet)
    monkeypatch.setattr(kv_mirrors, "numerics", lambda p: kinds[id(p)])
    m = kv_mirrors.pair(ps)
    assert {ps.index(p): [ps.index(q) for q in m[id(p)]] for p in ps if id(p) in m} == {
        0: [1, 2], 1: [2, 3], 2: [3, 0], 3: [0, 1]}, "the lone y and the unknown copy nowhere"
    three = kv_mirrors.pair(ps[:3])  # every replica holds every other's
    assert [[q.index for q in three[id(p)]] for p in ps[:3]] == [[1, 2], [2, 0], [0, 1]]
    two = kv_mirrors.pair(ps[:2])
    assert [[q.index for q in two[id(p)]] for p in ps[:2]] == [[1], [0]]
    assert kv_mirrors.pair(ps[:2], fanout=1) == two and kv_mirrors.pair(ps[:1]) == {}

    a, b, c, d = ps[:4]
    pipelines = PipelineSet(None, lambda ev: None, lambda addr, why: None)
    pipelines.kv_mirror = False
    pipelines.replace([a, b, c, d])
    pipelines.mirrors = m
    assert pipelines.mirrors_of(a) == [b, c] and pipelines.mirrors_of(None) == []
    assert pipelines.mirror_of(a) is b
    b.silent = StageHandle("127.0.0.1:2", None, None, node_id="s1")
    assert pipelines.mirror_of(a) is c, "the first mirror silent: the second"
    b.silent, c.down = None, [("s2", "gone")]
    assert pipelines.mirror_of(a) is b and pipelines.mirror_of(b) is d, "a mirror that is down is passed over"
    c.down = []
    assert pipelines.mirror_of(a, lambda q: {id(b): 3, id(c): 1}[id(q)]) is c, "the least loaded of them"
    b.silent, c.retired = StageHandle("127.0.0.1:2", None, None, node_id="s1"), True
    assert pipelines.mirror_of(a) is None, "none serves: the router picks"


def test_a_silent_pipelines_requests_spread_over_its_two_mirrors_and_replays_on_a_replaced_one_too():
    async def main():
        a, b, c = FakePipeline(0), FakePipeline(1), FakePipeline(2)
        pipelines, sched = serving_one(a)
        reqs = [sched.submit(Job((1, 2, 3 + i) + (5,) * i, 20, request_id=f"r{i}")).request for i in range(6)]
        await until(lambda: all(r.session_id for r in reqs), "all six opened on the one pipeline", tries=300)
        pipelines.replace([a, b, c])
        pipelines.mirrors = {id(a): [b, c], id(b): [c, a], id(c): [a, b]}
        a.silent = StageHandle("127.0.0.1:1", None, None, node_id="s0")
        assert len(sched.evacuate(a)) == 6
        await until(lambda: len(b.opened) + len(c.opened) == 6, "the six reopened", tries=300)
        # both hold a's KV: each takes its even share, 3, the dearest alternating (b first: next in the ring)
        assert sorted(len(o.prompt_token_ids) for o in b.opened) == [4, 6, 8], [o.prompt_token_ids for o in b.opened]
        assert sorted(len(o.prompt_token_ids) for o in c.opened) == [3, 5, 7]
        # a plan replaces b (its stage lost): its three replay where b's KV was copied (c, and d, which
        # joined empty), the least loaded of those (c holds 3: all three onto d), not on a (answering
        # again and empty too, but it holds no copy of b's; the router would spread them over a and d)
        d = FakePipeline(3)
        pipelines.replace([a, b, c, d])
        pipelines.mirrors = {id(b): [c, d]}
        a.silent, b.retired = None, True
        sched.detach([b])
        await until(lambda: len(c.opened) + len(d.opened) == 6, "b's three reopened", tries=300)
        assert len(d.opened) == 3 and len(c.opened) == 3 and len(a.opened) == 6
        # a fault on d: its three sequences fail one after another, each replays where d's KV was copied,
        # the less loaded of a and e (both empty), counting those queued there before it: a, e, a
        e = FakePipeline(4)
        pipelines.replace([a, c, d, e])
        pipelines.mirrors = {id(d): [a, e]}
        on_d = [sid for sid, p in sched.opened.items() if p is d]
        gone = stage_pb2.SessionError(code=code_number(grpc.StatusCode.UNAVAILABLE), message="stage gone")
        for sid in on_d:
            sched.on_event(stage_pb2.Event(session_id=sid, error=gone))
        await until(lambda: len(a.opened) + len(e.opened) == 9, "d's three reopened", tries=300)
        assert len(on_d) == 3 and len(a.opened) == 8 and len(e.opened) == 1 and len(c.opened) == 3
        await sched.shutdown()

    asyncio.run(main())
