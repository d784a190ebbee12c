"""The allocator's pod record and its pure decision (webhook.allocator.track).

A table with a row for every step `next_step` can return (and the precedence between
them), a hypothesis property (never a write for an allocation whose create is in flight,
never a pin to one the allocator deleted), and the `Tracks` indexes: parked pods, pending
reasons, the pinned-unschedulable timer. The shell that executes the steps:
tests/unit/test_allocator_controller.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.allocation import SliceAllocation
from common.constants import GATE_NAME
from common.objects import Phase
from testkit.builders import make_allocation, make_pod
from webhook.allocator import pods as podlib
from webhook.allocator.preemption import Preemption, Victim
from webhook.allocator.track import (
    Act,
    AwaitVictims,
    Create,
    Dequeue,
    Evict,
    Forget,
    GiveUp,
    Kick,
    OnAllocation,
    Pin,
    PodTrack,
    Queue,
    Seen,
    Settled,
    Step,
    Tracks,
    Unserved,
    Unstick,
    UnstickPod,
    Wait,
    next_step,
    placeable,
)
from webhook.allocator.views import PodView

pytestmark = pytest.mark.timeout(10)

CLAIM = "cclaim"
POD = make_pod("p", uid="p", claim=CLAIM, created="2026-01-01T00:00:00Z")


def pod(**changes: Any) -> PodView:
    """The pod, gated by ours alone unless `gates` says otherwise."""
    obj = make_pod("p", uid="p", claim=CLAIM, created="2026-01-01T00:00:00Z", **changes)
    return PodView.of(obj)


WHOLE = pod(slices={"main": {"gpu": 1}})  # asks for a whole GPU (instaslice.io/gpu)


def unschedulable_pinned() -> PodView:
    obj = podlib.pin(POD, "n1")
    obj["status"] = {
        "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]
    }
    return PodView.of(obj)


def alloc(
    phase: Phase = Phase.PENDING, *, uid: str = "a1", deleting: bool = False, node: str = "n1"
) -> SliceAllocation:
    obj = make_allocation(POD, node, [("main", "1g.10gb", 0, 0, 1)], phase=phase, uid=uid)
    if deleting:
        obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return SliceAllocation.parse(obj)


def seen(p: PodView | None, *allocs: SliceAllocation, **kw: Any) -> Seen:
    kw.setdefault("nodes", frozenset(a.node for a in allocs))
    return Seen(pod=p, allocations=allocs, **kw)


def done_future() -> asyncio.Future[Any]:
    loop = asyncio.new_event_loop()
    fut: asyncio.Future[Any] = loop.create_future()
    fut.set_result({})
    loop.close()
    return fut


def pending_future() -> asyncio.Future[Any]:
    loop = asyncio.new_event_loop()
    fut: asyncio.Future[Any] = loop.create_future()
    loop.close()
    return fut


BODY = {"metadata": {"name": CLAIM}}

V1, V2 = Victim("v1", "ns", "low-1"), Victim("v2", "ns", "low-2")


def preempting(**changes: Any) -> PodTrack:
    """A pod whose preemption of v1 and v2 is in flight (deadline at t=100)."""
    p = Preemption(
        body=BODY,
        key=f"ns/{CLAIM}",
        node="n1",
        victims=(V1, V2),
        waits_for=frozenset({"v1", "v2"}),
        deadline=100.0,
    )
    for k, v in changes.items():
        setattr(p, k, v)
    return PodTrack("p", preempt=p)


def waiting(p: PodView | None = None, **kw: Any) -> Seen:
    """The preemptor, gated, with its reservation (an assumed allocation) in the cache."""
    kw.setdefault("now", 10.0)
    return seen(p or pod(), alloc(), assumed=frozenset({alloc().key}), **kw)


Kind = type[Step] | Act  # a step's class, or what it does with an allocation


def kind_of(step: Step) -> Kind:
    return step.act if isinstance(step, OnAllocation) else type(step)


# (id, track, seen, expected kind, expected detail or None)
ROWS: list[tuple[str, PodTrack, Seen, Kind, str | None]] = [
    # 0b. a preemption in flight (its slots reserved)
    (
        "preempt-evicts-running-victims",
        preempting(),
        waiting(victims_alive=frozenset({"v1", "v2"}), holding=frozenset({"v1", "v2"})),
        Evict,
        None,
    ),
    (
        "preempt-waits-for-evicted-victims-to-release",
        preempting(evicted=frozenset({"v1", "v2"})),
        waiting(victims_alive=frozenset({"v2"}), holding=frozenset({"v2"})),
        AwaitVictims,
        None,
    ),
    (
        "preempt-creates-once-every-victim-slot-is-free",
        preempting(evicted=frozenset({"v1", "v2"})),
        waiting(),
        Create,
        None,
    ),
    (
        "preempt-victims-that-outlive-the-deadline",
        preempting(evicted=frozenset({"v1", "v2"})),
        waiting(holding=frozenset({"v2"}), now=100.0),
        GiveUp,
        "victims did not release their slices in time",
    ),
    (
        "preempt-victims-gone-but-the-ampere-mode-change-not-done",
        preempting(evicted=frozenset({"v1", "v2"})),
        waiting(modes_pending=True),
        AwaitVictims,
        None,
    ),
    (
        "preempt-ampere-mode-change-past-the-deadline",
        preempting(evicted=frozenset({"v1", "v2"})),
        waiting(modes_pending=True, now=100.0),
        GiveUp,
        "the MIG mode change (Ampere maintenance) was not done in time",
    ),
    (
        "preempt-eviction-refused",
        preempting(refused="v1"),
        waiting(victims_alive=frozenset({"v1", "v2"}), holding=frozenset({"v1", "v2"})),
        GiveUp,
        "an eviction was refused (PodDisruptionBudget)",
    ),
    (
        "preempt-preemptor-deleted",
        preempting(),
        seen(None),
        GiveUp,
        "the preemptor is gone",
    ),
    (
        "preempt-preemptor-being-deleted",
        preempting(),
        waiting(dataclasses.replace(pod(), deleting=True)),
        GiveUp,
        "the preemptor is gone",
    ),
    (
        "preempt-preemptor-ungated-by-someone-else",
        preempting(),
        waiting(pod(gates=())),
        GiveUp,
        "the preemptor is no longer InstaSlice's to place",
    ),
    (
        "preempt-whole-gpus-namespace-opted-out-of-them",
        preempting(),
        waiting(WHOLE, whole_gpu=False),
        GiveUp,
        "the preemptor is no longer InstaSlice's to place",
    ),
    # 1. pinned and unschedulable past the timeout
    (
        "unstick-due",
        PodTrack("p", unstick=Unstick.DUE),
        seen(unschedulable_pinned(), alloc(Phase.READY)),
        UnstickPod,
        None,
    ),
    (
        "unstick-due-but-bound-meanwhile",
        PodTrack("p", unstick=Unstick.DUE),
        seen(pod(gates=(), node_name="n1"), alloc(Phase.READY)),
        Settled,
        None,
    ),
    # 2. per allocation
    ("node-gone", PodTrack("p"), seen(pod(), alloc(), nodes=frozenset()), Act.FINALIZE, None),
    (
        "node-gone-finalizer-dropped-deleting",
        PodTrack("p"),
        seen(
            pod(),
            dataclasses.replace(alloc(deleting=True), finalizers=()),
            nodes=frozenset(),
        ),
        Wait,
        None,
    ),
    ("orphan-never-seen", PodTrack("p"), seen(None, alloc(Phase.READY)), Act.RELEASE_ORPHAN, None),
    (
        "pod-deleted-event",
        PodTrack("p", gone="its pod is gone"),
        seen(None, alloc(Phase.READY)),
        Act.RELEASE,
        "its pod is gone",
    ),
    (
        "pod-finished",
        PodTrack("p"),
        seen(pod(gates=(), phase="Succeeded"), alloc(Phase.READY)),
        Act.RELEASE,
        "the pod finished",
    ),
    (
        "claim-changed",
        PodTrack("p"),
        seen(PodView.of(make_pod("p", uid="p", claim="cother")), alloc(Phase.READY)),
        Act.RELEASE,
        "the pod no longer carries this claim",
    ),
    (
        "other-namespace",  # a record naming our pod's uid in another namespace is not ours
        PodTrack("p"),
        seen(PodView.of(make_pod("p", uid="p", claim=CLAIM, namespace="x")), alloc(Phase.READY)),
        Act.RELEASE,
        "it is not in the pod's namespace",
    ),
    ("failed", PodTrack("p"), seen(pod(), alloc(Phase.FAILED)), Act.RELEASE_FAILED, None),
    (
        "agent-down-untouched",
        PodTrack("p"),
        seen(pod(), alloc(), agents_down=frozenset({"n1"})),
        Act.MOVE_OFF,
        None,
    ),
    (
        "agent-down-but-acted-on",
        PodTrack("p"),
        seen(pod(), alloc(Phase.CREATING), agents_down=frozenset({"n1"})),
        Wait,
        None,
    ),
    (
        "assumed-is-left-alone",
        PodTrack("p"),
        seen(None, alloc(), assumed=frozenset({f"ns/{CLAIM}"})),
        Forget,
        None,
    ),
    (
        "released-by-us-stale-event",
        PodTrack("p", released=frozenset({"a1"})),
        seen(None, alloc(Phase.READY)),
        Forget,
        None,
    ),
    # 3. nothing to remember
    ("pod-gone-nothing-held", PodTrack("p"), seen(None), Forget, None),
    ("no-claim", PodTrack("p"), seen(PodView.of(make_pod("p", uid="p", claim=None))), Forget, None),
    ("finished-nothing-held", PodTrack("p"), seen(pod(gates=(), phase="Failed")), Wait, None),
    # 4. gated by ours
    ("foreign-gate-first", PodTrack("p"), seen(pod(gates=("kueue", GATE_NAME))), Dequeue, None),
    ("not-opted-in", PodTrack("p"), seen(pod(), opted_in=False), Dequeue, None),
    ("whole-gpus-not-opted-in", PodTrack("p"), seen(WHOLE, whole_gpu=False), Unserved, None),
    ("slices-need-no-whole-gpu-opt-in", PodTrack("p"), seen(pod(), whole_gpu=False), Queue, None),
    ("whole-gpus-opted-in", PodTrack("p"), seen(WHOLE), Queue, None),
    (  # placed before the namespace opted out: what was promised is kept
        "whole-gpus-placed-before-an-opt-out",
        PodTrack("p"),
        seen(WHOLE, alloc(Phase.READY), whole_gpu=False),
        Pin,
        None,
    ),
    (
        "gated-but-deleting",
        PodTrack("p"),
        seen(dataclasses.replace(pod(), deleting=True)),
        Dequeue,
        None,
    ),
    ("decided", PodTrack("p", create=BODY), seen(pod(), alloc()), Create, None),
    (
        "decided-then-deleting",  # the assumed slots are never left unsent
        PodTrack("p", create=BODY),
        seen(dataclasses.replace(pod(), deleting=True), alloc()),
        Create,
        None,
    ),
    ("decided-pod-gone", PodTrack("p", create=BODY), seen(None), Forget, None),
    (
        "create-in-flight",
        PodTrack("p", creating=pending_future()),
        seen(pod()),
        Wait,
        "its create is in flight",
    ),
    ("name-held-by-another", PodTrack("p"), seen(pod(), name_holder="old"), Kick, None),
    ("parked-same-generation", PodTrack("p", parked_at=0), seen(pod()), Wait, None),
    (
        "parked-spec-changed",
        PodTrack("p", parked_at=0),
        seen(dataclasses.replace(pod(), generation=1)),
        Queue,
        None,
    ),
    ("to-place", PodTrack("p", creating=done_future()), seen(pod()), Queue, None),
    ("ready", PodTrack("p"), seen(pod(), alloc(Phase.READY)), Pin, None),
    (
        "ready-pinned-echo-pending",
        PodTrack("p", pinned=True),
        seen(pod(), alloc(Phase.READY)),
        Wait,
        "pinned already; the watch has not caught up",
    ),
    (
        "ready-but-released-by-us",
        PodTrack("p", released=frozenset({"a1"})),
        seen(pod(), alloc(Phase.READY)),
        Wait,
        None,
    ),
    ("agent-working", PodTrack("p"), seen(pod(), alloc(Phase.CREATING)), Wait, None),
    # 5. ungated
    ("ungated-running", PodTrack("p"), seen(pod(gates=(), node_name="n1")), Settled, None),
]


@pytest.mark.parametrize(
    ("track", "view", "kind", "detail"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS]
)
def test_next_step(track: PodTrack, view: Seen, kind: Kind, detail: str | None) -> None:
    step = next_step(track, view)
    assert kind_of(step) == kind
    if detail is not None:
        assert getattr(step, "why", None) == detail


@pytest.mark.parametrize(
    ("view", "expected"),
    [
        (pod(), True),
        (pod(gates=[GATE_NAME, "kueue.x-k8s.io/admission"]), False),  # another gate first
        (pod(gates=[]), False),  # ungated
        (PodView.of({**POD, "metadata": {**POD["metadata"], "deletionTimestamp": "x"}}), False),
        (pod(phase="Failed"), False),
        (PodView.of(make_pod("p", uid="p", claim=None)), False),  # not InstaSlice's
    ],
    ids=["ours-alone", "another-gate", "ungated", "deleting", "finished", "no-claim"],
)
def test_placeable_is_the_one_eligibility_check(view: PodView, expected: bool) -> None:
    """next_step queues, the placer decides for, and the autoscaler signal keeps a signal
    for, exactly the pods this says."""
    assert placeable(view) is expected


def test_every_step_has_a_row() -> None:
    kinds = {k for _, _, _, k, _ in ROWS}
    assert kinds == (set(Step.__args__) - {OnAllocation}) | set(Act)


def test_settled_says_whether_the_scheduler_gave_up() -> None:
    assert next_step(PodTrack("p"), seen(unschedulable_pinned())) == Settled(waiting=True)
    bound = pod(gates=(), node_name="n1")
    assert next_step(PodTrack("p"), seen(bound)) == Settled(waiting=False)


@given(
    phase=st.sampled_from(list(Phase)),
    assumed=st.booleans(),
    released=st.booleans(),
    deleting=st.booleans(),
    gated=st.booleans(),
    pod_present=st.booleans(),
    node_known=st.booleans(),
    agent_down=st.booleans(),
    pinned=st.booleans(),
)
def test_no_write_for_a_create_in_flight_and_no_pin_to_a_released_allocation(
    phase: Phase,
    assumed: bool,
    released: bool,
    deleting: bool,
    gated: bool,
    pod_present: bool,
    node_known: bool,
    agent_down: bool,
    pinned: bool,
) -> None:
    a = alloc(phase, deleting=deleting)
    track = PodTrack(
        "p",
        released=frozenset({"a1"}) if released else frozenset(),
        pinned=pinned,
    )
    view = Seen(
        pod=(pod() if gated else pod(gates=(), node_name="n1")) if pod_present else None,
        allocations=(a,),
        assumed=frozenset({a.key}) if assumed else frozenset(),
        nodes=frozenset({"n1"}) if node_known else frozenset(),
        agents_down=frozenset({"n1"}) if agent_down else frozenset(),
    )
    step = next_step(track, view)
    target = getattr(step, "alloc", None)
    if assumed:
        assert target is None  # never touched while its create is in flight
    if isinstance(step, Pin):
        assert not released and not deleting and phase is Phase.READY and not pinned
    if isinstance(step, OnAllocation) and step.act is not Act.FINALIZE:
        assert not released and not deleting  # never released twice by this record


# --- the records ----------------------------------------------------------------------------


def test_parked_pods_are_taken_once_capacity_grows() -> None:
    tracks = Tracks()
    a, b = tracks.ensure("a"), tracks.ensure("b")
    tracks.park(a, 3)
    tracks.park(b, 0)
    assert tracks.parked == {"a": 3, "b": 0}
    tracks.unpark(b)
    assert tracks.take_parked() == ["a"]
    assert tracks.parked == {} and a.parked_at is None


def test_pending_counts_and_the_end_of_a_term() -> None:
    tracks = Tracks()
    tracks.ensure("a").told = "Full"
    tracks.ensure("b").told = "NodeResources"
    tracks.park(tracks.ensure("c"), 0)
    tracks.get("c").told = "Full"  # type: ignore[union-attr]
    assert tracks.pending_counts() == {"Full": 2, "NodeResources": 1}
    tracks.end_term()
    assert tracks.pending_counts() == {} and tracks.parked == {}
    tracks.forget("a")
    assert tracks.get("a") is None and len(tracks) == 2


def test_unschedulable_timer() -> None:
    tracks = Tracks()
    a, b = tracks.ensure("a"), tracks.ensure("b")
    tracks.observe_unschedulable(a, True, now=10.0)
    tracks.observe_unschedulable(a, True, now=15.0)  # keeps the first time
    tracks.observe_unschedulable(b, True, now=12.0)
    assert tracks.next_deadline(5.0) == 15.0
    assert tracks.due(14.9, 5.0) == []
    assert tracks.due(17.0, 5.0) == ["a", "b"]
    assert a.unstick is Unstick.DUE
    assert tracks.due(30.0, 5.0) == []  # handled once
    assert tracks.next_deadline(5.0) is None
    tracks.observe_unschedulable(a, False, now=31.0)
    tracks.observe_unschedulable(a, True, now=32.0)
    assert tracks.due(37.0, 5.0) == ["a"]
