"""Preemption for size-based asks (`instaslice.io/mig-size.<container>`) against the real
local control plane (kube-apiserver with its Priority and Eviction admission,
kube-scheduler, KWOK nodes).

Covers: a high-priority pod asking `memory>=20Gi` on an H100 full of lower-priority pods
evicts exactly the pod whose window its resolved profile (3g.40gb) takes, the lowest in
priority (events on both sides), and the real node agent on the NVML emulator makes that
3g.40gb at the reserved window, beside the pod spared; across two GPU models (the fake agent),
the plan goes to the model whose victims are cheaper, with that model's resolved profile,
though the other model's fit is less memory. Leaves out: the planner's choices
(tests/unit/test_sizing_preempt.py), the placer's refusals
(tests/unit/test_allocator_preempt_sized.py), the steps shared with profile asks (PDBs,
stuck victims, failover: tests/integration/test_allocator_preemption.py).
"""

from __future__ import annotations

import pytest

from common.constants import REASON_PREEMPTED, REASON_PREEMPTING, SIZE_ANNOTATION_PREFIX
from common.kubeapi import Obj, core_path
from tests.integration.allocator_fixtures import (
    AllocatorEnv,
    assert_no_double_booking,
    kube,
    make_pod,
)
from tests.integration.test_allocator import env
from tests.integration.test_allocator_preemption import (
    HIGH,
    LOW,
    MID,
    alive,
    create,
    priority_classes,
)
from tests.integration.test_allocator_with_agent import AgentWorld, world
from webhook.allocator import pods as podlib

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
__all__ = ["env", "kube", "priority_classes", "world"]  # fixtures, imported for pytest


async def create_sized(env: AllocatorEnv, name: str, klass: str, size: str) -> Obj:
    """A pod as admission leaves a size ask (gated, claimed, no MIG resource), of `klass`."""
    pod = make_pod(name, namespace=env.namespace, slices={})
    pod["metadata"]["annotations"][SIZE_ANNOTATION_PREFIX + "main"] = size
    pod["spec"]["priorityClassName"] = klass
    return await env.kube.create(core_path("pods", env.namespace), pod)


async def record_of(env: AllocatorEnv, name: str) -> Obj:
    return next(a for a in await env.allocations() if a["spec"]["podName"] == name)


@pytest.mark.usefixtures("priority_classes")
async def test_a_sized_pod_evicts_the_pod_its_resolved_profile_needs(world: AgentWorld) -> None:
    (node,) = await world.nodes("n1")  # one H100 in MIG mode, the real agent on the emulator
    env = world.env
    env.start(preemption=True)
    for name, klass in (("lo", LOW), ("mid", MID)):  # 3g.40gb at slots 0 and 4: GPU full
        await create(env, name, klass, "3g.40gb")
        await env.wait_bound(name, within=60)
    lo = (await record_of(env, "lo"))["spec"]["slices"][0]

    await create_sized(env, "hi", HIGH, "memory>=20Gi")  # H100: 3g.40gb (1g.20gb is 19.6 GiB)
    bound = await env.wait_bound("hi", within=90)
    assert podlib.bound_node(bound) == node
    assert await alive(env) == {"hi", "mid"}
    (spec,) = (await record_of(env, "hi"))["spec"]["slices"]
    assert (spec["profile"], spec["gpuUUID"], spec["start"], spec["size"]) == (
        "3g.40gb",
        lo["gpuUUID"],
        lo["start"],
        4,
    )
    assert (0, "3g.40gb", lo["start"], 4) in world.instances(node)  # the agent made it there
    assert len(world.instances(node)) == 2  # and mid's, untouched
    preempting = await env.wait_event("hi", REASON_PREEMPTING)
    assert f"{env.namespace}/lo" in preempting["message"]
    assert f"{env.namespace}/mid" not in preempting["message"]
    event = await env.wait_event("lo", REASON_PREEMPTED)
    assert f"{env.namespace}/hi" in event["message"]
    assert_no_double_booking(await env.allocations())


@pytest.mark.usefixtures("priority_classes")
async def test_across_models_the_cheaper_victims_win_with_that_models_profile(
    env: AllocatorEnv,
) -> None:
    """memory>=30Gi: the H200's 1g.35gb is less memory than the H100's 3g.40gb, but the H200
    is held by a pod of higher priority (below the preemptor's)."""
    h100 = await env.add_node("h100", model="H100-80GB")
    await env.add_node("h200", model="H200-141GB")
    env.start(preemption=True)
    await create(env, "lo", LOW, "7g.80gb")  # only an H100 offers it
    await create(env, "mid", MID, "7g.141gb")  # only an H200
    for name in ("lo", "mid"):
        await env.wait_bound(name, within=60)

    await create_sized(env, "hi", HIGH, "memory>=30Gi")
    bound = await env.wait_bound("hi", within=90)
    assert podlib.bound_node(bound) == h100
    assert await alive(env) == {"hi", "mid"}
    (spec,) = (await record_of(env, "hi"))["spec"]["slices"]
    assert spec["profile"] == "3g.40gb"
    preempting = await env.wait_event("hi", REASON_PREEMPTING)
    assert f"{env.namespace}/lo" in preempting["message"]
    assert_no_double_booking(await env.allocations())
