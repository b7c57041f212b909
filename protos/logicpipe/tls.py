"""Mutual TLS for a mesh: its own certificate authority, a certificate per party naming its role,
and who the peer of a call is.

    lpctl ca init --dir /etc/logicpipe/ca                           # once: ca.key (keep it) + ca.crt
    lpctl ca issue ctl --role controller --dir /etc/logicpipe/ca --out /etc/logicpipe/tls
    lpctl ca issue node1 --role stage ...   lpctl ca issue alice --role client ...

A bundle directory holds ca.crt, NAME.crt and NAME.key; every process takes one (`--tls-dir`).
A certificate says its party's name (the subject's common name: a stage's node id) and role
(the organizational unit: controller, stage or client), and names two DNS names, "<role>.logicpipe"
and "<name>.<role>.logicpipe". A client dials a peer of a role by checking its certificate for
"<role>.logicpipe" (gRPC's target-name override), so a stage that streams to "the next stage" can
only reach a stage, and a server reads the caller's role and name from the certificate it
presented (`peer`). Keys are ECDSA P-256; certificates last a year (the CA ten).
"""
from __future__ import annotations

import datetime
import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path

ROLES = ("controller", "stage", "client")
DOMAIN = "logicpipe"
NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
CA_CERT, CA_KEY = "ca.crt", "ca.key"


class TlsError(ValueError):
    """A bundle or CA that cannot be used; the message says what to do."""


def check_name(name: str) -> str:
    if not NAME_RE.match(name or ""):
        raise TlsError(f"name {name[:80]!r}: use 1 to 63 lowercase letters, digits and '-' (it becomes a DNS name "
                       "in the certificate, and a stage's node id)")
    return name


def role_host(role: str, name: str = "") -> str:
    """The DNS name a certificate of `role` (and `name`) carries."""
    return f"{name}.{role}.{DOMAIN}" if name else f"{role}.{DOMAIN}"


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def init_ca(directory, *, common_name: str = "LogicPipe mesh CA", days: int = 3650) -> Path:
    """Make a CA in `directory` (ca.key, mode 0600, and ca.crt); refuses to overwrite one."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    d = Path(directory)
    if (d / CA_KEY).exists():
        raise TlsError(f"{d / CA_KEY} exists: a mesh has one CA (remove it to start a new mesh)")
    key = _key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    _write(d / CA_KEY, _pem_key(key), private=True)
    _write(d / CA_CERT, cert.public_bytes(serialization.Encoding.PEM))
    return d


def issue(ca_dir, name: str, role: str, out_dir, *, days: int = 365) -> Path:
    """A bundle for party `name` of `role` in `out_dir`: ca.crt, NAME.crt, NAME.key (0600)."""
    check_name(name)
    if role not in ROLES:
        raise TlsError(f"role {role!r}: use one of {', '.join(ROLES)}")
    ca_key, ca_cert, ca_pem = _load_ca(ca_dir)
    key = _key()
    cert_pem = _sign(ca_key, ca_cert, key.public_key(), name, role, days)
    return write_bundle(out_dir, name, ca_pem, cert_pem, _pem_key(key))


@functools.lru_cache(maxsize=1024)
def identity(cert_pem: bytes) -> tuple[str, str]:
    """(role, name) a certificate states ("", "" when it states none)."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    cert = x509.load_pem_x509_certificate(cert_pem)
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    ou = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    role = ou[0].value if ou else ""
    return (role if role in ROLES else ""), (cn[0].value if cn else "")


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

    def channel_credentials(self):
        import grpc

        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert)

    def server_credentials(self):
        import grpc

        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True)


def peer(context) -> tuple[str, str]:
    """(role, name) of the party on the other end of a server call, from the certificate it
    presented; ("", "") without TLS or without a certificate."""
    auth = context.auth_context() or {}
    pem = auth.get("x509_pem_cert")
    if not pem:
        return "", ""
    return identity(pem[0])


_C, _S, _U = "controller", "stage", "client"
STAGE_POLICY = {
    "Assign": frozenset({_C}), "OpenSession": frozenset({_C}), "CloseSession": frozenset({_C}),
    "Events": frozenset({_C}), "MeasureLink": frozenset({_C}),
    "Stream": frozenset({_C, _S}),  # the controller's prompts (stage 0) and the previous stage's steps
    "Echo": frozenset({_C, _S}), "Status": frozenset({_C, _S, _U}),
}
"""Who may call each StageNode method (logicpipe.interceptors.RoleCheck)."""

CONTROLLER_POLICY = {
    "Submit": frozenset({_U}), "Plan": frozenset({_U}), "Drain": frozenset({_U}),
    "Status": frozenset({_C, _S, _U}),
    "Register": frozenset({_S}), "Leave": frozenset({_S}), "PullWeights": frozenset({_S}),
    "CreateJoinToken": frozenset({_U}), "Revoke": frozenset({_U}), "Join": frozenset(),  # Join: bootstrap port only
}
"""Who may call each Controller method."""


def check_self(context, node_id: str) -> None:
    """Over TLS, a stage speaks only for itself: `node_id` must be its certificate's name."""
    from logicpipe import grpc_options
    from logicpipe.errors import PermissionDenied

    if grpc_options.tls_bundle() is None:
        return
    role, name = peer(context)
    if role == _S and node_id != name:
        raise PermissionDenied(f"a stage certificate for {name!r} cannot speak for node {node_id!r}")


def add_flags(ap, role: str) -> None:
    """--tls-dir and --insecure, as every server process takes them (see `configure`)."""
    ap.add_argument("--tls-dir", default="", metavar="DIR",
                    help=f"mutual TLS with the certificates in DIR (ca.crt, NAME.crt, NAME.key from `lpctl ca issue "
                         f"NAME --role {role}`); every peer must present one of the same CA")
    ap.add_argument("--insecure", action="store_true",
                    help="serve plaintext without authentication on a non-loopback address (a trusted network only)")


def configure(tls_dir: str, insecure: bool, listen: str, role: str, log) -> "Bundle | None":
    """A server process's transport from its flags: the bundle in `tls_dir` (of `role`) for every
    channel and server it makes; or plaintext, which a non-loopback `listen` allows only with
    `insecure` (and a warning at every start). TlsError says what to fix."""
    from logicpipe import grpc_options

    host = listen.rpartition(":")[0]
    if tls_dir:
        if insecure:
            raise TlsError("--tls-dir and --insecure exclude each other")
        bundle = Bundle.load(tls_dir)
        if bundle.role != role:
            raise TlsError(f"--tls-dir {tls_dir} holds a {bundle.role} certificate ({bundle.name}); a {role} needs one "
                           f"issued with `lpctl ca issue NAME --role {role}`")
        grpc_options.use_tls(bundle)
        log.info("mutual TLS as %s %s (every peer must present a certificate of this mesh's CA)", role, bundle.name)
        return bundle
    grpc_options.use_tls(None)
    if not grpc_options.is_loopback(host):
        if not insecure:
            raise TlsError(f"listening on {host or 'every interface'} without --tls-dir would let anyone who reaches "
                           "this port join the mesh, read its prompts or reconfigure it: give --tls-dir DIR "
                           "(certificates from `lpctl ca issue`) or, on a network you trust, --insecure")
        log.warning("INSECURE: serving plaintext gRPC on %s without authentication (--insecure); anyone who "
                    "reaches it can join the mesh, read prompts and reconfigure nodes", listen)
    return None


# ----------------------------------------------------------------------------- joining with a token

TOKEN_PREFIX = "lpj1"


def make_csr(name: str) -> tuple[bytes, bytes]:
    """(private key PEM, certificate signing request PEM) for party `name`: the key never leaves."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    check_name(name)
    key = _key()
    csr = (x509.CertificateSigningRequestBuilder()
           .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])).sign(key, hashes.SHA256()))
    return _pem_key(key), csr.public_bytes(serialization.Encoding.PEM)


def sign_csr(ca_dir, csr_pem: bytes, role: str, *, days: int = 365) -> tuple[str, bytes]:
    """(name, certificate PEM) for a signing request: the CA signs its key for `role` under the
    name it asks for (a valid name; its signature checked)."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError as exc:
        raise TlsError(f"not a PEM certificate signing request ({exc})") from exc
    if not csr.is_signature_valid:
        raise TlsError("the signing request's signature does not verify")
    cn = csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    name = check_name(cn[0].value if cn else "")
    ca_key, ca_cert, _ = _load_ca(ca_dir)
    return name, _sign(ca_key, ca_cert, csr.public_key(), name, role, days)


def _load_ca(ca_dir):
    """(CA key, CA certificate, its PEM) from `ca_dir`; TlsError saying how to make one."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    ca_dir = Path(ca_dir)
    try:
        ca_pem = (ca_dir / CA_CERT).read_bytes()
        return (serialization.load_pem_private_key((ca_dir / CA_KEY).read_bytes(), None),
                x509.load_pem_x509_certificate(ca_pem), ca_pem)
    except (OSError, ValueError) as exc:
        raise TlsError(f"no usable CA in {ca_dir} ({exc}); make one with `lpctl ca init --dir {ca_dir}`") from exc


def _sign(ca_key, ca_cert, public_key, name: str, role: str, days: int) -> bytes:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name),
                                     x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role)]))
            .issuer_name(ca_cert.subject).public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(role_host(role)), x509.DNSName(role_host(role, name))]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM)


def mac(secret: str, *parts: bytes) -> bytes:
    """HMAC-SHA256 over `parts` (length-prefixed) with a join token's secret."""
    import hashlib
    import hmac

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


def write_bundle(out_dir, name: str, ca_pem: bytes, cert_pem: bytes, key_pem: bytes) -> Path:
    out = Path(out_dir)
    _write(out / CA_CERT, ca_pem)
    _write(out / f"{name}.crt", cert_pem)
    _write(out / f"{name}.key", key_pem, private=True)
    return out


def join_mesh(address: str, token: str, node_id: str, out_dir) -> "Bundle":
    """Node side: trade `token` at the controller's bootstrap `address` for a bundle in `out_dir`."""
    import hmac

    import grpc

    from logicpipe import grpc_options
    from logicpipe.v1 import controller_pb2, controller_pb2_grpc

    token_id, secret = parse_token(token)
    key_pem, csr_pem = make_csr(node_id)
    with grpc.insecure_channel(address, options=grpc_options.CHANNEL_OPTIONS) as ch:
        try:
            reply = controller_pb2_grpc.ControllerStub(ch).Join(controller_pb2.JoinRequest(
                token_id=token_id, csr_pem=csr_pem, mac=mac(secret, token_id.encode(), csr_pem)), timeout=30)
        except grpc.RpcError as exc:
            raise TlsError(f"joining at {address} failed: {exc.code().name}: {exc.details()}") from exc
    if not hmac.compare_digest(reply.mac, mac(secret, reply.cert_pem, reply.ca_pem)):
        raise TlsError(f"the join reply from {address} is not signed with the token: not our controller")
    write_bundle(out_dir, node_id, reply.ca_pem, reply.cert_pem, key_pem)
    return Bundle.load(out_dir)
