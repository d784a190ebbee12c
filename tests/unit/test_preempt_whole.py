"""The whole-GPU preemption planner (common/placement/preempt_whole.py): table cases for each
rule (all holders of one GPU, blockers, non-candidate GPUs, N GPUs on one node, the shared
cost order, doomed holders, MIG-off GPUs held by whole-GPU pods) and hypothesis properties on
small random clusters: a plan's victims, removed, always let `place_whole` succeed on the
plan's node, every chosen GPU held only victims (never a foreign instance or a non-victim)
and was a candidate, and the plan costs the brute-force minimum over every victim subset.
Not covered here: how the allocator reserves and evicts (test_allocator_preemption.py,
tests/integration/test_allocator_preemption.py)."""

from __future__ import annotations

from collections.abc import Iterable
from itertools import combinations

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from common.placement import Gpu, NodeState, Occupied, Placement, PodRequest, SliceRequest, Snapshot
from common.placement.preempt import Holder, PreemptionPlan, victim_cost
from common.placement.preempt_whole import plan_whole_preemption
from common.placement.whole import WholeView, place_whole
from tests.unit.test_preempt import SIZE, draw_free

H100 = "H100-80GB"
Slice = tuple[int, int, int, str]  # (gpu, start, size, profile)


def holder(uid: str, node: str, *slices: Slice, prio: int = 0, **kw: object) -> Holder:
    return Holder(uid, node, tuple(s[:3] for s in slices), prio, **kw)  # type: ignore[arg-type]


def mig(gpu: int, profile: str, start: int) -> Slice:
    return (gpu, start, SIZE[profile], profile)


def whole_gpu(gpu: int) -> Slice:
    return (gpu, 0, 8, "gpu")


def cluster(
    holders: Iterable[tuple[Holder, tuple[Slice, ...]]],
    gpus: dict[str, int],
    foreign: Iterable[tuple[str, Slice]] = (),
    mig_off: Iterable[tuple[str, int]] = (),
) -> tuple[Snapshot, list[Holder]]:
    occ: dict[tuple[str, int], list[Occupied]] = {}
    out = []
    for h, slices in holders:
        out.append(h)
        for g, start, size, profile in slices:
            occ.setdefault((h.node, g), []).append(Occupied(start, size, profile))
    for node, (g, start, size, profile) in foreign:
        occ.setdefault((node, g), []).append(Occupied(start, size, profile))
    off = set(mig_off)
    nodes = tuple(
        NodeState(
            name,
            cpu_millis_free=64_000,
            memory_bytes_free=256 << 30,
            pods_free=10,
            gpus=tuple(
                Gpu(
                    i,
                    H100,
                    mig_enabled=(name, i) not in off,
                    occupied=tuple(occ.get((name, i), ())),
                )
                for i in range(count)
            ),
        )
        for name, count in gpus.items()
    )
    return Snapshot(nodes), out


def h(
    uid: str, node: str, *slices: Slice, prio: int = 0, **kw: object
) -> tuple[Holder, tuple[Slice, ...]]:
    return holder(uid, node, *slices, prio=prio, **kw), slices


def one_gpu_of_1g(
    node: str, gpu: int, prio: int = 0, t0: float = 0.0, **kw: object
) -> list[tuple[Holder, tuple[Slice, ...]]]:
    return [
        h(f"{node}-g{gpu}-{s}", node, mig(gpu, "1g.10gb", s), prio=prio, start_time=t0 + s, **kw)
        for s in range(7)
    ]


def every(snapshot: Snapshot) -> frozenset[tuple[str, int]]:
    return frozenset((n.name, g.index) for n in snapshot.nodes for g in n.gpus)


def ask(n: int = 1) -> PodRequest:
    return PodRequest("hi", 1000, 1 << 30, (SliceRequest("main", "gpu", n),))


def plan(snapshot: Snapshot, holders: list[Holder], n: int = 1, **kw: object) -> PreemptionPlan:
    got = plan_whole_preemption(snapshot, ask(n), holders, every(snapshot), **kw)  # type: ignore[arg-type]
    assert got is not None
    return got


def gpus_of(p: PreemptionPlan) -> list[int]:
    return [s.gpu_index for s in p.placement.slices]


# --- table cases ----------------------------------------------------------------------------


def test_a_whole_gpu_evicts_every_holder_of_one_gpu_and_no_other() -> None:
    snapshot, holders = cluster(
        [*one_gpu_of_1g("n", 0), h("big", "n", mig(1, "7g.80gb", 0))], {"n": 2}
    )
    p = plan(snapshot, holders)
    assert p.victims == ("big",) and gpus_of(p) == [1]  # one victim beats seven
    assert [(s.start, s.size, s.profile) for s in p.placement.slices] == [(0, 8, "gpu")]


def test_all_seven_holders_go_when_that_gpu_is_the_only_one() -> None:
    snapshot, holders = cluster(one_gpu_of_1g("n", 0), {"n": 1})
    assert set(plan(snapshot, holders).victims) == {f"n-g0-{s}" for s in range(7)}


def test_a_foreign_instance_or_a_non_victim_keeps_the_gpu_out() -> None:
    snapshot, holders = cluster(
        [
            h("a", "n", mig(0, "1g.10gb", 0)),
            h("keep", "n", mig(1, "1g.10gb", 0), preemptible=False),
            h("b", "n", mig(1, "3g.40gb", 4)),
            h("c", "n", mig(2, "1g.10gb", 0)),
            *one_gpu_of_1g("n", 3),
        ],
        {"n": 4},
        foreign=[("n", mig(0, "3g.40gb", 4)), ("n", mig(2, "1g.10gb", 1))],
    )
    p = plan(snapshot, holders)
    assert gpus_of(p) == [3] and len(p.victims) == 7  # the only GPU with victims alone on it
    snapshot, holders = cluster(
        [h("keep", "n", mig(0, "1g.10gb", 0), preemptible=False)],
        {"n": 1},
        foreign=[],
    )
    assert plan_whole_preemption(snapshot, ask(), holders, every(snapshot)) is None


def test_a_gpu_that_is_not_a_candidate_is_never_planned_on() -> None:
    snapshot, holders = cluster(
        [h("a", "n", mig(0, "7g.80gb", 0)), *one_gpu_of_1g("n", 1)], {"n": 2}
    )
    got = plan_whole_preemption(snapshot, ask(), holders, frozenset({("n", 1)}))
    assert got is not None and gpus_of(got) == [1]  # GPU 0 (say, Ampere) is left alone
    assert plan_whole_preemption(snapshot, ask(), holders, frozenset()) is None


def test_n_gpus_come_from_one_node_counting_a_free_one() -> None:
    snapshot, holders = cluster(
        [
            h("a", "x", mig(0, "7g.80gb", 0)),  # x: one GPU to empty, one busy with a blocker
            h("keep", "x", mig(1, "7g.80gb", 0), preemptible=False),
            h("b", "y", mig(0, "3g.40gb", 0)),  # y: one to empty, one free
            h("c", "z", mig(0, "1g.10gb", 0)),  # z: two to empty
            h("d", "z", mig(1, "1g.10gb", 0)),
        ],
        {"x": 2, "y": 2, "z": 2},
    )
    p = plan(snapshot, holders, n=2)
    assert p.placement.node == "y" and p.victims == ("b",) and sorted(gpus_of(p)) == [0, 1]


def test_lower_victim_priority_wins_then_newer_work() -> None:
    snapshot, holders = cluster(
        [
            h("mid", "n", mig(0, "7g.80gb", 0), prio=5),
            h("low1", "n", mig(1, "3g.40gb", 0), prio=1),
            h("low2", "n", mig(1, "3g.40gb", 4), prio=1),
        ],
        {"n": 2},
    )
    assert plan(snapshot, holders).victims == ("low1", "low2")
    snapshot, holders = cluster(
        [*one_gpu_of_1g("n", 0, t0=10.0), *one_gpu_of_1g("n", 1, t0=100.0)], {"n": 2}
    )
    assert gpus_of(plan(snapshot, holders)) == [1]  # its pods started later


def test_a_pdb_sends_the_pod_to_the_other_gpu_and_is_violated_only_when_needed() -> None:
    snapshot, holders = cluster(
        [h("guarded", "n", mig(0, "7g.80gb", 0), pdbs=("ns/g",)), *one_gpu_of_1g("n", 1)],
        {"n": 2},
    )
    p = plan(snapshot, holders, pdb_allowed={"ns/g": 0})
    assert gpus_of(p) == [1] and p.cost[0] == 0
    snapshot, holders = cluster([h("guarded", "n", mig(0, "7g.80gb", 0), pdbs=("ns/g",))], {"n": 1})
    assert plan(snapshot, holders, pdb_allowed={"ns/g": 0}).cost[0] == 1


def test_terminating_holders_cost_nothing_and_are_waited_for() -> None:
    snapshot, holders = cluster(
        [h("going", "n", mig(0, "3g.40gb", 0), doomed=True), h("low", "n", mig(0, "3g.40gb", 4))],
        {"n": 1},
    )
    p = plan(snapshot, holders)
    assert p.victims == ("low",) and p.waits_for == ("going",)


def test_a_lower_priority_whole_gpu_pod_on_a_mig_off_gpu_is_a_victim() -> None:
    snapshot, holders = cluster(
        [h("train-lo", "n", whole_gpu(0)), *one_gpu_of_1g("n", 1)], {"n": 2}, mig_off=[("n", 0)]
    )
    p = plan(snapshot, holders)
    assert p.victims == ("train-lo",) and gpus_of(p) == [0]


def test_a_node_the_pod_may_not_use_is_left_out() -> None:
    snapshot, holders = cluster(
        [h("a", "n", mig(0, "7g.80gb", 0)), *one_gpu_of_1g("m", 0)], {"n": 1, "m": 1}
    )
    request = PodRequest("hi", 0, 0, (SliceRequest("main", "gpu", 1),), node_selector={"pool": "m"})
    snapshot = Snapshot(
        tuple(
            NodeState(n.name, labels={"pool": n.name}, pods_free=10, gpus=n.gpus)
            for n in snapshot.nodes
        )
    )
    got = plan_whole_preemption(snapshot, request, holders, every(snapshot))
    assert got is not None and got.placement.node == "m" and len(got.victims) == 7


# --- properties on small random clusters ----------------------------------------------------

PROFILES = ["1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]
PREEMPTOR = 2


@st.composite
def scenarios(
    draw: st.DrawFn,
) -> tuple[Snapshot, list[Holder], frozenset[tuple[str, int]], int, dict[str, int]]:
    nodes = {f"n{i}": draw(st.integers(1, 3)) for i in range(draw(st.integers(1, 2)))}
    placed: list[tuple[Holder, tuple[Slice, ...]]] = []
    foreign: list[tuple[str, Slice]] = []
    off: list[tuple[str, int]] = []
    candidates = set()
    k = 0
    for name, count in nodes.items():
        for g in range(count):
            if draw(st.integers(0, 4)):
                candidates.add((name, g))
            kind = draw(st.sampled_from(["mig", "mig", "whole", "free"]))
            if kind == "free":
                continue
            if kind == "whole":
                off.append((name, g))
                prio = draw(st.integers(0, 3))
                placed.append(
                    h(f"w{k}", name, whole_gpu(g), prio=prio, preemptible=prio < PREEMPTOR)
                )
                k += 1
                continue
            used = 0
            for _ in range(draw(st.integers(1, 3))):
                found = draw_free(draw, PROFILES, used)
                if found is None:
                    continue
                profile, start, used = found
                if draw(st.integers(0, 7)) == 0:
                    foreign.append((name, mig(g, profile, start)))
                    continue
                prio = draw(st.integers(0, 3))
                placed.append(
                    h(
                        f"p{k}",
                        name,
                        mig(g, profile, start),
                        prio=prio,
                        start_time=float(draw(st.integers(0, 3))),
                        pdbs=("pdb",) if draw(st.booleans()) else (),
                        preemptible=prio < PREEMPTOR,
                        doomed=draw(st.integers(0, 9)) == 0,
                    )
                )
                k += 1
    snapshot, holders = cluster(placed, nodes, foreign, off)
    n = draw(st.integers(1, 2))
    return snapshot, holders, frozenset(candidates), n, {"pdb": draw(st.integers(0, 1))}


def _remove(node: NodeState, gone: Iterable[Holder]) -> NodeState:
    drop = {(g, s, z) for v in gone for g, s, z in v.slices}
    gpus = tuple(
        Gpu(
            g.index,
            g.model,
            mig_enabled=g.mig_enabled,
            occupied=tuple(o for o in g.occupied if (g.index, o.start, o.size) not in drop),
        )
        for g in node.gpus
    )
    return NodeState(node.name, pods_free=1, gpus=gpus)


def _fits(node: NodeState, candidates: frozenset[tuple[str, int]], n: int) -> Placement | None:
    empty = [g for g in node.gpus if not g.occupied and (node.name, g.index) in candidates]
    view = WholeView(
        right_mode=frozenset((node.name, g.index) for g in empty if not g.mig_enabled),
        toggle=frozenset((node.name, g.index) for g in empty if g.mig_enabled),
    )
    got = place_whole(
        Snapshot((node,)), PodRequest("hi", 0, 0, (SliceRequest("main", "gpu", n),)), view
    )
    return got.result if isinstance(got.result, Placement) else None


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_a_plan_frees_its_gpus_of_victims_alone_at_the_brute_force_minimum(
    case: tuple[Snapshot, list[Holder], frozenset[tuple[str, int]], int, dict[str, int]],
) -> None:
    snapshot, holders, candidates, n, allowed = case
    assume(all(_fits(node, candidates, n) is None for node in snapshot.nodes))  # as called
    got = plan_whole_preemption(snapshot, ask(n), holders, candidates, pdb_allowed=allowed)
    best = None
    for node in snapshot.nodes:
        mine = [x for x in holders if x.node == node.name]
        doomed = [x for x in mine if x.doomed]
        free = [x for x in mine if x.preemptible and not x.doomed]
        for size in range(len(free) + 1):
            for subset in combinations(free, size):
                if _fits(_remove(node, [*doomed, *subset]), candidates, n) is not None:
                    cost = victim_cost(subset, 8 * n, allowed)
                    best = cost if best is None or cost < best else best
    if best is None:
        assert got is None
        return
    assert got is not None and got.cost[:5] == best
    by_uid = {x.uid: x for x in holders}
    victims = [by_uid[u] for u in got.victims]
    assert all(v.preemptible and not v.doomed and v.priority < PREEMPTOR for v in victims)
    node = next(x for x in snapshot.nodes if x.name == got.placement.node)
    assert all(v.node == node.name for v in victims)
    # the victims (and the holders it waits for) gone, the placement is legal as it is
    after = _remove(node, [*victims, *(by_uid[u] for u in got.waits_for)])
    refs = {(node.name, s.gpu_index) for s in got.placement.slices}
    assert len(refs) == n and refs <= candidates
    on = {g.index: g for g in after.gpus}
    assert all(not on[i].occupied for _, i in refs)  # no foreign instance, no non-victim left
    assert _fits(after, frozenset(refs), n) is not None
