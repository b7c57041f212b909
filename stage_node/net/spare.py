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
"""
from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import time
from pathlib import Path

from logicpipe.common import sdnotify
from logicpipe.common.process import check_free, is_free
from logicpipe.stage_node.net.identity import file_label

log = logging.getLogger(__name__)

POLL_S = 0.05  # how often a spare tries the lock: its share of a takeover's time


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
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return True

    def holder(self) -> int | None:
        """The pid the last holder wrote (it may have ended since), or None."""
        try:
            text = self.path.read_text().strip()
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
    if serving.take():
        if spare:
            log.info("spare for node %s: no process serves it, so this one does", node_id)
        return
    holder = serving.holder()
    if not spare:
        raise SystemExit(f"node {node_id} is served by another process (pid {holder}) from {serving.path.parent}: "
                         "add --spare to wait as its spare, or give this one its own --state-dir")
    log.info("spare for node %s, served by pid %s: started up, waiting to take over", node_id, holder)
    sdnotify.notify("READY=1", f"STATUS=spare for node {node_id} (served by pid {holder})")
    watchdog = asyncio.create_task(sdnotify.watchdog(lambda: True), name="systemd-watchdog")
    try:
        waited = await serving.wait()
    finally:
        watchdog.cancel()
    t0 = time.monotonic()
    await wait_free(listen)
    log.info("spare for node %s: its serving process (pid %s) ended; taking over (waited %.1f s, its port %.2f s)",
             node_id, holder, waited, time.monotonic() - t0)
    sdnotify.notify(f"STATUS=taking over node {node_id}")
    check_free(listen, "--listen", prog)
