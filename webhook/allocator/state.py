"""The allocator's in-memory cluster model: pure data, fed by watch events, read as snapshots.

`ClusterState` keeps what the four informers deliver — Pods, Nodes, MigNodes and
SliceAllocations (in DRA mode ResourceClaims, read as SliceAllocations, and the devices
users' own claims hold: `put_foreign`) — reduced to what placement needs, and answers
`snapshot()` with the placement engine's `Snapshot`. It is the facade of three parts: the
tables and their updates (here), the accounting of what pods take of each node
(accounting.py: charges, bound usage, `room`), and the snapshots and fleet indexes placement
reads (snapshots.py: occupied slots, node states, `place`, `decide_calm`, the mode and
whole-GPU views).

"Assumed" allocations (docs/allocator.md "What one pod goes through", step 3) are recorded
before the create is sent, so the next decision already sees them, and are forgotten if the
create fails; the watched object replaces the assumed one when it arrives.

A node whose agent is down (its Lease went unrenewed; the controller decides, this only
records it) is left out of `snapshot()`: a pod placed there would wait for an agent that may
never come. Its allocations and GPUs still count, and `node_states()` still shows it.

`epoch` grows whenever capacity may have grown (a slice released, a pod gone from a node, a
node or GPU added or changed, an agent back): pods parked as pending are retried on that,
not on a timer. `holders_version` grows whenever what a preemption plan reads may have
changed (an allocation added, changed or gone, a pod holding one changed in what
`views.holder_facet` shows, a node, GPU or agent changed): a plan that found nothing is made
again only then (webhook/allocator/planning.py), not on every epoch.

It does no I/O and keeps no clock. With `avoid_creates_in_flight` on, it also counts the
slices in flight per GPU (inflight.py).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Collection
from typing import Any

from common.allocation import SliceAllocation
from common.catalog import Catalog, load_catalog
from common.catalog.learned import Geometries
from common.placement import (
    NodeState,
    Snapshot,
)
from common.placement.index import FleetIndex
from webhook.allocator import pods as podlib
from webhook.allocator.accounting import Accounting, Charge
from webhook.allocator.inflight import InFlight
from webhook.allocator.pods import Resources
from webhook.allocator.snapshots import Snapshots
from webhook.allocator.views import GpuView, NodeView, PodView, Room, gpus_of, holder_facet

Obj = dict[str, Any]


class ClusterState(Accounting, Snapshots):
    def __init__(self, catalog: Catalog | None = None, *, avoid_creates_in_flight: int = 0) -> None:
        # What each GPU is planned with: its catalog entry, or the table its node published.
        self.geometries = Geometries(catalog if catalog is not None else load_catalog())
        self.pods: dict[str, PodView] = {}  # by uid
        self._pod_by_claim: dict[str, str] = {}  # namespace/claim -> uid
        self.allocations: dict[str, SliceAllocation] = {}  # by namespace/name
        self._assumed: set[str] = set()  # keys of allocations decided but not yet created
        self._allocs_by_pod: dict[str, set[str]] = {}
        self._allocs_by_node: dict[str, set[str]] = {}
        self.nodes: dict[str, NodeView] = {}
        self.gpus: dict[str, tuple[GpuView, ...]] = {}  # MigNode status, by node
        # (node, claim) of every live allocation: a MigNode instance is covered by an
        # allocation only on its own node (claim names alone may repeat across namespaces)
        self._live_claims: Counter[tuple[str, str]] = Counter()
        self._charges: dict[str, Charge] = {}
        self._usage: dict[str, Resources] = {}
        # what the pods bound there (spec.nodeName) request, per node: `room`
        self._bound_usage: dict[str, Resources] = {}
        self._bound_extended: dict[str, dict[str, int]] = {}
        self._rooms: dict[str, Room] = {}  # `room`, by node: dropped when either changes
        self._node_cache: dict[str, NodeState] = {}
        self._nodes_sorted: tuple[NodeState, ...] | None = ()  # None: to sort again
        self._sorted_at: dict[str, int] = {}  # node name → its place in `_nodes_sorted`
        self._dirty: set[str] = set()
        self._index = FleetIndex()  # the placeable node states, keyed by name
        self._plain: Snapshot | None = None  # snapshot() while nothing changed: the index's
        self.agents_down: set[str] = set()  # nodes whose agent's Lease went unrenewed
        self.epoch = 0
        self.holders_version = 0
        # For metrics: slices of watched allocations by (profile, node, gpu uuid).
        self.slice_counts: Counter[tuple[str, str, str]] = Counter()
        # Slices in flight per GPU; with a limit, the nodes with busy GPUs left out (by name)
        self.in_flight = InFlight(avoid_creates_in_flight)
        self._calm_index = FleetIndex() if avoid_creates_in_flight else None
        self._calm_nodes: dict[str, NodeState] = {}
        self._calm_plain: Snapshot | None = None
        # DRA mode: the devices of our driver that claims not made by the allocator hold
        # (users' own, allocated by kube-scheduler), by claim key: (node, device names)
        self.foreign: dict[str, tuple[str, tuple[str, ...]]] = {}
        self._foreign_by_node: dict[str, set[str]] = {}

    # --- pods ---------------------------------------------------------------------------

    def upsert_pod(self, obj: Obj) -> PodView:
        old = self.pods.get(podlib.uid(obj))
        # Most pod updates are status changes: keep the parsed requests when they cannot
        # have changed (quantity parsing is the costly part of reading a pod).
        same = old is not None and podlib.same_requests(old.obj, obj)
        view = PodView.of(obj, like=old if old is not None and same else None)
        if old is not None:
            self._unindex_pod(old)
        if view.uid in self._allocs_by_pod and (
            old is None or holder_facet(old) != holder_facet(view)
        ):
            self.holders_version += 1
        self.pods[view.uid] = view
        if view.claim:
            self._pod_by_claim[f"{view.namespace}/{view.claim}"] = view.uid
        self._recharge(view.uid)
        return view

    def remove_pod(self, obj: Obj) -> PodView | None:
        uid = podlib.uid(obj)
        view = self.pods.pop(uid, None)
        if view is not None:
            self._unindex_pod(view)
            if uid in self._allocs_by_pod:
                self.holders_version += 1
        self._recharge(uid)
        return view

    def _unindex_pod(self, view: PodView) -> None:
        claim_key = f"{view.namespace}/{view.claim}"
        if view.claim and self._pod_by_claim.get(claim_key) == view.uid:
            del self._pod_by_claim[claim_key]

    def pod_by_claim(self, namespace: str, claim: str) -> PodView | None:
        uid = self._pod_by_claim.get(f"{namespace}/{claim}")
        return self.pods.get(uid) if uid else None

    # --- allocations --------------------------------------------------------------------

    def upsert_allocation(self, obj: Obj) -> SliceAllocation:
        """A watched allocation (replaces an assumed one of the same name)."""
        return self._put_alloc(SliceAllocation.parse(obj), assumed=False)

    def assume(self, obj: Obj) -> SliceAllocation:
        """Record a decision before its create is sent, so the next decision sees it."""
        return self._put_alloc(SliceAllocation.parse(obj), assumed=True)

    def is_assumed(self, key: str) -> bool:
        return key in self._assumed

    def confirm(self, obj: Obj) -> None:
        """The create succeeded: hold the written object unless the watch was faster."""
        view = SliceAllocation.parse(obj)
        if view.key in self._assumed:
            self._put_alloc(view, assumed=False)

    def forget(self, key: str) -> None:
        """The create failed: drop the assumed allocation (a watched one is kept)."""
        if key in self._assumed:
            self._drop_alloc(key)

    def drop_assumed(self, keep: Collection[str] = ()) -> None:
        """Forget assumed allocations, except `keep` (creates whose outcome is not known)."""
        for k in [k for k in self._assumed if k not in keep]:
            self._drop_alloc(k)

    def mark_deleting(self, alloc: SliceAllocation) -> None:
        """Our DELETE of `alloc` went through: count it as being deleted now, before the
        watch says so. (That no older watch event is trusted again is the pod record's
        job: `PodTrack.released`.)"""
        current = self.allocations.get(alloc.key)
        if alloc.uid and current is not None and current.uid == alloc.uid and not current.deleting:
            self._put_alloc(dataclasses.replace(current, deleting=True), assumed=False)

    def remove_allocation(self, obj: Obj) -> SliceAllocation | None:
        key = SliceAllocation.parse(obj).key
        if key not in self.allocations:
            return None
        return self._drop_alloc(key)

    def allocations_of(self, pod_uid: str) -> list[SliceAllocation]:
        return [self.allocations[k] for k in sorted(self._allocs_by_pod.get(pod_uid, ()))]

    def allocations_on(self, node: str) -> list[SliceAllocation]:
        return [self.allocations[k] for k in sorted(self._allocs_by_node.get(node, ()))]

    def _put_alloc(self, view: SliceAllocation, *, assumed: bool) -> SliceAllocation:
        old = self.allocations.get(view.key)
        if old is None or _held(old, view.key in self._assumed) != _held(view, assumed):
            self.holders_version += 1
        if old is not None:
            self._unindex(old)
        self.allocations[view.key] = view
        if assumed:
            self._assumed.add(view.key)
        self.in_flight.put(view, assumed=assumed)
        self._allocs_by_pod.setdefault(view.pod_uid, set()).add(view.key)
        self._allocs_by_node.setdefault(view.node, set()).add(view.key)
        self._live_claims[(view.node, view.name)] += 1
        if not assumed:
            self.slice_counts.update((s.profile, view.node, s.gpu_uuid) for s in view.slices)
        self._dirty.add(view.node)
        self._recharge(view.pod_uid)
        if old is not None and old.pod_uid != view.pod_uid:
            self._recharge(old.pod_uid)
        return view

    def _drop_alloc(self, key: str) -> SliceAllocation:
        view = self.allocations.pop(key)
        self._unindex(view)
        self._recharge(view.pod_uid)
        self.epoch += 1
        self.holders_version += 1
        return view

    def _unindex(self, view: SliceAllocation) -> None:
        self.in_flight.drop(view.key)
        keys = self._allocs_by_pod.get(view.pod_uid)
        if keys is not None:
            keys.discard(view.key)
            if not keys:
                del self._allocs_by_pod[view.pod_uid]
        keys = self._allocs_by_node.get(view.node)
        if keys is not None:
            keys.discard(view.key)
            if not keys:
                del self._allocs_by_node[view.node]
        live = (view.node, view.name)
        self._live_claims[live] -= 1
        if self._live_claims[live] <= 0:
            del self._live_claims[live]
        if view.key in self._assumed:
            self._assumed.discard(view.key)
        else:
            self.slice_counts.subtract((s.profile, view.node, s.gpu_uuid) for s in view.slices)
            self.slice_counts += Counter()  # drop zero counts
        self._dirty.add(view.node)

    def put_foreign(self, key: str, node: str, devices: tuple[str, ...]) -> bool:
        """DRA mode: the claim `key` (not ours) holds `devices` of `node`'s pool now (none:
        deallocated or gone); True when that changed. Counted as occupied (snapshots.py)."""
        old = self.foreign.get(key)
        if old == ((node, devices) if devices else None):
            return False
        if old is not None:
            del self.foreign[key]
            self._foreign_by_node[old[0]].discard(key)
            self._dirty.add(old[0])
            self.epoch += 1
        if devices:
            self.foreign[key] = (node, devices)
            self._foreign_by_node.setdefault(node, set()).add(key)
            self._dirty.add(node)
        self.holders_version += 1
        return True

    # --- nodes and MigNodes -------------------------------------------------------------

    def upsert_node(self, obj: Obj) -> bool:
        """Returns True when something placement looks at changed."""
        view = NodeView.of(obj)
        self._rooms.pop(view.name, None)
        return self._put(self.nodes, view.name, view)

    def remove_node(self, obj: Obj) -> None:
        self._rooms.pop(_name(obj), None)
        self._pop(self.nodes, _name(obj))

    def upsert_mig_node(self, obj: Obj, gpus: tuple[GpuView, ...] | None = None) -> bool:
        """`gpus`: `gpus_of(obj, self.geometries)`, when the caller has it already."""
        views = gpus if gpus is not None else gpus_of(obj, self.geometries)
        return self._put(self.gpus, _name(obj), views)

    def remove_mig_node(self, obj: Obj) -> None:
        self._pop(self.gpus, _name(obj))

    def _put(self, table: dict[str, Any], name: str, value: object) -> bool:
        """Store a node's view; a change is capacity that may have grown (epoch)."""
        if table.get(name) == value:
            return False
        table[name] = value
        self._dirty.add(name)
        self.epoch += 1
        self.holders_version += 1
        return True

    def _pop(self, table: dict[str, Any], name: str) -> None:
        if table.pop(name, None) is not None:
            self._dirty.add(name)
            self.holders_version += 1

    def set_agent_down(self, node: str, down: bool) -> bool:
        """Leave `node` out of placement while its agent is down; True when that changed.
        An agent back is capacity back (epoch)."""
        if down == (node in self.agents_down):
            return False
        self._dirty.add(node)  # in or out of the index
        self.holders_version += 1
        if down:
            self.agents_down.add(node)
        else:
            self.agents_down.discard(node)
            self.epoch += 1
        return True

    def down_agents_placeable(self) -> list[str]:
        """Nodes left out of placement only because their agent is down, sorted."""
        self.node_states()
        return sorted(n for n in self.agents_down if n in self._node_cache)

    def gpu(self, node: str, index: int) -> GpuView | None:
        return next((g for g in self.gpus.get(node, ()) if g.index == index), None)

    def gpu_uuid(self, node: str) -> Callable[[int], str]:
        """GPU index → UUID on `node`, for a placement decided on this model."""

        def uuid(index: int) -> str:
            gpu = self.gpu(node, index)
            assert gpu is not None, "placement named a GPU outside the snapshot"
            return gpu.uuid

        return uuid


def _held(alloc: SliceAllocation, assumed: bool) -> tuple[object, ...]:
    """What a preemption plan reads of an allocation (preemption.py `holders`): whose it is,
    where, which slots, whether it is going, whether it is a reservation. Not its phase."""
    return (alloc.pod_uid, alloc.node, alloc.slices, alloc.deleting, assumed)


def _name(obj: Obj) -> str:
    return str(obj.get("metadata", {}).get("name", ""))
