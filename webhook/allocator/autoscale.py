"""Autoscaler signal, the pure part: which pending pods need a new node, and what to ask for.

A gated pod is invisible to cluster-autoscaler and Karpenter: both act only on pods the
kube-scheduler marked `Unschedulable`, and InstaSlice's gate keeps its pods away from the
scheduler until a slice exists (docs/autoscaling.md). So the allocator tells them itself:

- `classify` sorts a pod the placement engine left pending into *waits* (it would fit on an
  existing node once the slices being released are gone, or it is pending for a reason no
  node can cure: an invalid request, agents down; or it waits for a MIG mode change under
  way) and *needs a node* (no existing node can serve it now: capacity, whatever the engine's
  capacity reason — Full, Fragmented, NodeResources, NoProfile, GpuUnavailable,
  NoMatchingNode, NeedsMigModeChange). A pod asking whole GPUs is placed again by the
  whole-GPU engine (`place_whole`), MIG slices by the slice engine;
- `placeholder_pod` renders the Karpenter signal: an ungated pod asking for what the new node
  must offer (the pod's cpu/memory and `instaslice.io/mig-*` counts, or `instaslice.io/gpu`
  for whole GPUs, its node selector, affinity and tolerations) and kept off the nodes the
  allocator knows cannot serve it
  (`instaslice.io/node NotIn`, the label each node agent puts on its Node: Karpenter refuses
  `kubernetes.io/hostname`), owned by the real pod;
- `provisioning_request` renders the cluster-autoscaler signal: a PodTemplate of the same
  shape and a ProvisioningRequest (`autoscaling.x-k8s.io/v1`) naming it, kept off those
  nodes by `kubernetes.io/hostname NotIn`;
- `kept_off` lists those nodes, of them only the ones whose advertised room (allocatable
  minus what is bound there, views.Room) would let the kube-scheduler bind the signal
  there: the others it never binds to; `misplaced` tells a placeholder the kube-scheduler
  bound to a node that cannot serve its pod (one raised before the node filled, or before
  its agent labelled it, or where the allocator's view of the room lagged), which the
  shell replaces.

Each node's advertised `instaslice.io/mig-<profile>` is a fixed upper bound (contract §3),
so with mixed profiles a node whose GPUs are full of one profile still shows room for
another: without the `NotIn` the scheduler binds the placeholder there, Karpenter counts it
served and never adds a node, and the real pod waits for good. `instaslice.io/gpu` is one
too (every GPU that can be whole, whatever holds slices on it), so whole GPUs need it alike.

Size-based asks (`instaslice.io/mig-size.<container>`) come here resolved on the one GPU
model their pod's nodeSelector names (the placer's `_signal_request`), or not at all: which
profile they need depends on the model of the node they land on, and a placeholder can ask
for one set of resources only (docs/autoscaling.md "Preemption, sizes, whole GPUs").

No I/O and no clock: `webhook.allocator.scaleup` keeps the records, writes and withdraws.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

from common.allocation import SliceAllocation
from common.catalog import Catalog
from common.constants import (
    INSTASLICE_GPU,
    NODE_LABEL,
    SCALE_UP_LABEL,
    WHOLE_GPU_PROFILE,
    EventReason,
)
from common.objects import node_label_value, node_labelled
from common.placeholders import (
    MANAGED_BY,
    MANAGED_BY_LABEL,
    PLACEHOLDER_PRIORITY_CLASS,
    signal_name,
)
from common.placement import (
    NodeState,
    Pending,
    PendingReason,
    PodRequest,
    Policy,
    Snapshot,
    place,
)
from common.placement.modes import ModeView, place_with_modes
from common.placement.selectors import mismatch
from common.placement.whole import WholeView, is_whole, place_whole
from common.profiles import instaslice_resource
from webhook.allocator.pods import Resources
from webhook.allocator.views import Room

Obj = dict[str, Any]

PLACEHOLDER_IMAGE: Final = "registry.k8s.io/pause:3.10"
PROVREQ_API_VERSION: Final = "autoscaling.x-k8s.io/v1"
DEFAULT_PROVREQ_CLASS: Final = "best-effort-atomic-scale-up.autoscaling.x-k8s.io"
HOSTNAME_LABEL: Final = "kubernetes.io/hostname"
REASON_REQUESTED: Final = EventReason.SCALE_UP_REQUESTED  # Normal: a signal raised for it
REASON_FAILED: Final = EventReason.SCALE_UP_FAILED  # Warning: the autoscaler said it cannot
REASON_PROVISIONED: Final = (
    EventReason.SCALE_UP_PROVISIONED
)  # Normal: ProvisioningRequest Provisioned

# The engine's reasons a new node can cure. NoMatchingNode qualifies: with no node of a
# group yet (count 0), nothing matches the pod's selector until the autoscaler makes one.
# NeedsMigModeChange qualifies: it fits today only on a GPU needing a reset InstaSlice never
# does, so a new node (its GPUs in MIG mode, or switchable) is what serves it.
# MigModeChangeUnderWay does not: the change under way serves it, soon.
CAPACITY_REASONS: Final = frozenset(
    {
        PendingReason.FULL,
        PendingReason.FRAGMENTED,
        PendingReason.NODE_RESOURCES,
        PendingReason.NO_PROFILE,
        PendingReason.GPU_UNAVAILABLE,
        PendingReason.NO_MATCHING_NODE,
        PendingReason.NEEDS_MIG_MODE_CHANGE,
    }
)


class SignalMode(StrEnum):
    OFF = "off"
    PLACEHOLDER = "placeholder"  # Karpenter (and cluster-autoscaler without ProvisioningRequest)
    PROVISIONING_REQUEST = "provisioning-request"  # cluster-autoscaler


@dataclass(frozen=True)
class ScaleUpSettings:
    """mode: which signal (off: none). delay_s: how long a pod must need a node before the
    signal is raised. interval_s: how often signals are reconciled. provisioning_class: the
    ProvisioningRequest class. image: the placeholder's (never run on a real node: it is
    deleted when the real pod is placed, and asks for no device)."""

    mode: SignalMode = SignalMode.OFF
    delay_s: float = 30.0
    interval_s: float = 1.0
    provisioning_class: str = DEFAULT_PROVREQ_CLASS
    image: str = PLACEHOLDER_IMAGE


@dataclass(frozen=True, slots=True)
class Verdict:
    needs_node: bool
    why: str


def releasing(
    allocations: Iterable[SliceAllocation], live_pod: Mapping[str, bool]
) -> dict[str, set[tuple[int, int, int]]]:
    """node → {(gpu index, start, size)} of the slices whose release is under way: the
    allocation is being deleted, or its pod finished or is gone (`live_pod[uid]` False/absent)."""
    out: dict[str, set[tuple[int, int, int]]] = {}
    for a in allocations:
        if a.deleting or not live_pod.get(a.pod_uid, False):
            for s in a.slices:
                if s.gpu_index is not None:
                    out.setdefault(a.node, set()).add((s.gpu_index, s.start, s.size))
    return out


def after_releases(
    snapshot: Snapshot, freed: Mapping[str, Collection[tuple[int, int, int]]]
) -> Snapshot:
    """`snapshot` with the slots of `freed` (see `releasing`) shown free."""
    if not freed:
        return snapshot
    nodes = []
    for n in snapshot.nodes:
        gone = freed.get(n.name)
        if gone:
            gpus = tuple(
                dataclasses.replace(
                    g,
                    occupied=tuple(o for o in g.occupied if (g.index, o.start, o.size) not in gone),
                )
                for g in n.gpus
            )
            n = dataclasses.replace(n, gpus=gpus)
        nodes.append(n)
    return Snapshot(nodes=tuple(nodes))


Wholes = WholeView | Callable[[Snapshot], WholeView]


def classify(
    request: PodRequest,
    result: Pending,
    freed_snapshot: Snapshot,
    policy: Policy,
    catalog: Catalog,
    wholes: Wholes,
) -> Verdict:
    """Does this pending pod need a new node? `freed_snapshot`: the snapshot it was refused
    on, with the slices being released shown free (`after_releases`); `wholes`: which of its
    GPUs could be whole GPUs (the allocator's `whole_view`), read for a whole-GPU pod only."""
    if result.reason not in CAPACITY_REASONS:
        return Verdict(False, f"pending for {result.reason.value}, which a new node does not cure")
    if is_whole(request):
        view = wholes(freed_snapshot) if callable(wholes) else wholes
        again = place_whole(freed_snapshot, request, view, catalog).result
    else:
        again = place(freed_snapshot, request, policy, catalog)
    if not isinstance(again, Pending):
        return Verdict(False, "fits on an existing node once the slices being released are gone")
    if again.reason is PendingReason.MIG_MODE_CHANGE_UNDER_WAY or (
        is_whole(request) and _under_way_somewhere(freed_snapshot, request, wholes, catalog)
    ):
        why = "fits once the slices being released are gone and a MIG mode change is done"
        return Verdict(False, why)
    return Verdict(True, f"no existing node can serve it now ({result.reason.value})")


def _under_way_somewhere(
    snapshot: Snapshot, request: PodRequest, wholes: Wholes, catalog: Catalog
) -> bool:
    """A node where a MIG mode change under way serves the whole-GPU pod. The fleet's one
    Pending reason may name another (a node that needs a reset ranks before it), so each node
    is asked alone, as the placer would serve it there: the pod then waits for that change
    and needs no new node (hypothesis found two empty nodes, one needing a reset, the other's
    change under way, classified as needing a node)."""
    for node in snapshot.nodes:
        one = Snapshot((node,))
        view = wholes(one) if callable(wholes) else wholes
        got = place_whole(one, request, view, catalog).result
        if isinstance(got, Pending) and got.reason is PendingReason.MIG_MODE_CHANGE_UNDER_WAY:
            return True
    return False


def placeholder_value(node: NodeState) -> str:
    """What a placeholder's `NotIn` names a node by: its `instaslice.io/node` label value."""
    return node_label_value(node.name)


def hostname_value(node: NodeState) -> str:
    """What a ProvisioningRequest's `NotIn` names a node by: its hostname label (Karpenter's
    nodes are named apart from it)."""
    return node.labels.get(HOSTNAME_LABEL, node.name)


def _unknown(node: str) -> Room | None:
    return None


def kept_off(
    nodes: Iterable[NodeState],
    request: PodRequest,
    room: Callable[[str], Room | None] = _unknown,
    value: Callable[[NodeState], str] = placeholder_value,
) -> list[str]:
    """The values (`value`: the placeholder's `instaslice.io/node`, or the hostname) of the
    nodes a signal for `request` is kept off, sorted: every node the allocator knows (a
    MigNode with GPUs) that the pod's selection admits (its own selector, affinity and
    tolerations, copied to the signal, keep it off the others) and whose advertised room
    (`room`, views.Room; None: unknown) holds the signal's requests. Called for a pod no
    node can serve (`classify`), so none of them can; but the kube-scheduler binds only
    where the advertised room holds the requests, so a node where it does not needs no
    listing: of a fleet of other models, profiles or full nodes, only the few that look
    free and are not stay in the list."""
    asks, extended = signal_asks(request)
    return sorted(
        value(n)
        for n in nodes
        if n.gpus
        and mismatch(n, request) is None
        and ((r := room(n.name)) is None or r.holds(asks, extended))
    )


def selection(request: PodRequest) -> Hashable:
    """What `kept_off` reads of a pod: its node selector, required affinity and
    tolerations, and its requests (pods equal here are kept off the same nodes)."""
    return (
        tuple(sorted(request.node_selector.items())),
        request.required_affinity,
        request.tolerations,
        _requests(request),
    )


def misplaced(
    node: NodeState | None,
    request: PodRequest,
    freed: Collection[tuple[int, int, int]],
    policy: Policy,
    catalog: Catalog,
    modes: ModeView | Callable[[Snapshot], ModeView],
    wholes: Wholes,
) -> bool:
    """Does a placeholder for `request`, bound to `node` (its current state, None when the
    allocator knows no such node or its agent is down), stand where its pod cannot go? Yes
    when the node has GPUs, the pod fits there neither now nor once the slices `freed`
    (`releasing`, this node's) are gone, by the placer's own rule (`modes`: GPUs with MIG
    off that the agent turns on for it count, as on the new node Karpenter made for it;
    whole GPUs by the whole-GPU engine on `wholes`, where GPUs in MIG mode that the agent
    turns off without a reset count; a mode change under way counts as room), and the node
    carries `instaslice.io/node=<name>`:
    a replacement's `NotIn` then keeps it off, so replacing it cannot flap. A node still
    coming up (no GPUs known) or not labelled (its agent older, or Karpenter's random value
    not yet written back) is left alone."""
    if node is None or not node.gpus or not node_labelled(node.labels, node.name):
        return False
    alone = after_releases(Snapshot((node,)), {node.name: freed} if freed else {})
    if is_whole(request):
        view = wholes(alone) if callable(wholes) else wholes
        result = place_whole(alone, request, view, catalog).result
    else:
        result = place_with_modes(alone, request, modes, policy, catalog).result
    return (
        isinstance(result, Pending) and result.reason is not PendingReason.MIG_MODE_CHANGE_UNDER_WAY
    )


def placeholder_identity(obj: Obj) -> Obj:
    """What the allocator keeps of a placeholder pod: who it is (name, namespace, uid,
    resourceVersion, labels, owners: what `common.placeholders.stands_for` reads) and where
    it is bound. Its body carries the `NotIn` list of every node that cannot serve its pod
    (up to ~150 KB at 5000 nodes), which nothing reads back: held for every pending pod it
    would be most of the allocator's memory in a burst."""
    meta = obj.get("metadata") or {}
    keep = ("name", "namespace", "uid", "resourceVersion", "labels", "ownerReferences")
    node = (obj.get("spec") or {}).get("nodeName")
    return {
        "kind": "Pod",
        "metadata": {k: meta[k] for k in keep if k in meta},
        "spec": {"nodeName": node} if node else {},
    }


def _owner(pod: Obj) -> Obj:
    meta = pod["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": meta["name"],
        "uid": meta["uid"],
        "blockOwnerDeletion": False,
    }


def signal_asks(request: PodRequest) -> tuple[Resources, dict[str, int]]:
    """What a signal for `request` asks of a node: (cpu, memory, one pod slot) and the sum
    of its `instaslice.io/mig-<profile>` (whole GPUs: `instaslice.io/gpu`) counts."""
    out: dict[str, int] = {}
    for s in request.slices:
        res = INSTASLICE_GPU if s.profile == WHOLE_GPU_PROFILE else instaslice_resource(s.profile)
        out[res] = out.get(res, 0) + s.count
    return Resources(request.cpu_millis, request.memory_bytes, 1), dict(sorted(out.items()))


def _requests(request: PodRequest) -> tuple[tuple[str, str], ...]:
    asks = {k: str(v) for k, v in signal_asks(request)[1].items()}
    if request.cpu_millis:
        asks["cpu"] = f"{request.cpu_millis}m"
    if request.memory_bytes:
        asks["memory"] = str(request.memory_bytes)
    return tuple(asks.items())


def _affinity(pod: Obj, avoid: Sequence[str], key: str) -> Obj | None:
    """The pod's required node affinity, each term also keeping off the nodes whose label
    `key` is in `avoid`. InstaSlice's own pin (matchFields metadata.name) is never there:
    the pod is gated."""
    spec = pod.get("spec") or {}
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    terms = [dict(t) for t in required.get("nodeSelectorTerms") or []] or [{}]
    if avoid:
        keep_off = {"key": key, "operator": "NotIn", "values": sorted(avoid)}
        for t in terms:
            t["matchExpressions"] = [*(t.get("matchExpressions") or []), keep_off]
    terms = [t for t in terms if t]
    if not terms:
        return None
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}
        }
    }


def _pod_spec(pod: Obj, request: PodRequest, avoid: Sequence[str], key: str, image: str) -> Obj:
    spec = pod.get("spec") or {}
    asks = dict(_requests(request))
    out: Obj = {
        "containers": [
            {
                "name": "placeholder",
                "image": image,
                "resources": {
                    "requests": asks,
                    "limits": {k: v for k, v in asks.items() if k.startswith("instaslice.io/")},
                },
            }
        ],
        "priorityClassName": PLACEHOLDER_PRIORITY_CLASS,
        "terminationGracePeriodSeconds": 0,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
    }
    if spec.get("nodeSelector"):
        out["nodeSelector"] = dict(spec["nodeSelector"])
    if spec.get("tolerations"):
        out["tolerations"] = list(spec["tolerations"])
    affinity = _affinity(pod, avoid, key)
    if affinity is not None:
        out["affinity"] = affinity
    return out


def _meta(pod: Obj, kind: str) -> Obj:
    meta = pod["metadata"]
    return {
        "name": signal_name(meta["uid"]),
        "namespace": meta["namespace"],
        "labels": {SCALE_UP_LABEL: meta["uid"], MANAGED_BY_LABEL: MANAGED_BY},
        "annotations": {"instaslice.io/scale-up-pod": meta["name"], "instaslice.io/kind": kind},
        "ownerReferences": [_owner(pod)],
    }


def placeholder_pod(
    pod: Obj, request: PodRequest, avoid: Sequence[str], image: str = PLACEHOLDER_IMAGE
) -> Obj:
    """The Karpenter signal for gated `pod`, kept off the nodes whose `instaslice.io/node`
    is in `avoid` (`kept_off`): see the module docstring. Karpenter (v1.15.0) accepts a
    `NotIn` on a label no NodePool defines and makes a node for it (a new node does not
    carry these values; Karpenter gives it a random one, which its agent writes over)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": _meta(pod, "placeholder"),
        "spec": _pod_spec(pod, request, avoid, NODE_LABEL, image),
    }


def provisioning_request(
    pod: Obj,
    request: PodRequest,
    avoid: Sequence[str],
    provisioning_class: str = DEFAULT_PROVREQ_CLASS,
    image: str = PLACEHOLDER_IMAGE,
) -> tuple[Obj, Obj]:
    """(PodTemplate, ProvisioningRequest) asking cluster-autoscaler for one new node's worth
    of what `pod` needs; both owned by the pod, both named `signal_name(uid)`."""
    name = signal_name(pod["metadata"]["uid"])
    template = {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": _meta(pod, "provisioning-request"),
        "template": {
            "metadata": {"labels": {SCALE_UP_LABEL: pod["metadata"]["uid"]}},
            "spec": _pod_spec(pod, request, avoid, HOSTNAME_LABEL, image),
        },
    }
    provreq = {
        "apiVersion": PROVREQ_API_VERSION,
        "kind": "ProvisioningRequest",
        "metadata": _meta(pod, "provisioning-request"),
        "spec": {
            "provisioningClassName": provisioning_class,
            "podSets": [{"podTemplateRef": {"name": name}, "count": 1}],
        },
    }
    return template, provreq


def condition(obj: Obj, type_: str) -> Obj | None:
    """The status condition of `type_` that is True, if any (ProvisioningRequest)."""
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_ and c.get("status") == "True":
            return dict(c)
    return None
