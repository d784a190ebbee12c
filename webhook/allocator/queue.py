"""Pure bookkeeping of the allocator loop: the placement queue and two small trackers.

- `PlacementQueue`: gated pods waiting for a decision, highest `spec.priority` first, then
  oldest `creationTimestamp`, then namespace/name (so the order is total and stable).
- `PendingTracker`: the last pending reason per pod, so `AllocationPending` is emitted once
  per reason, not once per retry.
- `UnschedulableTracker`: since when each pinned pod has been unschedulable, on an injected
  monotonic clock, so the pinned-unschedulable timeout needs no timer per pod.
"""

from __future__ import annotations

import heapq
from collections import Counter
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


class PendingTracker:
    """Last pending reason per pod uid; `observe` says whether it changed."""

    def __init__(self) -> None:
        self._reasons: dict[str, str] = {}

    def observe(self, uid: str, reason: str) -> bool:
        if self._reasons.get(uid) == reason:
            return False
        self._reasons[uid] = reason
        return True

    def clear(self, uid: str) -> None:
        self._reasons.pop(uid, None)

    def reason(self, uid: str) -> str | None:
        return self._reasons.get(uid)

    def counts(self) -> Counter[str]:
        return Counter(self._reasons.values())


class UnschedulableTracker:
    """Pinned pods the scheduler cannot place, and since when (monotonic seconds)."""

    def __init__(self) -> None:
        self._since: dict[str, float] = {}
        self._handled: set[str] = set()

    def observe(self, uid: str, unschedulable: bool, now: float) -> None:
        if unschedulable:
            self._since.setdefault(uid, now)
        else:
            self.forget(uid)

    def forget(self, uid: str) -> None:
        self._since.pop(uid, None)
        self._handled.discard(uid)

    def due(self, now: float, timeout: float) -> list[str]:
        """Pods unschedulable for at least `timeout`, not yet handled; marks them handled."""
        out = sorted(
            u for u, t in self._since.items() if u not in self._handled and now - t >= timeout
        )
        self._handled.update(out)
        return out

    def next_deadline(self, timeout: float) -> float | None:
        times = [t + timeout for u, t in self._since.items() if u not in self._handled]
        return min(times) if times else None

    def __contains__(self, uid: object) -> bool:
        return uid in self._since
