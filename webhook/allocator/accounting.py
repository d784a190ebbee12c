"""The cluster model's accounting: what pods take of each node's cpu, memory and pod slots.

A node's free cpu/memory/pods (`free`) is its allocatable minus the requests of every
non-terminal pod charged to it: bound there (`spec.nodeName`), pinned there (required
affinity on `metadata.name`, ours or anyone's), or holding a live SliceAllocation there.
InstaSlice's pods or not, each pod is charged to at most one node (`Charge`). `room(node)`
answers what the kube-scheduler may see free there, at most: allocatable (with the agent's
`instaslice.io/*` upper bounds) minus the requests of the pods bound there only — what the
autoscaler signal reads (autoscale.kept_off).

A part of `ClusterState` (state.py), which keeps the tables and calls `_recharge` whenever
a pod or one of its allocations changes; pure, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.allocation import SliceAllocation
from webhook.allocator.pods import Resources
from webhook.allocator.views import NodeView, PodView, Room

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


class Accounting:
    """Charges, bound usage and room, per node (ClusterState's tables, declared here)."""

    pods: dict[str, PodView]
    nodes: dict[str, NodeView]
    _charges: dict[str, Charge]
    _usage: dict[str, Resources]
    _bound_usage: dict[str, Resources]  # what the pods bound there request, per node
    _bound_extended: dict[str, dict[str, int]]
    _rooms: dict[str, Room]  # `room`, by node: dropped when either changes
    _dirty: set[str]  # nodes whose node state is to be built again
    epoch: int

    def allocations_of(self, pod_uid: str) -> list[SliceAllocation]:
        raise NotImplementedError  # ClusterState's

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
