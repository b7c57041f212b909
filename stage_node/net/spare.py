"""One process serves a node; a spare process waits, started up, to take over (`logicpipe-stage --spare`).

The serving process holds an exclusive flock(2) on `<state dir>/serving-<node>.lock` from the moment
it commits to serving until it ends; the kernel drops the lock when the process ends, however it
ends (SIGKILL, a crash, the OOM killer, a SIGTERM's orderly leave). A spare is a second process of
the same node (the same --state-dir, --listen and flags, plus --spare) that has done the slow part
of a start (the interpreter, torch's import, the kernel timing, the profile): 4 to 7 s on a small
CPU, more on a board; its imports, most of it, at idle priority (SCHED_IDLE: only CPU time nothing
else wants; stage_node/main.py), the rest at the normal one, measurements included. It polls the
lock every `POLL_S`; once it holds it, it reads the node's fence and KV disk store as the ended
process left them, binds --listen and serves, a fraction of a second after the end. Whoever starts
the next process (systemd, a supervisor) makes it the new spare.

A process without --spare that finds the lock held is refused at once (another process serves this
node from this state directory), before it binds anything.

`logicpipe-stage --keep-spare` does the same in one process tree (`keep`): the process started (systemd's
main process) imports, then forks the node's processes instead of serving: one serves, one is its spare,
and each time one ends it forks the next spare. A fork of a process whose imports are done costs
milliseconds where a spare's own start-up costs 4 to 7 s of CPU; in a storm of faults on 2 cores those
start-ups were most of the CPU, and a spare still starting when its node's process ended left the node
down. The keeper does nothing else: no event loop, no thread of its own, no torch operation (a fork
after one would copy a thread team that is not there).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import logging
import os
import signal
import time
import traceback
from pathlib import Path
from typing import Callable

from logicpipe.common import sdnotify
from logicpipe.common.process import check_free, end_now, exit_status, is_free
from logicpipe.stage_node.net.identity import file_label

log = logging.getLogger(__name__)

POLL_S = 0.05  # how often a spare tries the lock: its share of a takeover's time
KEEP_LIMIT = (20, 30.0)  # a keeper stops when this many of its processes ended within this many seconds
KEPT: dict = {"ready_fd": None}  # in a process a keeper forked: the pipe it tells the keeper it started up on


def lock_path(state_dir: Path, node_id: str) -> Path:
    """The serving lock of `node_id` under `state_dir`."""
    return state_dir / f"serving-{file_label(node_id)}.lock"


class ServingLock:
    """The flock that says which process serves a node; the holder's pid written in the file."""

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def take(self) -> bool:
        """Take the lock if no live process holds it (never waits); True once this process holds it.
        The file is not inheritable (PEP 446): a child the holder starts does not keep it held."""
        if self._fd is not None:
            return True
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except BaseException:
            os.close(fd)
            raise
        mine = f"{os.getpid()}\n".encode()  # written over the last holder's, then cut: a reader's first line is
        os.pwrite(fd, mine, 0)               # always a whole pid (theirs or ours), never an empty file
        os.ftruncate(fd, len(mine))
        self._fd = fd
        return True

    def holder(self) -> int | None:
        """The pid the last holder wrote (it may have ended since), or None."""
        try:
            text = self.path.read_text().partition("\n")[0].strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None

    async def wait(self) -> float:
        """Take the lock as soon as its holder ends; the seconds waited."""
        t0 = time.monotonic()
        while not self.take():
            await asyncio.sleep(POLL_S)
        return time.monotonic() - t0

    def release(self) -> None:
        """Let the lock go (the process ending does the same)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


async def wait_free(address: str, timeout_s: float = 5.0) -> None:
    """Wait until `address` can be listened on (the ended holder's listening socket gone), at most
    `timeout_s`: the lock is dropped as the holder's files close, its socket with them, but not in one step."""
    deadline = time.monotonic() + timeout_s
    while not is_free(address) and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)


def serving_priority() -> int:
    """Every thread of this process back on the normal policy (SCHED_OTHER) after a spare's imports at idle
    priority (stage_node/main.py): allowed without privileges at the thread's own nice value, as
    sched(7) says. The threads it starts later inherit it. Returns how many threads it moved."""
    if not hasattr(os, "SCHED_IDLE"):
        return 0
    moved = 0
    for tid in (int(t) for t in os.listdir("/proc/self/task")):
        try:
            if os.sched_getscheduler(tid) == os.SCHED_IDLE:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                moved += 1
        except ProcessLookupError:  # (a thread that ended meanwhile)
            continue
    return moved


async def take_node(serving: ServingLock, node_id: str, listen: str, *, spare: bool, prog: str) -> None:
    """Hold `node_id`'s serving lock before serving on `listen`: at once, or (`spare`) once the process
    serving the node has ended, telling systemd meanwhile that this one is its spare. SystemExit for a
    node another process serves when this one is not a spare."""
    kept = started_up(serving.path)
    if serving.take():
        now_serving()
        if kept:
            log.info("node %s: this process (pid %d) serves it; its keeper forks its spare", node_id, os.getpid())
        elif spare:
            log.info("spare for node %s: no process serves it, so this one does", node_id)
        return
    holder = serving.holder()
    if not spare:
        raise SystemExit(f"node {node_id} is served by another process (pid {holder}) from {serving.path.parent}: "
                         "add --spare to wait as its spare, or give this one its own --state-dir")
    log.info("spare for node %s, served by pid %s: started up, waiting to take over", node_id, holder)
    watchdog = None
    if kept:  # systemd hears from the serving process only (the keeper's unit has one READY, one watchdog)
        sdnotify.MUTED.update(("READY", "STATUS", "WATCHDOG"))
    else:
        sdnotify.notify("READY=1", f"STATUS=spare for node {node_id} (served by pid {holder})")
        watchdog = asyncio.create_task(sdnotify.watchdog(lambda: True), name="systemd-watchdog")
    try:
        waited = await serving.wait()
    finally:
        if watchdog is not None:
            watchdog.cancel()
        if kept:
            sdnotify.MUTED.difference_update(("READY", "STATUS", "WATCHDOG"))
    now_serving()
    t0 = time.monotonic()
    await wait_free(listen)
    log.info("spare for node %s: its serving process (pid %s) ended; taking over (waited %.1f s, its port %.2f s)",
             node_id, holder, waited, time.monotonic() - t0)
    sdnotify.notify(f"STATUS=taking over node {node_id}")
    check_free(listen, "--listen", prog)


def started_up(lock: Path) -> bool:
    """In a process a keeper forked: tell it this one started up (its flags checked, its profile
    measured; it serves or waits as the spare now) and where the node's serving lock is; True.
    Elsewhere False."""
    fd = KEPT["ready_fd"]
    if fd is None:
        return False
    with contextlib.suppress(OSError):
        os.write(fd, b"r" + os.fsencode(lock) + b"\n")
    return True


def now_serving() -> None:
    """In a process a keeper forked: tell it this one serves the node now (when it ends, the keeper
    waits for the spare to take over before it forks the next)."""
    fd, KEPT["ready_fd"] = KEPT["ready_fd"], None
    if fd is not None:
        with contextlib.suppress(OSError):
            os.write(fd, b"s")
            os.close(fd)


def keep(child: Callable[[], int], node: str, limit: tuple[int, float] = KEEP_LIMIT) -> int:
    """`--keep-spare`: fork the node's processes and keep two: the one that serves and its spare (each runs
    `child()`, which serves when it takes the serving lock and waits as the spare otherwise); fork the
    next one each time one ends. SIGTERM or SIGINT: passed on to them; the keeper ends when they have
    (systemd's stop: the serving one leaves the mesh as it does alone, STOPPING=1 from the keeper only).
    A process that ended before it started up (a mistake in the flags, a model that does not load)
    stops the node with its status, as would `limit`[0] ended within `limit`[1] s. Returns the exit status."""
    kids: dict[int, tuple[float, int]] = {}  # pid -> (started, read end of its started-up pipe)
    stopping: list[int] = []
    code = 0

    def stop(signum: int, _frame=None) -> None:
        if not stopping:
            stopping.append(signum)
            sdnotify.notify("STOPPING=1")
            log.info("keeper of node %s: %s, stopping its processes %s", node, signal.Signals(signum).name,
                     ", ".join(map(str, kids)))
        for pid in list(kids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    heard: dict[int, bytes] = {}  # what a process said on its pipe before it ended, read ahead (the first one)

    def fork() -> int:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            _child(child, r, w, [fd for _, fd in kids.values()])
        os.close(w)
        kids[pid] = (time.monotonic(), r)
        return pid

    before = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    ended: collections.deque[float] = collections.deque()
    try:
        first = fork()
        # the spare only once the first has started up: on a first boot the node's id, its join (a token
        # is good once) and its profile's measurement are made by one process, not two at once
        heard[first] = _started_up(kids[first][1])
        if heard[first] and not stopping:
            fork()
            log.info("keeper of node %s (pid %d): forked %s, the serving process and its spare", node, os.getpid(),
                     " and ".join(map(str, kids)))
        while kids:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            if pid not in kids:
                continue
            born, r = kids.pop(pid)
            try:
                said = heard.pop(pid, b"") + os.read(r, 4096)
            except OSError:
                said = b""
            os.close(r)
            up = said.startswith(b"r")
            lock, _, served = said[1:].partition(b"\n")
            rc = os.waitstatus_to_exitcode(status)
            if stopping:
                code = code or max(rc, 0)
                continue
            now = time.monotonic()
            ended.append(now)
            while ended and now - ended[0] > limit[1]:
                ended.popleft()
            how = f"status {rc}" if rc >= 0 else signal.Signals(-rc).name
            if not up:
                log.error("keeper of node %s: process %d ended (%s) before it started up: stopping the node", node,
                          pid, how)
                code = rc if rc > 0 else 1
                stop(signal.SIGTERM)
            elif len(ended) >= limit[0]:
                log.error("keeper of node %s: %d of its processes ended within %.0f s: stopping the node", node,
                          len(ended), limit[1])
                code = 1
                stop(signal.SIGTERM)
            else:
                took = _taken_over(ServingLock(Path(os.fsdecode(lock))), pid, stopping) if served == b"s" else ""
                fork()
                log.info("keeper of node %s: process %d ended (%s) after %.1f s%s; forked %d as the next spare", node,
                         pid, how, now - born, took, next(reversed(kids)))
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    return code


def _started_up(r: int) -> bytes:
    """What a process says on its pipe until it has started up (a line), or ended (b"" then)."""
    said = b""
    while b"\n" not in said:
        try:
            more = os.read(r, 4096)
        except OSError:
            return b""
        if not more:
            return said
        said += more
    return said


def _taken_over(lock: ServingLock, ended: int, stopping: list, within_s: float = 1.0) -> str:
    """The process that ended served the node: wait (at most `within_s`) until the spare holds the lock,
    so that the spare serves and the next fork waits, not the other way round (a fork is at the lock
    within milliseconds, before the spare's next try). What the log line says of it."""
    t0 = time.monotonic()
    while lock.holder() in (ended, None) and time.monotonic() - t0 < within_s and not stopping:
        time.sleep(POLL_S / 5)
    holder = lock.holder()
    return f"; its spare {holder} took over ({time.monotonic() - t0:.2f} s after)" if holder not in (ended, None) \
        else f"; no spare took over within {within_s:.0f} s"


def _child(child: Callable[[], int], r: int, w: int, others: list[int]) -> None:
    """A forked node process: the keeper's signal handling undone, its pipes closed but our own; run
    `child()` and end with its status (never returning into the keeper's code)."""
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd in (r, *others):
            os.close(fd)
        KEPT["ready_fd"] = w
        # systemd's watchdog (WATCHDOG_PID: the keeper, the unit's main process) is pinged by the serving
        # process, which NotifyAccess=all lets it do; a hung one stops the pings and the unit restarts
        if "WATCHDOG_PID" in os.environ:
            os.environ["WATCHDOG_PID"] = str(os.getpid())
        sdnotify.MUTED.add("STOPPING")  # the keeper's alone: one process leaving is not the unit stopping
        code = child()
    except SystemExit as exc:
        code = exit_status(exc)
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001 — said, and the status says it
        traceback.print_exc()
    finally:
        end_now(code)
