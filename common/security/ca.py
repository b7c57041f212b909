"""The mesh's own certificate authority: one CA per mesh, a certificate per party naming its role.

    lpctl ca init --dir /etc/logicpipe/ca                           # once: ca.key (keep it) + ca.crt
    lpctl ca issue ctl --role controller --dir /etc/logicpipe/ca --out /etc/logicpipe/tls
    lpctl ca issue node1 --role stage ...   lpctl ca issue alice --role client ...

Keys are ECDSA P-256; certificates last a year (the CA ten). A joining node makes its key itself
and sends only a signing request (`make_csr`), which the controller's CA signs (`sign_csr`).
"""
from __future__ import annotations

import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from logicpipe.common.security.bundle import CA_CERT, CA_KEY, TlsError, check_name, write_bundle, write_private
from logicpipe.policy import ROLES, role_host


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def init_ca(directory, *, common_name: str = "LogicPipe mesh CA", days: int = 3650) -> Path:
    """Make a CA in `directory` (ca.key, mode 0600, and ca.crt); refuses to overwrite one."""
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
    write_private(d / CA_KEY, _pem_key(key), private=True)
    write_private(d / CA_CERT, cert.public_bytes(serialization.Encoding.PEM))
    return d


def issue(ca_dir, name: str, role: str, out_dir, *, days: int = 365) -> Path:
    """A bundle for party `name` of `role` in `out_dir`: ca.crt, NAME.crt, NAME.key (0600)."""
    check_name(name)
    if role not in ROLES:
        raise TlsError(f"role {role!r}: use one of {', '.join(ROLES)}")
    ca_key, ca_cert, ca_pem = load_ca(ca_dir)
    key = _key()
    cert_pem = _sign(ca_key, ca_cert, key.public_key(), name, role, days)
    return write_bundle(out_dir, name, ca_pem, cert_pem, _pem_key(key))


def make_csr(name: str) -> tuple[bytes, bytes]:
    """(private key PEM, certificate signing request PEM) for party `name`: the key never leaves."""
    check_name(name)
    key = _key()
    csr = (x509.CertificateSigningRequestBuilder()
           .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])).sign(key, hashes.SHA256()))
    return _pem_key(key), csr.public_bytes(serialization.Encoding.PEM)


def sign_csr(ca_dir, csr_pem: bytes, role: str, *, days: int = 365) -> tuple[str, bytes]:
    """(name, certificate PEM) for a signing request: the CA signs its key for `role` under the
    name it asks for (a valid name; its signature checked)."""
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError as exc:
        raise TlsError(f"not a PEM certificate signing request ({exc})") from exc
    if not csr.is_signature_valid:
        raise TlsError("the signing request's signature does not verify")
    cn = csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    name = check_name(cn[0].value if cn else "")
    ca_key, ca_cert, _ = load_ca(ca_dir)
    return name, _sign(ca_key, ca_cert, csr.public_key(), name, role, days)


def load_ca(ca_dir):
    """(CA key, CA certificate, its PEM) from `ca_dir`; TlsError saying how to make one."""
    ca_dir = Path(ca_dir)
    try:
        ca_pem = (ca_dir / CA_CERT).read_bytes()
        return (serialization.load_pem_private_key((ca_dir / CA_KEY).read_bytes(), None),
                x509.load_pem_x509_certificate(ca_pem), ca_pem)
    except (OSError, ValueError) as exc:
        raise TlsError(f"no usable CA in {ca_dir} ({exc}); make one with `lpctl ca init --dir {ca_dir}`") from exc


def _sign(ca_key, ca_cert, public_key, name: str, role: str, days: int) -> bytes:
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
