"""When a better plan (a node back) replaces the one in force: not within HOLD_S of its install, of
the last fault, or of the moment its moved requests caught up, nor while requests it took over are
still replaying (each move replays them from scratch: in a storm, a move between two faults would
throw that work away), and at most MAX_HOLD_S after its install."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from logicpipe.controller.mesh import planning, replanning
from logicpipe.controller.mesh.replanning import Replanner

FULL, CURRENT = "3 stages", "2 stages"


class Sched:
    def __init__(self, running: int = 12, replaying: int = 0, caught_up_at: float = 0.0):
        self.running, self._replaying, self.caught_up_at = running, replaying, caught_up_at

    def catching_up(self) -> int:
        return self._replaying


@pytest.fixture
def replanner(monkeypatch):
    monkeypatch.setattr(planning, "mesh_for", lambda *a, **k: FULL)
    monkeypatch.setattr(planning, "evaluate", lambda *a, **k: CURRENT)
    monkeypatch.setattr(planning, "same_pipelines", lambda a, b: False)
    monkeypatch.setattr(planning, "extends", lambda a, b: False)
    monkeypatch.setattr(planning, "better", lambda a, b, o: a == FULL)
    monkeypatch.setattr(planning, "describe", str)
    r = Replanner.__new__(Replanner)
    r.app = SimpleNamespace(options=SimpleNamespace(replicas=0), spec=None, scheduler=Sched(),
                            members=SimpleNamespace(last_fault=lambda: 0.0))
    r.workload, r.profiles, r.plan, r._now, r._recheck, r._repaired = None, [], object(), False, None, False
    r.asked_later: list[float] = []
    r.later = lambda delay, why: r.asked_later.append(delay)
    kept = SimpleNamespace(plan=SimpleNamespace(stages=()))
    r.choose = lambda: r._choose([kept], [], "node back")
    return r


def test_a_better_plan_waits_while_moved_requests_replay(replanner):
    r = replanner
    now = time.monotonic()
    r._installed_at = now - 2 * replanning.HOLD_S  # long enough ago
    r.app.scheduler = Sched(replaying=3)
    assert r.choose() is None and r.asked_later == [1.0]  # asks again soon
    r.app.scheduler = Sched(replaying=0, caught_up_at=now - 1.0)  # they just caught up: HOLD_S from then
    assert r.choose() is None and replanning.HOLD_S - 1.5 < r.asked_later[-1] <= replanning.HOLD_S - 1.0
    r.app.scheduler = Sched(replaying=0, caught_up_at=now - replanning.HOLD_S - 1)
    assert r.choose() == FULL


def test_the_wait_for_replays_is_bounded(replanner):
    r = replanner
    r._installed_at = time.monotonic() - replanning.MAX_HOLD_S - 1
    r.app.scheduler = Sched(replaying=3)  # replaying for longer than MAX_HOLD_S: it moves them anyway
    assert r.choose() == FULL


def test_with_nothing_running_it_moves_at_once(replanner):
    r = replanner
    r._installed_at = time.monotonic()
    r.app.scheduler = Sched(running=0, replaying=0)
    assert r.choose() == FULL


def test_a_repair_in_force_gives_way_to_the_planner_s_plan_even_when_it_is_no_faster(replanner, monkeypatch):
    """A repair (survivors keep their ranges) is a stop-gap: at the next re-plan, say the lost node
    back, the planner's plan replaces it though it predicts no more tokens/s (one request at a time),
    after the same wait as a better plan; a plan in force that is not a repair stays."""
    r = replanner
    monkeypatch.setattr(planning, "better", lambda a, b, o: False)  # neither is better by --replan-gain
    r._installed_at = time.monotonic() - 2 * replanning.HOLD_S
    r.app.scheduler = Sched(running=0)
    r._repaired = False
    assert r.choose() is None
    r._repaired = True
    r.app.scheduler = Sched(replaying=2)  # it waits while moved requests replay, and still knows it then
    assert r.choose() is None and r.asked_later == [1.0] and r._repaired
    r.app.scheduler = Sched(running=0)
    assert r.choose() == FULL and not r._repaired
    monkeypatch.setattr(planning, "better", lambda a, b, o: a == CURRENT)  # the repair is the better one
    r._repaired = True
    assert r.choose() is None
