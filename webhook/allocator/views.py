"""The allocator's parsed views of the objects it watches: Pods, Nodes and MigNodes' GPUs.

Each watched object is parsed once, when it arrives, into a frozen view holding only what
the allocator decides on (SliceAllocations use the one model, common.allocation). Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from common.catalog import GpuModel
from common.catalog.learned import Geometries
from common.clock import parse_time
from common.constants import DRAIN_TIMED_OUT, MIG_MAX_NODE_TABLES
from common.objects import desired_modes, gpu_out_of_bounds
from common.placement import Taint
from common.quantity import parse_bytes, parse_cpu_millis
from webhook.allocator import pods as podlib
from webhook.allocator.pods import Resources

Obj = dict[str, Any]


@dataclass(frozen=True, slots=True)
class PodView:
    uid: str
    key: str  # namespace/name
    namespace: str
    name: str
    claim: str | None
    gates: tuple[str, ...]
    priority: int
    created: str
    generation: int
    terminal: bool
    deleting: bool
    bound: str
    pinned: str | None
    unschedulable: bool
    resources: Resources
    extended: tuple[tuple[str, int], ...]  # its instaslice.io/* requests, at least
    obj: Obj
    whole: bool = False  # it asks for whole GPUs (instaslice.io/gpu)

    @classmethod
    def of(cls, obj: Obj, *, like: PodView | None = None) -> PodView:
        """`like`: an earlier view of the same pod with the same requests (`same_requests`),
        whose parsed requests serve (quantity parsing is the costly part of reading a pod)."""
        meta = obj.get("metadata", {})
        return cls(
            uid=podlib.uid(obj),
            key=podlib.key(obj),
            namespace=str(meta.get("namespace", "")),
            name=str(meta.get("name", "")),
            claim=podlib.claim(obj),
            gates=podlib.gates(obj),
            priority=podlib.priority(obj),
            created=podlib.created(obj),
            generation=int(meta.get("generation") or 0),
            terminal=podlib.is_terminal(obj),
            deleting=podlib.is_deleting(obj),
            bound=podlib.bound_node(obj),
            pinned=podlib.pinned_node(obj),
            unschedulable=podlib.is_unschedulable(obj),
            resources=like.resources if like is not None else podlib.pod_resources(obj),
            extended=like.extended if like is not None else podlib.extended_requests(obj),
            obj=obj,
            whole=like.whole if like is not None else podlib.asks_whole_gpu(obj),
        )

    @property
    def node(self) -> str | None:
        """The node the pod is bound or pinned to, if any."""
        return self.bound or self.pinned


def holder_facet(pod: PodView) -> tuple[object, ...]:
    """What a preemption plan may read of a pod holding slices (preemption.py `holders`:
    its priority and class, labels for PodDisruptionBudgets and Kueue, annotations and
    owners, start time, whether it is terminating or finished). A change of any of it moves
    `ClusterState.holders_version`; a status update that changes none of it does not."""
    meta, spec = pod.obj.get("metadata") or {}, pod.obj.get("spec") or {}
    return (
        pod.namespace,
        pod.priority,
        pod.terminal,
        pod.deleting,
        spec.get("priorityClassName"),
        spec.get("preemptionPolicy"),
        meta.get("labels"),
        meta.get("annotations"),
        meta.get("ownerReferences"),
        meta.get("creationTimestamp"),
        (pod.obj.get("status") or {}).get("startTime"),
    )


@dataclass(frozen=True, slots=True)
class NodeView:
    name: str
    labels: Mapping[str, str]
    taints: tuple[Taint, ...]
    unschedulable: bool
    allocatable: Resources
    # its allocatable instaslice.io/* resources: the agent's fixed upper bounds (contract §3)
    extended: Mapping[str, int]

    @classmethod
    def of(cls, obj: Obj) -> NodeView:
        meta, spec = obj.get("metadata", {}), obj.get("spec", {})
        alloc = obj.get("status", {}).get("allocatable") or {}

        def q(name: str, parse: Any) -> int:
            try:
                return int(parse(alloc[name])) if name in alloc else 0
            except ValueError:
                return 0

        return cls(
            name=str(meta.get("name", "")),
            labels={str(k): str(v) for k, v in (meta.get("labels") or {}).items()},
            taints=tuple(
                Taint(str(t.get("key", "")), str(t.get("value") or ""), str(t.get("effect", "")))
                for t in spec.get("taints") or []
            ),
            unschedulable=bool(spec.get("unschedulable")),
            allocatable=Resources(
                q("cpu", parse_cpu_millis), q("memory", parse_bytes), q("pods", parse_bytes)
            ),
            extended={
                str(k): q(k, parse_bytes)
                for k in sorted(alloc)
                if str(k).startswith(podlib.EXTENDED_PREFIX)
            },
        )


@dataclass(frozen=True, slots=True)
class Room:
    """What the kube-scheduler may see free on a node, at most: its allocatable (cpu,
    memory, pods, and the `instaslice.io/*` upper bounds its agent advertises) minus the
    requests of the pods the allocator knows are bound there (`spec.nodeName`, not
    finished). Pods only pinned or promised there are not subtracted: the scheduler counts
    a pod once it binds it, and might bind another there first. Placeholders are not
    subtracted either (the allocator does not cache them). It is a moment's answer: room
    grows when a pod bound there finishes (and looks too small while the allocator still
    sees a pod bound that the scheduler saw go), so only a signal that is replaced when
    bound where its pod cannot go may be kept off by it: a placeholder, on a node whose
    agent is up (`autoscale.misplaced`; the replacement lists that node)."""

    free: Resources
    extended: Mapping[str, int]  # allocatable instaslice.io/* resources
    extended_bound: Mapping[str, int]  # the bound pods' requests of them (at least)

    def holds(self, asks: Resources, extended: Mapping[str, int]) -> bool:
        """Would the scheduler's resource fit (NodeResourcesFit) admit a pod asking `asks`
        (cpu, memory, and one pod slot) and `extended` here? A resource asked 0 is not
        checked, one the node does not advertise is 0."""
        if asks.pods > self.free.pods:
            return False
        if asks.cpu_millis > 0 and asks.cpu_millis > self.free.cpu_millis:
            return False
        if asks.memory_bytes > 0 and asks.memory_bytes > self.free.memory_bytes:
            return False
        for k, n in extended.items():
            if n > 0 and n > self.extended.get(k, 0) - self.extended_bound.get(k, 0):
                return False
        return True


@dataclass(frozen=True, slots=True)
class GpuView:
    index: int
    uuid: str
    model: str
    mig_enabled: bool
    healthy: bool
    instances: tuple[tuple[int, int, str, str], ...]  # (start, size, profile, claim)
    # warm slices (docs/warm-slices.md): made ahead of demand, free capacity, not in
    # `instances`; a single-slice pod takes one when it ties the engine's choice
    warm: tuple[tuple[int, int, str], ...] = ()
    # MIG off (common/placement/modes.py): `flex`, its agent enables MIG without a reset and
    # it is idle; `needs_reset`, only a GPU reset would (Ampere)
    flex: bool = False
    needs_reset: bool = False
    # for whole GPUs (common/placement/whole.py), if nothing is on it: MIG off and idle; MIG
    # on and idle, turned off without a reset; MIG on and idle, only a reset turns it off
    whole_now: bool = False
    whole_toggle: bool = False
    whole_needs_reset: bool = False
    # what serves a whole GPU once nothing (no instance, no process) is on it: "off" (MIG
    # off), "resetless" (turned off by the agent), "reset" (Ampere maintenance), "" nothing;
    # what whole-GPU preemption plans on (common/placement/preempt_whole.py)
    whole_if_idle: str = ""
    geometry: GpuModel | None = None  # the published table, when not the catalog's (learned.py)
    # Ampere maintenance (docs/allocator.md): the MigNode's spec.gpus[].desiredMigMode; while
    # it is not reached (or the agent drains/resets the GPU) nothing is placed there
    desired: str = ""
    maintenance: bool = False
    phase: str = ""  # the agent's modeChange.phase (Draining, Resetting, ...), "" if none
    # the agent's last successful mode change: (the mode it reached, wall-clock seconds);
    # the allocator spaces opposite asks on one GPU by it (webhook/allocator/maintenance.py)
    last_change: tuple[str, float] | None = None
    # why the GPU's entry lies beyond the MigNode bounds (common.objects.gpu_out_of_bounds):
    # then it is an unhealthy GPU of no model with nothing listed, and nothing goes there
    refused: str = ""


def last_change(g: Obj) -> tuple[str, float] | None:
    """(mode reached, when) of a MigNode GPU entry's `lastModeChange`; None if absent."""
    change = g.get("lastModeChange") or {}
    when = parse_time(change.get("time"))
    if when is None or not change.get("to"):
        return None
    return str(change["to"]), when.timestamp()


MAINTENANCE_PHASES = ("Draining", "Resetting")


def in_maintenance(g: Obj, desired: str) -> bool:
    """A desired mode not reached yet, or the agent draining/resetting the GPU. Not once the
    agent reports that very ask given up (`Failed` with reason DrainTimedOut: its drain ran
    out): the GPU serves its current mode again while the ask is left standing. A reset
    that merely failed (no reason: the agent retries after its back-off) keeps it locked."""
    mode = g.get("migMode") or {}
    reached = mode.get("current") == mode.get("pending") == desired
    change = g.get("modeChange") or {}
    phase = change.get("phase")
    if phase in MAINTENANCE_PHASES:
        return True
    given_up = (
        phase == "Failed"
        and change.get("target") == desired
        and change.get("reason") == DRAIN_TIMED_OUT
    )
    return bool(desired and not reached and not given_up)


def mode_class(g: Obj) -> tuple[bool, bool]:
    """(flex, needs_reset) of one MigNode GPU entry (docs/contract.md §3). A GPU whose last
    mode change failed (within the agent's back-off) or is changing is neither."""
    mode = g.get("migMode") or {}
    off = mode.get("current") == "disabled" and mode.get("pending") == "disabled"
    settled = "modeChange" not in g and bool(g.get("healthy"))
    toggle = g.get("modeToggle")
    flex = off and settled and toggle == "resetless" and not g.get("computeProcesses")
    return flex, off and settled and toggle == "reset"


def whole_class(g: Obj) -> tuple[bool, bool, bool]:
    """(now, after a reset-less toggle, after a reset) of one MigNode GPU entry, for whole
    GPUs: `whole_if_idle` while no compute process runs there; whether anything else occupies
    it is the caller's question."""
    way = "" if g.get("computeProcesses") else whole_if_idle(g)
    return way == "off", way == "resetless", way == "reset"


def whole_if_idle(g: Obj) -> str:
    """What it takes a MigNode GPU entry to serve a whole GPU once its instances and their
    processes are gone: "off" (MIG is off), "resetless" (its agent turns MIG off without a
    reset), "reset" (only a reset does: Ampere maintenance), "" (it cannot: changing,
    failed, unhealthy, or no mode change here)."""
    mode = g.get("migMode") or {}
    cur, pend = mode.get("current"), mode.get("pending")
    if "modeChange" in g or not g.get("healthy"):
        return ""
    if cur == pend == "disabled":
        return "off"
    toggle = g.get("modeToggle")
    if cur == pend == "enabled" and toggle in ("resetless", "reset"):
        return str(toggle)
    return ""


def refused_gpu(g: Obj, problem: str) -> GpuView:
    """A GPU whose entry lies beyond the MigNode bounds: unhealthy, of no model (so no table
    is ever looked up or built for it), its listed instances ignored (their slots could not
    be drawn anyway; live allocations on it still count: ClusterState.occupied)."""
    return GpuView(
        index=int(g.get("index", 0)),
        uuid=str(g.get("uuid", "")),
        model="",
        mig_enabled=False,
        healthy=False,
        instances=(),
        refused=problem,
    )


def gpus_of(mig_node: Obj, geometries: Geometries) -> tuple[GpuView, ...]:
    out = []
    desired = desired_modes(mig_node)
    learned: set[GpuModel] = set()  # the tables of this node that are not the catalog's
    for g in mig_node.get("status", {}).get("gpus") or []:
        problem = gpu_out_of_bounds(g)  # before anything is read or learned from its tables
        model = str(g.get("model", ""))
        geometry = geometries.of(model, g.get("profiles") or []) if problem is None else None
        if geometry is not None and geometry not in learned:
            if len(learned) >= MIG_MAX_NODE_TABLES:
                problem = f"its node publishes more than {MIG_MAX_NODE_TABLES} GPU tables"
            learned.add(geometry)
        if problem is not None:
            out.append(refused_gpu(g, problem))
            continue
        mode = g.get("migMode") or {}
        want = desired.get(str(g.get("uuid", "")), "")
        locked = in_maintenance(g, want)
        flex, needs_reset = mode_class(g) if not locked else (False, False)
        whole_now, whole_toggle, whole_reset = whole_class(g) if not locked else (False,) * 3
        out.append(
            GpuView(
                index=int(g.get("index", 0)),
                uuid=str(g.get("uuid", "")),
                model=model,
                mig_enabled=mode.get("current") == "enabled" and mode.get("pending") == "enabled",
                healthy=bool(g.get("healthy")) and not locked,
                instances=tuple(
                    (
                        int(s.get("start", 0)),
                        int(s.get("size", 1)),
                        str(s.get("profile", "")),
                        str(s.get("claim") or ""),
                    )
                    for s in g.get("slices") or []
                    if not s.get("warm")
                ),
                warm=tuple(
                    (int(s.get("start", 0)), int(s.get("size", 1)), str(s.get("profile", "")))
                    for s in g.get("slices") or []
                    if s.get("warm")
                ),
                flex=flex,
                needs_reset=needs_reset,
                whole_now=whole_now,
                whole_toggle=whole_toggle,
                whole_needs_reset=whole_reset,
                whole_if_idle="" if locked else whole_if_idle(g),
                geometry=geometry,
                desired=want,
                maintenance=locked,
                phase=str((g.get("modeChange") or {}).get("phase") or ""),
                last_change=last_change(g),
            )
        )
    return tuple(sorted(out, key=lambda g: g.index))
