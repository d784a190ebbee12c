"""Preemption for size-based asks (common/sizing.py `plan_sized_preemption`): the asks are
resolved on each GPU model as `place_sized` resolves them and planned with `plan_preemption`
on that model's GPUs only; the cheapest plan by the planner's own cost wins, then the least
memory.

Covers, as tables: a size on a full H100 evicts what its resolved profile needs (the same
plan as that profile asked by name); across models the planner's cost decides before memory
(cheaper victims on the model giving more memory win) and memory breaks a tie; a model that
offers no fit is never planned on; a named profile beside a size keeps the plan to models
offering it; on a node with GPUs of two models, one model's profile is never planned on the
other's GPU even where that would be cheaper. As a hypothesis property on random small
fleets of three models: the plan is no costlier than any single model's plan (and exists iff
one does), its slices are one model's resolved profile on that model's GPUs, every victim is
preemptible, and once its victims and the terminating pods it waits for are gone the pod
fits there (its windows legal and free, and `place_sized` places it).
Leaves out: the planner's own choice within a model (test_preempt.py), the placer carrying a
plan out (test_allocator_preempt_sized.py), the API server
(tests/integration/test_allocator_preempt_sized.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from common.catalog import load_catalog
from common.placement import (
    Gpu,
    NodeState,
    Occupied,
    Placement,
    PodRequest,
    Policy,
    SliceRequest,
    Snapshot,
)
from common.placement.modes import ModeView
from common.placement.preempt import Holder, PreemptionPlan, plan_preemption
from common.sizing import Size, SizeAsk, place_sized, plan_sized_preemption, resolve

CAT = load_catalog()
GIB = 1024
H100, H200, A100, A30 = "H100-80GB", "H200-141GB", "A100-80GB", "A30-24GB"

# One instance: (node, gpu index, model, profile, start, holder uid).
Inst = tuple[str, int, str, str, int, str]


def slots(model: str, profile: str) -> int:
    m = CAT.model(model)
    assert m is not None
    return next(p.memory_slots for p in m.profiles if p.name == profile)


def world(
    gpus: Mapping[str, Sequence[str]],
    instances: Iterable[Inst],
    prio: dict[str, int] | None = None,
    preemptor: int = 10,
    doomed: Iterable[str] = (),
) -> tuple[Snapshot, list[Holder]]:
    """Nodes (name → GPU models by index) holding `instances`; one holder per uid, of
    priority `prio[uid]` (0 by default), preemptible below `preemptor`."""
    prio, gone = prio or {}, set(doomed)
    occ: dict[tuple[str, int], list[Occupied]] = {}
    held: dict[str, list[tuple[int, int, int]]] = {}
    node_of: dict[str, str] = {}
    for node, index, model, profile, start, uid in instances:
        size = slots(model, profile)
        occ.setdefault((node, index), []).append(Occupied(start, size, profile))
        held.setdefault(uid, []).append((index, start, size))
        node_of[uid] = node
    nodes = tuple(
        NodeState(
            name,
            pods_free=10,
            gpus=tuple(
                Gpu(i, m, occupied=tuple(occ.get((name, i), ()))) for i, m in enumerate(models)
            ),
        )
        for name, models in gpus.items()
    )
    holders = [
        Holder(
            uid,
            node_of[uid],
            tuple(s),
            prio.get(uid, 0),
            preemptible=prio.get(uid, 0) < preemptor and uid not in gone,
            doomed=uid in gone,
        )
        for uid, s in sorted(held.items())
    ]
    return Snapshot(nodes), holders


def asking(gib: float, count: int = 1, *named: str) -> tuple[PodRequest, list[SizeAsk]]:
    request = PodRequest("ns/hi", slices=tuple(SliceRequest("side", p) for p in named))
    return request, [SizeAsk("main", Size(int(gib * GIB), count=count))]


def planned(snapshot: Snapshot, holders: list[Holder], gib: float, *named: str) -> PreemptionPlan:
    request, asks = asking(gib, 1, *named)
    plan = plan_sized_preemption(snapshot, request, asks, holders, catalog=CAT)
    assert plan is not None
    return plan


def chosen(p: PreemptionPlan) -> list[tuple[str, int, str, int]]:
    return [(p.placement.node, s.gpu_index, s.profile, s.start) for s in p.placement.slices]


def full_of(node: str, index: int, model: str, profile: str, tag: str) -> list[Inst]:
    m = CAT.model(model)
    assert m is not None
    p = next(p for p in m.profiles if p.name == profile)
    return [(node, index, model, profile, s, f"{tag}{s}") for s in p.starts[: p.max_count]]


# --- tables ------------------------------------------------------------------------------------


def test_a_size_on_a_full_h100_plans_as_its_resolved_profile_asked_by_name() -> None:
    snapshot, holders = world({"h": [H100]}, full_of("h", 0, H100, "1g.10gb", "lo"))
    plan = planned(snapshot, holders, 20)  # 1g.20gb is 19.6 GiB: 3g.40gb
    assert {p for _, _, p, _ in chosen(plan)} == {"3g.40gb"}
    by_name = PodRequest("ns/hi", slices=(SliceRequest("main", "3g.40gb"),))
    assert plan == plan_preemption(snapshot, by_name, holders, catalog=CAT)
    assert len(plan.victims) == 3  # slots 4-6: three 1g pods (0-3 would be four)


def test_the_planners_cost_decides_before_memory() -> None:
    """memory>=30Gi: H200 1g.35gb (33280 MiB) is less memory than H100 3g.40gb, but the
    H200's pods are of higher priority (still below the preemptor's)."""
    insts = [("h100", 0, H100, "7g.80gb", 0, "big"), *full_of("h200", 0, H200, "1g.18gb", "s")]
    prio = {u: 5 for *_, u in insts} | {"big": 1}
    snapshot, holders = world({"h100": [H100], "h200": [H200]}, insts, prio)
    plan = planned(snapshot, holders, 30)
    assert [(n, p) for n, _, p, _ in chosen(plan)] == [("h100", "3g.40gb")]
    assert plan.victims == ("big",)


def test_memory_breaks_a_tie_of_cost() -> None:
    """One victim each, of the same priority and start, nothing freed beyond need, both
    GPUs full after: the H200's 1g.35gb (less memory) wins over the H100's 3g.40gb."""
    insts = [
        ("h100", 0, H100, "3g.40gb", 0, "a0"),
        ("h100", 0, H100, "3g.40gb", 4, "a4"),
        *[("h200", 0, H200, "1g.35gb", s, f"b{s}") for s in (0, 2, 4, 6)],
    ]
    snapshot, holders = world({"h100": [H100], "h200": [H200]}, insts)
    plan = planned(snapshot, holders, 30)
    (node, _, profile, _) = chosen(plan)[0]
    assert (node, profile, len(plan.victims)) == ("h200", "1g.35gb", 1)
    h100 = plan_sized_preemption(Snapshot(snapshot.nodes[:1]), *asking(30), holders, catalog=CAT)
    assert h100 is not None and h100.cost == plan.cost  # a tie of the planner's cost


def test_a_model_offering_no_fit_is_never_planned_on() -> None:
    """The A30s hold the only preemptible pods, but offer nothing of >= 30 GiB."""
    insts = [*full_of("a30", 0, A30, "1g.6gb", "lo"), ("h", 0, H100, "7g.80gb", 0, "peer")]
    snapshot, holders = world({"a30": [A30], "h": [H100]}, insts, {"peer": 10})
    request, asks = asking(30)
    assert plan_sized_preemption(snapshot, request, asks, holders, catalog=CAT) is None


def test_a_named_profile_beside_a_size_keeps_the_plan_to_models_offering_it() -> None:
    """`side` asks 1g.10gb by name, which the H200 does not offer: the plan is the H100's,
    with both slices, though the H200's pods are the cheaper victims."""
    insts = full_of("h100", 0, H100, "1g.10gb", "a") + full_of("h200", 0, H200, "1g.18gb", "b")
    prio = {u: 5 if u.startswith("a") else 1 for *_, u in insts}
    snapshot, holders = world({"h100": [H100], "h200": [H200]}, insts, prio)
    plan = planned(snapshot, holders, 30, "1g.10gb")
    assert {(n, p) for n, _, p, _ in chosen(plan)} == {("h100", "3g.40gb"), ("h100", "1g.10gb")}
    assert [s.container for s in plan.placement.slices] == ["side", "main"]


def test_a_models_profile_is_never_planned_on_another_models_gpu_of_the_node() -> None:
    """memory>=19.6Gi: A100-80GB 1g.20gb (19968 MiB) falls short, so 3g.40gb; on the H100,
    1g.20gb (20096 MiB). The H100's low-priority 3g at slot 4 is the cheapest window for a
    3g.40gb, but the A100's resolution belongs on the A100 (whose pods cost more): the plan
    is the H100's own, a 1g.20gb there."""
    insts = [
        *full_of("n", 0, A100, "1g.10gb", "a"),
        ("n", 1, H100, "3g.40gb", 0, "peer"),
        ("n", 1, H100, "3g.40gb", 4, "lo"),
    ]
    prio = {u: 5 for *_, u in insts} | {"peer": 10, "lo": 1}
    snapshot, holders = world({"n": [A100, H100]}, insts, prio)
    plan = planned(snapshot, holders, 19.6)
    assert chosen(plan) in ([("n", 1, "1g.20gb", 4)], [("n", 1, "1g.20gb", 6)])
    assert plan.victims == ("lo",)


def test_terminating_pods_are_waited_for_not_evicted() -> None:
    snapshot, holders = world(
        {"h": [H100]}, full_of("h", 0, H100, "1g.10gb", "lo"), doomed=["lo4", "lo5", "lo6"]
    )
    plan = planned(snapshot, holders, 20)
    assert chosen(plan) == [("h", 0, "3g.40gb", 4)]
    assert plan.victims == () and plan.waits_for == ("lo4", "lo5", "lo6")


# --- the property --------------------------------------------------------------------------------

MODELS = (H100, H200, A100)


@st.composite
def fleets(draw: st.DrawFn) -> tuple[Snapshot, list[Holder]]:
    """1-2 nodes of 1-2 GPUs of the three models (a node may mix them), each GPU filled
    left to right with random plain profiles, each instance its own pod of priority 0-3
    (the preemptor's is 2), some terminating; a few pods hold an instance on each GPU."""
    gpus: dict[str, list[str]] = {}
    insts: list[Inst] = []
    for n in range(draw(st.integers(1, 2))):
        node = f"n{n}"
        gpus[node] = [draw(st.sampled_from(MODELS)) for _ in range(draw(st.integers(1, 2)))]
        for index, model in enumerate(gpus[node]):
            m = CAT.model(model)
            assert m is not None
            plain = [p for p in m.profiles if "+" not in p.name]
            taken, counts = 0, {p.name: 0 for p in plain}
            for start in range(m.memory_slots):
                if taken >> start & 1 or not draw(st.booleans()):
                    continue
                fits = [
                    p
                    for p in plain
                    if start in p.starts
                    and counts[p.name] < p.max_count
                    and not taken & ((1 << p.memory_slots) - 1) << start
                    and start + p.memory_slots <= m.memory_slots
                ]
                if not fits:
                    continue
                p = draw(st.sampled_from(fits))
                counts[p.name] += 1
                taken |= ((1 << p.memory_slots) - 1) << start
                uid = f"{node}-{draw(st.sampled_from(['w', 'x', 'y']))}-{index}-{start}"
                if draw(st.integers(0, 4)) == 0:
                    uid = f"{node}-wide-{start}"  # one pod, instances on several GPUs
                insts.append((node, index, model, p.name, start, uid))
    uids = sorted({u for *_, u in insts})
    prio = {u: draw(st.integers(0, 3)) for u in uids}
    doomed = [u for u in uids if draw(st.integers(0, 6)) == 0]
    return world(gpus, insts, prio, preemptor=2, doomed=doomed)


def only(snapshot: Snapshot, model: str) -> Snapshot:
    nodes = []
    for n in snapshot.nodes:
        gs = tuple(g for g in n.gpus if g.model == model)
        if gs:
            nodes.append(replace(n, gpus=gs))
    return Snapshot(tuple(nodes))


def without(snapshot: Snapshot, holders: list[Holder], gone: set[str]) -> Snapshot:
    """`snapshot` with the instances only `gone` pods hold removed."""
    mine: dict[tuple[str, int, int, int], set[str]] = {}
    for h in holders:
        for index, start, size in h.slices:
            mine.setdefault((h.node, index, start, size), set()).add(h.uid)
    nodes = []
    for n in snapshot.nodes:
        gs = []
        for g in n.gpus:
            keep = tuple(
                o
                for o in g.occupied
                if not mine.get((n.name, g.index, o.start, o.size), {""}) <= gone
            )
            gs.append(replace(g, occupied=keep))
        nodes.append(replace(n, gpus=tuple(gs)))
    return Snapshot(tuple(nodes))


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleets(), st.sampled_from([4, 10, 19.6, 20, 30, 40, 70]), st.integers(1, 2))
def test_the_plan_is_the_cheapest_models_and_fits_once_its_victims_are_gone(
    fleet: tuple[Snapshot, list[Holder]], gib: float, count: int
) -> None:
    snapshot, holders = fleet
    request, asks = asking(gib, count)
    plan = plan_sized_preemption(snapshot, request, asks, holders, catalog=CAT)
    per_model = {}
    for model in MODELS:
        m = CAT.model(model)
        assert m is not None
        profile = resolve(m, asks[0].size)
        if profile is None or not only(snapshot, model).nodes:
            continue
        by_name = replace(request, slices=(SliceRequest("main", profile.name, count),))
        p = plan_preemption(only(snapshot, model), by_name, holders, catalog=CAT)
        if p is not None:
            per_model[model] = p
    event(f"models with a plan: {len(per_model)}")
    if plan is None:
        assert per_model == {}
        return
    assert all(plan.cost <= p.cost for p in per_model.values())
    node = next(n for n in snapshot.nodes if n.name == plan.placement.node)
    models = {node.gpus[s.gpu_index].model for s in plan.placement.slices}
    assert len(models) == 1, plan
    (model,) = models
    profile = resolve(CAT.model(model), asks[0].size)  # type: ignore[arg-type]
    assert profile is not None
    assert [s.profile for s in plan.placement.slices] == [profile.name] * count
    by_uid = {h.uid: h for h in holders}
    assert all(by_uid[v].preemptible and not by_uid[v].doomed for v in plan.victims)
    after = without(snapshot, holders, set(plan.victims) | set(plan.waits_for))
    free = {g.index: g.mask for n in after.nodes if n.name == node.name for g in n.gpus}
    for s in plan.placement.slices:
        window = ((1 << s.size) - 1) << s.start
        assert s.start in profile.starts and s.size == profile.memory_slots
        assert not free[s.gpu_index] & window, (plan, after)
        free[s.gpu_index] |= window
    # the pod fits on the fleet as it is once they are gone (maybe elsewhere, as placed)
    placed = place_sized(after, request, asks, Policy.INSTASLICE, CAT, ModeView()).result
    assert isinstance(placed, Placement), placed
