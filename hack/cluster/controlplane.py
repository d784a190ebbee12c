"""A real Kubernetes control plane on loopback: etcd, kube-apiserver, kube-scheduler,
kube-controller-manager and KWOK, started as child processes from the cached binaries.

Why real components: RBAC, admission, scheduling, garbage collection and namespace deletion
are what InstaSlice is tested against, and mocks get those subtly wrong. What it does not do:
run kubelets or containers (KWOK fakes nodes and pod lifecycles), serve kubelet APIs
(logs/exec), or survive a reboot (etcd lives on tmpfs with fsync off, for speed).

`ControlPlane.start()` launches everything on fresh free ports and blocks until /readyz
passes and the controller manager has created the `default` ServiceAccount (the proof that
KCM, and so namespace deletion and GC, work). State (pids, ports, PKI) is written into the
work dir as it goes, so `ControlPlane.attach()` in another process can reuse or stop it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from cryptography.hazmat.primitives.asymmetric import ec

from hack.cluster.bins import find_bin_dir, stages_dir
from hack.cluster.kubeconfig import read_state_dir, write_kubeconfig
from hack.cluster.pki import CertificateAuthority, IssuedCert, write_service_account_key
from hack.cluster.procs import ProcessRecord, free_ports, spawn, stop_process

__all__ = ["KWOK_NODE_ANNOTATION", "ClusterSettings", "ControlPlane", "ControlPlaneError"]

# KWOK manages exactly the nodes carrying this annotation (see hack/cluster/nodes.py).
KWOK_NODE_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
_STATE = "state.json"
_ETCD_DIR_PREFIX = "instaslice-etcd-"
_ADMIN = ("kubernetes-admin", ("system:masters",))


class ControlPlaneError(RuntimeError):
    """The control plane failed to start or is not in the state asked for."""


@dataclass(frozen=True)
class ClusterSettings:
    """Knobs of the local control plane; defaults suit tests on a 2-core machine."""

    # Pods tolerate NotReady/Unreachable nodes this long before eviction (upstream: 300 s).
    not_ready_toleration_s: int = 10
    unreachable_toleration_s: int = 10
    # KWOK renews each node's Lease every duration/4; KCM marks a node Unknown after the
    # grace period without renewal. Raise both for 1000+ nodes (writes/s = nodes*4/duration).
    node_lease_duration_s: int = 40
    node_monitor_grace_s: int = 50
    node_monitor_period_s: int = 2
    # Client-side rate limits of scheduler, KCM and KWOK (upstream 50/100 slows benchmarks).
    client_qps: int = 500
    client_burst: int = 1000
    kwok: bool = True
    pod_cidr: str = "10.0.0.1/16"  # KWOK hands pod IPs from here (its default /24 is 254 pods)
    ready_timeout_s: float = 120.0
    extra_apiserver_args: tuple[str, ...] = ()


@dataclass
class ControlPlane:
    """A running local control plane (launched here, or attached to from its state dir)."""

    workdir: Path
    kubeconfig: Path
    server: str
    bin_dir: Path
    logs_dir: Path
    ca: CertificateAuthority
    processes: list[ProcessRecord]
    etcd_data_dir: Path
    # argv of each process as launched, so `restart(name)` can launch it again (chaos tests)
    argv: dict[str, list[str]] = field(default_factory=dict)
    _popens: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, repr=False)

    # ---- what other code uses -------------------------------------------------------------
    @property
    def ca_cert_pem(self) -> bytes:
        return self.ca.cert_pem

    @property
    def ca_key(self) -> ec.EllipticCurvePrivateKey:
        return self.ca.key

    @property
    def kubectl_path(self) -> Path:
        return self.bin_dir / "kubectl"

    def user_kubeconfig(
        self, user: str, groups: Sequence[str] = (), path: Path | None = None
    ) -> Path:
        """A kubeconfig authenticating as `user` in `groups` (client cert from the cluster CA)."""
        if path is None:
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in user)
            path = self.workdir / "kubeconfigs" / f"user-{safe}.kubeconfig"
        return write_kubeconfig(
            path,
            server=self.server,
            ca_cert_pem=self.ca_cert_pem,
            client=self.ca.issue_client(user, groups),
            user=user,
        )

    def service_account_kubeconfig(
        self, namespace: str, name: str, path: Path | None = None
    ) -> Path:
        """A kubeconfig that RBAC treats as ServiceAccount `namespace/name`."""
        return self.user_kubeconfig(
            f"system:serviceaccount:{namespace}:{name}",
            ("system:serviceaccounts", f"system:serviceaccounts:{namespace}"),
            path,
        )

    def issue_serving_cert(self, hosts: Sequence[str] = ("127.0.0.1", "localhost")) -> IssuedCert:
        """A serving certificate (e.g. for a webhook) that the apiserver trusts."""
        return self.ca.issue_serving(hosts)

    @property
    def kubectl_cache_dir(self) -> Path:
        """kubectl's discovery (and HTTP) cache for this cluster alone: pass it as
        `--cache-dir` or KUBECACHEDIR. kubectl keys its cache by host:port only and trusts it
        for 6 h, so a cluster on a loopback port an earlier one used reads that one's list of
        resources: a kind this cluster does not serve then maps, and its request fails with a
        404 that `--ignore-not-found` swallows (rc 0), where "no matches for kind" was due."""
        return self.workdir / "kubectl-cache"

    def kubectl(
        self, *args: str, check: bool = True, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl as admin against this cluster (with the cluster's own cache)."""
        return subprocess.run(
            [
                str(self.kubectl_path),
                f"--kubeconfig={self.kubeconfig}",
                f"--cache-dir={self.kubectl_cache_dir}",
                *args,
            ],
            input=stdin,
            capture_output=True,
            text=True,
            check=check,
        )

    def ready(self) -> bool:
        """The apiserver answers /readyz (a quick probe; no wait)."""
        return self._ready("/readyz")

    def alive(self) -> bool:
        return all(p.alive() for p in self.processes) and self._ready("/readyz")

    def stop(self) -> None:
        """Stop every process (whole process groups), delete etcd's data and the state file."""
        errors: list[str] = []
        for rec in reversed(self.processes):
            try:
                stop_process(rec, self._popens.pop(rec.name, None))
            except RuntimeError as e:
                errors.append(str(e))
        shutil.rmtree(self.etcd_data_dir, ignore_errors=True)
        if errors:
            raise ControlPlaneError("; ".join(errors))
        (self.workdir / _STATE).unlink(missing_ok=True)
        self.processes = []

    def restart(
        self, name: str, *, die_with_parent: bool = True, kill: bool = True, wait: bool = True
    ) -> None:
        """Stop one process (`kill`: SIGKILL, no graceful shutdown) and launch it again with
        the same arguments, ports and log; for the apiserver, with `wait`, block until
        /readyz passes (without it, the caller polls `ready()`).

        For fault injection (`make chaos`): etcd keeps the state, so a restarted apiserver or
        controller resumes where it was; clients see dropped watches and refused connections.
        """
        i = next((i for i, p in enumerate(self.processes) if p.name == name), None)
        if i is None or name not in self.argv:
            raise ControlPlaneError(f"no restartable process {name!r} in {self.workdir}")
        old = self.processes[i]
        popen = self._popens.pop(name, None)
        if kill:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(old.pid, 9)
        stop_process(old, popen, grace_s=0.0 if kill else 5.0)
        new_popen, rec = spawn(
            name, self.argv[name], Path(old.log), die_with_parent=die_with_parent
        )
        self._popens[name] = new_popen
        self.processes[i] = rec
        self._save()
        if name == "kube-apiserver" and wait:
            self._wait(ClusterSettings().ready_timeout_s, "/readyz", "kube-apiserver /readyz")

    def restart_exited(self) -> list[str]:
        """Launch again every process that exited on its own, as the kubelet restarts a
        control-plane static pod: kube-scheduler exits by design when it finds its cache
        corrupted, and the controller manager when it loses its leader lease. The names
        restarted (none when all run)."""
        gone = [p.name for p in self.processes if not p.alive() and p.name in self.argv]
        for name in gone:
            self.restart(name, kill=False, wait=False)
        return gone

    def __enter__(self) -> ControlPlane:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ---- start / attach -------------------------------------------------------------------
    @classmethod
    def start(
        cls,
        workdir: Path,
        *,
        kubeconfig: Path | None = None,
        logs_dir: Path | None = None,
        settings: ClusterSettings | None = None,
        bin_dir: Path | None = None,
        die_with_parent: bool = True,
    ) -> ControlPlane:
        """Launch a fresh control plane; blocks until it is ready (a few seconds).

        `die_with_parent=False` lets it outlive this Python process (`make cluster-up`).
        Leftovers of an earlier cluster in `workdir` are stopped first.
        """
        s = settings or ClusterSettings()
        workdir = workdir.resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        old = cls.attach(workdir, require_alive=False)
        if old is not None:
            old.stop()
        bin_dir = bin_dir or find_bin_dir()
        logs_dir = (logs_dir or workdir / "logs").resolve()
        logs_dir.mkdir(parents=True, exist_ok=True)
        kubeconfig = (kubeconfig or workdir / "kubeconfig").resolve()
        pki = workdir / "pki"
        kcs = workdir / "kubeconfigs"
        pki.mkdir(exist_ok=True)
        kcs.mkdir(exist_ok=True)

        ca = CertificateAuthority.generate()
        ca.write(pki / "ca.crt", pki / "ca.key")
        ca.issue(
            "kube-apiserver",
            hosts=("127.0.0.1", "localhost", "kubernetes", "kubernetes.default", "10.96.0.1"),
            server=True,
        ).write(pki / "apiserver.crt", pki / "apiserver.key")
        ca.issue_client(*_ADMIN).write(pki / "admin.crt", pki / "admin.key")
        write_service_account_key(pki / "sa.key", pki / "sa.pub")

        etcd_port, etcd_peer, api_port = free_ports(3)
        server = f"https://127.0.0.1:{api_port}"
        shm = Path("/dev/shm")
        data_root = shm if shm.is_dir() and os.access(shm, os.W_OK) else workdir
        _remove_orphaned_etcd_dirs(data_root)
        etcd_data = data_root / f"{_ETCD_DIR_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"

        def kc(path: Path, user: str, groups: Sequence[str] = ()) -> Path:
            return write_kubeconfig(
                path,
                server=server,
                ca_cert_pem=ca.cert_pem,
                client=ca.issue_client(user, groups),
                user=user,
                state_dir=workdir,
            )

        kc(kubeconfig, *_ADMIN)
        cp = cls(workdir, kubeconfig, server, bin_dir, logs_dir, ca, [], etcd_data)

        def launch(name: str, args: Sequence[str]) -> None:
            popen, rec = spawn(
                name, [str(bin_dir / name), *args], logs_dir / f"{name}.log",
                die_with_parent=die_with_parent,
            )  # fmt: skip
            cp._popens[name] = popen
            cp.processes.append(rec)
            cp.argv[name] = [str(bin_dir / name), *args]
            cp._save()  # after every launch, so a failed start can still be cleaned up

        try:
            launch("etcd", _etcd_args(etcd_data, etcd_port, etcd_peer))
            launch("kube-apiserver", _apiserver_args(s, pki, etcd_port, api_port))
            cp._wait(s.ready_timeout_s, "/readyz", "kube-apiserver /readyz")
            sched_cfg = workdir / "kube-scheduler.yaml"
            sched_cfg.write_text(
                _scheduler_config(kc(kcs / "scheduler.kubeconfig", "system:kube-scheduler"), s)
            )
            kcm_kc = kc(kcs / "controller-manager.kubeconfig", "system:kube-controller-manager")
            launch("kube-controller-manager", _kcm_args(s, pki, kcm_kc))
            launch("kube-scheduler", [f"--config={sched_cfg}", "--secure-port=0"])
            if s.kwok:
                kwok_kc = kc(kcs / "kwok.kubeconfig", *_ADMIN)
                launch("kwok", _kwok_args(s, kwok_kc, stages_dir(bin_dir)))
            cp._wait(
                s.ready_timeout_s,
                "/api/v1/namespaces/default/serviceaccounts/default",
                "the default ServiceAccount (created by kube-controller-manager)",
            )
        except BaseException:
            with contextlib.suppress(Exception):
                cp.stop()
            raise
        return cp

    @classmethod
    def attach(cls, workdir: Path, *, require_alive: bool = True) -> ControlPlane | None:
        """The control plane recorded in `workdir`: None if there is none (or, with
        `require_alive`, if any of its processes died or the apiserver is not ready)."""
        state_file = workdir / _STATE
        try:
            st = json.loads(state_file.read_text())
        except (OSError, ValueError):
            return None
        wd = Path(st["workdir"])
        cp = cls(
            workdir=wd,
            kubeconfig=Path(st["kubeconfig"]),
            server=st["server"],
            bin_dir=Path(st["bin_dir"]),
            logs_dir=Path(st["logs_dir"]),
            ca=CertificateAuthority.load(wd / "pki" / "ca.crt", wd / "pki" / "ca.key"),
            processes=[ProcessRecord.from_json(p) for p in st["processes"]],
            etcd_data_dir=Path(st["etcd_data_dir"]),
            argv={k: list(v) for k, v in st.get("argv", {}).items()},
        )
        if require_alive and not cp.alive():
            return None
        return cp

    @classmethod
    def from_kubeconfig(cls, kubeconfig: Path) -> ControlPlane:
        """Attach to the running control plane that wrote `kubeconfig` (e.g. `.dev/kubeconfig`)."""
        state_dir = read_state_dir(kubeconfig)
        cp = cls.attach(state_dir) if state_dir else None
        if cp is None:
            raise ControlPlaneError(
                f"{kubeconfig} does not belong to a running local control plane "
                "(start one with `make cluster-up`)"
            )
        return cp

    # ---- internals ------------------------------------------------------------------------
    def _save(self) -> None:
        state = {
            "workdir": str(self.workdir),
            "kubeconfig": str(self.kubeconfig),
            "server": self.server,
            "bin_dir": str(self.bin_dir),
            "logs_dir": str(self.logs_dir),
            "etcd_data_dir": str(self.etcd_data_dir),
            "processes": [p.to_json() for p in self.processes],
            "argv": self.argv,
        }
        tmp = self.workdir / (_STATE + ".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        os.replace(tmp, self.workdir / _STATE)

    def _ssl(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.workdir / "pki" / "ca.crt"))
        pki = self.workdir / "pki"
        ctx.load_cert_chain(pki / "admin.crt", pki / "admin.key")
        return ctx

    def _ready(self, path: str, ctx: ssl.SSLContext | None = None) -> bool:
        try:
            with urllib.request.urlopen(
                self.server + path, context=ctx or self._ssl(), timeout=5
            ) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def _wait(self, timeout_s: float, path: str, what: str) -> None:
        ctx = self._ssl()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = [p for p in self.processes if not p.alive()]
            if dead:
                raise ControlPlaneError(
                    f"{dead[0].name} exited while waiting for {what}:\n" + _tail(Path(dead[0].log))
                )
            if self._ready(path, ctx):
                return
            time.sleep(0.2)
        raise ControlPlaneError(
            f"timed out after {timeout_s:.0f}s waiting for {what}; logs in {self.logs_dir}"
        )


def _remove_orphaned_etcd_dirs(root: Path) -> None:
    """Delete etcd data dirs no running process names on its command line. They are what a
    launcher killed with SIGKILL leaves behind (its children die with it, via PDEATHSIG, but
    nobody runs `stop()`), and on /dev/shm they hold memory."""
    in_use = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                in_use.update((proc / "cmdline").read_bytes().split(b"\0"))
    for d in root.glob(_ETCD_DIR_PREFIX + "*"):
        if f"--data-dir={d}".encode() not in in_use:
            shutil.rmtree(d, ignore_errors=True)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {path})"


def _etcd_args(data_dir: Path, port: int, peer_port: int) -> list[str]:
    client, peer = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{peer_port}"
    return [
        "--name=instaslice",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=instaslice={peer}",
        "--unsafe-no-fsync",
        "--quota-backend-bytes=8589934592",
        "--log-level=warn",
    ]


def _apiserver_args(s: ClusterSettings, pki: Path, etcd_port: int, port: int) -> list[str]:
    return [
        f"--etcd-servers=http://127.0.0.1:{etcd_port}",
        "--bind-address=127.0.0.1",
        "--advertise-address=127.0.0.1",
        f"--secure-port={port}",
        f"--cert-dir={pki}",
        f"--tls-cert-file={pki / 'apiserver.crt'}",
        f"--tls-private-key-file={pki / 'apiserver.key'}",
        f"--client-ca-file={pki / 'ca.crt'}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={pki / 'sa.pub'}",
        f"--service-account-signing-key-file={pki / 'sa.key'}",
        "--service-cluster-ip-range=10.96.0.0/16",
        "--authorization-mode=Node,RBAC",
        "--allow-privileged=true",
        # the kubernetes Service's endpoint would be 127.0.0.1, which Endpoints reject
        "--endpoint-reconciler-type=none",
        # no kube-proxy: a webhook Service (the chart's, `install: chart`) is reached by
        # dialing its endpoints, as for aggregated APIs (hack/cluster/podnet.py)
        "--enable-aggregator-routing=true",
        f"--default-not-ready-toleration-seconds={s.not_ready_toleration_s}",
        f"--default-unreachable-toleration-seconds={s.unreachable_toleration_s}",
        "--profiling=false",
        *s.extra_apiserver_args,
    ]


def _kcm_args(s: ClusterSettings, pki: Path, kubeconfig: Path) -> list[str]:
    return [
        f"--kubeconfig={kubeconfig}",
        "--secure-port=0",
        "--leader-elect=false",
        "--controllers=*",
        "--use-service-account-credentials=true",
        f"--root-ca-file={pki / 'ca.crt'}",
        f"--service-account-private-key-file={pki / 'sa.key'}",
        f"--cluster-signing-cert-file={pki / 'ca.crt'}",
        f"--cluster-signing-key-file={pki / 'ca.key'}",
        f"--node-monitor-grace-period={s.node_monitor_grace_s}s",
        f"--node-monitor-period={s.node_monitor_period_s}s",
        f"--kube-api-qps={s.client_qps}",
        f"--kube-api-burst={s.client_burst}",
    ]


def _scheduler_config(kubeconfig: Path, s: ClusterSettings) -> str:
    return (
        "apiVersion: kubescheduler.config.k8s.io/v1\n"
        "kind: KubeSchedulerConfiguration\n"
        "clientConnection:\n"
        f"  kubeconfig: {kubeconfig}\n"
        f"  qps: {s.client_qps}\n"
        f"  burst: {s.client_burst}\n"
        "leaderElection:\n"
        "  leaderElect: false\n"
    )


def _kwok_args(s: ClusterSettings, kubeconfig: Path, stages: Path) -> list[str]:
    key, value = KWOK_NODE_ANNOTATION
    # the cached upstream stages, overridden by name by the repo's own (hack/cluster/stages/)
    by_name = {c.name: c for c in stages.glob("*.yaml")}
    by_name.update({c.name: c for c in (Path(__file__).parent / "stages").glob("*.yaml")})
    configs = [by_name[n] for n in sorted(by_name)]
    if not configs:
        raise ControlPlaneError(f"no KWOK stages in {stages}; rerun hack/kube/build.sh")
    return [
        f"--kubeconfig={kubeconfig}",
        *(f"--config={c}" for c in configs),
        "--manage-all-nodes=false",
        f"--manage-nodes-with-annotation-selector={key}={value}",
        f"--node-lease-duration-seconds={s.node_lease_duration_s}",
        f"--cidr={s.pod_cidr}",
    ]
