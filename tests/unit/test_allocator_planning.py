"""How often the placer plans a preemption (webhook/allocator/planning.py, placer.py
`preempt`, the controller's placement loop), counted with a spy on the planners: a plan
that found nothing is not made again when a pod holding no slices leaves a node (the
capacity epoch moves) nor when a holder's status alone changes, and is made again when
anything it read changes (a holder, its allocation, a PodDisruptionBudget, the room of a
node short of the pod's cpu); an ask no node could hold even empty is parked as
`LargerThanAnyNode`, naming the count and the largest node's, and never planned; a spent
CPU budget defers the remaining plans to the next round, which serves another namespace
first and which the loop starts by itself. What a plan chooses is tested elsewhere
(test_preempt.py, test_allocator_preempt_*.py).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest

from common.constants import REASON_PENDING, SIZE_ANNOTATION_PREFIX
from common.kubeapi import Kube
from common.objects import Phase
from common.placement.preempt import plan_preemption
from common.placement.preempt_whole import plan_whole_preemption
from common.sizing import plan_sized_preemption
from testkit.builders import make_allocation, make_mig_node, make_node, make_pod
from testkit.clock import FakeClock, settle
from tests.unit.test_allocator_controller import Leader, RecordingKube, leading, settings
from tests.unit.test_allocator_preempt_sized import cluster, fill_1g
from tests.unit.test_allocator_preempt_whole import decide, placer
from webhook.allocator.controller import Controller
from webhook.allocator.leader import LeaderElector
from webhook.allocator.metrics import AllocatorMetrics
from webhook.allocator.placer import Placer
from webhook.allocator.planning import TOO_LARGE, PlanRounds
from webhook.allocator.state import ClusterState
from webhook.allocator.track import Queue, Seen, next_step

pytestmark = pytest.mark.timeout(10)

Obj = dict[str, Any]
NEVER = "preemption: no set of lower-priority pods frees a placement for it"


@pytest.fixture
def plans(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The pods the placer planned for, one entry per plan (every planner spied on)."""
    calls: list[str] = []

    def spy(real: Callable[..., Any]) -> Callable[..., Any]:
        def plan(snapshot: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append(request.name)
            return real(snapshot, request, *args, **kwargs)

        return plan

    for name, real in (
        ("plan_preemption", plan_preemption),
        ("plan_sized_preemption", plan_sized_preemption),
        ("plan_whole_preemption", plan_whole_preemption),
    ):
        monkeypatch.setattr(f"webhook.allocator.planning.{name}", spy(real))
    yield calls


def parked_7g(name: str = "big", namespace: str = "ns", priority: int = 10) -> Obj:
    return make_pod(name, uid=name, namespace=namespace, priority=priority, cpu="8",
                    slices={"main": {"7g.80gb": 1}})  # fmt: skip


def full_node(web_cpu: str = "48") -> tuple[ClusterState, Obj]:
    """n1 (one H100, 64 cpu): seven 1g.10gb pods of the preemptor's priority (no victim
    for it), `web` (no slices, `web_cpu`) bound there, and the 7g pod `big` (8 cpu)."""
    state = cluster(n1="H100-80GB")
    fill_1g(state, "n1", prio=10)
    web = make_pod("web", uid="web", slices={}, claim=None, gates=(), node_name="n1",
                   phase="Running", cpu=web_cpu)  # fmt: skip
    state.upsert_pod(web)
    state.upsert_pod(parked_7g())
    return state, web


def again(p: Placer, uid: str = "big") -> None:
    """What the controller does for a parked pod once the epoch moved: unpark, queue, decide."""
    assert p.tracks.take_parked() == [uid]
    track = p.tracks.ensure(uid)
    assert isinstance(next_step(track, Seen(pod=p.state.pods[uid], allocations=())), Queue)
    p.decide(uid)


def updated(state: ClusterState, name: str = "n1-3") -> Obj:
    """A holder's pod as its next watch event brings it (to be changed by the caller)."""
    obj = copy.deepcopy(state.pods[name].obj)
    obj["metadata"]["resourceVersion"] = "99"
    return obj


Change = Callable[[ClusterState, Placer, Obj], None]


def web_gone(state: ClusterState, p: Placer, web: Obj) -> None:
    state.remove_pod(web)


def status_only(state: ClusterState, p: Placer, web: Obj) -> None:
    """A holder turns Ready: its pod's status and its allocation's phase change."""
    obj = updated(state)
    obj["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    state.upsert_pod(obj)
    (alloc,) = state.allocations_of("n1-3")
    ready = make_allocation(obj, "n1", [("main", "1g.10gb", 0, 3, 1)], phase=Phase.READY,
                            uid=alloc.uid)  # fmt: skip
    state.upsert_allocation(ready)


@pytest.mark.parametrize("change", [web_gone, status_only], ids=["unrelated-pod-gone", "status"])
def test_a_failed_plan_is_not_made_again_when_nothing_it_read_changed(
    plans: list[str], change: Change
) -> None:
    state, web = full_node()
    p, told = placer(state)
    track = decide(p, "big")
    assert plans == ["ns/big"] and track.told == "Full"
    epoch = state.epoch
    change(state, p, web)
    if change is web_gone:
        assert state.epoch > epoch  # capacity may have grown: the controller retries it
    again(p)  # (a status change alone retries nothing; retried here all the same)
    assert plans == ["ns/big"]  # the same answer, not searched for again
    ((name, reason, message),) = told
    assert (name, reason, track.told) == ("big", REASON_PENDING, "Full")
    assert message.endswith(NEVER), message


def relabelled(state: ClusterState, p: Placer, web: Obj) -> None:
    obj = updated(state)
    obj["metadata"]["labels"]["team"] = "b"  # a PodDisruptionBudget may select it now
    state.upsert_pod(obj)


def terminating(state: ClusterState, p: Placer, web: Obj) -> None:
    obj = updated(state)
    obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    state.upsert_pod(obj)


def released(state: ClusterState, p: Placer, web: Obj) -> None:
    (alloc,) = state.allocations_of("n1-3")
    state.remove_allocation({"metadata": {"namespace": alloc.namespace, "name": alloc.name}})


def new_budget(state: ClusterState, p: Placer, web: Obj) -> None:
    assert p.preemption is not None
    pdb = {"metadata": {"namespace": "ns", "name": "b"}, "spec": {}, "status": {}}
    p.preemption.budgets.upsert(pdb)


def kueue_namespaces(state: ClusterState, p: Placer, web: Obj) -> None:
    """The admin's Kueue selector now matches the holders' namespace: they are not victims."""
    assert p.preemption is not None
    p.preemption = dataclasses.replace(p.preemption, kueue=frozenset({"ns"}))


def owner_backed_off(state: ClusterState, p: Placer, web: Obj) -> None:
    """The preemptor's controller had a pod deleted on n1 as pinned-unschedulable."""
    assert p.preemption is not None
    obj = updated(state, "big")
    obj["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "apps/v1",
            "kind": "ReplicaSet",
            "name": "rs",
            "uid": "rs",
            "controller": True,
        }
    ]
    state.upsert_pod(obj)
    p.preemption.backoff.note("rs", "n1", p.preemption.now())


@pytest.mark.parametrize(
    ("change", "web_cpu"),
    [
        (kueue_namespaces, "48"),
        (owner_backed_off, "48"),
        (relabelled, "48"),
        (terminating, "48"),
        (released, "48"),
        (new_budget, "48"),
        (web_gone, "60"),  # n1 lacked the pod's 8 cpu (4 free): its room is read
    ],
    ids=[
        "kueue-namespaces",
        "owner-backed-off",
        "holder-relabelled",
        "holder-terminating",
        "allocation-gone",
        "pdb",
        "short-node-room",
    ],
)
def test_a_failed_plan_is_made_again_when_what_it_read_changes(
    plans: list[str], change: Change, web_cpu: str
) -> None:
    state, web = full_node(web_cpu)
    p, _ = placer(state)
    track = decide(p, "big")
    assert plans == ["ns/big"] and track.told == "Full"
    change(state, p, web)
    if track.parked_at is None:  # nothing that retries it moved: retried by hand
        p.tracks.park(track, 0)
    again(p)
    assert plans == ["ns/big", "ns/big"]


# --- asks no node holds --------------------------------------------------------------------


def sized(name: str, size: str) -> Obj:
    obj = make_pod(name, uid=name, priority=10, slices={})
    obj["metadata"]["annotations"][SIZE_ANNOTATION_PREFIX + "main"] = size
    return obj


@pytest.mark.parametrize(
    ("pod", "words"),
    [
        (make_pod("big", uid="big", priority=10, slices={"main": {"1g.10gb": 15}}),
         "it asks 15 x 1g.10gb; the largest node it may run on, n2 (2 x H100-80GB), holds "
         "at most 14"),
        (make_pod("big", uid="big", priority=10, slices={"a": {"1g.10gb": 9}, "b": {"1g.10gb": 6}}),
         "it asks 15 x 1g.10gb"),
        (make_pod("big", uid="big", priority=10, slices={"main": {"gpu": 3}}),
         "it asks 3 whole GPUs; the largest node it may run on, n2 (2 x H100-80GB), has 2"),
        (make_pod("big", uid="big", priority=10,
                  slices={"a": {"4g.40gb": 2}, "b": {"3g.40gb": 3}}),
         "its 5 slices take 20 memory slots together; the largest node it may run on, n2 "
         "(2 x H100-80GB), has 16"),
        (sized("big", "memory>=9Gi,count=15"), "it asks 15 x 1g.10gb"),
    ],
    ids=["count", "containers-add-up", "whole-gpus", "memory-slots", "size"],
)  # fmt: skip
@pytest.mark.parametrize("preemption", [True, False], ids=["preemption", "no-preemption"])
def test_an_ask_larger_than_any_node_is_parked_without_planning(
    plans: list[str], pod: Obj, words: str, preemption: bool
) -> None:
    state = cluster(n1="H100-80GB")
    state.upsert_node(make_node("n2", cpu="64", memory="256Gi", pods=50, gpus=2))
    state.upsert_mig_node(make_mig_node("n2", ["H100-80GB"] * 2))
    fill_1g(state, "n1", prio=1)  # victims enough, were the ask to fit a node
    state.upsert_pod(pod)
    p, told = placer(state)
    if not preemption:
        p.preemption = None
    track = decide(p, "big")
    assert plans == []
    assert track.told == TOO_LARGE and track.preempt is None
    ((_, reason, message),) = told
    assert reason == REASON_PENDING
    assert words in message and message.endswith("no preemption is planned for it"), message


@pytest.mark.parametrize("pool", ["small", None], ids=["selects-the-small-node", "any-node"])
def test_only_the_nodes_a_pod_selects_count(plans: list[str], pool: str | None) -> None:
    """8 x 1g.10gb: more than n1's one GPU holds, not more than n2's two (each holding a
    lower-priority 7g): selecting n1 it is too large, else it is planned (and found)."""
    state = ClusterState()
    for name, gpus in (("n1", 1), ("n2", 2)):
        labels = {"pool": "small" if gpus == 1 else "large"}
        state.upsert_node(make_node(name, cpu="64", memory="256Gi", labels=labels, gpus=gpus))
        state.upsert_mig_node(make_mig_node(name, ["H100-80GB"] * gpus))
    for g in range(2):
        fill = make_pod(f"f{g}", uid=f"f{g}", priority=1, gates=(), node_name="n2",
                        phase="Running", slices={"main": {"7g.80gb": 1}})  # fmt: skip
        state.upsert_pod(fill)
        state.upsert_allocation(make_allocation(fill, "n2", [("main", "7g.80gb", g, 0, 8)]))
    fill_1g(state, "n1", prio=1)
    state.upsert_pod(make_pod("big", uid="big", priority=10, slices={"main": {"1g.10gb": 8}},
                              node_selector={"pool": pool} if pool else None))  # fmt: skip
    p, told = placer(state)
    track = decide(p, "big")
    if pool:
        assert plans == [] and track.told == TOO_LARGE
        assert "n1 (1 x H100-80GB), holds at most 7" in told[0][2]
    else:
        assert plans == ["ns/big"] and track.preempt is not None


# --- rounds ----------------------------------------------------------------------------------


class Cpu:
    """A CPU clock the spied planner advances by one second per plan."""

    def __init__(self, plans: list[str]) -> None:
        self.plans = plans

    def __call__(self) -> float:
        return float(len(self.plans))


def run_round(p: Placer) -> None:
    """One round of the placement loop."""
    p.start_round()
    while p.waiting():
        p.place_queued()


def test_a_spent_budget_defers_plans_and_the_next_round_serves_another_namespace_first(
    plans: list[str],
) -> None:
    state = cluster(n1="H100-80GB")
    fill_1g(state, "n1", prio=50)  # nobody's victim: every plan finds nothing
    pods = [parked_7g("a1", "a", 30), parked_7g("a2", "a", 20), parked_7g("b1", "b", 10)]
    p, _ = placer(state)
    p.rounds = PlanRounds(budget_s=1.0, cpu=Cpu(plans))
    for pod in pods:
        state.upsert_pod(pod)
        p.tracks.ensure(pod["metadata"]["uid"])
        view = state.pods[pod["metadata"]["uid"]]
        p.queue.push(view.uid, priority=view.priority, created=view.created, key=view.key)
    run_round(p)
    assert plans == ["a/a1"]  # the budget is spent: a2 and b1 wait
    assert p.rounds.deferred == {"a2", "b1"}
    for uid in ("a2", "b1"):
        track = p.tracks.get(uid)
        assert track is not None and track.plan_deferred and track.parked_at is not None
    run_round(p)
    assert plans == ["a/a1", "b/b1"]  # b's turn, though a2 has the higher priority
    run_round(p)
    assert plans == ["a/a1", "b/b1", "a/a2"]
    run_round(p)
    assert plans == ["a/a1", "b/b1", "a/a2"] and not p.rounds.deferred


async def test_the_loop_runs_the_deferred_round_by_itself(plans: list[str]) -> None:
    kube, clock = RecordingKube(), FakeClock()
    c = Controller(
        cast(Kube, kube),
        cast(LeaderElector, Leader()),
        AllocatorMetrics(),
        settings(clock, preemption=True, preemption_round_cpu_s=0.0),  # one plan a round
    )
    c.opted_in.update({"a", "b"})
    async with leading(c):
        await c.handlers.on_node("ADDED", make_node("n1", cpu="64", memory="256Gi", pods=50))
        await c.handlers.on_mig_node("ADDED", make_mig_node("n1"))
        for s in range(7):
            pod = make_pod(f"h{s}", uid=f"h{s}", namespace="a", priority=50, gates=(),
                           node_name="n1", phase="Running")  # fmt: skip
            await c.handlers.on_pod("ADDED", pod)
            alloc = make_allocation(pod, "n1", [("main", "1g.10gb", 0, s, 1)], phase=Phase.READY)
            await c.handlers.on_allocation("ADDED", alloc)
        await c.handlers.on_pod("ADDED", parked_7g("a1", "a", 30))
        await c.handlers.on_pod("ADDED", parked_7g("b1", "b", 10))
        await settle()
        assert sorted(plans) == ["a/a1", "b/b1"]
        assert set(c.parked) == {"a1", "b1"}
        told = [e[2] for e in kube.writes("create") if e[1].endswith("/events")]
        assert [e["message"].endswith(NEVER) for e in told] == [True, True]  # deferral untold
