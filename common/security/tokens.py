"""One-time join tokens, `lpj1.<id>.<secret>`: what each side computes, and the node's half of
the exchange (the controller's half is logicpipe.controller.mesh.join.JoinAuthority).

The new node makes its key and a signing request under its node id and sends the request, with an
HMAC of it under the token's secret, to the controller's bootstrap port; the reply (its
certificate and the CA's) carries an HMAC under the same secret, which the node checks before it
trusts the CA. The secret itself never crosses the wire.
"""
from __future__ import annotations

import hashlib
import hmac

import grpc

from logicpipe.common.security.bundle import Bundle, TlsError, write_bundle
from logicpipe.common.security.ca import make_csr
from logicpipe.common.transport import CHANNEL_OPTIONS
from logicpipe.v1 import controller_pb2, controller_pb2_grpc

TOKEN_PREFIX = "lpj1"
JOIN_TIMEOUT_S = 30.0


def mac(secret: str, *parts: bytes) -> bytes:
    """HMAC-SHA256 over `parts` (length-prefixed) with a join token's secret."""
    h = hmac.new(secret.encode(), digestmod=hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(8, "big") + p)
    return h.digest()


def parse_token(token: str) -> tuple[str, str]:
    """(token id, secret) of "lpj1.<id>.<secret>"; TlsError if malformed."""
    parts = token.strip().split(".")
    if len(parts) != 3 or parts[0] != TOKEN_PREFIX or not parts[1] or len(parts[2]) < 32:
        raise TlsError("a join token looks like lpj1.<id>.<secret> (from `lpctl token create`)")
    return parts[1], parts[2]


def join_mesh(address: str, token: str, node_id: str, out_dir) -> Bundle:
    """Node side: trade `token` at the controller's bootstrap `address` for a bundle in `out_dir`
    (plaintext: the token's HMACs authenticate both ways)."""
    token_id, secret = parse_token(token)
    key_pem, csr_pem = make_csr(node_id)
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        try:
            reply = controller_pb2_grpc.ControllerStub(ch).Join(controller_pb2.JoinRequest(
                token_id=token_id, csr_pem=csr_pem, mac=mac(secret, token_id.encode(), csr_pem)),
                timeout=JOIN_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise TlsError(f"joining at {address} failed: {exc.code().name}: {exc.details()}") from exc
    if not hmac.compare_digest(reply.mac, mac(secret, reply.cert_pem, reply.ca_pem)):
        raise TlsError(f"the join reply from {address} is not signed with the token: not our controller")
    write_bundle(out_dir, node_id, reply.ca_pem, reply.cert_pem, key_pem)
    return Bundle.load(out_dir)
