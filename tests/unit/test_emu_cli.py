"""`instaslice-emu`, run as the installed console script and through `main()` in-process.

Covers: `lgip`/`lgipp --model H200-141GB` equal the real nvidia-smi dumps in
tests/data/h200-141gb/ (per line after rstrip, and byte for byte); every model
renders an 81-column table; `lgi` lines `<gpu> <profile> <id> <gi> <start>:<size>`; the
node commands (provision, latency, fail-next, gpu-lost, xid, processes, reset, reboot)
change what an EmulatedNvml in this process sees; errors exit 1 (refused) or 2 (usage).
Leaves out: the rules behind the commands (test_emulator.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pynvml
import pytest

from common.catalog import GpuModel, load_catalog
from nodeagent.emulator import EmulatedNvml, EmulatorControl
from nodeagent.emulator.cli import main

REPO = Path(__file__).resolve().parents[2]
REAL = REPO / "tests" / "data" / "h200-141gb"
SCRIPT = Path(sys.executable).parent / "instaslice-emu"


def script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPT), *args], capture_output=True, text=True, timeout=60, check=False
    )


def lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.splitlines()]


@pytest.mark.parametrize("cmd", ["lgip", "lgipp"])
def test_console_script_prints_the_real_h200_dump(cmd: str) -> None:
    done = script(cmd, "--model", "H200-141GB")
    assert done.returncode == 0, done.stderr
    real = (REAL / f"{cmd}.txt").read_text()
    assert lines(done.stdout) == lines(real)
    assert done.stdout == real  # byte for byte, trailing spaces and newline included


@pytest.mark.parametrize("cmd", ["lgip", "lgipp"])
def test_main_in_process_prints_the_real_h200_dump(
    cmd: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([cmd, "--model", "H200-141GB"]) == 0
    assert capsys.readouterr().out == (REAL / f"{cmd}.txt").read_text()


@pytest.mark.parametrize("model", load_catalog().models, ids=lambda m: m.name)
def test_every_model_renders(model: GpuModel, capsys: pytest.CaptureFixture[str]) -> None:
    name = model.name
    assert main(["lgip", "--model", name]) == 0
    table = capsys.readouterr().out.splitlines()
    assert {len(line) for line in table} == {81}
    assert len(table) == 5 + 3 * len(model.profiles)
    assert main(["lgipp", "--model", name]) == 0
    placements = capsys.readouterr().out.splitlines()
    assert all(line.startswith("GPU  0 Profile ID ") for line in placements)
    assert len(placements) == len(model.profiles)


def test_lgi_lists_gpu_instances(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = str(tmp_path)
    assert main(["provision", "--state", state, "--node", "w1", "--model", "H200-141GB"]) == 0
    # the same spec again keeps the node (another model would provision it anew)
    assert main(["provision", "--state", state, "--node", "w1", "--model", "H200-141GB"]) == 0
    assert main(["lgi", "--state", state, "--node", "w1"]) == 0
    assert capsys.readouterr().out == ""
    nv = EmulatedNvml(tmp_path, "w1")
    nv.nvmlInit()
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    for pid, start, size in ((19, 6, 1), (9, 0, 4), (15, 4, 2)):
        gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(
            dev, pid, pynvml.c_nvmlGpuInstancePlacement_t(start, size)
        )
        nv.nvmlGpuInstanceCreateComputeInstance(gi, 0)
    assert main(["lgi", "--state", state, "--node", "w1"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "0 3g.71gb 9 1 0:4",
        "0 1g.35gb 15 5 4:2",
        "0 1g.18gb 19 13 6:1",
    ]
    done = script("lgi", "--state", state, "--node", "w1")
    assert done.returncode == 0 and done.stdout.splitlines()[0] == "0 3g.71gb 9 1 0:4"
    assert main(["lgip", "--state", state, "--node", "w1"]) == 0
    free = [ln for ln in capsys.readouterr().out.splitlines() if "MIG 1g.18gb " in ln]
    assert free and " 0/7 " in free[0]  # slots 4-7 taken: nothing left for 1g (slot 7 is no 1g)


def test_node_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = str(tmp_path)
    node = ["--state", state, "--node", "w2"]
    args = ["provision", *node, "--model", "A100-40GB", "--gpus", "2", "--mig-mode", "disabled"]
    assert main(args) == 0
    nv = EmulatedNvml(tmp_path, "w2")
    nv.nvmlInit()
    assert nv.nvmlDeviceGetCount() == 2
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceGetMigMode(dev) == [0, 0]
    nv.nvmlDeviceSetMigMode(dev, 1)
    assert main(["reset-gpu", *node, "--gpu", "0"]) == 0
    assert nv.nvmlDeviceGetMigMode(dev) == [1, 1]

    assert main(["latency", *node, "--create-ms", "5", "--destroy-ms", "7"]) == 0
    settings = EmulatorControl(tmp_path, "w2").state().settings
    assert (settings.create_ms, settings.destroy_ms) == (5, 7)

    assert main(["fail-next", *node, "--op", "create_gi", "--code", "23"]) == 0
    place = pynvml.c_nvmlGpuInstancePlacement_t(0, 1)
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        nv.nvmlDeviceCreateGpuInstanceWithPlacement(dev, 19, place)
    gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(dev, 19, place)
    nv.nvmlGpuInstanceCreateComputeInstance(gi, 0)

    mig = EmulatorControl(tmp_path, "w2").instances()[0].mig_uuid
    assert mig is not None
    capsys.readouterr()
    assert main(["add-process", *node, "--uuid", mig]) == 0
    pid = int(capsys.readouterr().out)
    assert [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(dev)] == [pid]
    assert main(["remove-process", *node, "--uuid", mig, "--pid", str(pid)]) == 0
    assert nv.nvmlDeviceGetComputeRunningProcesses(dev) == []

    events = nv.nvmlEventSetCreate()
    nv.nvmlDeviceRegisterEvents(dev, pynvml.nvmlEventTypeXidCriticalError, events)
    assert main(["xid", *node, "--gpu", "0", "--xid", "48"]) == 0
    assert nv.nvmlEventSetWait(events, 1000).eventData == 48
    assert main(["gpu-lost", *node, "--gpu", "0"]) == 0
    assert nv.nvmlEventSetWait(events, 1000).eventData == 79
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nv.nvmlDeviceGetUUID(dev)

    boot = EmulatorControl(tmp_path, "w2").boot_id()
    capsys.readouterr()
    assert main(["reboot", *node]) == 0
    new_boot = capsys.readouterr().out.strip()
    assert new_boot != boot and new_boot == EmulatorControl(tmp_path, "w2").boot_id()
    assert nv.nvmlDeviceGetMigMode(dev) == [1, 1]
    assert main(["lgi", *node]) == 0 and capsys.readouterr().out == ""


def test_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lgip", "--model", "H300"]) == 1
    assert "unknown model" in capsys.readouterr().err
    assert main(["lgip"]) == 1  # neither --model nor a node
    assert main(["lgi", "--state", str(tmp_path), "--node", "ghost"]) == 1
    assert "not provisioned" in capsys.readouterr().err
    assert main(["provision", "--state", str(tmp_path), "--node", "x", "--model", "B300"]) == 1
    with pytest.raises(SystemExit) as usage:
        main(["fail-next", "--state", str(tmp_path), "--node", "x", "--op", "boom", "--code", "1"])
    assert usage.value.code == 2
    done = script("gpu-lost", "--state", str(tmp_path), "--node", "ghost", "--gpu", "0")
    assert done.returncode == 1 and "instaslice-emu:" in done.stderr
