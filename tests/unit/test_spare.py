"""Unit tier: a node's serving lock (stage_node/net/spare.py). One holder at a time; the holder's pid
in the file; a spare waiting on it holds it the moment the holder lets go (as the kernel does when
the holder's process ends)."""
from __future__ import annotations

import asyncio
import os
import threading

from logicpipe.stage_node.net import spare
from logicpipe.stage_node.net.spare import ServingLock, lock_path


def test_one_holder_at_a_time_and_a_waiting_spare_takes_over(tmp_path, monkeypatch):
    monkeypatch.setattr(spare, "POLL_S", 0.01)
    path = lock_path(tmp_path, "node a/b")
    assert path.parent == tmp_path and path.name == "serving-node_a_b.lock"
    first, second = ServingLock(path), ServingLock(path)
    assert first.take() and first.held and first.take()  # (taking it again is a no-op)
    assert not second.take() and not second.held
    assert second.holder() == os.getpid()

    async def spare_waits() -> float:
        waiting = asyncio.create_task(second.wait())
        await asyncio.sleep(0.1)
        assert not waiting.done()  # held: the spare waits
        first.release()
        return await asyncio.wait_for(waiting, 5)

    waited = asyncio.run(spare_waits())
    assert second.held and waited >= 0.1
    assert not ServingLock(path).take()  # the spare holds it now
    second.release()
    last = ServingLock(path)
    assert last.take()
    last.release()


def test_wait_free_returns_once_the_address_is_free(monkeypatch):
    answers = iter([False, False, True])
    monkeypatch.setattr(spare, "is_free", lambda _: next(answers))
    asyncio.run(spare.wait_free("127.0.0.1:1", timeout_s=5))
    monkeypatch.setattr(spare, "is_free", lambda _: False)
    asyncio.run(spare.wait_free("127.0.0.1:1", timeout_s=0.05))  # gives up: the bind then says why


def test_serving_priority_moves_every_idle_thread_back_to_the_normal_policy():
    """A spare starts up under SCHED_IDLE (stage_node/main.py); serving_priority puts every thread of the
    process, those started during the start-up included, back on SCHED_OTHER without privileges."""
    ready, done = threading.Event(), threading.Event()
    seen: dict[str, int] = {}

    def worker() -> None:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # this thread only
        seen["before"] = os.sched_getscheduler(0)
        ready.set()
        done.wait(10)
        seen["after"] = os.sched_getscheduler(0)

    t = threading.Thread(target=worker)
    t.start()
    assert ready.wait(10)
    assert spare.serving_priority() == 1  # the worker; the main thread was on SCHED_OTHER already
    done.set()
    t.join(10)
    assert seen == {"before": os.SCHED_IDLE, "after": os.SCHED_OTHER}
    assert spare.serving_priority() == 0
