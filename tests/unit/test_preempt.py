"""The preemption planner (common/placement/preempt.py): table cases for each cost term and
rule, the pod's cpu / memory / pod slot on the node once its victims are gone, and a
hypothesis property against a brute force over every victim subset on small clusters (≤ 2
nodes x 2 GPUs), which also checks that a plan's node fits the pod's cpu, memory and pod slot
after its victims leave. Not covered here: how the allocator evicts (integration)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from itertools import combinations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from common.catalog import load_catalog
from common.placement import Gpu, NodeState, Occupied, Placement, PodRequest, SliceRequest, Snapshot
from common.placement.engine import place
from common.placement.preempt import Frees, Holder, PreemptionPlan, plan_preemption, victim_cost

H100 = "H100-80GB"
SIZE = {p.name: p.memory_slots for p in load_catalog().model(H100).profiles}  # type: ignore[union-attr]
STARTS = {p.name: p.starts for p in load_catalog().model(H100).profiles}  # type: ignore[union-attr]


NAMES: dict[tuple[str, int, int], str] = {}  # (node, gpu, start) → profile, for `cluster`


def pod(uid: str, node: str, *slices: tuple[int, str, int], prio: int = 0, **kw: object) -> Holder:
    """A holder; `slices`: (gpu index, profile, start)."""
    for g, p, s in slices:
        NAMES[(node, g, s)] = p
    return Holder(uid, node, tuple((g, s, SIZE[p]) for g, p, s in slices), prio, **kw)  # type: ignore[arg-type]


GIB = 1 << 30
PLENTY = Frees(64_000, 256 * GIB, 10)  # a node's free cpu/memory/pods unless a test says


def cluster(
    holders: Iterable[Holder],
    gpus: Mapping[str, int],
    foreign: Iterable[tuple[str, int, str, int]] = (),
    free: Mapping[str, Frees] | None = None,
) -> Snapshot:
    """Nodes named in `gpus` (name → GPU count) whose occupancy is the holders' slices plus
    `foreign` (node, gpu, profile, start) instances; `free`: a node's free cpu/memory/pods
    (PLENTY otherwise)."""
    occ: dict[tuple[str, int], list[Occupied]] = {}
    for h in holders:
        for g, start, size in h.slices:
            profile = NAMES[(h.node, g, start)]
            occ.setdefault((h.node, g), []).append(Occupied(start, size, profile))
    for node, g, profile, start in foreign:
        occ.setdefault((node, g), []).append(Occupied(start, SIZE[profile], profile))
    nodes = []
    for name, count in gpus.items():
        gs = tuple(Gpu(i, H100, occupied=tuple(occ.get((name, i), ()))) for i in range(count))
        f = (free or {}).get(name, PLENTY)
        state = NodeState(name, pods_free=f.pods, gpus=gs)
        nodes.append(replace(state, cpu_millis_free=f.cpu_millis, memory_bytes_free=f.memory_bytes))
    return Snapshot(tuple(nodes))


def ask(*profiles: str) -> PodRequest:
    return PodRequest("hi", 1000, GIB, tuple(SliceRequest("main", p) for p in profiles))


def full_of_1g(node: str, gpu: int, prio: int = 0, t0: float = 0.0, **kw: object) -> list[Holder]:
    return [
        pod(f"{node}-g{gpu}-{s}", node, (gpu, "1g.10gb", s), prio=prio, start_time=t0 + s, **kw)
        for s in range(7)
    ]


def plan(
    snapshot: Snapshot, request: PodRequest, holders: list[Holder], **kw: object
) -> PreemptionPlan:
    result = plan_preemption(snapshot, request, holders, **kw)  # type: ignore[arg-type]
    assert result is not None
    return result


# --- table cases ----------------------------------------------------------------------------


def test_a_7g_evicts_exactly_the_pods_of_one_gpu() -> None:
    holders = full_of_1g("n", 0) + full_of_1g("n", 1)
    p = plan(cluster(holders, {"n": 2}), ask("7g.80gb"), holders)
    gpu = p.placement.slices[0].gpu_index
    assert set(p.victims) == {f"n-g{gpu}-{s}" for s in range(7)}
    assert p.placement.slices[0].start == 0


def test_newest_victims_are_chosen_so_less_work_is_lost() -> None:
    holders = full_of_1g("n", 0, t0=100.0) + full_of_1g("n", 1, t0=10.0)
    p = plan(cluster(holders, {"n": 2}), ask("7g.80gb"), holders)
    assert p.placement.slices[0].gpu_index == 0  # its pods started later


def test_a_pdb_protecting_one_gpu_sends_the_pod_to_the_other() -> None:
    holders = full_of_1g("n", 0, t0=100.0, pdbs=("ns/guard",)) + full_of_1g("n", 1, t0=10.0)
    p = plan(cluster(holders, {"n": 2}), ask("7g.80gb"), holders, pdb_allowed={"ns/guard": 0})
    assert p.placement.slices[0].gpu_index == 1
    assert p.cost[0] == 0


def test_pdb_violations_are_chosen_last_but_chosen_when_nothing_else_fits() -> None:
    holders = full_of_1g("n", 0, pdbs=("ns/guard",))
    p = plan(cluster(holders, {"n": 1}), ask("7g.80gb"), holders, pdb_allowed={"ns/guard": 2})
    assert len(p.victims) == 7 and p.cost[0] == 5


def test_lower_highest_victim_priority_beats_fewer_victims() -> None:
    holders = [
        pod("mid", "n", (0, "3g.40gb", 0), prio=5),
        pod("a", "n", (0, "2g.20gb", 4), prio=1),
        pod("b", "n", (0, "1g.10gb", 6), prio=1),
    ]
    p = plan(cluster(holders, {"n": 1}), ask("3g.40gb"), holders)
    assert p.victims == ("a", "b")


def test_fewest_victims_then_fewest_slots_freed_beyond_need() -> None:
    holders = [
        pod("big", "n", (0, "3g.40gb", 0)),
        pod("small1", "n", (0, "1g.10gb", 4)),
        pod("small2", "n", (0, "1g.10gb", 5)),
        pod("small3", "n", (0, "1g.10gb", 6)),
    ]
    p = plan(cluster(holders, {"n": 1}), ask("1g.10gb"), holders)
    assert p.victims in {("small1",), ("small2",), ("small3",)}  # not the 3g: 3 slots wasted
    assert p.cost[3] == 0


def test_equal_or_higher_priority_pods_and_foreign_instances_block() -> None:
    holders = [pod(f"p{s}", "n", (0, "1g.10gb", s), preemptible=False) for s in range(4)]
    snapshot = cluster(holders, {"n": 1}, foreign=[("n", 0, "3g.40gb", 4)])
    assert plan_preemption(snapshot, ask("1g.10gb"), holders) is None


def test_evicting_one_1g_frees_the_3g_start_that_fragmentation_blocked() -> None:
    holders = [
        pod("keep", "n", (0, "1g.10gb", 0), preemptible=False),
        pod("frag", "n", (0, "1g.10gb", 5)),
    ]
    snapshot = cluster(holders, {"n": 1}, foreign=[("n", 0, "2g.20gb", 2)])
    assert not isinstance(place(snapshot, replace_cpu(ask("3g.40gb"))), Placement)
    p = plan(snapshot, ask("3g.40gb"), holders)
    assert p.victims == ("frag",)
    assert (p.placement.slices[0].start, p.placement.slices[0].size) == (4, 4)


def replace_cpu(request: PodRequest) -> PodRequest:
    return PodRequest(request.name, 0, 0, request.slices)


def test_a_victim_is_a_whole_pod_and_frees_its_slices_on_every_gpu() -> None:
    holders = [
        pod("wide", "n", (0, "4g.40gb", 0), (1, "4g.40gb", 0)),
        pod("a", "n", (0, "3g.40gb", 4)),
        pod("b", "n", (1, "3g.40gb", 4)),
    ]
    p = plan(cluster(holders, {"n": 2}), ask("4g.40gb"), holders)
    assert p.victims == ("wide",)
    assert p.cost[3] == 4  # it frees 8 slots for a 4-slot slice


def test_several_slices_are_planned_jointly_on_one_node() -> None:
    holders = (
        full_of_1g("a", 0, prio=1)
        + [pod("a-3g", "a", (1, "3g.40gb", 0))]
        + [pod(f"a-{s}", "a", (1, "1g.10gb", s)) for s in (4, 5, 6)]
        + full_of_1g("b", 0, prio=0)
    )
    p = plan(cluster(holders, {"a": 2, "b": 1}), ask("3g.40gb", "1g.10gb"), holders)
    assert p.placement.node == "a"
    # the 3g's window alone leaves no room for the 1g: one more victim, chosen with it
    assert len(p.victims) == 2 and "a-3g" in p.victims


def test_terminating_holders_cost_nothing_and_are_waited_for() -> None:
    holders = full_of_1g("n", 0, doomed=True) + full_of_1g("n", 1)
    p = plan(cluster(holders, {"n": 2}), ask("7g.80gb"), holders)
    assert p.victims == ()
    assert p.waits_for == tuple(sorted(f"n-g0-{s}" for s in range(7)))


def test_a_reservation_over_a_terminating_pod_is_not_taken_twice() -> None:
    """Chaos found it: a second preemptor planned onto a slot a first one had reserved over
    a terminating pod (one instance, two holders; the doomed one made it look free)."""
    going = pod("going", "n", (0, "1g.10gb", 3), doomed=True)
    reserved = pod("first", "n", (0, "1g.10gb", 3), preemptible=False)
    others = [pod(f"o{s}", "n", (0, "1g.10gb", s), preemptible=False) for s in (0, 1, 2, 4, 5, 6)]
    holders = [going, reserved, *others]
    assert plan_preemption(cluster(holders, {"n": 1}), ask("1g.10gb"), holders) is None
    victim = pod("v", "n", (0, "1g.10gb", 3))  # a victim of the first preemptor, not yet gone
    holders = [victim, reserved, *others]
    assert plan_preemption(cluster(holders, {"n": 1}), ask("1g.10gb"), holders) is None


def test_node_selector_is_respected() -> None:
    holders = full_of_1g("a", 0) + full_of_1g("b", 0, prio=3)
    snapshot = cluster(holders, {"a": 1, "b": 1})
    nodes = tuple(
        NodeState(n.name, {"pool": n.name}, pods_free=1, gpus=n.gpus) for n in snapshot.nodes
    )
    request = PodRequest("hi", 0, 0, (SliceRequest("main", "7g.80gb"),), {"pool": "b"})
    p = plan(Snapshot(nodes), request, holders)
    assert p.placement.node == "b"


# --- the pod's cpu, memory and pod slot ----------------------------------------------------

NONE = Frees(0, 0, 0)


def test_a_node_where_the_pods_cpu_never_fits_is_not_planned_on() -> None:
    """Node a's victims are the cheapest, but what is left of its cpu is held by pods of
    equal or higher priority: pinned there the pod would never be scheduled (deleted after
    the pinned-unschedulable timeout, recreated, and evicting again). Node b it is."""
    holders = full_of_1g("a", 0, prio=0) + full_of_1g("b", 0, prio=1)
    free = {"a": Frees(500, 8 * GIB, 5), "b": PLENTY}
    p = plan(cluster(holders, {"a": 1, "b": 1}, free=free), ask("7g.80gb"), holders)
    assert p.placement.node == "b"
    alone = [h for h in holders if h.node == "a"]
    assert plan_preemption(cluster(alone, {"a": 1}, free=free), ask("7g.80gb"), alone) is None


@pytest.mark.parametrize(
    ("free", "frees", "spare", "planned"),
    [
        (NONE, Frees(150, GIB // 4, 1), NONE, True),  # the 7 victims free 1050m, 1.75 GiB
        (NONE, Frees(100, GIB // 4, 1), NONE, False),  # 700m: cpu short
        (NONE, Frees(150, GIB // 8, 1), NONE, False),  # 0.875 GiB: memory short
        (Frees(1000, GIB, 0), NONE, NONE, False),  # no pod slot, and the victims free none
        (Frees(1000, GIB, 0), Frees(0, 0, 1), NONE, True),  # a victim's pod slot
        (NONE, NONE, Frees(1000, GIB, 1), True),  # lower-priority pods holding no slices
        (NONE, NONE, Frees(999, GIB, 1), False),
    ],
)
def test_lower_priority_pods_free_their_cpu_memory_and_pod_slot(
    free: Frees, frees: Frees, spare: Frees, planned: bool
) -> None:
    holders = full_of_1g("n", 0, frees=frees)
    snapshot = cluster(holders, {"n": 1}, free={"n": free})
    got = plan_preemption(snapshot, ask("7g.80gb"), holders, spare={"n": spare})
    assert (got is not None) is planned


def test_a_plan_needing_the_cpu_of_terminating_pods_waits_for_them() -> None:
    """GPU 0's victims free the slots; the cpu is the terminating pods' on GPU 1 (which a
    pod of equal priority keeps from the 7g)."""
    gpu1 = full_of_1g("n", 1)
    going = [replace(h, doomed=True, preemptible=False, frees=Frees(1000, GIB, 1))
             for h in gpu1[:6]]  # fmt: skip
    holders = [*full_of_1g("n", 0), *going, replace(gpu1[6], preemptible=False)]
    p = plan(cluster(holders, {"n": 2}, free={"n": NONE}), ask("7g.80gb"), holders)
    assert p.placement.slices[0].gpu_index == 0 and len(p.victims) == 7
    assert set(p.waits_for) == {h.uid for h in going}  # though their slots are not taken
    roomy = plan(cluster(holders, {"n": 2}), ask("7g.80gb"), holders)
    assert roomy.victims == p.victims and roomy.waits_for == ()


def test_a_victim_whose_eviction_was_refused_counts_as_a_pdb_violation() -> None:
    refused = [replace(h, refused=True) for h in full_of_1g("n", 0, t0=100.0)]
    holders = refused + full_of_1g("n", 1, t0=10.0)
    p = plan(cluster(holders, {"n": 2}), ask("7g.80gb"), holders)
    assert p.placement.slices[0].gpu_index == 1 and p.cost[0] == 0
    alone = plan(cluster(refused, {"n": 1}), ask("7g.80gb"), refused)
    assert alone.cost[0] == 7  # the last resort: planned, counted


def test_victim_cost_counts_each_pdb_once_per_victim_beyond_its_allowance() -> None:
    vs = [pod(str(i), "n", (0, "1g.10gb", i), prio=i, pdbs=("x", "y")) for i in range(3)]
    assert victim_cost(vs, 1, {"x": 1, "y": 3})[:4] == (2, 2, 3, 2)


# --- the property: minimal against a brute force ---------------------------------------------

PROFILES = ["1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]  # no +me: module doc
PREEMPTOR = 2


def draw_free(draw: st.DrawFn, profiles: list[str], used: int) -> tuple[str, int, int] | None:
    """A drawn profile at its first legal start clear of the `used` slots, and the slots used
    then; None when it has none."""
    profile = draw(st.sampled_from(profiles))
    size = SIZE[profile]
    start = next((s for s in STARTS[profile] if not used & (((1 << size) - 1) << s)), None)
    return None if start is None else (profile, start, used | ((1 << size) - 1) << start)


Scenario = tuple[Snapshot, list[Holder], PodRequest, dict[str, int], dict[str, Frees]]


def small_frees(draw: st.DrawFn, pods: int = 1) -> Frees:
    """Around the request's 1000m / 1 GiB, so that a fit depends on who leaves."""
    return Frees(draw(st.sampled_from([0, 300, 1000])), draw(st.sampled_from([0, GIB])), pods)


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    nodes = {f"n{i}": draw(st.integers(1, 2)) for i in range(draw(st.integers(1, 2)))}
    free = {n: small_frees(draw, pods=draw(st.integers(0, 1))) for n in nodes}
    spare = {n: small_frees(draw, pods=0) for n in nodes if draw(st.booleans())}
    holders: list[Holder] = []
    for name, count in nodes.items():
        for g in range(count):
            used = 0
            for k in range(draw(st.integers(0, 6))):
                found = draw_free(draw, PROFILES, used)
                if found is None:
                    continue
                profile, start, used = found
                NAMES[(name, g, start)] = profile
                prio = draw(st.integers(0, 3))
                holders.append(
                    Holder(
                        f"{name}-{g}-{k}",
                        name,
                        ((g, start, SIZE[profile]),),
                        prio,
                        start_time=float(draw(st.integers(0, 3))),
                        pdbs=("pdb",) if draw(st.booleans()) else (),
                        preemptible=prio < PREEMPTOR,
                        doomed=draw(st.integers(0, 9)) == 0,
                        # a holder of the preemptor's priority or more frees nothing it may use
                        frees=small_frees(draw) if prio < PREEMPTOR else Frees(),
                    )
                )
    request = ask(*draw(st.lists(st.sampled_from(PROFILES), min_size=1, max_size=2)))
    allowed = {"pdb": draw(st.integers(0, 2))}
    return cluster(holders, nodes, free=free), holders, request, allowed, spare


def brute_force(
    snapshot: Snapshot,
    holders: list[Holder],
    request: PodRequest,
    allowed: dict[str, int],
    spare: dict[str, Frees],
) -> tuple[int, int, int, int, float] | None:
    """The least cost over every subset of every node's preemptible holders that lets the
    request's slices fit (by the placement engine) with doomed holders' slots free, on nodes
    where its cpu, memory and pod slot fit once every lower-priority pod is gone."""
    slots = sum(SIZE[s.profile] * s.count for s in request.slices)
    best = None
    for node in snapshot.nodes:
        mine = [h for h in holders if h.node == node.name]
        doomed = [h for h in mine if h.doomed]
        candidates = [h for h in mine if h.preemptible and not h.doomed]
        if not fits_after(node, [*doomed, *candidates], spare, request):
            continue
        for k in range(len(candidates) + 1):
            for subset in combinations(candidates, k):
                after = remove(node, [*doomed, *subset])
                if isinstance(place(Snapshot((after,)), replace_cpu(request)), Placement):
                    cost = victim_cost(subset, slots, allowed)
                    best = cost if best is None or cost < best else best
    return best


def fits_after(
    node: NodeState, gone: Iterable[Holder], spare: dict[str, Frees], request: PodRequest
) -> bool:
    """The pod's cpu, memory and one pod slot fit once `gone` left (written out here, not
    the planner's own helper)."""
    cpu, mem, pods = node.cpu_millis_free, node.memory_bytes_free, node.pods_free
    for f in [*(h.frees for h in gone), spare.get(node.name, Frees())]:
        cpu, mem, pods = cpu + f.cpu_millis, mem + f.memory_bytes, pods + f.pods
    return cpu >= request.cpu_millis and mem >= request.memory_bytes and pods >= 1


def remove(node: NodeState, gone: list[Holder]) -> NodeState:
    drop = {(g, s, z) for h in gone for g, s, z in h.slices}
    gpus = tuple(
        Gpu(
            g.index,
            g.model,
            occupied=tuple(o for o in g.occupied if (g.index, o.start, o.size) not in drop),
        )
        for g in node.gpus
    )
    return NodeState(node.name, pods_free=1, gpus=gpus)


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_the_chosen_victims_cost_the_brute_force_minimum(case: Scenario) -> None:
    snapshot, holders, request, allowed, spare = case
    # as it is called: the slots do not fit as they are (Full or Fragmented)
    roomy = Snapshot(tuple(replace(n, pods_free=1) for n in snapshot.nodes))
    assume(not isinstance(place(roomy, replace_cpu(request)), Placement))
    expected = brute_force(snapshot, holders, request, allowed, spare)
    got = plan_preemption(snapshot, request, holders, pdb_allowed=allowed, spare=spare)
    if expected is None:
        assert got is None
        return
    assert got is not None
    assert got.cost[:5] == expected
    by_uid = {h.uid: h for h in holders}
    victims = [by_uid[u] for u in got.victims]
    assert all(v.preemptible and not v.doomed and v.priority < PREEMPTOR for v in victims)
    assert all(v.node == got.placement.node for v in victims)
    # never a node where the pod's cpu / memory / pod slot do not fit once its victims and
    # the lower-priority pods kube-scheduler's preemption may evict (the other possible
    # victims, the terminating holders, the spare) are gone; equal or higher priority stay
    node = next(n for n in snapshot.nodes if n.name == got.placement.node)
    lower = [h for h in holders if h.node == node.name and (h.preemptible or h.doomed)]
    assert all(h.priority < PREEMPTOR or h.doomed for h in lower)
    assert fits_after(node, lower, spare, request)
    # an independent legality check of the placement once victims and doomed holders are gone
    node = next(n for n in snapshot.nodes if n.name == got.placement.node)
    gone = {
        (g, s, z) for h in [*victims, *(h for h in holders if h.doomed)] for g, s, z in h.slices
    }
    taken: dict[int, int] = {}
    for g in node.gpus:
        for o in g.occupied:
            if (g.index, o.start, o.size) not in gone:
                taken[g.index] = taken.get(g.index, 0) | o.mask
    for s in got.placement.slices:
        assert s.start in STARTS[s.profile]
        mask = ((1 << s.size) - 1) << s.start
        assert not taken.get(s.gpu_index, 0) & mask
        taken[s.gpu_index] = taken.get(s.gpu_index, 0) | mask
