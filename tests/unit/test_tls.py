"""The mesh CA and bundles (logicpipe.tls): what a certificate states, and the flags' errors."""
from __future__ import annotations

import logging
import stat

import pytest

from logicpipe import grpc_options, tls

log = logging.getLogger("test")


@pytest.fixture()
def ca(tmp_path):
    return tls.init_ca(tmp_path / "ca")


def test_issue_states_name_and_role_and_keys_are_private(ca, tmp_path):
    out = tls.issue(ca, "node-7", "stage", tmp_path / "b")
    b = tls.Bundle.load(out)
    assert (b.name, b.role) == ("node-7", "stage") and tls.identity(b.cert) == ("stage", "node-7")
    assert stat.S_IMODE((out / "node-7.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((ca / tls.CA_KEY).stat().st_mode) == 0o600
    assert b.ca == (ca / tls.CA_CERT).read_bytes()
    from cryptography import x509

    sans = x509.load_pem_x509_certificate(b.cert).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert set(sans.value.get_values_for_type(x509.DNSName)) == {"stage.logicpipe", "node-7.stage.logicpipe"}


def test_clear_errors(ca, tmp_path):
    with pytest.raises(tls.TlsError, match="exists"):
        tls.init_ca(ca)  # one CA per mesh: never overwritten
    with pytest.raises(tls.TlsError, match="lowercase"):
        tls.issue(ca, "Bad_Name", "stage", tmp_path / "x")
    with pytest.raises(tls.TlsError, match="role 'admin'"):
        tls.issue(ca, "a", "admin", tmp_path / "x")
    with pytest.raises(tls.TlsError, match="lpctl ca init"):
        tls.issue(tmp_path / "no-ca", "a", "stage", tmp_path / "x")
    with pytest.raises(tls.TlsError, match="expected ca.crt and one NAME.crt"):
        tls.Bundle.load(tmp_path / "nothing-here")


def test_configure_needs_tls_or_insecure_off_loopback(ca, tmp_path, caplog):
    try:
        assert tls.configure("", False, "127.0.0.1:50051", "controller", log) is None  # loopback: fine
        with pytest.raises(tls.TlsError, match="--insecure"):
            tls.configure("", False, "0.0.0.0:50051", "controller", log)
        with caplog.at_level(logging.WARNING):
            assert tls.configure("", True, "0.0.0.0:50051", "controller", log) is None
        assert "INSECURE" in caplog.text
        stage = tls.issue(ca, "s1", "stage", tmp_path / "s1")
        with pytest.raises(tls.TlsError, match="holds a stage certificate"):
            tls.configure(str(stage), False, "0.0.0.0:1", "controller", log)
        b = tls.configure(str(stage), False, "0.0.0.0:1", "stage", log)
        assert b.name == "s1" and grpc_options.tls_bundle() is b
    finally:
        grpc_options.use_tls(None)
    assert grpc_options.is_loopback("localhost") and grpc_options.is_loopback("[::1]")
    assert not grpc_options.is_loopback("") and not grpc_options.is_loopback("192.168.1.4")


def test_join_token_works_once_and_replies_are_authenticated(ca, tmp_path, monkeypatch):
    from logicpipe.controller.join import JoinAuthority
    from logicpipe.errors import PermissionDenied

    auth = JoinAuthority(ca)
    token, ttl = auth.create()
    assert ttl == 3600 and token.startswith("lpj1.")
    token_id, secret = tls.parse_token(token)
    key, csr = tls.make_csr("newbie")
    with pytest.raises(PermissionDenied, match="HMAC"):
        auth.join(token_id, csr, tls.mac("0" * 32, token_id.encode(), csr))  # a wrong secret
    cert, ca_pem, mac = auth.join(token_id, csr, tls.mac(secret, token_id.encode(), csr))
    assert mac == tls.mac(secret, cert, ca_pem) and tls.identity(cert) == ("stage", "newbie")
    with pytest.raises(PermissionDenied, match="used or expired"):
        auth.join(token_id, csr, tls.mac(secret, token_id.encode(), csr))  # spent
    expired, _ = auth.create(ttl_s=5)
    monkeypatch.setattr("logicpipe.controller.join.time.monotonic", lambda: 1e12)
    eid, esecret = tls.parse_token(expired)
    with pytest.raises(PermissionDenied, match="used or expired"):
        auth.join(eid, csr, tls.mac(esecret, eid.encode(), csr))
    monkeypatch.undo()
    # a revoked name stays refused, across a restart (the list lives in the CA directory)
    assert auth.revoke("newbie") and not auth.revoke("newbie")
    again = JoinAuthority(ca)
    assert "newbie" in again.revoked
    t2, _ = again.create()
    i2, s2 = tls.parse_token(t2)
    with pytest.raises(PermissionDenied, match="revoked"):
        again.join(i2, csr, tls.mac(s2, i2.encode(), csr))
    with pytest.raises(tls.TlsError, match="lpj1"):
        tls.parse_token("not-a-token")
