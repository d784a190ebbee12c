"""InstaSlice's safety and liveness invariants, checked against ground truth.

Ground truth is what actually exists, not what any component believes: the API objects
(Pods, SliceAllocations, the pods' AllocationPending/PinnedUnschedulable events), the GPU
instances the NVML emulator really holds (its state files, `EmulatorControl`), and the CDI
spec files on each node. `collect()` gathers it; every check is a pure function of a
`Truth`, so the chaos soak (bench/chaos.py), its quick test and the e2e tests share them.

The invariants (docs/contract.md §3-4, docs/protocol.md "Occupancy truth"):

- double booking (at any moment): no two live SliceAllocations — in any phase, including
  ones being deleted — overlap in memory slots on one GPU, nor name the same MIG UUID; and
  no live allocation overlaps the slots of a pod that still runs on a released allocation.
  `double_bookings()` needs only one list of allocations, so it is sampled during a run;
- leaked instance (once settled): every GPU instance the emulator holds belongs to a live
  allocation with exactly that GPU, start and size;
- orphan allocation (once settled): every allocation belongs to a live, non-terminal pod
  and is Ready with all its instances (MIG UUIDs as its status says) on the GPUs;
- mode mismatch (once settled): no Ready allocation has a MIG slice on a GPU whose MIG mode
  is off, nor a whole GPU on one whose MIG mode is on (the agent changes the mode on demand
  before creating, and after a reboot before re-creating);
- whole GPU shared (once settled): no GPU holds both a whole-GPU allocation and a GPU
  instance (at any moment, two allocations overlapping are already double-booked);
- unsettled pod (once settled): every InstaSlice pod is Running on slices it alone owns
  (Ready allocation of its UID on its node, instances present, CDI file present), or
  Pending with a reason (gated with an AllocationPending/PinnedUnschedulable event, or a
  scheduler condition), or finished, or gone.

What it does not check: CDI file contents and pod env (tests/e2e/helpers.py does, per
pod), capacity on Nodes and MigNodes (derived data the agent republishes).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from common.allocation import SliceAllocation
from common.constants import (
    CDI_FILE_PREFIX,
    CLAIM_ANNOTATION,
    GATE_NAME,
    INSTASLICE_GPU,
    INSTASLICE_MIG_PREFIX,
    NVIDIA_MIG_PREFIX,
    REASON_PENDING,
    REASON_PINNED_UNSCHEDULABLE,
)
from common.kubeapi import Kube, core_path, instaslice_path
from nodeagent.emulator import EmulatorControl

Obj = dict[str, Any]
Kind = Literal[
    "leaked_instance",
    "orphan_allocation",
    "double_booked",
    "unsettled_pod",
    "mode_mismatch",
    "whole_gpu_shared",
]
PENDING_REASONS = (REASON_PENDING, REASON_PINNED_UNSCHEDULABLE)


@dataclass(frozen=True, slots=True)
class Violation:
    kind: Kind
    key: str  # what it is about, stable across samples (so repeats count once)
    detail: str
    # the allocations (namespace/name) and pod UIDs it involves, for diagnosis
    refs: tuple[str, ...] = field(default=(), compare=False)

    def __str__(self) -> str:
        return f"{self.kind} {self.key}: {self.detail}"


@dataclass(frozen=True, slots=True)
class Instance:
    """One GPU instance (with its compute instance) as the emulated GPU holds it."""

    node: str
    gpu_uuid: str
    gpu_index: int
    profile: str
    start: int
    size: int
    mig_uuid: str


@dataclass(frozen=True, slots=True)
class Slot:
    """One slice of one allocation: where it is and whose it is."""

    alloc: str  # namespace/name
    pod_uid: str
    gpu_uuid: str
    start: int
    size: int
    mig_uuid: str  # from status; "" until Ready
    whole: bool = False  # a whole GPU (kind gpu): every slot, MIG off, no instance

    def overlaps(self, other: Slot) -> bool:
        return (
            self.gpu_uuid == other.gpu_uuid
            and self.start < other.start + other.size
            and other.start < self.start + self.size
        )


@dataclass
class Truth:
    """Everything the checks read, gathered at (nearly) one moment."""

    pods: list[Obj]
    allocs: list[Obj]
    instances: list[Instance]
    cdi_claims: dict[str, set[tuple[str, str]]]  # node -> {(namespace, claim)}
    pending_reasons: dict[str, str] = field(default_factory=dict)  # pod uid -> event reason
    mig_off: set[str] = field(default_factory=set)  # UUIDs of GPUs whose MIG mode is off


@dataclass
class Report:
    leaked_instances: list[Violation] = field(default_factory=list)
    orphan_allocations: list[Violation] = field(default_factory=list)
    double_booked: list[Violation] = field(default_factory=list)
    unsettled_pods: list[Violation] = field(default_factory=list)
    mode_mismatch: list[Violation] = field(default_factory=list)
    whole_gpu_shared: list[Violation] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.all()

    def all(self) -> list[Violation]:
        return (
            self.leaked_instances + self.orphan_allocations + self.double_booked
            + self.unsettled_pods + self.mode_mismatch + self.whole_gpu_shared
        )  # fmt: skip

    def counts(self) -> dict[str, int]:
        return {
            "leaked_instances": len(self.leaked_instances),
            "orphan_allocations": len(self.orphan_allocations),
            "double_booked": len(self.double_booked),
            "unsettled_pods": len(self.unsettled_pods),
            "mode_mismatch": len(self.mode_mismatch),
            "whole_gpu_shared": len(self.whole_gpu_shared),
        }


# --- reading objects ------------------------------------------------------------------------


def _key(obj: Obj) -> str:
    m = obj.get("metadata", {})
    return f"{m.get('namespace', '')}/{m.get('name', '')}"


def slots_of(obj: Obj) -> list[Slot]:
    alloc = SliceAllocation.parse(obj)
    done = alloc.status_slices
    out = []
    for i, s in enumerate(alloc.slices):
        mig = str(done[i].get("migUUID") or "") if i < len(done) else ""
        whole = s.kind == "gpu"
        out.append(Slot(alloc.key, alloc.pod_uid, s.gpu_uuid, s.start, s.size, mig, whole))
    return out


def _phase(pod: Obj) -> str:
    return str(pod.get("status", {}).get("phase") or "Pending")


def is_instaslice_pod(pod: Obj) -> bool:
    """Rewritten by the webhook (a claim), or asking for MIG slices at all."""
    if CLAIM_ANNOTATION in (pod.get("metadata", {}).get("annotations") or {}):
        return True
    spec = pod.get("spec", {})
    for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
        res = c.get("resources") or {}
        for k in {**(res.get("limits") or {}), **(res.get("requests") or {})}:
            if k.startswith((NVIDIA_MIG_PREFIX, INSTASLICE_MIG_PREFIX)) or k == INSTASLICE_GPU:
                return True
    return False


# --- the checks (pure) ------------------------------------------------------------------------


def double_bookings(
    allocs: Sequence[Obj], running_on_released: Mapping[str, Sequence[Slot]] | None = None
) -> list[Violation]:
    """Slots promised twice, in one consistent list of allocations. `running_on_released`
    (pod uid -> the slots of its last allocation) adds pods still Running whose allocation
    is gone: a new allocation on their slots is a double booking too."""
    slots = [s for a in allocs for s in slots_of(a)]
    out: list[Violation] = []
    for i, a in enumerate(slots):
        for b in slots[i + 1 :]:
            if a.alloc == b.alloc:
                if a.overlaps(b):
                    out.append(_booked(a, b, "slices of one allocation overlap"))
                continue
            if a.overlaps(b):
                out.append(_booked(a, b, "overlapping memory slots"))
            elif a.mig_uuid and a.mig_uuid == b.mig_uuid:
                out.append(_booked(a, b, f"both name MIG device {a.mig_uuid}"))
    for uid, held in (running_on_released or {}).items():
        for h in held:
            for s in slots:
                if s.pod_uid != uid and h.overlaps(s):
                    out.append(_booked(h, s, f"pod {uid} still runs on these slots"))
    return out


def _booked(a: Slot, b: Slot, why: str) -> Violation:
    x, y = sorted((f"{a.alloc}@{a.gpu_uuid}[{a.start}:{a.size}]",
                   f"{b.alloc}@{b.gpu_uuid}[{b.start}:{b.size}]"))  # fmt: skip
    refs = tuple(dict.fromkeys((a.alloc, b.alloc, a.pod_uid, b.pod_uid)))
    return Violation("double_booked", f"{x} & {y}", why, refs)


def leaked_instances(truth: Truth) -> list[Violation]:
    claimed = {(s.gpu_uuid, s.start, s.size) for a in truth.allocs for s in slots_of(a)}
    return [
        Violation(
            "leaked_instance",
            f"{i.node}/gpu{i.gpu_index}[{i.start}:{i.size}]",
            f"{i.profile} {i.mig_uuid or '(no compute instance)'} held by no live allocation",
        )
        for i in truth.instances
        if (i.gpu_uuid, i.start, i.size) not in claimed
    ]


def _missing_instances(alloc: Obj, by_place: Mapping[tuple[str, int, int], Instance]) -> str:
    """Why a Ready allocation's slices are not all on the GPUs ('' when they are). A whole
    GPU has no instance; `whole_gpu_shares` and `mode_mismatches` judge it."""
    for s in slots_of(alloc):
        if s.whole:
            continue
        inst = by_place.get((s.gpu_uuid, s.start, s.size))
        if inst is None:
            return f"no instance at {s.gpu_uuid}[{s.start}:{s.size}]"
        if s.mig_uuid != inst.mig_uuid:
            return f"status names {s.mig_uuid or '-'}, the GPU holds {inst.mig_uuid or '-'}"
    return ""


def orphan_allocations(truth: Truth) -> list[Violation]:
    live = {p["metadata"]["uid"]: p for p in truth.pods if _phase(p) not in ("Succeeded", "Failed")}
    by_place = {(i.gpu_uuid, i.start, i.size): i for i in truth.instances}
    out = []
    for a in truth.allocs:
        key, uid = _key(a), str(a.get("spec", {}).get("podUID", ""))
        phase = (a.get("status") or {}).get("phase") or "Pending"
        if uid not in live:
            why = "its pod is gone or finished"
        elif a["metadata"].get("deletionTimestamp"):
            why = f"still being deleted (phase {phase})"
        elif phase != "Ready":
            why = f"phase {phase}: {(a.get('status') or {}).get('message', '')}".rstrip(": ")
        else:
            why = _missing_instances(a, by_place)
        if why:
            out.append(Violation("orphan_allocation", key, why))
    return out


def unsettled_pods(truth: Truth) -> list[Violation]:
    allocs = {_key(a): a for a in truth.allocs}
    by_place = {(i.gpu_uuid, i.start, i.size): i for i in truth.instances}
    out = []
    for pod in truth.pods:
        if not is_instaslice_pod(pod):
            continue
        why = _pod_problem(pod, allocs, by_place, truth)
        if why:
            out.append(Violation("unsettled_pod", _key(pod), why))
    return out


def _pod_problem(
    pod: Obj,
    allocs: Mapping[str, Obj],
    by_place: Mapping[tuple[str, int, int], Instance],
    truth: Truth,
) -> str:
    meta, spec = pod["metadata"], pod.get("spec", {})
    phase, ns, uid = _phase(pod), meta.get("namespace", ""), meta.get("uid", "")
    claim = (meta.get("annotations") or {}).get(CLAIM_ANNOTATION)
    if meta.get("deletionTimestamp"):
        return "still being deleted"
    if phase in ("Succeeded", "Failed"):
        return ""
    if not claim:
        return "asks for MIG slices but was not rewritten by the webhook"
    alloc = allocs.get(f"{ns}/{claim}")
    mine = alloc is not None and alloc["spec"].get("podUID") == uid
    gates = [g.get("name") for g in spec.get("schedulingGates") or []]
    node = spec.get("nodeName")
    if phase == "Running":
        if alloc is None or not mine:
            return "Running without an allocation of its own"
        assert alloc is not None
        if (alloc.get("status") or {}).get("phase") != "Ready":
            return f"Running on an allocation in phase {alloc.get('status', {}).get('phase')}"
        if alloc["spec"].get("nodeName") != node:
            return f"Running on {node}, allocation is for {alloc['spec'].get('nodeName')}"
        missing = _missing_instances(alloc, by_place)
        if missing:
            return f"Running, but {missing}"
        if (ns, claim) not in truth.cdi_claims.get(str(node), set()):
            return f"Running, but no CDI spec file for {ns}/{claim} on {node}"
        return ""
    if node:
        return f"bound to {node} but {phase}"
    if GATE_NAME in gates:
        if alloc is not None:
            return f"gated; allocation {(alloc.get('status') or {}).get('phase', 'Pending')}"
        if uid in truth.pending_reasons:
            return ""
        return "gated with no allocation and no AllocationPending event"
    if gates:
        return ""  # another controller's gate goes first
    for c in pod.get("status", {}).get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason"):
            return ""
    return "Pending, ungated, with no scheduler verdict"


def mode_mismatches(truth: Truth) -> list[Violation]:
    """No Ready MIG slice on a GPU whose MIG mode is off (MIG mode on demand: the agent
    enables it before creating, and restores it after a reboot before re-creating)."""
    out = []
    for a in truth.allocs:
        if (a.get("status") or {}).get("phase") != "Ready":
            continue
        for s in slots_of(a):
            off = s.gpu_uuid in truth.mig_off
            if off != s.whole:
                what = "whole GPU" if s.whole else f"slice [{s.start}:{s.size}]"
                mode = "off" if off else "on"
                out.append(
                    Violation(
                        "mode_mismatch",
                        f"{_key(a)}@{s.gpu_uuid}",
                        f"Ready {what} on a GPU whose MIG mode is {mode}",
                    )
                )
    return out


def whole_gpu_shares(truth: Truth) -> list[Violation]:
    """No GPU holds both a whole-GPU allocation (any phase) and a GPU instance."""
    held = {i.gpu_uuid: i for i in truth.instances}
    return [
        Violation(
            "whole_gpu_shared",
            f"{s.alloc}@{s.gpu_uuid}",
            f"whole GPU allocated, but the GPU holds {held[s.gpu_uuid].profile} at "
            f"[{held[s.gpu_uuid].start}:{held[s.gpu_uuid].size}]",
        )
        for a in truth.allocs
        for s in slots_of(a)
        if s.whole and s.gpu_uuid in held
    ]


def check_settled(truth: Truth) -> Report:
    return Report(
        leaked_instances=leaked_instances(truth),
        orphan_allocations=orphan_allocations(truth),
        double_booked=double_bookings(truth.allocs),
        unsettled_pods=unsettled_pods(truth),
        mode_mismatch=mode_mismatches(truth),
        whole_gpu_shared=whole_gpu_shares(truth),
    )


# --- ground truth (I/O) ----------------------------------------------------------------------


def gpu_instances(gpu_state: Path, nodes: Iterable[str]) -> list[Instance]:
    """Every instance on the emulated GPUs of `nodes` (GIs without a CI included)."""
    out = []
    for node in nodes:
        ctl = EmulatorControl(gpu_state, node)
        uuids = {g.index: g.uuid for g in ctl.state().gpus}
        for r in ctl.instances():
            uuid = uuids[r.gpu_index]
            row = (r.gpu_index, r.profile_name, r.start, r.size, r.mig_uuid or "")
            out.append(Instance(node, uuid, *row))
    return out


def cdi_claims(cdi_root: Path, nodes: Iterable[str]) -> dict[str, set[tuple[str, str]]]:
    out: dict[str, set[tuple[str, str]]] = {}
    for node in nodes:
        d = cdi_root / node / "cdi"
        names = [p.name for p in d.glob(f"{CDI_FILE_PREFIX}*.json")] if d.is_dir() else []
        stems = (n[len(CDI_FILE_PREFIX) : -len(".json")].partition("_") for n in names)
        out[node] = {(ns, claim) for ns, _, claim in stems}
    return out


async def collect(kube: Kube, gpu_state: Path, cdi_root: Path, nodes: Sequence[str]) -> Truth:
    """Allocations first, then pods, events and the GPUs: a pod or instance newer than the
    allocation list can only make a check stricter in a settled system."""
    allocs = (await kube.list(instaslice_path("sliceallocations")))["items"]
    pods = (await kube.list(core_path("pods")))["items"]
    reasons: dict[str, str] = {}
    for reason in PENDING_REASONS:
        events = await kube.list(core_path("events"), fieldSelector=f"reason={reason}")
        for e in events["items"]:
            reasons[str(e.get("involvedObject", {}).get("uid", ""))] = reason
    instances = await asyncio.to_thread(gpu_instances, gpu_state, nodes)
    files = await asyncio.to_thread(cdi_claims, cdi_root, nodes)
    off = await asyncio.to_thread(gpus_with_mig_off, gpu_state, nodes)
    return Truth(pods, allocs, instances, files, reasons, off)


def gpus_with_mig_off(gpu_state: Path, nodes: Iterable[str]) -> set[str]:
    return {
        g.uuid
        for node in nodes
        for g in EmulatorControl(gpu_state, node).state().gpus
        if g.mig_current == 0
    }
