"""Ampere maintenance in the node agent (nodeagent/maintenance.py), on the real control plane
with the NVML emulator.

Covers: a MigNode `spec.gpus[].desiredMigMode` on an idle A100 pauses the GPU Operator's
clients through its own labels (only those present and not `false`), resets the GPU (the
reset is refused until the paused DCGM lets go: a fake Operator in the test drops the
emulator's driver client when it sees the label paused), verifies the mode, restores the
labels exactly as they were, and republishes MigNode; a GPU with an allocation on it is
drained first (MigNode `modeChange.phase: Draining`, nothing touched) and changed once the
allocation is gone; a reset that stays refused fails with a back-off and the labels are
restored; SIGKILL after the labels were paused, then a restart, restores them from the
fsynced record before anything else and then carries out the asked change.
Leaves out: the allocator's asks (test_allocator_with_agent.py), real hardware.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from common.kubeapi import Kube, core_path, instaslice_path
from hack.cluster import ControlPlane
from tests.integration.agent_fixtures import (
    AgentProcess,
    GpuNode,
    agent_settings,
    create_allocation,
    eventually,
    gpu_node,
    mig_node,
    process_args,
    running_agent,
    slice_allocation,
    wait_gone,
    wait_phase,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]
A100 = "A100-80GB"
Obj = dict[str, Any]
DCGM = "nvidia.com/gpu.deploy.dcgm"
EXPORTER = "nvidia.com/gpu.deploy.dcgm-exporter"
PLUGIN = "nvidia.com/gpu.deploy.device-plugin"
GFD = "nvidia.com/gpu.deploy.gpu-feature-discovery"
OPERATOR = {DCGM: "true", EXPORTER: "true", PLUGIN: "false"}  # GFD absent


async def _labels(kube: Kube, node: str) -> dict[str, str]:
    obj = await kube.get(core_path("nodes", name=node))
    return dict(obj["metadata"].get("labels") or {})


async def _operator_labels(kube: Kube, node: str) -> dict[str, str]:
    return {k: v for k, v in (await _labels(kube, node)).items() if k.startswith("nvidia.com/")}


async def _desire(kube: Kube, node: GpuNode, modes: dict[int, str]) -> None:
    async def published() -> bool:
        return await mig_node(kube, node.name) is not None

    await eventually(published, what="MigNode")
    gpus = [{"uuid": node.gpu_uuid(i), "desiredMigMode": m} for i, m in modes.items()]
    await kube.patch(instaslice_path("mignodes", name=node.name), {"spec": {"gpus": gpus}})


async def _gpus(kube: Kube, node: str, want: Any) -> list[Obj]:
    async def check() -> list[Obj] | None:
        mn = await mig_node(kube, node)
        gpus: list[Obj] = ((mn or {}).get("status") or {}).get("gpus") or []
        return gpus if gpus and want(gpus) else None

    return await eventually(check, what=f"MigNode {node}", within=30)


@contextlib.asynccontextmanager
async def fake_operator(kube: Kube, node: GpuNode, gpu: int) -> AsyncIterator[list[str]]:
    """DCGM holds GPU `gpu` open while its deploy label is not paused (the DaemonSet's node
    selector); the values seen are returned in order."""
    seen: list[str] = []
    node.emu.set_driver_client(gpu, True)

    async def loop() -> None:
        while True:
            value = (await _labels(kube, node.name)).get(DCGM, "")
            if not seen or seen[-1] != value:
                seen.append(value)
            node.emu.set_driver_client(gpu, value != "paused-for-mig-change")
            await asyncio.sleep(0.05)

    task = asyncio.create_task(loop())
    try:
        yield seen
    finally:
        task.cancel()
        await asyncio.wait({task})


async def _operator_node(kube: Kube, tmp: Path, mig_mode: str = "disabled") -> GpuNode:
    node = await gpu_node(kube, tmp, [A100, A100], mig_mode=mig_mode)  # type: ignore[arg-type]
    await kube.patch(core_path("nodes", name=node.name), {"metadata": {"labels": OPERATOR}})
    return node


async def test_maintenance_pauses_operator_clients_resets_and_restores_labels(
    agent_kube: Kube, alloc_ns: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    node = await _operator_node(agent_kube, tmp_path)
    settings = agent_settings([node], control_plane.kubeconfig, maintenance_wait_s=20.0)
    async with fake_operator(agent_kube, node, 0) as seen, running_agent(settings):
        await _desire(agent_kube, node, {0: "enabled"})
        gpus = await _gpus(
            agent_kube,
            node.name,
            lambda g: g[0]["migMode"]["current"] == "enabled" and "modeChange" not in g[0],
        )
        assert gpus[0]["migMode"] == {"current": "enabled", "pending": "enabled"}
        assert gpus[0]["lastModeChange"]["from"] == "disabled"
        assert "modeChange" not in gpus[0]
        assert gpus[1]["migMode"]["current"] == "disabled"  # not asked: untouched
        assert [g.mig_current for g in node.emu.state().gpus] == [1, 0]

        async def restored() -> dict[str, str] | None:
            got = await _operator_labels(agent_kube, node.name)
            return got if got == OPERATOR else None

        assert await eventually(restored, what="labels restored") == OPERATOR  # GFD not added

        async def operator_saw_it_back() -> list[str] | None:  # it polls the label: may lag
            return seen if len(seen) >= 3 else None

        await eventually(operator_saw_it_back, what="the operator seeing its label back")
        assert seen[:3] == ["true", "paused-for-mig-change", "true"], seen
        assert json.loads(node.checkpoint.read_text())["maintenance"] is None

        async def capacity() -> bool:
            cap = (await agent_kube.get(core_path("nodes", name=node.name)))["status"]["capacity"]
            return bool(cap.get("instaslice.io/mig-1g.10gb") == "7")

        await eventually(capacity, what="the GPU's MIG capacity advertised")


async def test_a_busy_gpu_is_drained_first(
    agent_kube: Kube, alloc_ns: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    node = await _operator_node(agent_kube, tmp_path, mig_mode="enabled")
    settings = agent_settings([node], control_plane.kubeconfig, maintenance_wait_s=5.0)
    async with running_agent(settings):
        alloc = slice_allocation(alloc_ns, node, [("a", "1g.10gb", 0, 6, 1)])
        await create_allocation(agent_kube, alloc)
        await wait_phase(agent_kube, alloc, "Ready")
        await _desire(agent_kube, node, {0: "disabled"})
        await _gpus(
            agent_kube, node.name, lambda g: g[0].get("modeChange", {}).get("phase") == "Draining"
        )
        await asyncio.sleep(1.0)  # several GC passes: still waiting, nothing touched
        assert node.emu.state().gpus[0].mig_pending == 1
        assert await _operator_labels(agent_kube, node.name) == OPERATOR
        await agent_kube.delete(
            instaslice_path("sliceallocations", alloc_ns, alloc["metadata"]["name"])
        )
        await wait_gone(agent_kube, alloc)
        await _gpus(  # the phase goes with the same or the next publish
            agent_kube,
            node.name,
            lambda g: g[0]["migMode"]["current"] == "disabled" and "modeChange" not in g[0],
        )
        assert await _operator_labels(agent_kube, node.name) == OPERATOR


async def test_a_reset_still_refused_fails_with_a_backoff_and_restores_labels(
    agent_kube: Kube, alloc_ns: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    node = await _operator_node(agent_kube, tmp_path)
    node.emu.set_driver_client(0, True)  # persistenced, say: no label pauses it
    settings = agent_settings([node], control_plane.kubeconfig, maintenance_wait_s=1.0)
    async with running_agent(settings):
        await _desire(agent_kube, node, {0: "enabled"})
        gpus = await _gpus(
            agent_kube, node.name, lambda g: g[0].get("modeChange", {}).get("phase") == "Failed"
        )
        assert "driver client" in gpus[0]["modeChange"]["message"]
        assert gpus[0]["migMode"] == {"current": "disabled", "pending": "disabled"}
        assert await _operator_labels(agent_kube, node.name) == OPERATOR
        node.emu.set_driver_client(0, False)
        node.emu.fail_next("set_mig_mode", 999)  # would show if it were tried again
        await asyncio.sleep(1.0)  # GC passes within the back-off: no retry
        assert node.emu.state().settings.fail != ()
        assert node.emu.state().gpus[0].mig_current == 0


async def test_crash_with_labels_paused_restores_them_at_start(
    agent_kube: Kube, alloc_ns: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    node = await _operator_node(agent_kube, tmp_path)
    settings = agent_settings([node], control_plane.kubeconfig)
    node.emu.set_latency(mode_ms=60_000)  # SetMigMode sleeps: labels paused, GPU untouched
    proc = AgentProcess(process_args(settings), tmp_path / "agent-1.log").start()
    try:
        await _desire(agent_kube, node, {0: "enabled"})

        async def paused() -> bool:
            labels = await _operator_labels(agent_kube, node.name)
            return labels.get(DCGM) == "paused-for-mig-change"

        await eventually(paused, what="labels paused", within=30)
        doc = json.loads(node.checkpoint.read_text())
        assert doc["maintenance"]["labels"] == {DCGM: "true", EXPORTER: "true"}
        proc.kill()
    finally:
        proc.kill()
    assert (await _operator_labels(agent_kube, node.name))[DCGM] == "paused-for-mig-change"
    assert node.emu.state().gpus[0].mig_current == 0, proc.tail()
    node.emu.set_latency(mode_ms=0)
    async with running_agent(settings):
        await _gpus(agent_kube, node.name, lambda g: g[0]["migMode"]["current"] == "enabled")

        async def restored() -> bool:
            return await _operator_labels(agent_kube, node.name) == OPERATOR

        await eventually(restored, what="labels restored")
        assert json.loads(node.checkpoint.read_text())["maintenance"] is None


async def test_a_desired_mode_on_a_hopper_gpu_changes_without_a_reset(
    agent_kube: Kube, alloc_ns: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    """An admin's `desiredMigMode` on an H100 is carried out reset-less (labels untouched),
    and wins over a resting mode asking the other one (never the two in turn)."""
    node = await gpu_node(agent_kube, tmp_path, ["H100-80GB"], mig_mode="disabled")
    labels = {**OPERATOR, "instaslice.io/idle-mig-mode": "disabled"}
    await agent_kube.patch(core_path("nodes", name=node.name), {"metadata": {"labels": labels}})
    settings = agent_settings([node], control_plane.kubeconfig, idle_mig_mode_after_s=0.3)
    async with running_agent(settings):
        await _desire(agent_kube, node, {0: "enabled"})
        gpus = await _gpus(agent_kube, node.name, lambda g: g[0]["migMode"]["current"] == "enabled")
        changed = gpus[0]["lastModeChange"]
        assert changed["to"] == "enabled"
        await asyncio.sleep(1.5)  # idle past the resting threshold, several GC passes
        gpus = await _gpus(agent_kube, node.name, lambda g: True)
        assert gpus[0]["lastModeChange"] == changed  # not rested to disabled meanwhile
        assert node.emu.state().gpus[0].mig_current == 1
        assert await _operator_labels(agent_kube, node.name) == OPERATOR
        assert json.loads(node.checkpoint.read_text())["maintenance"] is None
