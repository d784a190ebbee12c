"""Pure bookkeeping of the allocator loop besides the pod records (webhook.allocator.track):

- `PlacementQueue`: gated pods waiting for a decision, highest `spec.priority` first, then
  oldest `creationTimestamp`, then namespace/name (so the order is total and stable).
- `AgentLeases`: when each node agent's Lease was last seen renewed, on the injected
  monotonic clock, so nodes whose agent stopped can be left out of placement.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, order=True)
class _Entry:
    neg_priority: int
    created: str
    key: str
    uid: str


class PlacementQueue:
    def __init__(self) -> None:
        self._heap: list[_Entry] = []
        self._live: dict[str, _Entry] = {}  # uid -> its current entry (others are stale)

    def push(self, uid: str, *, priority: int, created: str, key: str) -> None:
        entry = _Entry(-priority, created, key, uid)
        if self._live.get(uid) == entry:
            return
        self._live[uid] = entry
        heapq.heappush(self._heap, entry)

    def pop(self) -> str | None:
        while self._heap:
            entry = heapq.heappop(self._heap)
            if self._live.get(entry.uid) == entry:
                del self._live[entry.uid]
                return entry.uid
        return None

    def remove(self, uid: str) -> None:
        self._live.pop(uid, None)  # its heap entry is skipped when popped
        if not self._live:
            self._heap.clear()

    def clear(self) -> None:
        self._live.clear()
        self._heap.clear()

    def __contains__(self, uid: object) -> bool:
        return uid in self._live

    def __len__(self) -> int:
        return len(self._live)


class AgentLeases:
    """Node agents' heartbeats, timed as the node lifecycle controller times kubelets': a
    renewal counts when it is seen (a new `renewTime`), on the allocator's own monotonic
    clock, so clock skew between a node and the allocator does not matter."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[str, float, float]] = {}  # node -> renewTime, seen, duration

    def observe(self, node: str, renew_time: str, duration_s: float, seen: float) -> None:
        """A Lease as watched; `seen` counts only when `renew_time` is new."""
        prev = self._seen.get(node)
        if prev is not None and prev[0] == renew_time:
            seen = prev[1]
        self._seen[node] = (renew_time, seen, duration_s)

    def forget(self, node: str) -> None:
        self._seen.pop(node, None)

    def expired(self, now: float) -> set[str]:
        """Nodes whose agent has not renewed its Lease for longer than the Lease's duration.
        A node without a Lease is not among them (unknown is not down)."""
        return {n for n, (_, seen, duration) in self._seen.items() if now - seen > duration}

    def is_expired(self, node: str, now: float) -> bool:
        """`node in expired(now)`, for one node (a Lease event must not scan them all)."""
        entry = self._seen.get(node)
        return entry is not None and now - entry[1] > entry[2]

    def silent_s(self, node: str, now: float) -> float | None:
        entry = self._seen.get(node)
        return None if entry is None else now - entry[1]
