"""The cluster model's snapshots: the placement engine's view of it, and its indexes.

A GPU's occupied slots are the union of the slices of every live SliceAllocation naming it
(any phase, including assumed ones and ones being deleted) and the MigNode's instances that
no live allocation claims (foreign instances are never reused), and in DRA mode the devices
users' own ResourceClaims hold (kube-scheduler allocated them; not yet carved, they are in no
MigNode). Node states are cached and
rebuilt only for nodes that changed (`_dirty`), and the placeable ones are kept in a
`FleetIndex` (common/placement/index.py), so a decision on the state's own snapshot
(`place`) neither rebuilds it nor scans every node. With `avoid_creates_in_flight` on, a
second index keeps the same nodes with their busy GPUs left out (`decide_calm`).

A part of `ClusterState` (state.py), which keeps the tables; pure, no I/O.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Collection

from common.allocation import SliceAllocation
from common.catalog import Catalog
from common.catalog.learned import Geometries
from common.constants import WHOLE_GPU_PROFILE
from common.draclaim import parse_device
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
from common.placement.warm import prefer_warm
from common.placement.whole import WholeView
from webhook.allocator.inflight import GpuRef, InFlight, calm_node
from webhook.allocator.pods import FIELD_NAME_LABEL, Resources
from webhook.allocator.views import GpuView, NodeView


class Snapshots:
    """Node states, the fleet indexes and snapshots (ClusterState's tables, declared here)."""

    nodes: dict[str, NodeView]
    gpus: dict[str, tuple[GpuView, ...]]
    allocations: dict[str, SliceAllocation]
    _allocs_by_node: dict[str, set[str]]
    _live_claims: Counter[tuple[str, str]]
    geometries: Geometries
    foreign: dict[str, tuple[str, tuple[str, ...]]]
    _foreign_by_node: dict[str, set[str]]
    agents_down: set[str]
    in_flight: InFlight
    _dirty: set[str]
    _node_cache: dict[str, NodeState]
    _nodes_sorted: tuple[NodeState, ...] | None  # None: to sort again
    _sorted_at: dict[str, int]  # node name → its place in `_nodes_sorted`
    _index: FleetIndex  # the placeable node states, keyed by name
    _plain: Snapshot | None  # snapshot() while nothing changed: the index's
    _calm_index: FleetIndex | None
    _calm_nodes: dict[str, NodeState]
    _calm_plain: Snapshot | None

    def free(self, node: str) -> Resources:
        raise NotImplementedError  # accounting.Accounting's

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
        for key in self._foreign_by_node.get(node, ()):
            for device in self.foreign[key][1]:
                held = self._device_slots(node, device)
                if held is not None:
                    slots.setdefault(held[0], set()).add(held[1])
        return {
            uuid: tuple(sorted(occ, key=lambda o: (o.start, o.size, o.profile)))
            for uuid, occ in slots.items()
        }

    def _device_slots(self, node: str, device: str) -> tuple[str, Occupied] | None:
        """(GPU uuid, slots) of a device of `node`'s pool (docs/dra.md); None when its GPU
        or profile is not (or no longer) published: nothing to plan around there."""
        parsed = parse_device(device)
        gpu = None if parsed is None else self.gpu(node, parsed[0])
        if parsed is None or gpu is None:
            return None
        model = gpu.geometry or self.geometries.catalog.model(gpu.model)
        if model is None:
            return None
        if parsed[1] is None:
            return gpu.uuid, Occupied(0, model.memory_slots, WHOLE_GPU_PROFILE)
        p = model.profile_by_id(parsed[1])
        return None if p is None else (gpu.uuid, Occupied(parsed[2], p.memory_slots, p.name))

    def gpu(self, node: str, index: int) -> GpuView | None:
        raise NotImplementedError  # ClusterState's

    def overlapped(self, alloc: SliceAllocation) -> str | None:
        """DRA mode: a user's claim holding some of `alloc`'s slots too (kube-scheduler
        allocated it at the same time as ours: each read the other late), as
        `<claim> (<device>)`; None when none does."""
        for key in sorted(self._foreign_by_node.get(alloc.node, ())):
            for device in self.foreign[key][1]:
                held = self._device_slots(alloc.node, device)
                if held is None:
                    continue
                uuid, occ = held
                for s in alloc.slices:
                    mask = ((1 << s.size) - 1) << s.start
                    if s.gpu_uuid == uuid and mask & occ.mask:
                        return f"{key} ({device})"
        return None

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
        """Rebuild the node states of the nodes that changed, and index the placeable ones.
        A node changed in place keeps its place in `node_states()`: only a node added or
        removed sorts them again (a sort of 5000 names took most of a decision's 4 ms after
        each placement: docs/benchmarks.md, issue 37)."""
        if not self._dirty:
            return
        moved: dict[int, NodeState] = {}  # place in `_nodes_sorted` → its new state
        for name in self._dirty:
            state = self._node_state(name)
            if state is None:
                if self._node_cache.pop(name, None) is not None:
                    self._nodes_sorted = None
            else:
                if name not in self._node_cache:
                    self._nodes_sorted = None
                elif self._nodes_sorted is not None:
                    moved[self._sorted_at[name]] = state
                self._node_cache[name] = state
            if state is None or name in self.agents_down:
                self._index.remove(name)
            else:
                self._index.put(state, name)
            if self._calm_index is not None:
                self._refresh_calm(name, state)
        self._dirty.clear()
        if self._nodes_sorted is not None and moved:
            nodes = list(self._nodes_sorted)
            for at, state in moved.items():
                nodes[at] = state
            self._nodes_sorted = tuple(nodes)
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
            names = sorted(self._node_cache)
            self._sorted_at = {n: i for i, n in enumerate(names)}
            self._nodes_sorted = tuple(self._node_cache[n] for n in names)
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

    def prefer_warm(self, placement: Placement, catalog: Catalog | None) -> Placement:
        """`placement` onto a warm slice of its node where that ties the engine's score
        (common/placement/warm.py); as it is when the node has none."""
        gpus = self.gpus.get(placement.node, ())
        warm = {g.index: tuple(Occupied(*w) for w in g.warm) for g in gpus if g.warm}
        if not warm:
            return placement
        self._refresh()
        node = self._node_cache.get(placement.node)
        return placement if node is None else prefer_warm(node, placement, warm, catalog)

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
