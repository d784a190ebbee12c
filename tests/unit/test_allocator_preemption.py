"""Who may be a preemption victim (webhook/allocator/preemption.py), from the allocator's
model: priorities, terminating pods, reservations, Kueue-managed pods (by the admin's
namespace selector, never by a pod's own label), `system-*` classes, pods to avoid; the
PodDisruptionBudgets' selectors and the `kubectl -l` selector parser; what lower-priority
pods free of a node's cpu, memory and pods (`Holder.frees`, `spare`), and the owner
back-off's clock. Then the allocator itself with the unit tests' fakes (a recording `Kube`,
the fake clock; tests/unit/test_allocator_controller.py): a node whose cpu the preemptor
never fits is not planned on; a controller whose pod was deleted as pinned-unschedulable
evicts nothing there again while backed off; a PDB-refused eviction of a last-resort plan
becomes a delete (as kube-scheduler's preemption), and one the cached budgets did not
foresee is planned again, not left immune. The planner itself: tests/unit/test_preempt.py;
the allocator's steps: tests/unit/test_allocator_track.py."""

from __future__ import annotations

from typing import Any

import pytest

from common.constants import ENABLED_KEY, REASON_PENDING, REASON_PINNED_UNSCHEDULABLE
from common.kubeapi import ApiError, Obj
from common.objects import Phase
from common.placement.preempt import Frees, Holder
from testkit.builders import make_allocation, make_mig_node, make_node, make_pod
from testkit.clock import FakeClock, settle
from tests.unit.test_allocator_controller import (
    RecordingKube,
    controller,
    event_reasons,
    leading,
    unschedulable,
)
from tests.unit.test_allocator_preempt_whole import decide, placer
from webhook.allocator.controller import Controller
from webhook.allocator.preemption import (
    Budgets,
    OwnerBackoff,
    holders,
    parse_selector,
    selects,
    spare,
    start_time,
)
from webhook.allocator.state import ClusterState
from webhook.allocator.views import PodView

pytestmark = pytest.mark.timeout(10)


def cluster(*pods: dict[str, Any], assumed: tuple[str, ...] = ()) -> ClusterState:
    """Node n1 (one H100); pod i holds a 1g at slot i; `assumed`: pod names whose
    allocation is only assumed (a reservation)."""
    state = ClusterState()
    state.upsert_node(make_node("n1"))
    state.upsert_mig_node(make_mig_node("n1"))
    for i, pod in enumerate(pods):
        state.upsert_pod(pod)
        alloc = make_allocation(pod, "n1", [("main", "1g.10gb", 0, i, 1)], uid=f"a{i}")
        if pod["metadata"]["name"] in assumed:
            state.assume(alloc)
        else:
            state.upsert_allocation(alloc)
    return state


def pod(name: str, priority: int, **kw: Any) -> dict[str, Any]:
    obj = make_pod(name, uid=name, priority=priority, gates=(), node_name="n1", **kw)
    obj["status"] = {"phase": "Running", "startTime": "2026-01-01T00:00:05Z"}
    return obj


def by_uid(hs: list[Holder]) -> dict[str, Holder]:
    return {h.uid: h for h in hs}


PREEMPTOR = PodView.of(make_pod("hi", uid="hi", priority=10))


def test_only_strictly_lower_priority_pods_may_be_victims() -> None:
    state = cluster(pod("low", 9), pod("same", 10), pod("higher", 11))
    got = by_uid(holders(state, PREEMPTOR, Budgets(), kueue_ok=False))
    assert [got[u].preemptible for u in ("low", "same", "higher")] == [True, False, False]
    assert got["low"].slices == ((0, 0, 1),) and got["low"].start_time == start_time(pod("x", 0))


def test_kueue_managed_is_the_admins_namespace_selector_never_a_pods_own_label() -> None:
    """Security (finding 5): a tenant labelling its pod `kueue.x-k8s.io/managed=true` or
    `kueue.x-k8s.io/queue-name` without Kueue made it immune to preemption. Now only the
    namespaces the admin's selector names (`--kueue-namespace-selector`) are Kueue's."""
    state = cluster(
        pod("self-labelled", 0, labels={"kueue.x-k8s.io/managed": "true"}),
        pod("queued", 0, labels={"kueue.x-k8s.io/queue-name": "q"}),
        pod("in-kueue-ns", 0, namespace="team"),
    )
    off = by_uid(holders(state, PREEMPTOR, Budgets(), kueue_ok=False, kueue={"team"}))
    on = by_uid(holders(state, PREEMPTOR, Budgets(), kueue_ok=True, kueue={"team"}))
    assert off["self-labelled"].preemptible and off["queued"].preemptible
    assert not off["in-kueue-ns"].preemptible
    assert all(h.preemptible for h in on.values())


def test_system_classes_reservations_and_avoided_pods_are_never_victims() -> None:
    critical = pod("critical", 0)
    critical["spec"]["priorityClassName"] = "system-node-critical"
    state = cluster(critical, pod("waiting", 0), pod("stuck", 0), assumed=("waiting",))
    got = by_uid(holders(state, PREEMPTOR, Budgets(), kueue_ok=True, avoid=("stuck",)))
    assert not any(h.preemptible for h in got.values())
    assert not any(h.doomed for h in got.values())


def test_terminating_pods_are_doomed_not_victims() -> None:
    going = pod("going", 0)
    going["metadata"]["deletionTimestamp"] = "2026-01-01T00:01:00Z"
    state = cluster(going)
    (h,) = holders(state, PREEMPTOR, Budgets(), kueue_ok=False)
    assert h.doomed and not h.preemptible


def test_pdbs_select_by_labels_in_their_namespace() -> None:
    budgets = Budgets()
    budgets.upsert(
        {
            "metadata": {"namespace": "ns", "name": "web"},
            "spec": {"selector": {"matchLabels": {"app": "web"}}},
            "status": {"disruptionsAllowed": 1},
        }
    )
    budgets.upsert({"metadata": {"namespace": "other", "name": "all"}, "spec": {}})
    state = cluster(pod("w", 0, labels={"app": "web"}), pod("x", 0))
    got = by_uid(holders(state, PREEMPTOR, budgets, kueue_ok=False))
    assert got["w"].pdbs == ("ns/web",) and got["x"].pdbs == ()
    assert budgets.allowed() == {"ns/web": 1, "other/all": 0}
    budgets.remove({"metadata": {"namespace": "other", "name": "all"}})
    assert list(budgets.allowed()) == ["ns/web"]


@pytest.mark.parametrize(
    ("selector", "labels", "expected"),
    [
        ({}, {}, True),
        ({"matchLabels": {"a": "1"}}, {"a": "1", "b": "2"}, True),
        ({"matchLabels": {"a": "1"}}, {"a": "2"}, False),
        ({"matchExpressions": [{"key": "a", "operator": "In", "values": ["1"]}]}, {"a": "1"}, True),
        ({"matchExpressions": [{"key": "a", "operator": "In", "values": ["1"]}]}, {}, False),
        ({"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["1"]}]}, {}, True),
        (
            {"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["1"]}]},
            {"a": "1"},
            False,
        ),
        ({"matchExpressions": [{"key": "a", "operator": "Exists"}]}, {"a": ""}, True),
        ({"matchExpressions": [{"key": "a", "operator": "DoesNotExist"}]}, {"a": ""}, False),
    ],
)
def test_label_selectors(selector: dict[str, Any], labels: dict[str, str], expected: bool) -> None:
    assert selects(selector, labels) is expected


@pytest.mark.parametrize(
    ("text", "labels", "expected"),
    [
        ("kueue.openshift.io/managed=true", {"kueue.openshift.io/managed": "true"}, True),
        ("kueue.openshift.io/managed=true", {"kueue.openshift.io/managed": "false"}, False),
        ("kubernetes.io/metadata.name in (a, b)", {"kubernetes.io/metadata.name": "b"}, True),
        ("kubernetes.io/metadata.name notin (a,b)", {"kubernetes.io/metadata.name": "b"}, False),
        ("team,!frozen", {"team": "x"}, True),
        ("team,!frozen", {"team": "x", "frozen": ""}, False),
        ("tier!=gold", {}, True),
        ("tier==gold", {"tier": "gold"}, True),
    ],
)
def test_the_kueue_namespace_selector_reads_kubectl_syntax(
    text: str, labels: dict[str, str], expected: bool
) -> None:
    selector = parse_selector(text)
    assert selector is not None and selects(selector, labels) is expected


@pytest.mark.parametrize("text", ["a in b", "a=b=c", "(a)", "a in (b"])
def test_a_malformed_selector_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a label selector term"):
        parse_selector(text)


def test_no_selector_selects_no_namespace() -> None:
    assert parse_selector("") is None and parse_selector("  ") is None


def test_holders_free_their_requests_and_spare_is_the_other_lower_priority_pods() -> None:
    state = cluster(pod("low", 9), pod("same", 10))
    for name, prio in (("cpu-low", 9), ("cpu-same", 10), ("cpu-kueue", 0)):
        hog = make_pod(name, uid=name, priority=prio, gates=(), claim=None, cpu="2",
                       memory="1Gi", slices={}, node_name="n1",
                       namespace="team" if name == "cpu-kueue" else "ns")  # fmt: skip
        hog["status"] = {"phase": "Running"}
        state.upsert_pod(hog)
    held = holders(state, PREEMPTOR, Budgets(), kueue_ok=False, kueue={"team"})
    one = Frees(100, 64 << 20, 1)  # make_pod's requests, one pod slot
    assert [(h.uid, h.frees) for h in held] == [("low", one), ("same", one)]
    # the lower-priority pod holding no slices; not the equal-priority one, nor Kueue's
    room = spare(state, PREEMPTOR, held, kueue_ok=False, kueue={"team"})
    assert room == {"n1": Frees(2000, 1 << 30, 1)}


def test_the_owner_backoff_keeps_a_node_off_until_its_time() -> None:
    backoff = OwnerBackoff(backoff_s=600)
    backoff.note("rs", "n1", now=1000)
    backoff.note("rs", "n2", now=1300)
    assert backoff.nodes("rs", 1599) == {"n1", "n2"}
    assert backoff.nodes("other", 1599) == frozenset() and backoff.nodes(None, 0) == frozenset()
    assert backoff.nodes("rs", 1600) == {"n2"}
    assert backoff.nodes("rs", 1900) == frozenset() and backoff.until == {}


# --- the pod's cpu on the allocator's model ---------------------------------------------------


def hold(state: ClusterState, name: str, node: str, slot: int, prio: int) -> None:
    obj = make_pod(name, uid=name, priority=prio, gates=(), node_name=node, phase="Running")
    state.upsert_pod(obj)
    state.upsert_allocation(make_allocation(obj, node, [("main", "1g.10gb", 0, slot, 1)]))


@pytest.mark.parametrize(("hog_priority", "node"), [(10, "n2"), (1, "n1")])
def test_a_node_whose_cpu_the_preemptor_never_fits_is_not_planned_on(
    hog_priority: int, node: str
) -> None:
    """Finding 6: n1's victims are the cheapest, but 1.5 of its 2 cpus are a pod's of the
    preemptor's priority: pinned there, the preemptor (1 cpu) would never be scheduled and,
    deleted and recreated, would evict again. A lower-priority pod there is kube-scheduler's
    to preempt once the pod is pinned, so then n1 it is."""
    state = ClusterState()
    for n in ("n1", "n2"):
        state.upsert_node(make_node(n, cpu="2", memory="32Gi", pods=20, gpus=1))
        state.upsert_mig_node(make_mig_node(n))
        for slot in range(7):
            hold(state, f"{n}-{slot}", n, slot, prio=0 if n == "n1" else 5)
    hog = make_pod("hog", uid="hog", priority=hog_priority, gates=(), claim=None, cpu="1500m",
                   slices={}, node_name="n1", phase="Running")  # fmt: skip
    state.upsert_pod(hog)
    hi = make_pod("hi", uid="hi", priority=10, cpu="1", slices={"main": {"1g.10gb": 1}})
    state.upsert_pod(hi)
    p, told = placer(state)
    pre = decide(p, "hi").preempt
    assert pre is not None and told == [], told
    assert pre.node == node and len(pre.victims) == 1


# --- the allocator, end to end on the fakes ---------------------------------------------------

RS = {"kind": "ReplicaSet", "name": "web", "uid": "rs-uid", "controller": True}


async def preempting_controller(kube: RecordingKube, clock: FakeClock) -> Controller:
    """Preemption on (default back-off), node n1 with one H100."""
    c = controller(kube, clock, preemption=True)
    await c.handlers.on_node("ADDED", make_node("n1", gpus=1))
    await c.handlers.on_mig_node("ADDED", make_mig_node("n1"))
    return c


async def low_pod(c: Controller, name: str, slot: int, **kw: Any) -> Obj:
    obj = make_pod(name, uid=name, priority=0, gates=(), node_name="n1", phase="Running", **kw)
    await c.handlers.on_pod("ADDED", obj)
    alloc = make_allocation(obj, "n1", [("main", "1g.10gb", 0, slot, 1)], phase=Phase.READY)
    await c.handlers.on_allocation("ADDED", alloc)
    return obj


def evictions(kube: RecordingKube) -> list[str]:
    return [c[1] for c in kube.writes("create") if c[1].endswith("/eviction")]


async def test_an_owner_whose_pod_was_deleted_as_pinned_unschedulable_evicts_not_again() -> None:
    """Finding 6: a high-priority Deployment's pod that cannot run where it evicts (here
    something the allocator does not model keeps the scheduler off n1) is deleted after the
    pinned-unschedulable timeout; its recreated pod must not evict a second time there."""
    kube, clock = RecordingKube(), FakeClock()
    c = await preempting_controller(kube, clock)
    first = make_pod("web-1", uid="web-1", priority=10, owner=RS)
    async with leading(c):
        for slot in range(6):
            await low_pod(c, f"low-{slot}", slot)
        mine = make_allocation(first, "n1", [("main", "1g.10gb", 0, 6, 1)], phase=Phase.READY)
        await c.handlers.on_allocation("ADDED", mine)
        kube.objects["/api/v1/namespaces/ns/pods/web-1"] = unschedulable(first)
        await c.handlers.on_pod("ADDED", unschedulable(first))
        await settle()
        await clock.advance(30.0)  # the helper's pinned-unschedulable timeout
        await settle()
        assert event_reasons(kube) == [REASON_PINNED_UNSCHEDULABLE]
        await c.handlers.on_pod("DELETED", unschedulable(first))
        await c.handlers.on_allocation("DELETED", mine)
        await low_pod(c, "low-6", 6)  # a lower-priority pod takes the slot meanwhile
        second = make_pod("web-2", uid="web-2", priority=10, owner=RS)
        await c.handlers.on_pod("ADDED", second)
        await settle()
    assert evictions(kube) == []
    pending = [c[2]["message"] for c in kube.writes("create")
               if c[1].endswith("/events") and c[2]["reason"] == REASON_PENDING]  # fmt: skip
    assert len(pending) == 1 and "not planned on n1 for now" in pending[0], pending


async def test_another_controllers_pod_still_preempts_there() -> None:
    """The back-off is the owner's: a pod of another controller evicts as before."""
    kube, clock = RecordingKube(), FakeClock()
    c = await preempting_controller(kube, clock)
    assert c.placer.preemption is not None
    c.placer.preemption.backoff.note("rs-uid", "n1", clock.monotonic())
    other = {**RS, "uid": "other-rs"}
    async with leading(c):
        for slot in range(7):
            await low_pod(c, f"low-{slot}", slot)
        await c.handlers.on_pod("ADDED", make_pod("job-1", uid="job-1", priority=10, owner=other))
        await settle()
    assert len(evictions(kube)) == 1


class RefusingEvictions(RecordingKube):
    """Every eviction is refused (429), as the API server does for a PDB at its limit."""

    async def create(self, path: str, body: Obj, **query: Any) -> Obj:
        if path.endswith("/eviction"):
            self.calls.append(("create", path, body))
            raise ApiError(429, "TooManyRequests", "Cannot evict pod: disruption budget")
        return await super().create(path, body, **query)


@pytest.mark.parametrize("allowed", [0, 7], ids=["budget-at-its-limit", "budget-cache-stale"])
async def test_a_pdb_makes_no_pod_immune_its_violation_is_the_last_resort(allowed: int) -> None:
    """Finding 5: a PDB with maxUnavailable 0 made its pods immune (the eviction refused,
    the pod avoided for good). As kube-scheduler's preemption does, a plan keeping every
    PDB is preferred; when none exists the victims are evicted, and those the API server
    refuses are deleted (UID precondition). A budget the cache thought open (stale) costs
    one round: planned again with that budget spent, then deleted."""
    kube, clock = RefusingEvictions(), FakeClock()
    c = await preempting_controller(kube, clock)
    pdb = {
        "metadata": {"namespace": "ns", "name": "web"},
        "spec": {"selector": {"matchLabels": {"app": "web"}}},
        "status": {"disruptionsAllowed": allowed},
    }
    await c.handlers.on_pdb("ADDED", pdb)
    async with leading(c):
        for slot in range(7):
            await low_pod(c, f"low-{slot}", slot, labels={"app": "web"})
        await c.handlers.on_pod("ADDED", make_pod("hi", uid="hi", priority=10))
        for _ in range(3):  # a refusal is looked at again after a 0 s retry delay
            await settle()
            await clock.advance(0.0)
    deleted = [(path, body) for verb, path, body in kube.calls if verb == "delete"]
    assert len(evictions(kube)) == 1 + (allowed > 0)  # asked first, as the API wants
    ((path, body),) = deleted
    assert path.startswith("/api/v1/namespaces/ns/pods/low-")
    assert body == {"preconditions": {"uid": path.rsplit("/", 1)[1]}}


async def test_the_controller_keeps_the_namespaces_the_kueue_selector_matches() -> None:
    kube, clock = RecordingKube(), FakeClock()
    c = controller(kube, clock)
    assert c.handlers.kueue_selector is None  # off by default: no namespace is Kueue's
    c.handlers.kueue_selector = parse_selector("kueue.openshift.io/managed=true")
    labels = {ENABLED_KEY: "true", "kueue.openshift.io/managed": "true"}
    ns: Obj = {"metadata": {"name": "team", "labels": labels}}
    await c.handlers.on_namespace("ADDED", ns)
    assert c.kueue_namespaces == {"team"}
    del ns["metadata"]["labels"]["kueue.openshift.io/managed"]
    await c.handlers.on_namespace("MODIFIED", ns)
    assert c.kueue_namespaces == set()
