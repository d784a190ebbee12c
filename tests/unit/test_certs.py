"""certs.make: the development CA and webhook serving certificate tool.

Covers: the CA is a CA, the serving certificate chains to it with the SANs asked for and
serverAuth only, TLS between a server and a client trusting only that CA works for the IP and
DNS SANs and fails for another name, the CLI writes the four files (keys 0600), reuses an
existing CA, prints the base64 bundle, and refuses bad arguments.
Leaves out: cert-manager (manifests only).
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import ssl
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from certs.make import KeyPair, ca_bundle, main, make_ca, make_serving_cert, write_pair
from common.x509 import BACKDATE
from testkit.tls import handshake


def _cert(pem: bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem)


def test_ca_and_serving_certificate() -> None:
    now = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    ca = make_ca(now=now)
    c = _cert(ca.cert_pem)
    assert c.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    leaf = make_serving_cert(ca, ["svc.ns.svc", "localhost"], ["127.0.0.1", "::1"], now=now)
    lc = _cert(leaf.cert_pem)
    lc.verify_directly_issued_by(c)
    sans = lc.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["svc.ns.svc", "localhost"]
    assert sans.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    ]
    eku = lc.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert not lc.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    # valid from a minute before `now` (clock skew) for 90 days from `now`
    assert lc.not_valid_after_utc - now == dt.timedelta(days=90)
    assert now - lc.not_valid_before_utc == BACKDATE


def test_serving_certificate_needs_a_name() -> None:
    with pytest.raises(ValueError, match="at least one"):
        make_serving_cert(make_ca())


def _handshake(tmp: Path, ca: KeyPair, leaf: KeyPair, host: str) -> None:
    """An in-memory TLS handshake: server with `leaf`, client trusting only `ca`."""
    write_pair(leaf, tmp / "tls.crt", tmp / "tls.key")
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(tmp / "tls.crt", tmp / "tls.key")
    handshake(server, ssl.create_default_context(cadata=ca.cert_pem.decode()), host)


def test_tls_handshake_trusts_the_sans_only(tmp_path: Path) -> None:
    ca = make_ca()
    leaf = make_serving_cert(ca, ["webhook.test"], ["127.0.0.1"])
    _handshake(tmp_path, ca, leaf, "127.0.0.1")
    _handshake(tmp_path, ca, leaf, "webhook.test")
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(tmp_path, ca, leaf, "other.test")
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(tmp_path, make_ca(), leaf, "127.0.0.1")


def test_cli_writes_files_and_reuses_the_ca(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "pki"
    assert main(["--out", str(out), "--dns", "a.b.svc", "--ip", "127.0.0.1"]) == 0
    bundle = capsys.readouterr().out.strip()
    assert base64.b64decode(bundle) == (out / "ca.crt").read_bytes()
    for name in ("ca.key", "tls.key"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o600
    first_leaf = (out / "tls.crt").read_bytes()
    ca = KeyPair((out / "ca.crt").read_bytes(), (out / "ca.key").read_bytes())
    assert main(["--out", str(out), "--dns", "a.b.svc", "--days", "7"]) == 0
    assert capsys.readouterr().out.strip() == ca_bundle(ca)  # same CA
    leaf = _cert((out / "tls.crt").read_bytes())
    assert (out / "tls.crt").read_bytes() != first_leaf
    leaf.verify_directly_issued_by(_cert(ca.cert_pem))
    assert leaf.not_valid_after_utc - leaf.not_valid_before_utc == dt.timedelta(days=7) + BACKDATE
    assert not list(out.glob(".*.tmp"))


@pytest.mark.parametrize(
    "argv",
    [
        ["--out", "X"],
        ["--out", "X", "--ip", "not-an-ip"],
        ["--out", "X", "--dns", "a", "--ca-cert", "/nonexistent/ca.crt"],
    ],
)
def test_cli_refuses_bad_arguments(tmp_path: Path, argv: list[str]) -> None:
    argv = [a.replace("X", str(tmp_path / "o")) for a in argv]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
