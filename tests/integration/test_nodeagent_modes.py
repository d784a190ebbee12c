"""MIG mode on demand in the node agent, on the real control plane with the NVML emulator.

Covers: an H100 node whose GPUs start with MIG off advertises capacity for them and
publishes architecture, modeToggle and computeProcesses; the first MIG allocation enables
MIG on its GPU (lazily, inside the realisation) and MigNode shows the new mode and the last
change; a process on the GPU makes the change fail — Failed with the reason, MigNode
`modeChange.phase: Failed` — and the GPU is then avoided for the back-off without another
NVML attempt; a VM guest (RESET_REQUIRED) marks the GPU `modeToggle: none` and takes the
pending mode back; an A100 (reset needed) is never changed; SIGKILL between the fsynced
intent record and SetMigMode, then a restart, finishes the allocation. The reboot path
(MIG restored before re-creating) is in test_nodeagent.py.
Leaves out: the allocator's choice of modes (test_allocator_modes.py), real hardware.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from common.kubeapi import Kube, core_path, instaslice_path
from hack.cluster import ControlPlane
from nodeagent.emulator import EmulatedNvml
from tests.integration.agent_fixtures import (
    AgentProcess,
    agent_settings,
    cdi_inject,
    create_allocation,
    eventually,
    gpu_node,
    had_its_chance,
    injected_devices,
    injected_env,
    mig_node,
    pod_events,
    process_args,
    running_agent,
    slice_allocation,
    wait_gone,
    wait_phase,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]
H100 = "H100-80GB"
A100 = "A100-80GB"
Obj = dict[str, Any]


async def _gpus(agent_kube: Kube, node: str, want: Any = None) -> list[Obj]:
    """The MigNode's GPUs, once `want(gpus)` holds."""

    async def check() -> list[Obj] | None:
        mn = await mig_node(agent_kube, node)
        gpus: list[Obj] = ((mn or {}).get("status") or {}).get("gpus") or []
        return gpus if gpus and (want is None or want(gpus)) else None

    return await eventually(check, what=f"MigNode {node}")


async def test_first_mig_slice_enables_mig_on_its_gpu(
    agent_kube: Kube, alloc_ns: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    node = await gpu_node(agent_kube, tmp_path, [H100, H100], mig_mode="disabled")
    settings = agent_settings([node], control_plane.kubeconfig)
    async with running_agent(settings):
        gpus = await _gpus(agent_kube, node.name)
        g0 = gpus[0]
        assert g0["migMode"] == {"current": "disabled", "pending": "disabled"}
        assert (g0["architecture"], g0["modeToggle"], g0["computeProcesses"]) == (
            "hopper",
            "resetless",
            0,
        )
        assert "modeChange" not in g0 and "lastModeChange" not in g0

        async def capacity() -> dict[str, str] | None:
            cap = (await agent_kube.get(core_path("nodes", name=node.name)))["status"].get(
                "capacity"
            )
            return cap if cap and "instaslice.io/mig-1g.10gb" in cap else None

        cap = await eventually(capacity, what="capacity")
        assert cap["instaslice.io/mig-1g.10gb"] == "14"  # both GPUs can serve MIG on demand

        alloc = slice_allocation(alloc_ns, node, [("a", "3g.40gb", 1, 4, 4)])
        await create_allocation(agent_kube, alloc)
        await wait_phase(agent_kube, alloc, "Ready")
        state = node.emu.state()
        assert [g.mig_current for g in state.gpus] == [0, 1]  # only the GPU it needed
        assert node.instances() == [(1, "3g.40gb", 4, 4, 0)]
        # the mode change is published at once, the slice within SLICES_LISTED_WITHIN_S
        gpus = await _gpus(agent_kube, node.name, lambda g: g[1]["slices"])
        assert gpus[1]["migMode"]["current"] == "enabled"
        assert gpus[1]["lastModeChange"]["from"] == "disabled"
        assert gpus[1]["lastModeChange"]["to"] == "enabled"
        assert gpus[1]["slices"][0]["profile"] == "3g.40gb"
        assert gpus[0]["migMode"]["current"] == "disabled"
        assert json.loads(node.checkpoint.read_text())["modeChanges"] == []


async def test_busy_gpu_fails_the_change_and_is_avoided_for_a_backoff(
    agent_kube: Kube, alloc_ns: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    node = await gpu_node(agent_kube, tmp_path, [H100], mig_mode="disabled")
    settings = agent_settings([node], control_plane.kubeconfig)
    gpu = node.gpu_uuid(0)
    pid = node.emu.add_process(gpu)  # appeared after the allocator looked
    async with running_agent(settings):
        first = slice_allocation(alloc_ns, node, [("a", "1g.10gb", 0, 6, 1)])
        await create_allocation(agent_kube, first)
        failed = await wait_phase(agent_kube, first, "Failed")
        assert "1 compute process(es) run on it" in failed["status"]["message"]
        gpus = await _gpus(
            agent_kube, node.name, lambda g: g[0].get("modeChange", {}).get("phase") == "Failed"
        )
        assert gpus[0]["modeChange"]["phase"] == "Failed"
        assert gpus[0]["modeChange"]["target"] == "enabled"
        node.emu.remove_process(gpu, pid)
        node.emu.fail_next("set_mig_mode", 999)  # would show if NVML were asked again
        second = slice_allocation(alloc_ns, node, [("a", "1g.10gb", 0, 5, 1)])
        await create_allocation(agent_kube, second)
        failed = await wait_phase(agent_kube, second, "Failed")
        assert "not retried for" in failed["status"]["message"], failed["status"]["message"]
        assert node.emu.state().settings.fail != ()  # the injected failure was not used up
        assert node.emu.state().gpus[0].mig_current == 0


async def test_vm_guest_marks_the_gpu_unable_and_takes_the_pending_mode_back(
    agent_kube: Kube, alloc_ns: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    node = await gpu_node(agent_kube, tmp_path, [H100], mig_mode="disabled")
    node.emu.set_vm(True)
    settings = agent_settings([node], control_plane.kubeconfig)
    async with running_agent(settings):
        alloc = slice_allocation(alloc_ns, node, [("a", "1g.10gb", 0, 6, 1)])
        await create_allocation(agent_kube, alloc)
        failed = await wait_phase(agent_kube, alloc, "Failed")
        assert "RESET_REQUIRED" in failed["status"]["message"]
        gpus = await _gpus(agent_kube, node.name, lambda g: g[0]["modeToggle"] == "none")
        assert gpus[0]["migMode"] == {"current": "disabled", "pending": "disabled"}
        assert gpus[0]["modeChange"]["phase"] == "Failed"

        async def no_capacity() -> bool:
            cap = (await agent_kube.get(core_path("nodes", name=node.name)))["status"].get(
                "capacity"
            )
            return (cap or {}).get("instaslice.io/mig-1g.10gb") == "0"

        await eventually(no_capacity, what="capacity withdrawn from a GPU that cannot change")


async def test_ampere_mode_is_never_changed_for_a_pod(
    agent_kube: Kube, alloc_ns: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    node = await gpu_node(agent_kube, tmp_path, [A100], mig_mode="disabled")
    settings = agent_settings([node], control_plane.kubeconfig)
    async with running_agent(settings):
        gpus = await _gpus(agent_kube, node.name)
        assert (gpus[0]["architecture"], gpus[0]["modeToggle"]) == ("ampere", "reset")
        alloc = slice_allocation(alloc_ns, node, [("a", "1g.10gb", 0, 6, 1)])
        await create_allocation(agent_kube, alloc)
        failed = await wait_phase(agent_kube, alloc, "Failed")
        assert "needs a GPU reset" in failed["status"]["message"]
        assert node.emu.state().gpus[0].mig_pending == 0  # nothing was even made pending


async def test_crash_between_intent_record_and_mode_change(
    agent_kube: Kube, alloc_ns: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    node = await gpu_node(agent_kube, tmp_path, [H100], mig_mode="disabled")
    settings = agent_settings([node], control_plane.kubeconfig)
    node.emu.set_latency(mode_ms=60_000)  # SetMigMode sleeps before it changes anything
    alloc = slice_allocation(alloc_ns, node, [("a", "2g.20gb", 0, 2, 2)])
    proc = AgentProcess(process_args(settings), tmp_path / "agent-1.log").start()
    try:
        await create_allocation(agent_kube, alloc)

        def intent_on_disk() -> Obj | None:
            if not node.checkpoint.exists():
                return None
            doc: Obj = json.loads(node.checkpoint.read_text())
            return doc if doc.get("modeChanges") else None

        async def intent() -> Obj | None:
            return intent_on_disk()

        doc = await eventually(intent, what="the fsynced mode-change intent", within=30)
        assert doc["modeChanges"][0]["target"] == "enabled"
        assert doc["claims"][0]["state"] == "creating"
        proc.kill()  # inside SetMigMode's sleep: after the intent, before the change
    finally:
        proc.kill()
    assert node.emu.state().gpus[0].mig_current == 0, proc.tail()
    node.emu.set_latency(mode_ms=0)
    async with running_agent(settings):
        await wait_phase(agent_kube, alloc, "Ready")
        assert node.emu.state().gpus[0].mig_current == 1
        assert node.instances() == [(0, "2g.20gb", 2, 2, 0)]
        assert json.loads(node.checkpoint.read_text())["modeChanges"] == []


async def test_mode_and_processes_changed_underneath_are_read_again(
    agent_kube: Kube, alloc_ns: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    """An admin turns MIG off on an idle GPU and a process starts on another: the agent's
    rescan publishes both, and the next slice there turns MIG on again."""
    node = await gpu_node(agent_kube, tmp_path, [H100, H100])  # MIG on
    settings = agent_settings([node], control_plane.kubeconfig)
    async with running_agent(settings):
        await _gpus(agent_kube, node.name)
        nv = EmulatedNvml(node.root / "gpus", node.name)
        nv.nvmlInit()
        nv.nvmlDeviceSetMigMode(nv.nvmlDeviceGetHandleByIndex(0), 0)
        node.emu.add_process(node.gpu_uuid(1))
        gpus = await _gpus(
            agent_kube,
            node.name,
            lambda g: g[0]["migMode"]["current"] == "disabled" and g[1]["computeProcesses"] == 1,
        )
        assert "lastModeChange" not in gpus[0]  # not InstaSlice's change
        alloc = slice_allocation(alloc_ns, node, [("a", "1g.10gb", 0, 6, 1)])
        await create_allocation(agent_kube, alloc)
        await wait_phase(agent_kube, alloc, "Ready")
        assert node.emu.state().gpus[0].mig_current == 1


def _whole(alloc: Obj) -> Obj:
    """`slice_allocation`'s object with every slice a whole GPU (kind gpu)."""
    for s in alloc["spec"]["slices"]:
        s["kind"] = "gpu"
    return alloc


async def test_whole_gpu_turns_mig_off_and_binds_the_gpu_by_cdi(
    agent_kube: Kube, alloc_ns: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    node = await gpu_node(agent_kube, tmp_path, [H100, H100])  # MIG on
    settings = agent_settings([node], control_plane.kubeconfig)
    async with running_agent(settings):

        async def capacity() -> dict[str, str] | None:
            cap = (await agent_kube.get(core_path("nodes", name=node.name)))["status"].get(
                "capacity"
            )
            return cap if cap and "instaslice.io/gpu" in cap else None

        assert (await eventually(capacity, what="capacity"))["instaslice.io/gpu"] == "2"
        alloc = _whole(slice_allocation(alloc_ns, node, [("train", "gpu", 1, 0, 8)]))
        await create_allocation(agent_kube, alloc)
        ready = await wait_phase(agent_kube, alloc, "Ready")
        gpu = node.gpu_uuid(1)
        assert ready["status"]["slices"] == [{"container": "train", "migUUID": gpu, "gpuUUID": gpu}]
        assert [g.mig_current for g in node.emu.state().gpus] == [1, 0]
        claim = alloc["metadata"]["name"]

        async def told() -> list[Obj] | None:
            events = await pod_events(agent_kube, alloc_ns, f"pod-{claim}")
            found = [e for e in events if e["reason"] == "SliceReady"]
            return found or None

        (ready_event,) = await eventually(told, what="SliceReady")
        assert ready_event["message"] == f"whole GPUs ready on {node.name}: train: {gpu}"
        got = cdi_inject([node.cdi_dir], [f"instaslice.io/mig={alloc_ns}_{claim}_train"])
        assert got["rc"] == 0 and got["errors"] == {}
        assert injected_env(got)["NVIDIA_VISIBLE_DEVICES"] == gpu
        assert set(injected_devices(got)) == {
            "/dev/nvidia1",
            "/dev/nvidiactl",
            "/dev/nvidia-uvm",
            "/dev/nvidia-uvm-tools",
        }  # the GPU's node, no capability nodes
        gpus = await _gpus(agent_kube, node.name, lambda g: g[1]["slices"])
        assert gpus[1]["migMode"]["current"] == "disabled"
        assert gpus[1]["slices"] == [
            {"profile": "gpu", "start": 0, "size": 8, "migUUID": gpu, "claim": claim}
        ]
        await agent_kube.delete(
            instaslice_path("sliceallocations", alloc_ns, alloc["metadata"]["name"])
        )
        await wait_gone(agent_kube, alloc)
        assert node.cdi_files() == []
        assert node.emu.state().gpus[1].mig_current == 0  # left as it is (lazy)
        again = slice_allocation(alloc_ns, node, [("a", "1g.10gb", 1, 6, 1)])
        await create_allocation(agent_kube, again)
        await wait_phase(agent_kube, again, "Ready")
        assert node.emu.state().gpus[1].mig_current == 1


async def test_whole_gpu_on_a_gpu_with_foreign_instances_fails_untouched(
    agent_kube: Kube, alloc_ns: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    node = await gpu_node(agent_kube, tmp_path, [H100])
    nv = EmulatedNvml(node.root / "gpus", node.name)
    nv.nvmlInit()
    nv.nvmlDeviceCreateGpuInstance(nv.nvmlDeviceGetHandleByIndex(0), 19)  # not InstaSlice's
    settings = agent_settings([node], control_plane.kubeconfig)
    async with running_agent(settings):
        alloc = _whole(slice_allocation(alloc_ns, node, [("a", "gpu", 0, 0, 8)]))
        await create_allocation(agent_kube, alloc)
        failed = await wait_phase(agent_kube, alloc, "Failed")
        assert "InstaSlice did not create" in failed["status"]["message"]
        assert node.emu.state().gpus[0].mig_current == 1 and len(node.instances()) == 1


async def _label(kube: Kube, node: str, value: str | None) -> None:
    body = {"metadata": {"labels": {"instaslice.io/idle-mig-mode": value}}}
    await kube.patch(core_path("nodes", name=node), body)


async def test_resting_mode_changes_only_idle_hopper_gpus(
    agent_kube: Kube, alloc_ns: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    """`instaslice.io/idle-mig-mode` (issue 24): an idle H100 is brought to the labelled mode
    once idle past `--idle-mig-mode-after-s`, through the intent/verify path; a GPU with an
    allocation, one with a process and an A100 are left alone; `any` stops it; a label
    asking the other mode brings the idle GPU back."""
    node = await gpu_node(agent_kube, tmp_path, [H100, H100, H100, A100])  # MIG on
    settings = agent_settings([node], control_plane.kubeconfig, idle_mig_mode_after_s=1.0)
    node.emu.add_process(node.gpu_uuid(2))
    async with running_agent(settings) as agents:
        agent = agents[node.name]
        alloc = slice_allocation(alloc_ns, node, [("a", "1g.10gb", 0, 6, 1)])
        await create_allocation(agent_kube, alloc)
        await wait_phase(agent_kube, alloc, "Ready")
        await _label(agent_kube, node.name, "bogus")  # read as any: nothing changes
        # idle past the threshold (the agent reads the real clock), then several GC passes
        await had_its_chance(agent, not_before=time.monotonic() + 1.0)
        assert [g.mig_current for g in node.emu.state().gpus] == [1, 1, 1, 1]
        await _label(agent_kube, node.name, "disabled")

        gpus = await _gpus(
            agent_kube, node.name, lambda g: g[1]["migMode"]["current"] == "disabled"
        )
        assert gpus[1]["lastModeChange"]["to"] == "disabled"
        assert [g.mig_current for g in node.emu.state().gpus] == [1, 0, 1, 1]
        assert json.loads(node.checkpoint.read_text())["modeChanges"] == []

        await _label(agent_kube, node.name, "enabled")
        await _gpus(agent_kube, node.name, lambda g: g[1]["migMode"]["current"] == "enabled")
        await _label(agent_kube, node.name, "any")
        nv = EmulatedNvml(node.root / "gpus", node.name)
        nv.nvmlInit()
        nv.nvmlDeviceSetMigMode(nv.nvmlDeviceGetHandleByIndex(1), 0)  # an admin, under `any`
        await _gpus(agent_kube, node.name, lambda g: g[1]["migMode"]["current"] == "disabled")
        # idle past the threshold (the agent reads the real clock), then several GC passes
        await had_its_chance(agent, not_before=time.monotonic() + 1.0)
        assert [g.mig_current for g in node.emu.state().gpus] == [1, 0, 1, 1]
        # the GPU with an allocation rests too once the allocation is gone
        await _label(agent_kube, node.name, "disabled")
        await agent_kube.delete(
            instaslice_path("sliceallocations", alloc_ns, alloc["metadata"]["name"])
        )
        await wait_gone(agent_kube, alloc)
        await _gpus(agent_kube, node.name, lambda g: g[0]["migMode"]["current"] == "disabled")
        assert [g.mig_current for g in node.emu.state().gpus] == [0, 0, 1, 1]
