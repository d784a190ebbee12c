"""The one LRU map (common/lru.py): bound, recency, a stored None, O(1) touches.

Its users are tested through their own behaviour too (tests/unit/test_metricsauth.py for
the metrics decisions' cache, tests/unit/test_mignode_bounds.py for the placement tables);
this covers the type itself, including the orders a caller could get wrong.
Leaves out: thread safety (none is promised).
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.lru import Lru
from testkit.counting import CountingStore


def test_the_least_recently_used_goes_first() -> None:
    lru: Lru[str, int] = Lru(2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru["a"] == 1  # a read makes "a" the most recent
    lru.put("c", 3)
    assert "b" not in lru and lru.get("a") == 1 and lru.get("c") == 3
    lru.put("a", 10)  # a write does too
    lru.put("d", 4)
    assert "c" not in lru and lru["a"] == 10 and len(lru) == 2


def test_membership_and_values_leave_recency_alone() -> None:
    lru: Lru[str, int] = Lru(2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert "a" in lru
    assert list(lru.values()) == [1, 2]  # least recent first
    lru.put("c", 3)
    assert "a" not in lru and list(lru.values()) == [2, 3]


def test_a_stored_none_is_told_from_a_miss_by_indexing() -> None:
    lru: Lru[str, int | None] = Lru(4)
    lru.put("none", None)
    assert lru["none"] is None and "none" in lru
    with pytest.raises(KeyError):
        lru["missing"]
    assert lru.get("missing", 7) == 7


def test_pop_drops_one_key_and_tolerates_a_missing_one() -> None:
    lru: Lru[str, int] = Lru(3)
    lru.put("a", 1)
    assert lru.pop("a") == 1 and lru.pop("a") is None and len(lru) == 0


def test_a_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        Lru(0)


def test_each_call_touches_a_constant_number_of_entries() -> None:
    store = CountingStore()
    lru: Lru[int, int] = Lru(100, store)
    calls = 5_000
    for i in range(calls):
        lru.put(i, i)
        lru.get(i - 1)
    assert len(lru) == 100
    assert store.touched <= 6 * calls, store.touched


@given(st.integers(1, 6), st.lists(st.tuples(st.booleans(), st.integers(0, 9)), max_size=60))
def test_it_matches_a_list_model_of_recency(size: int, ops: list[tuple[bool, int]]) -> None:
    """Against the plainest model: a list of keys, most recent last."""
    lru: Lru[int, int] = Lru(size)
    model: list[int] = []
    for write, key in ops:
        if write:
            lru.put(key, key)
            model = [k for k in model if k != key] + [key]
            model = model[-size:]
        else:
            assert lru.get(key) == (key if key in model else None)
            if key in model:
                model = [k for k in model if k != key] + [key]
        assert list(lru.values()) == model
