"""The mesh CA and bundles (logicpipe.common.security), the transport's flags and their errors,
join tokens and revocations."""
from __future__ import annotations

import logging
import stat

import pytest
from cryptography import x509

from logicpipe.common.security import ca as tls_ca
from logicpipe.common.security.bundle import CA_CERT, CA_KEY, Bundle, TlsError, identity
from logicpipe.common.security.ca import make_csr
from logicpipe.common.security.revocations import Revocations
from logicpipe.common.security.tokens import mac, parse_token
from logicpipe.common.transport import from_flags, is_loopback
from logicpipe.controller.mesh.join import JoinAuthority
from logicpipe.errors import PermissionDenied

log = logging.getLogger("test")


@pytest.fixture()
def ca(tmp_path):
    return tls_ca.init_ca(tmp_path / "ca")


def test_issue_states_name_and_role_and_keys_are_private(ca, tmp_path):
    out = tls_ca.issue(ca, "node-7", "stage", tmp_path / "b")
    b = Bundle.load(out)
    assert (b.name, b.role) == ("node-7", "stage") and identity(b.cert) == ("stage", "node-7")
    assert stat.S_IMODE((out / "node-7.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((ca / CA_KEY).stat().st_mode) == 0o600
    assert b.ca == (ca / CA_CERT).read_bytes()
    sans = x509.load_pem_x509_certificate(b.cert).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert set(sans.value.get_values_for_type(x509.DNSName)) == {"stage.logicpipe", "node-7.stage.logicpipe"}


def test_clear_errors(ca, tmp_path):
    with pytest.raises(TlsError, match="exists"):
        tls_ca.init_ca(ca)  # one CA per mesh: never overwritten
    with pytest.raises(TlsError, match="lowercase"):
        tls_ca.issue(ca, "Bad_Name", "stage", tmp_path / "x")
    with pytest.raises(TlsError, match="role 'admin'"):
        tls_ca.issue(ca, "a", "admin", tmp_path / "x")
    with pytest.raises(TlsError, match="lpctl ca init"):
        tls_ca.issue(tmp_path / "no-ca", "a", "stage", tmp_path / "x")
    with pytest.raises(TlsError, match="expected ca.crt and one NAME.crt"):
        Bundle.load(tmp_path / "nothing-here")


def test_configure_needs_tls_or_insecure_off_loopback(ca, tmp_path, caplog):
    assert from_flags("", False, "127.0.0.1:50051", "controller", log).bundle is None  # loopback: fine
    with pytest.raises(TlsError, match="--insecure"):
        from_flags("", False, "0.0.0.0:50051", "controller", log)
    with caplog.at_level(logging.WARNING):
        assert from_flags("", True, "0.0.0.0:50051", "controller", log).bundle is None
    assert "INSECURE" in caplog.text
    stage = tls_ca.issue(ca, "s1", "stage", tmp_path / "s1")
    with pytest.raises(TlsError, match="holds a stage certificate"):
        from_flags(str(stage), False, "0.0.0.0:1", "controller", log)
    t = from_flags(str(stage), False, "0.0.0.0:1", "stage", log)
    b = t.bundle
    assert b.name == "s1" and t.tls
    assert is_loopback("localhost") and is_loopback("[::1]")
    assert not is_loopback("") and not is_loopback("192.168.1.4")


def test_join_token_works_once_and_replies_are_authenticated(ca, tmp_path, monkeypatch):
    auth = JoinAuthority(ca, Revocations.in_ca_dir(ca))
    token, ttl = auth.create()
    assert ttl == 3600 and token.startswith("lpj1.")
    token_id, secret = parse_token(token)
    key, csr = make_csr("newbie")
    with pytest.raises(PermissionDenied, match="HMAC"):
        auth.join(token_id, csr, mac("0" * 32, token_id.encode(), csr))  # a wrong secret
    cert, ca_pem, reply_mac = auth.join(token_id, csr, mac(secret, token_id.encode(), csr))
    assert reply_mac == mac(secret, cert, ca_pem) and identity(cert) == ("stage", "newbie")
    with pytest.raises(PermissionDenied, match="used or expired"):
        auth.join(token_id, csr, mac(secret, token_id.encode(), csr))  # spent
    expired, _ = auth.create(ttl_s=5)
    monkeypatch.setattr("logicpipe.controller.mesh.join.time.monotonic", lambda: 1e12)
    eid, esecret = parse_token(expired)
    with pytest.raises(PermissionDenied, match="used or expired"):
        auth.join(eid, csr, mac(esecret, eid.encode(), csr))
    monkeypatch.undo()
    # a revoked name stays refused, across a restart (the list lives in the CA directory)
    assert auth.revocations.add("newbie") and not auth.revocations.add("newbie")
    again = JoinAuthority(ca, Revocations.in_ca_dir(ca))
    assert "newbie" in again.revocations
    t2, _ = again.create()
    i2, s2 = parse_token(t2)
    with pytest.raises(PermissionDenied, match="revoked"):
        again.join(i2, csr, mac(s2, i2.encode(), csr))
    with pytest.raises(TlsError, match="lpj1"):
        parse_token("not-a-token")
