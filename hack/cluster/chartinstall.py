"""`install: chart` (docs/contract.md §5): InstaSlice installed the way an administrator does,
on the local control plane's real node (hack/cluster/realnode.py).

`install_chart(...)`: build the two images from the Containerfiles (hack/images.py), import
them into the real node's containerd (`ctr -n k8s.io images import`), then install the chart
with the values of `chart_values`: the webhook/allocator Deployment, the node-agent DaemonSet
and the uninstall hooks' Jobs run as containers on the real node only (nodeSelector on its
hostname, toleration of its taint), the images never pulled, the agent on the NVML emulator
(`testing.emulator`, state shared with the emulated agent that serves the KWOK nodes from
outside the cluster), its host directories the real node's own.

The install is docs/install.md's "Helm without cert-manager", run as written: its marked sh
block, `helm install ... --create-namespace` with the self-managed certificate
(`certificates.mode=self`, the default), with `--values` of the local cluster appended to its
helm command. When the release is there already, docs/upgrade.md's "Helm" block (`helm upgrade
--reuse-values` and the rollouts) runs the same way. So the documented commands are the ones
tests/e2e/test_installed.py tests.

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
    "UPGRADE_DOC",
    "ChartInstallError",
    "chart_values",
    "doc_block",
    "helm",
    "install_chart",
    "rollout",
    "with_helm_args",
]

RELEASE: Final = "instaslice"
NAMESPACE: Final = "instaslice-system"
CHART: Final = REPO_ROOT / "charts" / "instaslice"
INSTALL_DOC: Final = REPO_ROOT / "docs" / "install.md"
UPGRADE_DOC: Final = REPO_ROOT / "docs" / "upgrade.md"
BLOCK_TIMEOUT_S: Final = 900  # a documented block: helm's and the rollouts' waits
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
            # the kubelet's --root-dir (realnode_config); its device-plugins dir is fixed
            "kubeletDir": str(root / "kubelet"),
            "hostPaths": {"cdi": str(root / "cdi"), "state": str(root / "agent-state")},
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
    """The ```sh block after `<!-- chartinstall: NAME -->` in `doc`."""
    m = re.search(rf"<!-- chartinstall: {name} -->\n```sh\n(.*?)```", doc.read_text(), re.S)
    if m is None:
        raise ChartInstallError(f"{doc}: no sh block marked `chartinstall: {name}`")
    return m.group(1)


def with_helm_args(block: str, append: str) -> str:
    """`block` with `append` at the end of its one helm command (lines joined by `\\`)."""
    commands = re.split(r"(?<!\\)\n", block.rstrip())
    helms = [i for i, c in enumerate(commands) if c.startswith("helm ")]
    if len(helms) != 1:
        raise ChartInstallError(f"expected one helm command, found {len(helms)}: {block}")
    commands[helms[0]] += f" {append}"
    return "\n".join(commands) + "\n"


def _run_block(cp: ControlPlane, doc: Path, name: str, workdir: Path, append: str) -> None:
    """Run the documented block `name` of `doc` with bash in `workdir`, kubectl and helm on
    PATH and KUBECONFIG the cluster's, `append` added to its helm command."""
    tools = f"{cp.bin_dir}:{find_helm().parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"
    env = dict(os.environ, PATH=tools, KUBECONFIG=str(cp.kubeconfig))
    env["KUBECACHEDIR"] = str(cp.kubectl_cache_dir)
    script = with_helm_args(doc_block(name, doc), append)
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S,
                          check=False)  # fmt: skip
    if proc.returncode != 0:
        raise ChartInstallError(f"docs/{doc.name} `{name}` failed: {proc.stderr.strip()}")


def _installed(cp: ControlPlane) -> bool:
    """Whether the release exists (deployed or not: `helm install` would refuse its name)."""
    try:
        helm(cp, "status", RELEASE, "-n", NAMESPACE)
    except ChartInstallError:
        return False
    return True


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
    (work / "values.json").write_text(json.dumps(values, indent=1))
    append = shlex.join(["--values=values.json", *helm_args])
    if _installed(cp):
        _run_block(cp, UPGRADE_DOC, "upgrade", work, append)
    else:
        _run_block(cp, INSTALL_DOC, "install", work, append)
    rollout(cp)
    return values
