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


_BUNDLE = None  # this process's logicpipe.tls.Bundle (--tls-dir), or None: plaintext (development)


def use_tls(bundle) -> None:
    """Every channel and server this process makes from now on uses `bundle` (None: plaintext)."""
    global _BUNDLE
    _BUNDLE = bundle


def tls_bundle():
    return _BUNDLE


def _tls_options(peer_role: str) -> list:
    from logicpipe.tls import role_host

    return [("grpc.ssl_target_name_override", role_host(peer_role))]


def channel(address: str, peer_role: str) -> grpc.aio.Channel:
    """An asyncio channel to a LogicPipe server of `peer_role` ("controller" or "stage"): mutual TLS
    when this process has a bundle (the server must prove that role), else plaintext."""
    if _BUNDLE is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(address, _BUNDLE.channel_credentials(),
                                   options=CHANNEL_OPTIONS + _tls_options(peer_role))


_CLIENT_BUNDLE = None  # blocking channels' bundle when none is given (a test process over a TLS LocalMesh)


def use_client_tls(bundle) -> None:
    """Blocking channels made without a bundle use `bundle` (None: plaintext)."""
    global _CLIENT_BUNDLE
    _CLIENT_BUNDLE = bundle


def sync_channel(address: str, peer_role: str, bundle=None, *, plaintext: bool = False) -> grpc.Channel:
    """A blocking channel (lpctl, tests, benchmarks): mutual TLS with `bundle`, else this
    process's client or server bundle, else (or with `plaintext`) plaintext."""
    bundle = None if plaintext else bundle or _CLIENT_BUNDLE or _BUNDLE
    if bundle is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.secure_channel(address, bundle.channel_credentials(), options=CHANNEL_OPTIONS + _tls_options(peer_role))


def new_server(policy: dict[str, frozenset[str]] | None = None, revoked: set[str] | None = None) -> grpc.aio.Server:
    """An asyncio server with the shared options and interceptors (add services, ports, then start);
    `policy`: method name -> the roles that may call it, enforced while this process uses TLS;
    `revoked`: certificate names refused on every method."""
    from logicpipe.interceptors import RoleCheck, ServiceErrors

    interceptors = [RoleCheck(policy or {}, revoked), ServiceErrors()]
    return grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)


def add_port(server: grpc.aio.Server, address: str) -> int:
    """Bind `address`: with mutual TLS when this process has a bundle. Returns the port (0: failed)."""
    if _BUNDLE is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, _BUNDLE.server_credentials())


def is_loopback(host: str) -> bool:
    """Whether a listen host only reaches this machine."""
    import ipaddress

    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
