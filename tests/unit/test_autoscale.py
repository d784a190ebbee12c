"""The autoscaler signal's pure part (webhook.allocator.autoscale) and the shell's bookkeeping
(webhook.allocator.scaleup: verdicts, which signals to raise and withdraw), plus the dev-up
pieces that feed Karpenter (hack.cluster.karpenter, the spec's `autoscaled` key).

Covers: the classification table (every PendingReason; fits once releases complete); which
slices count as being released; `after_releases` (hypothesis: exactly the freed slots go);
placeholder and ProvisioningRequest rendering; raise after the delay, withdraw when placed,
gone, ungated or now waiting; instance types carrying the agent's capacity rule; keeping
placeholders off nodes that cannot serve their pod (`kept_off`, `misplaced`: a table and
hypothesis properties, every node name a label value of its own, no flapping) and the loop
replacing one bound to such a node (once, at once, not against make_room's lost wait, late
events of the old one ignored). Whole GPUs: classification and replacement by the whole-GPU
engine (tables; hypothesis: the two rules agree), the `instaslice.io/gpu` placeholder, the
placer telling pending whole-GPU pods after preemption; instance types offering exactly what
the agent's own capacity rule advertises, for every catalog model and MIG mode.
Leaves out: the API writes and Karpenter itself (tests/integration/test_provisioning_request.py,
tests/e2e/test_autoscaling.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import re
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.allocation import SliceAllocation
from common.catalog import load_catalog
from common.constants import (
    GPU_MODEL_LABEL,
    INSTASLICE_GPU,
    NODE_LABEL,
    SCALE_UP_LABEL,
    SIZE_ANNOTATION_PREFIX,
)
from common.kubeapi import ApiError
from common.objects import Phase, node_label_value, node_labelled
from common.placeholders import signal_name
from common.placement import (
    Gpu,
    NodeState,
    Occupied,
    Pending,
    PendingReason,
    Policy,
    Snapshot,
    place,
)
from common.placement.modes import ModeView
from common.placement.whole import WholeView, place_whole
from hack.cluster.autonodes import Group
from hack.cluster.karpenter import instance_types, karpenter_objects, mig_capacity
from hack.cluster.nodes import SpecError, parse_spec
from nodeagent.modechange import ModeChanger
from nodeagent.model import NodeInventory
from nodeagent.report import capacity
from testkit.builders import gpu, make_allocation, make_mig_node, make_node, make_pod
from testkit.builders import mig_capacity as agent_capacity
from testkit.clock import FakeClock
from webhook.allocator import pods as podlib
from webhook.allocator.autoscale import (
    CAPACITY_REASONS,
    DEFAULT_PROVREQ_CLASS,
    ScaleUpSettings,
    SignalMode,
    after_releases,
    classify,
    condition,
    kept_off,
    misplaced,
    placeholder_identity,
    placeholder_pod,
    provisioning_request,
    releasing,
)
from webhook.allocator.metrics import AllocatorMetrics
from webhook.allocator.placer import Placer
from webhook.allocator.preemption import Budgets, PreemptionSettings
from webhook.allocator.scaleup import LOST_BACKOFF_S, ScaleUp
from webhook.allocator.state import ClusterState
from webhook.allocator.track import Need, Tracks
from webhook.allocator.writes import Writes

pytestmark = pytest.mark.timeout(20)
CATALOG = load_catalog()
NO_WHOLE = WholeView()  # no GPU can be whole (read for whole-GPU pods only)


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
    verdict = classify(request(), Pending(reason, "m"), full, Policy.INSTASLICE, CATALOG, NO_WHOLE)
    assert verdict.needs_node == (reason in CAPACITY_REASONS)


def test_capacity_reasons_are_all_but_a_change_under_way() -> None:
    # A new table row for a new reason must be a decision, not an accident.
    assert set(PendingReason) - CAPACITY_REASONS == {PendingReason.MIG_MODE_CHANGE_UNDER_WAY}


def test_a_pod_that_fits_once_releases_complete_waits() -> None:
    freed = Snapshot((one_gpu_node("n1", FULL_GPU[:1]),))  # one of the two slices going
    verdict = classify(
        request(), Pending(PendingReason.FULL, "m"), freed, Policy.INSTASLICE, CATALOG, NO_WHOLE
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
        NO_WHOLE,
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
    # Karpenter refuses kubernetes.io/hostname: the agents' own label (docs/autoscaling.md)
    keep_off = {"key": "instaslice.io/node", "operator": "NotIn", "values": ["n1", "n2"]}
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
    (term,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]  # cluster-autoscaler takes the hostname
    assert term["matchExpressions"] == [
        {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["n1"]}
    ]


# --- keeping placeholders off nodes that cannot serve them (mixed profiles) -----------------

LONG = "n" * 64  # a node name too long for a label value: its value is cut and hashed


def labelled(name: str, value: str | None = "self", **labels: str) -> dict[str, str]:
    """Node labels with `instaslice.io/node` = its agent's value, `value`, or none."""
    own = (
        {} if value is None else {NODE_LABEL: node_label_value(name) if value == "self" else value}
    )
    return {**labels, **own}


def h100(
    name: str,
    occupied: tuple[Occupied, ...] = (),
    *,
    gpus: int = 1,
    label: str | None = "self",
    **labels: str,
) -> NodeState:
    return NodeState(
        name,
        labelled(name, label, **labels),
        (),
        False,
        64_000,
        1 << 40,
        110,
        tuple(Gpu(i, "H100-80GB", True, True, occupied) for i in range(gpus)),
    )


SEVEN_G = (Occupied(0, 8, "7g.80gb"),)
NO_MODES = ModeView()  # every GPU in MIG mode, or off for good


@pytest.mark.parametrize(
    ("node", "profile", "freed", "expected"),
    [
        # the gap: its GPUs full of 7g.80gb, its upper bound still shows room for 1g.10gb
        (h100("n1", SEVEN_G, gpus=2), "1g.10gb", (), True),
        (h100("n1", FULL_GPU), "3g.40gb", (), True),
        (h100("n1", FULL_GPU[:1]), "3g.40gb", (), False),  # room: the pod goes there soon
        (h100("n1", FULL_GPU), "3g.40gb", ((0, 4, 4),), False),  # room once released
        (h100("n1", FULL_GPU, label=None), "3g.40gb", (), False),  # no label: would flap
        (h100("n1", FULL_GPU, label="4242"), "3g.40gb", (), False),  # Karpenter's, not back
        (h100(LONG, FULL_GPU), "3g.40gb", (), True),  # its value cut and hashed
        (h100(LONG, FULL_GPU, label=LONG[:63]), "3g.40gb", (), False),  # not its agent's
        (NodeState("n1", labelled("n1")), "3g.40gb", (), False),  # coming up: no GPUs yet
        (None, "3g.40gb", (), False),  # unknown to the allocator, or its agent is down
    ],
    ids=["mixed-profiles", "full", "room", "releasing", "unlabelled", "karpenter-value",
         "long-name", "long-name-cut-only", "no-gpus", "unknown"],
)  # fmt: skip
def test_misplaced(
    node: NodeState | None, profile: str, freed: tuple[tuple[int, int, int], ...], expected: bool
) -> None:
    assert (
        misplaced(node, request(profile), freed, Policy.INSTASLICE, CATALOG, NO_MODES, NO_WHOLE)
        is expected
    )


MIG_OFF = h100("n1", (), gpus=2)
MIG_OFF = dataclasses.replace(
    MIG_OFF, gpus=tuple(dataclasses.replace(g, mig_enabled=False) for g in MIG_OFF.gpus)
)
FLEX = ModeView(flex=frozenset({("n1", 0), ("n1", 1)}))
UNDER_WAY = ModeView(
    needs_reset=frozenset({("n1", 0), ("n1", 1)}), under_way=frozenset({("n1", 0)})
)


@pytest.mark.parametrize(
    ("modes", "expected"),
    [
        (FLEX, False),  # Karpenter's new node: MIG off, turned on for the pod without a reset
        (UNDER_WAY, False),  # a change to MIG on under way: the pod goes there once done
        (NO_MODES, True),  # MIG off and nothing will turn it on: it cannot go there
    ],
    ids=["flex", "under-way", "off-for-good"],
)
def test_misplaced_counts_mig_mode_on_demand(modes: ModeView, expected: bool) -> None:
    """By the placer's own rule: a labelled node whose GPUs have MIG off, which its agent
    turns on for the pod, is where the pod goes; replacing its placeholder there would send
    Karpenter for a second node."""
    assert (
        misplaced(MIG_OFF, request("1g.10gb"), (), Policy.INSTASLICE, CATALOG, modes, NO_WHOLE)
        is expected
    )


def test_kept_off_names_the_known_nodes_the_pod_could_be_sent_to() -> None:
    nodes = [
        h100("b", FULL_GPU, zone="a"),
        h100("a", zone="a"),  # room today: classify said none serves it, so kept off too
        h100("c", FULL_GPU, label=None, zone="a"),  # not labelled yet: named all the same
        h100("other-zone", FULL_GPU, zone="b"),  # its own selector keeps it off
        NodeState("coming-up", labelled("coming-up", zone="a")),  # no GPUs known
        h100(LONG, FULL_GPU, zone="a"),  # named by its cut and hashed value
    ]
    pod = make_pod("p", slices={"main": {"3g.40gb": 1}}, uid="u1", node_selector={"zone": "a"})
    assert kept_off(nodes, podlib.pod_request(pod)) == ["a", "b", "c", node_label_value(LONG)]


def test_a_nodes_label_value_is_its_name_when_it_can_be_one() -> None:
    assert node_label_value("ip-10-0-0-1.ec2.internal") == "ip-10-0-0-1.ec2.internal"
    assert node_label_value("n" * 63) == "n" * 63
    assert node_label_value(LONG) == "n" * 50 + "-" + hashlib.sha256(LONG.encode()).hexdigest()[:12]
    assert node_labelled({NODE_LABEL: "n1"}, "n1")
    assert not node_labelled({NODE_LABEL: "4242"}, "n1") and not node_labelled({}, "n1")
    assert not node_labelled({NODE_LABEL: LONG[:63]}, LONG)


dns_label = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,40}[a-z0-9])?", fullmatch=True)
LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")


@settings(deadline=None)
@given(parts=st.lists(dns_label, min_size=1, max_size=8), other=st.lists(dns_label, min_size=1))
def test_every_node_name_has_one_label_value_of_its_own(parts: list[str], other: list[str]) -> None:
    """Any node name (a DNS subdomain) gets a valid label value: itself when short enough,
    else cut and hashed; two names never share one (a node kept off for another's sake
    would be a node lost to the autoscaler)."""
    name = ".".join(parts)
    value = node_label_value(name)
    assert len(value) <= 63 and LABEL_VALUE.fullmatch(value), value
    assert (value == name) is (len(name) <= 63)
    second = ".".join(other)
    if second != name:
        assert node_label_value(second) != value


occupancy = st.lists(
    st.sampled_from([(0, 8, "7g.80gb"), (0, 4, "3g.40gb"), (4, 4, "3g.40gb"), (0, 1, "1g.10gb"),
                     (6, 1, "1g.10gb"), (4, 2, "2g.20gb")]),
    max_size=3,
    unique=True,
)  # fmt: skip


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])  # the engine's first
@given(  # call fills its tables: slow on a loaded machine, which a deadline calls flaky
    occupied=st.lists(occupancy, min_size=1, max_size=2),
    profile=st.sampled_from(["1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]),
    label=st.sampled_from(["self", None, "4242"]),
    zone=st.sampled_from(["a", "b"]),
    freed=st.sets(
        st.tuples(st.integers(0, 1), st.sampled_from([0, 4, 6]), st.sampled_from([1, 4, 8]))
    ),
)
def test_a_replaced_placeholder_cannot_land_where_it_stood(
    occupied: list[list[tuple[int, int, str]]],
    profile: str,
    label: str | None,
    zone: str,
    freed: set[tuple[int, int, int]],
) -> None:
    """No flapping: a placeholder is replaced only when its pod fits nowhere on that node,
    even once its releases are gone, and the replacement is kept off that node — by the
    `NotIn` (the node is in `kept_off`) or by the pod's own selector, which it copies."""
    gpus = tuple(
        Gpu(i, "H100-80GB", True, True, tuple(Occupied(s, n, p) for s, n, p in occ))
        for i, occ in enumerate(occupied)
    )
    node = NodeState("n1", labelled("n1", label, zone=zone), gpus=gpus)
    pod = make_pod("p", slices={"main": {profile: 1}}, uid="u1", node_selector={"zone": "a"})
    req = podlib.pod_request(pod)
    if misplaced(node, req, freed, Policy.INSTASLICE, CATALOG, NO_MODES, NO_WHOLE):
        alone = after_releases(Snapshot((node,)), {"n1": freed})
        assert isinstance(place(alone, req, Policy.INSTASLICE, CATALOG), Pending)
        body = placeholder_pod(pod, req, kept_off([node], req))
        assert "n1" in kept_off([node], req) or zone != "a"
        assert label == "self"  # the NotIn matches the node's label
        if zone == "a":
            term = body["spec"]["affinity"]["nodeAffinity"][
                "requiredDuringSchedulingIgnoredDuringExecution"
            ]["nodeSelectorTerms"][0]
            assert {"key": NODE_LABEL, "operator": "NotIn", "values": ["n1"]} in term[
                "matchExpressions"
            ]


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
        writes=Writes(None, _Elector(), clock, "allocator-0"),  # type: ignore[arg-type]
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


def test_a_pod_whose_affinity_names_its_nodes_waits() -> None:
    """A pod that selects nodes by `matchFields metadata.name` asks for no node: a new one,
    named by its provisioner, never matches, and a placeholder copying the names would bind
    on a named node it cannot serve and be replaced every round."""
    state, pod = _full_cluster()
    clock = FakeClock()
    s = _scale_up(state, clock)
    s.pending(state.pods["want"], podlib.pod_request(pod), Pending(PendingReason.FULL, "f"), True)
    clock.t += 60
    assert s.wanted(clock.monotonic()) == (set(), set()) and set(s.waits) == {"want"}
    s.pending(state.pods["want"], podlib.pod_request(pod), Pending(PendingReason.FULL, "f"), False)
    clock.t += 60
    assert s.wanted(clock.monotonic()) == ({"want"}, set())  # by labels, it asks


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
    placeholder = _bound("want", None)
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
    assert s.needs == {} and set(s.waits) == set()
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


@pytest.mark.parametrize("mig_mode", ["enabled", "disabled"])
@pytest.mark.parametrize("model", [m.name for m in CATALOG.models])
def test_instance_type_offers_exactly_what_the_agent_advertises(model: str, mig_mode: str) -> None:
    """The node agent's own rule (`nodeagent.report.capacity` with its mode changer): the
    `instaslice.io/mig-*` upper bound of GPUs in MIG mode or turned on without a reset, and
    `instaslice.io/gpu`, the GPUs that can be whole (MIG off, or turned off without a
    reset: Hopper and newer). Karpenter waits for every resource an instance type offers to
    appear on the node before it calls it initialized, and picks no type lacking one a
    placeholder asks; so the two must agree for every catalog model and MIG mode."""
    spec = parse_spec({"nodes": [group(model=model, migMode=mig_mode, gpus=2,
                                       autoscaled={"max": 1})]})  # fmt: skip
    (g,) = spec.autoscaled_groups
    arch = CATALOG.model(model).architecture  # type: ignore[union-attr]
    inv = NodeInventory(
        gpus=tuple(
            dataclasses.replace(gpu(i, f"GPU-{i}", model, mig_mode), architecture=arch)
            for i in range(2)
        )
    )
    modes = ModeChanger(st=SimpleNamespace(toggle_refused=set()), gpus=None, metrics=None)  # type: ignore[arg-type]
    agent = capacity(inv, {}, modes.can_enable, modes.can_be_whole)
    (it,) = instance_types([g], CATALOG)
    offered = {k: v for k, v in it["resources"].items() if k.startswith("instaslice.io/")}
    assert offered == {k: v for k, v in agent.items() if v != "0"}
    assert ("instaslice.io/gpu" in offered) is (mig_mode == "disabled" or arch != "ampere")


def test_autonodes_group_argument() -> None:
    g = Group.parse("auto-h100=H100-80GB:8:enabled")
    assert (g.prefix, g.model, g.gpus, g.mig_mode) == ("auto-h100", "H100-80GB", 8, "enabled")
    for bad in ("auto", "auto=H100-80GB:8", "auto=H100-80GB:8:on"):
        with pytest.raises(argparse.ArgumentTypeError, match="--group"):
            Group.parse(bad)


def _bound(uid: str, node: str | None) -> dict[str, Any]:
    """A placeholder signal as the informer holds it, bound to `node` (None: not yet)."""
    pod = make_pod("p", uid=uid)
    return placeholder_identity(placeholder_pod(pod, podlib.pod_request(pod), [])) | {
        "spec": {"nodeName": node} if node else {}
    }


def test_the_signals_in_a_pins_way() -> None:
    """Before `own` is pinned to n2: its own signal (wherever it stands), every
    placeholder on n2, also that of a pod still waiting for a node (left there, the
    kube-scheduler preempts it, kubernetes#141694), and every unwanted one wherever it
    stands (the scheduler may bind it to n2 meanwhile) go; a waiting pod's placeholder on
    another node stays."""
    state, _ = _full_cluster()
    clock = FakeClock()
    s = _scale_up(state, clock, delay=0)
    for uid in ("own", "decided", "elsewhere", "unbound", "needs", "far", "gone"):
        state.upsert_pod(make_pod(uid, slices={"main": {"3g.40gb": 1}}, uid=uid))
    for uid, node in (("own", "n2"), ("decided", "n2"), ("elsewhere", "n3"), ("unbound", "n2")):
        pod = state.pods[uid].obj
        state.upsert_allocation(make_allocation(pod, node, [("main", "3g.40gb", 0, 0, 4)]))
    for uid in ("needs", "far"):
        req = podlib.pod_request(state.pods[uid].obj)
        s.pending(state.pods[uid], req, Pending(PendingReason.FULL, "full"), False)
    state.remove_pod(state.pods["gone"].obj)
    s.signals = {
        "own": _bound("own", "n1"),
        "decided": _bound("decided", "n2"),
        "elsewhere": _bound("elsewhere", "n3"),
        "unbound": _bound("unbound", None),
        "needs": _bound("needs", "n2"),
        "far": _bound("far", "n3"),
        "gone": _bound("gone", "n2"),
    }
    unwanted = ["decided", "elsewhere", "gone", "own", "unbound"]  # own: decided too
    assert s.in_the_way("own", "n2") == sorted([*unwanted, "needs"])
    assert s.in_the_way("nobody", "n4") == unwanted


class _Kube:
    """Records creates and deletes; a delete of a name in `refuse` fails (500), a create
    answers once `answer` is set."""

    def __init__(self, refuse: tuple[str, ...] = (), bound: tuple[Any, ...] = ()) -> None:
        self.calls: list[str] = []
        self.refuse = refuse
        self.answer = asyncio.Event()
        self.bound = bound  # what a list of placeholders on a node answers
        self.created: list[dict[str, Any]] = []

    async def list(self, path: str, **query: Any) -> dict[str, Any]:
        self.calls.append(f"list {query.get('fieldSelector')}")
        return {"items": list(self.bound)}

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(f"create {body['metadata']['name']}")
        self.created.append(body)
        await self.answer.wait()
        return body

    async def delete_ignore_missing(self, path: str, **query: Any) -> None:
        name = path.rsplit("/", 1)[-1]
        await asyncio.sleep(0)
        if name in self.refuse:
            raise ApiError(500, "InternalError", "refused")
        self.calls.append(f"delete {name}")


def _decided(state: ClusterState, uid: str, node: str) -> None:
    state.upsert_pod(make_pod(uid, slices={"main": {"3g.40gb": 1}}, uid=uid))
    state.upsert_allocation(
        make_allocation(state.pods[uid].obj, node, [("main", "3g.40gb", 0, 0, 4)])
    )


def test_make_room_deletes_before_it_returns() -> None:
    """`make_room` awaits each delete (the pin is written after it returns), callers at
    the same time share one, and the signal is forgotten."""
    state, _ = _full_cluster()
    kube = _Kube()
    s = _scale_up(state, FakeClock(), delay=0)
    s.writes.kube = kube  # type: ignore[assignment]
    state.upsert_pod(make_pod("own", slices={"main": {"3g.40gb": 1}}, uid="own"))
    own = state.pods["own"].obj
    state.upsert_allocation(make_allocation(own, "n1", [("main", "3g.40gb", 0, 0, 4)]))
    s.signals = {"own": _bound("own", "n1")}

    async def two_pins_and_the_round() -> None:  # at once: they share one delete
        s.synced.set()
        await asyncio.gather(s.make_room("own", "n1"), s.make_room("own", "n1"), s.reconcile())

    asyncio.run(two_pins_and_the_round())
    assert kube.calls == [f"delete {signal_name('own')}"]
    assert s.signals == {}


def _own_decided_on_n2_want_waits(kube: _Kube, clock: FakeClock) -> tuple[ClusterState, ScaleUp]:
    """The full cluster with `own` decided on n2 and `want` pending (full), its need noted."""
    state, _ = _full_cluster()
    s = _scale_up(state, clock, delay=0)
    s.writes.kube = kube  # type: ignore[assignment]
    state.upsert_pod(make_pod("own", slices={"main": {"3g.40gb": 1}}, uid="own"))
    own = state.pods["own"].obj
    state.upsert_allocation(make_allocation(own, "n2", [("main", "3g.40gb", 0, 0, 4)]))
    req = podlib.pod_request(state.pods["want"].obj)
    s.pending(state.pods["want"], req, Pending(PendingReason.FULL, "full"), False)
    return state, s


def test_a_waiting_pods_placeholder_made_room_for_asks_again_after_the_lost_wait() -> None:
    """The placeholder of a pod still waiting for a node, withdrawn from the node other
    pods are pinned to, is raised again only after `lost`'s wait (at once, it would take the
    pinned pods' room back), counted once for two pins at once and not again when its
    DELETED event comes."""
    kube, clock = _Kube(), FakeClock()
    state, s = _own_decided_on_n2_want_waits(kube, clock)
    state.upsert_pod(make_pod("other", slices={"main": {"3g.40gb": 1}}, uid="other"))
    other = state.pods["other"].obj
    state.upsert_allocation(make_allocation(other, "n2", [("main", "3g.40gb", 0, 4, 4)]))
    s.signals = {"want": _bound("want", "n2")}

    async def two_pins_to_n2() -> None:  # at once: one delete, counted once
        s.synced.set()
        await asyncio.gather(s.make_room("own", "n2"), s.make_room("other", "n2"))

    asyncio.run(two_pins_to_n2())
    assert kube.calls == [f"delete {signal_name('want')}"] and s.signals == {}
    asyncio.run(s._on_signal("DELETED", _bound("want", "n2")))
    assert s.needs["want"].lost == 1
    clock.t += LOST_BACKOFF_S - 1
    assert s.wanted(clock.monotonic()) == (set(), set())  # not at once: the room is own's
    clock.t += 1
    assert s.wanted(clock.monotonic()) == ({"want"}, set())


def test_make_room_asks_the_api_server_where_a_placeholder_unbound_to_it_stands() -> None:
    """The watch still shows `want`'s placeholder unbound, but the scheduler has bound it to
    n2 (the event on its way to a busy allocator): before `own`'s pin to n2 make_room lists
    the placeholders bound to n2 and deletes it too, counted as lost like one it knew was
    there. With every signal bound as far as the watch told, nothing is listed."""
    now = _bound("want", "n2")
    now["metadata"]["uid"] = "ph-now"  # as the API server answers (the watch has not told)
    kube = _Kube(bound=(now,))
    _, s = _own_decided_on_n2_want_waits(kube, FakeClock())
    s.signals = {"want": _bound("want", None)}

    async def pin_to_n2() -> None:
        s.synced.set()
        await s.make_room("own", "n2")

    asyncio.run(pin_to_n2())
    assert kube.calls == ["list spec.nodeName=n2", f"delete {signal_name('want')}"]
    assert s.signals == {}
    asyncio.run(s._on_signal("DELETED", now))
    assert s.needs["want"].lost == 1

    kube.calls.clear()
    s.signals = {"want": _bound("want", "n1")}  # bound elsewhere, as far as the watch told
    asyncio.run(pin_to_n2())
    assert kube.calls == []  # nothing unbound: no list, and n1's placeholder stays
    assert set(s.signals) == {"want"}


def test_make_room_never_waits_for_the_terms_listing() -> None:
    """make_room reads the signals as the term's watches listed them: the controller starts
    a term's pins only once they have (`ScaleUp.listed`; test_allocator_controller.py
    `test_a_term_pins_nothing_before_the_signal_watches_listed`), so it never waits for
    the listing itself, even before `synced` is set."""
    state, _ = _full_cluster()
    s = _scale_up(state, FakeClock(), delay=0)
    kube = _Kube()
    s.writes.kube = kube  # type: ignore[assignment]
    _decided(state, "own", "n1")

    async def listing_then_pin() -> None:
        await s._on_signal("ADDED", _bound("own", "n1"))  # the listing
        await asyncio.wait_for(s.make_room("own", "n1"), 5)  # synced is never set here

    asyncio.run(listing_then_pin())
    assert kube.calls == [f"delete {signal_name('own')}"]


def test_make_room_waits_for_the_pods_own_create_in_flight() -> None:
    """The pod was decided and is pinned while its placeholder's create is in flight:
    make_room waits for the create's answer, then deletes it before the pin."""
    state, pod = _full_cluster()
    s = _scale_up(state, FakeClock(), delay=0)
    kube = _Kube()
    s.writes.kube = kube  # type: ignore[assignment]
    s.pending(state.pods["want"], podlib.pod_request(pod), Pending(PendingReason.FULL, "f"), False)
    name = signal_name("want")

    async def raise_decide_pin() -> None:
        s.synced.set()
        raising = asyncio.create_task(s.reconcile())
        await asyncio.sleep(0.01)
        assert kube.calls == [f"create {name}"]  # in flight
        state.upsert_allocation(make_allocation(pod, "n1", [("main", "3g.40gb", 0, 0, 4)]))
        s.placed("want")  # decided meanwhile
        room = asyncio.create_task(s.make_room("want", "n1"))
        await asyncio.sleep(0.01)
        assert not room.done()  # waits for the create's answer
        kube.answer.set()
        await room
        await raising

    asyncio.run(raise_decide_pin())
    assert kube.calls == [f"create {name}", f"delete {name}"]
    assert s.signals == {}


def test_a_placeholder_bound_before_its_create_answered_is_held_bound() -> None:
    """Under load the watch shows the new placeholder, and the scheduler binding it, before
    its create's answer reaches the allocator: the answer is the object as written
    (unbound), older than what the watch showed, so it does not replace the bound view
    (else a misplaced placeholder would never be seen bound, and never replaced)."""
    state, pod = _full_cluster()
    s = _scale_up(state, FakeClock(), delay=0)
    kube = _Kube()
    s.writes.kube = kube  # type: ignore[assignment]
    s.pending(state.pods["want"], podlib.pod_request(pod), Pending(PendingReason.FULL, "f"), False)
    create = kube.create

    async def watch_first(path: str, body: dict[str, Any]) -> dict[str, Any]:
        kube.answer.set()
        made = await create(path, body)
        made["metadata"] |= {"uid": "ph", "resourceVersion": "x1"}
        bound = placeholder_identity(made) | {"spec": {"nodeName": "n1"}}
        bound["metadata"] = {**bound["metadata"], "resourceVersion": "x2"}
        await s._on_signal("ADDED", placeholder_identity(made))
        await s._on_signal("MODIFIED", bound)
        return made

    kube.create = watch_first  # type: ignore[method-assign]
    asyncio.run(s.reconcile())
    assert s.signals["want"]["spec"] == {"nodeName": "n1"}
    assert s.signals["want"]["metadata"]["resourceVersion"] == "x2"


def test_make_room_needs_only_its_own_delete_to_succeed() -> None:
    """Another pod's placeholder whose delete fails does not hold the pin back (logged;
    the round tries it again); the pod's own failing does."""
    state, _ = _full_cluster()
    s = _scale_up(state, FakeClock(), delay=0)
    _decided(state, "own", "n1")
    _decided(state, "other", "n1")
    s.signals = {"own": _bound("own", "n1"), "other": _bound("other", "n1")}
    s.writes.kube = _Kube(refuse=(signal_name("other"),))  # type: ignore[assignment]

    async def pin(uid: str) -> None:
        s.synced.set()
        await s.make_room(uid, "n1")

    asyncio.run(pin("own"))
    assert set(s.signals) == {"other"}
    with pytest.raises(ApiError):
        asyncio.run(pin("other"))
    assert set(s.signals) == {"other"}


def _full_labelled_cluster(label: bool = True) -> tuple[ClusterState, ScaleUp, _Kube]:
    """`_full_cluster` with n1 labelled by its agent (or not), `want` needing a node, and
    its placeholder bound to n1 (raised before n1 filled): the kube-scheduler put it there,
    as n1's upper bound still shows room."""
    state, pod = _full_cluster()
    labels = {NODE_LABEL: "n1"} if label else {}
    state.upsert_node(make_node("n1", gpus=1, labels=labels))
    kube = _Kube()
    kube.answer.set()
    s = _scale_up(state, FakeClock(), delay=0)
    s.writes.kube = kube  # type: ignore[assignment]
    s.pending(state.pods["want"], podlib.pod_request(pod), Pending(PendingReason.FULL, "f"), False)
    old = _bound("want", "n1")
    old["metadata"].update(uid="old", resourceVersion="10")
    s.signals = {"want": old}
    s.synced.set()
    return state, s, kube


def _keep_off(body: dict[str, Any]) -> list[dict[str, Any]]:
    terms = body["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    return [e for t in terms["nodeSelectorTerms"] for e in t["matchExpressions"]]


def test_a_placeholder_bound_to_a_node_that_cannot_serve_its_pod_is_replaced_once() -> None:
    """Bound to n1 before n1 filled: deleted and raised again at once (no lost wait: it
    was ours to delete), kept off n1; the old one's late DELETED changes nothing, and the
    next rounds leave the replacement be (unbound, it cannot land on n1 again)."""
    _, s, kube = _full_labelled_cluster()
    told: list[str] = []
    s.tell = lambda pod, reason, message, type_: told.append(message)
    name = signal_name("want")
    asyncio.run(s.reconcile())
    assert kube.calls == [f"delete {name}", f"create {name}"]
    made = s.signals["want"]
    assert {"key": NODE_LABEL, "operator": "NotIn", "values": ["n1"]} in _keep_off(kube.created[-1])
    assert made == placeholder_identity(kube.created[-1])  # only who it is and where is kept
    assert s.needs["want"].lost == 0
    assert told and "replaces the one bound to n1" in told[-1]
    gone = _bound("want", "n1")
    gone["metadata"].update(uid="old", resourceVersion="11")  # before the create (rv 12)
    made["metadata"].update(uid="new", resourceVersion="12")
    asyncio.run(s._on_signal("DELETED", gone))
    asyncio.run(s._on_signal("MODIFIED", gone))
    assert s.signals["want"] is made and s.needs["want"].lost == 0
    asyncio.run(s.reconcile())
    asyncio.run(s.reconcile())
    assert kube.calls == [f"delete {name}", f"create {name}"]


def test_a_replaced_placeholders_late_events_are_older_whatever_the_resource_versions() -> None:
    """resourceVersions are opaque (equality only): the replaced placeholder's late events,
    arriving after the replacement's create answered, are told older by the watch's order
    (the replacement not shown yet), not by reading the versions as numbers. Once the
    watch shows the replacement, another object of that name is news again."""
    _, s, _ = _full_labelled_cluster()
    asyncio.run(s.reconcile())
    made = s.signals["want"]
    made["metadata"].update(uid="new", resourceVersion="b7")  # not a number
    gone = _bound("want", "n1")
    gone["metadata"].update(uid="old", resourceVersion="c9")  # not one either
    asyncio.run(s._on_signal("MODIFIED", gone))
    asyncio.run(s._on_signal("DELETED", gone))
    assert s.signals["want"] is made and s.needs["want"].lost == 0
    echo = _bound("want", None)
    echo["metadata"].update(uid="new", resourceVersion="b7")
    asyncio.run(s._on_signal("ADDED", echo))  # the watch caught up
    other = _bound("want", "n2")
    other["metadata"].update(uid="other", resourceVersion="a1")
    asyncio.run(s._on_signal("DELETED", other))  # after the echo: news, not a late event
    assert "want" not in s.signals and s.needs["want"].lost == 1


def test_the_echo_of_a_withdrawn_placeholder_does_not_hold_back_its_replacement() -> None:
    """The watch's MODIFIED of the old placeholder (deletion under way) runs between the
    withdrawal's answer and the round going on (seen under load): it is not held again, so
    the replacement is raised at once, and the old one's DELETED is no loss (no 30 s wait)."""
    _, s, kube = _full_labelled_cluster()
    name = signal_name("want")
    deleting = _bound("want", "n1")
    deleting["metadata"].update(
        uid="old", resourceVersion="11", deletionTimestamp="2026-12-02T14:17:56Z"
    )
    delete = kube.delete_ignore_missing
    echoes: list[asyncio.Task[None]] = []

    async def delete_then_echo(path: str, **query: Any) -> None:
        await delete(path, **query)
        echoes.append(asyncio.create_task(s._on_signal("MODIFIED", deleting)))  # before the round

    kube.delete_ignore_missing = delete_then_echo  # type: ignore[method-assign]
    asyncio.run(s.reconcile())
    assert kube.calls == [f"delete {name}", f"create {name}"] and echoes[0].done()
    s.signals["want"]["metadata"].update(uid="new", resourceVersion="12")
    asyncio.run(s._on_signal("DELETED", deleting))
    assert s.needs["want"].lost == 0 and "want" in s.signals


@pytest.mark.parametrize(
    ("label", "room"),
    [(False, False), (True, True)],
    ids=["n1-not-labelled", "n1-has-room"],
)
def test_a_placeholder_is_left_where_it_stands_unless_replacing_it_helps(
    label: bool, room: bool
) -> None:
    """Not labelled (an older agent, or Karpenter's value not yet written back), the
    replacement's NotIn could not keep it off n1: replacing it would flap. Room on n1:
    the pod goes there soon."""
    state, s, kube = _full_labelled_cluster(label)
    if room:
        holder = state.pods["holder"].obj
        state.upsert_allocation(
            make_allocation(holder, "n1", [("main", "3g.40gb", 0, 0, 4)], phase=Phase.READY)
        )  # one of its two slices only
    asyncio.run(s.reconcile())
    assert kube.calls == []
    assert s.misplaced() == {}


def test_a_replacement_waits_out_the_lost_wait_of_a_make_room_at_the_same_time() -> None:
    """A pin to n1 withdraws the same placeholder meanwhile: one delete, shared; the pod
    asks again only after `lost`'s wait (make_room's rule), not at once."""
    state, s, kube = _full_labelled_cluster()
    _decided(state, "own", "n1")
    name = signal_name("want")

    async def pin_and_round() -> None:
        await asyncio.gather(s.make_room("own", "n1"), s.reconcile())

    asyncio.run(pin_and_round())
    assert kube.calls == [f"delete {name}"]
    assert s.needs["want"].lost == 1 and "want" not in s.signals
    assert s.wanted(s.clock.monotonic()) == (set(), set())


def test_a_deleted_event_of_our_own_delete_in_flight_is_no_loss() -> None:
    """The watch's DELETED can come before the delete's answer: still no lost wait."""
    _, s, _ = _full_labelled_cluster()
    s.needs["want"].since = 0.0
    held = s.signals["want"]

    async def withdraw_with_the_event_first() -> None:
        task = s._withdrawal("want")
        await s._on_signal("DELETED", held)
        await task

    asyncio.run(withdraw_with_the_event_first())
    assert s.needs["want"].lost == 0 and "want" not in s.signals


def test_placeholder_identity_keeps_who_and_where_only() -> None:
    """The allocator keeps of a placeholder only what it reads: identity, labels and its
    binding; the NotIn list (the body's bulk at scale) is dropped."""
    pod = make_pod("p", slices={"main": {"1g.10gb": 1}}, uid="u1")
    req = podlib.pod_request(pod)
    body = placeholder_pod(pod, req, [f"n{i}" for i in range(5000)])
    body["metadata"].update(uid="ph", resourceVersion="7")
    kept = placeholder_identity(body)
    assert kept["spec"] == {} and kept["metadata"]["uid"] == "ph"
    assert kept["metadata"]["labels"][SCALE_UP_LABEL] == "u1"
    assert placeholder_identity({**body, "spec": {**body["spec"], "nodeName": "n9"}})["spec"] == {
        "nodeName": "n9"
    }
    assert len(json.dumps(kept)) < 500 < 40_000 < len(json.dumps(body))


def test_one_round_lists_the_nodes_to_keep_off_once_per_node_selection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A burst's pods of one node selection and requests share the round's `NotIn` list
    (6-28 ms at 5000 nodes, each); a pod selecting otherwise gets its own."""
    from webhook.allocator import signals  # the module, to patch it

    state, _ = _full_cluster()
    for uid, selector in (("want2", {}), ("zoned", {"zone": "a"})):
        state.upsert_pod(
            make_pod(uid, slices={"main": {"3g.40gb": 1}}, uid=uid, node_selector=selector)
        )
    calls: list[str] = []

    def counting(nodes: Any, request: Any, *args: Any) -> list[str]:
        calls.append(request.name)
        return kept_off(nodes, request, *args)

    monkeypatch.setattr(signals, "kept_off", counting)
    kube = _Kube()
    kube.answer.set()
    clock = FakeClock()
    s = _scale_up(state, clock, delay=0)
    s.writes.kube = kube  # type: ignore[assignment]
    s.tell = lambda pod, reason, message, type_: None
    for uid in ("want", "want2", "zoned"):
        req = podlib.pod_request(state.pods[uid].obj)
        s.pending(state.pods[uid], req, Pending(PendingReason.FULL, "full"), False)
    asyncio.run(s.reconcile())
    assert len(kube.created) == 3 and len(calls) == 2
    assert _keep_off(kube.created[0]) == _keep_off(kube.created[1])


# --- whole GPUs (`instaslice.io/gpu`) -------------------------------------------------------


def whole(n: int = 1, **kw: Any) -> Any:
    pod = make_pod("w", slices={"main": {"gpu": n}}, uid="w", cpu="2", memory="1Gi", **kw)
    return podlib.pod_request(pod)


def two_gpus(
    name: str, first: tuple[Occupied, ...], second: tuple[Occupied, ...], **kw: Any
) -> NodeState:
    node = h100(name, gpus=2, **kw)
    gpus = (dataclasses.replace(node.gpus[0], occupied=first),
            dataclasses.replace(node.gpus[1], occupied=second))  # fmt: skip
    return dataclasses.replace(node, gpus=gpus)


def toggles(snapshot: Snapshot) -> WholeView:
    """An H100 fleet in MIG mode, as the allocator's `whole_view` shows it: every healthy GPU
    with nothing on it is turned off without a reset for a whole GPU."""
    return WholeView(
        toggle=frozenset(
            (n.name, g.index)
            for n in snapshot.nodes
            for g in n.gpus
            if g.healthy and not g.occupied
        )
    )


ONE_SLICE = (Occupied(0, 1, "1g.10gb"),)


@pytest.mark.parametrize(
    ("nodes", "n", "reason", "wholes", "needs"),
    [
        # both GPUs hold a slice: no GPU is free to be whole
        ((two_gpus("n1", ONE_SLICE, FULL_GPU),), 1, PendingReason.FULL, toggles, True),
        # GPU 1's slices are being released (shown free): it is whole once they are gone
        ((two_gpus("n1", ONE_SLICE, ()),), 1, PendingReason.FULL, toggles, False),
        # one GPU free, two asked, on one node: another node
        ((two_gpus("n1", ONE_SLICE, ()), two_gpus("n2", (), FULL_GPU)), 2, PendingReason.FULL,
         toggles, True),
        # GPU 1 free but only a reset turns its MIG off (Ampere): InstaSlice never resets
        ((two_gpus("n1", ONE_SLICE, ()),), 1, PendingReason.NEEDS_MIG_MODE_CHANGE,
         WholeView(needs_reset=frozenset({("n1", 1)})), True),
        # GPU 1's change to MIG off is under way (Ampere maintenance): it serves the pod soon
        ((two_gpus("n1", ONE_SLICE, ()),), 1, PendingReason.FULL,
         WholeView(under_way=frozenset({("n1", 1)})), False),
        # the free GPU's node lacks the pod's cpu
        ((dataclasses.replace(two_gpus("n1", (), ()), cpu_millis_free=1000),), 1,
         PendingReason.NODE_RESOURCES, toggles, True),
        ((), 1, PendingReason.NO_MATCHING_NODE, toggles, True),  # no node of the group yet
        ((two_gpus("n1", ONE_SLICE, FULL_GPU),), 1, PendingReason.MIG_MODE_CHANGE_UNDER_WAY,
         toggles, False),  # not a capacity reason: the change under way serves it
    ],
    ids=["full", "releasing", "two-asked", "needs-reset", "under-way", "cpu-short", "no-node",
         "not-capacity"],
)  # fmt: skip
def test_a_whole_gpu_pod_is_classified_by_the_whole_gpu_engine(
    nodes: tuple[NodeState, ...],
    n: int,
    reason: PendingReason,
    wholes: Any,
    needs: bool,
) -> None:
    """Placed again on the freed snapshot by `place_whole` (the slice engine knows no
    profile `gpu`: every whole-GPU pod would need a node)."""
    verdict = classify(
        whole(n), Pending(reason, "m"), Snapshot(nodes), Policy.INSTASLICE, CATALOG, wholes
    )
    assert verdict.needs_node is needs, verdict.why


def test_a_whole_gpu_placeholder_asks_for_instaslice_gpu() -> None:
    pod = make_pod("w", slices={"main": {"gpu": 2}}, uid="w", cpu="2", memory="1Gi")
    req = podlib.pod_request(pod)
    body = placeholder_pod(pod, req, ["n1"])
    (container,) = body["spec"]["containers"]
    assert container["resources"] == {
        "requests": {"instaslice.io/gpu": "2", "cpu": "2000m", "memory": str(1 << 30)},
        "limits": {"instaslice.io/gpu": "2"},
    }
    assert {"key": NODE_LABEL, "operator": "NotIn", "values": ["n1"]} in _keep_off(body)
    template, _ = provisioning_request(pod, req, ["n1"])
    assert template["template"]["spec"]["containers"][0]["resources"] == container["resources"]


@pytest.mark.parametrize(
    ("node", "freed", "wholes", "expected"),
    [
        (two_gpus("n1", ONE_SLICE, FULL_GPU), (), toggles, True),  # no GPU free
        (two_gpus("n1", ONE_SLICE, ()), (), toggles, False),  # GPU 1 free: the pod goes there
        (two_gpus("n1", ONE_SLICE, FULL_GPU), ((1, 0, 4), (1, 4, 4)), toggles, False),  # soon
        (two_gpus("n1", ONE_SLICE, ()), (), WholeView(under_way=frozenset({("n1", 1)})), False),
        (two_gpus("n1", ONE_SLICE, ()), (), WholeView(needs_reset=frozenset({("n1", 1)})), True),
        (two_gpus("n1", ONE_SLICE, FULL_GPU, label=None), (), toggles, False),  # would flap
    ],
    ids=["full", "room", "releasing", "under-way", "needs-reset", "unlabelled"],
)
def test_misplaced_whole_gpu_placeholders(
    node: NodeState, freed: tuple[tuple[int, int, int], ...], wholes: Any, expected: bool
) -> None:
    """By the placer's whole-GPU rule: Karpenter's new node, its GPUs in MIG mode and
    turned off for the pod without a reset, is where the pod goes (not misplaced)."""
    got = misplaced(node, whole(), freed, Policy.INSTASLICE, CATALOG, NO_MODES, wholes)
    assert got is expected


def _classes(draw: Any, nodes: list[NodeState]) -> dict[tuple[str, int], str]:
    refs = [(n.name, g.index) for n in nodes for g in n.gpus]
    kinds = st.sampled_from(["right", "toggle", "reset", "under", ""])
    return {r: draw(kinds) for r in refs}


def view_of(classes: dict[tuple[str, int], str]) -> Any:
    """A `whole_view` over a fleet whose GPUs are of the classes given, as the allocator's:
    only GPUs with nothing on them (in the snapshot it is asked about) are listed."""

    def view(snapshot: Snapshot) -> WholeView:
        empty = {(n.name, g.index) for n in snapshot.nodes for g in n.gpus if not g.occupied}

        def of(kind: str) -> frozenset[tuple[str, int]]:
            return frozenset(r for r in empty if classes.get(r) == kind)

        return WholeView(of("right"), of("toggle"), of("reset"), of("under"))

    return view


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    fleet=st.lists(st.tuples(occupancy, occupancy), min_size=1, max_size=3),
    n=st.integers(1, 2),
    freed=st.sets(st.tuples(st.integers(0, 2), st.integers(0, 1), st.sampled_from([0, 4, 6]),
                            st.sampled_from([1, 4, 8]))),
)  # fmt: skip
def test_a_whole_gpu_pod_that_needs_a_node_is_never_left_on_a_known_node(
    data: Any,
    fleet: list[tuple[list[tuple[int, int, str]], list[tuple[int, int, str]]]],
    n: int,
    freed: set[tuple[int, int, int, int]],
) -> None:
    """The two rules agree: a whole-GPU pod classified *needs a node* has a placeholder that,
    bound to any known labelled node, is replaced (misplaced), and kept off every one at
    once; one classified *waits* has a node where `place_whole` (after the releases) serves
    it or a change under way will, and a placeholder there is left alone."""
    nodes = [
        two_gpus(f"n{i}", tuple(Occupied(*o) for o in a), tuple(Occupied(*o) for o in b))
        for i, (a, b) in enumerate(fleet)
    ]
    wholes = view_of(_classes(data.draw, nodes))
    gone = {f"n{i}": {(g, s, z) for j, g, s, z in freed if j == i} for i in range(len(nodes))}
    snapshot = after_releases(Snapshot(tuple(nodes)), gone)
    req = whole(n)
    verdict = classify(req, Pending(PendingReason.FULL, "m"), snapshot, Policy.INSTASLICE,
                       CATALOG, wholes)  # fmt: skip
    fits = [
        not isinstance(r := place_whole(Snapshot((x,)), req, wholes(Snapshot((x,))), CATALOG)
                       .result, Pending) or r.reason is PendingReason.MIG_MODE_CHANGE_UNDER_WAY
        for x in snapshot.nodes
    ]  # fmt: skip
    assert verdict.needs_node is not any(fits)
    bad = [
        misplaced(x, req, gone[x.name], Policy.INSTASLICE, CATALOG, NO_MODES, wholes) for x in nodes
    ]
    # needs a node: wherever its placeholder stands it is replaced; waits: one node serves it
    assert all(bad) if verdict.needs_node else not all(bad)
    assert kept_off(nodes, req) == sorted(x.name for x in nodes)


def test_a_whole_gpu_pod_a_change_under_way_serves_waits_though_another_node_needs_a_reset() -> (
    None
):
    """The case hypothesis found: n0's GPUs are one right and one needing a reset, n1's one
    needing a reset and one whose change is under way. The fleet's Pending reason names n0's
    reset, but n1 serves two whole GPUs once its change is done: the pod waits."""
    nodes = [two_gpus("n0", (), ()), two_gpus("n1", (), ())]
    classes = {("n0", 0): "right", ("n0", 1): "reset", ("n1", 0): "reset", ("n1", 1): "under"}
    verdict = classify(whole(2), Pending(PendingReason.FULL, "m"), Snapshot(tuple(nodes)),
                       Policy.INSTASLICE, CATALOG, view_of(classes))  # fmt: skip
    assert not verdict.needs_node, verdict.why
    assert "MIG mode change is done" in verdict.why


def _whole_cluster(want_priority: int) -> ClusterState:
    """Node n1, two H100s in MIG mode (turned off without a reset), each holding a
    low-priority 3g.40gb pod; `want` asks one whole GPU. Its Node advertises both GPUs as
    `instaslice.io/gpu`, as their agent does (they can be whole)."""
    state = ClusterState()
    node = make_node("n1", gpus=2, labels={NODE_LABEL: "n1"})
    node["status"]["allocatable"][INSTASLICE_GPU] = node["status"]["capacity"][INSTASLICE_GPU] = "2"
    state.upsert_node(node)
    mig_node = make_mig_node("n1", ["H100-80GB", "H100-80GB"])
    for g in mig_node["status"]["gpus"]:
        g["modeToggle"] = "resetless"
    state.upsert_mig_node(mig_node)
    for i in range(2):
        holder = make_pod(f"holder{i}", slices={"main": {"3g.40gb": 1}}, uid=f"holder{i}",
                          priority=0, gates=(), node_name="n1", phase="Running")  # fmt: skip
        state.upsert_pod(holder)
        state.upsert_allocation(make_allocation(holder, "n1", [("main", "3g.40gb", i, 0, 4)],
                                                phase=Phase.READY))  # fmt: skip
    want = make_pod("want", slices={"main": {"gpu": 1}}, uid="want", priority=want_priority)
    state.upsert_pod(want)
    return state


@pytest.mark.parametrize(
    ("want_priority", "preemption", "needs"),
    [
        (10, True, set()),  # a preemption is planned (one GPU's holder goes): no new node
        (10, False, {"want"}),  # preemption off: only a new node serves it
        (0, True, {"want"}),  # nobody of lower priority to evict: a new node
    ],
)
def test_a_whole_gpu_pod_no_node_serves_asks_for_a_node_after_preemption(
    want_priority: int, preemption: bool, needs: set[str]
) -> None:
    """The placer tells the signal of a pending whole-GPU pod (it used to skip them): one
    that preemption serves is told as decided; one it cannot gets a placeholder asking
    `instaslice.io/gpu: 1`, kept off n1."""
    state = _whole_cluster(want_priority)
    s = _scale_up(state, FakeClock(), delay=0)
    placer = _placer(state, s, preemption)
    track = placer.tracks.ensure("want")
    placer.decide("want")
    assert set(s.needs) == needs
    assert (track.preempt is not None) is (needs == set())
    kube = _Kube()
    kube.answer.set()
    s.writes.kube = kube  # type: ignore[assignment]
    asyncio.run(s.reconcile())
    if needs:
        (body,) = kube.created
        assert body["spec"]["containers"][0]["resources"]["limits"] == {"instaslice.io/gpu": "1"}
        assert {"key": NODE_LABEL, "operator": "NotIn", "values": ["n1"]} in _keep_off(body)
    else:
        assert kube.created == []


def test_a_whole_gpu_pod_waits_for_a_gpu_being_released() -> None:
    """One holder's pod finished: its slice is being released, and GPU 1 (MIG on, turned off
    without a reset) serves the pod once it is gone; the allocator's own `whole_view`
    says so: the pod waits, and its placeholder is withdrawn."""
    state = _whole_cluster(0)
    s = _scale_up(state, FakeClock(), delay=0)
    placer = _placer(state, s, preemption=False)
    placer.tracks.ensure("want")
    placer.decide("want")
    assert set(s.needs) == {"want"}
    s.signals["want"] = _bound("want", None)
    holder = state.pods["holder1"].obj
    state.upsert_pod({**holder, "status": {"phase": "Succeeded"}})
    placer.decide("want")
    assert s.needs == {} and set(s.waits) == {"want"}
    assert s.wanted(0.0) == (set(), {"want"})


def test_a_whole_gpu_placeholder_on_a_node_it_cannot_use_is_replaced() -> None:
    """Bound to n1 (its `instaslice.io/gpu: 2` upper bound shows room while both GPUs hold
    slices): replaced by one kept off n1; once GPU 1 is free it is left there."""
    state = _whole_cluster(0)
    s = _scale_up(state, FakeClock(), delay=0)
    s.pending(state.pods["want"], whole(), Pending(PendingReason.FULL, "f"), False)
    s.signals = {"want": _bound("want", "n1")}
    assert s.misplaced() == {"want": "n1"}
    holder = state.pods["holder1"].obj
    state.remove_pod(holder)
    state.remove_allocation(make_allocation(holder, "n1", [("main", "3g.40gb", 1, 0, 4)]))
    assert s.misplaced() == {}


@pytest.mark.parametrize(
    ("selector", "asks"),
    [
        ({GPU_MODEL_LABEL: "H100-80GB"}, {"instaslice.io/mig-3g.40gb": "1"}),  # n1 is full
        ({GPU_MODEL_LABEL: "H200-141GB"}, {"instaslice.io/mig-1g.35gb": "1"}),  # no such node
        ({}, None),  # no model named: a size is no one resource
        ({GPU_MODEL_LABEL: "X10-120GB"}, None),  # not a catalog model: sizes resolve on those
    ],
)
def test_a_size_based_pod_asks_for_a_node_only_on_the_model_it_names(
    selector: dict[str, str], asks: dict[str, str] | None
) -> None:
    """`memory>=20Gi` that no node serves: with a nodeSelector naming one catalog GPU model
    (a Kueue flavor's nodeLabels) its placeholder asks for the size resolved on that model
    (3g.40gb on an H100-80GB: its 1g.20gb is 19.6 GiB; 1g.35gb on an H200-141GB); naming
    none, it raises no signal."""
    state, _ = _full_cluster()
    obj = make_pod("sized", slices={}, uid="sized", cpu=None, memory=None,
                   node_selector=selector)  # fmt: skip
    obj["metadata"]["annotations"][SIZE_ANNOTATION_PREFIX + "main"] = "memory>=20Gi"
    state.upsert_pod(obj)
    s = _scale_up(state, FakeClock(), delay=0)
    placer = _placer(state, s, preemption=False)
    placer.tracks.ensure("sized")
    placer.decide("sized")
    assert ("sized" in s.needs) is (asks is not None)
    kube = _Kube()
    kube.answer.set()
    s.writes.kube = kube  # type: ignore[assignment]
    asyncio.run(s.reconcile())
    if asks is None:
        assert kube.created == []
    else:
        (body,) = kube.created
        assert body["spec"]["containers"][0]["resources"]["limits"] == asks
        assert body["spec"]["nodeSelector"] == selector
