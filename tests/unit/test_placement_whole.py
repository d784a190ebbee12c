"""Whole-GPU placement (common/placement/whole.py) and the allocator's whole-GPU classes.

Covers, as tables: GPUs already with MIG off win over GPUs whose MIG would be turned off (no
needless toggle); a toggle only when the right-mode GPUs do not suffice; all of a pod's GPUs on
one node, one per asked GPU, each spanning all memory slots; selectors and node resources
respected; GPUs needing a reset are never chosen and named in NeedsMigModeChange; a pod that
GPUs whose change to MIG off is under way would serve waits for them (MigModeChangeUnderWay,
naming them); the MigNode → class derivation (views.whole_class). As hypothesis properties on
random small clusters: every chosen GPU is in the view and healthy (so never one holding a MIG
slice or another whole GPU, which the caller keeps out of the view); the count is exact; the
number of toggles is the least any eligible node needs (a brute-force minimum);
MigModeChangeUnderWay exactly when GPUs under way would complete an eligible node, or would
together with GPUs needing a reset while no reset alone would, else NeedsMigModeChange
exactly when only reset GPUs would complete a node.
Leaves out: the agent's side (tests/integration/test_nodeagent_modes.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.placement import (
    Gpu,
    NodeState,
    Pending,
    PendingReason,
    Placement,
    PodRequest,
    SliceRequest,
    Snapshot,
)
from common.placement.whole import WholeView, is_whole, place_whole, wanted
from testkit.builders import pod_request
from tests.unit.test_placement import make_gpu, make_node, snap
from webhook.allocator.views import whole_class

H100 = "H100-80GB"
A100 = "A100-80GB"


def whole_pod(n: int = 1, **kw: Any) -> PodRequest:
    return pod_request(("main", "gpu", n), **kw)


def test_right_mode_gpus_win_over_a_toggle() -> None:
    a = make_node("a", [make_gpu(H100, mig=False), make_gpu(H100)])
    b = make_node("b", [make_gpu(H100, mig=False), make_gpu(H100, mig=False)])
    view = WholeView(
        right_mode=frozenset({("a", 0), ("b", 0), ("b", 1)}), toggle=frozenset({("a", 1)})
    )
    got = place_whole(snap(a, b), whole_pod(2), view)
    assert isinstance(got.result, Placement) and got.result.node == "b" and got.toggles == ()
    assert [(s.gpu_index, s.start, s.size, s.profile) for s in got.result.slices] == [
        (0, 0, 8, "gpu"),
        (1, 0, 8, "gpu"),
    ]
    one = place_whole(snap(a, b), whole_pod(1), view)
    assert isinstance(one.result, Placement) and one.toggles == ()
    assert one.result.node == "a"  # tightest fit: b's two MIG-off GPUs stay together


def test_toggle_only_when_right_mode_gpus_do_not_suffice() -> None:
    a = make_node("a", [make_gpu(H100, mig=False), make_gpu(H100)])
    view = WholeView(right_mode=frozenset({("a", 0)}), toggle=frozenset({("a", 1)}))
    got = place_whole(snap(a), whole_pod(2), view)
    assert isinstance(got.result, Placement) and got.toggles == (1,)
    full = place_whole(snap(a), whole_pod(3), view)
    assert isinstance(full.result, Pending) and full.result.reason is PendingReason.FULL


def test_selectors_and_node_resources() -> None:
    a = make_node("a", [make_gpu(H100, mig=False)], labels={"zone": "x"}, cpu=500)
    view = WholeView(right_mode=frozenset({("a", 0)}))
    short = place_whole(snap(a), whole_pod(1, cpu=1000), view)
    assert isinstance(short.result, Pending)
    assert short.result.reason is PendingReason.NODE_RESOURCES
    other = place_whole(snap(a), whole_pod(1, cpu=100, selector={"zone": "y"}), view)
    assert isinstance(other.result, Pending)
    assert other.result.reason is PendingReason.NO_MATCHING_NODE


def test_ampere_gpus_in_mig_mode_are_named_and_never_used() -> None:
    a = make_node("amp", [make_gpu(A100), make_gpu(A100)])
    view = WholeView(needs_reset=frozenset({("amp", 0), ("amp", 1)}))
    got = place_whole(snap(a), whole_pod(1), view)
    assert isinstance(got.result, Pending)
    assert got.result.reason is PendingReason.NEEDS_MIG_MODE_CHANGE
    assert "amp/GPU 0" in got.result.message and "reset" in got.result.message
    assert got.resets == (("amp", 0),)  # what Ampere maintenance would ask for: one GPU
    two = place_whole(snap(a), whole_pod(2), view)
    assert two.resets == (("amp", 0), ("amp", 1))


def test_a_pod_waits_for_the_change_to_mig_off_under_way() -> None:
    # GPU 0: asked to turn MIG off (shown unhealthy meanwhile); GPU 1: MIG on, a reset away
    a = make_node("amp", [make_gpu(A100, 0, healthy=False), make_gpu(A100, 1)], cpu=2000)
    view = WholeView(needs_reset=frozenset({("amp", 1)}), under_way=frozenset({("amp", 0)}))
    got = place_whole(snap(a), whole_pod(1), view)
    assert isinstance(got.result, Pending), got.result
    assert got.result.reason is PendingReason.MIG_MODE_CHANGE_UNDER_WAY
    want = "1 whole GPU fit once the MIG mode change under way on amp/GPU 0 is done (MIG off"
    assert want in got.result.message, got.result.message
    assert got.resets == ()  # nothing new is asked
    short = place_whole(snap(a), whole_pod(1, cpu=4000), view)  # it would not fit there
    assert isinstance(short.result, Pending)
    assert short.result.reason is PendingReason.NEEDS_MIG_MODE_CHANGE


@pytest.mark.parametrize(
    ("gpus", "view", "n", "reason", "says"),
    [
        # GPU 0 under way, GPU 1 a reset away: 2 whole GPUs need both, the change under way
        # first (the older answer was Full)
        (
            [make_gpu(A100, 0, healthy=False), make_gpu(A100, 1)],
            WholeView(needs_reset=frozenset({("amp", 1)}), under_way=frozenset({("amp", 0)})),
            2,
            PendingReason.MIG_MODE_CHANGE_UNDER_WAY,
            "under way on amp/GPU 0 is done (MIG off; Ampere maintenance: the GPU takes nothing "
            "new while its node agent drains and resets it), and then a MIG mode change on "
            "amp/GPU 1 too",
        ),
        # two under way, one reset, three asked: all three named
        (
            [make_gpu(A100, 0, healthy=False), make_gpu(A100, 1, healthy=False), make_gpu(A100, 2)],
            WholeView(
                needs_reset=frozenset({("amp", 2)}),
                under_way=frozenset({("amp", 0), ("amp", 1)}),
            ),
            3,
            PendingReason.MIG_MODE_CHANGE_UNDER_WAY,
            "under way on amp/GPU 0, amp/GPU 1 is done (MIG off; Ampere maintenance: the GPU "
            "takes nothing new while its node agent drains and resets it), and then a MIG mode "
            "change on amp/GPU 2 too",
        ),
        # a right-mode GPU, one under way, one a reset away: three fit after both
        (
            [make_gpu(A100, 0, mig=False), make_gpu(A100, 1, healthy=False), make_gpu(A100, 2)],
            WholeView(
                right_mode=frozenset({("amp", 0)}),
                needs_reset=frozenset({("amp", 2)}),
                under_way=frozenset({("amp", 1)}),
            ),
            3,
            PendingReason.MIG_MODE_CHANGE_UNDER_WAY,
            "amp/GPU 1 is done",
        ),
        # resets alone would do (two reset GPUs): a new reset is named, not the wait
        (
            [make_gpu(A100, 0, healthy=False), make_gpu(A100, 1), make_gpu(A100, 2)],
            WholeView(
                needs_reset=frozenset({("amp", 1), ("amp", 2)}),
                under_way=frozenset({("amp", 0)}),
            ),
            2,
            PendingReason.NEEDS_MIG_MODE_CHANGE,
            "amp/GPU 1",
        ),
        # even together not enough: Full
        (
            [make_gpu(A100, 0, healthy=False), make_gpu(A100, 1)],
            WholeView(needs_reset=frozenset({("amp", 1)}), under_way=frozenset({("amp", 0)})),
            3,
            PendingReason.FULL,
            "no node has 3 whole GPUs free",
        ),
    ],
)
def test_a_pod_needing_a_change_under_way_and_a_reset_waits_for_the_change(
    gpus: list[Gpu], view: WholeView, n: int, reason: PendingReason, says: str
) -> None:
    got = place_whole(snap(make_node("amp", gpus, cpu=2000)), whole_pod(n), view)
    assert isinstance(got.result, Pending), got.result
    assert got.result.reason is reason, got.result
    assert says in got.result.message, got.result.message
    if reason is PendingReason.MIG_MODE_CHANGE_UNDER_WAY:
        assert got.resets == ()  # nothing new asked while one is under way


def test_is_whole_and_wanted() -> None:
    assert is_whole(whole_pod(3)) and wanted(whole_pod(3)) == 3
    assert not is_whole(pod_request(("c", "1g.10gb")))


def _gpu(**kw: Any) -> dict[str, Any]:
    base = {
        "migMode": {"current": "disabled", "pending": "disabled"},
        "healthy": True,
        "modeToggle": "resetless",
        "computeProcesses": 0,
    }
    return {**base, **kw}


ON = {"current": "enabled", "pending": "enabled"}


@pytest.mark.parametrize(
    ("entry", "want"),
    [
        (_gpu(), (True, False, False)),
        (_gpu(modeToggle="reset"), (True, False, False)),  # Ampere with MIG off: as it is
        (_gpu(migMode=ON), (False, True, False)),
        (_gpu(migMode=ON, modeToggle="reset"), (False, False, True)),
        (_gpu(migMode=ON, modeToggle="none"), (False, False, False)),
        (_gpu(computeProcesses=1), (False, False, False)),
        (_gpu(healthy=False), (False, False, False)),
        (_gpu(modeChange={"phase": "Failed"}), (False, False, False)),
        (_gpu(migMode={"current": "enabled", "pending": "disabled"}), (False, False, False)),
    ],
)
def test_whole_class(entry: dict[str, Any], want: tuple[bool, bool, bool]) -> None:
    assert whole_class(entry) == want


@st.composite
def cases(draw: st.DrawFn) -> tuple[Snapshot, WholeView, PodRequest]:
    nodes = []
    now: set[tuple[str, int]] = set()
    tog: set[tuple[str, int]] = set()
    rst: set[tuple[str, int]] = set()
    und: set[tuple[str, int]] = set()
    for i in range(draw(st.integers(1, 3))):
        name = f"n{i}"
        gpus = []
        for k in range(draw(st.integers(1, 4))):
            kind = draw(st.sampled_from(["now", "toggle", "reset", "under", "busy", "sick"]))
            gpus.append(Gpu(k, H100, kind in ("toggle", "reset"), kind not in ("sick", "under")))
            {"now": now, "toggle": tog, "reset": rst, "under": und}.get(kind, set()).add((name, k))
        cpu = draw(st.sampled_from([0, 8000]))
        nodes.append(NodeState(name, {"zone": draw(st.sampled_from("ab"))}, (), False, cpu,
                               1 << 36, 10, tuple(gpus)))  # fmt: skip
    n = draw(st.integers(1, 4))
    selector = {"zone": "a"} if draw(st.booleans()) else {}
    req = PodRequest("p", 1000, 0, (SliceRequest("main", "gpu", n),), selector)
    view = WholeView(*(frozenset(refs) for refs in (now, tog, rst, und)))
    return Snapshot(tuple(nodes)), view, req


@settings(max_examples=400, deadline=None)
@given(cases())
def test_whole_properties(case: tuple[Snapshot, WholeView, PodRequest]) -> None:
    s, view, req = case
    n = wanted(req)
    got = place_whole(s, req, view)
    eligible = [
        node
        for node in s.nodes
        if all(node.labels.get(k) == v for k, v in req.node_selector.items())
        and node.cpu_millis_free >= req.cpu_millis
    ]

    def count(node: NodeState, refs: frozenset[tuple[str, int]]) -> int:
        return sum(1 for g in node.gpus if (node.name, g.index) in refs)

    need = [
        max(0, n - count(node, view.right_mode))
        for node in eligible
        if count(node, view.right_mode) + count(node, view.toggle) >= n
    ]
    if isinstance(got.result, Placement):
        p = got.result
        used = [(p.node, sl.gpu_index) for sl in p.slices]
        assert len(used) == len(set(used)) == n
        assert set(used) <= view.right_mode | view.toggle
        assert {(p.node, i) for i in got.toggles} == set(used) & view.toggle
        assert need and len(got.toggles) == min(need)  # the fewest toggles any node needs
        assert all(sl.start == 0 and sl.size == 8 for sl in p.slices)
    else:
        assert not need
        under = [
            node
            for node in eligible
            if count(node, view.right_mode) + count(node, view.toggle)
            < n
            <= count(node, view.right_mode) + count(node, view.toggle) + count(node, view.under_way)
        ]
        have = {
            node.name: count(node, view.right_mode) + count(node, view.toggle) for node in eligible
        }
        resets = [  # a reset alone completes it: NeedsMigModeChange comes first
            node
            for node in eligible
            if have[node.name] < n <= have[node.name] + count(node, view.needs_reset)
        ]
        mixed = [  # the change under way and a reset together complete it
            node
            for node in eligible
            if count(node, view.under_way)
            and n <= have[node.name] + count(node, view.under_way) + count(node, view.needs_reset)
        ]
        waits = got.result.reason is PendingReason.MIG_MODE_CHANGE_UNDER_WAY
        assert waits == (bool(under) or (bool(mixed) and not resets))
        with_reset = [
            node
            for node in s.nodes
            if all(node.labels.get(k) == v for k, v in req.node_selector.items())
            and count(node, view.right_mode) + count(node, view.toggle)
            < n
            <= count(node, view.right_mode)
            + count(node, view.toggle)
            + count(node, view.needs_reset)
        ]
        fits_but_short = any(
            count(node, view.right_mode) + count(node, view.toggle) >= n
            for node in s.nodes
            if all(node.labels.get(k) == v for k, v in req.node_selector.items())
        )
        if not fits_but_short and not under and not (mixed and not resets):
            reset = got.result.reason is PendingReason.NEEDS_MIG_MODE_CHANGE
            assert reset == bool(with_reset)


def test_sick_gpu_in_the_view_is_never_chosen() -> None:
    a = make_node("a", [replace(make_gpu(H100, mig=False), healthy=False)])
    got = place_whole(snap(a), whole_pod(1), WholeView(right_mode=frozenset({("a", 0)})))
    assert isinstance(got.result, Pending)
