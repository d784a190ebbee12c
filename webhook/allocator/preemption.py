"""Preemption, the allocator's side: who may be a victim, and the record of one preemption.

The victim search itself is pure and lives with the placement engine
(`common.placement.preempt.plan_preemption`); this module turns the allocator's model into
its input — one `Holder` per pod holding slices, with its priority, start time, the
PodDisruptionBudgets selecting it, whether it may be a victim and whether it is terminating
already — and keeps the PodDisruptionBudgets it needs (`Budgets`, fed by a watch). No I/O:
the evictions are `steps.py`'s, the decisions `track.next_step`'s (docs/allocator.md
"Preemption").

Who is never a victim: pods of equal or higher priority; pods of a `system-*`
PriorityClass; Kueue-managed pods unless `preempt_kueue_pods` — a pod is Kueue-managed when
its namespace matches the admin's `kueue_namespace_selector` (docs/kueue.md "Preemption"), never by
a label on the pod, which its owner could set to make it immune; a pod that did not
terminate in time for this preemptor (`avoid`); another preemptor's reservation; foreign
MIG instances (they have no holder: the planner sees them as blockers). A pod whose
eviction a PodDisruptionBudget refused for this preemptor stays a victim, one whose
eviction counts as a PDB violation (`refused`): chosen only as a last resort, as
kube-scheduler's preemption does. A whole-GPU pod plans only on GPUs that serve it without
a reset once empty (`whole_candidates`): an Ampere GPU in MIG mode would need the reset
InstaSlice never does for a pod.

The planner also needs what the node's lower-priority pods free: each holder's requests
(`Holder.frees`) and `spare`, the other lower-priority pods bound there (kube-scheduler's
own preemption frees them once the pod is pinned). And `OwnerBackoff` remembers, per
controller, the nodes where its pod was deleted as pinned-unschedulable: its next pods plan
no preemption there for a while (docs/allocator.md "Preemption").
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from common.allocation import SliceAllocation
from common.placement.model import Snapshot
from common.placement.preempt import Frees, Holder
from common.placement.whole import GpuRef
from webhook.allocator.pods import Resources
from webhook.allocator.state import ClusterState
from webhook.allocator.views import PodView

Obj = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Victim:
    uid: str
    namespace: str
    name: str


@dataclass
class Preemption:
    """One preemption in flight, in the preemptor's `PodTrack`: its reserved allocation
    (assumed in the model, so nobody else is given those slots; created once every victim's
    allocation is gone), the pods it evicts and those it waits for."""

    body: Obj  # the SliceAllocation to create
    key: str  # its namespace/name
    node: str
    victims: tuple[Victim, ...]
    waits_for: frozenset[str]  # uids of every pod whose allocation must go first
    deadline: float  # monotonic: past it, the preemption is given up
    evicted: frozenset[str] = frozenset()
    told: bool = False  # the `Preempting` event was written
    refused: str = ""  # uid of a victim whose eviction a PodDisruptionBudget refused
    # the plan evicts past a PodDisruptionBudget (its last resort, cost term 1 > 0): a
    # refused eviction is then answered with a delete, as kube-scheduler's preemption does
    past_pdb: bool = False
    summary: str = ""
    # whole GPUs: the reserved GPUs whose MIG mode goes off only through the Ampere
    # maintenance (asked with the plan); the reservation is created once that is done
    resets: tuple[GpuRef, ...] = ()


@dataclass(frozen=True)
class PreemptionSettings:
    budgets: Budgets  # the PodDisruptionBudgets, kept by a watch
    kueue_ok: bool  # Kueue-managed pods may be victims
    wait_s: float  # how long victims may take to release their slices
    now: Callable[[], float]  # monotonic
    # the namespaces whose pods are Kueue-managed (the admin's selector; a watch keeps it)
    kueue: Collection[str] = frozenset()
    # controllers whose pod was deleted as pinned-unschedulable: no preemption on that node
    backoff: OwnerBackoff = field(default_factory=lambda: OwnerBackoff())


# --- PodDisruptionBudgets -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Budget:
    namespace: str
    selector: Obj  # spec.selector (a LabelSelector); empty selects every pod of the namespace
    allowed: int  # status.disruptionsAllowed


@dataclass
class Budgets:
    """The cluster's PodDisruptionBudgets, by namespace/name (a watch feeds it)."""

    by_key: dict[str, Budget] = field(default_factory=dict)
    version: int = 0  # grows on every change: a failed plan read them (planning.PlanInputs)

    def upsert(self, obj: Obj) -> None:
        meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
        key = f"{meta.get('namespace')}/{meta.get('name')}"
        allowed = (obj.get("status") or {}).get("disruptionsAllowed")
        budget = Budget(
            namespace=str(meta.get("namespace") or ""),
            selector=spec.get("selector") or {},
            allowed=int(allowed) if isinstance(allowed, int) else 0,
        )
        if self.by_key.get(key) != budget:
            self.by_key[key] = budget
            self.version += 1

    def remove(self, obj: Obj) -> None:
        meta = obj.get("metadata") or {}
        if self.by_key.pop(f"{meta.get('namespace')}/{meta.get('name')}", None) is not None:
            self.version += 1

    def selecting(self, namespace: str, labels: Mapping[str, str]) -> tuple[str, ...]:
        return tuple(
            sorted(
                k
                for k, b in self.by_key.items()
                if b.namespace == namespace and selects(b.selector, labels)
            )
        )

    def allowed(self) -> dict[str, int]:
        return {k: b.allowed for k, b in self.by_key.items()}


def selects(selector: Obj, labels: Mapping[str, str]) -> bool:
    """A metav1.LabelSelector against labels (a PDB's empty selector selects every pod)."""
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for req in selector.get("matchExpressions") or []:
        key, op, values = req.get("key"), req.get("operator"), req.get("values") or []
        present = key in labels
        if op == "In" and not (present and labels[key] in values):
            return False
        if op == "NotIn" and present and labels[key] in values:
            return False
        if op == "Exists" and not present:
            return False
        if op == "DoesNotExist" and present:
            return False
    return True


# --- victims --------------------------------------------------------------------------------


_TERM = re.compile(
    r"^\s*(?:(?P<not>!)\s*(?P<absent>[^\s!=,()]+)"
    r"|(?P<key>[^\s!=,()]+)\s*(?:(?P<op>==|=|!=)\s*(?P<value>[^\s!=,()]*)"
    r"|\s+(?P<set>in|notin)\s*\((?P<values>[^()]*)\))?)\s*$"
)


def parse_selector(text: str) -> Obj | None:
    """A label selector as `kubectl -l` writes it (`a=b`, `a!=b`, `a`, `!a`,
    `a in (x,y)`, `a notin (x,y)`, comma-separated, all must hold) as a metav1.LabelSelector
    for `selects`; None for "" (`kueue_namespace_selector` off: it selects nothing, unlike
    an empty LabelSelector). ValueError when it does not parse."""
    if not text.strip():
        return None
    terms = re.split(r",(?![^()]*\))", text)
    labels: dict[str, str] = {}
    exprs: list[Obj] = []
    for term in terms:
        m = _TERM.match(term)
        if m is None:
            raise ValueError(f"not a label selector term: {term.strip()!r}")
        if m["absent"]:
            exprs.append({"key": m["absent"], "operator": "DoesNotExist"})
        elif m["op"] in ("=", "=="):
            labels[m["key"]] = m["value"]
        elif m["op"] == "!=":
            exprs.append({"key": m["key"], "operator": "NotIn", "values": [m["value"]]})
        elif m["set"]:
            values = [v.strip() for v in m["values"].split(",") if v.strip()]
            operator = {"in": "In", "notin": "NotIn"}[m["set"]]
            exprs.append({"key": m["key"], "operator": operator, "values": values})
        else:
            exprs.append({"key": m["key"], "operator": "Exists"})
    return {"matchLabels": labels, "matchExpressions": exprs}


def never_preempts(pod: Obj) -> bool:
    return (pod.get("spec") or {}).get("preemptionPolicy") == "Never"


def start_time(pod: Obj) -> float:
    """status.startTime (else creationTimestamp) in seconds since the epoch; 0 unknown."""
    raw = (pod.get("status") or {}).get("startTime") or (pod.get("metadata") or {}).get(
        "creationTimestamp"
    )
    try:
        return datetime.fromisoformat(str(raw).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def holders(
    state: ClusterState,
    preemptor: PodView,
    budgets: Budgets,
    *,
    kueue_ok: bool,
    kueue: Collection[str] = (),
    avoid: Collection[str] = (),
    refused: Collection[str] = (),
) -> list[Holder]:
    """One holder per pod with live allocations in the model (assumed ones included).
    `kueue`: the namespaces Kueue manages (the admin's selector); `refused`: pods whose
    eviction the API server refused for this preemptor (a PDB)."""
    by_pod: dict[str, list[SliceAllocation]] = {}
    for alloc in state.allocations.values():
        by_pod.setdefault(alloc.pod_uid, []).append(alloc)
    out = []
    for uid, allocs in sorted(by_pod.items()):
        if uid == preemptor.uid:
            continue
        pod = state.pods.get(uid)
        node = allocs[0].node
        index = {g.uuid: g.index for g in state.gpus.get(node, ())}
        slices = tuple(
            (index[s.gpu_uuid], s.start, s.size)
            for a in allocs
            for s in a.slices
            if s.gpu_uuid in index
        )
        reserved = any(state.is_assumed(a.key) for a in allocs)
        # a terminating pod's slots are planned on only by a pod of higher priority: after a
        # failover the victims of a lost reservation terminate, and a pod of their priority
        # or lower must not take what was freed for the preemptor (CI saw it happen)
        doomed = (
            not reserved
            and (pod is None or pod.priority < preemptor.priority)
            and (pod is None or pod.terminal or pod.deleting or all(a.deleting for a in allocs))
        )
        if uid in avoid:
            doomed = False  # did not terminate (or refused) in time: a blocker now
        labels: Mapping[str, str] = {}
        priority, started = 0, 0.0
        preemptible = False
        frees = Frees()
        if pod is not None:
            labels = (pod.obj.get("metadata") or {}).get("labels") or {}
            priority, started = pod.priority, start_time(pod.obj)
            preemptible = (
                not doomed
                and not reserved
                and uid not in avoid
                and may_evict(pod, preemptor, kueue_ok=kueue_ok, kueue=kueue)
            )
            if not pod.terminal and (pod.node or node) == node:  # charged to that node
                frees = _frees(pod.resources)
        out.append(
            Holder(
                uid=uid,
                node=node,
                slices=slices,
                priority=priority,
                start_time=started,
                pdbs=budgets.selecting(pod.namespace, labels) if pod is not None else (),
                preemptible=preemptible,
                doomed=doomed,
                frees=frees,
                refused=uid in refused,
            )
        )
    return out


def may_evict(pod: PodView, preemptor: PodView, *, kueue_ok: bool, kueue: Collection[str]) -> bool:
    """The rules on the pod itself: strictly lower priority, not of a `system-*` class, not
    Kueue-managed (its namespace is one of `kueue`) unless `kueue_ok`."""
    class_name = str((pod.obj.get("spec") or {}).get("priorityClassName") or "")
    return (
        pod.priority < preemptor.priority
        and not class_name.startswith("system-")
        and (kueue_ok or pod.namespace not in kueue)
    )


def spare(
    state: ClusterState,
    preemptor: PodView,
    held: Collection[Holder],
    *,
    kueue_ok: bool,
    kueue: Collection[str] = (),
) -> dict[str, Frees]:
    """Per node of `held`, what the lower-priority pods bound there that hold no slices
    request: kube-scheduler's own preemption frees it once the preemptor is pinned (they
    may be evicted by the same rules as a holder)."""
    nodes = {h.node for h in held}
    uids = {h.uid for h in held}
    out: dict[str, Frees] = {}
    for pod in state.pods.values():
        if not pod.bound or pod.bound not in nodes or pod.terminal or pod.uid in uids:
            continue
        if may_evict(pod, preemptor, kueue_ok=kueue_ok, kueue=kueue):
            out[pod.bound] = out.get(pod.bound, Frees()) + _frees(pod.resources)
    return out


def _frees(r: Resources) -> Frees:
    return Frees(r.cpu_millis, r.memory_bytes, r.pods)


# --- back-off after a pinned-unschedulable delete --------------------------------------------

BACKOFF_S = 600.0  # AllocatorSettings.preemption_backoff_s's default


@dataclass
class OwnerBackoff:
    """Per controller (ownerReference uid), the nodes where its pod was deleted as pinned
    but unschedulable, each until when (monotonic): its pods plan no preemption on them
    meanwhile, so a pod that cannot run where it evicts does not evict there again each
    time it is recreated. Entries past their time are dropped as they are read."""

    backoff_s: float = BACKOFF_S
    until: dict[str, dict[str, float]] = field(default_factory=dict)

    def note(self, owner: str, node: str, now: float) -> None:
        self.until.setdefault(owner, {})[node] = now + self.backoff_s
        self._prune(now)

    def nodes(self, owner: str | None, now: float) -> frozenset[str]:
        """The nodes `owner`'s pods plan no preemption on now."""
        if owner is None or owner not in self.until:
            return frozenset()
        self._prune(now)
        return frozenset(self.until.get(owner, {}))

    def _prune(self, now: float) -> None:
        for owner in list(self.until):
            left = {n: t for n, t in self.until[owner].items() if t > now}
            if left:
                self.until[owner] = left
            else:
                del self.until[owner]


NO_RESET = ("off", "resetless")


def whole_candidates(
    state: ClusterState, snapshot: Snapshot, classes: Collection[str] = NO_RESET
) -> frozenset[GpuRef]:
    """The snapshot's healthy GPUs that serve a whole GPU once nothing is on them, by what
    that takes (views.whole_if_idle, one of `classes`): where whole-GPU preemption plans."""
    out = set()
    for node in snapshot.nodes:
        healthy = {g.index for g in node.gpus if g.healthy}
        for g in state.gpus.get(node.name, ()):
            if g.index in healthy and g.whole_if_idle in classes:
                out.add((node.name, g.index))
    return frozenset(out)
