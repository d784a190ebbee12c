"""The fleet index (common/placement/index.py) decides exactly as the engine's scan.

Covers: hypothesis sequences of adds and removes on random fleets (models, occupancy,
labels, taints, cordons, cpu / memory / pod slots, selectors, several slices per pod),
replayed twice — through the index and by `engine.place` on the snapshot — with every
answer equal, placements and Pending messages alike; hypothesis sequences of the node
changes the index may skip (free cpu / pods, taints, cordons, one GPU's slices, GPU sets,
nodes leaving and coming back) between pods of a few repeated shapes; every trace of the
placement benchmark's suite under every policy, replayed both ways; and the allocator's
`ClusterState.decide`: the index follows assume / forget, node removal and agents going
down and coming back. Leaves out: the decisions' quality (test_placement*.py) and speed
(`make bench-placement`).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any
from unittest.mock import patch

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.placement import POLICIES, suite
from common.placement import (
    Gpu,
    NodeState,
    Occupied,
    Pending,
    PendingReason,
    Placement,
    PodRequest,
    Policy,
    SliceRequest,
    Snapshot,
    Taint,
    Toleration,
    place,
)
from common.placement import index as index_module
from common.placement.engine import clear_caches
from common.placement.explain import explain
from common.placement.index import FleetIndex
from common.placement.lazyheap import LazyHeap
from common.placement.replay import AddEvent, Cluster, parse_trace, replay
from common.placement.search import Context
from common.placement.why import ShapeWhy
from testkit.builders import make_allocation, make_mig_node, make_node, make_pod
from tests.unit.test_placement_properties import nodes, spec
from webhook.allocator import pods as podlib
from webhook.allocator.state import ClusterState


@st.composite
def fleets_and_events(draw: st.DrawFn) -> tuple[Cluster, list[PodRequest | int]]:
    """A replay cluster built from random node states, and a sequence of pods to add
    (PodRequest) or, by position among the pods held, to remove (int)."""
    states = [draw(nodes(i)) for i in range(draw(st.integers(1, 6)))]
    for i, s in enumerate(states):  # more tainted and cordoned nodes than nodes() draws
        if draw(st.integers(0, 3)) == 0:
            states[i] = replace(s, taints=(Taint("dedicated", "x", "NoSchedule"),))
        if draw(st.integers(0, 5)) == 0:
            states[i] = replace(states[i], unschedulable=True)
    cluster = Cluster(())
    for i, s in enumerate(states):  # random occupancy and resources, as a live fleet has
        cluster._nodes.append(s)
        cluster._index[s.name] = i
        cluster._fleet.put(s, i)
    gpus = [g for s in states for g in s.gpus]
    events: list[PodRequest | int] = []
    for k in range(draw(st.integers(1, 25))):
        if draw(st.integers(0, 3)) == 0:
            events.append(draw(st.integers(0, 50)))
            continue
        names = (
            [p.name for p in spec(draw(st.sampled_from(gpus))).profiles] if gpus else ["1g.10gb"]
        )
        slices = tuple(
            SliceRequest(f"c{c}", draw(st.sampled_from(names)), draw(st.sampled_from([1, 1, 2])))
            for c in range(draw(st.sampled_from([1, 1, 1, 2])))
        )
        events.append(
            PodRequest(
                f"p{k}",
                draw(st.sampled_from([0, 500, 4000, 9000])),
                draw(st.sampled_from([0, 1 << 30, 100 << 30])),
                slices,
                {"zone": "a"} if draw(st.integers(0, 5)) == 0 else {},
                tolerations=draw(st.sampled_from(TOLERATIONS)),
            )
        )
    return cluster, events


# Pods that tolerate nothing, the test fleets' taint, cordons, or everything.
TOLERATIONS = [
    (),
    (),
    (Toleration("dedicated", "Equal", "x", "NoSchedule"),),
    (Toleration("node.kubernetes.io/unschedulable", "Exists"),),
    (Toleration("", "Exists"),),
]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleets_and_events())
def test_index_and_scan_decide_alike_through_adds_and_removes(
    case: tuple[Cluster, list[PodRequest | int]],
) -> None:
    _decide_alike(case)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleets_and_events())
def test_index_and_scan_decide_alike_when_each_decision_tidies_one_node(
    case: tuple[Cluster, list[PodRequest | int]],
) -> None:
    """The same, with every order and kept explanation brought up to date one changed node
    per decision (`FleetIndex._tidy`): the partial refreshes a large fleet makes."""
    with (
        patch.object(index_module, "ORDER_STALE_KEPT", 0),
        patch.object(index_module, "ORDER_TIDY_NODES", 1),
        patch.object(index_module, "WHY_TIDY_NODES", 1),
    ):
        _decide_alike(case)


def _decide_alike(case: tuple[Cluster, list[PodRequest | int]]) -> None:
    cluster, events = case
    held: list[str] = []
    for ev in events:
        if isinstance(ev, int):
            if held:
                assert cluster.remove(held.pop(ev % len(held)))
            continue
        indexed = cluster.decide(ev, indexed=True)
        scanned = place(cluster.snapshot, ev, cluster.policy, cluster.catalog)
        assert indexed == scanned
        if isinstance(indexed, Placement):
            cluster.assume(ev, indexed)
            held.append(ev.name)


Change = PodRequest | NodeState | str  # a pod to decide, a node's new state, a node gone


@st.composite
def fleets_and_changes(draw: st.DrawFn) -> tuple[list[NodeState], list[Change]]:
    """Random nodes, then pods to decide between the changes a live fleet sees: a node's
    free cpu / pods alone (its GPUs as they were), its taints, its cordon, its slices alone
    (one GPU emptied or filled whole), its GPUs (health, MIG mode, occupancy, models), a
    node leaving and coming back. What the index may skip (an order re-scores a node only
    when its GPUs changed; a kept explanation re-records it only when something it reads
    changed) must not change an answer."""
    fleet = [draw(nodes(i)) for i in range(draw(st.integers(1, 5)))]
    current: dict[str, NodeState | None] = {n.name: n for n in fleet}
    names = [p.name for n in fleet for g in n.gpus for p in spec(g).profiles] or ["1g.10gb"]
    shapes = [  # a few shapes, each asked again and again: what the explanations are kept for
        tuple(
            SliceRequest(f"c{c}", draw(st.sampled_from(names)), draw(st.sampled_from([1, 2])))
            for c in range(draw(st.sampled_from([1, 1, 2])))
        )
        for _ in range(draw(st.integers(1, 3)))
    ]
    kinds = ["pod", "pod", "resources", "taints", "cordon", "gpus", "slices", "slices", "leave"]
    changes: list[Change] = []
    for k in range(draw(st.integers(1, 30))):
        name = draw(st.sampled_from(sorted(current)))
        node = current[name]
        kind = draw(st.sampled_from(kinds))
        if kind == "leave" and node is None:  # it comes back as it first was
            node = fleet[int(name[1:])]
        elif kind == "leave":
            changes.append(name)
            current[name] = None
            continue
        elif kind == "resources" and node is not None:
            cpu = draw(st.sampled_from([0, 1000, 8000]))
            pods = draw(st.sampled_from([0, 1, 10]))
            node = replace(node, cpu_millis_free=cpu, pods_free=pods)
        elif kind == "taints" and node is not None:
            node = replace(node, taints=() if node.taints else TAINT)
        elif kind == "cordon" and node is not None:
            node = replace(node, unschedulable=not node.unschedulable)
        elif kind == "gpus" and node is not None:
            node = replace(node, gpus=draw(nodes(0)).gpus)
        elif kind == "slices" and node is not None:  # one GPU emptied, or filled whole
            k = draw(st.integers(0, len(node.gpus) - 1))
            g = node.gpus[k]
            whole = max(spec(g).profiles, key=lambda p: p.memory_slots)
            occupied = (
                () if g.occupied else (Occupied(whole.starts[0], whole.memory_slots, whole.name),)
            )
            gpus = list(node.gpus)
            gpus[k] = replace(g, occupied=occupied)
            node = replace(node, gpus=tuple(gpus))
        else:
            slices = draw(st.sampled_from(shapes))
            tolerations = draw(st.sampled_from(TOLERATIONS))
            cpu = draw(st.sampled_from([0, 500, 4000]))
            changes.append(PodRequest(f"p{k}", cpu, 0, slices, tolerations=tolerations))
            continue
        changes.append(node)
        current[name] = node
    return fleet, changes


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleets_and_changes())
def test_index_and_scan_decide_alike_through_node_changes(
    case: tuple[list[NodeState], list[Change]],
) -> None:
    fleet, changes = case
    for tidy_one in (False, True):  # with the default budgets, and one node per decision
        with (
            patch.object(index_module, "ORDER_STALE_KEPT", 0 if tidy_one else 16),
            patch.object(index_module, "ORDER_TIDY_NODES", 1 if tidy_one else 8),
            patch.object(index_module, "WHY_TIDY_NODES", 1 if tidy_one else 8),
        ):
            index = FleetIndex()
            current: dict[str, NodeState] = {}
            for node in fleet:
                index.put(node, _position(node))
                current[node.name] = node
            for change in changes:
                if isinstance(change, str):
                    index.remove(change)
                    del current[change]
                elif isinstance(change, NodeState):
                    index.put(change, _position(change))
                    current[change.name] = change
                else:
                    snap = Snapshot(tuple(sorted(current.values(), key=_position)))
                    got = index.place(change, Policy.INSTASLICE, None, partial(_same, snap))
                    assert got == place(snap, change)


def _position(node: NodeState) -> int:
    return int(node.name[1:])


def _same(snap: Snapshot) -> Snapshot:
    return snap


def test_every_benchmark_trace_replays_alike_under_every_policy() -> None:
    clear_caches()
    for name, doc in suite(quick=True).items():
        trace = parse_trace(doc)
        for policy in POLICIES:
            by_index = replay(trace, policy)
            scan = Cluster(trace.nodes, policy, indexed=False)
            for ev, line in zip(trace.events, by_index, strict=True):
                if isinstance(ev, AddEvent):
                    result = scan.add(ev.request)
                    assert line["placed"] == isinstance(result, Placement), (name, policy, ev)
                    if isinstance(result, Placement):
                        assert line["node"] == result.node, (name, policy, ev)
                        got = [(s["gpu"], s["start"]) for s in line["slices"]]
                        assert got == [(s.gpu_index, s.start) for s in result.slices]
                    else:
                        assert isinstance(result, Pending)
                        assert line["reason"] == result.message
                else:
                    assert line["removed"] == scan.remove(ev.pod)


def _state(*names: str) -> ClusterState:
    state = ClusterState()
    for name in names:
        state.upsert_node(make_node(name, cpu="8", memory="32Gi", pods=10, gpus=1))
        state.upsert_mig_node(make_mig_node(name, ["H100-80GB"]))
    return state


def _decide(state: ClusterState, pod: dict[str, object]) -> Placement | Pending:
    request = podlib.pod_request(pod)
    result = state.place(state.snapshot(), request, Policy.INSTASLICE, None)
    assert result == place(state.snapshot(), request)
    assert state.decide(request, Policy.INSTASLICE, None) == result  # the same, shorter
    return result


def test_cluster_state_decides_through_the_index_as_the_scan_would() -> None:
    state = _state("n1", "n2")
    placed = []
    for i in range(14):  # two H100s: seven 1g.10gb each, the fuller node first
        pod = make_pod(f"p{i}", uid=f"u{i}", cpu="10m")
        state.upsert_pod(pod)
        result = _decide(state, pod)
        assert isinstance(result, Placement)
        (s,) = result.slices
        body = make_allocation(pod, result.node, [("main", s.profile, s.gpu_index, s.start, 1)])
        state.assume(body)
        placed.append((result.node, body))
    assert [n for n, _ in placed] == ["n1"] * 7 + ["n2"] * 7
    last = _decide(state, make_pod("p14", uid="u14"))
    assert isinstance(last, Pending)
    node, body = placed[9]
    state.forget(f"ns/{body['metadata']['name']}")  # the create failed: room on n2 again
    again = _decide(state, make_pod("p14", uid="u14"))
    assert isinstance(again, Placement) and again.node == node


def test_the_index_leaves_out_nodes_whose_agent_is_down_and_takes_them_back() -> None:
    state = _state("n1", "n2")
    assert _decide(state, make_pod("a")).node == "n1"  # type: ignore[union-attr]
    state.set_agent_down("n1", True)
    assert _decide(state, make_pod("b")).node == "n2"  # type: ignore[union-attr]
    state.set_agent_down("n2", True)
    assert isinstance(_decide(state, make_pod("c")), Pending)
    state.set_agent_down("n1", False)
    assert _decide(state, make_pod("d")).node == "n1"  # type: ignore[union-attr]
    state.remove_mig_node(make_mig_node("n1", ["H100-80GB"]))  # gone from the fleet
    assert isinstance(_decide(state, make_pod("e")), Pending)


def test_cluster_state_answers_its_own_snapshot_from_the_index_and_any_other_by_scan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`ClusterState.place` is the one decision function the placer hands every slice
    decision (modes.place_with_modes): the index for the state's own current snapshot, the
    scan of the snapshot given otherwise — a stale one, one with GPUs excluded, or the
    mode path's hypothetical snapshots."""
    state = _state("n1", "n2")
    asked: list[str] = []
    real = FleetIndex.place

    def spy(self: FleetIndex, request: PodRequest, *args: Any) -> Placement | Pending:
        asked.append(request.name)
        return real(self, request, *args)

    monkeypatch.setattr(FleetIndex, "place", spy)
    pod = make_pod("a", uid="ua", cpu="10m")
    state.upsert_pod(pod)
    own = state.snapshot()
    assert state.snapshot() is own  # nothing changed: the same object
    request = podlib.pod_request(pod)
    first = state.place(own, request)
    assert isinstance(first, Placement) and asked == ["ns/a"]
    (s,) = first.slices
    state.assume(make_allocation(pod, first.node, [("main", s.profile, s.gpu_index, s.start, 1)]))
    # `own` is stale now: it is decided as it is (the slot just taken still free there)
    again = state.place(own, request)
    assert again == place(own, request) == first and asked == ["ns/a"]
    fresh = state.snapshot()
    assert fresh is not own
    assert state.place(fresh, request) == place(fresh, request) and asked == ["ns/a", "ns/a"]
    excluded = state.snapshot(exclude={("n1", "GPU-n1-0")})
    assert state.place(excluded, request) == place(excluded, request) and asked == ["ns/a", "ns/a"]


def _h100(
    name: str,
    *occupied: tuple[str, int, int],
    mig: bool = True,
    healthy: bool = True,
    cpu: int = 8000,
    taints: tuple[Taint, ...] = (),
    cordoned: bool = False,
) -> NodeState:
    """A one-H100 node; `occupied`: (profile, start, size) on its GPU."""
    occ = tuple(Occupied(start, size, p) for p, start, size in occupied)
    gpu = Gpu(0, "H100-80GB", mig, healthy, occ)
    return NodeState(name, {"zone": "a"}, taints, cordoned, cpu, 64 << 30, 10, (gpu,))


TAINT = (Taint("dedicated", "x", "NoSchedule"),)
ONE_4G = PodRequest("p", 1000, 0, (SliceRequest("c", "4g.40gb", 1),))
TWO_1G = PodRequest("p", 1000, 0, (SliceRequest("c", "1g.10gb", 2),))

# (case, fleet, pod, the reason the sums give — the scan's, word for word)
WHY_CASES = [
    (
        "cpu short",
        [_h100("n0", cpu=500), _h100("n1", ("7g.80gb", 0, 8))],
        ONE_4G,
        PendingReason.NODE_RESOURCES,
    ),
    (
        "fragmented",
        [
            _h100("n0", ("1g.10gb", 1, 1)),
            _h100("n1", ("1g.10gb", 2, 1), ("1g.10gb", 5, 1)),
            _h100("n2", ("3g.40gb", 0, 4)),
            _h100("n3", ("7g.80gb", 0, 8)),
        ],
        ONE_4G,
        PendingReason.FRAGMENTED,
    ),
    (
        "fragmented, six GPUs listed four",
        [_h100(f"n{i}", ("1g.10gb", i % 4, 1)) for i in range(6)],
        ONE_4G,
        PendingReason.FRAGMENTED,
    ),
    (
        "full",
        [
            _h100("n0", ("7g.80gb", 0, 8)),
            _h100("n1", ("4g.40gb", 0, 4), ("3g.40gb", 4, 4)),
            _h100("n2", healthy=False),
        ],
        ONE_4G,
        PendingReason.FULL,
    ),
    (
        "full, several slices",
        [_h100("n0", ("4g.40gb", 0, 4), ("3g.40gb", 4, 4))],
        TWO_1G,
        PendingReason.FULL,
    ),
    (
        "unavailable",
        [_h100("n0", healthy=False), _h100("n1", mig=False)],
        ONE_4G,
        PendingReason.GPU_UNAVAILABLE,
    ),
    (
        "all tainted or cordoned",
        [_h100("n0", taints=TAINT), _h100("n1", cordoned=True), _h100("n2", taints=TAINT)],
        ONE_4G,
        PendingReason.NO_MATCHING_NODE,
    ),
    (
        "only tainted nodes offer it",
        [
            _h100("n0", taints=TAINT),
            replace(_h100("n1"), gpus=(Gpu(0, "A100-40GB", True, True, ()),)),
        ],
        ONE_4G,
        PendingReason.NO_MATCHING_NODE,
    ),
]


@pytest.mark.parametrize(
    ("fleet", "pod", "reason"), [c[1:] for c in WHY_CASES], ids=[c[0] for c in WHY_CASES]
)
def test_a_pending_pod_is_explained_from_the_sums_as_the_scan_explains_it(
    fleet: list[NodeState], pod: PodRequest, reason: PendingReason
) -> None:
    index = FleetIndex()
    for i, node in enumerate(fleet):
        index.put(node, i)
    ctx = Context(None, Policy.INSTASLICE, pod)
    fast = ShapeWhy(ctx, index._nodes).explain(pod, index._nodes)
    scan = explain(Snapshot(tuple(fleet)), pod, ctx)
    assert fast is not None and fast.reason is reason
    assert fast == scan
    assert index.place(pod, Policy.INSTASLICE, None, lambda: Snapshot(tuple(fleet))) == scan


def test_the_sums_leave_to_the_scan_what_only_node_order_decides() -> None:
    """A nodeSelector (labels differ per node) and a tie the scan breaks by node order."""
    fleet = [_h100("n0", taints=TAINT), _h100("n1", cordoned=True)]
    index = FleetIndex()
    for i, node in enumerate(fleet):
        index.put(node, i)
    ctx = Context(None, Policy.INSTASLICE, ONE_4G)
    why = ShapeWhy(ctx, index._nodes)
    assert why.explain(ONE_4G, index._nodes) is None  # 1 tainted, 1 cordoned: a tie
    selector = replace(ONE_4G, node_selector={"zone": "a"})
    assert why.explain(selector, index._nodes) is None
    snap = Snapshot(tuple(fleet))
    assert index.place(ONE_4G, Policy.INSTASLICE, None, lambda: snap) == place(snap, ONE_4G)


def test_an_order_tidied_one_node_at_a_time_loses_no_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two nodes change; a decision for another shape brings one of them into the 1g order
    (`FleetIndex._tidy`), the next 1g decision the other: the 1g pod must see both (the
    best node is now full, another one is the best)."""
    monkeypatch.setattr(index_module, "ORDER_STALE_KEPT", 0)
    monkeypatch.setattr(index_module, "ORDER_TIDY_NODES", 1)
    one_1g = PodRequest("p", 1000, 0, (SliceRequest("c", "1g.10gb", 1),))
    broken = (("4g.40gb", 0, 4), ("2g.20gb", 4, 2))  # slots 6 and 7 free
    fleet = [_h100("n0", *broken), _h100("n1"), _h100("n2")]
    index = FleetIndex()
    for i, node in enumerate(fleet):
        index.put(node, i)

    def decide(pod: PodRequest) -> Placement | Pending:
        got = index.place(pod, Policy.INSTASLICE, None, lambda: Snapshot(tuple(fleet)))
        assert got == place(Snapshot(tuple(fleet)), pod)
        return got

    assert decide(one_1g).node == "n0"  # type: ignore[union-attr]
    fleet[0], fleet[2] = _h100("n0", ("7g.80gb", 0, 8)), _h100("n2", *broken)
    index.put(fleet[0], 0)
    index.put(fleet[2], 2)
    decide(ONE_4G)
    assert decide(one_1g).node == "n2"  # type: ignore[union-attr]


@given(
    st.lists(st.tuples(st.sampled_from("abcde"), st.none() | st.integers(0, 3)), max_size=40),
    st.integers(0, 5),
)
def test_a_lazy_heap_yields_each_live_entry_once_in_order(
    ops: list[tuple[str, int | None]], stop: int
) -> None:
    """Set, re-set to an older value, discard: only the current entry of each name comes
    out, in (score, key) order, and a walk stopped early puts back what it took."""
    heap = LazyHeap()
    want: dict[str, tuple[int, int]] = {}
    for name, score in ops:
        if score is None:
            heap.discard(name)
            want.pop(name, None)
        else:
            heap.set(name, score, ord(name))
            want[name] = (score, ord(name))
        heap.compact()
    expected = sorted((s, k, n) for n, (s, k) in want.items())
    walk = heap.ascending()
    assert [next(walk) for _ in range(min(stop, len(expected)))] == expected[:stop]
    walk.close()
    assert list(heap.ascending()) == expected
    assert len(heap) == len(expected)
