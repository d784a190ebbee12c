"""hack/cluster/realnode_config.py: the real node's containerd, NVIDIA runtime and kubelet
settings are valid TOML/data and carry the settings this VM needs (docs/control-plane.md,
"The real node"). Leaves out starting them (tests/e2e/test_realnode.py)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from hack.cluster.realnode_config import (
    RUNC,
    SHIM_SOCKET_DIR,
    Layout,
    Runtime,
    containerd_toml,
    kubelet_argv,
    kubelet_configuration,
    nvidia_runtime_toml,
)

L = Layout(Path("/x/real-0"))
CRI = "io.containerd.cri.v1.runtime"


@pytest.mark.parametrize(("runtime", "default"), [("runc", "runc"), ("nvidia", "nvidia")])
def test_containerd_config(runtime: Runtime, default: str) -> None:
    cfg = tomllib.loads(containerd_toml(L, runtime))
    cri = cfg["plugins"][CRI]
    assert cri["cdi_spec_dirs"] == [str(L.cdi_dir)]
    assert cri["restrict_oom_score_adj"] is True
    assert cri["containerd"]["default_runtime_name"] == default
    runtimes = cri["containerd"]["runtimes"]
    assert runtimes["runc"]["options"]["BinaryName"] == str(RUNC)
    assert runtimes["nvidia"]["options"]["BinaryName"] == str(L.nvidia_wrapper)
    assert cfg["grpc"]["address"] == str(L.containerd_socket)
    socket_dir = cfg["plugins"]["io.containerd.shim.v1.manager"]["socket_dir"]
    assert socket_dir == str(SHIM_SOCKET_DIR) and len(socket_dir) <= 42
    assert cfg["plugins"]["io.containerd.cri.v1.images"]["pinned_images"]["sandbox"]


def test_nvidia_runtime_config_reads_our_cdi_dir_in_cdi_mode() -> None:
    cfg = tomllib.loads(nvidia_runtime_toml(L))
    assert cfg["accept-nvidia-visible-devices-envvar-when-unprivileged"] is True
    assert cfg["nvidia-container-runtime"]["mode"] == "cdi"
    assert cfg["nvidia-container-runtime"]["runtimes"] == [str(RUNC)]
    assert cfg["nvidia-container-runtime"]["modes"]["cdi"]["spec-dirs"] == [str(L.cdi_dir)]


def test_kubelet_listens_on_loopback_with_the_vm_workarounds() -> None:
    taint = {"key": "instaslice.io/real-node", "value": "true", "effect": "NoSchedule"}
    cfg = kubelet_configuration(L, port=1234, healthz_port=1235, taints=[taint], max_pods=20)
    assert (cfg["address"], cfg["port"]) == ("127.0.0.1", 1234)
    assert cfg["healthzBindAddress"] == "127.0.0.1"
    assert cfg["failCgroupV1"] is False and cfg["cgroupDriver"] == "cgroupfs"
    assert cfg["registerWithTaints"] == [taint] and cfg["maxPods"] == 20
    argv = kubelet_argv(L, Path("/bin/kubelet"), "real-0", {"a": "1", "b": "2"})
    assert "--cloud-provider=external" in argv and "--hostname-override=real-0" in argv
    assert f"--cert-dir={L.root / 'kubelet-pki'}" in argv and "--node-labels=a=1,b=2" in argv
