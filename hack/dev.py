"""`make dev-up` / `make dev-down`: the whole InstaSlice system on the local control plane.

`DevSystem.up()` = control plane (reused when alive) + InstaSlice's CRDs, namespace, RBAC and
admission policies + KWOK GPU nodes from a cluster spec (docs/contract.md §5) + emulated GPUs per
node (`<dir>/gpus/`) + the webhook/allocator process (as the instaslice-controller
ServiceAccount, so its RBAC is the real one) + one emulated node-agent process serving every
node (CDI dirs `<dir>/nodes/<node>/cdi/`), logs under `<dir>/logs/`. The components run as
local processes, so the MutatingWebhookConfiguration points at `https://127.0.0.1:<port>`
with a serving certificate from the cluster CA.

A `runtime: containerd` group's node is real (hack/cluster/realnode.py: kubelet + containerd
+ runc on this machine, state under `<dir>/rn/<node>/`); its emulated GPUs get real
device files, and its node agent runs as its own process, as in a cluster: CDI dir =
containerd's `cdi_spec_dirs`, `--binding-mode device-plugin` against that kubelet (`env` on request,
with NVIDIA's runtime as the node's default runtime).

The same class backs the e2e tests, the demo and the benchmarks (each with its own dir).
With `kueue: true` in the spec, Kueue runs too (hack/kueue.py: CRDs, webhooks, manager as a
local process); its configuration charges `instaslice.io/memory-slots` only when the webhook
runs with `--slot-accounting` (the spec's `slotAccounting: true`, docs/kueue.md).

With `install: chart` (docs/contract.md §5) InstaSlice runs as shipped instead: images built
from the Containerfiles, `helm install` of charts/instaslice, the webhook/allocator and the
real node's agent as pods there (hack/cluster/chartinstall.py, pod networking
hack/cluster/podnet.py); the KWOK nodes keep the emulated agent process outside the cluster.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes_asyncio import config as k8s_config

from common.catalog import load_catalog, load_model_file
from common.constants import AllocationMode, BindingMode
from common.kubeapi import harden
from hack import kueue
from hack.cluster import karpenter
from hack.cluster.chartinstall import install_chart
from hack.cluster.controlplane import ClusterSettings, ControlPlane
from hack.cluster.nodes import (
    ClusterSpec,
    NodeGroup,
    create_nodes,
    wait_nodes_ready,
)
from hack.cluster.procs import ProcessRecord, free_ports, spawn, stop_process
from hack.cluster.realnode import DEVICE_PLUGIN_DIR, RealNode, Runtime
from hack.kueue import KueueSettings
from nodeagent.emulator import provision

REPO = Path(__file__).resolve().parents[1]
MANIFESTS = REPO / "manifests" / "base"
NAMESPACE = "instaslice-system"
CONTROLLER_SA = "instaslice-controller"
SLOT_ACCOUNTING = "--slot-accounting"  # the webhook's flag (docs/kueue.md)
DRA_MODE = f"--allocation-mode={AllocationMode.DRA}"  # every component's (docs/dra.md)
# What a dev install applies (the Deployments/DaemonSet are replaced by local processes).
INSTALL = [
    "crds/sliceallocations.yaml",
    "crds/mignodes.yaml",
    "common/namespace.yaml",
    "webhook/serviceaccount.yaml",
    "webhook/rbac.yaml",
    "allocator/rbac.yaml",
    "allocator/priorityclass.yaml",
    "nodeagent/serviceaccount.yaml",
    "nodeagent/rbac.yaml",
    "nodeagent/policy.yaml",
    "policy/validatingadmissionpolicy.yaml",
    "policy/binding.yaml",
    "policy/instaslice-controller.yaml",
    "policy/unserved-asks.yaml",
]
# DRA mode (`dra: true`): what the component manifests/components/dra adds
DRA_INSTALL = ["../components/dra/deviceclasses.yaml", "../components/dra/rbac.yaml",
               "../components/dra/policy.yaml"]  # fmt: skip
_STATE = "system.json"
PART_OF = {"app.kubernetes.io/part-of": "instaslice"}


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


@dataclass
class DevSystem:
    dir: Path
    cp: ControlPlane
    nodes: list[str]
    webhook_port: int
    metrics_port: int  # the webhook's /metrics, /healthz, /readyz
    agent_metrics_port: int = 0  # the node agent's
    processes: dict[str, ProcessRecord] = field(default_factory=dict)
    agent_args: tuple[str, ...] = ()
    webhook_args: tuple[str, ...] = ()
    real: RealNode | None = None  # the runtime: containerd group's node
    real_binding: BindingMode = BindingMode.DEVICE_PLUGIN
    kueue_port: int = 0  # Kueue's webhook port when the spec says `kueue: true`, else 0
    chart: bool = False  # `install: chart`: InstaSlice's pods on the real node, from Helm
    # children started by this Python process: reaped through their Popen (no zombie, no
    # "still running" ResourceWarning); a DevSystem attached from another process has none
    _popens: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, repr=False)

    # ---- paths ------------------------------------------------------------------------------
    @property
    def kubeconfig(self) -> Path:
        return self.cp.kubeconfig

    @property
    def gpu_state(self) -> Path:
        return self.dir / "gpus"

    @property
    def logs(self) -> Path:
        return self.dir / "logs"

    def cdi_dir(self, node: str) -> Path:
        if self.real is not None and node == self.real.name:
            return self.real.cdi_dir
        return self.dir / "nodes" / node / "cdi"

    @property
    def kwok_nodes(self) -> list[str]:
        return [n for n in self.nodes if self.real is None or n != self.real.name]

    # ---- lifecycle -------------------------------------------------------------------------
    @classmethod
    def up(
        cls,
        dir: Path,
        spec: ClusterSpec,
        *,
        die_with_parent: bool = False,
        cluster_settings: ClusterSettings | None = None,
        agent_args: Sequence[str] = (),
        webhook_args: Sequence[str] = (),
        real_binding: BindingMode = BindingMode.DEVICE_PLUGIN,
    ) -> DevSystem:
        """Start (or restart the components of) the system of `spec` in `dir`.

        `real_binding` is the real node's binding mode: `device-plugin` (containerd applies
        the CDI device from the kubelet, runc runs it) or `env` (NVIDIA's runtime, the node's
        default runtime, resolves the container's NVIDIA_VISIBLE_DEVICES)."""
        dir = dir.absolute()
        dir.mkdir(parents=True, exist_ok=True)
        old = cls.attach(dir)
        if old is not None:
            old.stop_components()
        reused = ControlPlane.attach(dir / "cluster")
        cp = reused or ControlPlane.start(
            dir / "cluster",
            kubeconfig=dir / "kubeconfig",
            logs_dir=dir / "logs",
            settings=cluster_settings,
            die_with_parent=die_with_parent,
        )
        _link_bin(dir, cp)
        if spec.autoscaled_groups and not any(
            a.startswith("--autoscaler-signal") for a in webhook_args
        ):  # Karpenter acts on placeholder pods (docs/autoscaling.md)
            webhook_args = [
                *webhook_args,
                "--autoscaler-signal=placeholder",
                "--scale-up-delay=2",
                "--karpenter-do-not-disrupt",
            ]
        webhook_port, metrics_port, agent_metrics_port = free_ports(3)
        system = cls(
            dir,
            cp,
            spec.node_names(),
            webhook_port,
            metrics_port,
            agent_metrics_port,
            agent_args=tuple(agent_args),
            webhook_args=tuple(webhook_args),
            real_binding=real_binding,
            chart=spec.install == "chart",
        )
        if spec.slot_accounting and SLOT_ACCOUNTING not in system.webhook_args:
            system.webhook_args += (SLOT_ACCOUNTING,)
        if spec.dra:  # every component in DRA mode, as the ConfigMap sets it (docs/dra.md)
            system.webhook_args += (DRA_MODE,) if DRA_MODE not in system.webhook_args else ()
            system.agent_args += (DRA_MODE,) if DRA_MODE not in system.agent_args else ()
        try:
            if not system.chart:  # the chart installs all of it itself
                system.install(dra=spec.dra)
            if spec.kueue:
                system.start_kueue(system.kueue_settings(), die_with_parent=die_with_parent)
            asyncio.run(_create_nodes(cp.kubeconfig, spec))
            outcome: dict[str, list[str]] = {}
            for group in spec.groups:
                for name in group.names():
                    models = [group.model] * group.gpus
                    tables = (
                        () if group.model_file is None else (load_model_file(group.model_file),)
                    )
                    done = provision(system.gpu_state, name, models, group.mig_mode, tables)
                    outcome.setdefault(done, []).append(name)
            if outcome.get("kept") or outcome.get("replaced"):  # a restart: say what stayed
                kept, anew = outcome.get("kept", []), outcome.get("replaced", [])
                print(
                    f"emulated GPUs: {len(kept)} node(s) kept their state (spec unchanged), "
                    f"{len(anew)} provisioned anew (spec changed){': ' if anew else ''}"
                    + ", ".join(anew)
                )
            if (real := spec.real_group) is not None:
                runtime: Runtime = "nvidia" if real_binding == "env" else "runc"
                system.start_real_node(real, runtime=runtime, die_with_parent=die_with_parent)
            if system.chart:
                system.install_chart()
            else:
                system.start_webhook(die_with_parent=die_with_parent)
            if system.kwok_nodes:
                system.start_agent(die_with_parent=die_with_parent)
            if system.real is not None and not system.chart:
                system.start_real_agent(die_with_parent=die_with_parent)
            if spec.autoscaled_groups:
                system.start_autoscaling(spec.autoscaled_groups, die_with_parent=die_with_parent)
            system.save()
            system.wait_ready()
        except BaseException:  # what this call started goes (a reused control plane stays)
            with contextlib.suppress(Exception):
                system.stop_components()
                if system.real is not None:
                    system.real.stop()
                if reused is None:
                    system.down()
            raise
        return system

    def install(self, *, dra: bool = False) -> None:
        docs = []
        for f in (*INSTALL, *(DRA_INSTALL if dra else ())):
            for doc in yaml.safe_load_all((MANIFESTS / f).read_text()):
                if doc:  # the label the base kustomization adds (docs select by it)
                    doc.setdefault("metadata", {}).setdefault("labels", {}).update(PART_OF)
                    docs.append(doc)
        body = yaml.safe_dump_all(docs)
        self.cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", stdin=body)
        self._wait_crds(("sliceallocations.instaslice.io", "mignodes.instaslice.io"))

    def _wait_crds(self, names: Sequence[str]) -> None:
        deadline = time.monotonic() + 60
        for crd in names:
            # `kubectl wait --for=condition=Established` fails outright while a new CRD has
            # no conditions yet, so read the condition until it is True
            jsonpath = '{.status.conditions[?(@.type=="Established")].status}'
            while (
                self.cp.kubectl(
                    "get", "crd", crd, "-o", f"jsonpath={jsonpath}", check=False
                ).stdout.strip()
                != "True"
            ):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"CRD {crd} not Established after 60s")
                time.sleep(0.2)

    def start_webhook(self, *, die_with_parent: bool = False) -> None:
        certs = self.dir / "certs"
        certs.mkdir(exist_ok=True)
        issued = self.cp.issue_serving_cert(("127.0.0.1", "localhost"))
        (certs / "tls.crt").write_bytes(issued.cert_pem)
        (certs / "tls.key").write_bytes(issued.key_pem)
        kubeconfig = self.cp.service_account_kubeconfig(NAMESPACE, CONTROLLER_SA)
        argv = [
            _bin("instaslice-webhook"),
            f"--kubeconfig={kubeconfig}",
            "--host=127.0.0.1",
            f"--port={self.webhook_port}",
            f"--metrics-port={self.metrics_port}",
            f"--cert-file={certs / 'tls.crt'}",
            f"--key-file={certs / 'tls.key'}",
            f"--namespace={NAMESPACE}",
            *self.webhook_args,
        ]
        self._spawn("webhook", argv, die_with_parent)
        self._register_webhook()

    def start_kueue(self, settings: KueueSettings, *, die_with_parent: bool = False) -> None:
        """Install Kueue's CRDs, start its manager and register its webhooks (hack/kueue.py)."""
        kdir = kueue.find_kueue_dir()
        kueue.install_crds(self.cp, kdir)
        certs = self.dir / "kueue-certs"
        certs.mkdir(exist_ok=True)
        issued = self.cp.issue_serving_cert(("127.0.0.1", "localhost"))
        (certs / "tls.crt").write_bytes(issued.cert_pem)
        (certs / "tls.key").write_bytes(issued.key_pem)
        kueue.ensure_metrics_cert(issued.cert_pem, issued.key_pem)
        self.kueue_port, health = free_ports(2)
        config = self.dir / "kueue-config.yaml"
        config.write_text(
            yaml.safe_dump(
                kueue.kueue_config(
                    settings, webhook_port=self.kueue_port, health_port=health, certs=certs
                )
            )
        )
        argv = [
            str(kdir / "bin" / "kueue"),
            f"--config={config}",
            f"--kubeconfig={self.kubeconfig}",
        ]
        self._spawn("kueue", argv, die_with_parent)
        rec = self.processes["kueue"]
        kueue.wait_ready(health, rec.alive, rec.log)
        kueue.register_webhooks(self.cp, kdir, self.kueue_port)

    def kueue_settings(self) -> KueueSettings:
        """Kueue charges memory slots exactly when the webhook does (docs/kueue.md)."""
        return KueueSettings(slot_accounting=SLOT_ACCOUNTING in self.webhook_args)

    def set_slot_accounting(self, on: bool, *, die_with_parent: bool = False) -> None:
        """Restart the webhook with or without `--slot-accounting`, and Kueue (if it runs)
        with the configuration to match; the node agents keep running. Ready on return."""
        if (SLOT_ACCOUNTING in self.webhook_args) == on:
            return
        rest = tuple(a for a in self.webhook_args if a != SLOT_ACCOUNTING)
        self.webhook_args = (*rest, SLOT_ACCOUNTING) if on else rest
        self.stop("webhook")
        self.start_webhook(die_with_parent=die_with_parent)
        if self.kueue_port:
            self.stop("kueue")
            self.start_kueue(self.kueue_settings(), die_with_parent=die_with_parent)
        self.save()
        self.wait_ready()

    def start_real_node(
        self, group: NodeGroup, *, runtime: Runtime = "runc", die_with_parent: bool = False
    ) -> None:
        """(Re)start the real node (kubelet + containerd) of `group`; Ready on return."""
        self.real = RealNode.start(
            # short: the DRA agent binds <root>/kubelet/plugins_registry/instaslice.io-reg.sock
            # and gRPC refuses a unix socket path over 105 bytes (a test's dir is already long)
            self.dir / "rn" / group.names()[0],
            self.cp,
            group,
            runtime=runtime,
            pod_network=self.chart,
            die_with_parent=die_with_parent,
        )
        self.save()

    def install_chart(self, extra_values: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Images built and imported, `helm install` or else `helm upgrade`
        (hack/cluster/chartinstall.py) with `extra_values` over the dev values; both workloads
        rolled out. The values used."""
        assert self.real is not None
        # DRA mode is the chart's allocationMode (its ConfigMap, DeviceClasses and DRA RBAC)
        mode = {"allocationMode": AllocationMode.DRA.value} if DRA_MODE in self.agent_args else {}
        return install_chart(
            self.cp,
            self.real,
            self.gpu_state,
            self.dir / "images",
            extra_values={**mode, **(extra_values or {})},
        )

    def start_real_agent(
        self, *, binding: BindingMode | None = None, die_with_parent: bool = False
    ) -> None:
        """The real node's agent: its own process, as a DaemonSet pod would be."""
        assert self.real is not None
        self.real_binding = binding or self.real_binding
        kubelet_root = self.real.pod_resources_socket.parents[1]  # <root>/pod-resources/x.sock
        argv = [
            _bin("instaslice-nodeagent"),
            f"--kubeconfig={self.kubeconfig}",
            "--emulate",
            f"--emu-state={self.gpu_state}",
            f"--node={self.real.name}",
            f"--cdi-dir={self.real.cdi_dir}",
            f"--dev-root={self.real.dev_root}",
            f"--binding-mode={self.real_binding}",
            f"--kubelet-dir={DEVICE_PLUGIN_DIR}",
            f"--pod-resources-socket={self.real.pod_resources_socket}",
            # DRA mode: the plugin watcher's and the plugins' dirs under the kubelet's root dir
            f"--kubelet-registry-dir={kubelet_root / 'plugins_registry'}",
            f"--kubelet-plugins-dir={kubelet_root / 'plugins'}",
            f"--namespace={NAMESPACE}",
            *self.agent_args,
        ]
        self._spawn(self.real_agent, argv, die_with_parent)

    @property
    def real_agent(self) -> str:
        """The process name of the real node's agent."""
        assert self.real is not None
        return f"nodeagent-{self.real.name}"

    def start_agent(self, *, die_with_parent: bool = False) -> None:
        argv = [
            _bin("instaslice-nodeagent"),
            f"--kubeconfig={self.kubeconfig}",
            "--emulate",
            f"--emu-state={self.gpu_state}",
            f"--nodes={','.join(self.kwok_nodes)}",
            f"--cdi-root={self.dir / 'nodes'}",
            f"--namespace={NAMESPACE}",
            f"--metrics-port={self.agent_metrics_port}",
            *self.agent_args,
        ]
        self._spawn("nodeagent", argv, die_with_parent)

    def start_autoscaling(
        self, groups: Sequence[NodeGroup], *, die_with_parent: bool = False
    ) -> None:
        """Karpenter's KWOK provider for the autoscaled `groups` (hack.cluster.karpenter) and
        the process that serves their nodes as they come and go (hack.cluster.autonodes)."""
        built = karpenter.karpenter_dir()
        self.cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(built / "crds"))
        self._wait_crds(karpenter.CRD_NAMES)
        types = self.dir / "karpenter-instance-types.json"
        types.write_text(json.dumps(karpenter.instance_types(groups, load_catalog()), indent=1))
        objs = yaml.safe_dump_all(karpenter.karpenter_objects(groups))
        self.cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", stdin=objs)
        env = karpenter.karpenter_env(self.kubeconfig, types, *free_ports(2))
        self._spawn("karpenter", [str(built / "bin" / "karpenter-kwok")], die_with_parent, env)
        argv = [
            sys.executable, "-m", "hack.cluster.autonodes",
            f"--kubeconfig={self.kubeconfig}", f"--emu-state={self.gpu_state}",
            f"--cdi-root={self.dir / 'nodes'}", f"--logs={self.logs}", f"--namespace={NAMESPACE}",
            *(f"--group={g.prefix}={g.model}:{g.gpus}:{g.mig_mode}" for g in groups),
            "--", *self.agent_args,
        ]  # fmt: skip
        self._spawn("autonodes", argv, die_with_parent)

    def _spawn(
        self, name: str, argv: list[str], die_with_parent: bool, env: dict[str, str] | None = None
    ) -> None:
        env = dict(env or os.environ, PYTHONUNBUFFERED="1")
        popen, rec = spawn(
            name, argv, self.logs / f"{name}.log", env=env, die_with_parent=die_with_parent
        )
        self.processes[name] = rec
        self._popens[name] = popen

    def stop(self, name: str) -> None:
        rec = self.processes.pop(name, None)
        if rec is not None:
            stop_process(rec, self._popens.pop(name, None))
        self.save()

    def kill(self, name: str) -> None:
        """kill -9 (chaos): no graceful shutdown, no Lease hand-back."""
        rec = self.processes.pop(name, None)
        popen = self._popens.pop(name, None)
        if rec is not None and rec.alive():
            os.killpg(rec.pid, 9)
        if popen is not None:
            popen.wait()
        self.save()

    def stop_components(self) -> None:
        for name in list(self.processes):
            self.stop(name)
        # best effort: with the API server already gone (a crashed or killed run) there is
        # nothing to unregister; the configuration lives in etcd, which ControlPlane.stop
        # removes
        self.cp.kubectl(
            "delete", "mutatingwebhookconfiguration", "instaslice-dev", "--ignore-not-found",
            check=False,
        )  # fmt: skip
        if self.kueue_port:
            kueue.unregister_webhooks(self.cp)

    def down(self) -> None:
        self.stop_components()
        if self.real is not None:
            self.real.stop()
        self.cp.stop()
        (self.dir / _STATE).unlink(missing_ok=True)

    def _register_webhook(self) -> None:
        mwc = yaml.safe_load(
            (MANIFESTS / "webhook" / "mutatingwebhookconfiguration.yaml").read_text()
        )
        mwc["metadata"]["name"] = "instaslice-dev"
        ca = base64.b64encode(self.cp.ca_cert_pem).decode()
        for hook in mwc["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]  # /mutate, /mutate-whole-gpu
            hook["clientConfig"] = {
                "url": f"https://127.0.0.1:{self.webhook_port}{path}",
                "caBundle": ca,
            }
        self.cp.kubectl("apply", "-f", "-", stdin=json.dumps(mwc))

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Until the webhook answers /readyz and every node has a MigNode."""
        import urllib.request

        deadline = time.monotonic() + timeout_s
        want = set(self.nodes)
        while time.monotonic() < deadline:
            for name, rec in self.processes.items():
                if not rec.alive():
                    raise RuntimeError(f"{name} exited; see {rec.log}")
            try:  # the chart's webhook: its rollout (install_chart) was its readiness
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{self.metrics_port}/readyz", timeout=2
                ) as r:
                    ready = self.chart or r.status == 200
            except OSError:
                ready = self.chart
            out = self.cp.kubectl("get", "mignodes", "-o", "name", check=False).stdout
            have = {line.split("/", 1)[1] for line in out.split() if "/" in line}
            if ready and want <= have:
                return
            time.sleep(0.5)
        raise TimeoutError(f"InstaSlice not ready after {timeout_s}s; logs in {self.logs}")

    # ---- persistence (so `make dev-down` in another process can stop it) -------------------
    def save(self) -> None:
        state: dict[str, Any] = {
            "nodes": self.nodes,
            "webhook_port": self.webhook_port,
            "metrics_port": self.metrics_port,
            "agent_metrics_port": self.agent_metrics_port,
            "processes": {k: v.to_json() for k, v in self.processes.items()},
            "agent_args": list(self.agent_args),
            "webhook_args": list(self.webhook_args),
            "real": None if self.real is None else str(self.real.root),
            "real_binding": self.real_binding,
            "kueue_port": self.kueue_port,
            "chart": self.chart,
        }
        (self.dir / _STATE).write_text(json.dumps(state, indent=1))

    @classmethod
    def attach(cls, dir: Path) -> DevSystem | None:
        dir = dir.absolute()
        try:
            st = json.loads((dir / _STATE).read_text())
        except (OSError, ValueError):
            return None
        cp = ControlPlane.attach(dir / "cluster", require_alive=False)
        if cp is None:
            return None
        return cls(
            dir,
            cp,
            st["nodes"],
            st["webhook_port"],
            st["metrics_port"],
            st.get("agent_metrics_port", 0),
            {k: ProcessRecord.from_json(v) for k, v in st["processes"].items()},
            tuple(st.get("agent_args", ())),
            tuple(st.get("webhook_args", ())),
            RealNode.attach(Path(st["real"])) if st.get("real") else None,
            BindingMode(st.get("real_binding", "device-plugin")),
            st.get("kueue_port", 0),
            st.get("chart", False),
        )


def _link_bin(dev: Path, cp: ControlPlane) -> None:
    link = dev / "bin"
    if link.is_symlink() and link.resolve() == cp.bin_dir.resolve():
        return
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(cp.bin_dir)


async def _create_nodes(kubeconfig: Path, spec: ClusterSpec) -> None:
    async with harden(await k8s_config.new_client_from_config(config_file=str(kubeconfig))) as api:
        names = await create_nodes(api, spec)
        await wait_nodes_ready(api, names, timeout_s=180)


if __name__ == "__main__":  # `python -m hack.dev up|down|status`: the CLI is hack/dev_cli.py
    from hack.dev_cli import main

    sys.exit(main())
