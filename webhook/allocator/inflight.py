"""Slices placed but not made yet, per GPU, and the node view that leaves busy GPUs out.

Why: the node agent makes one GPU's slices one at a time (~0.6 s each with real NVML), and
the `instaslice` policy packs, so consecutive pods go to the same broken-open GPU and queue
there behind each other's creates: under churn a pod waited behind 4 to 5 of them, p99 3.3 s
for its slice where the slice itself takes 0.6 s (docs/benchmarks-history.md "The churn-realistic
tail"). With `--avoid-creates-in-flight N` (N > 0) the placer first decides as if every GPU
with N or more slices in flight were not there (`calm_node`); only when no other GPU can
take the pod does it decide as before, so a pod that can be placed never waits for this.
The trade: more GPUs broken open, a shorter tail (docs/allocator.md "Creates in flight").

In flight: a slice of an allocation the allocator assumed (decided, create not seen back) or
watched in phase `Pending` or `Creating` and not being deleted; it leaves the count when the
allocation turns `Ready` (or `Failed`, or goes). Counted per (node, GPU UUID) from what the
allocator already watches: no write, no clock. A slice being released is not counted (its
slots are occupied anyway, and placement never reuses them before the release is done).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from common.allocation import SliceAllocation
from common.objects import Phase
from common.placement import NodeState

GpuRef = tuple[str, str]  # (node, GPU UUID)

_MAKING = frozenset((Phase.PENDING.value, Phase.CREATING.value))


def making(view: SliceAllocation, *, assumed: bool) -> bool:
    """Whether `view`'s slices are still to be made (see the module docstring)."""
    return assumed or (not view.deleting and view.phase in _MAKING)


class InFlight:
    """Slices in flight per GPU; `limit` (0: off) is when a GPU counts as busy."""

    def __init__(self, limit: int = 0) -> None:
        if limit < 0:
            raise ValueError(f"avoid_creates_in_flight must be >= 0, not {limit}")
        self.limit = limit
        self._by_node: dict[str, Counter[str]] = {}  # node -> GPU UUID -> slices in flight
        self._of: dict[str, tuple[str, tuple[str, ...]]] = {}  # allocation key -> counted
        self._busy: set[GpuRef] = set()  # kept as the counts change: a decision reads it

    def put(self, view: SliceAllocation, *, assumed: bool) -> None:
        """Count `view` (replacing what its key counted before)."""
        self.drop(view.key)
        if not making(view, assumed=assumed) or not view.slices:
            return
        uuids = tuple(s.gpu_uuid for s in view.slices)
        self._of[view.key] = (view.node, uuids)
        on_node = self._by_node.setdefault(view.node, Counter())
        on_node.update(uuids)
        if self.limit:
            self._busy.update((view.node, u) for u in uuids if on_node[u] >= self.limit)

    def drop(self, key: str) -> None:
        counted = self._of.pop(key, None)
        if counted is None:
            return
        node, uuids = counted
        on_node = self._by_node[node]
        on_node.subtract(uuids)
        for uuid in uuids:
            if on_node[uuid] < self.limit:
                self._busy.discard((node, uuid))
            if on_node[uuid] <= 0:
                del on_node[uuid]
        if not on_node:
            del self._by_node[node]

    def count(self, node: str, uuid: str) -> int:
        return self._by_node.get(node, Counter())[uuid]

    def busy_on(self, node: str) -> frozenset[str]:
        """The UUIDs of `node`'s GPUs with `limit` or more slices in flight (none when off)."""
        on_node = self._by_node.get(node)
        if not self.limit or not on_node:
            return frozenset()
        return frozenset(uuid for uuid, n in on_node.items() if n >= self.limit)

    def busy(self) -> frozenset[GpuRef]:
        """Every busy GPU, as (node, UUID) pairs (`ClusterState.snapshot`'s `exclude`)."""
        return frozenset(self._busy)

    def any_busy(self) -> bool:
        return bool(self._busy)


def calm_node(state: NodeState, busy_indexes: frozenset[int]) -> NodeState:
    """`state` with the GPUs at `busy_indexes` shown unhealthy (the first pass skips them),
    or `state` itself when there are none."""
    if not busy_indexes:
        return state
    return dataclasses.replace(
        state,
        gpus=tuple(
            dataclasses.replace(g, healthy=False) if g.index in busy_indexes else g
            for g in state.gpus
        ),
    )
