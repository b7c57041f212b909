"""Channel and server options, defined once for every LogicPipe client and server."""
from __future__ import annotations

import grpc

MAX_MESSAGE_BYTES = 64 * 2**20  # one gRPC message either way, bytes
KEEPALIVE_TIME_MS = 20_000      # ping an idle connection this often, ms
KEEPALIVE_TIMEOUT_MS = 10_000   # a ping unanswered this long closes the connection, ms

_COMMON = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]

CHANNEL_OPTIONS = _COMMON + [
    # Stage links must not sit in a long reconnect back-off after a peer restarts.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    ("grpc.enable_retries", 0),
]

SERVER_OPTIONS = _COMMON + [
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.so_reuseport", 0),
]


def insecure_channel(address: str) -> grpc.aio.Channel:
    """An asyncio channel to a LogicPipe server with the shared options."""
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


def new_server() -> grpc.aio.Server:
    """An asyncio server with the shared options and interceptors (add services, ports, then start)."""
    from logicpipe.interceptors import ServiceErrors

    return grpc.aio.server(options=SERVER_OPTIONS, interceptors=[ServiceErrors()])


def caller_address(address: str, peer: str) -> str:
    """`address` ("host:port"), its host taken from the gRPC peer ("ipv4:1.2.3.4:5678",
    "ipv6:[::1]:5678") when empty or a wildcard; "" when `address` is empty."""
    if not address:
        return ""
    host, _, port = address.rpartition(":")
    if host in ("", "0.0.0.0", "[::]", "::"):
        kind, _, rest = peer.partition(":")
        if kind in ("ipv4", "ipv6"):
            host = rest.rpartition(":")[0]
    return f"{host}:{port}" if host else ""
