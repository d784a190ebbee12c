"""Ampere maintenance in the node agent (nodeagent/maintenance.py), on the real control plane
with the NVML emulator.

Covers: a MigNode `spec.gpus[].desiredMigMode` on an idle A100 pauses the GPU Operator's
clients through its own labels (only those present and not `false`), resets the GPU (the
reset is refused until the paused DCGM lets go: a fake Operator in the test drops the
emulator's driver client when it sees the label paused), verifies the mode, restores the
labels exactly as they were, and republishes MigNode; a GPU with an allocation on it is
drained first (MigNode `modeChange.phase: Draining`, nothing touched) and changed once the
allocation is gone; a drain that runs past `--maintenance-drain-timeout-s` gives the ask up
(`Failed` naming the allocation, a Warning event on the MigNode, the allocation left Ready,
labels and mode untouched, and not carried out once the GPU is free while the same ask
stands; removed and written anew after the back-off, it is carried out); a reset that stays
refused fails with a back-off and the labels are restored; SIGKILL after the labels were
paused, then a restart, restores them from the fsynced record before anything else and then
carries out the asked change.
Leaves out: the allocator's asks (test_allocator_with_agent.py), real hardware.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from common.kubeapi import Kube, core_path, instaslice_path
from hack.cluster import ControlPlane
from nodeagent import modes
from tests.integration.agent_fixtures import (
    AgentProcess,
    GpuNode,
    agent_settings,
    create_allocation,
    delete_allocation,
    eventually,
    gpu_node,
    had_its_chance,
    mig_node,
    mig_node_warning,
    process_args,
    running_agent,
    slice_allocation,
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


async def _drain_busy_gpu(kube: Kube, alloc_ns: str, node: GpuNode) -> Obj:
    """A Ready allocation on GPU 0, then MIG off asked there: the agent drains (the
    allocation is returned)."""
    alloc = slice_allocation(alloc_ns, node, [("a", "1g.10gb", 0, 6, 1)])
    await create_allocation(kube, alloc)
    await wait_phase(kube, alloc, "Ready")
    await _desire(kube, node, {0: "disabled"})
    await _gpus(kube, node.name, lambda g: g[0].get("modeChange", {}).get("phase") == "Draining")
    return alloc


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
    async with running_agent(settings) as agents:
        alloc = await _drain_busy_gpu(agent_kube, alloc_ns, node)
        await had_its_chance(agents[node.name], maintenance=True)  # still waiting, untouched
        assert node.emu.state().gpus[0].mig_pending == 1
        assert await _operator_labels(agent_kube, node.name) == OPERATOR
        await delete_allocation(agent_kube, alloc, wait=True)
        await _gpus(  # the phase goes with the same or the next publish
            agent_kube,
            node.name,
            lambda g: g[0]["migMode"]["current"] == "disabled" and "modeChange" not in g[0],
        )
        assert await _operator_labels(agent_kube, node.name) == OPERATOR


async def test_a_drain_past_its_timeout_gives_the_ask_up_and_evicts_nothing(
    agent_kube: Kube, alloc_ns: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    node = await _operator_node(agent_kube, tmp_path, mig_mode="enabled")
    settings = agent_settings([node], control_plane.kubeconfig, maintenance_drain_timeout_s=1.0)
    async with running_agent(settings) as agents:
        alloc = await _drain_busy_gpu(agent_kube, alloc_ns, node)
        gpus = await _gpus(
            agent_kube, node.name, lambda g: g[0].get("modeChange", {}).get("phase") == "Failed"
        )
        failed = gpus[0]["modeChange"]
        assert failed["target"] == "disabled" and failed["reason"] == "DrainTimedOut"
        assert "drain timed out after 1 s" in failed["message"]
        assert f"{alloc_ns}/{alloc['metadata']['name']}" in failed["message"]
        assert "nothing was evicted" in failed["message"]
        assert gpus[0]["migMode"] == {"current": "enabled", "pending": "enabled"}

        told = await mig_node_warning(agent_kube, node.name, "MigModeDrainTimedOut")
        assert "drain timed out" in told["message"]
        await wait_phase(agent_kube, alloc, "Ready")  # still there, untouched
        assert await _operator_labels(agent_kube, node.name) == OPERATOR

        # the GPU frees up while the same ask stands: given up, not carried out after all
        await delete_allocation(agent_kube, alloc, wait=True)  # its record dropped before
        await had_its_chance(agents[node.name], maintenance=True)
        gpus = await _gpus(agent_kube, node.name, lambda g: True)
        assert gpus[0]["modeChange"]["phase"] == "Failed"
        assert gpus[0]["migMode"] == {"current": "enabled", "pending": "enabled"}
        assert node.emu.state().gpus[0].mig_pending == 1
        assert await _operator_labels(agent_kube, node.name) == OPERATOR


def _drain_record(node: GpuNode, gpu: int) -> Obj | None:
    drains: Obj = json.loads(node.checkpoint.read_text()).get("drains") or {}
    return drains.get(node.gpu_uuid(gpu))


async def test_a_drain_clock_and_a_given_up_ask_outlive_a_restart(
    agent_kube: Kube, alloc_ns: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    """The drain's start is in the checkpoint: a restarted agent goes on with it (a
    crash-looping agent still runs out); a given-up ask stays given up across a restart,
    shown `Failed` again and not carried out once the GPU is free."""
    node = await _operator_node(agent_kube, tmp_path, mig_mode="enabled")
    slow = agent_settings([node], control_plane.kubeconfig, maintenance_drain_timeout_s=3600)
    async with running_agent(slow):
        alloc = await _drain_busy_gpu(agent_kube, alloc_ns, node)
        first = await eventually(
            lambda: asyncio.to_thread(_drain_record, node, 0), what="the drain's clock on disk"
        )
    assert first["target"] == "disabled" and not first["givenUp"]
    async with running_agent(slow) as agents:  # restarted: still draining, on the same clock
        await _gpus(
            agent_kube, node.name, lambda g: g[0].get("modeChange", {}).get("phase") == "Draining"
        )
        await had_its_chance(agents[node.name], maintenance=True)
        assert _drain_record(node, 0) == first
    # the drain's clock (wall time, read by the agent) runs past the quick agent's 1 s before
    # it starts: serve() takes no clock to move instead
    await asyncio.sleep(max(0.0, first["since"] + 1.0 - time.time()))
    quick = agent_settings([node], control_plane.kubeconfig, maintenance_drain_timeout_s=1.0)
    async with running_agent(quick):  # the clock started > 1 s ago, before this process
        await _gpus(
            agent_kube, node.name, lambda g: g[0].get("modeChange", {}).get("phase") == "Failed"
        )
        given_up = await eventually(
            lambda: asyncio.to_thread(lambda: (_drain_record(node, 0) or {}).get("givenUp")),
            what="the give-up on disk",
        )
        assert "drain timed out" in given_up
    async with running_agent(quick) as agents:  # restarted: the ask is still given up
        gpus = await _gpus(
            agent_kube, node.name, lambda g: g[0].get("modeChange", {}).get("phase") == "Failed"
        )
        assert gpus[0]["modeChange"]["reason"] == "DrainTimedOut"
        assert gpus[0]["modeChange"]["message"] == given_up
        await delete_allocation(agent_kube, alloc, wait=True)  # the GPU frees up
        await had_its_chance(agents[node.name], maintenance=True)  # not carried out after all
        gpus = await _gpus(agent_kube, node.name, lambda g: True)
        assert gpus[0]["modeChange"]["phase"] == "Failed"
        assert gpus[0]["migMode"] == {"current": "enabled", "pending": "enabled"}
        assert node.emu.state().gpus[0].mig_pending == 1
        assert await _operator_labels(agent_kube, node.name) == OPERATOR


async def test_a_hopper_ask_waits_past_the_drain_timeout_and_is_carried_out_once_idle(
    agent_kube: Kube, alloc_ns: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    """The drain timeout is Ampere's: an ask on a reset-less GPU is never given up; it waits
    for the work and is carried out once the GPU is idle (docs/nodeagent.md)."""
    node = await gpu_node(agent_kube, tmp_path, ["H100-80GB"], mig_mode="enabled")
    settings = agent_settings([node], control_plane.kubeconfig, maintenance_drain_timeout_s=0.3)
    async with running_agent(settings) as agents:
        alloc = await _drain_busy_gpu(agent_kube, alloc_ns, node)
        # draining longer than the timeout (the agent reads the real clock), several steps
        past = time.monotonic() + 0.3
        await had_its_chance(agents[node.name], maintenance=True, not_before=past)
        gpus = await _gpus(agent_kube, node.name, lambda g: True)
        assert gpus[0]["modeChange"] == {"phase": "Draining"}
        assert _drain_record(node, 0) is None  # no clock runs for it
        await delete_allocation(agent_kube, alloc, wait=True)
        gpus = await _gpus(
            agent_kube,
            node.name,
            lambda g: g[0]["migMode"]["current"] == "disabled" and "modeChange" not in g[0],
        )
        assert gpus[0]["lastModeChange"]["to"] == "disabled"


async def test_a_given_up_ask_written_anew_after_the_backoff_is_carried_out(
    agent_kube: Kube,
    alloc_ns: str,
    tmp_path: Path,
    control_plane: ControlPlane,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(modes, "BACKOFF_S", 1.0)  # the in-process agent reads it per failure
    node = await _operator_node(agent_kube, tmp_path, mig_mode="enabled")
    settings = agent_settings([node], control_plane.kubeconfig, maintenance_drain_timeout_s=0.5)
    async with running_agent(settings):
        alloc = await _drain_busy_gpu(agent_kube, alloc_ns, node)
        await _gpus(
            agent_kube, node.name, lambda g: g[0].get("modeChange", {}).get("phase") == "Failed"
        )
        await delete_allocation(agent_kube, alloc, wait=True)
        await _desire(agent_kube, node, {})  # the admin gives up too: forgotten
        await _gpus(agent_kube, node.name, lambda g: "modeChange" not in g[0])  # back-off over
        await _desire(agent_kube, node, {0: "disabled"})  # asked anew, the GPU idle now
        gpus = await _gpus(
            agent_kube,
            node.name,
            lambda g: g[0]["migMode"]["current"] == "disabled" and "modeChange" not in g[0],
        )
        assert gpus[0]["lastModeChange"]["to"] == "disabled"
        assert await _operator_labels(agent_kube, node.name) == OPERATOR


async def test_a_reset_still_refused_fails_with_a_backoff_and_restores_labels(
    agent_kube: Kube, alloc_ns: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    node = await _operator_node(agent_kube, tmp_path)
    node.emu.set_driver_client(0, True)  # persistenced, say: no label pauses it
    settings = agent_settings([node], control_plane.kubeconfig, maintenance_wait_s=1.0)
    async with running_agent(settings) as agents:
        await _desire(agent_kube, node, {0: "enabled"})
        gpus = await _gpus(
            agent_kube, node.name, lambda g: g[0].get("modeChange", {}).get("phase") == "Failed"
        )
        assert "driver client" in gpus[0]["modeChange"]["message"]
        assert "reason" not in gpus[0]["modeChange"]  # retried after the back-off: not given up
        assert gpus[0]["migMode"] == {"current": "disabled", "pending": "disabled"}
        assert await _operator_labels(agent_kube, node.name) == OPERATOR
        node.emu.set_driver_client(0, False)
        node.emu.fail_next("set_mig_mode", 999)  # would show if it were tried again
        # steps within the back-off (modes.BACKOFF_S, 300 s): no retry
        await had_its_chance(agents[node.name], maintenance=True)
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
    async with running_agent(settings) as agents:
        await _desire(agent_kube, node, {0: "enabled"})
        gpus = await _gpus(agent_kube, node.name, lambda g: g[0]["migMode"]["current"] == "enabled")
        changed = gpus[0]["lastModeChange"]
        assert changed["to"] == "enabled"
        idle = time.monotonic() + 0.3  # idle past the resting threshold, then several passes
        await had_its_chance(agents[node.name], maintenance=True, not_before=idle)
        gpus = await _gpus(agent_kube, node.name, lambda g: True)
        assert gpus[0]["lastModeChange"] == changed  # not rested to disabled meanwhile
        assert node.emu.state().gpus[0].mig_current == 1
        assert await _operator_labels(agent_kube, node.name) == OPERATOR
        assert json.loads(node.checkpoint.read_text())["maintenance"] is None
