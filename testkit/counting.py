"""A map that counts what each call touches, for tests that a structure's every operation stays
O(1) (common/lru.py, the metrics endpoint's decision cache). A fake, no I/O."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class CountingStore(OrderedDict[Any, Any]):
    """An OrderedDict counting every entry a call touches: single-key operations count 1,
    anything iterating over the entries counts them all."""

    def __init__(self) -> None:
        super().__init__()
        self.touched = 0

    def __getitem__(self, key: Any) -> Any:
        self.touched += 1
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self.touched += 1
        return super().get(key, default)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.touched += 1
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        self.touched += 1
        super().__delitem__(key)

    def move_to_end(self, key: Any, last: bool = True) -> None:
        self.touched += 1
        super().move_to_end(key, last)

    def popitem(self, last: bool = True) -> tuple[Any, Any]:
        self.touched += 1
        return super().popitem(last)

    def __iter__(self) -> Any:
        self.touched += len(self)
        return super().__iter__()

    def items(self) -> Any:
        self.touched += len(self)
        return super().items()

    def values(self) -> Any:
        self.touched += len(self)
        return super().values()

    def keys(self) -> Any:
        self.touched += len(self)
        return super().keys()
