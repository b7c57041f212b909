"""What every LogicPipe server process does the same way: log format, serving until SIGINT/SIGTERM."""
from __future__ import annotations

import asyncio
import logging
import signal
from typing import Awaitable, Callable

from logicpipe.common import sdnotify
from logicpipe.common.health import set_serving

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)


async def serve_until_signalled(server, health, service_name: str, grace_s: float, *,
                                ready: Callable[[], Awaitable[str]] | None = None,
                                on_stop: Callable[[], Awaitable[None]] | None = None,
                                alive: Callable[[], bool] = lambda: True) -> None:
    """Report SERVING, run `ready` (what must hold before systemd hears READY=1; it returns a
    status line), tell systemd READY=1 and ping its watchdog while `alive()`; wait for SIGINT or
    SIGTERM (systemd's stop), then report NOT_SERVING, run `on_stop` (hand work over) and stop the
    server, giving in-flight calls `grace_s` seconds."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await set_serving(health, True, service_name)
    status = await ready() if ready is not None else "serving"
    sdnotify.notify("READY=1", f"STATUS={status}")
    watchdog = asyncio.create_task(sdnotify.watchdog(alive), name="systemd-watchdog")
    await stop.wait()
    log = logging.getLogger(__name__)
    log.info("shutting down")
    sdnotify.notify("STOPPING=1")
    await set_serving(health, False, service_name)
    try:
        if on_stop is not None:
            await on_stop()
    except Exception:  # noqa: BLE001 — stopping goes on
        log.exception("handing work over before stopping failed")
    watchdog.cancel()
    await server.stop(grace=grace_s)
