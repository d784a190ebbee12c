"""hack/cluster/pki.py: the test control plane's CA and the leaf certificates it issues carry
the key usages TLS and kube-apiserver expect (a CA signs certificates and CRLs, a leaf only
signs), and a leaf's groups and SANs are what was asked. Leaves out: the control plane
accepting them (every integration test starts one)."""

from __future__ import annotations

import ipaddress

from cryptography import x509
from cryptography.x509.oid import NameOID

from hack.cluster.pki import CertificateAuthority


def _usage(cert: x509.Certificate) -> tuple[bool, bool, bool]:
    u = cert.extensions.get_extension_for_class(x509.KeyUsage)
    assert u.critical
    return u.value.digital_signature, u.value.key_cert_sign, u.value.crl_sign


def test_ca_and_leaf_key_usages() -> None:
    ca = CertificateAuthority.generate("test-ca")
    assert _usage(ca.cert) == (True, True, True)
    leaf = ca.issue("alice", organizations=["team"], hosts=["127.0.0.1", "localhost"], client=True)
    cert = x509.load_pem_x509_certificate(leaf.cert_pem)
    assert _usage(cert) == (True, False, False)
    assert cert.issuer == ca.cert.subject
    orgs = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
    assert [a.value for a in orgs] == ["team"]
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert sans.get_values_for_type(x509.DNSName) == ["localhost"]
