"""`make chaos`: a seeded fault-injection soak of the whole system, judged by ground truth.

    python -m bench.chaos --minutes M --seed S [--quick] [--dir D] [--out F]

Brings up InstaSlice on the local control plane with KWOK GPU nodes backed by the NVML
emulator (`hack.dev.DevSystem`, in its own dir `.dev/bench/chaos-run/`, always torn down),
then for M minutes runs three things at once:

- churn (`Workload`): MIG pods, and some whole-GPU pods (`nvidia.com/gpu: 1`; the
  namespaces opt in to whole GPUs too), created in opted-in namespaces — bare pods (deleted again
  at random), Jobs (KWOK completes them after a run time) and a Deployment per namespace
  (scaled up and down) — around a target number of live pods, so some wait for capacity;
  mixed priorities: a quarter of the bare and Job pods are `chaos-high` (half of those ask
  for a 4g/7g), the rest and the Deployments `chaos-low`, so the allocator preempts;
- faults (bench/chaos_faults.py), drawn from the seed: every kind once, then by weight,
  up to three at a time;
- a sampler: every second one list of SliceAllocations is checked for double bookings
  (bench/invariants.py), so a slot promised twice is caught at the moment, not only at the end.

After the last fault is recovered and the churn stops, it waits for the system to settle:
the settled invariants (no leaked instance, no orphan allocation, no unsettled pod) are
checked every few seconds until they hold twice in a row, or the settle timeout passes.
The result goes to `.dev/bench/chaos.json` (schema in docs/security.md); violations, the
fault log and per-kind counts ride along for diagnosis. Exit status 1 if any count is not 0.

Component settings for the soak (documented, not hidden): the node agent collects orphaned
records after 10 s (`--gc-grace-s`, default 60) and the allocator releases pinned-but-
unschedulable pods after 20 s (default 60) and gives a preemption up after 30 s of waiting
for its victims (`--preemption-wait-timeout`, default 180), so recoveries finish within the
settle time.

Preemption is judged too: every `Preempted` event's victim must have had a lower priority
than its preemptor (`preemption_priority_violations`, counted with the double bookings).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import logging
import random
import shutil
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from bench.chaos_dossier import AUDIT_LOG, Timelines, audit_args, dossier
from bench.chaos_faults import Faults, detached
from bench.invariants import (
    Report,
    Slot,
    Truth,
    Violation,
    check_settled,
    collect,
    double_bookings,
    is_instaslice_pod,
    slots_of,
)
from common.constants import ENABLED_KEY, NVIDIA_GPU, WHOLE_GPU_KEY
from common.kubeapi import ApiError, EventType, Informer, Kube, Obj, core_path, group_path
from common.kubeapi import instaslice_path as isl_path
from hack.cluster.controlplane import ClusterSettings
from hack.cluster.nodes import ClusterSpec, parse_spec
from hack.cluster.priority import ensure_priority_classes
from hack.dev import REPO, DevSystem

log = structlog.get_logger("chaos")

CHAOS_LABEL = "instaslice.io/chaos"
IMAGE = "registry.k8s.io/pause:3.10"
_NODE = {"cpu": "16", "memory": "64Gi", "pods": 110,
         "labels": {"nvidia.com/mig.capable": "true"}}  # fmt: skip
_OFF = {**_NODE, "migMode": "disabled"}
FULL_SPEC = {
    "nodes": [
        {"prefix": "h100", "count": 3, "gpus": 2, "model": "H100-80GB", **_NODE},
        {"prefix": "a100", "count": 2, "gpus": 2, "model": "A100-40GB", **_NODE},
        # MIG mode on demand: GPUs that start with MIG off
        {"prefix": "h100off", "count": 1, "gpus": 2, "model": "H100-80GB", **_OFF},
    ]
}
QUICK_SPEC = {
    "nodes": [
        {"prefix": "h100", "count": 2, "gpus": 2, "model": "H100-80GB", **_NODE},
        {"prefix": "a100", "count": 1, "gpus": 2, "model": "A100-40GB", **_NODE},
        {"prefix": "h100off", "count": 1, "gpus": 2, "model": "H100-80GB", **_OFF},
    ]
}
PROFILES = ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "1g.5gb", "2g.10gb", "3g.20gb")
AGENT_ARGS = ("--gc-grace-s=10", "--gc-period-s=5")
WHOLE_GPU_SHARE = 0.12  # of churn pods, asking one whole GPU (nvidia.com/gpu: 1)
WEBHOOK_ARGS = ("--pinned-unschedulable-timeout=20", "--preemption-wait-timeout=30")
PRIORITY_CLASSES = {"chaos-low": 100, "chaos-high": 1000}
LARGE_PROFILES = ("4g.40gb", "7g.80gb", "4g.20gb", "7g.40gb")  # H100 and A100-40GB


@dataclass(frozen=True)
class Mode:
    spec: dict[str, Any]
    namespaces: int
    target_pods: int
    churn_period_s: float
    fault_gap_s: float  # mean time between fault starts
    max_faults: int  # at once
    hold: tuple[float, float]
    settle_timeout_s: float
    # go on past the minutes until every fault kind came up, for at most this many times the
    # minutes (a loaded machine slows each fault down; the quick soak must see them all)
    every_kind_within: float = 0.0


# up to 4 faults at once: test_chaos_quick.py's soak goes on past its 30 s until the 13 kinds
# have all come up (seed 7: 46 s at load 10), at most 10 x as long on a loaded machine
QUICK = Mode(QUICK_SPEC, 2, 10, 0.8, 2.0, 4, (3.0, 10.0), 180.0, every_kind_within=10.0)
FULL = Mode(FULL_SPEC, 3, 24, 0.7, 5.0, 3, (5.0, 25.0), 300.0)


# --- the workload ---------------------------------------------------------------------------


def _container(name: str, profile: str, count: int = 1) -> Obj:
    return {
        "name": name,
        "image": IMAGE,
        "resources": {
            "limits": {f"nvidia.com/mig-{profile}": str(count)},
            "requests": {"cpu": "100m", "memory": "64Mi"},
        },
    }


def _whole(name: str) -> Obj:
    """A container asking one whole GPU (the namespaces opt in to whole GPUs too)."""
    return {
        "name": name,
        "image": IMAGE,
        "resources": {
            "limits": {NVIDIA_GPU: "1"},
            "requests": {"cpu": "100m", "memory": "64Mi"},
        },
    }


@dataclass
class Workload:
    """The churn, and the informer cache of its pods that the sampler reads too."""

    kube: Kube
    rng: random.Random
    mode: Mode
    namespaces: list[str] = field(default_factory=list)
    pods: dict[str, Obj] = field(default_factory=dict)  # uid -> latest pod
    seen: set[str] = field(default_factory=set)  # uids of every chaos pod ever seen
    ran: set[str] = field(default_factory=set)  # uids of those ever seen Running
    refused: int = 0
    deleted: int = 0
    priority: dict[str, int] = field(default_factory=dict)  # uid -> spec.priority
    timelines: Timelines = field(default_factory=Timelines)  # for a violation's dossier

    async def on_pod(self, etype: EventType, pod: Obj) -> None:
        uid = pod["metadata"]["uid"]
        self.timelines.on_pod(etype, pod, time.monotonic())
        self.seen.add(uid)
        self.priority[uid] = int(pod.get("spec", {}).get("priority") or 0)
        if pod.get("status", {}).get("phase") == "Running":
            self.ran.add(uid)
        if etype == "DELETED":
            self.pods.pop(uid, None)
        else:
            self.pods[uid] = pod

    def live(self) -> list[Obj]:
        return [
            p
            for p in self.pods.values()
            if not p["metadata"].get("deletionTimestamp")
            and p.get("status", {}).get("phase") not in ("Succeeded", "Failed")
            and p["metadata"]["namespace"] in self.namespaces
        ]

    def _profile(self) -> str:
        return self.rng.choice(PROFILES)

    def _pod_spec(self, *, mixed: bool = True) -> Obj:
        high = mixed and self.rng.random() < 0.25
        if self.rng.random() < WHOLE_GPU_SHARE:
            containers = [_whole("main")]
        elif high and self.rng.random() < 0.5:
            containers = [_container("main", self.rng.choice(LARGE_PROFILES))]
        else:
            containers = [_container("main", self._profile(), self.rng.choice((1, 1, 1, 2)))]
            if self.rng.random() < 0.15:
                containers.append(_container("side", self._profile()))
        return {
            "containers": containers,
            "terminationGracePeriodSeconds": 0,
            "priorityClassName": "chaos-high" if high else "chaos-low",
        }

    async def new_namespace(self) -> None:
        ns = await self.kube.create(
            core_path("namespaces"),
            {"metadata": {"generateName": "chaos-",
                          "annotations": {ENABLED_KEY: "true", WHOLE_GPU_KEY: "true"},
                          "labels": {CHAOS_LABEL: "1"}}},
        )  # fmt: skip
        name = ns["metadata"]["name"]
        # usable once the mirror labelled it (else MIG pods would skip the webhook) and its
        # default ServiceAccount exists; the webhook may be down for a while, so be patient
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with contextlib.suppress(ApiError):
                got = await self.kube.get(core_path("namespaces", name=name))
                sa = await self.kube.list(core_path("serviceaccounts", name))
                labels = got["metadata"].get("labels") or {}
                labelled = labels.get(ENABLED_KEY) == labels.get(WHOLE_GPU_KEY) == "true"
                if labelled and sa["items"]:
                    self.namespaces.append(name)
                    await self._deployment(name)
                    return
            await asyncio.sleep(0.5)
        log.warning("namespace never got its opt-in label; not used", namespace=name)

    async def _deployment(self, ns: str) -> None:
        labels = {CHAOS_LABEL: "1", "app": "svc"}
        body = {
            "metadata": {"name": "svc"},
            "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels},
                                  "spec": self._pod_spec(mixed=False)}},
        }  # fmt: skip
        with contextlib.suppress(ApiError):
            await self.kube.create(group_path("apps/v1", "deployments", ns), body)

    async def replace_namespace(self, ns: str) -> None:
        if ns in self.namespaces:
            self.namespaces.remove(ns)
        await self.kube.delete_ignore_missing(core_path("namespaces", name=ns))
        await self.new_namespace()

    async def create_pod(self, ns: str, *, why: str = "churn", name: str = "") -> Obj | None:
        meta: Obj = {"labels": {CHAOS_LABEL: "1", "why": why}}
        meta.update({"name": name} if name else {"generateName": "p-"})
        body = {"metadata": meta, "spec": self._pod_spec()}
        try:
            pod = await self.kube.create(core_path("pods", ns), body)
        except ApiError as exc:  # webhook down (failurePolicy Fail), apiserver restarting...
            self.refused += 1
            log.info("pod refused", namespace=ns, status=exc.status, error=exc.message[:120])
            return None
        self.seen.add(pod["metadata"]["uid"])
        return pod

    async def _job(self, ns: str) -> None:
        runtime = self.rng.randint(3, 20)
        labels = {CHAOS_LABEL: "1"}
        body = {
            "metadata": {"generateName": "job-"},
            "spec": {
                "backoffLimit": 0,
                "ttlSecondsAfterFinished": 10,
                "template": {
                    "metadata": {
                        "labels": labels,
                        "annotations": {"pod-complete.stage.kwok.x-k8s.io/delay": f"{runtime}s"},
                    },
                    "spec": {**self._pod_spec(), "restartPolicy": "Never"},
                },
            },
        }
        with contextlib.suppress(ApiError):
            await self.kube.create(group_path("batch/v1", "jobs", ns), body)

    async def _scale(self, ns: str) -> None:
        path = group_path("apps/v1", "deployments", ns, "svc")
        with contextlib.suppress(ApiError):
            await self.kube.patch(path + "/scale", {"spec": {"replicas": self.rng.randint(0, 3)}})

    async def step(self) -> None:
        if not self.namespaces:
            return
        ns = self.rng.choice(self.namespaces)
        live = self.live()
        r = self.rng.random()
        if len(live) < self.mode.target_pods and r < 0.75:
            if r < 0.45:
                await self.create_pod(ns)
            else:
                await self._job(ns)
        elif r < 0.85:
            bare = [p for p in live if (p["metadata"].get("labels") or {}).get("why") == "churn"]
            if bare:
                victim = self.rng.choice(bare)["metadata"]
                self.deleted += 1
                await self.kube.delete_ignore_missing(
                    core_path("pods", victim["namespace"], victim["name"])
                )
        else:
            await self._scale(ns)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.step()
            except ApiError as exc:
                log.info("churn step failed", error=str(exc)[:160])
            await asyncio.sleep(self.rng.uniform(0.5, 1.5) * self.mode.churn_period_s)


# --- sampling double bookings during the run --------------------------------------------------


@dataclass
class Sampler:
    kube: Kube
    workload: Workload
    last_slots: dict[str, list[Slot]] = field(default_factory=dict)  # pod uid -> slots
    violations: dict[str, Violation] = field(default_factory=dict)
    samples: int = 0
    faults: Faults | None = None  # the recent ones go into a violation's dossier
    logs: Path | None = None  # the components' logs (and the audit log); dossiers go there
    dossiers: list[Obj] = field(default_factory=list)
    max_dossiers: int = 5

    async def once(self) -> None:
        allocs = (await self.kube.list(isl_path("sliceallocations")))["items"]
        self.workload.timelines.on_allocations(allocs, time.monotonic())
        by_pod = {str(a["spec"].get("podUID", "")) for a in allocs}
        for a in allocs:
            self.last_slots[str(a["spec"].get("podUID", ""))] = slots_of(a)
        # pods still Running after their allocation went: confirm each with a fresh read
        # (the informer may lag) before counting an overlap with it
        held: dict[str, list[Slot]] = {}
        others = [s for a in allocs for s in slots_of(a)]
        for uid, pod in list(self.workload.pods.items()):
            if uid in by_pod or uid not in self.last_slots:
                continue
            mine = self.last_slots[uid]
            if not any(m.overlaps(o) and o.pod_uid != uid for m in mine for o in others):
                continue
            m = pod["metadata"]
            try:
                fresh = await self.kube.get(core_path("pods", m["namespace"], m["name"]))
            except ApiError:
                continue
            if (
                fresh["metadata"]["uid"] == uid
                and not fresh["metadata"].get("deletionTimestamp")
                and fresh.get("status", {}).get("phase") == "Running"
            ):
                held[uid] = mine
        for v in double_bookings(allocs, held):
            if v.key not in self.violations:
                log.error("double booking", violation=str(v))
                self.violations[v.key] = v
                if len(self.dossiers) < self.max_dossiers:
                    await self._dossier(v)
        self.samples += 1
        live_uids = set(self.workload.pods)
        for uid in [u for u in self.last_slots if u not in by_pod and u not in live_uids]:
            del self.last_slots[uid]

    async def _dossier(self, v: Violation) -> None:
        """Gather, now, what explains `v` (bench/chaos_dossier.py); keep it with the logs."""
        uids = [r for r in v.refs if "/" not in r]
        now_mono, now_wall = time.monotonic(), time.time()
        recent = []
        if self.faults is not None:
            for r in self.faults.records:
                ago = now_mono - (self.faults.t0 + r.started)
                if ago < 180:
                    wall = dt.datetime.fromtimestamp(now_wall - ago, dt.UTC)
                    recent.append({**r.to_json(), "at": wall.isoformat(timespec="seconds")})
        found = await dossier(
            self.kube,
            violation=str(v),
            pod_uids=uids,
            known_pods=self.workload.pods,
            allocs=[r for r in v.refs if "/" in r],
            timelines=self.workload.timelines,
            faults=recent,
            logs=self.logs,
        )
        self.dossiers.append(found)
        if self.logs is not None:
            path = self.logs / f"double-booking-{len(self.dossiers)}.json"
            await asyncio.to_thread(path.write_text, json.dumps(found, indent=1) + "\n")
        log.error("double booking dossier", dossier=found)

    async def run(self, period_s: float = 1.0) -> None:
        while True:
            try:
                await self.once()
            except ApiError as exc:  # apiserver restarting
                log.info("sample skipped", error=str(exc)[:120])
            await asyncio.sleep(period_s)


# --- the soak ---------------------------------------------------------------------------------


async def _supervise(system: DevSystem, restarts: Counter[str], period_s: float = 2.0) -> None:
    """The kubelet's part for the control plane: a component that exits on its own (not one
    a fault killed: those are restarted by the fault) is launched again and counted, with the
    last line of its log, so a soak goes on as a cluster would and the result says so."""
    while True:
        await asyncio.sleep(period_s)
        with detached():
            for name in system.cp.restart_exited():
                restarts[name] += 1
                rec = next(p for p in system.cp.processes if p.name == name)
                last = _last_error(Path(rec.log))
                print(f"{name} exited on its own; restarted ({last})", flush=True)
                log.warning("control-plane component exited; restarted", name=name, last=last)


def _last_error(path: Path) -> str:
    """The last error-level line of a Go component's log (klog `E…`), shortened."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "no log"
    errors = [ln for ln in lines if ln.startswith(("E", "F"))]
    return (errors[-1] if errors else lines[-1] if lines else "empty log")[:300]


async def _cancel(tasks: Sequence[asyncio.Task[Any]]) -> None:
    """Cancel until done (an informer's watch can swallow one cancellation on 3.11)."""
    while pending := [t for t in tasks if not t.done()]:
        for t in pending:
            t.cancel()
        await asyncio.wait(pending, timeout=1.0)


async def _settle(
    system: DevSystem, kube: Kube, timeout_s: float
) -> tuple[Report, float, dict[str, int]]:
    """Check the settled invariants until they hold twice in a row (3 s apart): the report,
    the seconds until the first of the two (the timeout if they never held), and what the
    settled system held (so a clean report is seen not to be an empty one)."""
    t0 = time.monotonic()
    first_ok: float | None = None
    report, held = Report(), {}
    while True:
        ok = False
        try:
            truth = await collect(kube, system.gpu_state, system.dir / "nodes", system.nodes)
            report = check_settled(truth)
            ok = report.ok
            held = _held(truth)
        except ApiError as exc:
            log.info("settle check failed", error=str(exc)[:120])
        now = time.monotonic() - t0
        if ok:
            if first_ok is not None:
                return report, first_ok, held
            first_ok = now
        else:
            first_ok = None
        if now > timeout_s:
            return report, now, held
        await asyncio.sleep(3.0)


def _held(truth: Truth) -> dict[str, int]:
    phases = Counter(str(p.get("status", {}).get("phase") or "Pending") for p in truth.pods
                     if is_instaslice_pod(p))  # fmt: skip
    return {
        "pods_running": phases["Running"],
        "pods_pending": phases["Pending"],
        "pods_finished": phases["Succeeded"] + phases["Failed"],
        "allocations": len(truth.allocs),
        "gpu_instances": len(truth.instances),
    }


async def soak(system: DevSystem, spec: ClusterSpec, mode: Mode, minutes: float, seed: int) -> Obj:
    t_start = time.monotonic()
    async with await Kube.connect(str(system.kubeconfig)) as kube:
        work = Workload(kube, random.Random(f"{seed}/churn"), mode)
        informer = Informer(
            kube, core_path("pods"), work.on_pod, label_selector=f"{CHAOS_LABEL}=1", name="pods"
        )
        faults = Faults(system, kube, spec, work, random.Random(f"{seed}/faults"),
                        hold=mode.hold)  # fmt: skip
        sampler = Sampler(kube, work, faults=faults, logs=system.logs)
        background = [
            asyncio.create_task(informer.run(), name="pod-informer"),
            asyncio.create_task(sampler.run(), name="sampler"),
        ]
        restarts: Counter[str] = Counter()
        background.append(asyncio.create_task(_supervise(system, restarts), name="supervisor"))
        errors: list[str] = []
        try:
            await ensure_priority_classes(kube, PRIORITY_CLASSES)
            for _ in range(mode.namespaces):
                await work.new_namespace()
            t_soak = time.monotonic()
            until = t_soak + minutes * 60
            last = time.monotonic() + minutes * 60 * max(1.0, mode.every_kind_within)
            stop = asyncio.Event()
            churn = asyncio.create_task(work.run(stop))
            rng = random.Random(f"{seed}/schedule")
            started: list[asyncio.Task[None]] = []
            next_progress = time.monotonic() + 30
            while True:
                await asyncio.sleep(rng.expovariate(1.0 / mode.fault_gap_s))
                now = time.monotonic()
                if now >= until and (
                    not mode.every_kind_within or faults.every_kind_came_up() or now >= last
                ):
                    break
                if sum(not t.done() for t in started) < mode.max_faults:
                    started.append(asyncio.create_task(faults.run_one()))
                if time.monotonic() > next_progress:
                    next_progress += 30
                    _progress(t_start, faults, work, sampler)
            stop.set()
            ended = time.monotonic()
            faults.finish()
            for res in await asyncio.gather(*started, return_exceptions=True):
                if isinstance(res, BaseException):
                    errors.append(f"{type(res).__name__}: {res}")
                    log.error("fault failed", error=str(res))
            await churn
            print(f"[{time.monotonic() - t_start:6.0f}s] last fault recovered; settling",
                  flush=True)  # fmt: skip
            report, settle_s, held = await _settle(system, kube, mode.settle_timeout_s)
            await sampler.once()  # one last sample, after settling
            preempted, wrong = await _preemptions(kube, work)
            for name, rec in system.processes.items():
                if not rec.alive():  # a component that crashed (nothing restarts it here)
                    errors.append(f"{name} exited; see {rec.log}")
            for task in background:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    errors.append(f"chaos {task.get_name()} failed: {task.exception()!r}")
        finally:
            await _cancel(background)
    result = {
        "minutes": round((ended - t_soak) / 60 if mode.every_kind_within else minutes, 2),
        "seed": seed,
        "faults_injected": faults.injected,
        "pods_created": len(work.seen),
        "leaked_instances": len(report.leaked_instances),
        "orphan_allocations": len(report.orphan_allocations),
        "double_booked": len(sampler.violations)
        + len([v for v in report.double_booked if v.key not in sampler.violations])
        + len(wrong),
        "unsettled_pods": len(report.unsettled_pods),
        "mode_mismatch": len(report.mode_mismatch),
        "whole_gpu_shared": len(report.whole_gpu_shared),
        "settle_s": round(settle_s, 1),
        # diagnosis, beyond the contract's schema
        "quick": mode is QUICK,
        "pods_ran": len(work.ran),
        "settled": held,
        "control_plane_restarts": dict(restarts),
        "faults_by_kind": faults.by_kind(),
        "double_booking_samples": sampler.samples,
        "pods_refused": work.refused,
        "preempted": preempted,
        "preemption_priority_violations": wrong,
        "fault_errors": errors,
        "faults_not_injected": faults.skipped,
        "violations": [str(v) for v in [*sampler.violations.values(), *report.all()]][:200],
        "dossiers": sampler.dossiers,
        "unsettled_timelines": _timelines_of(work, report.unsettled_pods[:10]),
        "faults": [r.to_json() for r in faults.records],
    }
    return result


def _timelines_of(work: Workload, pods: Sequence[Violation]) -> dict[str, list[Obj]]:
    """The timelines of the pods (namespace/name) the violations are about, for diagnosis."""
    uids = {
        f"{p['metadata']['namespace']}/{p['metadata']['name']}": uid for uid, p in work.pods.items()
    }
    return {v.key: work.timelines.pods.get(uids.get(v.key, ""), []) for v in pods}


async def _preemptions(kube: Kube, work: Workload) -> tuple[int, list[str]]:
    """How many `Preempted` events were written, and those whose victim's priority was not
    below the preemptor's (from the event message, "... (priority N) ...")."""
    events = await kube.list(core_path("events"), fieldSelector="reason=Preempted")
    wrong = []
    for e in events.get("items", []):
        message = str(e.get("message") or "")
        victim = work.priority.get(str(e.get("involvedObject", {}).get("uid")))
        try:
            preemptor = int(message.split("(priority ", 1)[1].split(")", 1)[0])
        except (IndexError, ValueError):
            wrong.append(f"unreadable Preempted event: {message[:120]}")
            continue
        if victim is None or victim >= preemptor:
            wrong.append(f"victim priority {victim} >= preemptor {preemptor}: {message[:120]}")
    return len(events.get("items", [])), wrong


def _progress(t0: float, faults: Faults, work: Workload, sampler: Sampler) -> None:
    print(
        f"[{time.monotonic() - t0:6.0f}s] faults {faults.injected} {faults.by_kind()}  "
        f"pods seen {len(work.seen)} live {len(work.live())} refused {work.refused}  "
        f"samples {sampler.samples} double-booked {len(sampler.violations)}",
        flush=True,
    )


def run_chaos(dir: Path, *, minutes: float, seed: int, quick: bool = False) -> Obj:
    """Bring the system up in `dir` (wiped first), soak it, always tear it down."""
    mode = QUICK if quick else FULL
    dir = dir.absolute()
    old = DevSystem.attach(dir)
    if old is not None:
        with contextlib.suppress(Exception):
            old.down()
    shutil.rmtree(dir, ignore_errors=True)
    dir.mkdir(parents=True)
    spec = parse_spec(mode.spec)
    # who deleted or bound what, for a violation's dossier (bench/chaos_dossier.py)
    audited = ClusterSettings(extra_apiserver_args=audit_args(dir, dir / "logs" / AUDIT_LOG))
    t0 = time.monotonic()
    with detached():
        system = DevSystem.up(
            dir, spec, die_with_parent=True, agent_args=AGENT_ARGS, webhook_args=WEBHOOK_ARGS,
            cluster_settings=audited,
        )  # fmt: skip
    print(f"InstaSlice up in {time.monotonic() - t0:.0f}s on {len(system.nodes)} nodes; "
          f"soaking {minutes:g} min, seed {seed}; logs in {system.logs}", flush=True)  # fmt: skip
    try:
        result = asyncio.run(soak(system, spec, mode, minutes, seed))
        if any(result[k] for k in COUNTS) or result["fault_errors"]:
            kept = dir.parent / f"{dir.name}-logs-seed{seed}"  # for diagnosis, past teardown
            shutil.rmtree(kept, ignore_errors=True)
            shutil.copytree(system.logs, kept)
            result["logs_kept"] = str(kept)
        return result
    finally:
        system.down()


COUNTS = (
    "leaked_instances",
    "orphan_allocations",
    "double_booked",
    "unsettled_pods",
    "mode_mismatch",
    "whole_gpu_shared",
)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="small fleet, short holds")
    ap.add_argument("--dir", type=Path, default=REPO / ".dev" / "bench" / "chaos-run")
    ap.add_argument("--out", type=Path, default=REPO / ".dev" / "bench" / "chaos.json")
    args = ap.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    log_file = (args.dir.parent / "chaos-driver.log").open("w")
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(file=log_file),
    )
    result = run_chaos(args.dir, minutes=args.minutes, seed=args.seed, quick=args.quick)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    summary = {k: result[k] for k in list(result)[:10]}
    print(json.dumps(summary, indent=1))
    for v in result["violations"][:20]:
        print("  ", v)
    print(f"written to {args.out}")
    return 0 if all(result[k] == 0 for k in COUNTS) and not result["fault_errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
