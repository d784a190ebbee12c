"""The preemption planner (common/placement/preempt.py): table cases for each cost term and
rule, and a hypothesis property against a brute force over every victim subset on small
clusters (≤ 2 nodes x 2 GPUs). Not covered here: how the allocator evicts (integration)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from itertools import combinations

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from common.catalog import load_catalog
from common.placement import Gpu, NodeState, Occupied, Placement, PodRequest, SliceRequest, Snapshot
from common.placement.engine import place
from common.placement.preempt import Holder, PreemptionPlan, plan_preemption, victim_cost

H100 = "H100-80GB"
SIZE = {p.name: p.memory_slots for p in load_catalog().model(H100).profiles}  # type: ignore[union-attr]
STARTS = {p.name: p.starts for p in load_catalog().model(H100).profiles}  # type: ignore[union-attr]


NAMES: dict[tuple[str, int, int], str] = {}  # (node, gpu, start) → profile, for `cluster`


def pod(uid: str, node: str, *slices: tuple[int, str, int], prio: int = 0, **kw: object) -> Holder:
    """A holder; `slices`: (gpu index, profile, start)."""
    for g, p, s in slices:
        NAMES[(node, g, s)] = p
    return Holder(uid, node, tuple((g, s, SIZE[p]) for g, p, s in slices), prio, **kw)  # type: ignore[arg-type]


def cluster(
    holders: Iterable[Holder],
    gpus: Mapping[str, int],
    foreign: Iterable[tuple[str, int, str, int]] = (),
) -> Snapshot:
    """Nodes named in `gpus` (name → GPU count) whose occupancy is the holders' slices plus
    `foreign` (node, gpu, profile, start) instances."""
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
        nodes.append(NodeState(name, cpu_millis_free=0, memory_bytes_free=0, pods_free=10, gpus=gs))
    return Snapshot(tuple(nodes))


def ask(*profiles: str) -> PodRequest:
    return PodRequest("hi", 1000, 1 << 30, tuple(SliceRequest("main", p) for p in profiles))


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
    nodes = tuple(NodeState(n.name, {"pool": n.name}, gpus=n.gpus) for n in snapshot.nodes)
    request = PodRequest("hi", 0, 0, (SliceRequest("main", "7g.80gb"),), {"pool": "b"})
    p = plan(Snapshot(nodes), request, holders)
    assert p.placement.node == "b"


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


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Snapshot, list[Holder], PodRequest, dict[str, int]]:
    nodes = {f"n{i}": draw(st.integers(1, 2)) for i in range(draw(st.integers(1, 2)))}
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
                    )
                )
    request = ask(*draw(st.lists(st.sampled_from(PROFILES), min_size=1, max_size=2)))
    return cluster(holders, nodes), holders, request, {"pdb": draw(st.integers(0, 2))}


def brute_force(
    snapshot: Snapshot, holders: list[Holder], request: PodRequest, allowed: dict[str, int]
) -> tuple[int, int, int, int, float] | None:
    """The least cost over every subset of every node's preemptible holders that lets the
    request fit (by the placement engine) with doomed holders' slots free."""
    request = replace_cpu(request)
    slots = sum(SIZE[s.profile] * s.count for s in request.slices)
    best = None
    for node in snapshot.nodes:
        mine = [h for h in holders if h.node == node.name]
        doomed = [h for h in mine if h.doomed]
        candidates = [h for h in mine if h.preemptible and not h.doomed]
        for k in range(len(candidates) + 1):
            for subset in combinations(candidates, k):
                after = remove(node, [*doomed, *subset])
                if isinstance(place(Snapshot((after,)), request), Placement):
                    cost = victim_cost(subset, slots, allowed)
                    best = cost if best is None or cost < best else best
    return best


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
def test_the_chosen_victims_cost_the_brute_force_minimum(
    case: tuple[Snapshot, list[Holder], PodRequest, dict[str, int]],
) -> None:
    snapshot, holders, request, allowed = case
    assume(not isinstance(place(snapshot, replace_cpu(request)), Placement))  # as it is called
    expected = brute_force(snapshot, holders, request, allowed)
    got = plan_preemption(snapshot, request, holders, pdb_allowed=allowed)
    if expected is None:
        assert got is None
        return
    assert got is not None
    assert got.cost[:5] == expected
    by_uid = {h.uid: h for h in holders}
    victims = [by_uid[u] for u in got.victims]
    assert all(v.preemptible and not v.doomed and v.priority < PREEMPTOR for v in victims)
    assert all(v.node == got.placement.node for v in victims)
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
