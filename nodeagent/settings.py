"""The node agent's settings: one frozen dataclass, built from the command line (main.py)
or directly by tests and the dev launcher. Nothing reads the environment at import time."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from common.constants import AGENT_LEASE_DURATION_S, AllocationMode, BindingMode
from common.metricsauth import MetricsAuthLimits
from common.version import VERSION

DEFAULT_CDI_DIR = Path("/var/run/cdi")
DEFAULT_STATE_DIR = Path("/var/lib/instaslice")
# Where the node's NVIDIA CDI spec is looked for, in order: what `nvidia-ctk cdi generate` (or
# the toolkit's nvidia-cdi-refresh service) writes, then what the GPU Operator's toolkit
# container writes (kind management.nvidia.com/gpu; its common edits are the same driver
# mounts and hooks). docs/install.md.
DEFAULT_NVIDIA_CDI_SPECS = (
    Path("/var/run/cdi/nvidia.yaml"),
    Path("/etc/cdi/nvidia.yaml"),
    Path("/var/run/cdi/management.nvidia.com-gpu.yaml"),
)
BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")


@dataclass(frozen=True)
class Settings:
    nodes: tuple[str, ...]
    kubeconfig: str | None = None
    emulate: bool = False
    emu_state: Path | None = None
    cdi_dir: Path = DEFAULT_CDI_DIR
    cdi_root: Path | None = None  # many nodes: CDI dir of node n is ROOT/n/cdi
    state_dir: Path | None = None  # default: emu_state under --emulate, else DEFAULT_STATE_DIR
    namespace: str = "instaslice-system"
    binding: BindingMode = BindingMode.ENV
    # dra: also publish this node's pool as ResourceSlices and serve the kubelet's DRA plugin
    # API (docs/dra.md); gates: neither
    allocation: AllocationMode = AllocationMode.GATES
    # DRA mode with one node: serve the kubelet's DRA plugin API, registered in this dir
    # (None: no kubelet plugin, e.g. emulated KWOK nodes); the plugin socket goes under
    # dra_plugins_dir/instaslice.io/
    dra_registry_dir: Path | None = None
    dra_plugins_dir: Path = Path("/var/lib/kubelet/plugins")
    discover_only: bool = False
    gc_grace_s: float = 60.0
    gc_period_s: float = 30.0
    # how often a GC pass also reads the Node's labels for conflicting managers (one GET per
    # node: 2000 emulated nodes at 300 s are under 7 requests a second)
    conflict_check_period_s: float = 300.0
    # resting mode (Node label instaslice.io/idle-mig-mode): how long a Hopper+ GPU must be
    # idle before it is brought to the mode the label names (checked with each GC pass)
    idle_mig_mode_after_s: float = 600.0
    # Ampere maintenance (nodeagent/maintenance.py): how long a reset may be refused (the
    # GPU Operator's paused clients still holding the GPU) before it counts as failed; the
    # command that resets GPU {index} on a real node
    maintenance_wait_s: float = 300.0
    # how long a drain may wait for what runs on an asked GPU before the ask is given up
    # (never evicted); 0: as long as it runs
    maintenance_drain_timeout_s: float = 1800.0
    gpu_reset_command: tuple[str, ...] = ("nvidia-smi", "--gpu-reset", "-i", "{index}")
    lease_duration_s: int = AGENT_LEASE_DURATION_S
    # a create that has taken this long writes `Creating` (docs/protocol.md); a faster one
    # goes from nothing to `Ready`
    creating_after_s: float = 1.0
    # warm slices (docs/warm-slices.md): off unless asked; at most this many per GPU and per
    # node, of the `warm_profiles` profiles most asked for in the last `warm_window_s`
    warm_slices: bool = False
    warm_per_gpu: int = 1
    warm_per_node: int = 2
    warm_profiles: int = 2
    warm_window_s: float = 600.0
    release_backoff_s: float = 0.5  # first IN_USE retry; doubles up to release_backoff_max_s
    release_backoff_max_s: float = 30.0
    nvidia_cdi_spec: Path | None = None  # None: the first of cdi_specs that exists
    cdi_specs: tuple[Path, ...] = DEFAULT_NVIDIA_CDI_SPECS
    mig_minors: Path = Path("/proc/driver/nvidia-caps/mig-minors")
    # --emulate only: a directory of real device files standing in for /dev (CDI hostPaths
    # point there), for an emulated node whose containers really start (docs/binding.md)
    dev_root: Path | None = None
    proc_devices: Path = Path("/proc/devices")
    boot_id_path: Path = BOOT_ID_PATH
    health_timeout_ms: int = 500
    metrics_port: int = 0  # 0: no /metrics, /healthz, /readyz server
    metrics_auth: bool = False  # /metrics needs an authorized bearer token (common.metricsauth)
    metrics_auth_limits: MetricsAuthLimits = field(default_factory=MetricsAuthLimits)
    kubelet_dir: Path = Path("/var/lib/kubelet/device-plugins")  # device-plugin binding
    pod_resources_socket: Path = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
    plugin_refresh_s: float = 1.0
    version: str = VERSION  # common/version.py

    def node_cdi_dir(self, node: str) -> Path:
        if self.cdi_root is not None:
            return self.cdi_root / node / "cdi"
        return self.cdi_dir

    def checkpoint_path(self, node: str) -> Path:
        base = self.state_dir or (self.emu_state if self.emulate else None) or DEFAULT_STATE_DIR
        return base / f"{node}.agent.json"
