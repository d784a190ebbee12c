"""A heap of named entries that change: the fleet index's orders (index.py, why.py).

Each name has at most one live entry — the very tuple in the heap, so a heap entry is live
when it *is* its name's entry (one tuple per change, and an identity test); setting or
discarding it leaves the old heap entry in place, stale, and it is dropped when met.
Iteration pops live entries in ascending order and pushes them back when it ends, so a
caller that stops after a few entries pays for a few. When stale entries outnumber live
ones the heap is rebuilt.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from heapq import heapify, heappop, heappush
from typing import Any

Entry = tuple[Any, Any, str]  # (score, sort key, name): scores and keys must compare


class LazyHeap:
    def __init__(self, entries: list[Entry] | None = None) -> None:
        self.heap: list[Entry] = entries if entries is not None else []
        self.live: dict[str, Entry] = {entry[2]: entry for entry in self.heap}
        heapify(self.heap)

    def __len__(self) -> int:
        return len(self.live)

    def set(self, name: str, score: Any, key: Any) -> None:
        old = self.live.get(name)
        if old is None or old[0] != score or old[1] != key:
            entry = self.live[name] = (score, key, name)
            heappush(self.heap, entry)

    def discard(self, name: str) -> None:
        self.live.pop(name, None)

    def compact(self) -> None:
        if len(self.heap) > 2 * len(self.live) + 256:  # mostly stale entries: rebuild
            self.heap = list(self.live.values())
            heapify(self.heap)

    def ascending(self) -> Generator[Entry]:
        """Live entries, best first. Entries are popped while iterating and pushed back
        when the iteration ends (close it, or run it to its end)."""
        heap, live = self.heap, self.live
        taken: list[Entry] = []
        try:
            while heap:
                entry = heappop(heap)
                if live.get(entry[2]) is not entry:
                    continue  # stale
                taken.append(entry)
                yield entry
        finally:
            for entry in taken:
                heappush(heap, entry)


def take(stale: set[str], limit: int | None) -> tuple[Iterable[str], set[str]]:
    """Up to `limit` names out of `stale` (all of them when None): (taken, left). Taking
    all hands `stale` itself back and leaves a fresh set: popping a set emptied of many
    names is slow (CPython)."""
    if limit is None or limit >= len(stale):
        return stale, set()
    return [stale.pop() for _ in range(limit)], stale
