"""The allocator's in-memory cluster model: pure data, fed by watch events, read as snapshots.

`ClusterState` keeps what the four informers deliver — Pods, Nodes, MigNodes and
SliceAllocations — reduced to what placement needs, and answers `snapshot()` with the
placement engine's `Snapshot`:

- A node's free cpu/memory/pods is its allocatable minus the requests of every non-terminal
  pod charged to it: bound there (`spec.nodeName`), pinned there (required affinity on
  `metadata.name`, ours or anyone's), or holding a live SliceAllocation there. InstaSlice's
  pods or not, each pod is charged to at most one node.
- `room(node)` answers what the kube-scheduler may see free there, at most: allocatable
  (with the agent's `instaslice.io/*` upper bounds) minus the requests of the pods bound
  there only — what the autoscaler signal reads (autoscale.kept_off).
- A GPU's occupied slots are the union of the slices of every live SliceAllocation naming
  it (any phase, including assumed ones and ones being deleted) and the MigNode's instances
  that no live allocation claims (foreign instances are never reused). Slots free up only
  when the allocation object is gone (docs/protocol.md, "Occupancy truth").

"Assumed" allocations (docs/style.md §3) are recorded before the create is sent, so the next
decision already sees them, and are forgotten if the create fails; the watched object
replaces the assumed one when it arrives.

A node whose agent is down (its Lease went unrenewed; the controller decides, this only
records it) is left out of `snapshot()`: a pod placed there would wait for an agent that may
never come. Its allocations and GPUs still count, and `node_states()` still shows it.

`epoch` grows whenever capacity may have grown (a slice released, a pod gone from a node, a
node or GPU added or changed, an agent back): pods parked as pending are retried on that,
not on a timer. `holders_version` grows whenever what a preemption plan reads may have
changed (an allocation added, changed or gone, a pod holding one changed in what
`views.holder_facet` shows, a node, GPU or agent changed): a plan that found nothing is made
again only then (webhook/allocator/planning.py), not on every epoch.

It does no I/O and keeps no clock. Node states are cached and rebuilt only for nodes that
changed, and the placeable ones are kept in a `FleetIndex` (common/placement/index.py), so a
decision on the state's own snapshot (`place`) neither rebuilds it nor scans every node.

With `avoid_creates_in_flight` on, it also counts the slices in flight per GPU (inflight.py)
and keeps a second index of the same nodes with their busy GPUs left out (`decide_calm`), so
the placer's first pass costs what a decision costs.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from common.allocation import SliceAllocation
from common.catalog import Catalog, load_catalog
from common.catalog.learned import Geometries
from common.placement import (
    Gpu,
    NodeState,
    Occupied,
    Pending,
    Placement,
    PodRequest,
    Policy,
    Snapshot,
    engine,
)
from common.placement.index import FleetIndex
from common.placement.modes import ModeView
from common.placement.whole import WholeView
from webhook.allocator import pods as podlib
from webhook.allocator.inflight import GpuRef, InFlight, calm_node
from webhook.allocator.pods import FIELD_NAME_LABEL, Resources
from webhook.allocator.views import GpuView, NodeView, PodView, Room, gpus_of, holder_facet

Obj = dict[str, Any]
_NONE: dict[str, int] = {}  # never written: what a node without bound extended requests has


@dataclass(frozen=True, slots=True)
class Charge:
    """One pod's requests, charged to `node`: it is bound there (`bound`), pinned there, or
    holds a live SliceAllocation there."""

    node: str
    resources: Resources
    extended: tuple[tuple[str, int], ...]
    bound: bool

    @property
    def usage(self) -> tuple[str, Resources]:
        """What placement counts of it (all but `bound` and `extended`)."""
        return self.node, self.resources


class ClusterState:
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

    # --- accounting ---------------------------------------------------------------------

    def _charge_of(self, uid: str) -> Charge | None:
        pod = self.pods.get(uid)
        if pod is None or pod.terminal:
            return None
        node = pod.node
        if not node:
            live = [a for a in self.allocations_of(uid) if not a.deleting]
            node = live[0].node if live else None
        return Charge(node, pod.resources, pod.extended, bool(pod.bound)) if node else None

    def _recharge(self, uid: str) -> None:
        new = self._charge_of(uid)
        old = self._charges.get(uid)
        if new == old:
            return
        if old is not None and old.bound:
            self._bind(old, -1)
        if new is not None and new.bound:
            self._bind(new, 1)
        # a pinned pod binding on its node changes nothing placement reads
        if (old and old.usage) != (new and new.usage):
            if old is not None:
                node, res = old.usage
                self._usage[node] = self._usage.get(node, Resources()) - res
                self._dirty.add(node)
                self.epoch += 1  # something left (or shrank on) a node
            if new is not None:
                node, res = new.usage
                self._usage[node] = self._usage.get(node, Resources()) + res
                self._dirty.add(node)
        if new is None:
            self._charges.pop(uid, None)
        else:
            self._charges[uid] = new

    def _bind(self, charge: Charge, sign: int) -> None:
        node = charge.node
        self._rooms.pop(node, None)
        res = self._bound_usage.get(node, Resources())
        self._bound_usage[node] = res + charge.resources if sign > 0 else res - charge.resources
        if charge.extended:  # a new dict each time: a Room handed out keeps the old one
            used = dict(self._bound_extended.get(node) or {})
            for name, count in charge.extended:
                used[name] = used.get(name, 0) + sign * count
                if not used[name]:
                    del used[name]
            if used:
                self._bound_extended[node] = used
            else:
                self._bound_extended.pop(node, None)
        if self._bound_usage[node] == Resources():
            del self._bound_usage[node]

    def room(self, node: str) -> Room | None:
        """What the kube-scheduler may see free on `node`, at most (views.Room: allocatable
        minus what the pods bound there request); None for a node without a Node. Kept
        until the node or a pod bound there changes (a signal lists it per node)."""
        room = self._rooms.get(node)
        if room is None:
            view = self.nodes.get(node)
            if view is None:
                return None
            free = view.allocatable - self._bound_usage.get(node, Resources())
            used = self._bound_extended.get(node, _NONE)
            room = self._rooms[node] = Room(free, view.extended, used)
        return room

    def usage(self, node: str) -> Resources:
        return self._usage.get(node, Resources())

    def free(self, node: str) -> Resources:
        view = self.nodes.get(node)
        return (view.allocatable if view else Resources()) - self.usage(node)

    # --- snapshots ----------------------------------------------------------------------

    def occupied(self, node: str) -> dict[str, tuple[Occupied, ...]]:
        """Per GPU uuid of `node`: the union of live allocations' slices on it and the
        MigNode's instances that no live allocation claims."""
        slots: dict[str, set[Occupied]] = {}
        for key in self._allocs_by_node.get(node, ()):
            for s in self.allocations[key].slices:
                slots.setdefault(s.gpu_uuid, set()).add(Occupied(s.start, s.size, s.profile))
        for gpu in self.gpus.get(node, ()):
            for start, size, profile, claim in gpu.instances:
                if not claim or (node, claim) not in self._live_claims:
                    slots.setdefault(gpu.uuid, set()).add(Occupied(start, size, profile))
        return {
            uuid: tuple(sorted(occ, key=lambda o: (o.start, o.size, o.profile)))
            for uuid, occ in slots.items()
        }

    def _node_state(self, name: str) -> NodeState | None:
        view = self.nodes.get(name)
        gpus = self.gpus.get(name)
        if view is None or gpus is None:
            return None
        free = self.free(name)
        occupied = self.occupied(name)
        return NodeState(
            name=name,
            labels=view.labels,
            taints=view.taints,
            unschedulable=view.unschedulable,
            cpu_millis_free=free.cpu_millis,
            memory_bytes_free=free.memory_bytes,
            pods_free=free.pods,
            gpus=tuple(
                Gpu(
                    index=g.index,
                    model=g.model,
                    mig_enabled=g.mig_enabled,
                    healthy=g.healthy,
                    occupied=occupied.get(g.uuid, ()),
                    geometry=g.geometry,
                )
                for g in gpus
            ),
        )

    def _refresh(self) -> None:
        """Rebuild the node states of the nodes that changed, and index the placeable ones."""
        if not self._dirty:
            return
        for name in self._dirty:
            state = self._node_state(name)
            if state is None:
                self._node_cache.pop(name, None)
            else:
                self._node_cache[name] = state
            if state is None or name in self.agents_down:
                self._index.remove(name)
            else:
                self._index.put(state, name)
            if self._calm_index is not None:
                self._refresh_calm(name, state)
        self._dirty.clear()
        self._nodes_sorted = None
        self._plain = None
        self._calm_plain = None

    def _refresh_calm(self, name: str, state: NodeState | None) -> None:
        assert self._calm_index is not None
        if state is None:
            self._calm_nodes.pop(name, None)
            self._calm_index.remove(name)
            return
        busy = self.in_flight.busy_on(name)
        indexes = frozenset(g.index for g in self.gpus.get(name, ()) if g.uuid in busy)
        calm = self._calm_nodes[name] = calm_node(state, indexes)
        if name in self.agents_down:
            self._calm_index.remove(name)
        else:
            self._calm_index.put(calm, name)

    def node_states(self) -> tuple[NodeState, ...]:
        """Every node that has both a Node and a MigNode, by name (agents down included)."""
        self._refresh()
        if self._nodes_sorted is None:
            self._nodes_sorted = tuple(self._node_cache[n] for n in sorted(self._node_cache))
        return self._nodes_sorted

    def place(
        self,
        snapshot: Snapshot,
        request: PodRequest,
        policy: Policy = Policy.INSTASLICE,
        catalog: Catalog | None = None,
    ) -> Placement | Pending:
        """`engine.place(snapshot, request, policy, catalog)`: answered by the fleet index
        when `snapshot` is the state's own and current (`snapshot()` with no arguments, and
        nothing changed since), else by the engine's scan of `snapshot`. Same answers."""
        self._refresh()
        if snapshot is self._plain:
            return self._index.place(request, policy, catalog, self.snapshot)
        return engine.place(snapshot, request, policy, catalog)

    def decide(
        self, request: PodRequest, policy: Policy, catalog: Catalog | None
    ) -> Placement | Pending:
        """`place` on the state's own current snapshot: the fleet index answers."""
        return self.place(self.snapshot(), request, policy, catalog)

    def busy_gpus(self) -> frozenset[GpuRef]:
        """The GPUs with `avoid_creates_in_flight` or more slices in flight (none when off)."""
        return self.in_flight.busy()

    def any_busy(self) -> bool:
        return self.in_flight.any_busy()

    def decide_calm(
        self, request: PodRequest, policy: Policy, catalog: Catalog | None
    ) -> Placement | Pending:
        """`engine.place` on the state's own snapshot with the busy GPUs shown unhealthy
        (`snapshot(exclude=busy_gpus())`, same answers), from the second index."""
        if self._calm_index is None:
            raise RuntimeError("decide_calm needs avoid_creates_in_flight > 0")
        self._refresh()
        return self._calm_index.place(request, policy, catalog, self._calm_snapshot)

    def _calm_snapshot(self) -> Snapshot:
        if self._calm_plain is None:
            nodes = self.snapshot().nodes
            self._calm_plain = Snapshot(nodes=tuple(self._calm_nodes[n.name] for n in nodes))
        return self._calm_plain

    def snapshot(
        self,
        *,
        exclude: Collection[tuple[str, str]] = frozenset(),
        name_label: bool = False,
    ) -> Snapshot:
        """The placement engine's view: `node_states()` less the nodes whose agent is down.

        `exclude`: (node, gpu uuid) pairs shown as unhealthy (GPUs that failed this pod).
        `name_label`: add FIELD_NAME_LABEL=<node> to each node (pods with matchFields).
        """
        placeable = self.node_states()
        if self.agents_down:
            placeable = tuple(n for n in placeable if n.name not in self.agents_down)
        if not exclude and not name_label:
            if self._plain is None:
                self._plain = Snapshot(nodes=placeable)
            return self._plain
        excluded: dict[str, set[str]] = {}
        for node, gpu_uuid in exclude:
            excluded.setdefault(node, set()).add(gpu_uuid)
        nodes = []
        for state in placeable:
            name = state.name
            if name in excluded:
                bad = {g.index for g in self.gpus.get(name, ()) if g.uuid in excluded[name]}
                state = dataclasses.replace(
                    state,
                    gpus=tuple(
                        dataclasses.replace(g, healthy=False) if g.index in bad else g
                        for g in state.gpus
                    ),
                )
            if name_label:
                state = dataclasses.replace(state, labels={**state.labels, FIELD_NAME_LABEL: name})
            nodes.append(state)
        return Snapshot(nodes=tuple(nodes))

    def mode_view(self, snapshot: Snapshot) -> ModeView:
        """The snapshot's GPUs with MIG off, by class (common/placement/modes.py); GPUs the
        snapshot shows unhealthy (failed for this pod) are left out, but for those whose
        change to MIG on is under way (Ampere maintenance: shown unhealthy meanwhile)."""
        flex: set[tuple[str, int]] = set()
        reset: set[tuple[str, int]] = set()
        under_way: set[tuple[str, int]] = set()
        for node in snapshot.nodes:
            healthy = {g.index for g in node.gpus if g.healthy and not g.occupied}
            empty = {g.index for g in node.gpus if not g.occupied}
            for g in self.gpus.get(node.name, ()):
                if g.index in healthy and g.flex:
                    flex.add((node.name, g.index))
                elif g.index in healthy and g.needs_reset:
                    reset.add((node.name, g.index))
                elif g.index in empty and _under_way(g, "enabled"):
                    under_way.add((node.name, g.index))
        return ModeView(frozenset(flex), frozenset(reset), frozenset(under_way))

    def whole_view(self, snapshot: Snapshot) -> WholeView:
        """The snapshot's GPUs with nothing on them (no instance, no allocation) that could be
        whole GPUs, by what that takes (common/placement/whole.py)."""
        now: set[tuple[str, int]] = set()
        toggle: set[tuple[str, int]] = set()
        reset: set[tuple[str, int]] = set()
        under_way: set[tuple[str, int]] = set()
        for node in snapshot.nodes:
            empty = {g.index for g in node.gpus if g.healthy and not g.occupied}
            unused = {g.index for g in node.gpus if not g.occupied}
            for g in self.gpus.get(node.name, ()):
                ref = (node.name, g.index)
                if g.index in unused and _under_way(g, "disabled"):
                    under_way.add(ref)
                if g.index not in empty:
                    continue
                if g.whole_now:
                    now.add(ref)
                elif g.whole_toggle:
                    toggle.add(ref)
                elif g.whole_needs_reset:
                    reset.add(ref)
        return WholeView(frozenset(now), frozenset(toggle), frozenset(reset), frozenset(under_way))


def _under_way(gpu: GpuView, mode: str) -> bool:
    """An asked change to `mode` not done yet (views.in_maintenance)."""
    return gpu.maintenance and gpu.desired == mode


def _held(alloc: SliceAllocation, assumed: bool) -> tuple[object, ...]:
    """What a preemption plan reads of an allocation (preemption.py `holders`): whose it is,
    where, which slots, whether it is going, whether it is a reservation. Not its phase."""
    return (alloc.pod_uid, alloc.node, alloc.slices, alloc.deleting, assumed)


def _name(obj: Obj) -> str:
    return str(obj.get("metadata", {}).get("name", ""))
