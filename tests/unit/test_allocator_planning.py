"""How often the placer plans a preemption (webhook/allocator/planning.py, placer.py
`preempt`), counted with a spy on the planners: a plan that found nothing is not made again
when a pod holding no slices leaves a node (the capacity epoch moves) nor when a holder's
status alone changes, and is made again when anything it read changes (a holder, its
allocation, a PodDisruptionBudget, the room of a node short of the pod's cpu). What a plan
chooses is tested elsewhere (test_preempt.py, test_allocator_preempt_*.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from common.constants import REASON_PENDING
from common.objects import Phase
from common.placement.preempt import plan_preemption
from common.placement.preempt_whole import plan_whole_preemption
from common.sizing import plan_sized_preemption
from tests.integration.allocator_fixtures import make_allocation, make_pod
from tests.unit.test_allocator_preempt_sized import cluster, fill_1g
from tests.unit.test_allocator_preempt_whole import decide, placer
from webhook.allocator.placer import Placer
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
        monkeypatch.setattr(f"webhook.allocator.placer.{name}", spy(real))
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


@pytest.mark.parametrize(
    ("change", "web_cpu"),
    [
        (relabelled, "48"),
        (terminating, "48"),
        (released, "48"),
        (new_budget, "48"),
        (web_gone, "60"),  # n1 lacked the pod's 8 cpu (4 free): its room is read
    ],
    ids=["holder-relabelled", "holder-terminating", "allocation-gone", "pdb", "short-node-room"],
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
