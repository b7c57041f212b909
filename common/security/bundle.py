"""One party's credentials, and who the peer of a call is.

A bundle directory (`--tls-dir`) holds ca.crt, NAME.crt and NAME.key. A certificate says its
party's name (the subject's common name: a stage's node id) and role (the organizational unit:
controller, stage or client), and names two DNS names, "<role>.logicpipe" and
"<name>.<role>.logicpipe" (logicpipe.policy.role_host). Make them with `lpctl ca issue`
(logicpipe.common.security.ca).
"""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.x509.oid import NameOID

from logicpipe.policy import ROLES

NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
CA_CERT, CA_KEY = "ca.crt", "ca.key"


class TlsError(ValueError):
    """A bundle, CA or token that cannot be used; the message says what to do."""


def check_name(name: str) -> str:
    if not NAME_RE.match(name or ""):
        raise TlsError(f"name {name[:80]!r}: use 1 to 63 lowercase letters, digits and '-' (it becomes a DNS name "
                       "in the certificate, and a stage's node id)")
    return name


@functools.lru_cache(maxsize=1024)
def identity(cert_pem: bytes) -> tuple[str, str]:
    """(role, name) a certificate states ("", "" when it states none)."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    ou = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    role = ou[0].value if ou else ""
    return (role if role in ROLES else ""), (cn[0].value if cn else "")


def peer(context) -> tuple[str, str]:
    """(role, name) of the party on the other end of a server call, from the certificate it
    presented; ("", "") without TLS or without a certificate."""
    auth = context.auth_context() or {}
    pem = auth.get("x509_pem_cert")
    if not pem:
        return "", ""
    return identity(pem[0])


def write_private(path: Path, data: bytes, private: bool = False) -> None:
    """Write `data` to `path` (mode 0600 when `private`), making its directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def write_bundle(out_dir, name: str, ca_pem: bytes, cert_pem: bytes, key_pem: bytes) -> Path:
    out = Path(out_dir)
    write_private(out / CA_CERT, ca_pem)
    write_private(out / f"{name}.crt", cert_pem)
    write_private(out / f"{name}.key", key_pem, private=True)
    return out


@dataclass(frozen=True)
class Bundle:
    """One party's credentials: the CA certificate, its certificate and key."""

    name: str
    role: str
    ca: bytes
    cert: bytes
    key: bytes

    @classmethod
    def load(cls, directory) -> "Bundle":
        """The bundle in `directory`: ca.crt and exactly one other NAME.crt with its NAME.key."""
        d = Path(directory)
        certs = sorted(p for p in d.glob("*.crt") if p.name != CA_CERT) if d.is_dir() else []
        if not (d / CA_CERT).is_file() or len(certs) != 1:
            raise TlsError(f"--tls-dir {d}: expected ca.crt and one NAME.crt with its NAME.key (found "
                           f"{', '.join(p.name for p in d.glob('*')) if d.is_dir() else 'no such directory'}); "
                           "make them with `lpctl ca issue NAME --role ROLE`")
        key = certs[0].with_suffix(".key")
        if not key.is_file():
            raise TlsError(f"--tls-dir {d}: {certs[0].name} has no {key.name}")
        cert = certs[0].read_bytes()
        try:
            role, name = identity(cert)
        except ValueError as exc:
            raise TlsError(f"{certs[0]}: not a PEM certificate ({exc})") from exc
        if not role:
            raise TlsError(f"{certs[0]}: the certificate names no LogicPipe role; issue it with `lpctl ca issue`")
        return cls(name=name, role=role, ca=(d / CA_CERT).read_bytes(), cert=cert, key=key.read_bytes())

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True)
