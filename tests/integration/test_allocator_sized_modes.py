"""Size-based asks (`instaslice.io/mig-size.<container>`) and MIG mode on demand, with the
real control plane and the real node agent (in-process, on the NVML emulator).

Covers: a sized pod whose only fitting GPU is a Hopper with MIG off is placed there, and the
agent turns MIG on and makes the slice its size resolved to; on an A100 with MIG off, with
`--ampere-mode-changes=drain`, a sized pod makes the allocator ask the Ampere maintenance for
that GPU (the pod told so), the agent resets it into MIG mode and the pod is served there.
Leaves out: the placement rules themselves (tests/unit/test_sizing_modes.py), the profile
asks' same paths (test_allocator_with_agent.py), admission (the pods are created as
admission leaves them).
"""

from __future__ import annotations

import pytest

from common.constants import MIG_NODE_PLURAL, REASON_PENDING, SIZE_ANNOTATION_PREFIX
from common.kubeapi import Obj, core_path, instaslice_path
from nodeagent.emulator import EmulatorControl
from tests.integration.allocator_fixtures import AllocatorEnv, kube, make_pod
from tests.integration.test_allocator_with_agent import AgentWorld, decided, world
from tests.support import eventually
from webhook.allocator import pods as podlib

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
__all__ = ["kube", "world"]  # fixtures, imported for pytest


async def create_sized(env: AllocatorEnv, name: str, size: str) -> Obj:
    """A pod as admission leaves a size ask: gated, claimed, no MIG resource."""
    pod = make_pod(name, namespace=env.namespace, slices={})
    pod["metadata"]["annotations"][SIZE_ANNOTATION_PREFIX + "main"] = size
    return await env.kube.create(core_path("pods", env.namespace), pod)


async def test_a_sized_pod_is_served_by_a_hopper_gpu_with_mig_off(world: AgentWorld) -> None:
    (node,) = await world.nodes("h1", model="H100-80GB", mig_mode="disabled")
    env = world.env
    env.start()
    await create_sized(env, "p", "memory>=20Gi")  # H100-80GB: 3g.40gb (1g.20gb is 19.6 GiB)
    bound = await env.wait_bound("p", within=60)
    assert podlib.bound_node(bound) == node
    (record,) = await env.allocations()
    assert [s["profile"] for s in record["spec"]["slices"]] == ["3g.40gb"]
    gpu = EmulatorControl(world.gpus, node).state().gpus[0]
    assert (gpu.mig_current, gpu.mig_pending) == (1, 1)  # the agent turned MIG on for it
    assert world.instances(node) == decided([record], node)


async def test_ampere_maintenance_serves_a_sized_pod_on_an_a100_with_mig_off(
    world: AgentWorld,
) -> None:
    (node,) = await world.nodes("a1", model="A100-80GB", mig_mode="disabled")
    env = world.env
    env.start(ampere_mode_changes="drain")
    await create_sized(env, "p", "memory>=20Gi")  # A100-80GB: 3g.40gb (2g.20gb is 19.5 GiB)
    told = await env.wait_event("p", REASON_PENDING, saying="asked for (Ampere maintenance")
    assert f"MIG mode change on {node}/GPU 0" in told["message"], told["message"]
    bound = await env.wait_bound("p", within=60)
    assert podlib.bound_node(bound) == node
    gpu = EmulatorControl(world.gpus, node).state().gpus[0]
    assert (gpu.mig_current, gpu.mig_pending) == (1, 1)
    assert [p for _, p, _, _ in world.instances(node)] == ["3g.40gb"]
    path = instaslice_path(MIG_NODE_PLURAL, name=node)

    async def withdrawn() -> bool:
        return not (await env.kube.get(path)).get("spec", {}).get("gpus")

    await eventually(withdrawn, what="the ask withdrawn")
