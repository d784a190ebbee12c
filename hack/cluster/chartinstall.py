"""`install: chart` (docs/contract.md §5): InstaSlice installed the way an administrator does,
on the local control plane's real node (hack/cluster/realnode.py).

`install_chart(...)`: build the two images from the Containerfiles (hack/images.py), import
them into the real node's containerd (`ctr -n k8s.io images import`), then
`helm upgrade --install instaslice charts/instaslice` with the values of `chart_values`: the
webhook/allocator Deployment and the node-agent DaemonSet run as containers on the real node
only (nodeSelector on its hostname, toleration of its taint), the images never pulled, the
agent on the NVML emulator (`testing.emulator`, state shared with the emulated agent that
serves the KWOK nodes from outside the cluster), its host paths the real node's own. The
webhook's serving certificate is the no-cert-manager path of docs/install.md: a Secret from
the cluster CA and `certificate.source=secret` with that CA as caBundle. The namespace is
created first (with Helm's adoption metadata) so the Secret exists before the pods start.

Pod networking and the API server's reach are hack/cluster/podnet.py's; this module only
installs. What it does not do: KWOK nodes' agents (KWOK starts no container), cert-manager.
"""

from __future__ import annotations

import base64
import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from hack.cluster.bins import REPO_ROOT, find_helm
from hack.cluster.controlplane import ControlPlane
from hack.cluster.nodes import REAL_NODE_TAINT
from hack.cluster.realnode import DEVICE_PLUGIN_DIR, RealNode
from hack.images import COMPONENTS, IMAGE_TAG, build_images

__all__ = [
    "CHART",
    "NAMESPACE",
    "RELEASE",
    "ChartInstallError",
    "chart_values",
    "helm",
    "install_chart",
    "rollout",
]

RELEASE: Final = "instaslice"
NAMESPACE: Final = "instaslice-system"
CHART: Final = REPO_ROOT / "charts" / "instaslice"
TLS_SECRET: Final = "instaslice-webhook-tls"
SERVICE_DNS: Final = (
    "instaslice-webhook.instaslice-system.svc",
    "instaslice-webhook.instaslice-system.svc.cluster.local",
)
MIG_CAPABLE: Final = "nvidia.com/mig.capable"
WORKLOADS: Final = ("deployment/instaslice-webhook", "daemonset/instaslice-nodeagent")


class ChartInstallError(RuntimeError):
    """A step of the chart install failed; the message says which and why."""


def chart_values(
    *, node: str, root: Path, gpu_state: Path, ca_pem: bytes, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The values of a dev install on the real node `node` whose files live under `root`
    (hack/cluster/realnode_config.Layout); `extra` is merged on top (one level deep)."""
    key, value, effect = REAL_NODE_TAINT
    tolerate = [{"key": key, "operator": "Equal", "value": value, "effect": effect}]
    on_node = {"kubernetes.io/hostname": node}
    values: dict[str, Any] = {
        "images": {
            c: {
                "repository": f"localhost/instaslice/instaslice-{c}",
                "tag": IMAGE_TAG,
                "pullPolicy": "Never",
            }
            for c in COMPONENTS
        },
        "webhook": {"nodeSelector": on_node, "tolerations": tolerate},
        "nodeagent": {
            "nodeSelector": on_node,
            "tolerations": tolerate,
            "hostPaths": {
                "cdi": str(root / "cdi"),
                "podResources": str(root / "kubelet" / "pod-resources"),
                "state": str(root / "agent-state"),
            },
        },
        "certificate": {"source": "secret", "caBundle": base64.b64encode(ca_pem).decode()},
        "testing": {
            "emulator": {"enabled": True, "stateDir": str(gpu_state), "devRoot": str(root / "dev")}
        },
    }
    for k, v in (extra or {}).items():
        values[k] = {**values[k], **v} if isinstance(v, dict) and k in values else v
    return values


def helm(cp: ControlPlane, *args: str, timeout_s: float = 300) -> str:
    argv = [str(find_helm()), f"--kubeconfig={cp.kubeconfig}", *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        raise ChartInstallError(f"helm {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout


def rollout(cp: ControlPlane, timeout_s: int = 300) -> None:
    """Until both workloads have rolled out (every pod of the current spec Ready)."""
    for w in WORKLOADS:
        proc = cp.kubectl(
            "-n", NAMESPACE, "rollout", "status", w, f"--timeout={timeout_s}s", check=False
        )
        if proc.returncode != 0:
            raise ChartInstallError(f"{w} did not roll out: {proc.stderr.strip()}")


def _namespace_and_secret(cp: ControlPlane) -> None:
    """The namespace, adoptable by the release, and the webhook's serving certificate in it."""
    meta = {
        "name": NAMESPACE,
        "labels": {"app.kubernetes.io/managed-by": "Helm"},
        "annotations": {
            "meta.helm.sh/release-name": RELEASE,
            "meta.helm.sh/release-namespace": NAMESPACE,
        },
    }
    issued = cp.issue_serving_cert(SERVICE_DNS)
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/tls",
        "metadata": {"name": TLS_SECRET, "namespace": NAMESPACE},
        "data": {
            "tls.crt": base64.b64encode(issued.cert_pem).decode(),
            "tls.key": base64.b64encode(issued.key_pem).decode(),
        },
    }
    body = json.dumps({"apiVersion": "v1", "kind": "List",
                       "items": [{"apiVersion": "v1", "kind": "Namespace", "metadata": meta},
                                 secret]})  # fmt: skip
    cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", stdin=body)


def install_chart(
    cp: ControlPlane,
    real: RealNode,
    gpu_state: Path,
    images_dir: Path,
    *,
    extra_values: dict[str, Any] | None = None,
    helm_args: Sequence[str] = (),
) -> dict[str, Any]:
    """Images built and imported, release installed (or upgraded), both workloads rolled
    out; returns the values used."""
    built = build_images(images_dir, images_dir / "build.log")
    for tar in built.values():
        real.ctr("images", "import", str(tar))
    if not DEVICE_PLUGIN_DIR.is_dir():
        raise ChartInstallError(f"{DEVICE_PLUGIN_DIR} missing: is the real node's kubelet up?")
    values = chart_values(
        node=real.name,
        root=real.root,
        gpu_state=gpu_state,
        ca_pem=cp.ca_cert_pem,
        extra=extra_values,
    )
    (real.root / "agent-state").mkdir(exist_ok=True)
    # GPU Feature Discovery's label, which the DaemonSet's node affinity selects
    cp.kubectl("label", "node", real.name, f"{MIG_CAPABLE}=true", "--overwrite")
    _namespace_and_secret(cp)
    values_file = images_dir / "values.json"
    values_file.write_text(json.dumps(values, indent=1))
    helm(cp, "upgrade", "--install", RELEASE, str(CHART), "--namespace", NAMESPACE,
         f"--values={values_file}", *helm_args)  # fmt: skip
    rollout(cp)
    return values
