"""Whole-GPU preemption against the real local control plane (kube-apiserver with its
Priority and Eviction admission, kube-scheduler, KWOK nodes) and the real node agent on the
NVML emulator (tests/integration/test_allocator_with_agent.py's world).

Covers: a high-priority pod asking a whole H100 while both GPUs hold MIG pods evicts exactly
the lower-priority pods of one GPU (the one whose victims are of the lowest priority; events
on both sides), the agent turns that GPU's MIG mode off once their instances are gone (no
reset on Hopper) and the pod runs on it, the other GPU's pods untouched; on an A100 in MIG
mode with `--ampere-mode-changes=drain`, the victims go, the Ampere maintenance resets the GPU
to MIG off, and only then is the reservation created (no failed allocation). Leaves out: the
planner's choices in detail (tests/unit/test_preempt_whole.py), the placer's refusals and
Ampere choices (tests/unit/test_allocator_preempt_whole.py).
"""

from __future__ import annotations

import pytest

from common.constants import REASON_PREEMPTED, REASON_PREEMPTING
from nodeagent.emulator import EmulatorControl
from tests.integration.allocator_fixtures import assert_no_double_booking, kube
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
__all__ = ["kube", "priority_classes", "world"]  # fixtures, imported for pytest


async def gpu_of(world: AgentWorld, name: str) -> str:
    allocs = {a["spec"]["podName"]: a for a in await world.env.allocations()}
    return str(allocs[name]["spec"]["slices"][0]["gpuUUID"])


@pytest.mark.usefixtures("priority_classes")
async def test_a_whole_gpu_pod_evicts_the_lower_priority_mig_pods_of_one_gpu(
    world: AgentWorld,
) -> None:
    (node,) = await world.nodes("n1", gpus=2)  # two H100s in MIG mode, reset-less toggle
    env = world.env
    env.start(preemption=True)
    for name in ("lo-a", "lo-b"):  # a 4g starts only at slot 0: one on each GPU
        await create(env, name, LOW, "4g.40gb")
        await env.wait_bound(name, within=60)
    await create(env, "lo-c", LOW, "3g.40gb")  # beside one of them
    await env.wait_bound("lo-c", within=60)
    await create(env, "mid", MID, "3g.40gb")  # beside the other: every GPU holds slices
    await env.wait_bound("mid", within=60)
    target = await gpu_of(world, "lo-c")
    assert await gpu_of(world, "mid") != target
    victims = {n for n in ("lo-a", "lo-b") if await gpu_of(world, n) == target} | {"lo-c"}
    spared = {"lo-a", "lo-b", "mid"} - victims

    body = await create(env, "train", HIGH, "gpu")  # instaslice.io/gpu: 1
    assert "instaslice.io/gpu" in body["spec"]["containers"][0]["resources"]["limits"]
    bound = await env.wait_bound("train", within=90)
    assert podlib.bound_node(bound) == node
    assert await alive(env) == {"train"} | spared
    (record,) = [a for a in await env.allocations() if a["spec"]["podName"] == "train"]
    (spec,) = record["spec"]["slices"]
    assert (spec["kind"], spec["gpuUUID"], spec["start"]) == ("gpu", target, 0)
    gpu = next(g for g in EmulatorControl(world.gpus, node).state().gpus if g.uuid == target)
    assert (gpu.mig_current, gpu.mig_pending) == (0, 0)  # turned off, no reset
    assert {i for i, *_ in world.instances(node)} == {1 - gpu.index}  # the spared GPU's alone
    preempting = await env.wait_event("train", REASON_PREEMPTING)
    assert all(f"{env.namespace}/{n}" in preempting["message"] for n in victims)
    assert not any(f"{env.namespace}/{n}" in preempting["message"] for n in spared)
    for name in victims:
        event = await env.wait_event(name, REASON_PREEMPTED)
        assert f"{env.namespace}/train" in event["message"]
    assert_no_double_booking(await env.allocations())


@pytest.mark.usefixtures("priority_classes")
async def test_on_an_a100_the_ampere_maintenance_turns_mig_off_after_the_victims_go(
    world: AgentWorld,
) -> None:
    (node,) = await world.nodes("a1", model="A100-80GB")  # MIG on: only a reset turns it off
    env = world.env
    alloc = env.start(preemption=True, ampere_mode_changes="drain")
    for name, profile in (("lo-a", "4g.40gb"), ("lo-b", "3g.40gb")):
        await create(env, name, LOW, profile)
        await env.wait_bound(name, within=60)
    target = await gpu_of(world, "lo-a")
    await create(env, "train", HIGH, "gpu")
    bound = await env.wait_bound("train", within=90)
    assert podlib.bound_node(bound) == node
    assert await alive(env) == {"train"}
    (record,) = await env.allocations()
    assert (record["spec"]["slices"][0]["kind"], record["spec"]["slices"][0]["gpuUUID"]) == (
        "gpu",
        target,
    )
    (gpu,) = EmulatorControl(world.gpus, node).state().gpus
    assert (gpu.mig_current, gpu.mig_pending) == (0, 0) and world.instances(node) == set()
    preempting = await env.wait_event("train", REASON_PREEMPTING)
    assert all(f"{env.namespace}/{n}" in preempting["message"] for n in ("lo-a", "lo-b"))
    # the reservation was created once MIG was off, not before (the agent would fail it)
    assert alloc.metrics.count("failed") == 0 and alloc.metrics.count("preemption_abandoned") == 0
