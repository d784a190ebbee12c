"""webhook/selfcert.py's pure part: issuing, deciding when to rotate, the caBundle patch.

The loop against a real API server (Secret created, caBundle patched, a rotation reaching a
running server) is tests/integration/test_selfcert.py.
"""

from __future__ import annotations

import base64
import datetime as dt
import ssl
from pathlib import Path

import pytest
from cryptography import x509

from testkit.tls import handshake
from webhook.selfcert import (
    SelfCertSettings,
    ca_bundle_patch,
    decide,
    from_secret,
    issue,
    rotated,
    secret_body,
)

NOW = dt.datetime(2026, 12, 7, 12, 0, tzinfo=dt.UTC)
S = SelfCertSettings(namespace="gpu-ops", cert_file=Path("/x/tls.crt"), key_file=Path("/x/k"))
DAY = 86400.0


def _secret(now: dt.datetime = NOW, settings: SelfCertSettings = S) -> dict[str, object]:
    return secret_body(issue(now, settings.dns_names, settings.validity_s), settings, "1")


def test_issued_pair_serves_the_services_names_and_chains_to_its_ca(tmp_path: Path) -> None:
    b = issue(NOW, S.dns_names, S.validity_s)
    cert = x509.load_pem_x509_certificate(b.cert)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(sans.get_values_for_type(x509.DNSName)) == {
        "instaslice-webhook",
        "instaslice-webhook.gpu-ops",
        "instaslice-webhook.gpu-ops.svc",
        "instaslice-webhook.gpu-ops.svc.cluster.local",
    }
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(b.ca))
    (tmp_path / "c").write_bytes(b.cert)
    (tmp_path / "k").write_bytes(b.key)
    ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
        tmp_path / "c", tmp_path / "k"
    )  # the pair matches: the server can load it
    assert cert.not_valid_after_utc - NOW == dt.timedelta(days=365)


def test_a_strict_client_trusts_the_issued_pair(tmp_path: Path) -> None:
    """OpenSSL's X509_STRICT (Python 3.13's default) wants the CA's subjectKeyIdentifier and
    the leaf's authorityKeyIdentifier, which common/x509.py puts in."""
    b = issue(dt.datetime.now(dt.UTC), S.dns_names, S.validity_s)
    (tmp_path / "c").write_bytes(b.cert)
    (tmp_path / "k").write_bytes(b.key)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(tmp_path / "c", tmp_path / "k")
    client = ssl.create_default_context(cadata=b.ca.decode())
    client.verify_flags |= ssl.VERIFY_X509_STRICT
    handshake(server, client, "instaslice-webhook.gpu-ops.svc")


@pytest.mark.parametrize(
    ("age_days", "action"),
    [(0, "keep"), (274, "keep"), (276, "rotate"), (400, "rotate"), (-2, "rotate")],
    ids=["fresh", "before-renewal", "in-renewal-window", "expired", "not-yet-valid"],
)
def test_rotates_in_the_last_90_days(age_days: float, action: str) -> None:
    secret = _secret(NOW - dt.timedelta(days=age_days))
    assert decide(secret, NOW, S) == action


def test_creates_a_missing_secret_and_rotates_what_it_cannot_use() -> None:
    assert decide(None, NOW, S) == "create"
    assert decide({"data": {"tls.crt": "eA=="}}, NOW, S) == "rotate"  # keys missing
    other = SelfCertSettings(namespace="elsewhere", cert_file=S.cert_file, key_file=S.key_file)
    assert decide(_secret(settings=other), NOW, S) == "rotate"  # another namespace's names
    good = _secret()
    a = issue(NOW, S.dns_names, S.validity_s)  # a CA that did not sign the certificate
    data = dict(good["data"])  # type: ignore[call-overload]
    data["ca.crt"] = base64.b64encode(a.ca).decode()
    assert decide({"data": data}, NOW, S) == "rotate"


def test_rotation_keeps_the_previous_ca_trusted() -> None:
    old = issue(NOW - dt.timedelta(days=300), S.dns_names, S.validity_s)
    fresh = issue(NOW, S.dns_names, S.validity_s)
    new = rotated(old, fresh)
    assert x509.load_pem_x509_certificates(new.ca) == [
        x509.load_pem_x509_certificate(fresh.ca),
        x509.load_pem_x509_certificate(old.ca),
    ]
    assert (new.cert, new.key, new.ca_key) == (fresh.cert, fresh.key, fresh.ca_key)
    assert from_secret(secret_body(new, S, None)) == new
    assert decide(secret_body(new, S, None), NOW, S) == "keep"  # the bundle still verifies


def test_ca_bundle_patch_sets_every_webhook_guarded_by_resource_version() -> None:
    ca = b"CA"
    b64 = base64.b64encode(ca).decode()
    config = {
        "metadata": {"resourceVersion": "7"},
        "webhooks": [{"clientConfig": {"caBundle": b64}}, {"clientConfig": {"service": {}}}],
    }
    assert ca_bundle_patch(config, ca) == [
        {"op": "test", "path": "/metadata/resourceVersion", "value": "7"},
        {"op": "add", "path": "/webhooks/1/clientConfig/caBundle", "value": b64},
    ]
    config["webhooks"][1]["clientConfig"]["caBundle"] = b64  # type: ignore[index]
    assert ca_bundle_patch(config, ca) is None


def test_the_command_line_selects_it() -> None:
    from webhook.main import parse_args

    files = parse_args(["--namespace=gpu-ops"])
    assert files.self_cert is None  # cert-manager / the service CA write the files
    s = parse_args(["--cert-mode=self", "--namespace=gpu-ops", "--cert-file=/t/c",
                    "--key-file=/t/k", "--cert-secret=sec"]).self_cert  # fmt: skip
    assert s is not None
    assert (s.namespace, s.cert_file, s.key_file, s.secret) == (
        "gpu-ops",
        Path("/t/c"),
        Path("/t/k"),
        "sec",
    )
    assert s.webhook_configuration == "instaslice"
    assert "instaslice-webhook.gpu-ops.svc" in s.dns_names
