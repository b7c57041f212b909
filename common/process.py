"""What every LogicPipe process does the same way: log format, addresses from flags, a start-up
mistake as one line that names the fix (exit 2; its traceback only with --log-level debug),
binding a port with the reason when it cannot be had, serving until SIGINT/SIGTERM."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import sys
from typing import Awaitable, Callable

from logicpipe.common import sdnotify
from logicpipe.common.health import set_serving

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

CONTROLLER_PORT = 50051  # logicpipe-controller --listen's port, so a controller address without one means it
STAGE_PORT = 50061       # logicpipe-stage --listen's port, so a stage address without one means it
EXIT_USAGE = 2           # a mistake in how the process was started (as argparse exits)

log = logging.getLogger(__name__)


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)


# --- addresses from flags -------------------------------------------------------------------------

def with_port(address: str, default_port: int | None, flag: str = "") -> str:
    """`address` as HOST:PORT, a bare host given `default_port`: gRPC itself would dial a bare
    host at 443 (HTTPS's port), where no LogicPipe process listens. IPv6 hosts come in brackets
    ("[::1]:50051"); a gRPC target with a scheme ("unix:...", "dns:///...") is taken as it is.
    ValueError names the fix (`default_port` None: the port must be given)."""
    text = address.strip()
    where = f"{flag} {text}" if flag else text
    if not text:
        raise ValueError(f"{flag or 'address'}: give HOST:PORT")
    if "://" in text or text.startswith(("unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:")):
        return text
    if text.count(":") > 1 and not text.startswith("["):  # a bare IPv6 address, no port
        host, port = f"[{text}]", ""
    elif text.startswith("["):
        host, _, rest = text.partition("]")
        host, port = host + "]", rest.removeprefix(":")
        if rest and not rest.startswith(":"):
            raise ValueError(f"{where}: give [IPV6]:PORT")
    else:
        host, _, port = text.partition(":")
    if not host:
        raise ValueError(f"{where}: give the host too, HOST:{port or 'PORT'} (127.0.0.1 for this machine)")
    if not port:
        if default_port is None:
            raise ValueError(f"{where}: give the port too, {host}:PORT")
        return f"{host}:{default_port}"
    if not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{where}: the port must be a number from 0 to 65535")
    return f"{host}:{int(port)}"


def address_flag(default_port: int | None) -> Callable[[str], str]:
    """An argparse type for a HOST:PORT flag (see with_port)."""
    def parse(text: str) -> str:
        try:
            return with_port(text, default_port)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


def address_list_flag(default_port: int | None) -> Callable[[str], list[str]]:
    """An argparse type for HOST:PORT,... (empty: no address)."""
    one = address_flag(default_port)
    return lambda text: [one(a) for a in text.split(",") if a.strip()]


# --- start-up mistakes ------------------------------------------------------------------------------

def run_main(prog: str, serve: Callable[[], Awaitable[None]], log_level: str) -> None:
    """Run a server process's `serve()`: a start-up mistake (SystemExit with a message, as serve
    raises them) is one line on stderr, `prog: message`, and exit 2, its traceback logged only at
    --log-level debug; Ctrl-C before the server is up ends it quietly (130)."""
    configure_logging(log_level)
    try:
        asyncio.run(serve())
    except SystemExit as exc:
        if not isinstance(exc.code, str):
            raise
        if log.isEnabledFor(logging.DEBUG):
            cause = exc.__cause__ or exc.__context__ or exc
            log.debug("what stopped the start", exc_info=(type(cause), cause, cause.__traceback__))
        print(f"{prog}: {exc.code}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    except KeyboardInterrupt:
        sys.exit(130)


def exit_after(main: Callable[[], None]) -> None:
    """A command's entry point: `main()`, then the process ends at once with its status, its output
    and log flushed. Every resource is closed by then (servers stopped, journals and files closed);
    what the interpreter's own teardown adds is gRPC's and torch's finalisers: about 3 s a server
    process here, and now and then a hang (lpctl: an answer printed, then no exit for 210 s).
    In-process callers (tests) call `main()` itself and get its SystemExit as before."""
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exit_status(exc)
    except BaseException:  # (propagates as before: an in-process caller's own exception is not an exit)
        flush_logs()
        raise
    end_now(code)


def exit_status(exc: SystemExit) -> int:
    """The status a SystemExit ends the process with (its message, when it has one, on stderr)."""
    if isinstance(exc.code, str):
        print(exc.code, file=sys.stderr)
    return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)


def flush_logs() -> None:
    """The log and the output flushed (as the interpreter's exit would)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def end_now(code: int) -> None:
    """End the process at once with `code`, its log and output flushed (exit_after)."""
    flush_logs()
    os._exit(code)


def bind(transport, server, address: str, flag: str, prog: str) -> int:
    """Bind `address` (`flag`'s value) on a gRPC server through `transport`. Returns the port;
    SystemExit naming why not and what to change (gRPC itself only says "Failed to bind")."""
    try:
        port = transport.add_port(server, address)
    except RuntimeError as exc:
        log.debug("binding %s: %s", address, exc)
        port = 0
    if port == 0:
        raise SystemExit(cannot_listen(address, flag, prog))
    return port


def cannot_listen(address: str, flag: str, prog: str, exc: OSError | None = None) -> str:
    """Why `address` cannot be listened on, as one line that names the flag to change: `exc`'s
    errno, else that of a plain bind of the same address, tried now."""
    host, _, port = address.rpartition(":")
    code = exc.errno if exc is not None else _bind_errno(host.strip("[]"), port)
    where = f"{flag} {address}"
    if code == errno.EADDRINUSE:
        return (f"{where}: the port is in use (another {prog}? `ss -ltnp 'sport = :{port}'`); "
                f"pick another with {flag} HOST:PORT")
    if code == errno.EADDRNOTAVAIL:
        return (f"{where}: {host} is not an address of this machine; give one of its addresses "
                f"(`ip -br addr`), 127.0.0.1, or 0.0.0.0 for all, with {flag} HOST:PORT")
    if code == errno.EACCES:
        return f"{where}: ports below 1024 need privileges; pick one from 1024 up with {flag} HOST:PORT"
    if code == -1:
        return f"{where}: {host} is not a known host name or address; give an address of this machine with {flag}"
    why = f" ({exc.strerror or exc})" if exc is not None else ""
    return f"{where}: cannot listen there{why}; check the address, or pick another with {flag} HOST:PORT"


def _bind_errno(host: str, port: str) -> int | None:
    """The errno of binding host:port as a server would (-1: the host does not resolve; None: it binds)."""
    try:
        infos = socket.getaddrinfo(host or None, int(port or 0), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, ValueError):
        return -1
    first = None
    for family, kind, proto, _, sockaddr in infos:  # "localhost" is two: one that binds is enough, as for gRPC
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC and aiohttp bind
            try:
                s.bind(sockaddr)
                return None
            except OSError as exc:
                first = first or exc.errno
    return first


def is_free(address: str) -> bool:
    """Whether `address` (HOST:PORT; port 0: any) can be listened on now."""
    host, _, port = address.rpartition(":")
    return not int(port or 0) or _bind_errno(host.strip("[]"), port) is None


def check_free(address: str, flag: str, prog: str) -> None:
    """SystemExit now, before a slow start (a model to load, a benchmark), when `address` cannot be
    listened on; the real bind later says so again should another process take it meanwhile."""
    if not is_free(address):
        raise SystemExit(cannot_listen(address, flag, prog))


# --- serving ----------------------------------------------------------------------------------------

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
