"""TLS for `/metrics` where metrics auth is on (`--metrics-auth`): a bearer token must not
cross the network in clear text.

The webhook serves its metrics port with its admission serving pair; the node agent has no
certificate of its own, so, as kube-rbac-proxy does without one, it serves a self-signed pair
made at start (in memory: the key is written only to a private temporary directory for
`load_cert_chain` and removed at once). Scrapers therefore skip verification of the node
agent's certificate (the shipped PodMonitor says so: `insecureSkipVerify`); the token's
confidentiality is what TLS buys here, the authorization is the TokenReview's.
"""

from __future__ import annotations

import datetime as dt
import ssl
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

__all__ = ["self_signed_context"]


def self_signed_context(name: str, *, days: int = 3650) -> ssl.SSLContext:
    """A TLS 1.2+ server context with a fresh self-signed certificate for `name`."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .sign(key, hashes.SHA256())
    )
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    with tempfile.TemporaryDirectory(prefix="instaslice-metrics-tls-") as tmp:
        crt, pem = Path(tmp, "tls.crt"), Path(tmp, "tls.key")
        crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        pem.touch(mode=0o600)
        pem.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        ctx.load_cert_chain(crt, pem)
    return ctx
