"""How a process talks gRPC: channel and server options defined once, and the `Transport` (mutual
TLS with the process's bundle, or plaintext) that every channel and server of a process is made
through. A process builds its transport once, in its main (`from_flags`), and hands it to what
dials or serves; nothing here is global.
"""
from __future__ import annotations

import argparse
import ipaddress
import logging
from typing import Container

import grpc

from logicpipe.common.interceptors import RoleCheck, ServiceErrors
from logicpipe.common.security.bundle import Bundle, TlsError, peer
from logicpipe.limits import MAX_MESSAGE_BYTES
from logicpipe.policy import role_host

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


class Transport:
    """Mutual TLS with `bundle` for every channel and server made through it, or plaintext (None)."""

    def __init__(self, bundle: Bundle | None = None):
        self.bundle = bundle

    @property
    def tls(self) -> bool:
        return self.bundle is not None

    def _tls_options(self, peer_role: str) -> list:
        # the server must prove `peer_role`: its certificate names "<role>.logicpipe"
        return [("grpc.ssl_target_name_override", role_host(peer_role))]

    def channel(self, address: str, peer_role: str) -> grpc.aio.Channel:
        """An asyncio channel to a LogicPipe server of `peer_role` ("controller" or "stage")."""
        if self.bundle is None:
            return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        return grpc.aio.secure_channel(address, self.bundle.channel_credentials(),
                                       options=CHANNEL_OPTIONS + self._tls_options(peer_role))

    def sync_channel(self, address: str, peer_role: str) -> grpc.Channel:
        """A blocking channel (lpctl, tests, benchmarks)."""
        if self.bundle is None:
            return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        return grpc.secure_channel(address, self.bundle.channel_credentials(),
                                   options=CHANNEL_OPTIONS + self._tls_options(peer_role))

    def server(self, policy: dict[str, frozenset[str]] | None = None,
               revocations: Container[str] | None = None) -> grpc.aio.Server:
        """An asyncio server with the shared options and interceptors (add services, then
        `add_port`, then start); `policy`: method name -> the roles that may call it, and
        `revocations`: certificate names refused on every method (a Revocations, or a stage's
        fence), both enforced when this transport is TLS."""
        interceptors = [RoleCheck(self.tls, policy or {}, revocations), ServiceErrors()]
        return grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Bind `address`. Returns the port (0: failed)."""
        if self.bundle is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, self.bundle.server_credentials())

    def peer(self, context) -> tuple[str, str]:
        """(role, name) of a server call's caller, from its certificate; ("", "") in plaintext."""
        return peer(context) if self.bundle is not None else ("", "")


PLAINTEXT = Transport()


def add_flags(ap: argparse.ArgumentParser, role: str) -> None:
    """--tls-dir and --insecure, as every server process takes them (see `from_flags`)."""
    ap.add_argument("--tls-dir", default="", metavar="DIR",
                    help=f"mutual TLS with the certificates in DIR (ca.crt, NAME.crt, NAME.key from `lpctl ca issue "
                         f"NAME --role {role}`); every peer must present one of the same CA")
    ap.add_argument("--insecure", action="store_true",
                    help="serve plaintext without authentication on a non-loopback address (a trusted network only)")


def from_flags(tls_dir: str, insecure: bool, listen: str, role: str, log: logging.Logger) -> Transport:
    """A server process's transport from its flags: the bundle in `tls_dir` (of `role`), or
    plaintext, which a non-loopback `listen` allows only with `insecure` (and a warning at every
    start). TlsError says what to fix."""
    host = listen.rpartition(":")[0]
    if tls_dir:
        if insecure:
            raise TlsError("--tls-dir and --insecure exclude each other")
        bundle = Bundle.load(tls_dir)
        if bundle.role != role:
            raise TlsError(f"--tls-dir {tls_dir} holds a {bundle.role} certificate ({bundle.name}); a {role} needs one "
                           f"issued with `lpctl ca issue NAME --role {role}`")
        log.info("mutual TLS as %s %s (every peer must present a certificate of this mesh's CA)", role, bundle.name)
        return Transport(bundle)
    if not is_loopback(host):
        if not insecure:
            raise TlsError(f"listening on {host or 'every interface'} without --tls-dir would let anyone who reaches "
                           "this port join the mesh, read its prompts or reconfigure it: give --tls-dir DIR "
                           "(certificates from `lpctl ca issue`) or, on a network you trust, --insecure")
        log.warning("INSECURE: serving plaintext gRPC on %s without authentication (--insecure); anyone who "
                    "reaches it can join the mesh, read prompts and reconfigure nodes", listen)
    return PLAINTEXT


def is_loopback(host: str) -> bool:
    """Whether a listen host only reaches this machine."""
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
