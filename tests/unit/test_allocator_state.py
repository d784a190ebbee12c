"""The allocator's pure core: pod readers, the cluster model and the queue.

Covers resource accounting (init containers, sidecars, overhead, bound / pinned / allocated
pods, terminal pods), occupancy (allocation slices united with unclaimed MigNode instances),
assume / confirm / forget, the capacity epoch, snapshots with exclusions, gate detection,
the pin update, queue order and the agents' Lease tracker (the pod records and their
trackers: tests/unit/test_allocator_track.py). Leaves out everything with I/O (the
controller, leader election against an API server): tests/integration/test_allocator.py.
"""

from __future__ import annotations

import builtins
from typing import Any

import pytest

from common.constants import GATE_NAME
from common.objects import Phase
from common.placement import Pending, PendingReason, Placement, place
from common.podspec import SliceRequestError
from testkit.builders import GpuSpec, gpu_uuid, make_allocation, make_mig_node, make_node, make_pod
from webhook.allocator import pods as podlib
from webhook.allocator import snapshots
from webhook.allocator.agents import AgentLeases
from webhook.allocator.pods import FIELD_NAME_LABEL, Resources
from webhook.allocator.queue import PlacementQueue
from webhook.allocator.state import ClusterState

pytestmark = pytest.mark.timeout(10)

GiB = 2**30
MiB = 2**20


def cluster(*nodes: str, cpu: str = "8", gpus: int = 1) -> ClusterState:
    state = ClusterState()
    for name in nodes:
        state.upsert_node(make_node(name, cpu=cpu, memory="32Gi", pods=10, gpus=gpus))
        state.upsert_mig_node(make_mig_node(name, ["H100-80GB"] * gpus))
    return state


# --- pod readers --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"cpu": "500m", "memory": "1Gi"}, Resources(500, GiB, 1)),
        ({"cpu": None, "memory": None}, Resources(0, 0, 1)),
        # init peak (2 cpu) beats the app's 500m; memory stays the app's
        (
            {"cpu": "500m", "memory": "1Gi", "init": [("i", {}, "2", "100Mi")]},
            Resources(2000, GiB, 1),
        ),
        # overhead is added on top of the max
        (
            {"cpu": "500m", "memory": "1Gi", "overhead": {"cpu": "250m", "memory": "64Mi"}},
            Resources(750, GiB + 64 * MiB, 1),
        ),
    ],
)
def test_pod_resources(kwargs, expected):
    assert podlib.pod_resources(make_pod("p", **kwargs)) == expected


def test_pod_resources_with_sidecars_follows_the_scheduler():
    pod = make_pod("p", cpu="1", memory="1Gi")
    pod["spec"]["initContainers"] = [
        {"name": "side", "restartPolicy": "Always", "resources": {"requests": {"cpu": "1"}}},
        {"name": "init", "resources": {"requests": {"cpu": "3", "memory": "2Gi"}}},
    ]
    # app + sidecar = 2 cpu; init after the sidecar = 3 + 1 = 4 cpu; memory init 2Gi
    assert podlib.pod_resources(pod) == Resources(4000, 2 * GiB, 1)


def test_requests_default_to_limits():
    pod = make_pod("p", cpu=None, memory=None)
    pod["spec"]["containers"][0]["resources"]["limits"].update(cpu="2", memory="1Gi")
    assert podlib.pod_resources(pod) == Resources(2000, GiB, 1)


@pytest.mark.parametrize(
    ("gates", "ours", "only"),
    [
        ((GATE_NAME,), True, True),
        (("kueue.x-k8s.io/admission", GATE_NAME), True, False),
        (("kueue.x-k8s.io/admission",), False, False),
        ((), False, False),
    ],
)
def test_gate_detection(gates, ours, only):
    pod = make_pod("p", gates=gates)
    assert podlib.has_our_gate(pod) is ours
    assert podlib.only_our_gate(pod) is only


def test_pin_adds_a_term_and_lifts_only_our_gate():
    pod = make_pod("p", gates=(GATE_NAME, "other/gate"))
    pinned = podlib.pin(pod, "n1")
    assert podlib.gates(pinned) == ("other/gate",)
    assert podlib.pinned_node(pinned) == "n1"
    assert podlib.gates(pod) == (GATE_NAME, "other/gate")  # the input is untouched
    assert "schedulingGates" not in podlib.pin(make_pod("q"), "n1")["spec"]


def test_pin_adds_to_every_existing_term():
    terms = [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]},
    ]
    pinned = podlib.pin(make_pod("p", required_terms=terms), "n2")
    out = podlib.required_terms(pinned)
    assert len(out) == 2
    for term in out:
        assert term["matchExpressions"]
        assert term["matchFields"] == [{"key": "metadata.name", "operator": "In", "values": ["n2"]}]
    assert podlib.pinned_node(pinned) == "n2"


def test_pinned_node_needs_every_term_pinned_to_one_node():
    one = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["a"]}]}
    other = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["b"]}]}
    assert podlib.pinned_node(make_pod("p", required_terms=[one])) == "a"
    assert podlib.pinned_node(make_pod("p", required_terms=[one, other])) is None
    assert podlib.pinned_node(make_pod("p", required_terms=[one, {"matchExpressions": []}])) is None
    assert podlib.pinned_node(make_pod("p")) is None


def test_pod_request_reads_slices_selectors_and_tolerations():
    pod = make_pod(
        "p",
        slices={"a": {"1g.10gb": 2}, "b": {"3g.40gb": 1, "1g.10gb+me": 1}},
        node_selector={"pool": "gpu"},
        required_terms=[
            {
                "matchExpressions": [{"key": "zone", "operator": "In", "values": ["z"]}],
                "matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["x"]}],
            }
        ],
        tolerations=[{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        init=[("setup", {}, "1", None)],
        sidecars=[("proxy", {"1g.10gb": 1}, None, None)],
    )
    req = podlib.pod_request(pod)
    assert [(s.container, s.profile, s.count) for s in req.slices] == [
        ("a", "1g.10gb", 2),
        ("b", "3g.40gb", 1),
        ("b", "1g.10gb+me", 1),
        ("proxy", "1g.10gb", 1),
    ]
    assert req.node_selector == {"pool": "gpu"}
    (term,) = req.required_affinity
    assert [(r.key, r.operator, r.values) for r in term] == [
        ("zone", "In", ("z",)),
        (FIELD_NAME_LABEL, "NotIn", ("x",)),
    ]
    assert req.tolerations[0].key == "gpu" and req.tolerations[0].operator == "Exists"
    assert req.cpu_millis == 1000  # the init container's 1 cpu beats the two 100m


def test_a_slice_asked_by_an_init_container_that_is_not_a_sidecar_is_not_read():
    """Only a pod that bypassed admission carries one (docs/contract.md §1); the placer parks
    it (InvalidRequest) rather than hold slices no quota counts."""
    pod = make_pod("p", init=[("setup", {"1g.10gb": 1}, None, None)])
    with pytest.raises(SliceRequestError, match=r"'setup'.*not a sidecar"):
        podlib.pod_request(pod)


def test_unschedulable_and_controller_readers():
    pod = make_pod("p", owner={"kind": "ReplicaSet", "name": "rs", "uid": "u", "controller": True})
    assert podlib.controller_ref(pod) is not None
    assert podlib.controller_ref(make_pod("q")) is None
    pod["status"] = {
        "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]
    }
    assert podlib.is_unschedulable(pod)
    pod["status"]["conditions"][0]["reason"] = "SchedulingGated"
    assert not podlib.is_unschedulable(pod)


# --- accounting ---------------------------------------------------------------------------


def test_free_resources_count_bound_pinned_and_allocated_pods_once():
    state = cluster("n1", "n2")
    bound = make_pod("bound", uid="b", cpu="1", memory="1Gi", node_name="n1", gates=(), claim=None)
    pinned = podlib.pin(make_pod("pinned", uid="p", cpu="2", memory="1Gi"), "n1")
    gated = make_pod("gated", uid="g", cpu="3", memory="1Gi")
    stray = make_pod("stray", uid="s", cpu="4", gates=(), claim=None)  # not promised anywhere
    done = make_pod("done", uid="d", cpu="5", node_name="n1", gates=(), phase="Succeeded")
    for p in (bound, pinned, gated, stray, done):
        state.upsert_pod(p)
    assert state.free("n1") == Resources(8000 - 3000, 32 * GiB - 2 * GiB, 10 - 2)
    alloc = make_allocation(gated, "n1", [("main", "1g.10gb", 0, 0, 1)])
    state.upsert_allocation(alloc)
    assert state.free("n1").cpu_millis == 8000 - 6000
    # once bound, the same pod is still charged once, to the node it is bound to
    state.upsert_pod(make_pod("gated", uid="g", cpu="3", memory="1Gi", node_name="n1", gates=()))
    assert state.free("n1").cpu_millis == 8000 - 6000
    assert state.free("n2") == Resources(8000, 32 * GiB, 10)
    before = state.epoch
    state.remove_pod(bound)
    assert state.free("n1").cpu_millis == 8000 - 5000
    assert state.epoch > before


def test_terminal_pod_frees_its_node():
    state = cluster("n1")
    pod = make_pod("p", uid="p", cpu="2", node_name="n1", gates=())
    state.upsert_pod(pod)
    epoch = state.epoch
    pod["status"] = {"phase": "Failed"}
    state.upsert_pod(pod)
    assert state.free("n1").cpu_millis == 8000
    assert state.epoch > epoch


def test_snapshot_carries_free_resources_and_labels():
    state = cluster("n1", cpu="4")
    state.upsert_pod(make_pod("x", uid="x", cpu="1500m", node_name="n1", gates=()))
    (node,) = state.snapshot().nodes
    assert (node.cpu_millis_free, node.pods_free) == (2500, 9)
    assert node.labels["kubernetes.io/hostname"] == "n1"
    assert [g.model for g in node.gpus] == ["H100-80GB"]


def test_nodes_without_a_mig_node_are_not_offered():
    state = ClusterState()
    state.upsert_node(make_node("plain", model=None))
    state.upsert_mig_node(make_mig_node("ghost"))  # a MigNode without a Node
    assert state.snapshot().nodes == ()


def test_a_node_changed_in_place_keeps_its_place_without_sorting_the_fleet_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 37: after a placement or a departure (one node changed) the snapshot is not
    sorted again (5000 names: most of a decision's time, docs/benchmarks.md); a node added
    or removed still is, and the snapshot is the one a fresh sort gives."""
    sorts: list[int] = []  # sorts of the node cache (a dict of node states by name)

    def counting(xs: Any, **kw: Any) -> list[Any]:
        if isinstance(xs, dict):
            sorts.append(1)
        return builtins.sorted(xs, **kw)

    monkeypatch.setattr(snapshots, "sorted", counting, raising=False)
    state = ClusterState()
    for name in ("n3", "n1", "n2"):
        state.upsert_node(make_node(name))
        state.upsert_mig_node(make_mig_node(name))
    assert [n.name for n in state.snapshot().nodes] == ["n1", "n2", "n3"] and len(sorts) == 1
    pod = make_pod("p", uid="p", claim="cown")
    state.upsert_allocation(make_allocation(pod, "n2", [("main", "1g.10gb", 0, 0, 1)]))
    nodes = state.snapshot().nodes
    assert len(sorts) == 1  # n2 changed in place
    assert [n.name for n in nodes] == ["n1", "n2", "n3"] and nodes[1].gpus[0].occupied
    state.upsert_node(make_node("n0"))
    state.upsert_mig_node(make_mig_node("n0"))
    assert [n.name for n in state.snapshot().nodes] == ["n0", "n1", "n2", "n3"]
    assert len(sorts) == 2
    fresh = ClusterState()
    for name in ("n0", "n1", "n2", "n3"):
        fresh.upsert_node(make_node(name))
        fresh.upsert_mig_node(make_mig_node(name))
    fresh.upsert_allocation(make_allocation(pod, "n2", [("main", "1g.10gb", 0, 0, 1)]))
    assert state.snapshot() == fresh.snapshot()


# --- occupancy ----------------------------------------------------------------------------


def test_occupancy_unites_allocations_and_unclaimed_instances():
    state = ClusterState()
    state.upsert_node(make_node("n1"))
    pod = make_pod("p", uid="p", claim="cown")
    alloc = make_allocation(pod, "n1", [("main", "1g.10gb", 0, 0, 1)])
    state.upsert_allocation(alloc)
    state.upsert_mig_node(
        make_mig_node(
            "n1",
            [
                GpuSpec(
                    slices=[
                        # ours, claimed: not counted twice
                        {
                            "profile": "1g.10gb",
                            "start": 0,
                            "size": 1,
                            "migUUID": "M0",
                            "claim": "cown",
                        },
                        # foreign: occupied, never reused
                        {"profile": "2g.20gb", "start": 2, "size": 2, "migUUID": "M1"},
                        # claimed by an allocation that is gone: still there, still occupied
                        {
                            "profile": "1g.10gb",
                            "start": 5,
                            "size": 1,
                            "migUUID": "M2",
                            "claim": "cold",
                        },
                    ]
                )
            ],
        )
    )
    (gpu,) = state.snapshot().nodes[0].gpus
    assert [(o.start, o.size) for o in gpu.occupied] == [(0, 1), (2, 2), (5, 1)]


def test_an_instance_is_covered_only_by_an_allocation_on_its_own_node():
    """Security issue, item 12: a claim name is unique per namespace, not per cluster. An
    instance on n2 claimed "cdup" is not covered by a live allocation "cdup" (another
    namespace's, on n1): its slots stay occupied."""
    state = ClusterState()
    for n in ("n1", "n2"):
        state.upsert_node(make_node(n))
    pod = make_pod("p", uid="p", claim="cdup", namespace="a")
    state.upsert_allocation(make_allocation(pod, "n1", [("main", "1g.10gb", 0, 0, 1)]))
    held = {"profile": "1g.10gb", "start": 3, "size": 1, "migUUID": "M9", "claim": "cdup"}
    state.upsert_mig_node(make_mig_node("n2", [GpuSpec(slices=[held])]))
    state.upsert_mig_node(make_mig_node("n1", [GpuSpec()]))
    n2 = next(n for n in state.snapshot().nodes if n.name == "n2")
    assert [(o.start, o.size) for o in n2.gpus[0].occupied] == [(3, 1)]


def test_slots_free_only_when_the_allocation_object_is_gone():
    state = cluster("n1")
    pod = make_pod("p", uid="p")
    state.upsert_pod(pod)
    alloc = make_allocation(pod, "n1", [("main", "1g.10gb", 0, 3, 1)], phase=Phase.READY)
    state.upsert_allocation(alloc)
    deleting = make_allocation(pod, "n1", [("main", "1g.10gb", 0, 3, 1)], deleting=True)
    state.upsert_allocation(deleting)
    assert [o.start for o in state.snapshot().nodes[0].gpus[0].occupied] == [3]
    epoch = state.epoch
    state.remove_allocation(deleting)
    assert state.snapshot().nodes[0].gpus[0].occupied == ()
    assert state.epoch > epoch


def test_assume_confirm_forget():
    state = cluster("n1")
    pod = make_pod("p", uid="p", cpu="1")
    state.upsert_pod(pod)
    body = make_allocation(pod, "n1", [("main", "1g.10gb", 0, 0, 1)])
    view = state.assume(body)
    assert state.is_assumed(view.key)
    snap = state.snapshot().nodes[0]
    assert [o.start for o in snap.gpus[0].occupied] == [0]
    assert snap.cpu_millis_free == 7000  # the pod is promised to n1
    state.forget(view.key)
    snap = state.snapshot().nodes[0]
    assert snap.gpus[0].occupied == () and snap.cpu_millis_free == 8000
    # confirm replaces an assumed record; forget never drops a watched one
    state.assume(body)
    state.confirm(body)
    assert not state.is_assumed(view.key)
    state.forget(view.key)
    assert view.key in state.allocations
    state.assume(make_allocation(make_pod("q", uid="q"), "n1", [("main", "1g.10gb", 0, 1, 1)]))
    state.drop_assumed()
    assert list(state.allocations) == [view.key]


def test_snapshot_exclusions_and_name_label():
    state = cluster("n1", gpus=2)
    snap = state.snapshot(exclude={("n1", gpu_uuid("n1", 1))}, name_label=True)
    (node,) = snap.nodes
    assert [g.healthy for g in node.gpus] == [True, False]
    assert node.labels[FIELD_NAME_LABEL] == "n1"
    assert all(g.healthy for g in state.snapshot().nodes[0].gpus)  # the cache is untouched


def test_nodes_whose_agent_is_down_are_left_out_of_placement_only():
    state = cluster("n1", "n2")
    epoch = state.epoch
    assert state.set_agent_down("n1", True)
    assert not state.set_agent_down("n1", True)  # no change
    assert state.epoch == epoch  # less capacity: nothing to retry
    assert [n.name for n in state.snapshot().nodes] == ["n2"]
    assert [n.name for n in state.snapshot(name_label=True).nodes] == ["n2"]
    assert [n.name for n in state.node_states()] == ["n1", "n2"]  # gauges still see it
    assert state.down_agents_placeable() == ["n1"]
    state.set_agent_down("ghost", True)  # a Lease without a Node/MigNode: not in the note
    assert state.down_agents_placeable() == ["n1"]
    assert state.set_agent_down("n1", False)
    assert state.epoch > epoch  # the agent is back: parked pods are retried
    assert [n.name for n in state.snapshot().nodes] == ["n1", "n2"]


@pytest.mark.parametrize(
    ("events", "now", "expired"),
    [
        ([("a", "r1", 40, 0.0)], 40.0, set()),  # exactly the duration: not yet
        ([("a", "r1", 40, 0.0)], 40.1, {"a"}),
        ([("a", "r1", 40, 0.0), ("a", "r1", 40, 30.0)], 41.0, {"a"}),  # same renewTime
        ([("a", "r1", 40, 0.0), ("a", "r2", 40, 30.0)], 41.0, set()),  # renewed at 30
        ([("a", "r1", 40, 0.0), ("a", "r1", 60, 30.0)], 50.0, set()),  # duration raised
        ([("a", "r1", 40, 0.0), ("b", "r1", 10, 0.0)], 20.0, {"b"}),
    ],
)
def test_agent_leases(events, now, expired):
    leases = AgentLeases()
    for node, renew, duration, seen in events:
        leases.observe(node, renew, duration, seen)
    assert leases.expired(now) == expired
    assert {n for n in ("a", "b", "c") if leases.is_expired(n, now)} == expired
    for node in expired:
        leases.forget(node)
    assert leases.expired(now) == set() and not leases.is_expired("a", now)


def test_unhealthy_and_non_mig_gpus():
    state = ClusterState()
    state.upsert_node(make_node("n1", gpus=2))
    state.upsert_mig_node(make_mig_node("n1", [GpuSpec(healthy=False), GpuSpec(mig=False)]))
    gpus = state.snapshot().nodes[0].gpus
    assert [(g.healthy, g.mig_enabled) for g in gpus] == [(False, True), (True, False)]
    result = place(state.snapshot(), podlib.pod_request(make_pod("p")))
    assert isinstance(result, Pending) and result.reason is PendingReason.GPU_UNAVAILABLE


def test_node_changes_bump_the_epoch_only_when_relevant():
    state = cluster("n1")
    epoch = state.epoch
    node = make_node("n1", cpu="8", memory="32Gi", pods=10)
    assert not state.upsert_node(node)  # same content (a heartbeat)
    assert state.epoch == epoch
    node["metadata"]["labels"]["pool"] = "a"
    assert state.upsert_node(node)
    assert state.epoch > epoch


def test_fill_a_gpu_exactly_then_pending_full():
    """The loop's decide/assume cycle, without I/O: seven 1g.10gb fill an H100, the eighth
    is pending as Full, and releasing one makes room."""
    state = cluster("n1")
    placed = []
    for i in range(8):
        pod = make_pod(f"p{i}", uid=f"u{i}", cpu="10m")
        state.upsert_pod(pod)
        result = place(state.snapshot(), podlib.pod_request(pod))
        if isinstance(result, Placement):
            (s,) = result.slices
            body = make_allocation(pod, result.node, [("main", s.profile, s.gpu_index, s.start, 1)])
            state.assume(body)
            placed.append(body)
    assert len(placed) == 7
    assert sorted(a["spec"]["slices"][0]["start"] for a in placed) == list(range(7))
    last = place(state.snapshot(), podlib.pod_request(make_pod("p7", uid="u7")))
    assert isinstance(last, Pending) and last.reason is PendingReason.FULL
    state.forget(f"ns/{placed[3]['metadata']['name']}")
    again = place(state.snapshot(), podlib.pod_request(make_pod("p7", uid="u7")))
    assert isinstance(again, Placement) and again.slices[0].start == 3


def test_pods_by_claim_index():
    state = ClusterState()
    pod = make_pod("p", uid="p", claim="cabc")
    state.upsert_pod(pod)
    found = state.pod_by_claim("ns", "cabc")
    assert found is not None and found.uid == "p"
    state.remove_pod(pod)
    assert state.pod_by_claim("ns", "cabc") is None


# --- queue and trackers -------------------------------------------------------------------


def test_queue_orders_by_priority_then_age_then_name():
    q = PlacementQueue()
    q.push("old-low", priority=0, created="2026-01-01T00:00:00Z", key="ns/b")
    q.push("new-high", priority=10, created="2026-01-02T00:00:00Z", key="ns/c")
    q.push("new-low", priority=0, created="2026-01-02T00:00:00Z", key="ns/a")
    q.push("old-low-2", priority=0, created="2026-01-01T00:00:00Z", key="ns/a")
    q.push("gone", priority=99, created="2026-01-01T00:00:00Z", key="ns/z")
    q.remove("gone")
    q.push("new-low", priority=0, created="2026-01-02T00:00:00Z", key="ns/a")  # no duplicate
    assert len(q) == 4 and "gone" not in q
    order = [q.pop() for _ in range(5)]
    assert order == ["new-high", "old-low-2", "old-low", "new-low", None]


def test_queue_reprioritised_entry_moves():
    q = PlacementQueue()
    q.push("a", priority=0, created="t1", key="ns/a")
    q.push("b", priority=0, created="t2", key="ns/b")
    q.push("b", priority=5, created="t2", key="ns/b")
    assert [q.pop(), q.pop(), q.pop()] == ["b", "a", None]
