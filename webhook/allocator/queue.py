"""The placement queue (pure): gated pods waiting for a decision, highest `spec.priority`
first, then oldest `creationTimestamp`, then namespace/name (so the order is total and
stable). What is known about each pod lives in its record (webhook.allocator.track).
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
