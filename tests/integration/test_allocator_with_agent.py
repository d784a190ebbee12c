"""The allocator with the real node agent (in-process, on the NVML emulator) instead of the
fake one: what it decides is what NVML accepts.

Covers one pod end to end (SliceAllocation → GPU instance at exactly the decided placement →
Ready → pinned → bound → deleted → instance destroyed → record gone), two GPUs filled
with mixed profiles (every decided placement is legal on the emulated hardware; a pod that
needs a whole GPU is then pending), and Ampere maintenance: an A100 with MIG off serves a
MIG pod after the allocator asked for the mode change (`--ampere-mode-changes=drain`) and the
agent reset the GPU (meanwhile the asking pod, and another that fits only there, are told
they wait for the change under way), while with the flag off the pod keeps waiting
`NeedsMigModeChange`; an admin's ask on a busy A100 whose drain runs past the agent's
timeout is withdrawn, the running pod is left alone, and the GPU takes a new pod again; a
pod that needs both the GPU under way and another a reset away waits for the change under
way; the opposite change on one GPU waits `--ampere-mode-change-interval` after the agent's
last (`lastModeChange`, published by the real agent).
The fake-agent suite (test_allocator.py) covers the failure paths; the e2e suite covers the
webhook and agent processes as deployed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import pytest

from common.clock import cancel_until_done
from common.constants import MIG_NODE_PLURAL, NODE_LABEL, REASON_PENDING
from common.kubeapi import Kube, Obj, instaslice_path
from common.objects import node_label_value
from hack.cluster import ControlPlane
from nodeagent.emulator import EmulatorControl, provision
from nodeagent.main import serve
from nodeagent.settings import Settings
from tests.integration.allocator_fixtures import (
    AllocatorEnv,
    FakeAgent,
    assert_no_double_booking,
    kube,
)
from tests.support import eventually, listed, wait_for
from webhook.allocator import pods as podlib

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
__all__ = ["kube"]  # a fixture, imported for pytest


class AgentWorld:
    def __init__(self, env: AllocatorEnv, state: Path, kubeconfig: str) -> None:
        self.env = env
        self.gpus = state / "gpus"
        self.cdi = state / "nodes"
        self.kubeconfig = kubeconfig
        self.task: asyncio.Task[None] | None = None

    async def nodes(
        self,
        *shorts: str,
        model: str = "H100-80GB",
        gpus: int = 1,
        mig_mode: Literal["enabled", "disabled"] = "enabled",
        **agent: Any,
    ) -> list[str]:
        """KWOK nodes whose GPUs are emulated and served by one in-process node agent
        (`agent`: its Settings overrides)."""
        names = []
        for short in shorts:
            name = await self.env.add_node(short, model=None, mig_node=False)
            await asyncio.to_thread(provision, self.gpus, name, [model] * gpus, mig_mode)
            names.append(name)
        settings = Settings(
            nodes=tuple(names),
            kubeconfig=self.kubeconfig,
            emulate=True,
            emu_state=self.gpus,
            cdi_root=self.cdi,
            namespace=self.env.namespace,
            **agent,
        )
        self.task = asyncio.create_task(serve(settings), name="nodeagent")

        def published(items: list[Obj]) -> bool:
            ready = {o["metadata"]["name"] for o in items if o.get("status", {}).get("gpus")}
            return set(names) <= ready

        await wait_for(
            self.env.kube,
            instaslice_path(MIG_NODE_PLURAL),
            listed(published),
            what="MigNodes published",
        )
        return names

    def instances(self, node: str) -> set[tuple[int, str, int, int]]:
        rows = EmulatorControl(self.gpus, node).instances()
        return {(r.gpu_index, r.profile_name, r.start, r.size) for r in rows}


@pytest.fixture
async def world(
    kube: Kube, namespace: str, control_plane: ControlPlane, tmp_path: Path
) -> AsyncIterator[AgentWorld]:
    env = AllocatorEnv(kube, namespace, FakeAgent(kube))  # the fake agent is never started
    await env.opt_in()
    w = AgentWorld(env, tmp_path, str(control_plane.kubeconfig))
    try:
        yield w
    finally:
        await env.close()
        if w.task is not None:
            await cancel_until_done([w.task])


def decided(allocs: list[dict[str, object]], node: str) -> set[tuple[int, str, int, int]]:
    out = set()
    for a in allocs:
        spec = a["spec"]
        assert isinstance(spec, dict)
        if spec["nodeName"] == node:
            for s in spec["slices"]:
                out.add((s["gpuIndex"], s["profile"], s["start"], s["size"]))
    return out


async def test_one_pod_through_the_real_agent(world: AgentWorld) -> None:
    (node,) = await world.nodes("n1")
    env = world.env
    env.start()
    await env.create_pod("p", slices={"main": {"1g.10gb": 1}})
    bound = await env.wait_bound("p", within=60)
    assert podlib.bound_node(bound) == node
    (record,) = await env.allocations()
    assert record["status"]["phase"] == "Ready"
    assert record["status"]["slices"][0]["migUUID"].startswith("MIG-")
    assert world.instances(node) == decided([record], node)
    await env.delete_pod("p")
    await env.wait_allocations(lambda items: not items, within=60, what="released")
    assert world.instances(node) == set()


async def test_a_node_named_longer_than_a_label_value_gets_its_slice(world: AgentWorld) -> None:
    """A node name may have 253 characters, a label value 63 (Karpenter's KWOK nodes reached
    65 in CI): the SliceAllocation's `instaslice.io/node` is then the name cut and hashed,
    and the agent's watch selects on that. Before, the API server refused the allocation
    (422) and the pod waited for good."""
    (node,) = await world.nodes("a-node-named-longer-than-any-label-value-may-be-" + "x" * 20)
    assert len(node) > 63
    env = world.env
    env.start()
    await env.create_pod("p", slices={"main": {"1g.10gb": 1}})
    bound = await env.wait_bound("p", within=60)
    assert podlib.bound_node(bound) == node
    (record,) = await env.allocations()
    assert record["metadata"]["labels"][NODE_LABEL] == node_label_value(node)
    assert record["status"]["phase"] == "Ready"
    await env.delete_pod("p")
    await env.wait_allocations(lambda items: not items, within=60, what="released")
    assert world.instances(node) == set()


async def test_gpus_filled_with_mixed_profiles(world: AgentWorld) -> None:
    nodes = await world.nodes("n1", "n2")
    env = world.env
    env.start()
    # Two 3g.40gb and seven 1g.10gb fit two H100s however the 3g land (together on one GPU,
    # or one per GPU leaving 4 + 4 slots for the 1g); 15 of 16 memory slots end up used.
    asks = ["3g.40gb"] * 2 + ["1g.10gb"] * 7
    for i, profile in enumerate(asks):
        await env.create_pod(f"p{i}", slices={"main": {profile: 1}})
    for i in range(len(asks)):
        await env.wait_bound(f"p{i}", within=60)
    allocs = await env.allocations()
    assert len(allocs) == len(asks)
    assert_no_double_booking(allocs)
    for node in nodes:
        assert world.instances(node) == decided(allocs, node)  # NVML took every placement
    used = sum(size for node in nodes for _, _, _, size in world.instances(node))
    assert used == 2 * 4 + 7
    await env.create_pod("whole", slices={"main": {"7g.80gb": 1}})  # no GPU is empty now
    await env.wait_event("whole", REASON_PENDING)


async def _desired(env: AllocatorEnv, node: str) -> list[Obj]:
    obj = await env.kube.get(instaslice_path(MIG_NODE_PLURAL, name=node))
    return list((obj.get("spec") or {}).get("gpus") or [])


async def test_ampere_maintenance_serves_a_mig_pod_on_an_a100_with_mig_off(
    world: AgentWorld,
) -> None:
    (node,) = await world.nodes("a1", model="A100-80GB", mig_mode="disabled")
    emu = EmulatorControl(world.gpus, node)
    emu.set_driver_client(0, True)  # persistenced, say: the reset is refused until it lets go
    env = world.env
    env.start(ampere_mode_changes="drain")
    asked = "asked for (Ampere maintenance"
    under_way = f"once the MIG mode change under way on {node}/GPU 0 is done (MIG on"
    try:
        await env.create_pod("p", slices={"main": {"1g.10gb": 1}})
        await env.wait_event("p", REASON_PENDING, saying=asked)
        # the GPU takes nothing new now; the asking pod is told it waits for the change, and
        # so is another pod that fits only there (no second ask)
        await env.wait_event("p", REASON_PENDING, saying=under_way)
        await env.create_pod("q", slices={"main": {"1g.10gb": 1}})
        await env.wait_event("q", REASON_PENDING, saying=under_way)
    finally:
        emu.set_driver_client(0, False)  # else the agent retries the reset for 300 s
    for pod in ("p", "q"):
        bound = await env.wait_bound(pod, within=60)
        assert podlib.bound_node(bound) == node
    gpu = emu.state().gpus[0]
    assert (gpu.mig_current, gpu.mig_pending) == (1, 1)
    assert [p for _, p, _, _ in world.instances(node)] == ["1g.10gb"] * 2
    told = {pod: [e["message"] for e in await env.events(pod, REASON_PENDING)] for pod in "pq"}
    assert len(told["p"]) == 2 and all(asked in m or under_way in m for m in told["p"]), told
    assert len(told["q"]) == 1, told  # never a plainer reason in between

    async def withdrawn() -> bool:
        return await _desired(env, node) == []

    await eventually(withdrawn, what="the ask withdrawn")


@pytest.mark.parametrize("flag", ["drain", "off"])
async def test_a_drain_that_runs_out_is_given_up_and_the_gpu_takes_work_again(
    world: AgentWorld, flag: str
) -> None:
    """With `drain` the allocator withdraws the failed ask; with `off` the admin's ask stays
    in the spec, and the GPU serves anyway (the agent gave that ask up)."""
    (node,) = await world.nodes(
        "a1", model="A100-80GB", gc_period_s=0.5, maintenance_drain_timeout_s=2.0
    )
    env = world.env
    env.start(ampere_mode_changes=flag)
    await env.create_pod("p", slices={"main": {"1g.10gb": 1}})
    await env.wait_bound("p", within=60)
    gpu = EmulatorControl(world.gpus, node).state().gpus[0]
    path = instaslice_path(MIG_NODE_PLURAL, name=node)
    ask = {"uuid": gpu.uuid, "desiredMigMode": "disabled"}  # an admin's, by hand
    await env.kube.patch(path, {"spec": {"gpus": [ask]}})

    async def draining() -> bool:
        g = (await env.kube.get(path))["status"]["gpus"][0]
        return bool(g.get("modeChange", {}).get("phase") == "Draining")

    await eventually(draining, what="Draining")
    await env.create_pod("q", slices={"main": {"1g.10gb": 1}})  # fits as the GPU is
    await env.wait_event("q", REASON_PENDING)  # nothing new while it drains

    async def failed() -> Obj | None:
        g: Obj = (await env.kube.get(path))["status"]["gpus"][0]
        return g if g.get("modeChange", {}).get("phase") == "Failed" else None

    g = await eventually(failed, what="the ask failed", within=30)
    assert "drain timed out" in g["modeChange"]["message"]
    bound = await env.wait_bound("q", within=30)  # the GPU takes work again
    assert podlib.bound_node(bound) == node
    assert podlib.bound_node(await env.pod("p")) == node  # never evicted
    assert [p for _, p, _, _ in world.instances(node)] == ["1g.10gb"] * 2
    assert EmulatorControl(world.gpus, node).state().gpus[0].mig_current == 1
    if flag == "drain":

        async def withdrawn() -> bool:
            return await _desired(env, node) == []

        await eventually(withdrawn, what="the ask withdrawn")
    else:
        assert await _desired(env, node) == [ask]  # the allocator writes nothing


async def test_a_pod_needing_the_change_under_way_and_a_reset_waits_for_the_change(
    world: AgentWorld,
) -> None:
    """GPU 0 is asked for one pod; a pod of two full-GPU slices needs GPU 0 once it is done
    and GPU 1 after a reset of its own: it is told it waits for the change under way (not
    a plainer reason), and nothing more is asked meanwhile."""
    (node,) = await world.nodes("a1", model="A100-80GB", gpus=2, mig_mode="disabled")
    emu = EmulatorControl(world.gpus, node)
    emu.set_driver_client(0, True)  # the reset waits until the test lets go
    emu.set_driver_client(1, True)
    env = world.env
    env.start(ampere_mode_changes="drain")
    try:
        await env.create_pod("p", slices={"main": {"1g.10gb": 1}})
        await env.wait_event("p", REASON_PENDING, saying="asked for (Ampere maintenance")
        # the allocator has seen its ask (its informer may lag the write)
        await env.wait_event("p", REASON_PENDING, saying=f"under way on {node}/GPU 0")
        await env.create_pod("q", slices={"main": {"7g.80gb": 2}})
        told = await env.wait_event("q", REASON_PENDING)
        assert f"under way on {node}/GPU 0 is done" in told["message"], told["message"]
        assert f"then a MIG mode change on {node}/GPU 1 too" in told["message"]
        assert [e["message"] for e in await env.events("q", REASON_PENDING)] == [
            told["message"]
        ]  # never a plainer reason first
        assert [g["uuid"] for g in await _desired(env, node)] == [emu.state().gpus[0].uuid]
    finally:
        emu.set_driver_client(0, False)
        emu.set_driver_client(1, False)
    bound = await env.wait_bound("p", within=60)
    assert podlib.bound_node(bound) == node


async def test_without_the_flag_an_ampere_pod_keeps_waiting(world: AgentWorld) -> None:
    (node,) = await world.nodes("a1", model="A100-80GB", mig_mode="disabled")
    env = world.env
    alloc = env.start()  # --ampere-mode-changes=off
    pod = await env.create_pod("p", slices={"main": {"1g.10gb": 1}})
    told = await env.wait_event("p", REASON_PENDING)
    assert "needs a GPU reset" in told["message"], told["message"]

    async def parked() -> bool:  # decided: an ask is written before the pod is parked, and
        return pod["metadata"]["uid"] in alloc.parked  # a parked pod waits for a change

    await eventually(parked, what="the pod parked as pending")  # the agent acts on asks only
    assert await _desired(env, node) == []
    assert EmulatorControl(world.gpus, node).state().gpus[0].mig_current == 0
    assert not podlib.bound_node(await env.pod("p"))


async def test_ampere_maintenance_serves_a_whole_gpu_pod_on_an_a100_in_mig_mode(
    world: AgentWorld,
) -> None:
    (node,) = await world.nodes("a1", model="A100-80GB")  # MIG on
    emu = EmulatorControl(world.gpus, node)
    emu.set_driver_client(0, True)  # the reset waits until the test lets go
    env = world.env
    env.start(ampere_mode_changes="drain")
    asked = "asked for (Ampere maintenance"
    under_way = f"1 whole GPU fit once the MIG mode change under way on {node}/GPU 0 is done"
    try:
        await env.create_pod("w", slices={"main": {"gpu": 1}})
        await env.wait_event("w", REASON_PENDING, saying=asked)
        await env.wait_event("w", REASON_PENDING, saying=f"{under_way} (MIG off")
    finally:
        emu.set_driver_client(0, False)
    bound = await env.wait_bound("w", within=60)
    assert podlib.bound_node(bound) == node
    told = [e["message"] for e in await env.events("w", REASON_PENDING)]
    assert len(told) == 2 and all(asked in m or under_way in m for m in told), told
    gpu = emu.state().gpus[0]
    assert (gpu.mig_current, gpu.mig_pending) == (0, 0)
    (record,) = await env.allocations()
    assert record["spec"]["slices"][0]["kind"] == "gpu"
    assert record["status"]["slices"][0]["gpuUUID"] == gpu.uuid


async def test_an_opposite_change_waits_the_interval_after_the_agents_last(
    world: AgentWorld,
) -> None:
    """The agent turns an A100's MIG on for a MIG pod (its `lastModeChange`); once that pod
    is gone, a whole-GPU pod that needs MIG off again is not asked for within
    `--ampere-mode-change-interval` (it is told why); a replica started with no interval
    asks, and the pod runs."""
    (node,) = await world.nodes("a1", model="A100-80GB", mig_mode="disabled")
    env = world.env
    env.start(ampere_mode_changes="drain", ampere_mode_change_interval_s=600.0)
    await env.create_pod("p", slices={"main": {"1g.10gb": 1}})
    await env.wait_bound("p", within=60)
    await env.delete_pod("p")
    await env.wait_gone("p")
    await env.create_pod("w", slices={"main": {"gpu": 1}})
    told = await env.wait_event("w", REASON_PENDING, saying="--ampere-mode-change-interval")
    assert f"{node}/GPU 0, whose last change went the other way" in told["message"]
    assert await _desired(env, node) == []  # nothing asked
    assert EmulatorControl(world.gpus, node).state().gpus[0].mig_current == 1
    await env.stop()
    env.start(ampere_mode_changes="drain", ampere_mode_change_interval_s=0.0)
    bound = await env.wait_bound("w", within=60)
    assert podlib.bound_node(bound) == node
    assert EmulatorControl(world.gpus, node).state().gpus[0].mig_current == 0
