"""The system `bench.latency` measures: a fleet of KWOK nodes with InstaSlice, and its client.

`with_fleet` brings up a fresh `hack.dev.DevSystem` (etcd, kube-apiserver, scheduler, KCM,
KWOK, InstaSlice's webhook/allocator process and ONE emulated node-agent process serving
every node) of N KWOK nodes x 8 emulated H100-80GB, runs a body against it in an event loop
and always tears it down. `Fleet` is the body's handle: the benchmark's client, the
`Tracker` its informers feed, pod creation in the InstaSlice namespace `NS` or the static
baseline's `STATIC_NS`, and `measured`, which records process CPU/RSS and the API server's
requests around a scenario. The scenarios themselves are in bench/latency.py (and the floor's
in bench/floor.py); nothing here decides what to measure.
"""

from __future__ import annotations

import asyncio
import math
import os
import platform
import shutil
import time
import urllib.request
import warnings
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kubernetes_asyncio import config as k8s_config

from bench.latency_track import (
    ProcSampler,
    Tracker,
    admission_seconds,
    api_writes,
    latency_delta,
    load,
    machine_busy_s,
    mem_mb,
    r3,
    request_seconds,
    writes_summary,
)
from bench.warm import agent_scrape, warm_counts, warm_summary
from common.constants import DRA_API_VERSION
from common.draclaim import as_allocation
from common.kubeapi import (
    ApiError,
    Informer,
    Kube,
    Obj,
    core_path,
    group_path,
    harden,
    instaslice_path,
)
from hack.cluster.controlplane import ClusterSettings, ControlPlane
from hack.cluster.nodes import create_nodes, parse_spec, wait_nodes_ready
from hack.dev import DevSystem
from nodeagent.emulator import EmulatorControl

NS = "bench"
STATIC_NS = "bench-static"  # not opted in: no webhook, allocator or agent on its pods' path
MODEL = "H100-80GB"
PROFILE = "1g.10gb"
GPUS_PER_NODE = 8
OUT = Path(".dev/bench/latency.json")
RUN_DIR = Path(".dev/bench/latency-run")


def lease_s(nodes: int) -> int:
    """Node Lease duration for a fleet: renewals cost nodes/(lease/4) writes/s each for
    KWOK's node leases and the agent's (reference/control-plane.md); 1.6 s per node keeps
    each near 2.5 writes/s (capped at 20 minutes, so 2000 nodes pay 6.7/s)."""
    return int(min(1200, max(40, nodes * 1.6)))


def cluster_settings(nodes: int) -> ClusterSettings:
    """Stretch KWOK's node lease and KCM's grace period with the fleet (see lease_s)."""
    if nodes < 50:
        return ClusterSettings()
    lease = lease_s(nodes)
    return ClusterSettings(
        node_lease_duration_s=lease, node_monitor_grace_s=lease + 60, ready_timeout_s=300.0
    )


def agent_args(nodes: int) -> list[str]:
    """The agent's own per-node Leases like KWOK's; its garbage-collection rescan (NVML walk
    of every GPU, ~5-20 ms CPU per emulated node) every nodes/5 s, at least the default 30."""
    if nodes < 50:
        return []
    return [f"--lease-duration-s={lease_s(nodes)}", f"--gc-period-s={max(30, nodes // 5)}"]


def spec(nodes: int, dra: bool = False) -> Any:
    """The fleet's cluster spec; `dra`: every component in DRA mode (docs/dra.md)."""
    return parse_spec({"dra": dra, "nodes": [{
        "prefix": "gpu", "count": nodes, "gpus": GPUS_PER_NODE, "model": MODEL,
        "cpu": "128", "memory": "1Ti", "pods": 250,
    }]})  # fmt: skip


STATIC_PER_NODE = 7 * GPUS_PER_NODE  # an H100 statically sliced all-1g: 7 x 1g.10gb per GPU


def pod(name: str) -> Obj:
    """The same pod for both paths: in NS the webhook rewrites its `nvidia.com/mig-*` ask;
    in STATIC_NS it asks the nodes' pre-sliced capacity directly (the static baseline)."""
    limits = {f"nvidia.com/mig-{PROFILE}": 1, "cpu": "100m", "memory": "128Mi"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "bench"}},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "main", "image": "bench", "resources": {"limits": limits}}],
        },
    }


def machine() -> dict[str, Any]:
    mem = 0.0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) / 1024 / 1024
    except OSError:
        pass
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "memory_gib": round(mem, 1),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "load_at_start": load(),
    }


# ---- one fleet --------------------------------------------------------------------------------


class Fleet:
    """A running system of N nodes plus the bench's client, informers and tracker."""

    def __init__(self, system: DevSystem, kube: Kube, tracker: Tracker) -> None:
        self.system = system
        self.kube = kube
        self.tr = tracker
        self.pids = {
            "allocator": system.processes["webhook"].pid,
            "agent": system.processes["nodeagent"].pid,
            **{p.name: p.pid for p in system.cp.processes},
        }
        self.seq = 0
        self.ns = NS  # STATIC_NS while a static variant runs

    @property
    def static(self) -> bool:
        return self.ns == STATIC_NS

    def sampler(self) -> ProcSampler:
        return ProcSampler(dict(self.pids))

    def next_name(self) -> str:
        self.seq += 1
        return f"p{self.seq:05d}"

    async def create(self, sem: asyncio.Semaphore | None = None, name: str = "") -> str:
        name = name or self.next_name()
        body = pod(name)
        if sem is None:
            await self._create(name, body)
        else:
            async with sem:
                await self._create(name, body)
        return name

    async def _create(self, name: str, body: Obj) -> None:
        t = self.tr.sent(name)
        await create_pod(self.kube, core_path("pods", self.ns), body)
        t.admitted = self.tr.clock()

    async def delete(self, name: str) -> None:
        await self.kube.delete_ignore_missing(core_path("pods", self.ns, name))

    async def clean(self, timeout_s: float = 300.0) -> None:
        """Delete every bench pod; wait until no SliceAllocation is left in the namespace."""
        await self.kube.delete(core_path("pods", self.ns))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            allocs = await self.kube.list(instaslice_path("sliceallocations", self.ns))
            pods = await self.kube.list(core_path("pods", self.ns))
            if not allocs.get("items") and not pods.get("items"):
                return
            await asyncio.sleep(0.5)
        raise TimeoutError(f"bench namespace not clean after {timeout_s}s")

    async def api_writes(self) -> Counter[str]:
        return api_writes(await self.api_metrics())

    async def api_metrics(self) -> str:
        proc = await asyncio.to_thread(
            self.system.cp.kubectl, "get", "--raw", "/metrics", check=False
        )
        return proc.stdout

    async def agent_metrics(self) -> str:
        """The node agent process's /metrics ("" when it does not answer)."""
        port = self.system.agent_metrics_port
        return await asyncio.to_thread(agent_scrape, port) if port else ""

    async def measured(self, res: Obj, pods: int, coro: Any) -> None:
        """Run `coro` with process CPU/RSS and API-server writes recorded into `res`."""
        res["load_start"] = load()
        warm0 = warm_counts(await self.agent_metrics())
        text = await self.api_metrics()
        before, seconds = api_writes(text), request_seconds(text)
        s = self.sampler()
        s.start()
        busy0, own0 = machine_busy_s(), time.process_time()
        t0 = time.monotonic()
        try:
            await coro
        finally:
            wall = time.monotonic() - t0
            res["processes"] = procs = s.stop()
            text = await self.api_metrics()
            res["api"] = writes_summary(before, api_writes(text), pods, wall)
            # API writes per pod by kind (pod, SliceAllocation, its status, events, MigNode,
            # Leases): what the contract's chain costs the API server (docs/benchmarks.md)
            res["writes_per_pod"] = res["api"]["per_pod_by_kind"]
            # mean latency per request kind: the API server's own time for each (watches
            # left out), so a queue in a client shows as the gap to the step's time
            res["api"]["latency"] = dict(
                list(latency_delta(seconds, request_seconds(text)).items())[:12]
            )
            # load-independent cost: CPU seconds every process of the system spent, per pod,
            # and how many cores the system actually got (the machine is shared)
            total = sum(p["cpu_s"] for p in procs.values() if math.isfinite(p["cpu_s"]))
            res["system_cpu_s"] = r3(total)
            res["system_cpu_s_per_pod"] = r3(total / pods) if pods else math.nan
            res["system_cores_used"] = r3(total / wall) if wall > 0 else math.nan
            res["wall_s"] = r3(wall)
            # what else ran meanwhile: this benchmark process (its watches and clients),
            # and every core-second the machine was busy (the other engineers' work too)
            res["bench_cpu_s"] = r3(time.process_time() - own0)
            res["machine_busy_cores"] = r3((machine_busy_s() - busy0) / wall) if wall else 0.0
            res["load_end"] = load()
            warm = warm_summary(warm0, warm_counts(await self.agent_metrics()))
            if warm is not None:  # --warm-slices=on (docs/warm-slices.md)
                res["warm"] = warm

    async def scrape(self) -> dict[str, tuple[float, float]]:
        """The API server's request and admission histograms (`request_seconds`,
        `admission_seconds`) and the webhook's own (`instaslice_webhook_review_seconds`)."""
        text = await self.api_metrics()
        url = f"http://127.0.0.1:{self.system.metrics_port}/metrics"

        def get() -> str:
            with urllib.request.urlopen(url, timeout=5) as r:
                return str(r.read().decode())

        webhook = admission_seconds(await asyncio.to_thread(get))
        return {**request_seconds(text), **admission_seconds(text), **webhook}

    def set_latency(self, create_ms: int, destroy_ms: int) -> None:
        for node in self.system.nodes:
            EmulatorControl(self.system.gpu_state, node).set_latency(create_ms, destroy_ms)


async def create_pod(kube: Kube, path: str, body: Obj, attempts: int = 5) -> None:
    """POST the pod, retrying what may pass on a retry (timeouts, 429, 5xx). A retry that
    finds the pod already there (409) means an earlier attempt landed after all (its answer
    was lost to a timeout on a loaded machine): done, not an error."""
    for attempt in range(attempts):
        try:
            await kube.create(path, body)
            return
        except ApiError as exc:
            if attempt > 0 and exc.conflict:
                return
            if not exc.retryable or attempt == attempts - 1:
                raise
            await asyncio.sleep(0.2 * (attempt + 1))


async def opt_in(kube: Kube) -> None:
    body = {"metadata": {"name": NS, "annotations": {"instaslice.io/enabled": "true"}}}
    await kube.create(core_path("namespaces"), body)
    for _ in range(300):
        ns = await kube.get(core_path("namespaces", name=NS))
        if (ns["metadata"].get("labels") or {}).get("instaslice.io/enabled") == "true":
            break
        await asyncio.sleep(0.1)
    await kube.create(core_path("namespaces"), {"metadata": {"name": STATIC_NS}})
    for ns_name in (NS, STATIC_NS):
        await service_account(kube, ns_name)


async def pre_slice(kube: Kube, nodes: Sequence[str]) -> None:
    """The static baseline's nodes: each advertises `nvidia.com/mig-<PROFILE>` directly, as
    NVIDIA's device plugin does on a node MIG Manager sliced all-1g (the agent only ever
    touches `instaslice.io/` resources, KWOK keeps a node's capacity)."""
    sliced = {f"nvidia.com/mig-{PROFILE}": str(STATIC_PER_NODE)}
    body = {"status": {"capacity": sliced, "allocatable": sliced}}
    sem = asyncio.Semaphore(16)

    async def one(name: str) -> None:
        async with sem:
            await kube.patch(core_path("nodes", name=name) + "/status", body)

    await asyncio.gather(*(one(n) for n in nodes))


async def service_account(kube: Kube, namespace: str) -> None:
    for _ in range(300):  # pods need the default ServiceAccount (KCM makes it)
        try:
            await kube.get(core_path("serviceaccounts", namespace, "default"))
            return
        except ApiError as exc:
            if not exc.not_found:
                raise
        await asyncio.sleep(0.1)


class BenchSystem(DevSystem):
    """DevSystem with a readiness wait that grows with the fleet (its default, 120 s, is
    for dev-sized clusters; 2000 nodes publish 2000 MigNodes on a shared 2-core machine)."""

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        super().wait_ready(max(timeout_s, 0.5 * len(self.nodes)))


async def _nodes_ready(kubeconfig: Path, nodes: int) -> None:
    async with harden(await k8s_config.new_client_from_config(config_file=str(kubeconfig))) as api:
        names = await create_nodes(api, spec(nodes))
        await wait_nodes_ready(api, names, timeout_s=max(180.0, 0.5 * nodes))


def _leftovers(run_dir: Path) -> None:
    """Stop whatever an interrupted run left in `run_dir` (the whole system, or only the
    control plane when it died before InstaSlice started), then remove the directory."""
    old = DevSystem.attach(run_dir)
    cp = ControlPlane.attach(run_dir.absolute() / "cluster", require_alive=False)
    if old is not None:
        old.down()
    elif cp is not None:
        cp.stop()
    shutil.rmtree(run_dir, ignore_errors=True)


def bring_up(
    run_dir: Path,
    nodes: int,
    webhook_args: Sequence[str] = (),
    dra: bool = False,
    agent_extra: Sequence[str] = (),
) -> tuple[DevSystem, dict[str, float]]:
    """Control plane, then the KWOK nodes (Ready, untainted), then InstaSlice (DevSystem.up
    attaches to the running control plane); seconds per phase."""
    _leftovers(run_dir)
    phases: dict[str, float] = {}
    t0 = time.monotonic()
    cp = ControlPlane.start(
        run_dir / "cluster",
        kubeconfig=run_dir / "kubeconfig",
        logs_dir=run_dir / "logs",
        settings=cluster_settings(nodes),
        die_with_parent=True,
    )
    try:
        phases["control_plane_s"] = r3(time.monotonic() - t0)
        t1 = time.monotonic()
        asyncio.run(_nodes_ready(cp.kubeconfig, nodes))
        phases["nodes_ready_s"] = r3(time.monotonic() - t1)
        t2 = time.monotonic()
        with warnings.catch_warnings():
            # DevSystem hands its children to ProcessRecords and drops the Popen objects,
            # whose destructors warn that the (deliberately detached) child still runs; only
            # that warning is silenced (as tests/e2e/helpers.py does), so `-W error` passes
            warnings.filterwarnings("ignore", r"subprocess \d+ is still running", ResourceWarning)
            system = BenchSystem.up(
                run_dir,
                spec(nodes, dra),
                die_with_parent=True,
                cluster_settings=cluster_settings(nodes),
                agent_args=[*agent_args(nodes), *agent_extra],
                webhook_args=webhook_args,
            )
        phases["instaslice_ready_s"] = r3(time.monotonic() - t2)
    except BaseException:
        started = DevSystem.attach(run_dir)
        if started is not None:
            started.down()
        else:
            cp.stop()
        raise
    phases["startup_s"] = r3(time.monotonic() - t0)
    return system, phases


def with_fleet(
    run_dir: Path,
    nodes: int,
    idle_s: float,
    body: Any,
    log: Any,
    *,
    static: bool = False,
    webhook_args: Sequence[str] = (),
    dra: bool = False,
    agent_extra: Sequence[str] = (),
) -> dict[str, Any]:
    """Bring a fleet up, run `body(fleet, fleet_record)` in an event loop, always tear it
    down. Startup runs on the main thread, so the children die with this process
    (PR_SET_PDEATHSIG) even if it is killed."""
    log(f"fleet of {nodes} nodes x {GPUS_PER_NODE} {MODEL}: starting (load {load()})")
    system, phases = bring_up(run_dir, nodes, webhook_args, dra, agent_extra)
    cs = cluster_settings(nodes)
    rec: dict[str, Any] = {
        "nodes": nodes,
        "gpus": nodes * GPUS_PER_NODE,
        **phases,
        "settings": {
            "allocation_mode": "dra" if dra else "gates",
            "kwok_node_lease_s": cs.node_lease_duration_s,
            "kcm_node_monitor_grace_s": cs.node_monitor_grace_s,
            "agent_args": [*agent_args(nodes), *agent_extra],
            "webhook_args": list(webhook_args),
        },
    }
    steps = ", ".join(f"{k} {v:.0f}" for k, v in phases.items())
    log(f"  up in {phases['startup_s']:.1f}s ({steps})")
    try:
        asyncio.run(_session(system, rec, idle_s, body, log, static, dra))
    finally:
        system.down()
        log(f"  torn down (load {load()})")
    return rec


async def _session(
    system: DevSystem, rec: Obj, idle_s: float, body: Any, log: Any, static: bool, dra: bool
) -> None:
    async with await Kube.connect(str(system.kubeconfig)) as kube:
        tr = Tracker()
        fleet = Fleet(system, kube, tr)
        rec["after_startup"] = {
            k: {"peak_rss_mb": round(mem_mb(p)[1], 1)} for k, p in fleet.pids.items()
        }
        await opt_in(kube)
        if static:  # the static variants' capacity (a write per node: not for scale)
            await pre_slice(kube, system.nodes)
        informers = [
            Informer(kube, core_path("pods", NS), tr.on_pod, name="bench-pods"),
            Informer(kube, core_path("pods", STATIC_NS), tr.on_pod, name="bench-static-pods"),
            # the pods' records: in DRA mode their ResourceClaims, read as the allocations
            # they stand for (`Ready`: allocated and reserved, docs/dra.md)
            Informer(kube, claims_path(NS), claims_as_allocations(tr), name="bench-claims")
            if dra
            else Informer(
                kube, instaslice_path("sliceallocations", NS), tr.on_alloc, name="bench-allocs"
            ),
        ]
        tasks = [asyncio.create_task(i.run()) for i in informers]
        try:
            for i in informers:
                await i.synced.wait()
            rec["idle"] = await idle(fleet, idle_s)
            log(
                f"  idle: agent {rec['idle']['agent']['cpu_share']:.0%} CPU, "
                f"allocator {rec['idle']['allocator']['cpu_share']:.0%} CPU"
            )
            await body(fleet, rec)
        finally:
            # cancel until done: Python 3.11's wait_for (in Kube.watch) can swallow a
            # cancellation (gh-86296), and a still-running watch leaks its connection
            while pending := [t for t in tasks if not t.done()]:
                for t in pending:
                    t.cancel()
                await asyncio.wait(pending, timeout=1.0)


def claims_path(namespace: str) -> str:
    return group_path(DRA_API_VERSION, "resourceclaims", namespace)


def claims_as_allocations(tr: Tracker) -> Any:
    async def on_claim(etype: str, obj: Obj) -> None:
        shaped = as_allocation(obj)
        if shaped is not None:
            await tr.on_alloc(etype, shaped)

    return on_claim


async def idle(fleet: Fleet, seconds: float) -> dict[str, Any]:
    s = fleet.sampler()
    s.start()
    await asyncio.sleep(seconds)
    return s.stop()
