"""The placer's preemption for size-based asks (webhook/allocator/planning.py `Planner` over
common/sizing.py `plan_sized_preemption`), on the allocator's model: a high-priority pod
asking `memory>=20Gi` on a full H100 plans to evict the lower-priority pods its resolved
profile needs and reserves exactly the allocation a normal sized placement writes once they
are gone (the resolved profile, GPU UUID, window, summary), so nobody else is given those
slots meanwhile; across models the reservation is on the model of the cheaper victims, with
that model's profile; holders of equal priority or `preemptionPolicy: Never` leave the pod
pending, told why. The planner itself: test_sizing_preempt.py; the steps after the plan
(evict, await, create) on the API server: tests/integration/test_allocator_preempt_sized.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from common.catalog import load_catalog
from common.constants import REASON_PENDING, SIZE_ANNOTATION_PREFIX
from testkit.builders import gpu_uuid, make_allocation, make_mig_node, make_node, make_pod
from tests.unit.test_allocator_preempt_whole import decide, placer
from webhook.allocator.state import ClusterState

pytestmark = pytest.mark.timeout(10)

H100, H200 = "H100-80GB", "H200-141GB"
Obj = dict[str, Any]


def cluster(**nodes: str) -> ClusterState:
    """One node per keyword (name=model), one GPU in MIG mode each."""
    state = ClusterState()
    for name, model in nodes.items():
        state.upsert_node(make_node(name, cpu="64", memory="256Gi", pods=50, gpus=1))
        state.upsert_mig_node(make_mig_node(name, [model]))
    return state


def hold(state: ClusterState, name: str, node: str, start: int, profile: str, prio: int) -> None:
    model = load_catalog().model(H200 if node.startswith("h200") else H100)
    assert model is not None
    size = next(p.memory_slots for p in model.profiles if p.name == profile)
    obj = make_pod(name, uid=name, priority=prio, gates=(), node_name=node, phase="Running",
                   slices={"main": {profile: 1}})  # fmt: skip
    state.upsert_pod(obj)
    state.upsert_allocation(make_allocation(obj, node, [("main", profile, 0, start, size)]))


def fill_1g(state: ClusterState, node: str, prio: int, profile: str = "1g.10gb") -> list[str]:
    names = [f"{node}-{s}" for s in range(7)]
    for s, name in enumerate(names):
        hold(state, name, node, s, profile, prio)
    return names


def sized_pod(state: ClusterState, name: str = "hi", size: str = "memory>=20Gi", **kw: Any) -> Obj:
    obj = make_pod(name, uid=name, claim=f"c-{name}", priority=10, slices={}, **kw)
    obj["metadata"]["annotations"][SIZE_ANNOTATION_PREFIX + "main"] = size
    state.upsert_pod(obj)
    return obj


def test_a_sized_pod_reserves_what_a_sized_placement_writes_once_the_victims_are_gone() -> None:
    state = cluster(n1=H100)
    lows = fill_1g(state, "n1", prio=1)
    sized_pod(state)
    p, told = placer(state)
    pre = decide(p, "hi").preempt
    assert pre is not None and told == [], told
    victims = sorted(v.name for v in pre.victims)
    assert victims == ["n1-4", "n1-5", "n1-6"]  # a 3g.40gb at slot 4 (1g.20gb is 19.6 GiB)
    (spec,) = pre.body["spec"]["slices"]
    assert (spec["profile"], spec["gpuUUID"], spec["start"], spec["size"]) == (
        "3g.40gb",
        gpu_uuid("n1", 0),
        4,
        4,
    )
    assert "kind" not in spec
    assert state.snapshot().nodes[0].gpus[0].mask == 0xFF  # reserved: slot 7 is taken too
    # the same pod on the same GPU without those pods: placed, not preempted, the same object
    alone = cluster(n1=H100)
    for name in sorted(set(lows) - set(victims)):
        hold(alone, name, "n1", int(name[-1]), "1g.10gb", prio=1)
    sized_pod(alone)
    create = decide(placer(alone)[0], "hi").create
    assert create is not None
    assert create["spec"]["slices"] == pre.body["spec"]["slices"]
    assert create["metadata"]["annotations"] == pre.body["metadata"]["annotations"]


def test_a_pod_arriving_meanwhile_is_not_given_the_reserved_slots() -> None:
    state = cluster(n1=H100)
    fill_1g(state, "n1", prio=1)
    sized_pod(state)
    p, told = placer(state)
    assert decide(p, "hi").preempt is not None
    small = make_pod("small", uid="small", priority=0, slices={"main": {"1g.10gb": 1}})
    state.upsert_pod(small)
    assert decide(p, "small").create is None
    assert told[-1][:2] == ("small", REASON_PENDING)


def test_across_models_the_cheaper_victims_win_with_that_models_profile() -> None:
    """memory>=30Gi: the H200's 1g.35gb is less memory than the H100's 3g.40gb, but the
    H200's pods are of higher priority (below the preemptor's)."""
    state = cluster(h100=H100, h200=H200)
    hold(state, "big", "h100", 0, "7g.80gb", prio=1)
    fill_1g(state, "h200", prio=5, profile="1g.18gb")
    sized_pod(state, size="memory>=30Gi")
    pre = decide(placer(state)[0], "hi").preempt
    assert pre is not None and [v.name for v in pre.victims] == ["big"]
    assert pre.node == "h100"
    assert [(s["profile"], s["gpuUUID"]) for s in pre.body["spec"]["slices"]] == [
        ("3g.40gb", gpu_uuid("h100", 0))
    ]


@pytest.mark.parametrize(
    ("prio", "never", "ending"),
    [
        (10, False, "preemption: no set of lower-priority pods frees a placement for it"),
        (1, True, "its preemptionPolicy is Never: it preempts no pod"),
    ],
)
def test_no_plan_leaves_the_sized_pod_pending_and_says_why(
    prio: int, never: bool, ending: str
) -> None:
    state = cluster(n1=H100)
    fill_1g(state, "n1", prio=prio)
    obj = sized_pod(state)
    if never:
        obj["spec"]["preemptionPolicy"] = "Never"
        state.upsert_pod(obj)
    p, told = placer(state)
    track = decide(p, "hi")
    assert track.preempt is None and track.create is None
    ((name, reason, message),) = told
    assert (name, reason, track.told) == ("hi", REASON_PENDING, "Full")
    assert message.endswith(ending), message
