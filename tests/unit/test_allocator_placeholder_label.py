"""The label `instaslice.io/scale-up-for` proves nothing to the allocator (security finding 1).

Anyone who may write pods may write that label. The allocator once took every pod carrying it
for one of its autoscaler placeholders and skipped it on every event: a tenant who labelled
its MIG pod and deleted it kept the slices for good, a labelled 60-cpu pod was never charged
to its node, and a labelled pod could stand in for another pod's signal. Now a placeholder is
known by all InstaSlice gives one (common.placeholders) and a DELETED event is never skipped.

Covers, with the recording fake `Kube` of test_allocator_controller.py: a labelled tenant pod
deleted has its allocation released; a pod seen before and labelled like a placeholder leaves
the model when deleted; a labelled tenant pod is charged to its node (another pod stays
pending there) while a real placeholder is not; the scale-up loop takes no labelled tenant pod
for a signal. The pod policy refusing the label: tests/integration/test_admission_policy.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from common.constants import REASON_PENDING, SCALE_UP_LABEL
from common.objects import Phase
from common.placeholders import (
    MANAGED_BY,
    MANAGED_BY_LABEL,
    PLACEHOLDER_PRIORITY_CLASS,
    signal_name,
)
from common.placement import Pending, PendingReason
from testkit.builders import make_allocation, make_pod
from testkit.clock import FakeClock, settle
from tests.unit.test_allocator_controller import (
    RecordingKube,
    controller,
    leading,
    node,
)
from tests.unit.test_autoscale import _bound, _full_cluster, _Kube, _scale_up
from webhook.allocator import pods as podlib
from webhook.allocator.autoscale import placeholder_pod

pytestmark = pytest.mark.timeout(10)

Obj = dict[str, Any]


def labelled(pod: Obj, stands_for: str = "victim") -> Obj:
    """`pod` with the placeholder's labels added by its owner (a tenant)."""
    out = {**pod, "metadata": {**pod["metadata"]}}
    out["metadata"]["labels"] = {
        **(pod["metadata"].get("labels") or {}),
        SCALE_UP_LABEL: stands_for,
        MANAGED_BY_LABEL: MANAGED_BY,
    }
    return out


def alloc_path(alloc: Obj) -> str:
    meta = alloc["metadata"]
    return f"/apis/instaslice.io/v1alpha1/namespaces/ns/sliceallocations/{meta['name']}"


async def test_a_labelled_tenant_pod_deleted_has_its_slices_released() -> None:
    """A running MIG pod whose owner labels it and deletes it: its allocation is released
    (it used to be held for good — repeated, every GPU)."""
    kube, clock = RecordingKube(), FakeClock()
    c = controller(kube, clock)
    pod = make_pod("p", uid="p", gates=(), node_name="n1", phase="Running")
    alloc = make_allocation(pod, "n1", [("main", "1g.10gb", 0, 0, 1)], phase=Phase.READY)
    async with leading(c):
        await node(c)
        await c.handlers.on_allocation("ADDED", alloc)
        await c.handlers.on_pod("ADDED", pod)
        await c.handlers.on_pod("MODIFIED", labelled(pod))
        await settle()
        assert kube.writes() == []
        await c.handlers.on_pod("DELETED", labelled(pod))
        await settle()
    assert [(w[0], w[1]) for w in kube.writes()] == [("delete", alloc_path(alloc))]
    assert "p" not in c.state.pods


async def test_a_deleted_pod_leaves_the_model_whatever_it_looks_like_at_the_end() -> None:
    """A pod the model holds leaves it on its DELETED event, even one that then looks like a
    placeholder in every respect (the pod policy refuses the label to tenants; were it
    added anyway, its cpu would stay charged to the node for good)."""
    kube, clock = RecordingKube(), FakeClock()
    c = controller(kube, clock)
    await node(c)
    plain = make_pod(signal_name("x"), uid="big", claim=None, gates=(), cpu="6", node_name="n1")
    plain["metadata"]["ownerReferences"] = [{"kind": "Pod", "name": "x", "uid": "x"}]
    plain["spec"]["priorityClassName"] = PLACEHOLDER_PRIORITY_CLASS
    await c.handlers.on_pod("ADDED", plain)
    assert c.state.usage("n1").cpu_millis == 6000
    await c.handlers.on_pod("DELETED", labelled(plain, "x"))
    assert c.state.usage("n1").cpu_millis == 0 and "big" not in c.state.pods


@pytest.mark.parametrize("real", [False, True], ids=["tenant-labelled", "real-placeholder"])
async def test_only_a_real_placeholder_is_left_out_of_its_nodes_charge(real: bool) -> None:
    """A tenant's 8-cpu pod bound to the 8-cpu node, labelled: it is charged, so a gated pod
    is not pinned there (pinned, it would stay unschedulable and be deleted after the
    timeout) but told the node's cpu is short. A real placeholder on the node holds no cpu
    in the model (a pod pinned there preempts it) and the gated pod is placed."""
    kube, clock = RecordingKube(), FakeClock()
    c = controller(kube, clock)
    gated = make_pod("g", uid="g")
    if real:
        big = placeholder_pod(gated, podlib.pod_request(gated), [])
        big["metadata"]["uid"] = "big"
        big["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "8"
    else:
        big = labelled(make_pod("big", uid="big", claim=None, gates=(), cpu="8"), "g")
    big["spec"]["nodeName"] = "n1"
    async with leading(c):
        await node(c)
        await c.handlers.on_pod("ADDED", big)
        assert c.state.usage("n1").cpu_millis == (0 if real else 8000)
        await c.handlers.on_pod("ADDED", gated)
        await settle()
    created = [w for w in kube.writes("create") if "sliceallocations" in w[1]]
    assert len(created) == (1 if real else 0)
    if not real:
        (event,) = [w[2] for w in kube.writes("create") if w[1].endswith("/events")]
        assert event["reason"] == REASON_PENDING and "node cpu short" in event["message"]


def test_a_labelled_tenant_pod_is_no_signal_of_another_pod() -> None:
    """A tenant pod labelled with the uid of a pod waiting for a node: the scale-up loop
    does not hold it as that pod's signal (which would keep the real signal from being
    raised, or withdraw and lose it), nor count its deletion as the signal lost, nor take
    it for a placeholder bound where a pin goes."""
    state, pod = _full_cluster()
    clock = FakeClock()
    s = _scale_up(state, clock, delay=0)
    s.pending(
        state.pods["want"], podlib.pod_request(pod), Pending(PendingReason.FULL, "full"), False
    )
    tenant = labelled(make_pod("mine", uid="mine", claim=None, gates=(), node_name="n2"), "want")
    asyncio.run(s._on_signal("ADDED", tenant))
    assert s.signals == {}
    assert s.wanted(clock.monotonic()) == ({"want"}, set())  # raised all the same
    asyncio.run(s._on_signal("DELETED", tenant))
    assert s.needs["want"].lost == 0
    # the list of placeholders bound to a node a pin goes to
    kube = _Kube(bound=(tenant, _bound("want", "n2")))
    s.writes.kube = kube  # type: ignore[assignment]
    s.signals = {"want": _bound("want", None)}
    assert asyncio.run(s._bound_now("n2")) == {"want"}
    kube.bound = (tenant,)
    s.signals = {"want": _bound("want", None)}
    assert asyncio.run(s._bound_now("n2")) == set()
