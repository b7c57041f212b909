"""The systemd notify protocol (sd_notify(3)) and its watchdog, in the standard library only.

Under `Type=notify` systemd passes `$NOTIFY_SOCKET`; the process sends newline-separated
`KEY=VALUE` fields as one datagram: "READY=1" once it serves, "STATUS=..." for `systemctl status`,
"STOPPING=1" when it begins to shut down, "WATCHDOG=1" at least every `WatchdogSec=`.
Outside systemd every call is a no-op, so the same code runs from a terminal and under a unit.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Callable

log = logging.getLogger(__name__)


def _socket_address(value: str) -> str:
    """$NOTIFY_SOCKET as an AF_UNIX address: "@name" is the abstract namespace ("\\0name")."""
    return "\0" + value[1:] if value.startswith("@") else value


MUTED: set[str] = set()  # keys this process does not send (a node's spare under a keeper: stage_node.net.spare)


def notify(*fields: str) -> bool:
    """Send `fields` (e.g. "READY=1", "STATUS=serving") to systemd as one datagram.

    False when not run under a notify-type unit ($NOTIFY_SOCKET unset) or when the send fails;
    never raises — a lost notification must not take the server down."""
    target = os.environ.get("NOTIFY_SOCKET")
    fields = tuple(f for f in fields if f.partition("=")[0] not in MUTED)
    if not target or not fields:
        return False
    if not target.startswith(("/", "@")):  # e.g. "vsock:..." (systemd 254+, VMs): not supported here
        log.debug("NOTIFY_SOCKET=%r is not an AF_UNIX address; not notifying %s", target, fields)
        return False
    payload = "\n".join(fields).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(payload, _socket_address(target))
    except OSError as exc:
        log.debug("sd_notify %s to %r failed: %s", fields, target, exc)
        return False
    return True


def watchdog_interval() -> float | None:
    """Seconds between watchdog pings (half of `WatchdogSec=`, as sd_watchdog_enabled(3) advises),
    or None when systemd expects no pings from this process."""
    try:
        usec = int(os.environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    if pid:  # set: the pings are expected from that process only
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    return usec / 2 / 1e6


async def watchdog(alive: Callable[[], bool] = lambda: True) -> None:
    """Ping systemd's watchdog forever, but only while `alive()` is true; returns at once when no
    watchdog is configured. Run it as a task on the server's event loop: a blocked loop, or a
    wedged process whose `alive()` says so, stops the pings and systemd restarts the unit."""
    interval = watchdog_interval()
    if interval is None:
        return
    withheld = False
    while True:
        try:
            ok = bool(alive())
        except Exception:  # a broken liveness check counts as not alive, not as a dead watchdog task
            log.warning("watchdog liveness check failed", exc_info=True)
            ok = False
        if ok:
            notify("WATCHDOG=1")
        elif not withheld:
            log.warning("not alive: withholding watchdog pings (systemd restarts the unit after WatchdogSec)")
        withheld = not ok
        await asyncio.sleep(interval)
