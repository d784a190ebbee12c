"""The webhook's own serving certificate (`--cert-mode=self`): no cert-manager needed.

As Kueue's internal/cert (open-policy-agent/cert-controller) does: a self-signed CA and a
serving certificate for the webhook Service's DNS names are generated and kept in one Secret
(`tls.crt`, `tls.key`, `ca.crt`, `ca.key`); every replica writes the pair to its
`--cert-file`/`--key-file` (the server re-reads them when they change, webhook/server.py) and
patches the MutatingWebhookConfiguration's `caBundle`. The Secret is the one truth: the
first replica creates it (a losing racer's create or update conflicts and it re-reads), and
every replica watches it, so a rotation by any replica, or an administrator deleting the
Secret, reaches all of them without a restart.

Rotation: when less than `renew_before_s` of the certificate's validity is left, a new CA and
certificate replace both. `ca.crt` then holds the new CA *and* the previous one, so the API
server trusts a replica still serving the old pair until it has read the Secret again.

The pure part (issue, decide, patches) takes `now`; the loop takes the injected clock.
cert-manager (`--cert-mode=files`, the Kubernetes overlay) and OpenShift's service CA (the
same, the OpenShift overlay) stay as they were; the Helm value `certificates.mode` picks.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import structlog
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization

from common.clock import Clock
from common.kubeapi import ApiError, Kube, core_path, group_path
from common.x509 import Kind
from common.x509 import issue as issue_cert

__all__ = [
    "Bundle",
    "SelfCertSettings",
    "ca_bundle_patch",
    "decide",
    "ensure",
    "issue",
    "run_cert_rotation",
]

log = structlog.get_logger("selfcert")
Obj = dict[str, Any]
Action = Literal["keep", "create", "rotate"]
MWC = "admissionregistration.k8s.io/v1"


@dataclass(frozen=True)
class SelfCertSettings:
    namespace: str
    cert_file: Path
    key_file: Path
    secret: str = "instaslice-webhook-tls"
    service: str = "instaslice-webhook"
    webhook_configuration: str = "instaslice"
    validity_s: float = 365 * 86400.0
    renew_before_s: float = 90 * 86400.0
    retry_s: float = 5.0  # after a failed round (API down): try again this much later

    @property
    def dns_names(self) -> tuple[str, ...]:
        svc = f"{self.service}.{self.namespace}"
        return (self.service, svc, f"{svc}.svc", f"{svc}.svc.cluster.local")


@dataclass(frozen=True)
class Bundle:
    """PEM bytes, as they are stored in the Secret."""

    cert: bytes
    key: bytes
    ca: bytes  # the CA's certificate, then the previous CA's while one is kept
    ca_key: bytes


# --- pure ------------------------------------------------------------------------------------


def issue(now: dt.datetime, dns_names: tuple[str, ...], validity_s: float) -> Bundle:
    """A fresh CA and a serving certificate it signed for `dns_names` (common/x509.py: the
    extensions each kind carries), both valid from a minute before `now` (clock skew) until
    `validity_s` after it."""
    valid_for = dt.timedelta(seconds=validity_s)
    ca = issue_cert(Kind.CA, "instaslice-webhook-ca", now=now, valid_for=valid_for)
    leaf = issue_cert(
        Kind.SERVER, dns_names[-1], issuer=ca, dns=dns_names, now=now, valid_for=valid_for
    )
    return Bundle(leaf.cert_pem, leaf.key_pem, ca.cert_pem, ca.key_pem)


def from_secret(secret: Obj | None) -> Bundle | None:
    data = (secret or {}).get("data") or {}
    try:
        parts = [base64.b64decode(data[k]) for k in ("tls.crt", "tls.key", "ca.crt", "ca.key")]
    except (KeyError, ValueError):
        return None
    return Bundle(*parts)


def _valid(b: Bundle, now: dt.datetime, dns_names: tuple[str, ...], renew_before_s: float) -> bool:
    try:
        cert = x509.load_pem_x509_certificate(b.cert)
        ca = x509.load_pem_x509_certificates(b.ca)[0]
        serialization.load_pem_private_key(b.key, None)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, x509.ExtensionNotFound, InvalidSignature):
        return False
    renew_at = cert.not_valid_after_utc - dt.timedelta(seconds=renew_before_s)
    return (
        set(dns_names) <= set(sans.get_values_for_type(x509.DNSName))
        and cert.not_valid_before_utc <= now < renew_at
    )


def decide(secret: Obj | None, now: dt.datetime, s: SelfCertSettings) -> Action:
    """keep the Secret's pair, create the Secret, or rotate (replace) what it holds."""
    if secret is None:
        return "create"
    b = from_secret(secret)
    if b is not None and _valid(b, now, s.dns_names, s.renew_before_s):
        return "keep"
    return "rotate"


def renew_at(b: Bundle, s: SelfCertSettings) -> dt.datetime:
    cert = x509.load_pem_x509_certificate(b.cert)
    return cert.not_valid_after_utc - dt.timedelta(seconds=s.renew_before_s)


def rotated(old: Bundle | None, new: Bundle) -> Bundle:
    """`new`, with the previous CA kept after its own in `ca.crt`."""
    if old is None:
        return new
    try:
        previous = x509.load_pem_x509_certificates(old.ca)[0]
    except ValueError:
        return new
    return Bundle(new.cert, new.key, new.ca + previous.public_bytes(serialization.Encoding.PEM),
                  new.ca_key)  # fmt: skip


def secret_body(b: Bundle, s: SelfCertSettings, resource_version: str | None) -> Obj:
    def enc(v: bytes) -> str:
        return base64.b64encode(v).decode()

    meta: Obj = {
        "name": s.secret,
        "namespace": s.namespace,
        "labels": {"app.kubernetes.io/part-of": "instaslice"},
    }
    if resource_version is not None:
        meta["resourceVersion"] = resource_version
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/tls",
        "metadata": meta,
        "data": {
            "tls.crt": enc(b.cert),
            "tls.key": enc(b.key),
            "ca.crt": enc(b.ca),
            "ca.key": enc(b.ca_key),
        },
    }


def ca_bundle_patch(config: Obj, ca: bytes) -> list[Obj] | None:
    """A JSON patch setting every webhook's caBundle to `ca`, guarded by the object's
    resourceVersion; None when all already hold it."""
    want = base64.b64encode(ca).decode()
    ops: list[Obj] = [
        {"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": want}
        for i, w in enumerate(config.get("webhooks") or [])
        if (w.get("clientConfig") or {}).get("caBundle") != want
    ]
    if not ops:
        return None
    rv = config["metadata"]["resourceVersion"]
    return [{"op": "test", "path": "/metadata/resourceVersion", "value": rv}, *ops]


# --- I/O -------------------------------------------------------------------------------------


def _write(path: Path, data: bytes) -> None:
    """Replace `path` atomically (the server's reloader never sees half a file)."""
    if path.exists() and path.read_bytes() == data:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


async def _secret(kube: Kube, s: SelfCertSettings) -> Obj | None:
    try:
        return await kube.get(core_path("secrets", s.namespace, s.secret))
    except ApiError as exc:
        if exc.not_found:
            return None
        raise


async def _patch_ca_bundle(kube: Kube, s: SelfCertSettings, ca: bytes) -> None:
    path = group_path(MWC, "mutatingwebhookconfigurations", name=s.webhook_configuration)
    for _ in range(5):
        patch = ca_bundle_patch(await kube.get(path), ca)
        if patch is None:
            return
        try:
            await kube.patch(path, patch, kind="json")
        except ApiError as exc:
            if exc.status not in (409, 422):  # the test op failed: someone wrote in between
                raise
        else:
            log.info("webhook caBundle patched", configuration=s.webhook_configuration)
            return
    raise ApiError(409, "Conflict", f"{path}: caBundle not patched after 5 tries")


async def ensure(kube: Kube, s: SelfCertSettings, now: dt.datetime) -> tuple[Bundle, str]:
    """Make the Secret hold a valid pair (creating or rotating it), write it to the files
    and into the webhook configuration; (the pair, the Secret's resourceVersion)."""
    for _ in range(5):
        secret = await _secret(kube, s)
        action = decide(secret, now, s)
        if action == "keep":
            break
        fresh = rotated(from_secret(secret), issue(now, s.dns_names, s.validity_s))
        rv = None if secret is None else secret["metadata"]["resourceVersion"]
        try:
            if secret is None:
                path = core_path("secrets", s.namespace)
                secret = await kube.create(path, secret_body(fresh, s, None))
            else:
                path = core_path("secrets", s.namespace, s.secret)
                secret = await kube.replace(path, secret_body(fresh, s, rv))
        except ApiError as exc:
            if not exc.conflict:  # another replica wrote first: read its pair
                raise
            continue
        log.info("serving certificate issued", action=action, secret=s.secret)
        break
    else:
        raise ApiError(409, "Conflict", f"Secret {s.secret}: no pair after 5 tries")
    assert secret is not None
    b = from_secret(secret)
    assert b is not None
    _write(s.key_file, b.key)
    _write(s.cert_file, b.cert)
    await _patch_ca_bundle(kube, s, b.ca)
    return b, str(secret["metadata"]["resourceVersion"])


async def _changed(kube: Kube, s: SelfCertSettings, rv: str, timeout_s: float) -> None:
    """Return when the Secret changes (or goes), or after `timeout_s`."""
    path = core_path("secrets", s.namespace)
    with_timeout = max(1, int(timeout_s))
    try:
        async with asyncio.timeout(timeout_s + 5):
            async for etype, _ in kube.watch(
                path, rv, timeout_s=with_timeout, fieldSelector=f"metadata.name={s.secret}"
            ):
                if etype in ("MODIFIED", "DELETED", "ADDED"):
                    return
    except TimeoutError:
        return


async def run_cert_rotation(
    kube: Kube, s: SelfCertSettings, clock: Clock, *, first: tuple[Bundle, str] | None = None
) -> None:
    """Keep the pair valid for as long as the webhook runs: after each round, wait for the
    Secret to change or for the renewal time (at most a day, so clock jumps are caught)."""
    state = first
    while True:
        try:
            if state is None:
                state = await ensure(kube, s, clock.wall())
            bundle, rv = state
            wait = (renew_at(bundle, s) - clock.wall()).total_seconds()
            await _changed(kube, s, rv, min(max(wait, 1.0), 86400.0))
        except ApiError as exc:
            log.warning("serving certificate round failed", error=str(exc))
            await clock.sleep(s.retry_s)
        state = None
