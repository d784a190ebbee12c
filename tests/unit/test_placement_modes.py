"""Placement with MIG modes (common/placement/modes.py) and the allocator's mode classes.

Covers, as tables: a GPU in MIG mode that fits is chosen over a GPU whose mode would change;
only when none fits does a flex GPU serve, and the toggled GPU is reported; GPUs that need a
reset (Ampere) are never placed on, and when they alone would fit the reason is
NeedsMigModeChange naming them; the MigNode → class derivation (views.mode_class). As
hypothesis properties on random snapshots, against the brute-force oracle of
test_placement_properties.py: no toggle when a GPU in the right mode fits; a toggle only on a
flex GPU and only when nothing fits without one; never a slice on a GPU needing a reset;
NeedsMigModeChange exactly when only such GPUs would serve it.
Leaves out: whole-GPU requests (not built yet), the agent's side
(tests/integration/test_nodeagent_modes.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.catalog import Catalog
from common.placement import (
    Pending,
    PendingReason,
    Placement,
    PodRequest,
    Policy,
    Snapshot,
    place,
)
from common.placement.modes import ModeView, place_with_modes, with_mig
from tests.unit.test_placement import make_gpu, make_node, make_pod, snap
from tests.unit.test_placement_properties import brute_force, requests, snapshots
from webhook.allocator.views import mode_class

H100 = "H100-80GB"
A100 = "A100-80GB"


def test_gpu_in_mig_mode_that_fits_wins_over_a_toggle() -> None:
    node = make_node("n", [make_gpu(H100, 0, [("3g.40gb", 4, 4)]), make_gpu(H100, mig=False)])
    got = place_with_modes(
        snap(node), make_pod(("c", "3g.40gb")), ModeView(flex=frozenset({("n", 1)}))
    )
    assert isinstance(got.result, Placement) and got.toggles == ()
    assert [s.gpu_index for s in got.result.slices] == [0]


def test_flex_gpu_serves_only_when_nothing_else_fits() -> None:
    node = make_node(
        "n", [make_gpu(H100, 0, [("4g.40gb", 0, 4), ("3g.40gb", 4, 4)]), make_gpu(H100, mig=False)]
    )
    got = place_with_modes(
        snap(node), make_pod(("c", "1g.10gb")), ModeView(flex=frozenset({("n", 1)}))
    )
    assert isinstance(got.result, Placement) and got.toggles == (1,)
    plain = place_with_modes(snap(node), make_pod(("c", "1g.10gb")), ModeView())
    assert isinstance(plain.result, Pending) and plain.result.reason is PendingReason.FULL


def test_every_attempt_goes_through_the_given_place_and_modes_are_derived_only_when_needed() -> (
    None
):
    """The allocator hands its own `place` (the fleet index for its own snapshot) and a
    function deriving the mode view: the plain attempt and the flex attempt both go through
    that `place`, and the view is derived only after the plain attempt found nothing."""
    node = make_node(
        "n", [make_gpu(H100, 0, [("4g.40gb", 0, 4), ("3g.40gb", 4, 4)]), make_gpu(H100, mig=False)]
    )
    seen: list[tuple[bool, ...]] = []
    derived: list[Snapshot] = []

    def spy(s: Snapshot, r: PodRequest, p: Policy, c: Catalog | None) -> Placement | Pending:
        seen.append(tuple(g.mig_enabled for n in s.nodes for g in n.gpus))
        return place(s, r, p, c)

    def view(s: Snapshot) -> ModeView:
        derived.append(s)
        return ModeView(flex=frozenset({("n", 1)}))

    toggled = place_with_modes(snap(node), make_pod(("c", "3g.40gb")), view, place=spy)
    assert isinstance(toggled.result, Placement) and toggled.toggles == (1,)
    assert seen == [(True, False), (True, True)] and len(derived) == 1
    seen.clear()
    derived.clear()
    plain = snap(make_node("m", [make_gpu(H100)]))
    got = place_with_modes(plain, make_pod(("c", "1g.10gb")), view, place=spy)
    assert isinstance(got.result, Placement) and seen == [(True,)] and derived == []


def test_ampere_gpus_are_named_and_never_used() -> None:
    nodes = snap(make_node("a", [make_gpu(A100, mig=False), make_gpu(A100, mig=False)]))
    view = ModeView(needs_reset=frozenset({("a", 0), ("a", 1)}))
    got = place_with_modes(nodes, make_pod(("c", "1g.10gb")), view)
    assert isinstance(got.result, Pending)
    assert got.result.reason is PendingReason.NEEDS_MIG_MODE_CHANGE
    assert "a/GPU 0" in got.result.message and "1 more GPU" in got.result.message
    assert "needs a GPU reset" in got.result.message


def test_with_mig_leaves_other_nodes_alone() -> None:
    a, b = make_node("a", [make_gpu(H100, mig=False)]), make_node("b", [make_gpu(H100, mig=False)])
    got = with_mig(snap(a, b), [("a", 0)])
    assert [n.gpus[0].mig_enabled for n in got.nodes] == [True, False]
    assert got.nodes[1] is b


def _gpu(**kw: Any) -> dict[str, Any]:
    base = {
        "migMode": {"current": "disabled", "pending": "disabled"},
        "healthy": True,
        "modeToggle": "resetless",
        "computeProcesses": 0,
    }
    return {**base, **kw}


@pytest.mark.parametrize(
    ("entry", "want"),
    [
        (_gpu(), (True, False)),
        (_gpu(modeToggle="reset"), (False, True)),
        (_gpu(modeToggle="none"), (False, False)),
        (
            {"migMode": {"current": "disabled", "pending": "disabled"}, "healthy": True},
            (False, False),
        ),  # an older agent
        (_gpu(computeProcesses=2), (False, False)),
        (_gpu(healthy=False), (False, False)),
        (_gpu(modeChange={"phase": "Failed"}), (False, False)),
        (_gpu(modeChange={"phase": "Changing"}), (False, False)),
        (_gpu(migMode={"current": "enabled", "pending": "enabled"}), (False, False)),
        (
            _gpu(migMode={"current": "disabled", "pending": "enabled"}, modeToggle="reset"),
            (False, False),
        ),
    ],
)
def test_mode_class(entry: dict[str, Any], want: tuple[bool, bool]) -> None:
    assert mode_class(entry) == want


@st.composite
def mode_cases(draw: st.DrawFn) -> tuple[Snapshot, ModeView]:
    """A random snapshot; some of its MIG-off GPUs are flex (emptied: MIG off holds no
    instance), some need a reset."""
    s = draw(snapshots())
    flex: set[tuple[str, int]] = set()
    reset: set[tuple[str, int]] = set()
    nodes = []
    for n in s.nodes:
        gpus = []
        for g in n.gpus:
            if not g.mig_enabled and g.healthy:
                kind = draw(st.sampled_from(["flex", "reset", "off"]))
                if kind == "flex":
                    flex.add((n.name, g.index))
                elif kind == "reset":
                    reset.add((n.name, g.index))
                g = replace(g, occupied=())
            gpus.append(g)
        nodes.append(replace(n, gpus=tuple(gpus)))
    return Snapshot(tuple(nodes)), ModeView(frozenset(flex), frozenset(reset))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_modes_properties(data: st.DataObject) -> None:
    s, view = data.draw(mode_cases())
    req = data.draw(requests(s))
    got = place_with_modes(s, req, view)
    fits_now = brute_force(s, req, Policy.INSTASLICE)
    fits_flex = brute_force(with_mig(s, view.flex), req, Policy.INSTASLICE)
    fits_reset = brute_force(with_mig(s, view.flex | view.needs_reset), req, Policy.INSTASLICE)
    if fits_now:
        assert isinstance(got.result, Placement) and got.toggles == ()
    elif fits_flex:
        assert isinstance(got.result, Placement) and got.toggles
    if isinstance(got.result, Placement):
        p = got.result
        used = {(p.node, sl.gpu_index) for sl in p.slices}
        assert not used & view.needs_reset
        assert {(p.node, i) for i in got.toggles} == used & view.flex
        assert got.toggles == () or not fits_now
        node = next(n for n in s.nodes if n.name == p.node)
        for sl in p.slices:
            g = node.gpus[sl.gpu_index]
            assert g.usable or (p.node, sl.gpu_index) in view.flex
    else:
        assert not fits_flex
        needs = got.result.reason is PendingReason.NEEDS_MIG_MODE_CHANGE
        assert needs == fits_reset
