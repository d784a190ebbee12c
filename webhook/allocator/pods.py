"""Pure readers and builders for Pod JSON, as the allocator sees pods.

Readers answer the allocator's questions about one pod: is our gate its only gate, where is
it bound or pinned, what does it request (the kube-scheduler's arithmetic: the larger of
the app containers plus sidecars and the peak of the init sequence, plus overhead), what
does it ask the placement engine for. `pin` builds the one update that ties a pod to its
node and lifts the gate.

Pinning uses required node affinity on `metadata.name` (a `matchFields` requirement added to
every existing term, or one new term), which the API server accepts on a gated pod
("mutable scheduling directives"). The placement engine does not model `matchFields`, so a
pod that already has some is given them as requirements on a synthetic node label,
`FIELD_NAME_LABEL`, which `with_name_label` adds to snapshot nodes.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from common.constants import (
    ASKS_ANNOTATION,
    CLAIM_ANNOTATION,
    GATE_NAME,
    GROUP,
    INSTASLICE_GPU,
    SCALE_UP_LABEL,
    WHOLE_GPU_PROFILE,
)
from common.placeholders import MANAGED_BY_LABEL, is_placeholder
from common.placement.model import (
    NodeSelectorRequirement,
    PodRequest,
    SliceRequest,
    Toleration,
)
from common.podspec import SliceRequestError, iter_containers, slice_requests
from common.quantity import parse_bytes, parse_cpu_millis

Obj = dict[str, Any]

NAME_FIELD = "metadata.name"
# ':' cannot occur in a label key, so this never collides with a real label.
FIELD_NAME_LABEL = "field.instaslice.io:metadata.name"
TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
PLACEHOLDER_LABELS = (SCALE_UP_LABEL, MANAGED_BY_LABEL)  # of those common.placeholders reads
EXTENDED_PREFIX = f"{GROUP}/"  # InstaSlice's extended resources: instaslice.io/mig-*, .../gpu


@dataclass(frozen=True, slots=True)
class Resources:
    cpu_millis: int = 0
    memory_bytes: int = 0
    pods: int = 0

    def __add__(self, other: Resources) -> Resources:
        return Resources(
            self.cpu_millis + other.cpu_millis,
            self.memory_bytes + other.memory_bytes,
            self.pods + other.pods,
        )

    def __sub__(self, other: Resources) -> Resources:
        return Resources(
            self.cpu_millis - other.cpu_millis,
            self.memory_bytes - other.memory_bytes,
            self.pods - other.pods,
        )

    def peak(self, other: Resources) -> Resources:
        return Resources(
            max(self.cpu_millis, other.cpu_millis),
            max(self.memory_bytes, other.memory_bytes),
            max(self.pods, other.pods),
        )


# --- readers ------------------------------------------------------------------------------


def uid(pod: Obj) -> str:
    return str(pod.get("metadata", {}).get("uid", ""))


def key(pod: Obj) -> str:
    meta = pod.get("metadata", {})
    return f"{meta.get('namespace')}/{meta.get('name')}"


def claim(pod: Obj) -> str | None:
    value = (pod.get("metadata", {}).get("annotations") or {}).get(CLAIM_ANNOTATION)
    return value if isinstance(value, str) and value else None


def gates(pod: Obj) -> tuple[str, ...]:
    return tuple(str(g.get("name", "")) for g in pod.get("spec", {}).get("schedulingGates") or [])


def has_our_gate(pod: Obj) -> bool:
    return GATE_NAME in gates(pod)


def only_our_gate(pod: Obj) -> bool:
    """Our gate is the pod's only remaining scheduling gate (others, e.g. Kueue's, go first)."""
    return gates(pod) == (GATE_NAME,)


def priority(pod: Obj) -> int:
    value = pod.get("spec", {}).get("priority")
    return int(value) if isinstance(value, int) else 0


def created(pod: Obj) -> str:
    """creationTimestamp (RFC 3339, UTC: sorts as a string)."""
    return str(pod.get("metadata", {}).get("creationTimestamp") or "")


def is_terminal(pod: Obj) -> bool:
    return pod.get("status", {}).get("phase") in TERMINAL_PHASES


def is_deleting(pod: Obj) -> bool:
    return bool(pod.get("metadata", {}).get("deletionTimestamp"))


def bound_node(pod: Obj) -> str:
    return str(pod.get("spec", {}).get("nodeName") or "")


def required_terms(pod: Obj) -> list[Obj]:
    affinity = pod.get("spec", {}).get("affinity") or {}
    required = (affinity.get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    terms = required.get("nodeSelectorTerms") or []
    return [t for t in terms if isinstance(t, dict)]


def _term_pin(term: Obj) -> str | None:
    for req in term.get("matchFields") or []:
        values = req.get("values") or []
        if req.get("key") == NAME_FIELD and req.get("operator") == "In" and len(values) == 1:
            return str(values[0])
    return None


def pinned_node(pod: Obj) -> str | None:
    """The node a pod's required affinity allows exclusively (by `metadata.name`), if any.

    True of our pin and of anyone else's (DaemonSet pods are pinned the same way).
    """
    terms = required_terms(pod)
    nodes = {_term_pin(t) for t in terms}
    if len(nodes) == 1:
        return nodes.pop()
    return None


def is_unschedulable(pod: Obj) -> bool:
    """The scheduler tried and found no node (PodScheduled=False, reason Unschedulable)."""
    for cond in pod.get("status", {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled":
            return bool(cond.get("status") == "False" and cond.get("reason") == "Unschedulable")
    return False


def asks_whole_gpu(pod: Obj) -> bool:
    """Some container or initContainer of the pod asks for `instaslice.io/gpu` (whole GPUs),
    in its limits, where `slice_requests` reads asks (an extended resource's request is its
    limit), or in its `instaslice.io/asks` annotation (DRA mode)."""
    if ASKS_ANNOTATION in (pod.get("metadata", {}).get("annotations") or {}):
        try:
            return any(a.profile == WHOLE_GPU_PROFILE for a in slice_requests(pod))
        except SliceRequestError:
            return False
    for _, _, c in iter_containers(pod):
        limits = ((c.get("resources") or {}).get("limits") or {}) if isinstance(c, dict) else {}
        if isinstance(limits, dict) and INSTASLICE_GPU in limits:
            return True
    return False


def stuck_pinned(pod: Obj, uid_: str) -> bool:
    """`pod` is still the pod `uid_`, ungated by us, not bound, and the scheduler says it
    cannot place it: what the pinned-unschedulable timeout acts on."""
    return (
        uid(pod) == uid_
        and not has_our_gate(pod)
        and not bound_node(pod)
        and not is_deleting(pod)
        and is_unschedulable(pod)
    )


def ungated_on(pod: Obj, uid_: str, claim_: str) -> bool:
    """`pod` is still the pod `uid_`, carries the claim `claim_`, and has been ungated (so
    pinned or bound to that claim's node), and is neither finished nor being deleted: a pod
    that may run on the claim's slices, or start on them once scheduled."""
    return (
        uid(pod) == uid_
        and claim(pod) == claim_
        and not has_our_gate(pod)
        and not is_terminal(pod)
        and not is_deleting(pod)
    )


def controller_ref(pod: Obj) -> Obj | None:
    for ref in pod.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return dict(ref)
    return None


def _quantity(resources: Mapping[str, Any], name: str, parse: Any) -> int:
    for section in ("requests", "limits"):  # the API server defaults requests to limits
        values = resources.get(section) or {}
        if name in values:
            try:
                return int(parse(values[name]))
            except ValueError:
                return 0
    return 0


def _container_resources(container: Obj) -> Resources:
    res = container.get("resources") or {}
    return Resources(
        _quantity(res, "cpu", parse_cpu_millis), _quantity(res, "memory", parse_bytes), 0
    )


def pod_resources(pod: Obj) -> Resources:
    """What the pod takes from its node: kube-scheduler's `PodRequests`, plus one pod slot.

    max(app containers + sidecars, peak of each init container plus the sidecars started
    before it) + `spec.overhead`.
    """
    spec = pod.get("spec", {})
    total = Resources()
    for c in spec.get("containers") or []:
        total = total + _container_resources(c)
    sidecars = Resources()
    init_peak = Resources()
    for c in spec.get("initContainers") or []:
        own = _container_resources(c)
        if c.get("restartPolicy") == "Always":
            total = total + own
            sidecars = sidecars + own
            init_peak = init_peak.peak(sidecars)
        else:
            init_peak = init_peak.peak(own + sidecars)
    total = total.peak(init_peak)
    overhead = spec.get("overhead") or {}
    total = total + Resources(
        _quantity({"requests": overhead}, "cpu", parse_cpu_millis),
        _quantity({"requests": overhead}, "memory", parse_bytes),
        0,
    )
    return total + Resources(pods=1)


def extended_requests(pod: Obj) -> tuple[tuple[str, int], ...]:
    """The pod's `instaslice.io/*` requests (name, count), sorted, as the kube-scheduler
    counts them at least: summed over the app containers and the sidecars (restartable
    init containers). Its own figure is that or a larger init container's, never less —
    what `ClusterState.room` may subtract from a node's allocatable and stay on the safe
    side."""
    spec = pod.get("spec", {})
    total: dict[str, int] = {}
    containers = [
        *(spec.get("containers") or []),
        *(c for c in spec.get("initContainers") or [] if c.get("restartPolicy") == "Always"),
    ]
    for c in containers:
        requests = (c.get("resources") or {}).get("requests") or {}
        limits = (c.get("resources") or {}).get("limits") or {}
        for name in {*requests, *limits}:
            if str(name).startswith(EXTENDED_PREFIX):
                count = _quantity(c.get("resources") or {}, name, parse_bytes)
                if count > 0:
                    total[name] = total.get(name, 0) + count
    return tuple(sorted(total.items()))


def same_requests(a: Obj, b: Obj) -> bool:
    """Whether two versions of a pod request the same resources (`pod_resources` and
    `extended_requests` of one serve for the other)."""
    sa, sb = a.get("spec", {}), b.get("spec", {})

    def parts(spec: Obj) -> list[Any]:
        return [
            spec.get("overhead"),
            [c.get("resources") for c in spec.get("containers") or []],
            [
                (c.get("resources"), c.get("restartPolicy"))
                for c in spec.get("initContainers") or []
            ],
        ]

    return parts(sa) == parts(sb)


def _requirements(items: list[Any], *, fields: bool) -> list[NodeSelectorRequirement]:
    out = []
    for r in items or []:
        key_ = str(r.get("key", ""))
        if fields:
            if key_ != NAME_FIELD:
                # The only field the API server allows; anything else matches nothing.
                out.append(NodeSelectorRequirement(FIELD_NAME_LABEL, "In", ()))
                continue
            key_ = FIELD_NAME_LABEL
        out.append(
            NodeSelectorRequirement(
                key_, str(r.get("operator", "")), tuple(str(v) for v in r.get("values") or ())
            )
        )
    return out


def uses_name_field(pod: Obj) -> bool:
    return any(t.get("matchFields") for t in required_terms(pod))


def pod_request(pod: Obj, resources: Resources | None = None) -> PodRequest:
    """The placement engine's view of a gated pod (`resources`: its `pod_resources`, when
    already known). Raises SliceRequestError (podspec)."""
    spec = pod.get("spec", {})
    res = resources if resources is not None else pod_resources(pod)
    asks = slice_requests(pod)
    terms = tuple(
        tuple(
            _requirements(t.get("matchExpressions") or [], fields=False)
            + _requirements(t.get("matchFields") or [], fields=True)
        )
        for t in required_terms(pod)
    )
    tolerations = tuple(
        Toleration(
            key=str(t.get("key") or ""),
            operator=str(t.get("operator") or "Equal"),
            value=str(t.get("value") or ""),
            effect=str(t.get("effect") or ""),
        )
        for t in spec.get("tolerations") or []
    )
    return PodRequest(
        name=key(pod),
        cpu_millis=res.cpu_millis,
        memory_bytes=res.memory_bytes,
        slices=tuple(SliceRequest(a.container, a.profile, a.count) for a in asks),
        node_selector={str(k): str(v) for k, v in (spec.get("nodeSelector") or {}).items()},
        required_affinity=terms,
        tolerations=tolerations,
    )


# --- what the cache keeps -------------------------------------------------------------------

_META_KEPT = (
    *("name", "namespace", "uid", "resourceVersion", "generation"),
    *("creationTimestamp", "deletionTimestamp"),
)
_SPEC_KEPT = ("nodeName", "priority", "schedulingGates", "overhead")


def slim(pod: Obj) -> Obj:
    """What the allocator keeps of a pod it will never act on — one without our claim or
    our gate, i.e. every other pod of the cluster, cached only to charge its cpu / memory
    to a node: the fields the readers above look at (identity, phase, deletion, binding,
    pin, PodScheduled, requests), nothing else (a real pod is 10-15 KB of JSON, this a few
    hundred bytes). Our own pods are kept whole: they are PUT back (`pin`) and described
    in events. Idempotent, and every reader answers the same on the slim pod as on the pod.
    """
    meta = pod.get("metadata") or {}
    if claim(pod) is not None or has_our_gate(pod):
        return pod
    spec = pod.get("spec") or {}
    out_spec: Obj = {k: spec[k] for k in _SPEC_KEPT if k in spec}
    out_spec["containers"] = [
        {"name": c.get("name"), "resources": c.get("resources") or {}}
        for c in spec.get("containers") or []
    ]
    if spec.get("initContainers"):
        out_spec["initContainers"] = [
            {k: c[k] for k in ("name", "resources", "restartPolicy") if k in c}
            for c in spec["initContainers"]
        ]
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    if required:
        out_spec["affinity"] = {
            "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}
        }
    status = pod.get("status") or {}
    out_status: Obj = {"phase": status["phase"]} if "phase" in status else {}
    scheduled = [c for c in status.get("conditions") or [] if c.get("type") == "PodScheduled"]
    if scheduled:
        out_status["conditions"] = scheduled
    out: Obj = {k: pod[k] for k in ("apiVersion", "kind") if k in pod}
    out["metadata"] = {k: meta[k] for k in _META_KEPT if k in meta}
    if is_placeholder(pod):  # what a placeholder is known by (its cpu is charged to no node)
        out["metadata"]["labels"] = {k: meta["labels"][k] for k in PLACEHOLDER_LABELS}
        out["metadata"]["ownerReferences"] = meta["ownerReferences"]
        out_spec["priorityClassName"] = spec["priorityClassName"]
    out["spec"] = out_spec
    out["status"] = out_status
    return out


# --- the pin ------------------------------------------------------------------------------


def pin(pod: Obj, node: str) -> Obj:
    """A copy of `pod` pinned to `node` with our gate removed (one PUT does both).

    The pin requirement is added to every existing required term (additions are all a gated
    pod allows), or becomes the only term when there is none.
    """
    out = copy.deepcopy(pod)
    spec = out.setdefault("spec", {})
    requirement = {"key": NAME_FIELD, "operator": "In", "values": [node]}
    affinity = spec.get("affinity") or {}
    node_affinity = affinity.get("nodeAffinity") or {}
    required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    terms = [t for t in required.get("nodeSelectorTerms") or [] if isinstance(t, dict)]
    if terms:
        for term in terms:
            existing = term.get("matchFields") or []
            if requirement not in existing:
                term["matchFields"] = [*existing, dict(requirement)]
    else:
        terms = [{"matchFields": [requirement]}]
    required["nodeSelectorTerms"] = terms
    node_affinity["requiredDuringSchedulingIgnoredDuringExecution"] = required
    affinity["nodeAffinity"] = node_affinity
    spec["affinity"] = affinity
    return _drop_gate(out)


def ungate(pod: Obj) -> Obj:
    """A copy of `pod` with our gate removed and nothing else changed: DRA mode, where the
    claim's node selector binds the pod (docs/dra.md)."""
    return _drop_gate(copy.deepcopy(pod))


def _drop_gate(pod: Obj) -> Obj:
    spec = pod.setdefault("spec", {})
    remaining = [g for g in spec.get("schedulingGates") or [] if g.get("name") != GATE_NAME]
    if remaining:
        spec["schedulingGates"] = remaining
    else:
        spec.pop("schedulingGates", None)
    return pod
