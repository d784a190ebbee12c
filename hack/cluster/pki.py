"""Throwaway PKI for the local control plane, generated with `cryptography`.

One CA signs everything: the apiserver's serving certificate, client certificates for the
admin and each component (identity = CN user + O groups, which is how kube-apiserver's x509
authenticator reads them), and, for later tests, webhook serving certificates. A separate RSA
key signs service-account tokens. Keys are ECDSA P-256 (fast to generate, accepted by every
Kubernetes component); the service-account key stays RSA because RS256 is what every token
consumer expects. Nothing here is meant to be secure: certificates live a year, keys sit in
plain files under the cluster's work dir.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from certs.make import key_usage

__all__ = [
    "CertificateAuthority",
    "IssuedCert",
    "write_service_account_key",
]

_VALIDITY = datetime.timedelta(days=365)
_BACKDATE = datetime.timedelta(minutes=5)  # tolerate small clock skew between processes


@dataclass(frozen=True)
class IssuedCert:
    """A certificate and its private key, both PEM."""

    cert_pem: bytes
    key_pem: bytes

    def write(self, cert_path: Path, key_path: Path) -> None:
        cert_path.write_bytes(self.cert_pem)
        key_path.write_bytes(self.key_pem)
        key_path.chmod(0o600)


def _key_pem(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


@dataclass(frozen=True)
class CertificateAuthority:
    """The cluster CA: its certificate and key, able to issue leaf certificates."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    @property
    def key_pem(self) -> bytes:
        return _key_pem(self.key)

    @classmethod
    def generate(cls, common_name: str = "instaslice-local-ca") -> CertificateAuthority:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _BACKDATE)
            .not_valid_after(now + 10 * _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(key_usage(ca=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .sign(key, hashes.SHA256())
        )
        return cls(cert=cert, key=key)

    @classmethod
    def load(cls, cert_path: Path, key_path: Path) -> CertificateAuthority:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise TypeError(f"{key_path}: expected an EC private key")
        return cls(cert=cert, key=key)

    def write(self, cert_path: Path, key_path: Path) -> None:
        IssuedCert(self.cert_pem, self.key_pem).write(cert_path, key_path)

    def issue(
        self,
        common_name: str,
        *,
        organizations: Sequence[str] = (),
        hosts: Sequence[str] = (),
        client: bool = False,
        server: bool = False,
    ) -> IssuedCert:
        """Issue a leaf certificate.

        `hosts` become SANs (IP addresses or DNS names); `organizations` become O= entries,
        which kube-apiserver reads as the user's groups.
        """
        key = ec.generate_private_key(ec.SECP256R1())
        attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
        attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
        usages = []
        if client:
            usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
        if server:
            usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(attrs))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _BACKDATE)
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(key_usage(ca=False), critical=True)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), False
            )
        )
        if usages:
            builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        if hosts:
            sans: list[x509.GeneralName] = []
            for h in hosts:
                try:
                    sans.append(x509.IPAddress(ipaddress.ip_address(h)))
                except ValueError:
                    sans.append(x509.DNSName(h))
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        return IssuedCert(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))

    def issue_client(self, user: str, groups: Sequence[str] = ()) -> IssuedCert:
        """A client certificate that kube-apiserver authenticates as `user` in `groups`."""
        return self.issue(user, organizations=groups, client=True)

    def issue_serving(self, hosts: Sequence[str] = ("127.0.0.1", "localhost")) -> IssuedCert:
        """A TLS serving certificate for `hosts` (e.g. a webhook on 127.0.0.1)."""
        return self.issue(hosts[0] if hosts else "localhost", hosts=hosts, server=True)


def write_service_account_key(private_path: Path, public_path: Path) -> None:
    """An RSA key pair for signing (apiserver, KCM) and verifying service-account tokens."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private_path.write_bytes(_key_pem(key))
    private_path.chmod(0o600)
    public_path.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
