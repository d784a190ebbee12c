"""Kueue on the local control plane, for a dev-up spec with `kueue: true` (docs/kueue.md).

`start_kueue` applies the CRDs that hack/kueue/build.sh copied out of Kueue's module
(config/components/crd/bases), writes a Configuration (batch/job and pod integrations,
`waitForPodsReady`, and the resource transformations common/quota.py generates from the
catalog), starts the manager as a local process with the admin kubeconfig, and registers its
webhooks (config/components/webhook/manifests.yaml) at `https://127.0.0.1:<port>` with a
serving certificate from the cluster CA — as hack/dev.py does for InstaSlice's own webhook.

What it leaves out: Kueue's RBAC (the manager runs as admin), its internal certificate
manager and leader election (one local process), the visibility API server, and the webhooks
of integrations it does not enable (their paths would not be served).

Admission order: the API server calls mutating webhook configurations sorted by name. The
dev configurations are `instaslice-dev` and `kueue-dev`, so InstaSlice's runs first;
`register_webhooks(..., first=True)` names Kueue's `0-kueue-dev` so it runs first instead
(the tests prove both orders give the same result).
"""

from __future__ import annotations

import base64
import json
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import yaml

from common.catalog import load_catalog
from common.quota import kueue_resources
from hack.cluster.bins import REPO_ROOT, ask_build_script
from hack.cluster.controlplane import ControlPlane

__all__ = [
    "KUEUE_NAMESPACE",
    "KueueSettings",
    "find_kueue_dir",
    "install_crds",
    "kueue_config",
    "register_webhooks",
    "unregister_webhooks",
]

BUILD_SCRIPT: Final = REPO_ROOT / "hack" / "kueue" / "build.sh"
KUEUE_NAMESPACE: Final = "kueue-system"
WEBHOOK_NAMES: Final = ("kueue-dev", "0-kueue-dev")
VALIDATING_NAME: Final = "kueue-dev"
# The webhooks of the integrations enabled below, and of Kueue's own objects.
_SERVED_PATHS: Final = ("-kueue-x-k8s-io-", "-batch-v1-job", "--v1-pod")
# Never send these namespaces' pods to Kueue (config/default does the same with a patch).
_SYSTEM_NAMESPACES: Final = ["kube-system", KUEUE_NAMESPACE, "instaslice-system"]


@dataclass(frozen=True)
class KueueSettings:
    """What the dev Kueue runs with (the spec's `kueue: true` takes these defaults)."""

    # An admitted workload whose pods are not all Ready within this is evicted and requeued
    # (Kueue's waitForPodsReady): what frees quota InstaSlice cannot use (docs/kueue.md).
    pods_ready_timeout_s: int = 30
    requeue_backoff_base_s: int = 5
    # The webhook runs with --slot-accounting: Jobs are charged instaslice.io/memory-slots too
    # (common/quota.py). Off, nothing is added that a quota in NVIDIA's names does not cover.
    slot_accounting: bool = False


def find_kueue_dir() -> Path:
    """The built Kueue (bin/kueue, config/); `make kube-bins` builds it."""
    return ask_build_script(
        BUILD_SCRIPT, "--print-dir", "hack/kueue/build.sh: cold ~15 min on 2 cores"
    )


def kueue_config(
    settings: KueueSettings, *, webhook_port: int, health_port: int, certs: Path
) -> dict[str, Any]:
    """Kueue's Configuration (config.kueue.x-k8s.io/v1beta2) for the dev cluster."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": KUEUE_NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},  # off: nothing scrapes it here
        "webhook": {"port": webhook_port, "host": "127.0.0.1", "certDir": str(certs)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "integrations": {"frameworks": ["batch/job", "pod"]},
        # the visibility API server needs serving certificates at /visibility and an APIService
        "featureGates": {"VisibilityOnDemand": False},
        "managedJobsNamespaceSelector": {
            "matchExpressions": [
                {
                    "key": "kubernetes.io/metadata.name",
                    "operator": "NotIn",
                    "values": _SYSTEM_NAMESPACES,
                }
            ]
        },
        "waitForPodsReady": {
            "timeout": f"{settings.pods_ready_timeout_s}s",
            "blockAdmission": False,
            "requeuingStrategy": {
                "timestamp": "Eviction",
                "backoffBaseSeconds": settings.requeue_backoff_base_s,
                "backoffMaxSeconds": settings.requeue_backoff_base_s * 4,
            },
        },
        "resources": kueue_resources(load_catalog(), slot_accounting=settings.slot_accounting),
    }


# Kueue v0.17 without its internal certificate manager reads a metrics serving certificate from
# this fixed path at start and exits without it (cmd/kueue/main.go), even with metrics off.
METRICS_CERTS: Final = Path("/etc/kueue/metrics/certs")


def ensure_metrics_cert(cert_pem: bytes, key_pem: bytes, where: Path = METRICS_CERTS) -> None:
    """Write a certificate there if there is none (never replaced: metrics are off here, any
    valid pair will do, and another dev cluster on this machine may be using the one there)."""
    if (where / "tls.crt").is_file() and (where / "tls.key").is_file():
        return
    try:
        where.mkdir(parents=True, exist_ok=True)
        (where / "tls.key").write_bytes(key_pem)
        (where / "tls.crt").write_bytes(cert_pem)
    except OSError as exc:
        raise RuntimeError(
            f"Kueue needs a certificate at {where}/tls.{{crt,key}} to start and this user cannot "
            f"write one ({exc}); create it once as root (any valid pair)"
        ) from None


def install_crds(cp: ControlPlane, kueue_dir: Path, timeout_s: float = 60.0) -> None:
    """Apply Kueue's CRDs and its namespace; return once every CRD is Established."""
    docs = [
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": KUEUE_NAMESPACE},
        }
    ]
    names = []
    for f in sorted((kueue_dir / "config" / "crd" / "bases").glob("*.yaml")):
        doc = yaml.safe_load(f.read_text())
        names.append(doc["metadata"]["name"])
        docs.append(doc)
    cp.kubectl(
        "apply", "--server-side", "--force-conflicts", "-f", "-", stdin=yaml.safe_dump_all(docs)
    )
    deadline = time.monotonic() + timeout_s
    jsonpath = '{range .items[*]}{.metadata.name}={.status.conditions[?(@.type=="Established")].status}{"\\n"}{end}'  # noqa: E501
    while True:
        out = cp.kubectl("get", "crd", "-o", f"jsonpath={jsonpath}", check=False).stdout
        established = {ln.split("=")[0] for ln in out.split() if ln.endswith("=True")}
        if set(names) <= established:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"Kueue CRDs not Established after {timeout_s}s: {names}")
        time.sleep(0.2)


def _webhooks(kueue_dir: Path, kind: str, port: int, ca_pem: bytes) -> list[dict[str, Any]]:
    path = kueue_dir / "config" / "webhook" / "manifests.yaml"
    doc = next(d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == kind)
    hooks = []
    for hook in doc["webhooks"]:
        svc_path = hook["clientConfig"]["service"]["path"]
        if not any(p in svc_path for p in _SERVED_PATHS):
            continue
        hook["clientConfig"] = {
            "url": f"https://127.0.0.1:{port}{svc_path}",
            "caBundle": base64.b64encode(ca_pem).decode(),
        }
        if svc_path.endswith("-v1-pod"):
            hook["namespaceSelector"] = {
                "matchExpressions": [
                    {
                        "key": "kubernetes.io/metadata.name",
                        "operator": "NotIn",
                        "values": _SYSTEM_NAMESPACES,
                    }
                ]
            }
        hooks.append(hook)
    return hooks


def register_webhooks(cp: ControlPlane, kueue_dir: Path, port: int, *, first: bool = False) -> None:
    """(Re)register Kueue's webhooks; `first`: named to sort before InstaSlice's."""
    name = WEBHOOK_NAMES[1] if first else WEBHOOK_NAMES[0]
    mutating = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": _webhooks(kueue_dir, "MutatingWebhookConfiguration", port, cp.ca_cert_pem),
    }
    validating = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": VALIDATING_NAME},
        "webhooks": _webhooks(kueue_dir, "ValidatingWebhookConfiguration", port, cp.ca_cert_pem),
    }
    items = {"kind": "List", "apiVersion": "v1", "items": [mutating, validating]}
    cp.kubectl("apply", "-f", "-", stdin=json.dumps(items))
    other = WEBHOOK_NAMES[0] if first else WEBHOOK_NAMES[1]
    cp.kubectl("delete", "mutatingwebhookconfiguration", other, "--ignore-not-found")


def unregister_webhooks(cp: ControlPlane) -> None:
    """Best effort (the API server may be gone already)."""
    cp.kubectl("delete", "mutatingwebhookconfiguration", *WEBHOOK_NAMES, "--ignore-not-found",
               check=False)  # fmt: skip
    cp.kubectl("delete", "validatingwebhookconfiguration", VALIDATING_NAME, "--ignore-not-found",
               check=False)  # fmt: skip


def wait_ready(health_port: int, alive: Any, log: str, timeout_s: float = 120.0) -> None:
    """Until the manager's /readyz answers 200 (its webhook server is then serving)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"kueue exited; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{health_port}/readyz", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"Kueue not ready after {timeout_s}s; see {log}")
