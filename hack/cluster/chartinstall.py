"""`install: chart` (docs/contract.md §5): InstaSlice installed the way an administrator does,
on the local control plane's real node (hack/cluster/realnode.py).

`install_chart(...)`: build the two images from the Containerfiles (hack/images.py), import
them into the real node's containerd (`ctr -n k8s.io images import`), then
`helm upgrade --install instaslice charts/instaslice` with the values of `chart_values`: the
webhook/allocator Deployment and the node-agent DaemonSet run as containers on the real node
only (nodeSelector on its hostname, toleration of its taint), the images never pulled, the
agent on the NVML emulator (`testing.emulator`, state shared with the emulated agent that
serves the KWOK nodes from outside the cluster), its host paths the real node's own.

The install is docs/install.md's "Helm without cert-manager", run as written: its three
marked sh blocks (a CA and serving certificate with openssl; the namespace with Helm's
adoption metadata and the Secret; `helm upgrade --install` with `certificate.source=secret`),
the last with `--values` of the local cluster appended. So the documented commands are the
ones tests/e2e/test_installed.py tests.

Pod networking and the API server's reach are hack/cluster/podnet.py's; this module only
installs. What it does not do: KWOK nodes' agents (KWOK starts no container), cert-manager.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from hack.cluster.bins import REPO_ROOT, find_helm
from hack.cluster.controlplane import ControlPlane
from hack.cluster.nodes import REAL_NODE_TAINT
from hack.cluster.realnode import DEVICE_PLUGIN_DIR, RealNode
from hack.images import Built, build_images

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
INSTALL_DOC: Final = REPO_ROOT / "docs" / "install.md"
MIG_CAPABLE: Final = "nvidia.com/mig.capable"
WORKLOADS: Final = ("deployment/instaslice-webhook", "daemonset/instaslice-nodeagent")


class ChartInstallError(RuntimeError):
    """A step of the chart install failed; the message says which and why."""


def chart_values(
    *,
    node: str,
    root: Path,
    gpu_state: Path,
    images: Mapping[str, Built],
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The values of a dev install on the real node `node` whose files live under `root`
    (hack/cluster/realnode_config.Layout); `extra` is merged on top (one level deep)."""
    key, value, effect = REAL_NODE_TAINT
    tolerate = [{"key": key, "operator": "Equal", "value": value, "effect": effect}]
    on_node = {"kubernetes.io/hostname": node}
    values: dict[str, Any] = {
        "images": {
            c: {"repository": b.repository, "tag": b.tag, "pullPolicy": "Never"}
            for c, b in images.items()
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


def doc_block(name: str, doc: Path = INSTALL_DOC) -> str:
    """The ```sh block after `<!-- chartinstall: NAME -->` in docs/install.md."""
    m = re.search(rf"<!-- chartinstall: {name} -->\n```sh\n(.*?)```", doc.read_text(), re.S)
    if m is None:
        raise ChartInstallError(f"{doc}: no sh block marked `chartinstall: {name}`")
    return m.group(1)


def _run_block(cp: ControlPlane, name: str, workdir: Path, append: str = "") -> None:
    """Run the documented block `name` with bash in `workdir`, kubectl and helm on PATH and
    KUBECONFIG the cluster's (`append`: more arguments for its last command)."""
    tools = f"{cp.bin_dir}:{find_helm().parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"
    env = dict(os.environ, PATH=tools, KUBECONFIG=str(cp.kubeconfig))
    env["KUBECACHEDIR"] = str(cp.kubectl_cache_dir)
    script = doc_block(name).rstrip() + (f" {append}" if append else "") + "\n"
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=workdir, env=env,
                          capture_output=True, text=True, check=False)  # fmt: skip
    if proc.returncode != 0:
        raise ChartInstallError(f"docs/install.md `{name}` failed: {proc.stderr.strip()}")


def install_chart(
    cp: ControlPlane,
    real: RealNode,
    gpu_state: Path,
    images_dir: Path,
    *,
    extra_values: Mapping[str, Any] | None = None,
    helm_args: Sequence[str] = (),
) -> dict[str, Any]:
    """Images built and imported, release installed (or upgraded), both workloads rolled
    out; returns the values used."""
    built = build_images(images_dir, images_dir / "build.log")
    for b in built.values():
        real.ctr("images", "import", str(b.tar))
    if not DEVICE_PLUGIN_DIR.is_dir():
        raise ChartInstallError(f"{DEVICE_PLUGIN_DIR} missing: is the real node's kubelet up?")
    values = chart_values(
        node=real.name,
        root=real.root,
        gpu_state=gpu_state,
        images=built,
        extra=extra_values,
    )
    (real.root / "agent-state").mkdir(exist_ok=True)
    # GPU Feature Discovery's label, which the DaemonSet's node affinity selects
    cp.kubectl("label", "node", real.name, f"{MIG_CAPABLE}=true", "--overwrite")
    work = images_dir / "install"
    work.mkdir(exist_ok=True)
    if not (work / "charts").exists():
        (work / "charts").symlink_to(CHART.parent)
    if not (work / "ca.crt").exists():  # one CA per cluster dir: a reinstall keeps it
        _run_block(cp, "certs", work)
    _run_block(cp, "prepare", work)
    (work / "values.json").write_text(json.dumps(values, indent=1))
    _run_block(cp, "install", work, shlex.join(["--values=values.json", *helm_args]))
    rollout(cp)
    return values
