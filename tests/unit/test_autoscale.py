"""The autoscaler signal's pure part (webhook.allocator.autoscale) and the shell's bookkeeping
(webhook.allocator.scaleup: verdicts, which signals to raise and withdraw), plus the dev-up
pieces that feed Karpenter (hack.cluster.karpenter, the spec's `autoscaled` key).

Covers: the classification table (every PendingReason; fits once releases complete); which
slices count as being released; `after_releases` (hypothesis: exactly the freed slots go);
placeholder and ProvisioningRequest rendering; raise after the delay, withdraw when placed,
gone, ungated or now waiting; instance types carrying the agent's capacity rule.
Leaves out: the API writes and Karpenter itself (tests/integration/test_provisioning_request.py,
tests/e2e/test_autoscaling.py).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.allocation import SliceAllocation
from common.catalog import load_catalog
from common.constants import SCALE_UP_LABEL
from common.objects import Phase
from common.placement import (
    Gpu,
    NodeState,
    Occupied,
    Pending,
    PendingReason,
    Policy,
    Snapshot,
)
from hack.cluster.autonodes import Group
from hack.cluster.karpenter import instance_types, karpenter_objects, mig_capacity
from hack.cluster.nodes import SpecError, parse_spec
from tests.integration.allocator_fixtures import (
    FakeClock,
    make_allocation,
    make_mig_node,
    make_node,
    make_pod,
)
from tests.integration.allocator_fixtures import mig_capacity as agent_capacity
from webhook.allocator import pods as podlib
from webhook.allocator.autoscale import (
    CAPACITY_REASONS,
    DEFAULT_PROVREQ_CLASS,
    ScaleUpSettings,
    SignalMode,
    after_releases,
    classify,
    condition,
    placeholder_pod,
    provisioning_request,
    releasing,
    signal_name,
)
from webhook.allocator.metrics import AllocatorMetrics
from webhook.allocator.placer import Placer, PreemptionSettings
from webhook.allocator.preemption import Budgets
from webhook.allocator.scaleup import Need, ScaleUp
from webhook.allocator.state import ClusterState
from webhook.allocator.track import Tracks

pytestmark = pytest.mark.timeout(20)
CATALOG = load_catalog()


def one_gpu_node(name: str, occupied: tuple[Occupied, ...] = ()) -> NodeState:
    return NodeState(
        name, {}, (), False, 64_000, 1 << 40, 110, (Gpu(0, "H100-80GB", True, True, occupied),)
    )


def request(profile: str = "3g.40gb") -> Any:
    pod = make_pod("p", slices={"main": {profile: 1}}, uid="u1")
    return podlib.pod_request(pod)


FULL_GPU = (Occupied(0, 4, "3g.40gb"), Occupied(4, 4, "3g.40gb"))


# --- classification -------------------------------------------------------------------------


@pytest.mark.parametrize("reason", list(PendingReason))
def test_every_capacity_reason_needs_a_node_when_nothing_fits(reason: PendingReason) -> None:
    full = Snapshot((one_gpu_node("n1", FULL_GPU),))
    verdict = classify(request(), Pending(reason, "m"), full, Policy.INSTASLICE, CATALOG)
    assert verdict.needs_node == (reason in CAPACITY_REASONS)


def test_capacity_reasons_are_all_but_a_change_under_way() -> None:
    # A new table row for a new reason must be a decision, not an accident.
    assert set(PendingReason) - CAPACITY_REASONS == {PendingReason.MIG_MODE_CHANGE_UNDER_WAY}


def test_a_pod_that_fits_once_releases_complete_waits() -> None:
    freed = Snapshot((one_gpu_node("n1", FULL_GPU[:1]),))  # one of the two slices going
    verdict = classify(
        request(), Pending(PendingReason.FULL, "m"), freed, Policy.INSTASLICE, CATALOG
    )
    assert not verdict.needs_node
    assert "released" in verdict.why


def test_no_node_at_all_needs_a_node() -> None:
    verdict = classify(
        request(),
        Pending(PendingReason.NO_MATCHING_NODE, "no node"),
        Snapshot(()),
        Policy.INSTASLICE,
        CATALOG,
    )
    assert verdict.needs_node
    assert "NoMatchingNode" in verdict.why


def _alloc(pod: dict[str, Any], *, deleting: bool = False) -> SliceAllocation:
    obj = make_allocation(pod, "n1", [("main", "3g.40gb", 0, 4, 4)], deleting=deleting)
    return SliceAllocation.parse(obj)


def test_releasing_counts_deleting_allocations_and_those_of_gone_or_finished_pods() -> None:
    live = make_pod("live", uid="live")
    done = make_pod("done", uid="done")
    gone = make_pod("gone", uid="gone")
    dying = make_pod("dying", uid="dying")
    allocs = [_alloc(live), _alloc(done), _alloc(gone), _alloc(dying, deleting=True)]
    alive = {"live": True, "done": False, "dying": True}
    freed = releasing(allocs, alive)
    assert freed == {"n1": {(0, 4, 4)}}  # three of them, the same slots in this table
    assert releasing(allocs[:1], alive) == {}


slots = st.tuples(st.integers(0, 1), st.integers(0, 7), st.integers(1, 8))


@given(occupied=st.sets(slots, max_size=6), freed=st.sets(slots, max_size=6))
def test_after_releases_frees_exactly_the_named_slots(
    occupied: set[tuple[int, int, int]], freed: set[tuple[int, int, int]]
) -> None:
    gpus = tuple(
        Gpu(
            i, "H100-80GB", True, True, tuple(Occupied(s, n, "x") for g, s, n in occupied if g == i)
        )
        for i in range(2)
    )
    snap = Snapshot((NodeState("n1", gpus=gpus), NodeState("n2", gpus=gpus)))
    out = after_releases(snap, {"n1": freed})
    left = {(g.index, o.start, o.size) for g in out.nodes[0].gpus for o in g.occupied}
    assert left == occupied - freed
    assert out.nodes[1] == snap.nodes[1]  # another node's slots are untouched


# --- rendering ------------------------------------------------------------------------------


def _gated(**kw: Any) -> dict[str, Any]:
    pod = make_pod(
        "train",
        slices={"main": {"3g.40gb": 2}, "side": {"1g.10gb": 1}},
        uid="abc",
        cpu="2",
        memory="1Gi",
        **kw,
    )
    return pod


def test_placeholder_asks_for_what_the_new_node_must_offer() -> None:
    pod = _gated(
        node_selector={"instaslice.io/gpu-model": "H100-80GB"},
        tolerations=[{"key": "gpu", "operator": "Exists"}],
        required_terms=[
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]},
        ],
    )
    body = placeholder_pod(pod, podlib.pod_request(pod), ["n2", "n1"], image="img")
    meta, spec = body["metadata"], body["spec"]
    assert meta["name"] == signal_name("abc") and meta["namespace"] == "ns"
    assert meta["labels"][SCALE_UP_LABEL] == "abc"
    assert meta["ownerReferences"][0]["uid"] == "abc"
    assert "schedulingGates" not in spec and "instaslice.io/claim" not in meta["annotations"]
    (container,) = spec["containers"]
    assert container["image"] == "img"
    assert container["resources"]["requests"] == {
        "instaslice.io/mig-1g.10gb": "1",
        "instaslice.io/mig-3g.40gb": "2",
        "cpu": "4000m",  # two containers of 2 cpu each: the pod's effective request
        "memory": str(2 << 30),
    }
    assert spec["nodeSelector"] == {"instaslice.io/gpu-model": "H100-80GB"}
    assert spec["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    assert "preemptionPolicy" not in spec  # the Priority admission plugin sets it (the class's)
    assert spec["priorityClassName"] == "instaslice-placeholder"
    assert spec["automountServiceAccountToken"] is False
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    keep_off = {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["n1", "n2"]}
    assert [t["matchExpressions"][-1] for t in terms] == [keep_off, keep_off]
    assert [t["matchExpressions"][0]["values"] for t in terms] == [["a"], ["b"]]
    assert pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"][0]["matchExpressions"] == [
        {"key": "zone", "operator": "In", "values": ["a"]}
    ]


def test_placeholder_without_nodes_to_avoid_has_no_affinity() -> None:
    pod = _gated()
    assert "affinity" not in placeholder_pod(pod, podlib.pod_request(pod), [])["spec"]


def test_provisioning_request_names_its_template() -> None:
    pod = _gated()
    template, provreq = provisioning_request(pod, podlib.pod_request(pod), ["n1"])
    assert provreq["apiVersion"] == "autoscaling.x-k8s.io/v1"
    assert provreq["spec"]["provisioningClassName"] == DEFAULT_PROVREQ_CLASS
    assert provreq["spec"]["podSets"] == [
        {"podTemplateRef": {"name": template["metadata"]["name"]}, "count": 1}
    ]
    assert template["metadata"]["ownerReferences"][0]["uid"] == "abc"
    spec = template["template"]["spec"]
    assert spec["containers"][0]["resources"]["requests"]["instaslice.io/mig-3g.40gb"] == "2"


def test_condition_reads_only_true_conditions() -> None:
    provisioned = {"type": "Provisioned", "status": "True", "message": "ok"}
    obj = {"status": {"conditions": [{"type": "Failed", "status": "False"}, provisioned]}}
    assert condition(obj, "Failed") is None
    assert condition(obj, "Provisioned") == {
        "type": "Provisioned",
        "status": "True",
        "message": "ok",
    }
    assert condition({}, "Failed") is None


# --- the shell's bookkeeping ----------------------------------------------------------------


class _Elector:
    def check(self) -> None:
        pass


def _scale_up(state: ClusterState, clock: FakeClock, delay: float = 5.0) -> ScaleUp:
    told: list[tuple[str, str]] = []
    s = ScaleUp(
        kube=None,  # type: ignore[arg-type]  # bookkeeping only: nothing is written here
        elector=_Elector(),  # type: ignore[arg-type]
        state=state,
        settings=ScaleUpSettings(mode=SignalMode.PLACEHOLDER, delay_s=delay),
        policy=Policy.INSTASLICE,
        catalog=CATALOG,
        clock=clock,
        tell=lambda pod, reason, message, type_: told.append((reason, message)),
    )
    return s


def _full_cluster() -> tuple[ClusterState, dict[str, Any]]:
    state = ClusterState()
    state.upsert_node(make_node("n1", gpus=1))
    state.upsert_mig_node(make_mig_node("n1", ["H100-80GB"]))
    holder = make_pod("holder", slices={"main": {"3g.40gb": 2}}, uid="holder")
    state.upsert_pod(holder)
    state.upsert_allocation(
        make_allocation(holder, "n1", [("main", "3g.40gb", 0, 0, 4), ("main", "3g.40gb", 0, 4, 4)],
                        phase=Phase.READY)
    )  # fmt: skip
    pod = make_pod("want", slices={"main": {"3g.40gb": 1}}, uid="want")
    state.upsert_pod(pod)
    return state, pod


def test_raise_after_the_delay_and_withdraw_once_placed() -> None:
    state, pod = _full_cluster()
    clock = FakeClock()
    s = _scale_up(state, clock)
    view = state.pods["want"]
    req = podlib.pod_request(pod)
    s.pending(view, req, Pending(PendingReason.FULL, "full"), False)
    assert s.wanted(clock.monotonic()) == (set(), set())  # not yet: bursts settle first
    clock.t += 5
    assert s.wanted(clock.monotonic()) == ({"want"}, set())
    s.signals["want"] = {"metadata": {"namespace": "ns"}}
    assert s.wanted(clock.monotonic()) == (set(), set())  # raised once
    s.placed("want")
    assert s.wanted(clock.monotonic()) == (set(), set())  # still gated: kept until it is not
    state.upsert_pod({**pod, "spec": {**pod["spec"], "schedulingGates": []}})
    assert s.wanted(clock.monotonic()) == (set(), {"want"})


def test_a_pod_that_now_waits_for_releases_has_its_signal_withdrawn() -> None:
    state, pod = _full_cluster()
    clock = FakeClock()
    s = _scale_up(state, clock, delay=0)
    req = podlib.pod_request(pod)
    s.pending(state.pods["want"], req, Pending(PendingReason.FULL, "full"), False)
    s.signals["want"] = {"metadata": {"namespace": "ns"}}
    holder = state.pods["holder"].obj
    state.upsert_pod({**holder, "status": {"phase": "Succeeded"}})  # its slices go
    s.pending(state.pods["want"], req, Pending(PendingReason.FULL, "full"), False)
    assert "want" in s.waits
    assert s.wanted(clock.monotonic()) == (set(), {"want"})


def _placer(state: ClusterState, scale_up: ScaleUp, preemption: bool) -> Placer:
    placer = Placer(
        state,
        Tracks(),
        AllocatorMetrics(),
        Policy.INSTASLICE,
        CATALOG,
        kick=lambda uid: None,
        tell=lambda pod, reason, message: None,
        pendings=scale_up,
    )
    if preemption:
        placer.preemption = PreemptionSettings(Budgets(), kueue_ok=False, wait_s=60, now=lambda: 0)
    return placer


@pytest.mark.parametrize(
    ("want_priority", "preemption", "needs"),
    [
        (10, True, set()),  # a preemption is planned: room on n1, no new node
        (10, False, {"want"}),  # preemption off: only a new node serves it
        (0, True, {"want"}),  # nobody of lower priority to evict: a new node
    ],
)
def test_a_pod_with_a_planned_preemption_asks_for_no_node(
    want_priority: int, preemption: bool, needs: set[str]
) -> None:
    state = ClusterState()
    state.upsert_node(make_node("n1", gpus=1))
    state.upsert_mig_node(make_mig_node("n1", ["H100-80GB"]))
    holder = make_pod(
        "holder",
        slices={"main": {"3g.40gb": 2}},
        uid="holder",
        priority=0,
        gates=(),
        node_name="n1",
        phase="Running",
    )
    state.upsert_pod(holder)
    state.upsert_allocation(
        make_allocation(holder, "n1", [("main", "3g.40gb", 0, 0, 4), ("main", "3g.40gb", 0, 4, 4)],
                        phase=Phase.READY)
    )  # fmt: skip
    state.upsert_pod(make_pod("want", slices={"main": {"3g.40gb": 1}}, uid="want",
                              priority=want_priority))  # fmt: skip
    s = _scale_up(state, FakeClock(), delay=0)
    placer = _placer(state, s, preemption)
    placer.tracks.ensure("want")
    placer.decide("want")
    assert set(s.needs) == needs
    assert placer.tracks.get("want") is not None
    preempting = placer.tracks.get("want").preempt is not None  # type: ignore[union-attr]
    assert preempting == (needs == set())


def test_a_preemption_planned_later_withdraws_the_need() -> None:
    state, _ = _full_cluster()
    s = _scale_up(state, FakeClock(), delay=0)
    s.needs["want"] = Need(0.0, podlib.pod_request(state.pods["want"].obj), "full")
    s.signals["want"] = {"metadata": {"namespace": "ns"}}
    holder = state.pods["holder"].obj
    state.upsert_pod({**holder, "spec": {**holder["spec"], "priority": -5}})
    state.upsert_pod({**state.pods["want"].obj, "spec": {**state.pods["want"].obj["spec"],
                                                         "priority": 5}})  # fmt: skip
    placer = _placer(state, s, preemption=True)
    placer.tracks.ensure("want")
    placer.decide("want")
    assert s.needs == {}
    assert s.wanted(0.0) == (set(), {"want"})


def test_a_preempted_placeholder_is_raised_again_only_after_a_backoff() -> None:
    state, pod = _full_cluster()
    clock = FakeClock()
    s = _scale_up(state, clock, delay=2)
    s.pending(state.pods["want"], podlib.pod_request(pod), Pending(PendingReason.FULL, "f"), False)
    clock.t += 2
    placeholder = {"metadata": {"namespace": "ns", "labels": {SCALE_UP_LABEL: "want"}}}
    asyncio.run(s._on_signal("ADDED", placeholder))
    asyncio.run(s._on_signal("DELETED", placeholder))  # the kube-scheduler preempted it
    assert s.wanted(clock.monotonic()) == (set(), set())  # not at once: the room is a pod's
    clock.t += 32  # 30 s, then the delay
    assert s.wanted(clock.monotonic()) == ({"want"}, set())
    asyncio.run(s._on_signal("ADDED", placeholder))
    asyncio.run(s._on_signal("DELETED", placeholder))
    clock.t += 32
    assert s.wanted(clock.monotonic()) == (set(), set())  # the wait doubles
    clock.t += 30
    assert s.wanted(clock.monotonic()) == ({"want"}, set())


def test_a_deleted_pod_loses_its_need_and_signal() -> None:
    state, pod = _full_cluster()
    clock = FakeClock()
    s = _scale_up(state, clock, delay=0)
    s.pending(state.pods["want"], podlib.pod_request(pod), Pending(PendingReason.FULL, "f"), False)
    s.signals["want"] = {"metadata": {"namespace": "ns"}}
    state.remove_pod(pod)
    assert s.wanted(clock.monotonic()) == (set(), {"want"})
    assert s.needs == {}


def test_signals_of_pods_still_gated_survive_a_new_term() -> None:
    state, _ = _full_cluster()
    s = _scale_up(state, FakeClock(), delay=0)
    s.signals["want"] = {"metadata": {"namespace": "ns"}}  # listed by a new leader's informer
    assert s.wanted(1000.0) == (set(), set())


def test_off_does_nothing() -> None:
    state, pod = _full_cluster()
    s = _scale_up(state, FakeClock())
    s.settings = ScaleUpSettings(mode=SignalMode.OFF)
    s.pending(state.pods["want"], podlib.pod_request(pod), Pending(PendingReason.FULL, "f"), False)
    assert s.needs == {} and s.waits == set()
    asyncio.run(s.run())  # returns at once


# --- dev-up: the spec and what Karpenter reads ----------------------------------------------


def group(**kw: object) -> dict[str, object]:
    return {"prefix": "auto", "count": 0, "gpus": 8, "model": "H100-80GB", **kw}


def test_autoscaled_group_parses_and_needs_count_zero() -> None:
    spec = parse_spec({"nodes": [group(autoscaled={"max": 4})]})
    (g,) = spec.autoscaled_groups
    assert g.autoscaled_max == 4 and spec.node_names() == []
    with pytest.raises(SpecError, match=r"nodes\[0\]\.count"):
        parse_spec({"nodes": [group(count=1, autoscaled={"max": 2})]})
    with pytest.raises(SpecError, match=r"nodes\[0\]\.autoscaled"):
        parse_spec({"nodes": [group(autoscaled={"max": 0})]})


def test_instance_type_offers_what_the_agent_will_advertise() -> None:
    spec = parse_spec({"nodes": [group(cpu="32", autoscaled={"max": 3})]})
    (g,) = spec.autoscaled_groups
    assert mig_capacity(g, CATALOG) == agent_capacity("H100-80GB", 8)
    (it,) = instance_types([g], CATALOG)
    assert it["resources"]["instaslice.io/mig-3g.40gb"] == "16"
    assert it["resources"]["cpu"] == "32"
    pool = karpenter_objects([g])[1]
    assert pool["spec"]["limits"] == {"nodes": "3", "cpu": "96000m"}
    assert pool["spec"]["template"]["metadata"]["labels"]["instaslice.io/node-group"] == "auto"
    requirement = pool["spec"]["template"]["spec"]["requirements"][0]
    assert requirement["values"] == [it["name"]]


def test_autonodes_group_argument() -> None:
    g = Group.parse("auto-h100=H100-80GB:8:enabled")
    assert (g.prefix, g.model, g.gpus, g.mig_mode) == ("auto-h100", "H100-80GB", 8, "enabled")
    for bad in ("auto", "auto=H100-80GB:8", "auto=H100-80GB:8:on"):
        with pytest.raises(argparse.ArgumentTypeError, match="--group"):
            Group.parse(bad)
