"""Unit tier: a node's serving lock (stage_node/net/spare.py). One holder at a time; the holder's pid
in the file; a spare waiting on it holds it the moment the holder lets go (as the kernel does when
the holder's process ends)."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

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


KEEPER = r"""
import asyncio, sys, time
from pathlib import Path
from logicpipe.common import sdnotify
from logicpipe.common.process import configure_logging
from logicpipe.stage_node.net import spare

def child():
    if sys.argv[2] == "fail":
        raise SystemExit(3)  # a mistake found before it started up
    lock = spare.ServingLock(spare.lock_path(Path(sys.argv[1]), "n"))
    asyncio.run(spare.take_node(lock, "n", "127.0.0.1:0", spare=True, prog="test"))
    sdnotify.notify("READY=1", "STATUS=serving")
    time.sleep(600)
    return 0

configure_logging("info")
spare.POLL_S = 0.01
raise SystemExit(spare.keep(child, "n"))
"""


def _children(pid: int) -> set[int]:
    try:
        return {int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}
    except OSError:
        return set()


def _until(what, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not (got := what()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
    return got


def test_a_keeper_forks_the_next_spare_as_its_spare_takes_over_and_stops_them_on_sigterm(tmp_path):
    """--keep-spare (spare.keep): two processes, one serving (the lock's holder) and one waiting; the
    serving one SIGKILLed, the waiting one serves and a new spare is forked; systemd hears READY from
    the serving ones only (a waiting spare is muted) and STOPPING once, from the keeper; SIGTERM ends
    every process and the keeper with status 0."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.settimeout(0.2)
    env = {**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify")}
    keeper = subprocess.Popen([sys.executable, "-c", KEEPER, str(tmp_path), "serve"], env=env,
                              stderr=subprocess.PIPE, text=True)
    try:
        said = []

        def heard() -> list[str]:
            with contextlib.suppress(TimeoutError):
                while True:
                    said.append(sock.recv(4096).decode())
            return said

        lock = ServingLock(lock_path(tmp_path, "n"))
        first = _until(lambda: len(kids := _children(keeper.pid)) == 2 and lock.holder() in kids and kids)
        serving = lock.holder()
        (waiting,) = first - {serving}
        _until(lambda: heard().count("READY=1\nSTATUS=serving") == 1)
        os.kill(serving, signal.SIGKILL)
        _until(lambda: lock.holder() == waiting)  # the spare, not a new fork, serves
        after = _until(lambda: len(kids := _children(keeper.pid)) == 2 and serving not in kids and kids)
        assert waiting in after and len(after - first) == 1  # and one new spare
        _until(lambda: heard().count("READY=1\nSTATUS=serving") == 2)
        keeper.send_signal(signal.SIGTERM)
        assert keeper.wait(10) == 0
        assert not any(Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
                       for pid in after)
        # nothing from a waiting spare (its READY, its status, its watchdog); STOPPING from the keeper alone
        assert heard() == ["READY=1\nSTATUS=serving", "STATUS=taking over node n", "READY=1\nSTATUS=serving",
                           "STOPPING=1"], said
    finally:
        if keeper.poll() is None:
            keeper.kill()
        for pid in _children(keeper.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        keeper.wait(10)
        sock.close()
    err = keeper.stderr.read()
    assert f"its spare {waiting} took over" in err and "SIGTERM, stopping its processes" in err, err


def test_a_keeper_whose_process_fails_before_it_starts_up_ends_with_its_status(tmp_path):
    keeper = subprocess.run([sys.executable, "-c", KEEPER, str(tmp_path), "fail"], capture_output=True, text=True,
                            timeout=60)
    assert keeper.returncode == 3, keeper.stderr
    assert "ended (status 3) before it started up: stopping the node" in keeper.stderr
