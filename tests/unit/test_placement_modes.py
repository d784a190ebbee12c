"""Placement with MIG modes (common/placement/modes.py) and the allocator's mode classes.

Covers, as tables: a GPU in MIG mode that fits is chosen over a GPU whose mode would change;
only when none fits does a flex GPU serve, and the toggled GPU is reported; GPUs that need a
reset (Ampere) are never placed on, and when they alone would fit the reason is
NeedsMigModeChange naming them; a pod that would fit once a change under way (Ampere
maintenance) is done waits MigModeChangeUnderWay naming those GPUs, before any reset; the
MigNode → class derivation (views.mode_class). As hypothesis properties on random
snapshots, against the brute-force oracle of test_placement_properties.py: no toggle when a
GPU in the right mode fits; a toggle only on a flex GPU and only when nothing fits without
one; never a slice on a GPU needing a reset or under way; MigModeChangeUnderWay exactly when
the changes under way would serve it, or would together with resets while no reset alone
would, else NeedsMigModeChange exactly when only GPUs needing a reset would.
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
    NodeState,
    Pending,
    PendingReason,
    Placement,
    PodRequest,
    Policy,
    Snapshot,
    place,
)
from common.placement.modes import ModeView, place_with_modes, with_mig
from testkit.builders import pod_request
from tests.unit.test_placement import make_gpu, make_node, snap
from tests.unit.test_placement_properties import brute_force, requests, snapshots
from webhook.allocator.views import mode_class

H100 = "H100-80GB"
A100 = "A100-80GB"


def test_gpu_in_mig_mode_that_fits_wins_over_a_toggle() -> None:
    node = make_node("n", [make_gpu(H100, 0, [("3g.40gb", 4, 4)]), make_gpu(H100, mig=False)])
    got = place_with_modes(
        snap(node), pod_request(("c", "3g.40gb")), ModeView(flex=frozenset({("n", 1)}))
    )
    assert isinstance(got.result, Placement) and got.toggles == ()
    assert [s.gpu_index for s in got.result.slices] == [0]


def test_flex_gpu_serves_only_when_nothing_else_fits() -> None:
    node = make_node(
        "n", [make_gpu(H100, 0, [("4g.40gb", 0, 4), ("3g.40gb", 4, 4)]), make_gpu(H100, mig=False)]
    )
    got = place_with_modes(
        snap(node), pod_request(("c", "1g.10gb")), ModeView(flex=frozenset({("n", 1)}))
    )
    assert isinstance(got.result, Placement) and got.toggles == (1,)
    plain = place_with_modes(snap(node), pod_request(("c", "1g.10gb")), ModeView())
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

    toggled = place_with_modes(snap(node), pod_request(("c", "3g.40gb")), view, place=spy)
    assert isinstance(toggled.result, Placement) and toggled.toggles == (1,)
    assert seen == [(True, False), (True, True)] and len(derived) == 1
    seen.clear()
    derived.clear()
    plain = snap(make_node("m", [make_gpu(H100)]))
    got = place_with_modes(plain, pod_request(("c", "1g.10gb")), view, place=spy)
    assert isinstance(got.result, Placement) and seen == [(True,)] and derived == []


def test_ampere_gpus_are_named_and_never_used() -> None:
    nodes = snap(make_node("a", [make_gpu(A100, mig=False), make_gpu(A100, mig=False)]))
    view = ModeView(needs_reset=frozenset({("a", 0), ("a", 1)}))
    got = place_with_modes(nodes, pod_request(("c", "1g.10gb")), view)
    assert isinstance(got.result, Pending)
    assert got.result.reason is PendingReason.NEEDS_MIG_MODE_CHANGE
    assert "a/GPU 0" in got.result.message and "1 more GPU" in got.result.message
    assert "needs a GPU reset" in got.result.message


# An Ampere node: GPU 0 asked to turn MIG on (shown unhealthy meanwhile), GPU 1 MIG off too.
UNDER_WAY = make_node(
    "a", [make_gpu(A100, 0, mig=False, healthy=False), make_gpu(A100, 1, mig=False)]
)


@pytest.mark.parametrize(
    ("nodes", "view", "pod", "reason", "names"),
    [
        # the asking pod (or another one like it): it fits once the change is done
        (
            [UNDER_WAY],
            ModeView(needs_reset=frozenset({("a", 1)}), under_way=frozenset({("a", 0)})),
            pod_request(("c", "1g.10gb")),
            PendingReason.MIG_MODE_CHANGE_UNDER_WAY,
            "a/GPU 0 is done (MIG on",
        ),
        # it waits for the change under way, not for a new reset, even with none left
        (
            [UNDER_WAY],
            ModeView(under_way=frozenset({("a", 0)})),
            pod_request(("c", "7g.80gb")),
            PendingReason.MIG_MODE_CHANGE_UNDER_WAY,
            "under way on a/GPU 0 is done",
        ),
        # too big for the GPU under way: not waiting for it
        (
            [UNDER_WAY],
            ModeView(under_way=frozenset({("a", 0)})),
            pod_request(("c", "7g.80gb", 2)),
            PendingReason.GPU_UNAVAILABLE,
            "",
        ),
        # it needs GPU 0 under way and GPU 1 a reset away: it waits for the change under
        # way, naming the reset after (the older answer was GpuUnavailable)
        (
            [UNDER_WAY],
            ModeView(needs_reset=frozenset({("a", 1)}), under_way=frozenset({("a", 0)})),
            pod_request(("c", "7g.80gb", 2)),
            PendingReason.MIG_MODE_CHANGE_UNDER_WAY,
            "under way on a/GPU 0 is done (MIG on; Ampere maintenance: the GPU takes nothing "
            "new while its node agent drains and resets it), and then a MIG mode change on "
            "a/GPU 1 too (MIG on), which needs a GPU reset",
        ),
        # the same with a flex GPU it may toggle: still the wait, named alone
        (
            [UNDER_WAY, make_node("h", [make_gpu(H100, mig=False)])],
            ModeView(
                flex=frozenset({("h", 0)}),
                needs_reset=frozenset({("a", 1)}),
                under_way=frozenset({("a", 0)}),
            ),
            pod_request(("c", "7g.80gb", 2)),
            PendingReason.MIG_MODE_CHANGE_UNDER_WAY,
            "a/GPU 0 is done",
        ),
        # a reset elsewhere would serve it, the change under way would not: a reset it is
        (
            [replace(UNDER_WAY, cpu_millis_free=1000), make_node("b", [make_gpu(A100, mig=False)])],
            ModeView(needs_reset=frozenset({("b", 0)}), under_way=frozenset({("a", 0)})),
            pod_request(("c", "1g.10gb"), cpu=4000),
            PendingReason.NEEDS_MIG_MODE_CHANGE,
            "b/GPU 0",
        ),
    ],
)
def test_a_pod_that_fits_once_a_change_under_way_is_done_waits_for_it(
    nodes: list[NodeState], view: ModeView, pod: PodRequest, reason: PendingReason, names: str
) -> None:
    got = place_with_modes(snap(*nodes), pod, view)
    assert isinstance(got.result, Pending) and got.result.reason is reason, got.result
    assert names in got.result.message and got.resets == (
        (("b", 0),) if reason is PendingReason.NEEDS_MIG_MODE_CHANGE else ()
    )


def test_a_pod_that_fits_now_is_placed_while_a_change_is_under_way() -> None:
    free = make_node("h", [make_gpu(H100)])
    view = ModeView(under_way=frozenset({("a", 0)}))
    got = place_with_modes(snap(UNDER_WAY, free), pod_request(("c", "1g.10gb")), view)
    assert isinstance(got.result, Placement) and got.result.node == "h"


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
    instance), some need a reset, some are asked to turn MIG on (shown unhealthy)."""
    s = draw(snapshots())
    kinds: dict[str, set[tuple[str, int]]] = {"flex": set(), "reset": set(), "under": set()}
    nodes = []
    for n in s.nodes:
        gpus = []
        for g in n.gpus:
            # a quarter more of the GPUs with MIG off: snapshots() makes a tenth so
            if g.healthy and (not g.mig_enabled or draw(st.integers(0, 3)) == 0):
                kind = draw(st.sampled_from(["flex", "reset", "under", "off"]))
                kinds.get(kind, set()).add((n.name, g.index))
                g = replace(g, mig_enabled=False, occupied=(), healthy=kind != "under")
            gpus.append(g)
        nodes.append(replace(n, gpus=tuple(gpus)))
    view = ModeView(*(frozenset(kinds[k]) for k in ("flex", "reset", "under")))
    return Snapshot(tuple(nodes)), view


def once_done(s: Snapshot, gpus: frozenset[tuple[str, int]]) -> Snapshot:
    """`s` with the changes under way on `gpus` done: healthy, in MIG mode."""
    nodes = []
    for n in s.nodes:
        done = [
            replace(g, mig_enabled=True, healthy=True) if (n.name, g.index) in gpus else g
            for g in n.gpus
        ]
        nodes.append(replace(n, gpus=tuple(done)))
    return Snapshot(tuple(nodes))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_modes_properties(data: st.DataObject) -> None:
    s, view = data.draw(mode_cases())
    req = data.draw(requests(s))
    got = place_with_modes(s, req, view)
    fits_now = brute_force(s, req, Policy.INSTASLICE)
    fits_flex = brute_force(with_mig(s, view.flex), req, Policy.INSTASLICE)
    fits_reset = brute_force(with_mig(s, view.flex | view.needs_reset), req, Policy.INSTASLICE)
    fits_under = brute_force(
        once_done(with_mig(s, view.flex), view.under_way), req, Policy.INSTASLICE
    )
    if fits_now:
        assert isinstance(got.result, Placement) and got.toggles == ()
    elif fits_flex:
        assert isinstance(got.result, Placement) and got.toggles
    if isinstance(got.result, Placement):
        p = got.result
        used = {(p.node, sl.gpu_index) for sl in p.slices}
        assert not used & (view.needs_reset | view.under_way)
        assert {(p.node, i) for i in got.toggles} == used & view.flex
        assert got.toggles == () or not fits_now
        node = next(n for n in s.nodes if n.name == p.node)
        for sl in p.slices:
            g = node.gpus[sl.gpu_index]
            assert g.usable or (p.node, sl.gpu_index) in view.flex
    else:
        assert not fits_flex
        fits_both = brute_force(  # the changes under way done and the resets too
            once_done(with_mig(s, view.flex | view.needs_reset), view.under_way),
            req,
            Policy.INSTASLICE,
        )
        under = got.result.reason is PendingReason.MIG_MODE_CHANGE_UNDER_WAY
        assert under == (fits_under or (fits_both and not fits_reset))
        needs = got.result.reason is PendingReason.NEEDS_MIG_MODE_CHANGE
        assert needs == (fits_reset and not fits_under)


@st.composite
def ampere_cases(draw: st.DrawFn) -> tuple[Snapshot, ModeView, PodRequest]:
    """Ampere nodes whose GPUs are in MIG mode (some holding a slice), MIG off a reset away,
    or under way to MIG on (shown unhealthy); pods of several large slices, so that a pod
    needing both a GPU under way and a reset is common."""
    nodes, reset, under = [], set(), set()
    for i in range(draw(st.integers(1, 2))):
        gpus = []
        for k in range(draw(st.integers(1, 4))):
            kind = draw(st.sampled_from(["mig", "used", "reset", "under"]))
            if kind == "reset":
                reset.add((f"n{i}", k))
            if kind == "under":
                under.add((f"n{i}", k))
            used = [("3g.40gb", 0, 4)] if kind == "used" else []
            gpus.append(
                make_gpu(A100, k, used, mig=kind in ("mig", "used"), healthy=kind != "under")
            )
        nodes.append(make_node(f"n{i}", gpus))
    profile = draw(st.sampled_from(["7g.80gb", "4g.40gb", "3g.40gb"]))
    pod = pod_request(("c", profile, draw(st.integers(1, 4))))
    return snap(*nodes), ModeView(needs_reset=frozenset(reset), under_way=frozenset(under)), pod


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ampere_cases())
def test_changes_under_way_and_resets_together(case: tuple[Snapshot, ModeView, PodRequest]) -> None:
    """MigModeChangeUnderWay exactly when the changes under way alone would serve the pod, or
    would together with resets while resets alone would not; NeedsMigModeChange exactly when
    resets alone would (and the changes under way alone would not)."""
    s, view, req = case
    got = place_with_modes(s, req, view)
    if isinstance(got.result, Placement):
        assert brute_force(s, req, Policy.INSTASLICE)
        return
    fits_under = brute_force(once_done(s, view.under_way), req, Policy.INSTASLICE)
    fits_reset = brute_force(with_mig(s, view.needs_reset), req, Policy.INSTASLICE)
    fits_both = brute_force(
        once_done(with_mig(s, view.needs_reset), view.under_way), req, Policy.INSTASLICE
    )
    under = got.result.reason is PendingReason.MIG_MODE_CHANGE_UNDER_WAY
    assert under == (fits_under or (fits_both and not fits_reset)), got.result
    needs = got.result.reason is PendingReason.NEEDS_MIG_MODE_CHANGE
    assert needs == (fits_reset and not fits_under), got.result
    if under and not fits_under:
        assert "which needs a GPU reset" in got.result.message
