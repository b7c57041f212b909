"""What every LogicPipe server process does the same way: log format, waiting for SIGINT/SIGTERM."""
from __future__ import annotations

import asyncio
import logging
import signal

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)


async def until_signalled() -> None:
    """Return once the process gets SIGINT or SIGTERM (systemd's stop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logging.getLogger(__name__).info("shutting down")
