"""What every LogicPipe server process does the same way: log format, serving until SIGINT/SIGTERM."""
from __future__ import annotations

import asyncio
import logging
import signal

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)


async def serve_until_signalled(server, health, service_name: str, grace_s: float) -> None:
    """Report SERVING, wait for SIGINT or SIGTERM (systemd's stop), then report NOT_SERVING and
    stop the server, giving in-flight calls `grace_s` seconds."""
    from logicpipe.health import set_serving

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await set_serving(health, True, service_name)
    await stop.wait()
    logging.getLogger(__name__).info("shutting down")
    await set_serving(health, False, service_name)
    await server.stop(grace=grace_s)
