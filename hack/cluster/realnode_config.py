"""The real node's files, as pure functions of where it lives (hack/cluster/realnode.py runs
them): the directory layout, containerd's config, NVIDIA's runtime config, the kubelet's
configuration and command line. No I/O here, so tests read them without starting anything.

Each setting that is not a default says why next to it; docs/control-plane.md ("The real
node") has the obstacles of this VM behind them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from hack.cluster.ociimage import PAUSE_IMAGE

__all__ = [
    "NVIDIA_RUNTIME",
    "RUNC",
    "SHIM_SOCKET_DIR",
    "Layout",
    "Runtime",
    "containerd_toml",
    "kubelet_argv",
    "kubelet_configuration",
    "nvidia_runtime_toml",
]

RUNC: Final = Path("/usr/sbin/runc")  # Debian's runc package
# containerd limits its shim socket dir to 42 characters, too short for a path under a test's
# tmp dir; one real node per machine, so one fixed short dir
SHIM_SOCKET_DIR: Final = Path("/run/instaslice-realnode")
NVIDIA_RUNTIME: Final = "nvidia"
# runc: containerd's default runtime is runc. nvidia: NVIDIA's container runtime (CDI mode)
# in front of runc, as the GPU Operator configures it (the env binding mode needs it).
Runtime = Literal["runc", "nvidia"]


@dataclass(frozen=True)
class Layout:
    """Where one real node keeps everything: its own root, nothing in /run/containerd or
    /var/lib/containerd; only the kubelet's device-plugin dir is host-wide."""

    root: Path

    @property
    def cdi_dir(self) -> Path:
        """containerd's `cdi_spec_dirs` (and NVIDIA's runtime's spec dir): the agent's CDI dir."""
        return self.root / "cdi"

    @property
    def dev_root(self) -> Path:
        return self.root / "dev"

    @property
    def kubelet_root(self) -> Path:
        return self.root / "kubelet"

    @property
    def pod_resources_socket(self) -> Path:
        return self.kubelet_root / "pod-resources" / "kubelet.sock"

    @property
    def containerd_socket(self) -> Path:
        return self.root / "run" / "containerd.sock"

    @property
    def runc_root(self) -> Path:
        return self.root / "run" / "runc"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def nvidia_wrapper(self) -> Path:
        """NVIDIA's runtime behind a script that names its config file (the shim execs the
        runtime binary with no way to pass one)."""
        return self.root / "nvidia-container-runtime"

    @property
    def nvidia_config(self) -> Path:
        return self.root / "nvidia-container-runtime.toml"


def containerd_toml(layout: Layout, runtime: Runtime) -> str:
    r = layout.root
    nvidia = f"""
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.{NVIDIA_RUNTIME}]
        runtime_type = 'io.containerd.runc.v2'
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.{NVIDIA_RUNTIME}.options]
          BinaryName = '{layout.nvidia_wrapper}'
          Root = '{layout.runc_root}'
          SystemdCgroup = false"""
    default = NVIDIA_RUNTIME if runtime == "nvidia" else "runc"
    # version 3: 2.4's default is 4; 3 is migrated at load with a warning only
    # restrict_oom_score_adj: this VM's root lacks CAP_SYS_RESOURCE, so the kubelet's negative
    # oom_score_adj for the sandbox fails every pod; clamped to containerd's own score
    return f"""version = 3
root = '{r / "containerd" / "root"}'
state = '{r / "containerd" / "state"}'
temp = '{r / "containerd" / "tmp"}'
imports = []
[grpc]
  address = '{layout.containerd_socket}'
[ttrpc]
  address = '{layout.containerd_socket}.ttrpc'
[plugins]
  [plugins.'io.containerd.cri.v1.images']
    snapshotter = 'overlayfs'
    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = '{PAUSE_IMAGE}'
    [plugins.'io.containerd.cri.v1.images'.registry]
      config_path = ''
  [plugins.'io.containerd.cri.v1.runtime']
    cdi_spec_dirs = ['{layout.cdi_dir}']
    netns_mounts_under_state_dir = true
    restrict_oom_score_adj = true
    tolerate_missing_hugetlb_controller = true
    disable_hugetlb_controller = true
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = '{default}'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
        runtime_type = 'io.containerd.runc.v2'
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
          BinaryName = '{RUNC}'
          Root = '{layout.runc_root}'
          SystemdCgroup = false{nvidia}
    [plugins.'io.containerd.cri.v1.runtime'.cni]
      bin_dirs = ['{r / "cni" / "bin"}']
      conf_dir = '{r / "cni" / "net.d"}'
      max_conf_num = 1
  [plugins.'io.containerd.grpc.v1.cri']
    disable_tcp_service = true
    stream_server_address = '127.0.0.1'
    stream_server_port = '0'
  [plugins.'io.containerd.internal.v1.opt']
    path = '{r / "containerd" / "opt"}'
  [plugins.'io.containerd.nri.v1.nri']
    disable = true
  [plugins.'io.containerd.shim.v1.manager']
    socket_dir = '{SHIM_SOCKET_DIR}'
"""


def nvidia_runtime_toml(layout: Layout) -> str:
    """NVIDIA's container runtime in CDI mode, reading our CDI dir; it accepts
    NVIDIA_VISIBLE_DEVICES from unprivileged containers (what the env binding needs)."""
    return f"""accept-nvidia-visible-devices-envvar-when-unprivileged = true
accept-nvidia-visible-devices-as-volume-mounts = false
[nvidia-container-runtime]
debug = '{layout.logs / "nvidia-container-runtime.log"}'
log-level = 'debug'
mode = 'cdi'
runtimes = ['{RUNC}']
[nvidia-container-runtime.modes.cdi]
spec-dirs = ['{layout.cdi_dir}']
default-kind = 'nvidia.com/gpu'
annotation-prefixes = ['cdi.k8s.io/']
"""


def kubelet_configuration(
    layout: Layout,
    *,
    port: int,
    healthz_port: int,
    taints: Sequence[Mapping[str, str]],
    max_pods: int,
) -> dict[str, Any]:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": False,  # 1.37 refuses cgroup v1 otherwise; this VM has v1
        "cgroupDriver": "cgroupfs",
        "cgroupsPerQOS": True,
        "containerRuntimeEndpoint": f"unix://{layout.containerd_socket}",
        # loopback only: anonymous + AlwaysAllow (the apiserver has no kubelet client cert)
        "address": "127.0.0.1",
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        "authentication": {
            "anonymous": {"enabled": True},
            "webhook": {"enabled": False},
            "x509": {"clientCAFile": str(layout.root / "ca.crt")},
        },
        "authorization": {"mode": "AlwaysAllow"},
        "failSwapOn": False,
        "podLogsDir": str(layout.root / "pod-logs"),
        "staticPodPath": "",
        "clusterDNS": [],
        "resolvConf": "/etc/resolv.conf",
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
        "registerNode": True,
        "registerWithTaints": [dict(t) for t in taints],
        "maxPods": max_pods,
        "evictionHard": {"memory.available": "100Mi"},
        # the imported images cannot be pulled again: never garbage-collect them
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        # device-plugin capacity reaches the Node at the next status update: keep it short
        "nodeStatusUpdateFrequency": "2s",
    }


def kubelet_argv(layout: Layout, kubelet: Path, name: str, labels: Mapping[str, str]) -> list[str]:
    return [
        str(kubelet),
        f"--config={layout.root / 'kubelet-config.json'}",
        f"--kubeconfig={layout.root / 'kubelet.kubeconfig'}",
        f"--root-dir={layout.kubelet_root}",
        f"--cert-dir={layout.root / 'kubelet-pki'}",  # its default ignores --root-dir
        f"--hostname-override={name}",
        # addresses are left to a cloud controller, which RealNode plays once (module doc)
        "--cloud-provider=external",
        f"--node-labels={','.join(f'{k}={v}' for k, v in sorted(labels.items()))}",
        "--v=2",
    ]
