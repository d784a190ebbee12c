"""Size-based asks and MIG modes (common/sizing.py `place_sized` over
common/placement/modes.py `mode_steps`), and the placer carrying them out.

Covers, as tables: a size ask is placed on a Hopper GPU with MIG off (the agent turns MIG on)
when no GPU in MIG mode fits; a GPU in MIG mode of any model wins over a mode change on
another, even one giving less memory; among models that each need a reset-less change, the
least memory wins; a reset-less change wins over an Ampere reset; only Ampere GPUs with MIG
off give `NeedsMigModeChange` naming the GPUs to reset (of the least-memory model where
several would); a change under way on one model is waited for before a reset is asked on
another; when nothing would do, the most advanced reason of the models tells (the model the
selector picks being full, not the one it leaves out); the mode view function is derived
once per model, on that model's GPUs only, and only after nothing fits in MIG mode. The
placer: a sized pod gets an allocation on a flex GPU; with `--ampere-mode-changes=drain` it
asks the Ampere maintenance for the GPU its placement would use (not while another ask is
in flight: one at a time), without it it waits `NeedsMigModeChange`. As hypothesis
properties on random small fleets with mixed MIG modes: the size ask and the profile
`resolve` picks get the same placement, toggles, resets and pending reason (and message on a
one-model fleet); across several models, a mode change only when no model's GPUs in MIG
mode fit, then a reset-less change only when no such fits, each with the least memory among
the models the engine places on at that attempt.
Leaves out: the grammar and admission (test_sizing_quota.py), the modes engine alone
(test_placement_modes.py), the API server and the node agent
(tests/integration/test_allocator_sized_modes.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from common.catalog import load_catalog
from common.constants import REASON_PENDING, SIZE_ANNOTATION_PREFIX
from common.placement import (
    NodeState,
    Pending,
    PendingReason,
    Placement,
    PodRequest,
    Policy,
    SliceRequest,
    Snapshot,
    place,
)
from common.placement.modes import ModePlacement, ModeView, place_with_modes, with_mig
from common.sizing import Size, SizeAsk, place_sized, resolve
from testkit.builders import GpuSpec, gpu_uuid, make_pod, quiet_placer
from tests.unit.test_allocator_modes import _mig_node, state_with
from tests.unit.test_placement import make_gpu, make_node, snap

CAT = load_catalog()
GIB = 1024
H100, H200, A100, A30 = "H100-80GB", "H200-141GB", "A100-80GB", "A30-24GB"
AMPERE = (A100, A30)
Ref = tuple[str, int]


def sized(s: Snapshot, gib: int, view: ModeView | Callable[[Snapshot], ModeView]) -> ModePlacement:
    """One container `main` asking `memory>=<gib>Gi` on `s`."""
    asks = [SizeAsk("main", Size(gib * GIB))]
    return place_sized(s, PodRequest("ns/p", cpu_millis=1000), asks, Policy.INSTASLICE, CAT, view)


def off(model: str, index: int = 0) -> Any:
    return make_gpu(model, index, mig=False)


def flex(*refs: Ref) -> ModeView:
    return ModeView(flex=frozenset(refs))


def chosen(p: Placement) -> list[tuple[str, int, str]]:
    return [(p.node, s.gpu_index, s.profile) for s in p.slices]


# --- tables ------------------------------------------------------------------------------------


def test_a_hopper_gpu_with_mig_off_serves_a_size_ask_after_a_toggle() -> None:
    got = sized(snap(make_node("h", [off(H100)])), 20, flex(("h", 0)))
    assert isinstance(got.result, Placement), got.result
    assert chosen(got.result) == [("h", 0, "3g.40gb")] and got.toggles == (0,)


def test_a_gpu_in_mig_mode_wins_over_a_toggle_on_a_model_giving_less_memory() -> None:
    # H200's 1g.35gb (33280 MiB) is less memory than H100's 3g.40gb, but the H200 is MIG off
    s = snap(make_node("h200", [off(H200)]), make_node("h100", [make_gpu(H100)]))
    got = sized(s, 20, flex(("h200", 0)))
    assert isinstance(got.result, Placement) and got.toggles == ()
    assert chosen(got.result) == [("h100", 0, "3g.40gb")]


def test_among_toggles_the_least_memory_wins() -> None:
    full = make_gpu(H100, 0, [("7g.80gb", 0, 8)])
    s = snap(make_node("h100", [full, off(H100, 1)]), make_node("h200", [off(H200)]))
    got = sized(s, 20, flex(("h100", 1), ("h200", 0)))
    assert isinstance(got.result, Placement) and got.toggles == (0,)
    assert chosen(got.result) == [("h200", 0, "1g.35gb")]


def test_a_reset_less_toggle_wins_over_an_ampere_reset_giving_less_memory() -> None:
    # A100-80GB's 3g.40gb (40192 MiB) is less than H100's (40448 MiB)
    s = snap(make_node("a", [off(A100)]), make_node("h", [off(H100)]))
    got = sized(s, 20, ModeView(flex=frozenset({("h", 0)}), needs_reset=frozenset({("a", 0)})))
    assert isinstance(got.result, Placement) and got.toggles == (0,) and got.resets == ()
    assert chosen(got.result) == [("h", 0, "3g.40gb")]


def test_only_ampere_gpus_with_mig_off_need_a_reset_named_as_for_a_profile() -> None:
    s = snap(make_node("a", [off(A100), off(A100, 1)]))
    view = ModeView(needs_reset=frozenset({("a", 0), ("a", 1)}))
    got = sized(s, 20, view)
    assert isinstance(got.result, Pending)
    assert got.result.reason is PendingReason.NEEDS_MIG_MODE_CHANGE
    assert got.resets == (("a", 0),)
    profile = place_with_modes(
        s, PodRequest("ns/p", slices=(SliceRequest("main", "3g.40gb"),)), view
    )
    assert got == profile  # the same message too: "a/GPU 0 (1 more GPU(s) in the same state)"


def test_the_reset_asked_is_on_the_model_giving_least_memory() -> None:
    # memory>=10Gi: A30 2g.12gb (11968 MiB) against A100-80GB 1g.20gb (19968 MiB)
    s = snap(make_node("a100", [off(A100)]), make_node("a30", [off(A30)]))
    got = sized(s, 10, ModeView(needs_reset=frozenset({("a100", 0), ("a30", 0)})))
    assert isinstance(got.result, Pending)
    assert got.result.reason is PendingReason.NEEDS_MIG_MODE_CHANGE
    assert got.resets == (("a30", 0),)
    assert "more GPU" not in got.result.message  # the A100 is not counted with the A30s


def test_a_change_under_way_is_waited_for_before_a_reset_on_another_model() -> None:
    # an A100-40GB asked to turn MIG on (shown unhealthy meanwhile); an A100-80GB MIG off
    asked = make_gpu("A100-40GB", 0, mig=False, healthy=False)
    s = snap(make_node("a40", [asked]), make_node("a80", [off(A100)]))
    view = ModeView(needs_reset=frozenset({("a80", 0)}), under_way=frozenset({("a40", 0)}))
    got = sized(s, 20, view)
    assert isinstance(got.result, Pending), got.result
    assert got.result.reason is PendingReason.MIG_MODE_CHANGE_UNDER_WAY
    assert "a40/GPU 0" in got.result.message and got.resets == ()


def test_when_nothing_would_do_the_most_advanced_reason_tells() -> None:
    """The selector picks the H100, which is full: Full, not the reason of the H200 it leaves
    out (NoMatchingNode), though the H200's fit is the least memory."""
    full = make_gpu(H100, 0, [("7g.80gb", 0, 8)])
    s = snap(make_node("h100", [full], labels={"m": "h100"}), make_node("h200", [make_gpu(H200)]))
    req = PodRequest("ns/p", cpu_millis=1000, node_selector={"m": "h100"})
    ask = [SizeAsk("main", Size(20 * GIB))]
    got = place_sized(s, req, ask, Policy.INSTASLICE, CAT, ModeView()).result
    assert isinstance(got, Pending) and got.reason is PendingReason.FULL, got


def test_the_view_is_derived_per_model_on_its_gpus_only_after_nothing_fits() -> None:
    seen: list[set[str]] = []

    def view(s: Snapshot) -> ModeView:
        seen.append({g.model for n in s.nodes for g in n.gpus})
        return flex(("n", 1)) if H100 in seen[-1] else ModeView()

    node = make_node("n", [make_gpu(H100, 0, [("7g.80gb", 0, 8)]), off(H100, 1), off(H200, 2)])
    got = sized(snap(node), 20, view)
    assert isinstance(got.result, Placement) and chosen(got.result) == [("n", 1, "3g.40gb")]
    assert sorted(map(sorted, seen)) == [[H100], [H200]]
    seen.clear()
    fits = sized(snap(make_node("m", [make_gpu(H100)])), 20, view)
    assert isinstance(fits.result, Placement) and seen == []


# --- the placer ------------------------------------------------------------------------------


def sized_pod(name: str, size: str = "memory>=20Gi") -> dict[str, Any]:
    pod = make_pod(name, uid=name, claim=f"c-{name}", slices={})
    pod["metadata"]["annotations"][SIZE_ANNOTATION_PREFIX + "main"] = size
    return pod


def test_the_placer_places_a_sized_pod_on_a_hopper_gpu_with_mig_off() -> None:
    placer = quiet_placer(state_with([GpuSpec(H100, mig=False)]))
    placer.state.upsert_pod(sized_pod("p"))
    track = placer.tracks.ensure("p")
    placer.decide("p")
    assert track.create is not None, track.told
    spec = track.create["spec"]
    assert [(s["gpuUUID"], s["profile"]) for s in spec["slices"]] == [
        (gpu_uuid("n1", 0), "3g.40gb")
    ]


@pytest.mark.parametrize("drain", [True, False])
def test_the_placer_asks_ampere_maintenance_for_a_sized_pod(drain: bool) -> None:
    placer = quiet_placer(state_with([GpuSpec(A100, mig=False), GpuSpec(A100, mig=False)]))
    asked: list[tuple[str, dict[str, str]]] = []
    told: list[tuple[str, str]] = []
    placer.tell = lambda pod, reason, message: told.append((reason, message))
    if drain:
        placer.ampere.ask_modes = lambda node, wants: asked.append((node, wants))
    placer.state.upsert_pod(sized_pod("p"))
    placer.tracks.ensure("p")
    placer.decide("p")
    ((reason, message),) = told
    assert reason == REASON_PENDING
    assert placer.tracks.ensure("p").told == PendingReason.NEEDS_MIG_MODE_CHANGE.value
    if drain:
        assert asked == [("n1", {gpu_uuid("n1", 0): "enabled"})]
        assert "n1/GPU 0: asked for (Ampere maintenance" in message, message
    else:
        assert asked == [] and "needs a GPU reset" in message, message


def test_a_sized_pod_waits_for_the_one_ask_in_flight_before_asking() -> None:
    """One ask in the cluster at a time: GPU 1 is asked to turn MIG off (for a whole GPU);
    the sized pod that needs GPU 0 reset asks nothing and is told it waits."""
    specs = [GpuSpec(A100, mig=False), GpuSpec(A100)]
    state = state_with(specs)
    mig_node = _mig_node("n1", specs)
    mig_node["spec"] = {"gpus": [{"uuid": gpu_uuid("n1", 1), "desiredMigMode": "disabled"}]}
    state.upsert_mig_node(mig_node)
    placer = quiet_placer(state)
    asked: list[tuple[str, dict[str, str]]] = []
    told: list[str] = []
    placer.ampere.ask_modes = lambda node, wants: asked.append((node, wants))
    placer.tell = lambda pod, reason, message: told.append(message)
    placer.state.upsert_pod(sized_pod("p"))
    placer.tracks.ensure("p")
    placer.decide("p")
    assert asked == [] and len(told) == 1
    assert "one is under way on n1/GPU 1 (Ampere maintenance)" in told[0], told


# --- properties --------------------------------------------------------------------------------


@st.composite
def fleets(draw: st.DrawFn, models: tuple[str, ...]) -> tuple[Snapshot, ModeView]:
    """1-3 nodes of 1-2 GPUs, each node of one of `models`; each GPU in MIG mode (empty,
    half or wholly taken), unhealthy, or MIG off: flex (Hopper), a reset away (Ampere),
    under way to MIG on (Ampere, shown unhealthy), or neither (a busy or locked GPU)."""
    nodes: list[NodeState] = []
    kinds: dict[str, set[Ref]] = {"flex": set(), "reset": set(), "under": set()}
    for i in range(draw(st.integers(1, 3))):
        model = draw(st.sampled_from(models))
        slots = CAT.model(model).memory_slots  # type: ignore[union-attr]
        gpus = []
        for k in range(draw(st.integers(1, 2))):
            kind = draw(st.sampled_from(["mig", "mig", "sick", "off", "change", "change", "under"]))
            if kind == "change":
                kind = "reset" if model in AMPERE else "flex"
            if kind == "under" and model not in AMPERE:
                kind = "off"
            kinds.get(kind, set()).add((f"n{i}", k))
            taken = draw(st.sampled_from([0, slots // 2, slots, slots])) if kind == "mig" else 0
            used = [("x", 0, taken)] if taken else []
            mig, healthy = kind in ("mig", "sick"), kind not in ("sick", "under")
            gpus.append(make_gpu(model, k, used, mig=mig, healthy=healthy))
        cpu = draw(st.sampled_from([64_000, 64_000, 500]))
        nodes.append(make_node(f"n{i}", gpus, cpu=cpu))
    view = ModeView(*(frozenset(kinds[k]) for k in ("flex", "reset", "under")))
    return Snapshot(tuple(nodes)), view


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from([H100, A100, H200]),
    st.data(),
    st.integers(24, 78),
    st.sampled_from([0, 0, 30, 60]),
    st.integers(1, 2),
)
def test_a_size_ask_is_placed_as_the_profile_it_resolves_to(
    model: str, data: st.DataObject, gib: int, sm: int, count: int
) -> None:
    """A fleet of `model` (and some A30s, which offer no slice of >= 24 GiB): the size ask
    gets what its resolved profile asked by name gets, mode changes and reasons included."""
    s, view = data.draw(fleets((model, model, model, A30)))
    size = Size(gib * GIB, sm, count)
    got = place_sized(
        s,
        PodRequest("ns/p", cpu_millis=1000),
        [SizeAsk("main", size)],
        Policy.INSTASLICE,
        CAT,
        view,
    )
    profile = resolve(CAT.model(model), size)  # type: ignore[arg-type]
    if profile is None or not any(g.model == model for n in s.nodes for g in n.gpus):
        assert isinstance(got.result, Pending) and got.result.reason is PendingReason.NO_PROFILE
        return
    by_name = PodRequest(
        "ns/p", cpu_millis=1000, slices=(SliceRequest("main", profile.name, count),)
    )
    want = place_with_modes(s, by_name, view, Policy.INSTASLICE, CAT)
    event(_kind(want))
    assert (got.toggles, got.resets) == (want.toggles, want.resets), (got, want)
    if isinstance(want.result, Placement):
        assert got.result == want.result
    else:
        assert isinstance(got.result, Pending) and got.result.reason is want.result.reason
        if all(g.model == model for n in s.nodes for g in n.gpus):
            assert got.result.message == want.result.message


def _kind(m: ModePlacement) -> str:
    if isinstance(m.result, Placement):
        return "toggled" if m.toggles else "placed"
    return m.result.reason.value


def _memory(s: Snapshot, p: Placement, size: Size) -> int:
    node = next(n for n in s.nodes if n.name == p.node)
    profile = resolve(CAT.model(node.gpus[0].model), size)  # type: ignore[arg-type]
    assert profile is not None
    return profile.memory_mib


def _fitting(s: Snapshot, size: Size, shown: frozenset[Ref]) -> list[int]:
    """The memory of each model whose GPUs alone (with `shown` in MIG mode) take the ask."""
    out = []
    for model in sorted({g.model for n in s.nodes for g in n.gpus}):
        profile = resolve(CAT.model(model), size)  # type: ignore[arg-type]
        if profile is None:
            continue
        sub = Snapshot(tuple(n for n in with_mig(s, shown).nodes if n.gpus[0].model == model))
        req = PodRequest("ns/p", cpu_millis=1000, slices=(SliceRequest("main", profile.name),))
        if isinstance(place(sub, req, Policy.INSTASLICE, CAT), Placement):
            out.append(profile.memory_mib)
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.integers(4, 70))
def test_across_models_mig_mode_first_then_toggles_each_with_the_least_memory(
    data: st.DataObject, gib: int
) -> None:
    s, view = data.draw(fleets((H100, H200, A100, A30)))
    size = Size(gib * GIB)
    got = sized(s, gib, view)
    event(_kind(got))
    now, toggled = _fitting(s, size, frozenset()), _fitting(s, size, view.flex)
    if now:
        assert isinstance(got.result, Placement) and got.toggles == ()
        assert _memory(s, got.result, size) == min(now)
    elif toggled:
        assert isinstance(got.result, Placement) and got.toggles
        assert _memory(s, got.result, size) == min(toggled)
    else:
        assert isinstance(got.result, Pending)
    if isinstance(got.result, Placement):
        used = {(got.result.node, sl.gpu_index) for sl in got.result.slices}
        assert not used & (view.needs_reset | view.under_way)
        assert {(got.result.node, i) for i in got.toggles} == used & view.flex
    if got.resets:
        assert isinstance(got.result, Pending)
        assert got.result.reason is PendingReason.NEEDS_MIG_MODE_CHANGE
        assert set(got.resets) <= view.needs_reset
        assert _fitting(s, size, view.flex | view.needs_reset)
