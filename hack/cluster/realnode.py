"""A real node on this machine: kubelet + containerd v2 + runc, registered to the local
control plane (the `runtime: containerd` group of a cluster spec; docs/control-plane.md).

Why: KWOK nodes start no container, so CDI specs and the device-plugin binding were never
proven in a real one. This node runs the cached kubelet and containerd (hack/kube/
build-node.sh) and Debian's runc; its GPUs stay emulated (NVML), but get real character
devices under a per-node dev root (`<root>/dev`, numbered like the emulator's mig-minors), so
the CDI specs' hostPaths exist and runc creates them in the container.

What it deliberately does not do: pod networking unless asked (a loopback-only CNI config;
its test pods use `hostNetwork: true`; with `pod_network`, for InstaSlice's own pods under
`install: chart`, a bridge: hack/cluster/podnet.py), registry pulls (two images are imported
from local OCI tarballs), or
more than one real node per machine (the kubelet's device-plugin socket dir
`/var/lib/kubelet/device-plugins` is fixed, so `OWNER_FILE` records who holds it).

Reachability without DNS: the apiserver calls a kubelet at the node's preferred address
(Hostname first). `<prefix>-0` does not resolve and a kubelet refuses a loopback node IP, so
the kubelet runs with `--cloud-provider=external` (it then leaves addresses to a cloud
controller) and `start` acts as that controller once: InternalIP 127.0.0.1, the
`uninitialized` taint removed. The kubelet listens on 127.0.0.1 only (anonymous, AlwaysAllow:
acceptable on loopback alone; the apiserver has no kubelet client certificate).

Obstacles of this VM handled here (docs/control-plane.md has the list): no CAP_SYS_RESOURCE
(containerd `restrict_oom_score_adj`), cgroup v1 (`failCgroupV1: false`, cgroupfs driver),
kubelet's default `--cert-dir` outside `--root-dir`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client.exceptions import ApiException

from hack.cluster import podnet
from hack.cluster.bins import find_node_bin_dir
from hack.cluster.controlplane import ControlPlane
from hack.cluster.kubeconfig import write_kubeconfig
from hack.cluster.nodes import REAL_NODE_TAINT, NodeGroup, node_labels, wait_nodes_ready
from hack.cluster.ociimage import busybox_image, pause_image
from hack.cluster.procs import ProcessRecord, free_ports, spawn, stop_process
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
from nodeagent.cdi import (
    EMULATED_CAPS_MAJOR,
    EMULATED_UVM_MAJOR,
    NVIDIA_MAJOR,
    NVIDIACTL_MINOR,
    formula_mig_minors,
)

__all__ = ["DEVICE_PLUGIN_DIR", "OWNER_FILE", "RealNode", "RealNodeError", "Runtime"]

DEVICE_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")  # fixed by the kubelet
OWNER_FILE = Path("/run/instaslice-realnode.json")
BUSYBOX = Path("/bin/busybox")
UNINITIALIZED_TAINT = "node.cloudprovider.kubernetes.io/uninitialized"
_STATE = "realnode.json"


class RealNodeError(RuntimeError):
    """The real node cannot start here, or did not become Ready; the message says why."""


@dataclass
class RealNode:
    name: str
    root: Path
    bin_dir: Path
    runtime: Runtime = "runc"
    # pods without hostNetwork get IPs on a bridge (hack/cluster/podnet.py): `install: chart`
    pod_network: bool = False
    processes: dict[str, ProcessRecord] = field(default_factory=dict)
    argv: dict[str, list[str]] = field(default_factory=dict)  # as launched, for restarts
    _popens: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, repr=False)

    # ---- paths ------------------------------------------------------------------------------
    @property
    def layout(self) -> Layout:
        return Layout(self.root)

    @property
    def cdi_dir(self) -> Path:
        """containerd's `cdi_spec_dirs` (and NVIDIA's runtime's spec dir): the agent's CDI dir."""
        return self.layout.cdi_dir

    @property
    def dev_root(self) -> Path:
        return self.layout.dev_root

    @property
    def pod_resources_socket(self) -> Path:
        return self.layout.pod_resources_socket

    @property
    def containerd_socket(self) -> Path:
        return self.layout.containerd_socket

    @property
    def runc_root(self) -> Path:
        return self.layout.runc_root

    @property
    def logs(self) -> Path:
        return self.layout.logs

    # ---- start ------------------------------------------------------------------------------
    @classmethod
    def start(
        cls,
        root: Path,
        cp: ControlPlane,
        group: NodeGroup,
        *,
        runtime: Runtime = "runc",
        pod_network: bool = False,
        die_with_parent: bool = False,
        bin_dir: Path | None = None,
        timeout_s: float = 120.0,
    ) -> RealNode:
        """Start containerd and the kubelet for `group`'s node; blocks until it is Ready."""
        _check_host()
        root = root.absolute()
        node = cls(group.names()[0], root, bin_dir or find_node_bin_dir(), runtime, pod_network)
        old = cls.attach(root)
        if old is not None:
            old.stop()
        _claim_host(root)
        try:
            node._prepare(cp, group)
            node._start_containerd(die_with_parent)
            node._start_kubelet(cp, group, die_with_parent)
            asyncio.run(node._initialize(cp.kubeconfig, timeout_s))
        except BaseException:
            with contextlib.suppress(Exception):
                node.stop()
            raise
        return node

    def _prepare(self, cp: ControlPlane, group: NodeGroup) -> None:
        dirs = ("cdi", "run", "cni/net.d", "images", "kubelet", "kubelet-pki", "pod-logs", "logs")
        for d in dirs:
            (self.root / d).mkdir(parents=True, exist_ok=True)
        DEVICE_PLUGIN_DIR.mkdir(parents=True, exist_ok=True)
        make_dev_root(self.dev_root, range(group.gpus))
        plugins = {"loopback": self.bin_dir / "loopback"}
        network = {
            "cniVersion": "1.0.0",
            "name": "instaslice-lo",
            "plugins": [{"type": "loopback"}],
        }
        for old in (self.root / "cni" / "net.d").glob("*.conflist"):
            old.unlink()
        if self.pod_network:
            plugins |= podnet.plugin_paths()
            network = podnet.conflist(self.root / "cni" / "ipam")
            podnet.up(urlsplit(cp.server).port or 443)
        (self.root / "cni" / "net.d" / "10-instaslice.conflist").write_text(json.dumps(network))
        cni_bin = self.root / "cni" / "bin"
        cni_bin.mkdir(parents=True, exist_ok=True)
        for name, path in plugins.items():
            with contextlib.suppress(FileNotFoundError):
                (cni_bin / name).unlink()
            (cni_bin / name).symlink_to(path)
        (self.root / "containerd.toml").write_text(containerd_toml(self.layout, self.runtime))
        self.layout.nvidia_config.write_text(nvidia_runtime_toml(self.layout))
        pause_image(self.root / "images" / "pause.tar", self.bin_dir / "pause")
        busybox_image(self.root / "images" / "busybox.tar", BUSYBOX)
        cert = cp.ca.issue_client(f"system:node:{self.name}", ("system:nodes",))
        write_kubeconfig(
            self.root / "kubelet.kubeconfig",
            server=cp.server,
            ca_cert_pem=cp.ca_cert_pem,
            client=cert,
            user=f"system:node:{self.name}",
        )
        (self.root / "ca.crt").write_bytes(cp.ca_cert_pem)

    def _start_containerd(self, die_with_parent: bool) -> None:
        # the shim execs BinaryName with no way to pass the runtime's config file: a wrapper
        wrapper = self.layout.nvidia_wrapper
        wrapper.write_text(
            "#!/bin/sh\n"
            f"export NVIDIA_CTK_CONFIG_FILE_PATH='{self.layout.nvidia_config}'\n"
            f"exec '{self.bin_dir / 'nvidia-container-runtime'}' \"$@\"\n"
        )
        wrapper.chmod(0o755)
        argv = [str(self.bin_dir / "containerd"), f"--config={self.root / 'containerd.toml'}"]
        env = dict(os.environ, PATH=f"{self.bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}")
        self._spawn("containerd", argv, die_with_parent, env)
        deadline = time.monotonic() + 30
        while not self._ctr_ok():
            if not self.processes["containerd"].alive() or time.monotonic() > deadline:
                raise RealNodeError(f"containerd did not start; see {self.logs}/containerd.log")
            time.sleep(0.2)
        for image in ("pause.tar", "busybox.tar"):
            self.ctr("images", "import", "--all-platforms", str(self.root / "images" / image))

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """`ctr` against this node's containerd, in the CRI namespace (k8s.io)."""
        argv = [str(self.bin_dir / "ctr"), f"--address={self.containerd_socket}", "-n", "k8s.io"]
        proc = subprocess.run([*argv, *args], capture_output=True, text=True, check=False)
        if check and proc.returncode != 0:
            raise RealNodeError(f"ctr {' '.join(args)}: {proc.stderr.strip()}")
        return proc

    def _ctr_ok(self) -> bool:
        return self.containerd_socket.exists() and self.ctr("version", check=False).returncode == 0

    def _start_kubelet(self, cp: ControlPlane, group: NodeGroup, die_with_parent: bool) -> None:
        port, healthz = free_ports(2)
        key, value, effect = REAL_NODE_TAINT
        taints = [{"key": key, "value": value, "effect": effect}]
        taints += [{"key": t.key, "value": t.value, "effect": t.effect} for t in group.taints]
        config = kubelet_configuration(
            self.layout,
            port=port,
            healthz_port=healthz,
            taints=taints,
            max_pods=min(group.pods, 110),
        )
        (self.root / "kubelet-config.json").write_text(json.dumps(config, indent=1))
        # the kubelet sets kubernetes.io/{hostname,os,arch} itself and refuses others there
        labels = {
            k: v for k, v in node_labels(group, self.name).items() if "kubernetes.io" not in k
        }
        argv = kubelet_argv(self.layout, self.bin_dir / "kubelet", self.name, labels)
        self._spawn("kubelet", argv, die_with_parent)

    def stop_kubelet(self) -> None:
        """Stop the kubelet only (containers keep running, as on a kubelet restart)."""
        stop_process(self.processes.pop("kubelet"), self._popens.pop("kubelet", None))
        self._save()

    def start_kubelet(self, *, die_with_parent: bool = False) -> None:
        """Start the kubelet again with its arguments (after `stop_kubelet`)."""
        self._spawn("kubelet", self.argv["kubelet"], die_with_parent)

    async def _initialize(self, kubeconfig: Path, timeout_s: float) -> None:
        """Act as the node's cloud controller once (addresses, taint), then wait for Ready."""
        from kubernetes_asyncio import config as k8s_config

        from common.kubeapi import harden

        async with harden(
            await k8s_config.new_client_from_config(config_file=str(kubeconfig))
        ) as api:
            core = client.CoreV1Api(api)
            async with asyncio.timeout(timeout_s):
                await self._wait_registered(core)
                await core.patch_node_status(
                    self.name,
                    [
                        {
                            "op": "add",
                            "path": "/status/addresses",
                            "value": [{"type": "InternalIP", "address": "127.0.0.1"}],
                        }
                    ],
                )
                while True:  # the kubelet writes the node too: optimistic concurrency
                    node = await core.read_node(self.name)
                    taints = [
                        t.to_dict()
                        for t in (node.spec.taints or [])
                        if t.key != UNINITIALIZED_TAINT
                    ]
                    body = {
                        "metadata": {"resourceVersion": node.metadata.resource_version},
                        "spec": {"taints": _wire_taints(taints)},
                    }
                    try:
                        await core.patch_node(self.name, body)
                        break
                    except ApiException as e:
                        if e.status != 409:
                            raise
            await wait_nodes_ready(api, [self.name], timeout_s=timeout_s)

    async def _wait_registered(self, core: client.CoreV1Api) -> None:
        """Until the kubelet has created its Node; fails fast if the kubelet exits."""
        selector = f"metadata.name={self.name}"
        while True:
            listing = await core.list_node(field_selector=selector)
            if listing.items:
                return
            async with watch.Watch() as w:  # short watches: check the kubelet in between
                async for _ev in w.stream(
                    core.list_node,
                    field_selector=selector,
                    resource_version=listing.metadata.resource_version,
                    timeout_seconds=2,
                ):
                    return
            for name in ("kubelet", "containerd"):
                if not self.processes[name].alive():
                    raise RealNodeError(f"{name} exited; see {self.logs}/{name}.log")

    def _spawn(
        self, name: str, argv: list[str], die_with_parent: bool, env: dict[str, str] | None = None
    ) -> None:
        popen, rec = spawn(
            name, argv, self.logs / f"{name}.log", env=env, die_with_parent=die_with_parent
        )
        self.processes[name] = rec
        self._popens[name] = popen
        self.argv[name] = list(argv)
        self._save()

    # ---- stop -------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop the kubelet, every container, containerd and its shims; unmount and remove
        what the node left on the host (device-plugin sockets, kubepods cgroups)."""
        if "kubelet" in self.processes:
            stop_process(self.processes.pop("kubelet"), self._popens.pop("kubelet", None))
        for cid in self._runc_ids():
            subprocess.run(
                [str(RUNC), f"--root={self.runc_root / 'k8s.io'}", "delete", "--force", cid],
                capture_output=True,
                check=False,
            )
        if "containerd" in self.processes:
            stop_process(self.processes.pop("containerd"), self._popens.pop("containerd", None))
        for pid in self._our_shims():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for mount in sorted(_mounts_under(self.root), key=len, reverse=True):
            subprocess.run(["umount", "-l", mount], capture_output=True, check=False)
        # the plugins' and the kubelet's sockets and the kubelet's device checkpoint (stale
        # allocations must not reach the next real node)
        for f in DEVICE_PLUGIN_DIR.glob("*"):
            if not f.is_dir():
                f.unlink(missing_ok=True)
        _remove_empty_tree(DEVICE_PLUGIN_DIR.parent)
        _remove_kubepods_cgroups()
        shutil.rmtree(self.root / "kubelet", ignore_errors=True)
        shutil.rmtree(self.root / "containerd", ignore_errors=True)
        shutil.rmtree(self.root / "run", ignore_errors=True)
        shutil.rmtree(SHIM_SOCKET_DIR, ignore_errors=True)
        if self.pod_network:
            podnet.down()
            shutil.rmtree(self.root / "cni" / "ipam", ignore_errors=True)
        (self.root / _STATE).unlink(missing_ok=True)
        with contextlib.suppress(OSError, ValueError):
            if json.loads(OWNER_FILE.read_text()).get("root") == str(self.root):
                OWNER_FILE.unlink()

    def _runc_ids(self) -> list[str]:
        d = self.runc_root / "k8s.io"
        return sorted(p.name for p in d.iterdir()) if d.is_dir() else []

    def _our_shims(self) -> Iterator[int]:
        shim = str(self.bin_dir / "containerd-shim-runc-v2")
        needle = str(self.containerd_socket).encode()
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                if os.readlink(proc / "exe") == shim and needle in (proc / "cmdline").read_bytes():
                    yield int(proc.name)

    # ---- persistence ------------------------------------------------------------------------
    def _save(self) -> None:
        state: dict[str, Any] = {
            "name": self.name,
            "bin_dir": str(self.bin_dir),
            "runtime": self.runtime,
            "pod_network": self.pod_network,
            "processes": {k: v.to_json() for k, v in self.processes.items()},
            "argv": self.argv,
        }
        (self.root / _STATE).write_text(json.dumps(state, indent=1))

    @classmethod
    def attach(cls, root: Path) -> RealNode | None:
        root = root.absolute()
        try:
            st = json.loads((root / _STATE).read_text())
        except (OSError, ValueError):
            return None
        procs = {k: ProcessRecord.from_json(v) for k, v in st["processes"].items()}
        runtime = st.get("runtime", "runc")
        return cls(
            st["name"],
            root,
            Path(st["bin_dir"]),
            runtime,
            st.get("pod_network", False),
            procs,
            st.get("argv", {}),
        )


def make_dev_root(dev: Path, gpu_minors: Sequence[int]) -> None:
    """Character devices for emulated GPUs, as the NVIDIA driver creates them in /dev:
    nvidia<N>, nvidiactl, nvidia-uvm(-tools) and nvidia-caps/nvidia-cap<M> for every minor in
    the emulator's mig-minors (also written, as the driver's /proc file reads). Majors are the
    emulator's (nodeagent/cdi.py); nothing backs them, so opening one fails with ENXIO."""
    caps = dev / "nvidia-caps"
    caps.mkdir(parents=True, exist_ok=True)
    minors = formula_mig_minors(gpu_minors)
    (dev / "mig-minors").write_text("".join(f"{k} {v}\n" for k, v in minors.items()))
    nodes = [(dev / f"nvidia{g}", NVIDIA_MAJOR, g, 0o666) for g in gpu_minors]
    nodes += [
        (dev / "nvidiactl", NVIDIA_MAJOR, NVIDIACTL_MINOR, 0o666),
        (dev / "nvidia-uvm", EMULATED_UVM_MAJOR, 0, 0o666),
        (dev / "nvidia-uvm-tools", EMULATED_UVM_MAJOR, 1, 0o666),
    ]
    nodes += [(caps / f"nvidia-cap{m}", EMULATED_CAPS_MAJOR, m, 0o444) for m in minors.values()]
    for path, major, minor, mode in nodes:
        with contextlib.suppress(FileExistsError):
            os.mknod(path, mode | stat.S_IFCHR, os.makedev(major, minor))
        path.chmod(mode)


def _check_host() -> None:
    missing = [str(p) for p in (RUNC, BUSYBOX) if not p.exists()]
    if missing:
        raise RealNodeError(
            f"the real node needs {', '.join(missing)}: run `make node-deps` "
            "(apt-get install runc busybox-static)"
        )
    if os.geteuid() != 0:
        raise RealNodeError("the real node (runtime: containerd) needs root: kubelet and runc")


def _other_owner(root: Path) -> str | None:
    """The root of another live real node on this machine, if any. A dead one (its launcher
    was killed: kubelet and containerd died with it, but runc containers, shims and mounts
    outlive them) is cleaned up here."""
    try:
        owner = json.loads(OWNER_FILE.read_text())
    except (OSError, ValueError):
        return None
    if owner.get("root") == str(root):
        return None
    other = RealNode.attach(Path(owner["root"]))
    if other is not None and any(p.alive() for p in other.processes.values()):
        return str(owner["root"])
    if other is not None:
        with contextlib.suppress(Exception):
            other.stop()
    return None


def _claim_host(root: Path, wait_s: float = 240.0) -> None:
    """One real node per machine (the device-plugin socket dir is host-wide): wait up to
    `wait_s` for another one (e.g. a test run in another checkout) to stop. Polls: the other
    owner is another process tree, with nothing to watch."""
    deadline = time.monotonic() + wait_s
    while (other := _other_owner(root)) is not None:
        if time.monotonic() > deadline:
            raise RealNodeError(
                f"another real node has run on this machine for {wait_s:.0f}s ({other}); "
                "stop it first (make dev-down in its checkout)"
            )
        time.sleep(2)
    OWNER_FILE.write_text(json.dumps({"root": str(root), "pid": os.getpid()}))


def _mounts_under(root: Path) -> list[str]:
    prefix = str(root) + "/"
    out = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = line.split()[4].replace("\\040", " ")
            if point.startswith(prefix) or point == str(root):
                out.append(point)
    return out


def _remove_empty_tree(top: Path) -> None:
    """rmdir `top` and its subdirectories that are empty (what the kubelet made there)."""
    if not top.is_dir():
        return
    for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        with contextlib.suppress(OSError):
            d.rmdir()
    with contextlib.suppress(OSError):
        top.rmdir()


def _remove_kubepods_cgroups() -> None:
    for ctrl in Path("/sys/fs/cgroup").iterdir():
        kubepods = ctrl / "kubepods"
        if kubepods.is_dir():
            for d in sorted(
                (p for p in kubepods.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)
            ):
                with contextlib.suppress(OSError):
                    d.rmdir()
            with contextlib.suppress(OSError):
                kubepods.rmdir()


def _wire_taints(taints: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Taints from the client's snake_case dicts to wire JSON."""
    out = []
    for t in taints:
        w = {"key": t["key"], "effect": t["effect"]}
        if t.get("value"):
            w["value"] = t["value"]
        if t.get("time_added"):
            w["timeAdded"] = t["time_added"].isoformat()
        out.append(w)
    return out
