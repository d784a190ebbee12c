"""The one least-recently-used map: at most `size` entries, the one used longest ago out first.

Every bounded memo that must forget by recency uses it (the placement tables per GPU model,
the node index's per-shape sums, the metrics endpoint's token decisions), so eviction is
written and tested once. Every operation touches O(1) entries: reading or writing a key
moves it to the recent end, and each insert past the bound drops one entry from the other.
Not thread-safe, like the `OrderedDict` under it. `functools.lru_cache` memoises a function;
this is for a cache whose entries a caller fills, inspects or drops itself.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Lru(Generic[K, V]):
    """A map of at most `size` entries. `store` is injectable so a test can count what each
    call touches."""

    def __init__(self, size: int, store: OrderedDict[K, V] | None = None) -> None:
        if size < 1:
            raise ValueError(f"an LRU holds at least one entry, not {size}")
        self.size = size
        self._store: OrderedDict[K, V] = OrderedDict() if store is None else store

    def __getitem__(self, key: K) -> V:
        """The value (KeyError if absent), now the most recently used."""
        value = self._store[key]
        self._store.move_to_end(key)
        return value

    def get(self, key: K, default: V | None = None) -> V | None:
        """`self[key]`, or `default` when absent (a stored None is told apart only by `[]`)."""
        try:
            return self[key]
        except KeyError:
            return default

    def put(self, key: K, value: V) -> None:
        """Set `key`, the most recently used; past `size`, the least recently used goes."""
        self._store[key] = value
        self._store.move_to_end(key)
        while len(self._store) > self.size:
            self._store.popitem(last=False)

    def pop(self, key: K) -> V | None:
        """Drop `key`; its value, or None when absent."""
        return self._store.pop(key, None)

    def __contains__(self, key: object) -> bool:
        """Whether `key` is held; its recency is left as it was."""
        return key in self._store

    def __len__(self) -> int:
        return len(self._store)

    def values(self) -> Iterator[V]:
        """Every value, least recently used first; recency left as it was."""
        return iter(self._store.values())
