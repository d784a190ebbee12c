"""The faults `make chaos` injects, each with its recovery, drawn from a seeded RNG.

Every fault is an `inject` (what breaks) and a `recover` (what an operator or the platform
does afterwards); `Faults.run_one()` picks one by weight, injects it, holds it for a random
time and recovers it. The soak runs a few at once; a lock per target (a process, a node)
keeps two faults off the same target. `finish()` ends whatever is still broken before
the soak checks the invariants. What each fault is:

- `kill-webhook` / `kill-agent`: kill -9 of the webhook+allocator process (one process:
  admission, namespace mirror and allocator) or of the node-agent process (all emulated
  nodes), restarted after a few seconds. While the webhook is down, MIG pods in opted-in
  namespaces are refused (failurePolicy Fail), which the churn counts as refused;
- `restart-apiserver`: kill -9 of kube-apiserver, relaunched at once (etcd keeps the state);
- `nvml-fail`: the next 1-3 NVML create/destroy calls of one op on a node fail with a real
  NVML error code; `nvml-slow`: every create/destroy on a node takes 0.3-3 s for a while;
- `gpu-lost`: a GPU falls off the bus (XID 79; every NVML call on it fails). Recovery is
  what an operator does: drain the pods using it, `nvidia-smi -r` (emulator reset), and
  restart the node agent so it sees the GPU healthy again;
- `node-not-ready`: KWOK's node-not-ready stage marks the node NotReady; the taint manager
  evicts its pods after the (10 s) toleration; recovery marks it Ready again;
- `node-deleted`: the Node object is deleted (its allocations are finalized by the
  allocator, its pods removed by the pod garbage collector); recovery re-registers the node
  once its pods are gone, like a replaced machine joining under the same name;
- `pod-mid-allocation`: a MIG pod is created and deleted 0-2 s later, while it is gated,
  being placed or having its slices made;
- `namespace-deleted`: one of the churn's namespaces is deleted with everything in it; the
  churn carries on in a fresh one;
- `rollback-fail`: on one node the next create of a compute instance fails and so do the
  next two GPU-instance destroys: a create whose rollback NVML refuses twice (the agent's
  own and garbage collection's first retry) must still end `Failed`, nothing leaked;
- `same-name-gap`: a watch gap hides the replacement of a pod by a same-name one: the
  webhook and agent processes are frozen (SIGSTOP), kube-apiserver restarts (their watches
  break; resuming from a version the new apiserver's cache lacks means a re-list), a churn
  pod is deleted and a pod of the same name (no MIG request, so admission, in the frozen
  process, is not asked) created, and the processes thawed. The old UID must be released;
- `mode-flip`: an admin flips the MIG mode of an idle Hopper GPU (no instance, no process)
  behind InstaSlice's back, through NVML. The agent must read the new mode again (its
  garbage-collection rescan), enable MIG on demand when a slice needs the GPU, and no Ready
  slice may sit on a GPU with MIG off (invariant `mode_mismatch`). The soak's fleet has a
  node whose GPUs start with MIG off.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import random
import signal
import time
import warnings
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import pynvml
import structlog

from common.kubeapi import ApiError, Kube, Obj, core_path, instaslice_path
from hack.cluster.nodes import ClusterSpec, node_manifest
from hack.dev import DevSystem
from nodeagent.emulator import EmulatedNvml, EmulatorControl

log = structlog.get_logger("chaos.faults")

NOT_READY_LABEL = "node-not-ready.stage.kwok.x-k8s.io"
NVML_OPS = ("create_gi", "create_ci", "destroy_ci", "destroy_gi")
NVML_CODES = (
    pynvml.NVML_ERROR_UNKNOWN,
    pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES,
    pynvml.NVML_ERROR_TIMEOUT,
)
# relative weights; the cheap, frequent faults first
WEIGHTS: dict[str, int] = {
    "pod-mid-allocation": 6,
    "nvml-fail": 5,
    "nvml-slow": 3,
    "kill-agent": 3,
    "kill-webhook": 3,
    "restart-apiserver": 2,
    "gpu-lost": 2,
    "node-not-ready": 2,
    "node-deleted": 1,
    "namespace-deleted": 1,
    "rollback-fail": 2,
    "same-name-gap": 1,
    "mode-flip": 2,
}


@contextlib.contextmanager
def detached() -> Iterator[None]:
    """Around DevSystem starts: they keep a ProcessRecord and drop the Popen, whose destructor
    warns "subprocess N is still running" (an error under the test suite's filterwarnings).
    The children are meant to outlive it (DevSystem stops them by process group)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"subprocess \d+ is still running", ResourceWarning)
        yield


class Churn(Protocol):
    """What the faults need of the workload (bench.chaos.Workload)."""

    namespaces: list[str]

    async def create_pod(self, ns: str, *, why: str, name: str = "") -> Obj | None: ...

    async def replace_namespace(self, ns: str) -> None: ...


@dataclass
class FaultRecord:
    kind: str
    target: str
    started: float
    detail: str = ""
    ended: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "target": self.target,
            "t": round(self.started, 1),
            "held_s": round((self.ended or self.started) - self.started, 1),
            "detail": self.detail,
        }


@dataclass
class Faults:
    system: DevSystem
    kube: Kube
    spec: ClusterSpec
    churn: Churn
    rng: random.Random
    t0: float = field(default_factory=time.monotonic)
    hold: tuple[float, float] = (5.0, 25.0)  # how long a fault stays before its recovery
    records: list[FaultRecord] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    _busy: set[str] = field(default_factory=set)
    ending: asyncio.Event = field(default_factory=asyncio.Event)
    _deleted_nodes: set[str] = field(default_factory=set)
    _first_round: list[str] | None = None

    # ---- scheduling ------------------------------------------------------------------------

    @property
    def injected(self) -> int:
        return len(self.records)

    def every_kind_came_up(self) -> bool:
        return set(self.by_kind()) == set(WEIGHTS)

    def by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.records:
            out[r.kind] = out.get(r.kind, 0) + 1
        return dict(sorted(out.items()))

    @contextlib.contextmanager
    def _claim(self, kind: str, *targets: str) -> Iterator[bool]:
        """Hold `targets` for one fault; when one is busy, the fault is skipped and drawn
        again later (so every kind still comes up)."""
        if any(t in self._busy for t in targets):
            if self._first_round is not None:
                self._first_round.insert(0, kind)
            yield False
            return
        self._busy.update(targets)
        try:
            yield True
        finally:
            self._busy.difference_update(targets)

    def _nodes(self) -> list[str]:
        return [n for n in self.system.nodes if n not in self._deleted_nodes]

    async def run_one(self) -> None:
        """Pick a fault and run it through its recovery (or skip it when its target is busy
        with another fault): every kind once, in a shuffled order, then by weight."""
        if self._first_round is None:
            self._first_round = list(WEIGHTS)
            self.rng.shuffle(self._first_round)
        kinds = list(WEIGHTS)
        if self._first_round:
            kind = self._first_round.pop()
        else:
            kind = self.rng.choices(kinds, weights=[WEIGHTS[k] for k in kinds])[0]
        node = self.rng.choice(self._nodes())
        hold = self.rng.uniform(*self.hold)
        fn: dict[str, Callable[[], Awaitable[None]]] = {
            "kill-webhook": lambda: self._process("webhook", hold),
            "kill-agent": lambda: self._process("nodeagent", hold),
            "restart-apiserver": self._apiserver,
            "nvml-fail": lambda: self._nvml_fail(node),
            "nvml-slow": lambda: self._nvml_slow(node, hold),
            "gpu-lost": lambda: self._gpu_lost(node, hold),
            "node-not-ready": lambda: self._not_ready(node, hold),
            "node-deleted": lambda: self._node_deleted(node),
            "pod-mid-allocation": self._pod_mid_allocation,
            "namespace-deleted": self._namespace_deleted,
            "rollback-fail": lambda: self._rollback_fail(node),
            "same-name-gap": self._same_name_gap,
            "mode-flip": self._mode_flip,
        }
        try:
            await fn[kind]()
        except ApiError as exc:
            if not (exc.retryable or exc.conflict):
                raise
            # the API was away (another fault restarts it) before anything broke, or a
            # recovery gave up after its retries; the invariants at the end still judge
            self.skipped.append(f"{kind}: {exc}")
            log.warning("fault not injected", kind=kind, error=str(exc))
            if self._first_round is not None and not any(r.kind == kind for r in self.records):
                self._first_round.insert(0, kind)  # every kind still comes up

    def finish(self) -> None:
        """End every held fault now (its recovery runs); `run_one` calls still in flight
        return once recovered. The soak calls this after the last fault was drawn."""
        self.ending.set()

    def _start(self, kind: str, target: str, detail: str = "") -> FaultRecord:
        rec = FaultRecord(kind, target, time.monotonic() - self.t0, detail)
        self.records.append(rec)
        log.info("fault", kind=kind, target=target, detail=detail)
        return rec

    def _end(self, rec: FaultRecord) -> None:
        rec.ended = time.monotonic() - self.t0
        log.info("recovered", kind=rec.kind, target=rec.target)

    async def _held(
        self, rec: FaultRecord, hold: float, recover: Callable[[], Awaitable[None]]
    ) -> None:
        """Hold the fault for `hold` seconds (less once `finish()` was called), recover."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(hold):
                await self.ending.wait()
        for attempt in range(3):
            try:
                await recover()
                break
            except (ApiError, RuntimeError, OSError) as exc:  # e.g. kubectl during a blip
                log.warning("recovery failed; retrying", kind=rec.kind, error=str(exc))
                if attempt == 2:
                    raise
                await asyncio.sleep(3.0)
        self._end(rec)

    # ---- processes ---------------------------------------------------------------------------

    async def _process(self, name: str, hold: float) -> None:
        with self._claim(f"kill-{'agent' if name == 'nodeagent' else name}", "processes") as ok:
            if not ok:
                return
            rec = self._start(f"kill-{'agent' if name == 'nodeagent' else name}", name)
            self.system.kill(name)
            await self._held(rec, min(hold, 8.0), lambda: self._restart(name))

    async def _restart(self, name: str) -> None:
        # on the event loop's (main) thread: children get PDEATHSIG tied to this process
        with detached():
            if name == "webhook":
                self.system.start_webhook(die_with_parent=True)
            else:
                self.system.start_agent(die_with_parent=True)

    async def _apiserver(self) -> None:
        with self._claim("restart-apiserver", "processes") as ok:
            if not ok:
                return
            rec = self._start("restart-apiserver", "kube-apiserver")
            await self._restart_apiserver()
            self._end(rec)

    async def _restart_apiserver(self) -> None:
        """kill -9 of kube-apiserver, relaunched at once; returns once it is ready."""
        self.system.cp.restart("kube-apiserver", wait=False)
        deadline = time.monotonic() + 120
        while not await asyncio.to_thread(self.system.cp.ready):
            if time.monotonic() > deadline:
                raise RuntimeError("kube-apiserver did not come back within 120 s")
            await asyncio.sleep(0.5)

    # ---- NVML ----------------------------------------------------------------------------

    def _emu(self, node: str) -> EmulatorControl:
        return EmulatorControl(self.system.gpu_state, node)

    async def _nvml_fail(self, node: str) -> None:
        op = self.rng.choice(NVML_OPS)
        code = self.rng.choice(NVML_CODES)
        count = self.rng.randint(1, 3)
        rec = self._start("nvml-fail", node, f"next {count} {op} fail with NVML error {code}")
        await asyncio.to_thread(self._emu(node).fail_next, op, code, count)  # type: ignore[arg-type]
        self._end(rec)  # armed; the agent meets it on its next calls

    async def _rollback_fail(self, node: str) -> None:
        code = self.rng.choice(NVML_CODES)
        rec = self._start("rollback-fail", node, f"next create_ci, then 2 destroy_gi: error {code}")
        emu = self._emu(node)
        await asyncio.to_thread(emu.fail_next, "create_ci", code, 1)
        await asyncio.to_thread(emu.fail_next, "destroy_gi", code, 2)
        self._end(rec)  # armed; the agent meets it on its next create

    async def _mode_flip(self) -> None:
        """An admin flips the MIG mode of an idle Hopper GPU (no instance, no process) behind
        InstaSlice's back, on any node that has one; the agent must read it again and still
        change the mode on demand. A GPU any allocation names is left alone: a pod on it
        (whole GPU included) would hold a process there on real hardware, and SetMigMode
        would answer IN_USE; emulated pods run none."""
        allocs = (await self.kube.list(instaslice_path("sliceallocations")))["items"]
        used = {s.get("gpuUUID") for a in allocs for s in a.get("spec", {}).get("slices") or []}
        idle = []
        for n in self._nodes():
            state = await asyncio.to_thread(self._emu(n).state)
            idle += [
                (n, g)
                for g in state.gpus
                if not g.spec.resets_for_mig_mode and not g.gis and not g.all_processes()
                and not g.lost and g.uuid not in used
            ]  # fmt: skip
        if not idle:
            self._end(self._start("mode-flip", "-", "no idle Hopper GPU; nothing flipped"))
            return
        node, gpu = self.rng.choice(idle)
        target = 1 - gpu.mig_current
        rec = self._start("mode-flip", node, f"GPU {gpu.index}: MIG mode set to {target}")

        def flip() -> str:
            nv = EmulatedNvml(self.system.gpu_state, node)
            nv.nvmlInit()
            try:
                nv.nvmlDeviceSetMigMode(nv.nvmlDeviceGetHandleByIndex(gpu.index), target)
            except pynvml.NVMLError as exc:  # the agent made an instance there meanwhile
                return f"; refused: {exc}"
            finally:
                nv.nvmlShutdown()
            return ""

        rec.detail += await asyncio.to_thread(flip)
        self._end(rec)

    async def _nvml_slow(self, node: str, hold: float) -> None:
        with self._claim("nvml-slow", f"nvml/{node}") as ok:
            if not ok:
                return
            create, destroy = self.rng.randint(300, 3000), self.rng.randint(300, 3000)
            rec = self._start("nvml-slow", node, f"create {create} ms, destroy {destroy} ms")
            await asyncio.to_thread(self._emu(node).set_latency, create, destroy)
            await self._held(
                rec, hold, lambda: asyncio.to_thread(self._emu(node).set_latency, 0, 0)
            )

    async def _gpu_lost(self, node: str, hold: float) -> None:
        with self._claim("gpu-lost", f"node/{node}", "processes") as ok:
            if not ok:
                return
            gpus = (await asyncio.to_thread(self._emu(node).state)).gpus
            gpu = self.rng.choice(gpus)
            rec = self._start("gpu-lost", node, f"GPU {gpu.index} ({gpu.uuid}) fell off the bus")
            await asyncio.to_thread(self._emu(node).gpu_lost, gpu.index)

            async def recover() -> None:
                drained = await self._drain_gpu(gpu.uuid)
                await asyncio.to_thread(self._emu(node).reset_gpu, gpu.index, force=True)
                self.system.stop("nodeagent")
                await self._restart("nodeagent")
                rec.detail += f"; drained {drained} pods, reset the GPU, restarted the agent"

            await self._held(rec, hold, recover)

    async def _drain_gpu(self, gpu_uuid: str) -> int:
        """Delete the pods whose allocations use the GPU (their workload died with it)."""
        allocs = (await self.kube.list(instaslice_path("sliceallocations")))["items"]
        n = 0
        for a in allocs:
            if any(s.get("gpuUUID") == gpu_uuid for s in a["spec"]["slices"]):
                ns, pod = a["metadata"]["namespace"], a["spec"]["podName"]
                with contextlib.suppress(ApiError):
                    await self.kube.delete(core_path("pods", ns, pod))
                    n += 1
        return n

    # ---- nodes ---------------------------------------------------------------------------

    async def _not_ready(self, node: str, hold: float) -> None:
        with self._claim("node-not-ready", f"node/{node}") as ok:
            if not ok:
                return
            path = core_path("nodes", name=node)
            await self.kube.patch(path, {"metadata": {"labels": {NOT_READY_LABEL: "true"}}})
            rec = self._start("node-not-ready", node)

            async def recover() -> None:
                await self.kube.patch(path, {"metadata": {"labels": {NOT_READY_LABEL: None}}})
                now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                ready = {"type": "Ready", "status": "True", "reason": "KubeletReady",
                         "message": "chaos: recovered", "lastHeartbeatTime": now,
                         "lastTransitionTime": now}  # fmt: skip
                await self.kube.patch(
                    path + "/status", {"status": {"conditions": [ready]}}, "strategic"
                )

            await self._held(rec, max(hold, 15.0), recover)  # past the 10 s toleration

    async def _node_deleted(self, node: str) -> None:
        if len(self._nodes()) <= 2:
            return  # keep some capacity
        with self._claim("node-deleted", f"node/{node}") as ok:
            if not ok:
                return
            await self.kube.delete_ignore_missing(core_path("nodes", name=node))
            rec = self._start("node-deleted", node)
            self._deleted_nodes.add(node)

            async def recover() -> None:
                # a replacement machine joins under the same name once the old pods are gone
                await self._wait_no_pods_on(node, timeout_s=150)
                group = next(g for g in self.spec.groups if node in g.names())
                await self.kube.create(
                    core_path("nodes"), node_manifest(group, group.names().index(node))
                )
                self._deleted_nodes.discard(node)

            await self._held(rec, 0.0, recover)

    async def _wait_no_pods_on(self, node: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pods = await self.kube.list(core_path("pods"), fieldSelector=f"spec.nodeName={node}")
            if not pods["items"]:
                return
            await asyncio.sleep(2.0)
        log.warning("pods of a deleted node still there; re-registering it anyway", node=node)

    # ---- workload ------------------------------------------------------------------------

    async def _pod_mid_allocation(self) -> None:
        ns = self.rng.choice(self.churn.namespaces)
        delay = self.rng.uniform(0.0, 2.0)
        pod = await self.churn.create_pod(ns, why="mid-allocation")
        if pod is None:
            return
        name = pod["metadata"]["name"]
        rec = self._start("pod-mid-allocation", f"{ns}/{name}", f"deleted after {delay:.2f}s")
        await asyncio.sleep(delay)
        await self.kube.delete_ignore_missing(core_path("pods", ns, name))
        self._end(rec)

    async def _same_name_gap(self) -> None:
        with self._claim("same-name-gap", "processes") as ok:
            if not ok:
                return
            ns = self.rng.choice(self.churn.namespaces)
            name = f"same-{self.rng.randrange(10**6)}"
            if await self.churn.create_pod(ns, why="same-name", name=name) is None:
                return
            await asyncio.sleep(self.rng.uniform(0.5, 3.0))  # being placed, or placed
            rec = self._start("same-name-gap", f"{ns}/{name}")
            frozen = [self.system.processes[p] for p in ("webhook", "nodeagent")]
            for proc in frozen:
                os.kill(proc.pid, signal.SIGSTOP)
            try:
                await self._restart_apiserver()
                await self.kube.delete_ignore_missing(
                    core_path("pods", ns, name), gracePeriodSeconds=0
                )
                for _ in range(40):  # the same name again, once the old object is gone
                    with contextlib.suppress(ApiError):
                        await self.kube.get(core_path("pods", ns, name))
                        await asyncio.sleep(0.25)
                        continue
                    break
                # a pod with no MIG request: admission (the frozen webhook process) is not
                # asked, and the allocator's re-list finds another UID under the old name
                plain = {"metadata": {"name": name, "labels": {"why": "same-name"}},
                         "spec": {"containers": [{"name": "main", "image": "busybox"}],
                                  "terminationGracePeriodSeconds": 0}}  # fmt: skip
                with contextlib.suppress(ApiError):
                    await self.kube.create(core_path("pods", ns), plain)
            finally:
                for proc in frozen:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, signal.SIGCONT)
            self._end(rec)

    async def _namespace_deleted(self) -> None:
        if len(self.churn.namespaces) < 2:
            return
        ns = self.rng.choice(self.churn.namespaces)
        rec = self._start("namespace-deleted", ns)
        await self.churn.replace_namespace(ns)
        self._end(rec)
