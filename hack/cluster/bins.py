"""Where the control-plane binaries live.

hack/kube/build.sh owns the cache layout; this module only asks it (`--print-bindir`, which
never builds) so Python and shell cannot disagree about the cache key. INSTASLICE_KUBE_BIN_DIR
overrides the lookup, e.g. for binaries built elsewhere.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

__all__ = [
    "BINARIES",
    "NODE_BINARIES",
    "REPO_ROOT",
    "BinariesMissing",
    "find_bin_dir",
    "find_helm",
    "find_node_bin_dir",
    "stages_dir",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "hack" / "kube" / "build.sh"
NODE_BUILD_SCRIPT = REPO_ROOT / "hack" / "kube" / "build-node.sh"
HELM_BUILD_SCRIPT = REPO_ROOT / "hack" / "helm" / "build.sh"
NODE_BINARIES = (
    "kubelet",
    "pause",
    "containerd",
    "ctr",
    "containerd-shim-runc-v2",
    "loopback",
    "nvidia-container-runtime",
)
BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-scheduler",
    "kube-controller-manager",
    "kubectl",
    "kwok",
)


class BinariesMissing(RuntimeError):
    """The binaries are not built yet; `make kube-bins` builds them."""


def ask_build_script(script: Path, flag: str, hint: str) -> Path:
    """The path a build script prints for `flag` (which never builds); BinariesMissing with
    the script's own complaint and `hint` when it has nothing built."""
    proc = subprocess.run([str(script), flag], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise BinariesMissing(f"{proc.stderr.strip()} ({hint})")
    return Path(proc.stdout.strip())


def find_bin_dir() -> Path:
    override = os.environ.get("INSTASLICE_KUBE_BIN_DIR")
    if override:
        bin_dir = Path(override)
    else:
        bin_dir = ask_build_script(
            BUILD_SCRIPT, "--print-bindir", "run `make kube-bins`; cold: ~20 min, once per machine"
        )
    missing = [b for b in BINARIES if not (bin_dir / b).is_file()]
    if missing:
        raise BinariesMissing(f"{bin_dir} lacks {', '.join(missing)}; run `make kube-bins`")
    return bin_dir


def stages_dir(bin_dir: Path) -> Path:
    """KWOK Stage YAMLs that build.sh copied next to the bin dir."""
    return bin_dir.parent / "stages"


def find_node_bin_dir() -> Path:
    """The real node's binaries (hack/kube/build-node.sh); INSTASLICE_NODE_BIN_DIR overrides."""
    override = os.environ.get("INSTASLICE_NODE_BIN_DIR")
    if override:
        bin_dir = Path(override)
    else:
        bin_dir = ask_build_script(NODE_BUILD_SCRIPT, "--print-bindir", "run `make node-bins`")
    missing = [b for b in NODE_BINARIES if not (bin_dir / b).is_file()]
    if missing:
        raise BinariesMissing(f"{bin_dir} lacks {', '.join(missing)}; run `make node-bins`")
    return bin_dir


def find_helm() -> Path:
    """The helm binary (hack/helm/build.sh, run by `make kube-bins`); INSTASLICE_HELM overrides."""
    override = os.environ.get("INSTASLICE_HELM")
    if override:
        helm = Path(override)
    else:
        helm = (
            ask_build_script(
                HELM_BUILD_SCRIPT,
                "--print-bindir",
                "hack/helm/build.sh: ~70 s with a warm Go cache",
            )
            / "helm"
        )
    if not helm.is_file():
        raise BinariesMissing(f"{helm} does not exist; run `make kube-bins`")
    return helm
