"""The device-plugin binding's bookkeeping (nodeagent.deviceplugin.core.Bindings), pure.

Table cases for each step the kubelet drives (Allocate, PodResources settling, release) and a
hypothesis state machine over random interleavings of them, checking what release relies on:
no two device-id sets ever resolve to the same slice, every id set resolves to a prepared
slice, and ids known to run (settled) never change their slice until it is released.
"""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nodeagent.deviceplugin.core import Bindings, NoSlice, Unit, key_of

A1 = Unit("ns", "claim-a", "main", "1g.10gb", 1)
B1 = Unit("ns", "claim-b", "main", "1g.10gb", 1)
C2 = Unit("ns", "claim-c", "main", "1g.10gb", 2)
D3G = Unit("ns", "claim-d", "main", "3g.40gb", 1)


def bindings(*units: Unit) -> Bindings:
    b = Bindings()
    b.add_ready(list(units))
    return b


def test_allocate_picks_an_unbound_unit_of_that_profile_and_count() -> None:
    b = bindings(A1, B1, C2, D3G)
    assert b.allocate("1g.10gb", ["x"]) == A1
    assert b.allocate("1g.10gb", ["y"]) == B1
    assert b.allocate("1g.10gb", ["q", "p"]) == C2  # two ids: the unit asking for two
    assert b.allocate("3g.40gb", ["z"]) == D3G
    assert b.bound[key_of(["p", "q"])] == C2


def test_a_kubelet_retry_gets_the_same_unit() -> None:
    b = bindings(A1, B1)
    first = b.allocate("1g.10gb", ["x"])
    assert b.allocate("1g.10gb", ["x"]) == first
    assert len(b.bound) == 1


def test_no_free_unit_names_profile_and_count() -> None:
    b = bindings(A1)
    b.allocate("1g.10gb", ["x"])
    with pytest.raises(NoSlice, match=r"1g\.10gb slice x1"):
        b.allocate("1g.10gb", ["y"])
    with pytest.raises(NoSlice, match=r"3g\.40gb slice x1"):
        b.allocate("3g.40gb", ["z"])
    with pytest.raises(NoSlice, match=r"x2"):
        b.allocate("1g.10gb", ["p", "q"])


def test_settle_swaps_ids_to_their_holders_own_unit() -> None:
    b = bindings(A1, B1)
    b.allocate("1g.10gb", ["x"])  # → A1
    b.allocate("1g.10gb", ["y"])  # → B1
    # PodResources: ids x belong to claim-b's container, so x must resolve to B1
    changed = b.settle(("x",), B1)
    assert sorted(changed) == [("x",), ("y",)]
    assert b.bound == {("x",): B1, ("y",): A1}
    assert ("x",) in b.settled and ("y",) not in b.settled


def test_settle_onto_an_unbound_unit_moves_the_ids() -> None:
    b = bindings(A1, B1)
    b.allocate("1g.10gb", ["x"])  # → A1; B1 unbound
    assert b.settle(("x",), B1) == [("x",)]
    assert b.bound == {("x",): B1}


def test_settle_leaves_ids_that_already_run_alone() -> None:
    b = bindings(A1, B1)
    b.allocate("1g.10gb", ["x"])  # → A1
    b.allocate("1g.10gb", ["y"])  # → B1
    assert b.settle(("y",), B1) == []  # y is where it belongs, and now known to run
    assert b.settle(("x",), B1) == []  # B1 runs under y: x is not moved onto it
    assert b.bound == {("x",): A1, ("y",): B1}


def test_settle_of_a_unit_no_longer_ready_changes_nothing() -> None:
    b = bindings(A1)
    b.allocate("1g.10gb", ["x"])
    assert b.settle(("x",), B1) == []
    assert b.bound == {("x",): A1}


def test_release_forgets_the_claims_units_and_their_ids() -> None:
    b = bindings(A1, B1)
    b.allocate("1g.10gb", ["x"])
    b.allocate("1g.10gb", ["y"])
    b.settle(("x",), A1)
    assert b.release("ns", "claim-a") == [("x",)]
    assert b.ready == {B1} and b.bound == {("y",): B1} and ("x",) not in b.settled
    assert b.release("ns", "claim-a") == []  # twice is harmless


UNITS = [
    Unit("ns", f"c{i}", container, profile, count)
    for i, (container, profile, count) in enumerate(
        [
            ("main", "1g.10gb", 1),
            ("main", "1g.10gb", 1),
            ("side", "1g.10gb", 1),
            ("main", "1g.10gb", 2),
            ("main", "2g.20gb", 1),
            ("main", "2g.20gb", 1),
        ]
    )
]


class BindingsMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.b = Bindings()
        self.next_id = 0
        self.fixed: dict[tuple[str, ...], Unit] = {}  # settled keys → unit they must keep

    def _ids(self, n: int) -> list[str]:
        self.next_id += n
        return [f"dev-{self.next_id - i}" for i in range(n)]

    @rule(unit=st.sampled_from(UNITS))
    def prepare(self, unit: Unit) -> None:
        self.b.add_ready([unit])

    @rule(profile=st.sampled_from(["1g.10gb", "2g.20gb"]), count=st.sampled_from([1, 2]))
    def allocate(self, profile: str, count: int) -> None:
        free = [
            u
            for u in self.b.ready
            if u.profile == profile and u.count == count and u not in self.b.bound.values()
        ]
        if not free:
            with pytest.raises(NoSlice):
                self.b.allocate(profile, self._ids(count))
            return
        unit = self.b.allocate(profile, self._ids(count))
        assert unit in free

    @precondition(lambda self: bool(self.b.bound))
    @rule(data=st.data())
    def settle(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.b.bound)))
        if key in self.b.settled:
            return  # the kubelet reports a running container's ids once per holder
        # The holder's own unit: same profile and count as what the ids were bound to, and
        # no other running container's (holders and their own units are one to one).
        now = self.b.bound[key]
        owns = sorted(
            u
            for u in self.b.ready
            if (u.profile, u.count) == (now.profile, now.count) and u not in self.fixed.values()
        )
        own = data.draw(st.sampled_from(owns))  # `now` itself is always a candidate
        self.b.settle(key, own)
        assert self.b.bound[key] == own  # the ids now reach their holder's own slices
        self.fixed[key] = self.b.bound[key]

    @precondition(lambda self: bool(self.b.ready))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        unit = data.draw(st.sampled_from(sorted(self.b.ready)))
        keys = self.b.release(unit.namespace, unit.claim)
        for k in keys:
            self.fixed.pop(k, None)
        assert all(u.claim != unit.claim for u in self.b.ready)
        assert all(u.claim != unit.claim for u in self.b.bound.values())

    @invariant()
    def one_slice_per_id_set(self) -> None:
        units = list(self.b.bound.values())
        assert len(units) == len(set(units))

    @invariant()
    def ids_resolve_to_prepared_slices_of_their_size(self) -> None:
        for key, unit in self.b.bound.items():
            assert unit in self.b.ready and unit.count == len(key)

    @invariant()
    def running_ids_keep_their_slice(self) -> None:
        for key, unit in self.fixed.items():
            assert self.b.bound.get(key) == unit


TestBindingsMachine = BindingsMachine.TestCase


def test_releasing_an_older_allocation_keeps_the_newer_ones_units() -> None:
    """Security issue, item 6: units are the allocation's, by UID. Releasing an older
    allocation of the same claim must not drop the newer one's unit or its bound ids."""
    old = Unit("ns", "claim-a", "main", "1g.10gb", 1, "uid-old")
    new = Unit("ns", "claim-a", "main", "1g.10gb", 1, "uid-new")
    b = Bindings()
    b.add_ready([new])
    key = key_of(["id-0"])
    assert b.allocate("1g.10gb", ["id-0"]) == new
    assert b.release("ns", "claim-a", "uid-old") == []
    assert b.ready == {new} and b.bound == {key: new}
    assert old not in b.ready
    assert b.release("ns", "claim-a", "uid-new") == [key]
    assert b.ready == set() and b.bound == {}
