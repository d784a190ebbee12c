"""The fleet index (common/placement/index.py) decides exactly as the engine's scan.

Covers: hypothesis sequences of adds and removes on random fleets (models, occupancy,
labels, taints, cordons, cpu / memory / pod slots, selectors, several slices per pod),
replayed twice — through the index and by `engine.place` on the snapshot — with every
answer equal, placements and Pending messages alike; every trace of the placement
benchmark's suite under every policy, replayed both ways; and the allocator's
`ClusterState.decide`: the index follows assume / forget, node removal and agents going
down and coming back. Leaves out: the decisions' quality (test_placement*.py) and speed
(`make bench-placement`).
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.placement import POLICIES, suite
from common.placement import Pending, Placement, PodRequest, Policy, SliceRequest, place
from common.placement.engine import clear_caches
from common.placement.replay import AddEvent, Cluster, parse_trace, replay
from tests.integration.allocator_fixtures import (
    make_allocation,
    make_mig_node,
    make_node,
    make_pod,
)
from tests.unit.test_placement_properties import nodes, spec
from webhook.allocator import pods as podlib
from webhook.allocator.state import ClusterState


@st.composite
def fleets_and_events(draw: st.DrawFn) -> tuple[Cluster, list[PodRequest | int]]:
    """A replay cluster built from random node states, and a sequence of pods to add
    (PodRequest) or, by position among the pods held, to remove (int)."""
    states = [draw(nodes(i)) for i in range(draw(st.integers(1, 6)))]
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
                draw(st.sampled_from([0, 500, 4000])),
                draw(st.sampled_from([0, 1 << 30])),
                slices,
                {"zone": "a"} if draw(st.integers(0, 5)) == 0 else {},
            )
        )
    return cluster, events


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleets_and_events())
def test_index_and_scan_decide_alike_through_adds_and_removes(
    case: tuple[Cluster, list[PodRequest | int]],
) -> None:
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
    result = state.decide(request, Policy.INSTASLICE, None)
    assert result == place(state.snapshot(), request)
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
