"""TLS for `/metrics` where metrics auth is on (`--metrics-auth`): a bearer token must not
cross the network in clear text.

The webhook serves its metrics port with its admission serving pair; the node agent has no
certificate of its own, so, as kube-rbac-proxy does without one, it serves a pair signed by a
throwaway CA, made at start by common/x509.py (in memory: the key is written only to a private
temporary directory for `load_cert_chain` and removed at once). Scrapers therefore skip
verification of the node agent's certificate (the shipped PodMonitor says so:
`insecureSkipVerify`); the token's confidentiality is what TLS buys here, the authorization is
the TokenReview's.
"""

from __future__ import annotations

import datetime as dt
import ssl
import tempfile
from pathlib import Path

from common.x509 import Kind, issue

__all__ = ["self_signed_context", "serving_chain"]


def serving_chain(name: str, *, days: int) -> tuple[bytes, bytes]:
    """A serving certificate for `name` signed by a throwaway CA whose key is dropped at once
    (what client-go's GenerateSelfSignedCertKey makes: a serverAuth leaf, not a self-signed
    certificate that is also a CA): (the chain PEM, leaf then CA; the leaf's key PEM)."""
    now, valid_for = dt.datetime.now(dt.UTC), dt.timedelta(days=days)
    ca = issue(Kind.CA, f"{name}-ca", now=now, valid_for=valid_for)
    leaf = issue(Kind.SERVER, name, issuer=ca, dns=[name], now=now, valid_for=valid_for)
    return leaf.cert_pem + ca.cert_pem, leaf.key_pem


def self_signed_context(name: str, *, days: int = 3650) -> ssl.SSLContext:
    """A TLS 1.2+ server context with a fresh `serving_chain` for `name`."""
    chain, key = serving_chain(name, days=days)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    with tempfile.TemporaryDirectory(prefix="instaslice-metrics-tls-") as tmp:
        crt, pem = Path(tmp, "tls.crt"), Path(tmp, "tls.key")
        crt.write_bytes(chain)
        pem.touch(mode=0o600)
        pem.write_bytes(key)
        ctx.load_cert_chain(crt, pem)
    return ctx
