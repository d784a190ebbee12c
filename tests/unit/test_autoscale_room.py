"""Which nodes a signal's `NotIn` lists: only those the kube-scheduler could bind it to
(webhook.allocator.autoscale.kept_off with `ClusterState.room`, views.Room).

Covers: a table of what shrinks a node's advertised room (another model, a profile's count
used up by bound pods, cpu / memory / pod slots taken) and what does not (pods only pinned
or promised there, finished pods, an init container's asks); the room's bookkeeping as pods
bind, finish and go; a hypothesis property over random fleets (every node left off the list
cannot take the signal by the scheduler's own arithmetic, computed here apart); the loop's
lists for placeholders and ProvisioningRequests, and a replacement naming the node its
placeholder was misplaced on whatever the room says.
Leaves out: the scheduler and Karpenter themselves (tests/e2e/test_autoscaling.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.catalog import load_catalog
from common.constants import GATE_NAME, NODE_LABEL
from common.objects import Phase
from common.placeholders import signal_name
from common.placement import Pending, PendingReason, Policy
from common.quantity import parse_bytes, parse_cpu_millis
from testkit.builders import make_allocation, make_mig_node, make_node, make_pod
from testkit.clock import FakeClock
from webhook.allocator import pods as podlib
from webhook.allocator.autoscale import (
    ScaleUpSettings,
    SignalMode,
    kept_off,
    placeholder_pod,
    signal_asks,
)
from webhook.allocator.scaleup import ScaleUp
from webhook.allocator.state import ClusterState
from webhook.allocator.views import Room
from webhook.allocator.writes import Writes

pytestmark = pytest.mark.timeout(60)
CATALOG = load_catalog()
Obj = dict[str, Any]
PIN = [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n"]}]}]


def _state(node: Obj, model: str | None, pods: list[Obj]) -> ClusterState:
    state = ClusterState()
    state.upsert_node(node)
    state.upsert_mig_node(make_mig_node(node["metadata"]["name"], [model or "H100-80GB"]))
    for p in pods:
        state.upsert_pod(p)
    return state


def _bound(i: int, profile: str = "1g.10gb", count: int = 1, **kw: Any) -> Obj:
    kw.setdefault("cpu", "100m")
    kw.setdefault("memory", "64Mi")
    return make_pod(f"b{i}", slices={"main": {profile: count}}, gates=(), claim=None,
                    uid=f"b{i}", node_name="n", **kw)  # fmt: skip


WANTS = make_pod("q", slices={"main": {"1g.10gb": 1}}, cpu="4", memory="8Gi", uid="q")

CASES: list[tuple[str, str | None, dict[str, Any], list[Obj], bool]] = [
    # (id, the node's model, make_node's resources, pods there, listed)
    ("room", "H100-80GB", {}, [], True),
    ("another-model", "H200-141GB", {}, [], False),  # advertises no 1g.10gb
    ("profile-used-up", "H100-80GB", {}, [_bound(i) for i in range(7)], False),
    ("profile-one-left", "H100-80GB", {}, [_bound(i) for i in range(6)], True),
    ("other-profile-full", "H100-80GB", {}, [_bound(0, "7g.80gb")], True),  # looks free
    ("cpu-taken", "H100-80GB", {"cpu": "8"}, [_bound(0, cpu="5")], False),
    ("cpu-left", "H100-80GB", {"cpu": "8"}, [_bound(0, cpu="4")], True),
    ("memory-taken", "H100-80GB", {"memory": "16Gi"}, [_bound(0, memory="9Gi")], False),
    ("pod-slots-taken", "H100-80GB", {"pods": 2}, [_bound(0), _bound(1, "7g.80gb")], False),
    ("pinned-only", "H100-80GB", {"cpu": "8"},  # not bound yet: the scheduler may bind q first
     [make_pod("pin", cpu="8", gates=(), uid="pin", required_terms=PIN)], True),
    ("finished", "H100-80GB", {"cpu": "8"}, [_bound(0, cpu="8", phase="Succeeded")], True),
    ("init-asks-only", "H100-80GB", {},  # counted at least: its init's 7 may be, or not
     [make_pod("i", slices={}, init=[("init", {"1g.10gb": 7}, None, None)], gates=(),
               claim=None, uid="i", node_name="n")], True),
]  # fmt: skip


@pytest.mark.parametrize(
    ("model", "resources", "pods", "listed"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_a_node_is_listed_only_where_its_advertised_room_takes_the_signal(
    model: str | None, resources: dict[str, Any], pods: list[Obj], listed: bool
) -> None:
    node = make_node("n", labels={NODE_LABEL: "n"}, model=model, **resources)
    state = _state(node, model, pods)
    request = podlib.pod_request(WANTS)
    assert kept_off(state.node_states(), request, state.room) == (["n"] if listed else [])
    assert kept_off(state.node_states(), request) == ["n"]  # without the room: every one


def test_a_promised_pod_is_not_counted_and_a_pod_counts_once_bound() -> None:
    """A pod with a SliceAllocation there, then bound, then finished, then gone: only the
    bound stretch takes the room; each Room is a value (an old one never changes)."""
    state = _state(make_node("n", cpu="8", model="H100-80GB"), "H100-80GB", [])
    pod = make_pod("p", slices={"main": {"1g.10gb": 7}}, cpu="6", uid="p")
    state.upsert_pod(pod)
    state.upsert_allocation(make_allocation(pod, "n", [("main", "1g.10gb", 0, 0, 1)],
                                            phase=Phase.READY))  # fmt: skip
    asks, extended = signal_asks(podlib.pod_request(WANTS))
    free = state.room("n")
    assert free is not None and free.holds(asks, extended)
    bound = {**pod, "spec": {**pod["spec"], "nodeName": "n", "schedulingGates": []}}
    state.upsert_pod(bound)
    taken = state.room("n")
    assert taken is not None and not taken.holds(asks, extended)
    assert taken.free.cpu_millis == 2000 and taken.extended_bound == {
        "instaslice.io/mig-1g.10gb": 7
    }
    assert free.holds(asks, extended) and free.extended_bound == {}
    state.upsert_pod({**bound, "status": {"phase": "Succeeded"}})
    assert state.room("n") == free
    state.upsert_pod(bound)
    state.remove_pod(bound)
    assert state.room("n") == free
    state.upsert_node(make_node("n", cpu="2", model="H100-80GB"))  # the node shrank
    shrunk = state.room("n")
    assert shrunk is not None and not shrunk.holds(asks, extended)


@pytest.mark.parametrize(
    ("asks", "extended", "holds"),
    [
        ((0, 0, 1), {}, True),
        ((0, 0, 2), {}, False),  # one pod slot left
        ((1000, 0, 1), {}, True),
        ((1001, 0, 1), {}, False),
        ((0, 1 << 30, 1), {}, True),
        ((0, (1 << 30) + 1, 1), {}, False),
        ((0, 0, 1), {"instaslice.io/mig-1g.10gb": 2}, True),
        ((0, 0, 1), {"instaslice.io/mig-1g.10gb": 3}, False),
        ((0, 0, 1), {"instaslice.io/mig-2g.20gb": 1}, False),  # not advertised: 0
        ((0, 0, 1), {"instaslice.io/mig-2g.20gb": 0}, True),  # asked 0: not checked
    ],
)
def test_room_holds_by_the_schedulers_resource_fit(
    asks: tuple[int, int, int], extended: dict[str, int], holds: bool
) -> None:
    """cpu 1000m, memory 1 GiB and 1 pod slot left; 1g.10gb: 7 advertised, 5 bound."""
    room = Room(
        podlib.Resources(1000, 1 << 30, 1),
        {"instaslice.io/mig-1g.10gb": 7},
        {"instaslice.io/mig-1g.10gb": 5},
    )
    assert room.holds(podlib.Resources(*asks), extended) is holds


# --- the property: every node left off cannot take the signal -------------------------------

MODELS = ("H100-80GB", "H100-80GB", "A100-40GB", "H200-141GB")  # A100-40GB: 4 of 1g.10gb
PROFILES = ("1g.10gb", "1g.10gb", "3g.40gb", "7g.80gb", "1g.18gb")


def _schedulers_requests(pod: Obj) -> dict[str, int]:
    """The kube-scheduler's PodRequests, written apart from the allocator's readers:
    max(app containers + sidecars, each init container + the sidecars before it)."""

    def of(c: Obj) -> dict[str, int]:
        res = c.get("resources") or {}
        out: dict[str, int] = {}
        for section in ("limits", "requests"):  # requests win, limits default them
            for k, v in (res.get(section) or {}).items():
                out[k] = parse_cpu_millis(v) if k == "cpu" else parse_bytes(v)
        return out

    def add(a: dict[str, int], b: Mapping[str, int]) -> dict[str, int]:
        return {k: a.get(k, 0) + b.get(k, 0) for k in {*a, *b}}

    def peak(a: dict[str, int], b: Mapping[str, int]) -> dict[str, int]:
        return {k: max(a.get(k, 0), b.get(k, 0)) for k in {*a, *b}}

    spec = pod["spec"]
    total: dict[str, int] = {}
    for c in spec["containers"]:
        total = add(total, of(c))
    sidecars: dict[str, int] = {}
    init: dict[str, int] = {}
    for c in spec.get("initContainers") or []:
        if c.get("restartPolicy") == "Always":
            total, sidecars = add(total, of(c)), add(sidecars, of(c))
            init = peak(init, sidecars)
        else:
            init = peak(init, add(of(c), sidecars))
    return peak(total, init)


def _scheduler_fits(node: Obj, pods: list[Obj], wants: Mapping[str, int]) -> bool:
    alloc = node["status"]["allocatable"]
    bound = [
        p for p in pods
        if p["spec"].get("nodeName") == node["metadata"]["name"]
        and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
    ]  # fmt: skip
    if len(bound) + 1 > int(alloc["pods"]):
        return False
    used: dict[str, int] = {}
    for p in bound:
        for k, v in _schedulers_requests(p).items():
            used[k] = used.get(k, 0) + v
    for k, v in wants.items():
        have = parse_cpu_millis(alloc.get(k, "0")) if k == "cpu" else parse_bytes(alloc.get(k, "0"))
        if v > 0 and v > have - used.get(k, 0):
            return False
    return True


pod_st = st.fixed_dictionaries(
    {
        "node": st.integers(0, 3),
        "how": st.sampled_from(["bound", "bound", "pinned", "promised", "finished"]),
        "profile": st.sampled_from(PROFILES),
        "count": st.integers(1, 4),
        "cpu": st.sampled_from(["0", "500m", "2", "5"]),
        "init": st.sampled_from([None, "init", "sidecar"]),
    }
)
node_st = st.fixed_dictionaries(
    {
        "model": st.sampled_from(MODELS),
        "gpus": st.integers(1, 2),
        "cpu": st.sampled_from(["2", "8"]),
        "pods": st.sampled_from([2, 4, 110]),
        "zone": st.sampled_from(["a", "b"]),
    }
)


def _pod(i: int, p: Mapping[str, Any]) -> Obj:
    """A pod of `pod_st`: bound (or finished) on its node, pinned there, or promised there
    (gated, as if its SliceAllocation were written)."""
    node, how = f"n{p['node']}", p["how"]
    init = [] if p["init"] is None else [("i", {p["profile"]: p["count"] + 2}, "1", None)]
    pin = [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]
    pod = make_pod(
        f"p{i}", slices={"main": {p["profile"]: p["count"]}}, cpu=p["cpu"], memory="1Gi",
        init=init, uid=f"p{i}",
        gates=(GATE_NAME,) if how == "promised" else (),
        claim="auto" if how == "promised" else None,
        node_name=node if how in ("bound", "finished") else None,
        required_terms=pin if how == "pinned" else None,
        phase="Succeeded" if how == "finished" else None,
    )  # fmt: skip
    if p["init"] == "sidecar":
        pod["spec"]["initContainers"][0]["restartPolicy"] = "Always"
    return pod


@settings(deadline=None, max_examples=600, suppress_health_check=[HealthCheck.too_slow])
@given(
    nodes=st.lists(node_st, min_size=1, max_size=4),
    pods=st.lists(pod_st, max_size=12),
    profile=st.sampled_from(PROFILES),
    count=st.integers(1, 7),
    cpu=st.sampled_from(["0", "1", "3"]),
)
def test_every_node_left_off_the_list_cannot_take_the_signal(
    nodes: list[Mapping[str, Any]],
    pods: list[Mapping[str, Any]],
    profile: str,
    count: int,
    cpu: str,
) -> None:
    """For random fleets and pods (bound, pinned, promised, finished; init containers and
    sidecars): a node the pod's selection admits is left off only when the scheduler's
    resource fit, computed here from the objects, refuses the signal there; and nothing
    outside the admitted nodes is listed."""
    state = ClusterState()
    objs = []
    for i, n in enumerate(nodes):
        name = f"n{i}"
        obj = make_node(name, cpu=n["cpu"], pods=n["pods"], model=n["model"], gpus=n["gpus"],
                        labels={NODE_LABEL: name, "zone": n["zone"]})  # fmt: skip
        objs.append(obj)
        state.upsert_node(obj)
        state.upsert_mig_node(make_mig_node(name, [n["model"]] * n["gpus"]))
    made = [_pod(i, p) for i, p in enumerate(pods) if p["node"] < len(nodes)]
    for p in made:
        state.upsert_pod(p)
    wants = make_pod("q", slices={"main": {profile: count}}, cpu=cpu, memory="1Gi", uid="q",
                     node_selector={"zone": "a"})  # fmt: skip
    request = podlib.pod_request(wants)
    listed = set(kept_off(state.node_states(), request, state.room))
    asks = _schedulers_requests(placeholder_pod(wants, request, []))
    for obj, n in zip(objs, nodes, strict=True):
        name = obj["metadata"]["name"]
        if n["zone"] != "a":
            assert name not in listed
        elif name not in listed:
            assert not _scheduler_fits(obj, made, asks), name


# --- the loop ------------------------------------------------------------------------------


class _Kube:
    def __init__(self) -> None:
        self.created: list[Obj] = []

    async def create(self, path: str, body: Obj) -> Obj:
        self.created.append(body)
        return body

    async def delete_ignore_missing(self, path: str, **query: Any) -> None:
        await asyncio.sleep(0)


class _Elector:
    def check(self) -> None:
        pass


def _fleet(mode: SignalMode) -> tuple[ClusterState, ScaleUp, _Kube]:
    """n1: one H100-80GB GPU full of a 7g.80gb pod bound there (still advertising 1g.10gb);
    n2: an H200 (no 1g.10gb at all); each with a hostname label apart from its name, as
    Karpenter's nodes have; `want` asks 1g.10gb and needs a node."""
    state = ClusterState()
    for name, model in (("n1", "H100-80GB"), ("n2", "H200-141GB")):
        labels = {NODE_LABEL: name, "kubernetes.io/hostname": f"kwok-{name}"}
        state.upsert_node(make_node(name, labels=labels, model=model))
        state.upsert_mig_node(make_mig_node(name, [model]))
    holder = make_pod("holder", slices={"main": {"7g.80gb": 1}}, uid="holder", gates=(),
                      node_name="n1")  # fmt: skip
    state.upsert_pod(holder)
    state.upsert_allocation(make_allocation(holder, "n1", [("main", "7g.80gb", 0, 0, 8)],
                                            phase=Phase.READY))  # fmt: skip
    want = make_pod("want", slices={"main": {"1g.10gb": 1}}, uid="want")
    state.upsert_pod(want)
    kube, clock = _Kube(), FakeClock()
    s = ScaleUp(
        kube=kube,  # type: ignore[arg-type]
        writes=Writes(kube, _Elector(), clock, "allocator-0"),  # type: ignore[arg-type]
        state=state,
        settings=ScaleUpSettings(mode=mode, delay_s=0),
        policy=Policy.INSTASLICE,
        catalog=CATALOG,
        clock=clock,
        tell=lambda pod, reason, message, type_: None,
    )
    s.pending(state.pods["want"], podlib.pod_request(want), Pending(PendingReason.FULL, "f"), False)
    s.synced.set()
    return state, s, kube


def _not_in(body: Obj) -> list[Obj]:
    spec = (
        body["spec"]
        if "spec" in body and "containers" in body["spec"]
        else body["template"]["spec"]
    )
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    return [e for t in terms["nodeSelectorTerms"] for e in t["matchExpressions"]]


@pytest.mark.parametrize(
    ("mode", "key", "listed"),
    [
        (SignalMode.PLACEHOLDER, NODE_LABEL, ["n1"]),
        (SignalMode.PROVISIONING_REQUEST, "kubernetes.io/hostname", ["kwok-n1", "kwok-n2"]),
    ],
    ids=["placeholder", "provisioning-request"],
)
def test_the_loops_signal_lists_by_room_only_where_a_misplaced_one_is_replaced(
    mode: SignalMode, key: str, listed: list[str]
) -> None:
    """n1 looks free to the scheduler (1g.10gb advertised, none bound), n2 offers no
    1g.10gb. A placeholder names only n1, by the agents' label: one bound where its pod
    cannot go is replaced. Nothing replaces a ProvisioningRequest the autoscaler found room
    for on an existing node (cluster-autoscaler's `CapacityIsFound`: no node made), so it
    names every node that cannot serve the pod, by hostname label (Karpenter's nodes are
    named apart from it, as these are)."""
    _, s, kube = _fleet(mode)
    asyncio.run(s.reconcile())
    assert _not_in(kube.created[0]) == [{"key": key, "operator": "NotIn", "values": listed}]


def test_a_node_whose_agent_is_down_is_listed_whatever_its_room() -> None:
    """n1's cpu is taken by a bound pod, so its room cannot take the placeholder; while its
    agent is down it is named all the same: `misplaced` leaves a placeholder on such a node
    alone, so one bound there once the cpu frees would stand there for good."""
    state, s, kube = _fleet(SignalMode.PLACEHOLDER)
    state.upsert_pod(make_pod("hog", slices={}, cpu="8", uid="hog", gates=(), claim=None,
                              node_name="n1"))  # fmt: skip
    state.set_agent_down("n1", True)
    asyncio.run(s.reconcile())
    assert _not_in(kube.created[0]) == [{"key": NODE_LABEL, "operator": "NotIn", "values": ["n1"]}]


def test_a_replacement_names_the_node_its_placeholder_was_misplaced_on() -> None:
    """The scheduler bound the placeholder to n1 although the allocator sees n1's cpu
    taken by a bound pod (its view lags: that pod already went, for the scheduler): the
    replacement lists n1 all the same, so it cannot land there again."""
    state, s, kube = _fleet(SignalMode.PLACEHOLDER)
    state.upsert_pod(make_pod("hog", slices={}, cpu="8", uid="hog", gates=(), claim=None,
                              node_name="n1"))  # fmt: skip
    request = podlib.pod_request(state.pods["want"].obj)
    assert kept_off(state.node_states(), request, state.room) == []
    asyncio.run(s.reconcile())
    assert "affinity" not in kube.created[0]["spec"]  # nothing to list
    placed = {**kube.created[0], "spec": {**kube.created[0]["spec"], "nodeName": "n1"}}
    placed["metadata"] = {**placed["metadata"], "uid": "old", "resourceVersion": "1"}
    s.signals["want"] = placed
    asyncio.run(s.reconcile())
    assert kube.created[-1]["metadata"]["name"] == signal_name("want") and len(kube.created) == 2
    assert _not_in(kube.created[-1]) == [{"key": NODE_LABEL, "operator": "NotIn", "values": ["n1"]}]
