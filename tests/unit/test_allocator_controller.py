"""The allocator loop's decisions, without an API server: a recording fake `Kube`, an
always-leader elector and the fake clock.

Covers what is hard to provoke on a real cluster on purpose: the pinned-unschedulable
timeout on the injected clock (owned pod deleted, bare pod told); the safety checks before a
destructive write (an allocation looks orphaned or its node looks gone only because the
cache lags: a GET says otherwise, nothing is written); finalizing a gone node's record;
placement after a Failed allocation avoiding the failed GPU; a foreign gate; a lapsed Lease
retrying a step instead of dropping it; a failed leadership term handing the Lease back
instead of taking the process down. The same paths on a real control plane:
tests/integration/test_allocator.py.
"""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

import pytest

from common.clock import cancel_until_done
from common.constants import (
    GATE_NAME,
    REASON_PENDING,
    REASON_PINNED_UNSCHEDULABLE,
    RELEASE_FINALIZER,
)
from common.kubeapi import ApiError, Kube, Obj
from common.objects import Phase
from testkit.builders import GpuSpec, gpu_uuid, make_allocation, make_mig_node, make_node, make_pod
from testkit.clock import FakeClock, settle
from webhook.allocator import AllocatorSettings, run_controller
from webhook.allocator import pods as podlib
from webhook.allocator.autoscale import ScaleUpSettings, SignalMode
from webhook.allocator.controller import Controller
from webhook.allocator.leader import LeaderElector, NotLeader
from webhook.allocator.metrics import AllocatorMetrics
from webhook.allocator.preemption import Preemption

pytestmark = pytest.mark.timeout(10)

TIMEOUT = 30.0


class RecordingKube:
    """Answers GETs from `objects` (404 otherwise) and records every call."""

    def __init__(self) -> None:
        self.objects: dict[str, Obj] = {}
        self.calls: list[tuple[str, str, Any]] = []

    def writes(self, verb: str | None = None) -> list[tuple[str, str, Any]]:
        return [c for c in self.calls if c[0] != "get" and (verb is None or c[0] == verb)]

    async def get(self, path: str) -> Obj:
        self.calls.append(("get", path, None))
        if path not in self.objects:
            raise ApiError(404, "NotFound", path)
        return copy.deepcopy(self.objects[path])

    async def list(self, path: str, **query: Any) -> Obj:
        return {"items": []}

    async def create(self, path: str, body: Obj, **query: Any) -> Obj:
        self.calls.append(("create", path, body))
        return {**body, "metadata": {**body["metadata"], "resourceVersion": "1", "uid": "new"}}

    async def replace(self, path: str, body: Obj) -> Obj:
        self.calls.append(("replace", path, body))
        return body

    async def patch(self, path: str, body: Any, kind: str = "merge", **query: Any) -> Obj:
        self.calls.append(("patch", path, body))
        return {}

    async def delete(self, path: str, body: Obj | None = None, **query: Any) -> Obj:
        self.calls.append(("delete", path, body))
        return {}


class SlowCreates(RecordingKube):
    """Creates wait until the test lets them through (an overloaded API server)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def create(self, path: str, body: Obj, **query: Any) -> Obj:
        if "sliceallocations" in path:
            await self.gate.wait()
        return await super().create(path, body, **query)


class Leader:
    def __init__(self) -> None:
        self.leading = True

    @property
    def is_leader(self) -> bool:
        return self.leading

    def check(self) -> None:
        if not self.leading:
            raise NotLeader("test")


def settings(clock: FakeClock, **overrides: Any) -> AllocatorSettings:
    return AllocatorSettings(
        namespace="instaslice-system",
        identity="test",
        clock=clock,
        pinned_unschedulable_timeout_s=TIMEOUT,
        max_backoff_s=1.0,
        **overrides,
    )


def controller(
    kube: RecordingKube, clock: FakeClock, elector: Leader | None = None, **overrides: Any
) -> Controller:
    """A controller whose Lease informer has synced (renewals count when seen);
    `overrides`: AllocatorSettings fields."""
    c = Controller(
        cast(Kube, kube),
        cast(LeaderElector, elector or Leader()),
        AllocatorMetrics(),
        settings(clock, **overrides),
    )
    c.lease_informer.synced.set()
    c.opted_in.add("ns")  # the tests' pods live in namespace "ns", opted in
    c.whole_gpu.add("ns")  # and to whole GPUs
    return c


@asynccontextmanager
async def leading(c: Controller) -> AsyncIterator[None]:
    """The loops of a leadership term, without informers (events are fed by hand)."""
    term = asyncio.create_task(c.term(revisit=False))
    try:
        await asyncio.sleep(0)  # the term starts (it leads from its first step)
        yield
        await settle()
    finally:
        await cancel_until_done([term])


async def node(c: Controller, name: str = "n1", gpus: int = 1) -> None:
    await c.handlers.on_node("ADDED", make_node(name, gpus=gpus))
    await c.handlers.on_mig_node("ADDED", make_mig_node(name, [GpuSpec()] * gpus))


def unschedulable(pod: Obj) -> Obj:
    pod = podlib.pin(pod, "n1")
    pod["metadata"]["resourceVersion"] = "7"
    pod["status"] = {
        "phase": "Pending",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/1 nodes are available: 1 Insufficient cpu.",
            }
        ],
    }
    return pod


def event_reasons(kube: RecordingKube) -> list[str]:
    return [c[2]["reason"] for c in kube.writes("create") if c[1].endswith("/events")]


# --- the autoscaler signal's watches -------------------------------------------------------


async def test_a_term_pins_nothing_before_the_signal_watches_listed() -> None:
    """A term's workers start once the autoscaler signal's watches have listed (a new
    leader's first pins would know no placeholder), so `make_room` never waits for them."""
    kube, clock = RecordingKube(), FakeClock()
    c = controller(kube, clock, scale_up=ScaleUpSettings(mode=SignalMode.PLACEHOLDER))
    listing = asyncio.Event()

    async def run() -> None:  # stands for ScaleUp.run: its watches list, then its rounds
        await listing.wait()
        c.scale_up.synced.set()
        await asyncio.Event().wait()

    c.scale_up.run = run  # type: ignore[method-assign]
    pod = make_pod("p", uid="p")
    alloc = make_allocation(pod, "n1", [("main", "1g.10gb", 0, 0, 1)], phase=Phase.READY)
    await node(c)
    await c.handlers.on_allocation("ADDED", alloc)
    await c.handlers.on_pod("ADDED", pod)
    term = asyncio.create_task(c.term(revisit=True))
    try:
        await settle()
        assert kube.writes() == [] and not c.work.active  # nothing pinned, no worker yet
        listing.set()
        await settle()
        assert [call[1] for call in kube.writes("replace")] == ["/api/v1/namespaces/ns/pods/p"]
    finally:
        await cancel_until_done([term])


# --- pinned but unschedulable --------------------------------------------------------------


@pytest.mark.parametrize("owned", [True, False], ids=["controller-owned", "bare"])
async def test_pinned_unschedulable_after_the_timeout(owned: bool) -> None:
    kube, clock = RecordingKube(), FakeClock()
    c = controller(kube, clock)
    owner = {"kind": "ReplicaSet", "name": "rs", "uid": "rs-uid", "controller": True}
    pod = make_pod("p", uid="p", owner=owner if owned else None)
    alloc = make_allocation(pod, "n1", [("main", "1g.10gb", 0, 0, 1)], phase=Phase.READY)
    kube.objects["/api/v1/namespaces/ns/pods/p"] = unschedulable(pod)  # still stuck when read
    async with leading(c):
        await node(c)
        await c.handlers.on_allocation("ADDED", alloc)
        await c.handlers.on_pod("ADDED", unschedulable(pod))
        await settle()
        await clock.advance(TIMEOUT - 1)
        assert kube.writes("delete") == []
        await clock.advance(1)
        await settle()
    deletes = [(c[1], c[2]) for c in kube.writes("delete")]
    alloc_path = (
        f"/apis/instaslice.io/v1alpha1/namespaces/ns/sliceallocations/{alloc['metadata']['name']}"
    )
    # the pod first, only as read (a bind since then would make it fail), then its slices:
    # a failed delete must not leave the pod ungated without slices (issue 17). A bare pod
    # too (security: ungated without slices, the kubelet would hand it another pod's)
    assert [path for path, _ in deletes] == ["/api/v1/namespaces/ns/pods/p", alloc_path]
    assert deletes[0][1] == {"preconditions": {"uid": "p", "resourceVersion": "7"}}
    assert event_reasons(kube) == [REASON_PINNED_UNSCHEDULABLE]
    assert c.metrics.count("pinned_unschedulable") == 1


async def test_a_pod_bound_meanwhile_is_left_alone_though_the_cache_lags() -> None:
    """The timer fires on the cached view; a fresh read shows the pod bound: nothing is
    released or deleted."""
    kube, clock = RecordingKube(), FakeClock()
    c = controller(kube, clock)
    pod = make_pod("p", uid="p")
    alloc = make_allocation(pod, "n1", [("main", "1g.10gb", 0, 0, 1)], phase=Phase.READY)
    bound = unschedulable(pod)
    bound["spec"]["nodeName"] = "n1"
    bound["status"] = {"phase": "Running"}
    kube.objects["/api/v1/namespaces/ns/pods/p"] = bound
    async with leading(c):
        await node(c)
        await c.handlers.on_allocation("ADDED", alloc)
        await c.handlers.on_pod("ADDED", unschedulable(pod))
        await clock.advance(TIMEOUT + 1)
    assert kube.writes() == []


async def test_a_pod_that_gets_bound_in_time_is_left_alone() -> None:
    kube, clock = RecordingKube(), FakeClock()
    c = controller(kube, clock)
    pod = make_pod("p", uid="p")
    async with leading(c):
        await node(c)
        await c.handlers.on_pod("ADDED", unschedulable(pod))
        await clock.advance(TIMEOUT / 2)
        bound = unschedulable(pod)
        bound["spec"]["nodeName"] = "n1"
        bound["status"] = {"phase": "Running"}
        await c.handlers.on_pod("MODIFIED", bound)
        await clock.advance(TIMEOUT)
    assert kube.writes() == []


# --- destructive writes are double-checked ---------------------------------------------------


async def test_orphan_allocation_is_released_only_when_the_pod_is_really_gone() -> None:
    kube, clock = RecordingKube(), FakeClock()
    c = controller(kube, clock)
    pod = make_pod("p", uid="p")
    alloc = make_allocation(pod, "n1", [("main", "1g.10gb", 0, 0, 1)], phase=Phase.READY)
    kube.objects["/api/v1/namespaces/ns/pods/p"] = pod  # exists; our pod cache lags
    async with leading(c):
        await node(c)
        await c.handlers.on_allocation("ADDED", alloc)
    assert kube.writes() == []
    del kube.objects["/api/v1/namespaces/ns/pods/p"]
    async with leading(c):
        c.kick("p")
    assert [w[0] for w in kube.writes()] == ["delete"]
    assert kube.writes()[0][2] == {"preconditions": {"uid": alloc["metadata"]["uid"]}}


async def test_allocation_of_a_gone_node_is_finalized_only_when_the_node_is_really_gone() -> None:
    kube, clock = RecordingKube(), FakeClock()
    c = controller(kube, clock)
    pod = make_pod("p", uid="p", gates=())
    alloc = make_allocation(pod, "gone", [("main", "1g.10gb", 0, 0, 1)], phase=Phase.READY)
    path = (
        f"/apis/instaslice.io/v1alpha1/namespaces/ns/sliceallocations/{alloc['metadata']['name']}"
    )
    kube.objects[path] = alloc
    kube.objects["/api/v1/nodes/gone"] = make_node("gone")  # our node cache lags
    async with leading(c):
        await c.handlers.on_pod("ADDED", pod)
        await c.handlers.on_allocation("ADDED", alloc)
    assert kube.writes() == []
    del kube.objects["/api/v1/nodes/gone"]
    async with leading(c):
        c.kick("p")
    patch, delete = kube.writes()
    assert patch[0] == "patch" and patch[1] == path
    test_op, replace_op = patch[2]
    assert test_op == {"op": "test", "path": "/metadata/finalizers", "value": [RELEASE_FINALIZER]}
    assert replace_op["value"] == []
    assert delete[0] == "delete" and delete[1] == path


async def _gone_node_with(pod: Obj) -> tuple[RecordingKube, str]:
    """`pod`'s allocation on node `gone`, which the API server no longer has, seen by a
    leading controller; the kube that recorded its writes, and the allocation's path."""
    kube, clock = RecordingKube(), FakeClock()
    c = controller(kube, clock)
    alloc = make_allocation(pod, "gone", [("main", "1g.10gb", 0, 0, 1)], phase=Phase.READY)
    path = (
        f"/apis/instaslice.io/v1alpha1/namespaces/ns/sliceallocations/{alloc['metadata']['name']}"
    )
    kube.objects[path] = alloc
    kube.objects["/api/v1/namespaces/ns/pods/p"] = pod
    async with leading(c):
        await c.handlers.on_pod("ADDED", pod)
        await c.handlers.on_allocation("ADDED", alloc)
    return kube, path


@pytest.mark.parametrize("bound", [False, True])
async def test_an_ungated_pod_of_a_gone_node_is_deleted_before_its_record_is_finished(
    bound: bool,
) -> None:
    """Pinned there (or bound): were its slots released first, a Node registered again under
    the name would have the pod bound and started on slots given to another pod."""
    pod = podlib.pin(make_pod("p", uid="p", gates=()), "gone")
    pod["metadata"]["resourceVersion"] = "7"
    if bound:
        pod["spec"]["nodeName"] = "gone"
    kube, path = await _gone_node_with(pod)
    (pod_delete, patch, alloc_delete) = kube.writes()
    assert pod_delete == (
        "delete",
        "/api/v1/namespaces/ns/pods/p",
        {"preconditions": {"uid": "p", "resourceVersion": "7"}},
    )
    assert patch[0] == "patch" and patch[1] == path
    assert alloc_delete[0] == "delete" and alloc_delete[1] == path


async def test_a_gated_pod_of_a_gone_node_is_left_to_be_placed_again() -> None:
    kube, path = await _gone_node_with(make_pod("p", uid="p"))  # gated: placed again elsewhere
    assert [(w[0], w[1]) for w in kube.writes()] == [("patch", path), ("delete", path)]


# --- placement ------------------------------------------------------------------------------


async def test_failed_allocation_is_replaced_on_another_gpu() -> None:
    kube, clock = RecordingKube(), FakeClock()
    c = controller(kube, clock)
    pod = make_pod("p", uid="p", claim="cclaim")
    async with leading(c):
        await node(c, gpus=2)
        await c.handlers.on_pod("ADDED", pod)
        await settle()
        (create,) = kube.writes("create")[:1]
        first = create[2]
        failed = copy.deepcopy(first)
        failed["metadata"]["uid"] = "a1"
        failed["status"] = {"phase": "Failed", "message": "boom"}
        await c.handlers.on_allocation("ADDED", failed)
        await settle()
        assert kube.writes("delete")  # released
        failed["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        await c.handlers.on_allocation("DELETED", failed)
        await settle()
    creates = [w for w in kube.writes("create") if "sliceallocations" in w[1]]
    assert len(creates) == 2
    gpus = [w[2]["spec"]["slices"][0]["gpuUUID"] for w in creates]
    assert gpus[0] != gpus[1] and set(gpus) == {gpu_uuid("n1", 0), gpu_uuid("n1", 1)}
    assert c.metrics.count("failed") == 1


async def test_foreign_gate_first_then_ours() -> None:
    kube, clock = RecordingKube(), FakeClock()
    c = controller(kube, clock)
    pod = make_pod("p", uid="p", gates=("kueue.x-k8s.io/admission", GATE_NAME))
    async with leading(c):
        await node(c)
        await c.handlers.on_pod("ADDED", pod)
    assert kube.writes() == []
    async with leading(c):
        await c.handlers.on_pod("MODIFIED", make_pod("p", uid="p", claim=podlib.claim(pod)))
    assert next(w[1] for w in kube.writes("create")).endswith("/sliceallocations")


async def test_pending_event_once_per_reason_and_retry_on_capacity_only() -> None:
    kube, clock = RecordingKube(), FakeClock()
    c = controller(kube, clock)
    async with leading(c):
        await node(c)
        await c.handlers.on_pod("ADDED", make_pod("p", uid="p", slices={"main": {"7g.80gb": 2}}))
        await settle()
        tried = c.metrics.count("pending")
        await c.handlers.on_pod(
            "ADDED", make_pod("other", uid="o", slices={}, claim=None, gates=())
        )
        await settle()
        assert c.metrics.count("pending") == tried  # a new pod frees nothing: no retry
        await node(c, "n2")  # capacity grew, still not enough for two 7g on one node
        await settle()
        assert c.metrics.count("pending") == tried + 1
    assert event_reasons(kube) == [REASON_PENDING]


async def test_a_step_refused_for_a_lapsed_lease_is_retried() -> None:
    kube, clock = RecordingKube(), FakeClock()
    elector = Leader()
    c = controller(kube, clock, elector)
    pod = make_pod("p", uid="p")
    async with leading(c):
        await node(c)
        elector.leading = False  # the renewal is late
        await c.handlers.on_pod("ADDED", pod)
        await settle()
        assert kube.writes() == []
        assert not c.state.allocations  # the assumed decision was forgotten
        elector.leading = True  # the late renewal succeeded
        await clock.advance(1.0)
        await settle()
    assert [w[0] for w in kube.writes() if "sliceallocations" in w[1]] == ["create"]


async def test_a_pod_parked_while_the_renewal_is_late_is_told_once_it_lands() -> None:
    """CI: the first Lease write of a term was slow, the pod was parked before the renewal
    deadline was met again, and its AllocationPending event was skipped for good."""
    kube, clock = RecordingKube(), FakeClock()
    elector = Leader()
    c = controller(kube, clock, elector)
    async with leading(c):
        await node(c)
        elector.leading = False  # the renewal is late
        await c.handlers.on_pod("ADDED", make_pod("p", uid="p", slices={"main": {"7g.80gb": 2}}))
        await settle()
        assert c.parked == {"p": 0}
        await clock.advance(5.0)
        assert event_reasons(kube) == []  # not while leadership is unconfirmed
        elector.leading = True  # the late renewal succeeded
        await clock.advance(1.0)
        assert event_reasons(kube) == [REASON_PENDING]
        await clock.advance(5.0)
    assert event_reasons(kube) == [REASON_PENDING]  # once


async def test_a_pending_event_cut_off_by_the_end_of_a_term_is_told_by_the_next() -> None:
    """The pending reason was recorded with its event still waiting; the term's end forgets
    it, so the replica that wins the Lease back tells the pod, as any other replica would."""
    kube, clock = RecordingKube(), FakeClock()
    elector = Leader()
    c = controller(kube, clock, elector)
    pod = make_pod("p", uid="p", slices={"main": {"7g.80gb": 2}})

    async def first_term() -> None:
        async with leading(c):
            await node(c)
            elector.leading = False
            await c.handlers.on_pod("ADDED", pod)
            await asyncio.Event().wait()  # until the Lease is lost

    term = asyncio.create_task(first_term())
    await settle()
    assert c.parked == {"p": 0}
    await cancel_until_done([term])  # the Lease was lost with the event still waiting
    c.step_down()  # as `lead` does when its term ends
    assert event_reasons(kube) == []
    elector.leading = True
    async with leading(c):  # won back: every pod is looked at again, as `lead` does
        await c.handlers.on_pod("MODIFIED", pod)
        await settle()
    assert event_reasons(kube) == [REASON_PENDING]


async def test_an_allocation_it_released_is_never_pinned_to_even_if_it_turns_ready() -> None:
    """`make chaos` under load: the node agent wrote Ready over its own Failed (a stale view)
    just before the allocator's DELETE landed; the step after the DELETE trusted the Ready it
    had seen and pinned the pod to slots that were being freed: double booking."""
    kube, clock = RecordingKube(), FakeClock()
    c = controller(kube, clock)
    pod = make_pod("p", uid="p")
    failed = make_allocation(pod, "n1", [("main", "1g.10gb", 0, 0, 1)], phase=Phase.FAILED, uid="a")
    ready = make_allocation(pod, "n1", [("main", "1g.10gb", 0, 0, 1)], phase=Phase.READY, uid="a")
    async with leading(c):
        await node(c)
        await c.handlers.on_pod("ADDED", pod)
        await c.handlers.on_allocation("ADDED", failed)
        await settle()
        assert [w[0] for w in kube.writes() if "sliceallocations" in w[1]] == ["delete"]
        await c.handlers.on_allocation("MODIFIED", ready)  # landed before the DELETE; seen after it
        await clock.advance(2.0)
    assert [w for w in kube.writes() if "/pods/" in w[1]] == []  # not pinned


async def test_a_create_in_flight_when_the_term_ends_keeps_its_slots() -> None:
    """Lease lost and won back while a create is still queued at the API server: the next
    term must not promise those slots to another pod."""
    kube, clock = SlowCreates(), FakeClock()
    c = controller(kube, clock)
    first = make_pod("first", uid="u1", slices={"main": {"7g.80gb": 1}})
    second = make_pod("second", uid="u2", slices={"main": {"7g.80gb": 1}})
    async with leading(c):
        await node(c)
        await c.handlers.on_pod("ADDED", first)
        await settle()
    c.step_down()  # the term ends with the create still in flight
    (held,) = c.state.allocations.values()
    assert c.state.is_assumed(held.key) and held.pod_uid == "u1"
    async with leading(c):  # won back at once
        await c.handlers.on_pod("ADDED", second)
        await settle()
        assert c.parked == {"u2": 0}  # the GPU is still promised to "first"
        kube.gate.set()  # the old request lands after all
        await settle()
    (confirmed,) = c.state.allocations.values()
    assert not c.state.is_assumed(confirmed.key) and confirmed.pod_uid == "u1"
    creates = [w for w in kube.writes("create") if "sliceallocations" in w[1]]
    assert len(creates) == 1


async def test_a_failed_create_frees_the_slots_even_after_its_term() -> None:
    kube, clock = SlowCreates(), FakeClock()
    c = controller(kube, clock)

    async def refuse(path: str, body: Obj, **query: Any) -> Obj:
        await kube.gate.wait()
        raise ApiError(500, "InternalError", "etcd timeout")

    kube.create = refuse  # type: ignore[method-assign]
    async with leading(c):
        await node(c)
        await c.handlers.on_pod("ADDED", make_pod("p", uid="u1", slices={"main": {"7g.80gb": 1}}))
        await settle()
    c.step_down()
    assert len(c.state.allocations) == 1
    kube.gate.set()
    await settle()
    assert c.state.allocations == {}


# --- a failing term does not take the process down -----------------------------------------


class TermElector(Leader):
    def __init__(self) -> None:
        super().__init__()
        self.released = 0
        self.acquired = 0

    async def acquire(self) -> None:
        self.acquired += 1

    async def hold(self) -> None:
        await asyncio.Event().wait()

    async def release(self) -> None:
        self.released += 1


class FlakyController(Controller):
    """Leads by failing once, then by waiting forever; no informers."""

    terms = 0

    async def watch(self) -> None:
        await asyncio.Event().wait()

    async def synced(self) -> None:
        return None

    async def lead(self) -> None:
        self.terms += 1
        if self.terms == 1:
            raise RuntimeError("a bug")
        await asyncio.Event().wait()


async def test_a_failed_term_hands_the_lease_back_and_stands_again() -> None:
    kube, clock, elector = RecordingKube(), FakeClock(), TermElector()
    settings = AllocatorSettings(namespace="sys", identity="a", clock=clock)
    c = FlakyController(
        cast(Kube, kube), cast(LeaderElector, elector), AllocatorMetrics(), settings
    )
    task = asyncio.create_task(run_controller(c, settings))
    await settle()
    assert (c.terms, elector.released, elector.acquired) == (1, 1, 1)
    await clock.advance(settings.lease_duration_s)
    assert (c.terms, elector.acquired) == (2, 2)
    await cancel_until_done([task])
    assert elector.released == 2  # and once more on the way out


# --- node agents that stopped ---------------------------------------------------------------


def agent_lease(node: str, renew: str, duration: int = 40, holder: str | None = None) -> Obj:
    return {
        "metadata": {"name": node, "namespace": "instaslice-system"},
        "spec": {
            "holderIdentity": holder or f"instaslice-nodeagent/{node}",
            "leaseDurationSeconds": duration,
            "renewTime": renew,
        },
    }


def allocated_nodes(kube: RecordingKube) -> list[str]:
    return [w[2]["spec"]["nodeName"] for w in kube.writes("create") if "sliceallocations" in w[1]]


def pending_messages(kube: RecordingKube) -> list[str]:
    return [
        c[2]["message"]
        for c in kube.writes("create")
        if c[1].endswith("/events") and c[2]["reason"] == REASON_PENDING
    ]


async def test_a_node_whose_agent_stopped_is_left_out_until_it_renews() -> None:
    kube, clock = RecordingKube(), FakeClock()
    c = controller(kube, clock)
    async with leading(c):
        await node(c, "n1")
        await c.handlers.on_lease("ADDED", agent_lease("n1", "2026-01-01T00:00:00.000000Z"))
        await clock.advance(40)
        assert c.state.agents_down == set()  # silent for exactly the duration: not yet
        await c.handlers.on_lease("MODIFIED", agent_lease("n1", "2026-01-01T00:00:00.000000Z"))
        await clock.advance(5)  # the same renewTime again is no renewal: 45 s > 40 s
        assert c.state.agents_down == {"n1"}
        await c.handlers.on_pod("ADDED", make_pod("p", uid="p"))
        await settle()
        assert allocated_nodes(kube) == []
        (message,) = pending_messages(kube)
        assert message == (
            "every MIG node is left out: 1 node(s) whose node agent is not running "
            "(Lease not renewed): n1"
        )
        assert c.metrics.registry.get_sample_value("instaslice_nodes_agent_down") is None
        c.metrics.state_gauges.source = c._gauge_view
        assert c.metrics.registry.get_sample_value("instaslice_nodes_agent_down") == 1
        pending = {"reason": "NodeAgentDown"}
        assert c.metrics.registry.get_sample_value("instaslice_pending_pods", pending) == 1
        # A renewal seen brings the node back at once and retries the parked pod.
        await c.handlers.on_lease("MODIFIED", agent_lease("n1", "2026-01-01T00:00:45.000000Z"))
        await settle()
        assert c.state.agents_down == set()
        assert allocated_nodes(kube) == ["n1"]
        assert c.metrics.registry.get_sample_value("instaslice_nodes_agent_down") == 0


async def test_placement_avoids_a_node_whose_agent_stopped() -> None:
    kube, clock = RecordingKube(), FakeClock()
    c = controller(kube, clock)
    async with leading(c):
        for n in ("n1", "n2"):
            await node(c, n)
            await c.handlers.on_lease("ADDED", agent_lease(n, "t0"))
        await clock.advance(30)
        await c.handlers.on_lease("MODIFIED", agent_lease("n2", "t1"))  # n2 renews, n1 does not
        await clock.advance(15)
        assert c.state.agents_down == {"n1"}
        for i in range(3):
            await c.handlers.on_pod("ADDED", make_pod(f"p{i}", uid=f"p{i}"))
        await settle()
        assert allocated_nodes(kube) == ["n2"] * 3
        await c.handlers.on_pod(
            "ADDED", make_pod("big", uid="big", slices={"main": {"7g.80gb": 1}})
        )
        await settle()
        # n2 is too full for a 7g now; n1 is empty but its agent is down: both said
        (message,) = pending_messages(kube)
        assert message == (
            "the only H100-80GB GPU that offers 7g.80gb is full (at most 0 free slots on a "
            "node; needs 8); left out: 1 node(s) whose node agent is not running (Lease not "
            "renewed): n1"
        )
        # A deleted Lease is no heartbeat at all: unknown, not down (nor is a foreign Lease).
        await c.handlers.on_lease("ADDED", agent_lease("n2", "t9", holder="someone-else"))
        await c.handlers.on_lease("DELETED", agent_lease("n1", "t0"))
        await settle()
        assert c.state.agents_down == set()


@pytest.mark.parametrize("touched", [False, True], ids=["never-acted-on", "creating"])
async def test_an_allocation_on_a_node_whose_agent_stopped(touched: bool) -> None:
    """Never acted on (no status): moved — finalizer dropped with a resourceVersion `test`,
    deleted, the pod placed on a node whose agent runs. Acted on (`Creating`): left for
    that agent, which finishes or releases it when it returns."""
    kube, clock = RecordingKube(), FakeClock()
    c = controller(kube, clock)
    pod = make_pod("p", uid="p")
    alloc = make_allocation(pod, "n1", [("main", "1g.10gb", 0, 0, 1)])
    alloc["metadata"]["resourceVersion"] = "41"
    if touched:
        alloc["status"] = {"phase": "Creating"}
    else:
        del alloc["status"]  # as the allocator creates it
    path = (
        f"/apis/instaslice.io/v1alpha1/namespaces/ns/sliceallocations/{alloc['metadata']['name']}"
    )
    kube.objects[path] = alloc
    async with leading(c):
        for n in ("n1", "n2"):
            await node(c, n)
            await c.handlers.on_lease("ADDED", agent_lease(n, "t0"))
        await c.handlers.on_allocation("ADDED", alloc)
        await c.handlers.on_pod("ADDED", pod)
        await settle()
        assert kube.writes() == []  # the agent is alive: its allocation, its business
        await clock.advance(30)
        await c.handlers.on_lease("MODIFIED", agent_lease("n2", "t1"))
        await clock.advance(15)  # n1's agent silent 45 s > 40 s
        await settle()
        if touched:
            assert kube.writes() == []
            return
        patch, delete = kube.writes()[:2]
        assert patch == (
            "patch",
            path,
            [
                {"op": "test", "path": "/metadata/resourceVersion", "value": "41"},
                {"op": "replace", "path": "/metadata/finalizers", "value": []},
            ],
        )
        assert delete[:2] == ("delete", path)
        await c.handlers.on_allocation("DELETED", alloc)
        await settle()
    assert allocated_nodes(kube) == ["n2"]


async def test_a_lease_found_stale_at_startup_is_down_at_the_first_sweep() -> None:
    """Before the Lease informer has synced, a renewal counts from its own renewTime (so an
    agent that died long before this allocator started is not trusted for a whole duration);
    afterwards from when it is seen (clock skew does not matter)."""
    kube, clock = RecordingKube(), FakeClock()
    c = Controller(
        cast(Kube, kube), cast(LeaderElector, Leader()), AllocatorMetrics(), settings(clock)
    )
    now = clock.wall()
    old = (now - dt.timedelta(minutes=10)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    fresh = now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    await node(c, "n1")
    await node(c, "n2")
    await c.handlers.on_lease("ADDED", agent_lease("n1", old))
    await c.handlers.on_lease("ADDED", agent_lease("n2", fresh))
    c.lease_informer.synced.set()
    async with leading(c):
        await settle()
        assert c.state.agents_down == {"n1"}
        # after the sync a renewTime far in the past (a skewed node clock) still counts now
        await c.handlers.on_lease("MODIFIED", agent_lease("n1", old.replace("00Z", "01Z")))
        assert c.state.agents_down == set()


# --- state gauges ----------------------------------------------------------------------------


async def test_state_gauges_are_read_from_the_model_when_scraped_and_only_by_the_leader() -> None:
    kube, clock = RecordingKube(), FakeClock()
    c = controller(kube, clock)
    reg = c.metrics.registry
    await node(c, "n1", gpus=2)
    pod = make_pod("p", uid="p")
    await c.handlers.on_allocation(
        "ADDED", make_allocation(pod, "n1", [("main", "3g.40gb", 0, 4, 4)], phase=Phase.READY)
    )
    used = "instaslice_gpu_slots_used"
    assert reg.get_sample_value(used, {"node": "n1", "gpu": "0", "model": "H100-80GB"}) is None
    c.metrics.state_gauges.source = c._gauge_view  # what lead() installs
    assert reg.get_sample_value(used, {"node": "n1", "gpu": "0", "model": "H100-80GB"}) == 4
    assert reg.get_sample_value(used, {"node": "n1", "gpu": "1", "model": "H100-80GB"}) == 0
    assert (
        reg.get_sample_value(
            "instaslice_gpu_slots", {"node": "n1", "gpu": "1", "model": "H100-80GB"}
        )
        == 8
    )
    slices = {"profile": "3g.40gb", "model": "H100-80GB"}
    assert reg.get_sample_value("instaslice_slices", slices) == 1
    assert reg.get_sample_value("instaslice_pending_pods", {"reason": "Full"}) == 0
    assert reg.get_sample_value("instaslice_allocator_queue_depth") == 0
    await c.handlers.on_allocation(
        "DELETED", make_allocation(pod, "n1", [("main", "3g.40gb", 0, 4, 4)])
    )
    assert reg.get_sample_value(used, {"node": "n1", "gpu": "0", "model": "H100-80GB"}) == 0
    assert reg.get_sample_value("instaslice_slices", slices) is None
    c.step_down()
    assert reg.get_sample_value("instaslice_allocator_queue_depth") is None


# --- a standby keeps caches, not records -----------------------------------------------------


async def test_a_standby_keeps_no_per_pod_records() -> None:
    """Security issue, item 8: standby replicas grew by about 200 B per pod ever seen (a
    dirty set and ungate start times) until they led. Now records are made only while
    leading, and a pod's DELETED event drops whatever a past term left."""
    kube, clock = RecordingKube(), FakeClock()
    c = controller(kube, clock)
    await node(c)
    pods = [make_pod(f"p{i}", uid=f"u{i}") for i in range(200)]
    for p in pods:
        await c.handlers.on_pod("ADDED", p)
    assert len(c.tracks) == 0 and c.work.pending == [] and c.work.active == 0
    assert len(c.state.pods) == 200  # the cache is warm
    async with leading(c):
        await c.handlers.on_pod("MODIFIED", pods[0])
        await settle()
    assert len(c.tracks) == 1
    await c.handlers.on_pod("DELETED", pods[0])
    assert len(c.tracks) == 0


async def test_a_pod_in_a_namespace_not_opted_in_is_not_placed() -> None:
    """Security issue, item 3: the already-rewritten form created directly in a namespace
    that did not opt in (the admission policy refuses it; this is the second line) is not
    placed; labelling the namespace brings it in."""
    kube, clock = RecordingKube(), FakeClock()
    c = controller(kube, clock)
    c.opted_in.clear()
    async with leading(c):
        await node(c)
        await c.handlers.on_pod("ADDED", make_pod("p", uid="p"))
        await settle()
        assert kube.writes("create") == []
        opted = {"metadata": {"name": "ns", "labels": {"instaslice.io/enabled": "true"}}}
        await c.handlers.on_namespace("MODIFIED", opted)
        await settle()
    assert [w[0] for w in kube.writes() if "sliceallocations" in w[1]] == ["create"]


async def test_a_whole_gpu_pod_in_a_namespace_not_opted_in_to_whole_gpus_is_not_placed() -> None:
    """Security finding 4: a hand-written gated pod asking `instaslice.io/gpu` in a namespace
    opted in to MIG slices only (the webhook never sees it there; the pod policy refuses
    it, this is the second line) is not placed, and is told once which annotation it
    lacks; the namespace's whole-GPU opt-in brings it in. A slice pod there is placed."""
    kube, clock = RecordingKube(), FakeClock()
    c = controller(kube, clock)
    c.whole_gpu.clear()
    async with leading(c):
        await c.handlers.on_node("ADDED", make_node("n1", gpus=2))
        await c.handlers.on_mig_node("ADDED", make_mig_node("n1", [GpuSpec(), GpuSpec(mig=False)]))
        await c.handlers.on_pod("ADDED", make_pod("w", uid="w", slices={"main": {"gpu": 1}}))
        await c.handlers.on_pod("ADDED", make_pod("s", uid="s"))
        await settle()
        await c.handlers.on_pod("MODIFIED", make_pod("w", uid="w", slices={"main": {"gpu": 1}}))
        await settle()
        created = [w[2] for w in kube.writes("create") if "sliceallocations" in w[1]]
        assert [a["spec"]["podName"] for a in created] == ["s"]
        told = [w[2] for w in kube.writes("create") if w[1].endswith("/events")]
        told = [e for e in told if e["involvedObject"]["name"] == "w"]
        assert [e["reason"] for e in told] == [REASON_PENDING]  # once, not at its next event
        assert 'annotate it instaslice.io/whole-gpu: "true"' in told[0]["message"]
        labels = {"instaslice.io/enabled": "true", "instaslice.io/whole-gpu": "true"}
        await c.handlers.on_namespace("MODIFIED", {"metadata": {"name": "ns", "labels": labels}})
        await settle()
    created = [w[2] for w in kube.writes("create") if "sliceallocations" in w[1]]
    assert [a["spec"]["podName"] for a in created] == ["s", "w"]


async def test_a_decision_whose_pod_left_before_its_create_frees_the_slots() -> None:
    """The placer records a decision (slots assumed) and the pod's worker sends it; a pod
    deleted in between must not leave the assumed slots held in the model."""
    kube, clock = RecordingKube(), FakeClock()
    c = controller(kube, clock)
    await node(c)
    pod = make_pod("p", uid="p")
    body = make_allocation(pod, "n1", [("main", "1g.10gb", 0, 0, 1)])
    c.state.assume(body)
    c.tracks.ensure("p").create = body
    assert c.state.allocations  # promised
    await c._work("p")  # the pod is not in the cache any more
    assert c.state.allocations == {} and c.tracks.get("p") is None
    assert kube.writes() == []


# --- whole-GPU preemption on Ampere, given up ---------------------------------------------


async def test_a_given_up_whole_gpu_preemption_withdraws_its_ampere_reset() -> None:
    """A whole-GPU preemption on an A100 asked the maintenance to turn its MIG mode off;
    given up (a victim's eviction refused, or its deadline), the ask is withdrawn while the
    GPU is still in MIG mode: left standing, the agent would drain the GPU for up to its
    drain timeout (no other Ampere change meanwhile) and reset it for nobody. A GPU already
    off keeps its entry (the reached ask goes by the MigNode event's own path)."""
    kube, clock = RecordingKube(), FakeClock()
    c = controller(kube, clock)
    await c.handlers.on_node("ADDED", make_node("n1", gpus=2))
    mig = make_mig_node("n1", [GpuSpec(model="A100-40GB"), GpuSpec(model="A100-40GB", mig=False)])
    mig["spec"] = {"gpus": [{"uuid": gpu_uuid("n1", i), "desiredMigMode": "disabled"}
                            for i in range(2)]}  # fmt: skip
    await c.handlers.on_mig_node("ADDED", mig)
    written: list[tuple[str, dict[str, str], set[str]]] = []
    c.modes.set = lambda node, add, drop: written.append((node, add, drop))  # type: ignore[method-assign]
    track = c.tracks.ensure("p1")
    p = Preemption({}, "ns/claim", "n1", (), frozenset(), 0.0, resets=(("n1", 0), ("n1", 1)))
    c.tracks.begin_preempt(track, p)
    c.steps.book.give_up(track, "refused", frozenset())
    assert written == [("n1", {}, {gpu_uuid("n1", 0)})]
    assert c.tracks.get("p1") is None or c.tracks.get("p1").preempt is None  # type: ignore[union-attr]
