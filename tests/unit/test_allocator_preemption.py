"""Who may be a preemption victim (webhook/allocator/preemption.py), from the allocator's
model: priorities, terminating pods, reservations, Kueue-managed pods, `system-*` classes,
pods to avoid; and the PodDisruptionBudgets' selectors. The planner itself:
tests/unit/test_preempt.py; the allocator's steps: tests/unit/test_allocator_track.py."""

from __future__ import annotations

from typing import Any

import pytest

from common.placement.preempt import Holder
from tests.integration.allocator_fixtures import make_allocation, make_mig_node, make_node, make_pod
from webhook.allocator.preemption import Budgets, holders, selects, start_time
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


def test_kueue_pods_are_victims_only_when_configured() -> None:
    state = cluster(
        pod("queued", 0, labels={"kueue.x-k8s.io/queue-name": "q"}),
        pod("managed", 0, labels={"kueue.x-k8s.io/managed": "true"}),
    )
    off = by_uid(holders(state, PREEMPTOR, Budgets(), kueue_ok=False))
    on = by_uid(holders(state, PREEMPTOR, Budgets(), kueue_ok=True))
    assert not off["queued"].preemptible and not off["managed"].preemptible
    assert on["queued"].preemptible and on["managed"].preemptible


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
