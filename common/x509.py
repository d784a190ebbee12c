"""The one place InstaSlice builds an X.509 certificate: a key plus a self-signed CA, or a
leaf (serving or client) that a CA signs.

Every certificate we make comes from here: the development CA and webhook pair
(certs/make.py), the webhook's self-managed pair (webhook/selfcert.py), the metrics ports'
throwaway pair (common/metricstls.py) and the test control plane's PKI
(hack/cluster/pki.py). docs/security.md ("Transport, containers, logs") describes the uses.

Each kind carries one fixed set of extensions, the RFC 5280 profile that strict verifiers
(OpenSSL's `X509_V_FLAG_X509_STRICT`, Python's `ssl.VERIFY_X509_STRICT`) accept:

- CA: basicConstraints `CA:TRUE, pathlen:0` (critical; it signs leaves only), keyUsage
  digitalSignature + keyCertSign + cRLSign (critical), subjectKeyIdentifier.
- server / client leaf: basicConstraints `CA:FALSE` (critical), keyUsage digitalSignature
  (critical; ECDSA keys sign, they never encipher), extendedKeyUsage serverAuth or
  clientAuth only, subjectAltName (DNS names, then IPs; a server needs one), and the
  authorityKeyIdentifier of its CA.

Keys are ECDSA P-256, signatures SHA-256. A certificate is valid from one minute before `now`
(clock skew between this host and its peers) until `now + valid_for`. What this module
deliberately does not do: write files, load CA files, or decide lifetimes; callers do.
"""

from __future__ import annotations

import datetime as dt
import enum
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["BACKDATE", "Kind", "Pair", "issue", "key_pem"]

BACKDATE = dt.timedelta(minutes=1)

IpLike = str | ipaddress.IPv4Address | ipaddress.IPv6Address


class Kind(enum.Enum):
    """What a certificate is for; each kind has one fixed set of extensions."""

    CA = "ca"
    SERVER = "server"
    CLIENT = "client"


_EKU = {Kind.SERVER: ExtendedKeyUsageOID.SERVER_AUTH, Kind.CLIENT: ExtendedKeyUsageOID.CLIENT_AUTH}


@dataclass(frozen=True)
class Pair:
    """A certificate and its private key (PKCS#8, unencrypted), both PEM."""

    cert_pem: bytes
    key_pem: bytes

    @property
    def cert(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.cert_pem)

    @property
    def key(self) -> ec.EllipticCurvePrivateKey:
        key = serialization.load_pem_private_key(self.key_pem, password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise TypeError("expected an EC private key (as common.x509 makes)")
        return key


def key_pem(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    """PKCS#8, unencrypted (an RSA key too: the test control plane signs tokens with one)."""
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def issue(
    kind: Kind,
    common_name: str,
    *,
    now: dt.datetime,
    valid_for: dt.timedelta,
    issuer: Pair | None = None,
    dns: Sequence[str] = (),
    ips: Sequence[IpLike] = (),
    organizations: Sequence[str] = (),
) -> Pair:
    """A fresh key and its certificate of `kind`: a CA signs itself (no `issuer`), a leaf is
    signed by `issuer`. `organizations` become O= entries (kube-apiserver reads them as a
    client's groups); `dns` and `ips` become the subjectAltName."""
    if (kind is Kind.CA) != (issuer is None):
        raise ValueError("a CA signs itself; a leaf needs an issuer")
    if kind is Kind.CA and (dns or ips):
        raise ValueError("a CA names no host")
    if kind is Kind.SERVER and not dns and not ips:
        raise ValueError("a serving certificate needs at least one DNS name or IP address")
    key = ec.generate_private_key(ec.SECP256R1())
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
    subject = x509.Name([*attrs, x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + valid_for)
    )
    if issuer is None:
        signer = key
        builder = (
            builder.issuer_name(subject)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_key_usage(ca=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        )
    else:
        signer = issuer.key
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        builder = (
            builder.issuer_name(issuer.cert.subject)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(ca=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([_EKU[kind]]), critical=False)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(signer.public_key()), False
        )
    cert = builder.sign(signer, hashes.SHA256())
    return Pair(cert.public_bytes(serialization.Encoding.PEM), key_pem(key))
