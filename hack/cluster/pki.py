"""Throwaway PKI for the local control plane: certificates from common/x509.py.

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

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from common.x509 import Kind, Pair, issue, key_pem

__all__ = [
    "CertificateAuthority",
    "IssuedCert",
    "write_service_account_key",
]

_VALIDITY = datetime.timedelta(days=365)


@dataclass(frozen=True)
class IssuedCert(Pair):
    """A certificate and its private key, both PEM."""

    def write(self, cert_path: Path, key_path: Path) -> None:
        cert_path.write_bytes(self.cert_pem)
        key_path.write_bytes(self.key_pem)
        key_path.chmod(0o600)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class CertificateAuthority(IssuedCert):
    """The cluster CA: its certificate and key, able to issue leaf certificates."""

    @classmethod
    def generate(cls, common_name: str = "instaslice-local-ca") -> CertificateAuthority:
        now = datetime.datetime.now(datetime.UTC)
        ca = issue(Kind.CA, common_name, now=now, valid_for=10 * _VALIDITY)
        return cls(ca.cert_pem, ca.key_pem)

    @classmethod
    def load(cls, cert_path: Path, key_path: Path) -> CertificateAuthority:
        ca = cls(cert_path.read_bytes(), key_path.read_bytes())
        try:
            _ = ca.cert, ca.key  # parse now: a bad file fails here, not at first use
        except TypeError as exc:
            raise TypeError(f"{key_path}: expected an EC private key") from exc
        return ca

    def issue(
        self,
        common_name: str,
        *,
        organizations: Sequence[str] = (),
        hosts: Sequence[str] = (),
        client: bool = False,
        server: bool = False,
    ) -> IssuedCert:
        """Issue a leaf certificate: a `client` or a `server` one.

        `hosts` become SANs (IP addresses or DNS names); `organizations` become O= entries,
        which kube-apiserver reads as the user's groups.
        """
        if client == server:
            raise ValueError("a leaf is either a client or a server certificate")
        pair = issue(
            Kind.CLIENT if client else Kind.SERVER,
            common_name,
            issuer=self,
            organizations=organizations,
            dns=[h for h in hosts if not _is_ip(h)],
            ips=[h for h in hosts if _is_ip(h)],
            now=datetime.datetime.now(datetime.UTC),
            valid_for=_VALIDITY,
        )
        return IssuedCert(pair.cert_pem, pair.key_pem)

    def issue_client(self, user: str, groups: Sequence[str] = ()) -> IssuedCert:
        """A client certificate that kube-apiserver authenticates as `user` in `groups`."""
        return self.issue(user, organizations=groups, client=True)

    def issue_serving(self, hosts: Sequence[str] = ("127.0.0.1", "localhost")) -> IssuedCert:
        """A TLS serving certificate for `hosts` (e.g. a webhook on 127.0.0.1)."""
        return self.issue(hosts[0] if hosts else "localhost", hosts=hosts, server=True)


def write_service_account_key(private_path: Path, public_path: Path) -> None:
    """An RSA key pair for signing (apiserver, KCM) and verifying service-account tokens."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private_path.write_bytes(key_pem(key))
    private_path.chmod(0o600)
    public_path.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
