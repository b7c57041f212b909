"""Joining: one-time join tokens a new node trades for a stage certificate (like kubeadm/k3s join
tokens, over the mesh's own CA). The controller's half; the node's is
logicpipe.common.security.tokens.join_mesh.

`lpctl token create` asks the controller (a client certificate) for a token `lpj1.<id>.<secret>`:
the secret is 128 random bits, kept in the controller's memory, good once and for `ttl_s`. The
new node (`logicpipe-stage --join-token T --join-address HOST:PORT`) makes its key and a signing
request under its node id, and sends the request with an HMAC of it under the secret to the
controller's bootstrap port (`--join-listen`, plaintext, serving only Join). The controller checks
the HMAC, signs the request as a stage certificate and answers with it, the CA certificate and an
HMAC of both, which the node checks before it trusts the CA. The secret itself never crosses the
wire, a reply cannot be forged without it, and the token is spent by the first valid use.

A revoked name (logicpipe.common.security.revocations) never joins again, and a join never
issues a certificate under a name already taken: one a known node goes by, the controller's own,
or one issued by an earlier join (kept beside the CA in joined.json). A certificate under a taken
name would pass every name check made for that node (streaming into its successor, Leave).
"""
from __future__ import annotations

import hmac
import json
import logging
import math
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from logicpipe.common.security.bundle import CA_CERT, CA_KEY, TlsError, write_private
from logicpipe.common.security.ca import sign_csr
from logicpipe.common.security.revocations import Revocations
from logicpipe.common.security.tokens import TOKEN_PREFIX, mac
from logicpipe.errors import AlreadyExists, FailedPrecondition, InvalidArgument, PermissionDenied

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 3600.0
MAX_TTL_S = 24 * 3600.0
MAX_TOKENS = 1024  # live tokens at once


@dataclass
class _Token:
    secret: str
    expires: float  # time.monotonic()


JOINED_FILE = "joined.json"  # beside the CA: names issued by joins


class JoinAuthority:
    """The controller's join tokens, over the CA in `ca_dir`; `revocations`: names never signed;
    `taken(name)`: why a name is in use now ("" if it is not; the controller sets it)."""

    def __init__(self, ca_dir, revocations: Revocations, taken: Callable[[str], str] = lambda name: ""):
        self.ca_dir = Path(ca_dir)
        if not (self.ca_dir / CA_KEY).is_file():
            raise TlsError(f"--ca-dir {self.ca_dir}: no {CA_KEY} there (make a CA with `lpctl ca init`)")
        self.revocations = revocations
        self.taken = taken
        self._tokens: dict[str, _Token] = {}
        try:
            self._joined: set[str] = set(json.loads((self.ca_dir / JOINED_FILE).read_text()))
        except FileNotFoundError:
            self._joined = set()
        except (OSError, ValueError, TypeError) as exc:
            raise TlsError(f"{self.ca_dir / JOINED_FILE}: unreadable ({exc}); fix or remove it") from exc

    def create(self, ttl_s: float = 0.0) -> tuple[str, float]:
        """A new one-time token and its lifetime (s): `ttl_s`, at most MAX_TTL_S (0: DEFAULT_TTL_S)."""
        if not math.isfinite(ttl_s) or ttl_s < 0:
            raise InvalidArgument(f"ttl_s {ttl_s} is not a lifetime: give seconds from 0 (the default, "
                                  f"{DEFAULT_TTL_S:.0f} s) to {MAX_TTL_S:.0f}")
        ttl = DEFAULT_TTL_S if ttl_s == 0 else min(ttl_s, MAX_TTL_S)
        now = time.monotonic()
        self._tokens = {k: t for k, t in self._tokens.items() if t.expires > now}
        if len(self._tokens) >= MAX_TOKENS:
            raise FailedPrecondition(f"{MAX_TOKENS} join tokens are live already; wait for some to expire")
        token_id, secret = secrets.token_hex(6), secrets.token_hex(16)
        self._tokens[token_id] = _Token(secret, now + ttl)
        return f"{TOKEN_PREFIX}.{token_id}.{secret}", ttl

    def join(self, token_id: str, csr_pem: bytes, request_mac: bytes) -> tuple[bytes, bytes, bytes]:
        """(stage certificate, CA certificate, reply HMAC) for a valid, unspent, unexpired token."""
        t = self._tokens.get(token_id)
        if t is None or t.expires <= time.monotonic():
            self._tokens.pop(token_id, None)
            raise PermissionDenied("unknown, used or expired join token: make a new one with `lpctl token create`")
        if not hmac.compare_digest(request_mac, mac(t.secret, token_id.encode(), csr_pem)):
            raise PermissionDenied("the join request's HMAC does not match the token: wrong secret")
        try:
            name, cert = sign_csr(self.ca_dir, csr_pem, "stage")
        except TlsError as exc:
            raise InvalidArgument(f"join request: {exc}") from exc
        if name in self.revocations:
            raise PermissionDenied(f"node {name} was revoked; it cannot join again under that name")
        why = self.taken(name) or (f"a node joined under it before (see {JOINED_FILE} beside the CA)"
                                   if name in self._joined else "")
        if why:
            raise AlreadyExists(f"node id {name!r} is taken: {why}; join with another --node-id (the token is "
                                "still good)")
        del self._tokens[token_id]  # spent
        self._joined.add(name)
        write_private(self.ca_dir / JOINED_FILE, json.dumps(sorted(self._joined)).encode())
        ca = (self.ca_dir / CA_CERT).read_bytes()
        log.info("node %s joined with token %s: stage certificate issued", name, token_id)
        return cert, ca, mac(t.secret, cert, ca)
