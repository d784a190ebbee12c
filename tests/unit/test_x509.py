"""common/x509.py, the one certificate builder, and the four places that use it.

Covers: each kind's extensions (a table), a leaf's names and subject for any DNS names and IP
addresses (hypothesis), the validity window, the refusals, strict verification (OpenSSL's
X509_STRICT) of a leaf against its CA for its names only, and that every caller's
certificates (certs/make.py, webhook/selfcert.py, common/metricstls.py,
hack/cluster/pki.py) carry exactly their kind's extensions.
Leaves out: the API server trusting them (tests/integration/test_selfcert.py, every
integration test's control plane).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import ssl
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.provisional import domains

from certs.make import make_ca, make_serving_cert
from common.metricstls import self_signed_context, serving_chain
from common.x509 import BACKDATE, Kind, Pair, issue
from hack.cluster.pki import CertificateAuthority
from testkit.tls import extensions, handshake, peer_chain_leaf
from webhook.selfcert import issue as selfcert_issue

Extensions = dict[str, tuple[bool, str]]
ALNUM = st.characters(codec="ascii", categories=["L", "N"])
NOW = dt.datetime(2026, 12, 8, 1, 0, tzinfo=dt.UTC)
YEAR = dt.timedelta(days=365)
CA_EXTENSIONS = {
    "BasicConstraints": (True, "ca=True pathlen=0"),
    "KeyUsage": (True, "digital_signature key_cert_sign crl_sign"),
    "SubjectKeyIdentifier": (False, "own"),
}


def leaf_extensions(eku: str, sans: str | None) -> Extensions:
    want = {
        "BasicConstraints": (True, "ca=False pathlen=None"),
        "KeyUsage": (True, "digital_signature"),
        "ExtendedKeyUsage": (False, eku),
        "AuthorityKeyIdentifier": (False, "issuer's"),
    }
    if sans is not None:
        want["SubjectAlternativeName"] = (False, sans)
    return want


def _ca() -> Pair:
    return issue(Kind.CA, "test-ca", now=NOW, valid_for=YEAR)


@pytest.mark.parametrize(
    ("kind", "names", "want"),
    [
        (Kind.CA, {}, CA_EXTENSIONS),
        (
            Kind.SERVER,
            {"dns": ["svc.ns.svc"], "ips": ["127.0.0.1"]},
            leaf_extensions("serverAuth", "svc.ns.svc 127.0.0.1"),
        ),
        (Kind.CLIENT, {}, leaf_extensions("clientAuth", None)),
        (Kind.CLIENT, {"dns": ["node-a"]}, leaf_extensions("clientAuth", "node-a")),
    ],
    ids=["ca", "server", "client", "client-with-names"],
)
def test_each_kind_carries_its_extensions(
    kind: Kind, names: dict[str, list[str]], want: Extensions
) -> None:
    ca = _ca()
    leaf = (
        None if kind is Kind.CA else issue(kind, "x", issuer=ca, now=NOW, valid_for=YEAR, **names)
    )
    pair = leaf or ca
    assert extensions(pair.cert, ca.cert) == want
    pair.cert.verify_directly_issued_by(ca.cert)


def test_valid_from_a_minute_before_now_for_what_the_caller_asks() -> None:
    ca = _ca()
    leaf = issue(Kind.SERVER, "a", issuer=ca, dns=["a"], now=NOW, valid_for=dt.timedelta(days=9))
    for cert, valid_for in ((ca.cert, YEAR), (leaf.cert, dt.timedelta(days=9))):
        assert cert.not_valid_before_utc == NOW - BACKDATE == NOW - dt.timedelta(minutes=1)
        assert cert.not_valid_after_utc == NOW + valid_for


@given(
    dns=st.lists(domains(), max_size=4),
    ips=st.lists(st.ip_addresses(), max_size=3),
    org=st.lists(
        st.text(st.characters(codec="ascii", categories=["L", "N"]), min_size=1), max_size=2
    ),
)
@settings(max_examples=60, deadline=None)
def test_a_leaf_names_exactly_what_it_was_given(
    dns: list[str],
    ips: list[ipaddress.IPv4Address | ipaddress.IPv6Address],
    org: list[str],
) -> None:
    ca = _ca()
    kind = Kind.SERVER if dns or ips else Kind.CLIENT
    cert = issue(kind, "who", issuer=ca, dns=dns, ips=ips, organizations=org, now=NOW,
                 valid_for=YEAR).cert  # fmt: skip
    cert.verify_directly_issued_by(ca.cert)
    assert [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)] == ["who"]
    orgs = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
    assert [a.value for a in orgs] == org
    if not dns and not ips:
        assert "SubjectAlternativeName" not in extensions(cert, ca.cert)
        return
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == dns
    assert sans.get_values_for_type(x509.IPAddress) == ips


def test_refusals() -> None:
    ca = _ca()
    with pytest.raises(ValueError, match="at least one"):
        issue(Kind.SERVER, "x", issuer=ca, now=NOW, valid_for=YEAR)
    with pytest.raises(ValueError, match="needs an issuer"):
        issue(Kind.SERVER, "x", dns=["x"], now=NOW, valid_for=YEAR)
    with pytest.raises(ValueError, match="signs itself"):
        issue(Kind.CA, "x", issuer=ca, now=NOW, valid_for=YEAR)
    with pytest.raises(ValueError, match="names no host"):
        issue(Kind.CA, "x", dns=["x"], now=NOW, valid_for=YEAR)


def _server(tmp: Path, chain: bytes, key: bytes) -> ssl.SSLContext:
    (tmp / "c").write_bytes(chain)
    (tmp / "k").write_bytes(key)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tmp / "c", tmp / "k")
    return ctx


def _strict_client(ca_pem: bytes) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cadata=ca_pem.decode())
    ctx.verify_flags |= ssl.VERIFY_X509_STRICT
    return ctx


def test_a_strict_client_trusts_the_leaf_for_its_names_only(tmp_path: Path) -> None:
    ca = issue(Kind.CA, "ca", now=dt.datetime.now(dt.UTC), valid_for=YEAR)
    leaf = issue(Kind.SERVER, "w", issuer=ca, dns=["w.ns.svc"], ips=["127.0.0.1"],
                 now=dt.datetime.now(dt.UTC), valid_for=YEAR)  # fmt: skip
    server = _server(tmp_path, leaf.cert_pem, leaf.key_pem)
    for host in ("w.ns.svc", "127.0.0.1"):
        handshake(server, _strict_client(ca.cert_pem), host)
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(server, _strict_client(ca.cert_pem), "other.ns.svc")
    other = issue(Kind.CA, "ca", now=dt.datetime.now(dt.UTC), valid_for=YEAR)
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(server, _strict_client(other.cert_pem), "w.ns.svc")


# --- the callers: each certificate they make is of its kind, extension for extension -----


def _pem(pem: bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem)


def _certs_make() -> list[tuple[x509.Certificate, x509.Certificate, Extensions]]:
    ca = make_ca()
    leaf = _pem(make_serving_cert(ca, ["svc.ns.svc"], ["127.0.0.1"]).cert_pem)
    return [
        (_pem(ca.cert_pem), _pem(ca.cert_pem), CA_EXTENSIONS),
        (leaf, _pem(ca.cert_pem), leaf_extensions("serverAuth", "svc.ns.svc 127.0.0.1")),
    ]


def _selfcert() -> list[tuple[x509.Certificate, x509.Certificate, Extensions]]:
    b = selfcert_issue(NOW, ("w", "w.ns.svc"), YEAR.total_seconds())
    ca, leaf = _pem(b.ca), _pem(b.cert)
    return [(ca, ca, CA_EXTENSIONS), (leaf, ca, leaf_extensions("serverAuth", "w w.ns.svc"))]


def _pki() -> list[tuple[x509.Certificate, x509.Certificate, Extensions]]:
    ca = CertificateAuthority.generate()
    apiserver = _pem(
        ca.issue("kube-apiserver", hosts=("127.0.0.1", "localhost"), server=True).cert_pem
    )
    client = _pem(ca.issue_client("alice", ["team"]).cert_pem)
    return [
        (ca.cert, ca.cert, CA_EXTENSIONS),
        (apiserver, ca.cert, leaf_extensions("serverAuth", "localhost 127.0.0.1")),
        (client, ca.cert, leaf_extensions("clientAuth", None)),
    ]


def _metricstls() -> list[tuple[x509.Certificate, x509.Certificate, Extensions]]:
    chain, _ = serving_chain("instaslice-nodeagent-h", days=1)
    leaf, ca = x509.load_pem_x509_certificates(chain)
    return [(ca, ca, CA_EXTENSIONS), (leaf, ca, leaf_extensions("serverAuth", leaf_name(leaf)))]


def leaf_name(cert: x509.Certificate) -> str:
    return str(cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)


@pytest.mark.parametrize("made_by", [_certs_make, _selfcert, _pki, _metricstls])
def test_every_caller_makes_its_kinds_extensions(
    made_by: Callable[[], list[tuple[x509.Certificate, x509.Certificate, Extensions]]],
) -> None:
    for cert, issuer, want in made_by():
        assert extensions(cert, issuer) == want, cert.subject


def test_the_metrics_port_serves_a_leaf_for_its_name() -> None:
    leaf = peer_chain_leaf(self_signed_context("instaslice-nodeagent-h"))
    assert leaf_name(leaf) == "instaslice-nodeagent-h"
    assert leaf.issuer != leaf.subject  # signed by the throwaway CA, not by itself
    got = extensions(leaf, leaf)  # the CA is not at hand: all but the AKI's match
    assert got.pop("AuthorityKeyIdentifier")[0] is False
    want = leaf_extensions("serverAuth", "instaslice-nodeagent-h")
    del want["AuthorityKeyIdentifier"]
    assert got == want
