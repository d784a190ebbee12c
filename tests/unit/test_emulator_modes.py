"""MIG mode rules of the NVML emulator, one test per rule (docs/emulator.md "MIG mode").

Covers: the Hopper+ reset-less toggle when idle; IN_USE with processes or GPU instances (and
the "destroy" variant); Ampere's pending mode until a reset; the per-model mode after a
reboot; a pass-through VM where toggling needs a reset that is refused; the latency of a
mode change; the settings surviving the state file. Leaves out: the agent's use of them
(tests/integration/test_nodeagent_modes.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pynvml
import pytest

from nodeagent.emulator import EmulatedNvml, EmulatorControl, EmulatorError, provision
from nodeagent.emulator.cli import run as emu


def make(
    tmp: Path, models: list[str], mig: str = "disabled", **kw: Any
) -> tuple[EmulatedNvml, EmulatorControl]:
    provision(tmp, "n0", models, mig)  # type: ignore[arg-type]
    nv = EmulatedNvml(tmp, "n0", **kw)
    nv.nvmlInit()
    return nv, EmulatorControl(tmp, "n0")


@pytest.mark.parametrize("model", ["H100-80GB", "H200-141GB", "GH200-144GB", "B200-180GB"])
def test_hopper_and_newer_toggle_without_reset_when_idle(tmp_path: Path, model: str) -> None:
    nv, _ = make(tmp_path, [model])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceSetMigMode(dev, 1) == pynvml.NVML_SUCCESS
    assert nv.nvmlDeviceGetMigMode(dev) == [1, 1]
    assert nv.nvmlDeviceSetMigMode(dev, 0) == pynvml.NVML_SUCCESS
    assert nv.nvmlDeviceGetMigMode(dev) == [0, 0]


def test_in_use_with_processes_on_the_gpu_or_a_mig_device(tmp_path: Path) -> None:
    nv, ctl = make(tmp_path, ["H100-80GB"])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    gpu = nv.nvmlDeviceGetUUID(dev)
    pid = ctl.add_process(gpu)
    with pytest.raises(pynvml.NVMLError_InUse):
        nv.nvmlDeviceSetMigMode(dev, 1)
    assert nv.nvmlDeviceGetMigMode(dev) == [0, 0]
    ctl.remove_process(gpu, pid)
    nv.nvmlDeviceSetMigMode(dev, 1)
    gi = nv.nvmlDeviceCreateGpuInstance(dev, 19)
    info = nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 0, 0)
    nv.nvmlGpuInstanceCreateComputeInstance(gi, info.id)
    mig = next(r.mig_uuid for r in ctl.instances())
    assert mig is not None
    ctl.add_process(mig)
    ctl.set_disable_with_instances("destroy")  # even then, a process blocks it
    with pytest.raises(pynvml.NVMLError_InUse):
        nv.nvmlDeviceSetMigMode(dev, 0)
    assert nv.nvmlDeviceGetMigMode(dev) == [1, 1] and len(ctl.instances()) == 1


def test_in_use_with_gpu_instances_unless_told_to_destroy(tmp_path: Path) -> None:
    nv, ctl = make(tmp_path, ["H200-141GB"], mig="enabled")
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    nv.nvmlDeviceCreateGpuInstance(dev, 19)  # a GI without compute instances is enough
    with pytest.raises(pynvml.NVMLError_InUse):
        nv.nvmlDeviceSetMigMode(dev, 0)
    assert nv.nvmlDeviceGetMigMode(dev) == [1, 1] and len(ctl.instances()) == 1
    assert nv.nvmlDeviceSetMigMode(dev, 1) == pynvml.NVML_SUCCESS  # same mode: no-op
    ctl.set_disable_with_instances("destroy")
    assert nv.nvmlDeviceSetMigMode(dev, 0) == pynvml.NVML_SUCCESS
    assert nv.nvmlDeviceGetMigMode(dev) == [0, 0] and ctl.instances() == []
    with pytest.raises(EmulatorError, match="in_use or destroy"):
        ctl.set_disable_with_instances("later")  # type: ignore[arg-type]


@pytest.mark.parametrize("model", ["A30-24GB", "A100-40GB", "A100-80GB"])
def test_ampere_mode_is_pending_until_a_reset(tmp_path: Path, model: str) -> None:
    nv, ctl = make(tmp_path, [model, model])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceSetMigMode(dev, 1) == pynvml.NVML_ERROR_RESET_REQUIRED
    assert nv.nvmlDeviceGetMigMode(dev) == [0, 1]
    assert nv.nvmlDeviceGetMaxMigDeviceCount(dev) == 0  # not in effect
    ctl.reset_gpu(0)
    assert nv.nvmlDeviceGetMigMode(dev) == [1, 1]
    other = nv.nvmlDeviceGetHandleByIndex(1)
    assert nv.nvmlDeviceGetMigMode(other) == [0, 0]  # a reset is per GPU


@pytest.mark.parametrize(
    ("model", "after"),
    [("A100-80GB", [1, 1]), ("A30-24GB", [1, 1]), ("H100-80GB", [0, 0]), ("B200-180GB", [0, 0])],
)
def test_mode_after_reboot_is_per_model(tmp_path: Path, model: str, after: list[int]) -> None:
    nv, ctl = make(tmp_path, [model], mig="enabled")
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    ctl.reboot()
    assert nv.nvmlDeviceGetMigMode(dev) == after
    nv.nvmlDeviceSetMigMode(dev, 1)
    ctl.reboot(keep_mig_mode=False)
    assert nv.nvmlDeviceGetMigMode(dev) == [0, 0]


def test_ampere_reboot_applies_the_pending_mode(tmp_path: Path) -> None:
    nv, ctl = make(tmp_path, ["A100-40GB"])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    nv.nvmlDeviceSetMigMode(dev, 1)
    ctl.reboot()
    assert nv.nvmlDeviceGetMigMode(dev) == [1, 1]


@pytest.mark.parametrize("model", ["H100-80GB", "A100-80GB"])
def test_vm_needs_a_reset_that_is_refused(tmp_path: Path, model: str) -> None:
    nv, ctl = make(tmp_path, [model])
    ctl.set_vm(True)
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceSetMigMode(dev, 1) == pynvml.NVML_ERROR_RESET_REQUIRED
    assert nv.nvmlDeviceGetMigMode(dev) == [0, 1]
    with pytest.raises(EmulatorError, match="not supported in a VM"):
        ctl.reset_gpu(0)
    with pytest.raises(EmulatorError, match="not supported in a VM"):
        ctl.reset_gpu(0, force=True)
    assert nv.nvmlDeviceGetMigMode(dev) == [0, 1]
    assert nv.nvmlDeviceSetMigMode(dev, 0) == pynvml.NVML_SUCCESS  # back to current
    ctl.set_vm(False)
    if model.startswith("H"):
        assert nv.nvmlDeviceSetMigMode(dev, 1) == pynvml.NVML_SUCCESS


def test_mode_change_latency_is_slept_only_for_a_change(tmp_path: Path) -> None:
    slept: list[float] = []
    nv, ctl = make(tmp_path, ["H100-80GB"], sleep=slept.append)
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    ctl.set_latency(mode_ms=1500)
    nv.nvmlDeviceSetMigMode(dev, 0)  # already disabled: nothing to wait for
    assert slept == []
    nv.nvmlDeviceSetMigMode(dev, 1)
    assert slept == [1.5]
    nv.nvmlDeviceCreateGpuInstance(dev, 19)  # create latency is separate (0 here)
    assert slept == [1.5]


def test_settings_survive_the_state_file_and_the_cli(tmp_path: Path) -> None:
    _, ctl = make(tmp_path, ["H100-80GB"])
    emu(["latency", "--state", str(tmp_path), "--node", "n0", "--mode-ms", "70"])
    emu(["vm", "--state", str(tmp_path), "--node", "n0", "--on", "true"])
    ctl.set_disable_with_instances("destroy")
    s = EmulatorControl(tmp_path, "n0").state().settings
    assert (s.mode_ms, s.vm, s.disable_with_instances) == (70, True, "destroy")
    where = ["--state", str(tmp_path), "--node", "n0"]
    emu(["reboot", *where, "--keep-mig-mode"])
    with pytest.raises(SystemExit):
        emu(["reboot", *where, "--keep-mig-mode", "--clear-mig-mode"])
