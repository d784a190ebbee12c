"""The NVML emulator through its pynvml-shaped facade and its controls.

Covers: every placement of every profile of every model creates (with its default CI) and
reports the right GI info; invalid starts and sizes, overlaps, instance counts, `+me` once,
engine exhaustion (`+me.all`), MIG off; MIG-mode semantics per architecture; destroy order
and IN_USE with processes; the MIG-handle walk, parent device in CI info, fresh UUIDs on
re-create; stale handles; CI profiles; persistence and concurrency across processes; reboot;
latency and injected failures; a lost GPU and XID events through the event-set API; return
shapes and pass-through of pynvml's names. Leaves out: random operation sequences (the
property tests), the CLI (test_emu_cli.py), timing of real hardware.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pynvml
import pytest

from common.catalog import GpuModel, load_catalog
from nodeagent.emulator import EmulatedNvml, EmulatorControl, EmulatorError, provision, rules
from nodeagent.emulator import state as st
from testkit.clock import FakeClock

CATALOG = load_catalog()
REPO = Path(__file__).resolve().parents[2]
E = pynvml


def make(
    tmp: Path, models: list[str], mig: str = "enabled", node: str = "n0", **kw: Any
) -> tuple[EmulatedNvml, EmulatorControl]:
    provision(tmp, node, models, mig)  # type: ignore[arg-type]
    nv = EmulatedNvml(tmp, node, **kw)
    nv.nvmlInit()
    return nv, EmulatorControl(tmp, node)


def at(start: int, size: int) -> Any:
    return pynvml.c_nvmlGpuInstancePlacement_t(start, size)


def addr(handle: Any) -> int:
    return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)


def gi_at(nv: EmulatedNvml, dev: Any, profile_id: int, start: int, size: int) -> Any:
    return nv.nvmlDeviceCreateGpuInstanceWithPlacement(dev, profile_id, at(start, size))


def with_ci(nv: EmulatedNvml, gi: Any, ci_enum: int = 0) -> Any:
    info = nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, ci_enum, 0)
    return nv.nvmlGpuInstanceCreateComputeInstance(gi, info.id)


def mig_uuid_of(nv: EmulatedNvml, dev: Any, gi_id: int, ci_id: int) -> str:
    """The recommended walk (docs/mig-facts.md §3.2)."""
    for i in range(nv.nvmlDeviceGetMaxMigDeviceCount(dev)):
        try:
            m = nv.nvmlDeviceGetMigDeviceHandleByIndex(dev, i)
        except pynvml.NVMLError_NotFound:
            continue
        if (nv.nvmlDeviceGetGpuInstanceId(m), nv.nvmlDeviceGetComputeInstanceId(m)) == (
            gi_id,
            ci_id,
        ):
            return str(nv.nvmlDeviceGetUUID(m))
    raise AssertionError(f"no MIG device for GI {gi_id} CI {ci_id}")


# ---- every placement -----------------------------------------------------------------------


@pytest.mark.parametrize("model", CATALOG.models, ids=lambda m: m.name)
def test_every_placement_of_every_profile_creates(tmp_path: Path, model: GpuModel) -> None:
    nv, ctl = make(tmp_path, [model.name])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    for p in model.profiles:
        info = nv.nvmlDeviceGetGpuInstanceProfileInfo(dev, p.enum)
        assert (info.id, info.name) == (p.id, f"MIG {p.name}")
        for start in p.starts:
            gi = gi_at(nv, dev, info.id, start, p.size)
            gi_info = nv.nvmlGpuInstanceGetInfo(gi)
            assert (gi_info.profileId, gi_info.placement.start) == (p.id, start)
            assert gi_info.placement.size == p.size
            assert addr(gi_info.device) == addr(dev)
            assert gi_info.id == rules.tree_gi_id(model.memory_slots, start, p.size)
            ci = with_ci(nv, gi, p.default_ci)
            ci_info = nv.nvmlComputeInstanceGetInfo(ci)
            assert ci_info.profileId == p.default_ci
            uuid = mig_uuid_of(nv, dev, gi_info.id, ci_info.id)
            assert uuid.startswith("MIG-")
            assert ctl.instances() == [
                (0, p.name, p.id, gi_info.id, start, p.size, ci_info.id, uuid)
            ]
            nv.nvmlComputeInstanceDestroy(ci)
            nv.nvmlGpuInstanceDestroy(gi)
    assert ctl.instances() == []


def test_gi_ids_follow_the_observed_tree(tmp_path: Path) -> None:
    """1g at 6 → 13, 2g at 4:2 → 5, 2g at 2:2 → 4 (docs/mig-facts.md §2.12); A30 and RTX PRO too."""
    nv, _ = make(tmp_path, ["H200-141GB", "A30-24GB", "RTX-PRO-6000"])
    h200, a30, rtx = (nv.nvmlDeviceGetHandleByIndex(i) for i in range(3))
    assert nv.nvmlGpuInstanceGetInfo(gi_at(nv, h200, 19, 6, 1)).id == 13
    assert nv.nvmlGpuInstanceGetInfo(gi_at(nv, h200, 14, 4, 2)).id == 5
    assert nv.nvmlGpuInstanceGetInfo(gi_at(nv, h200, 14, 2, 2)).id == 4
    assert [nv.nvmlGpuInstanceGetInfo(gi_at(nv, a30, 14, s, 1)).id for s in (0, 1)] == [3, 4]
    assert nv.nvmlGpuInstanceGetInfo(gi_at(nv, a30, 5, 2, 2)).id == 2
    assert nv.nvmlGpuInstanceGetInfo(gi_at(nv, rtx, 5, 0, 6)).id == 1
    assert [nv.nvmlGpuInstanceGetInfo(gi_at(nv, rtx, 14, s, 3)).id for s in (6, 9)] == [5, 6]


def test_default_placement_like_the_driver(tmp_path: Path) -> None:
    """7x 1g fill 6,4,5,0,1,2,3; the user guide's `-cgi 19,19,14,9` trap and its fix."""
    nv, _ = make(tmp_path, ["H100-80GB", "A100-40GB", "A100-40GB"])
    dev, a, b = (nv.nvmlDeviceGetHandleByIndex(i) for i in range(3))
    starts = [nv.nvmlGpuInstanceGetInfo(nv.nvmlDeviceCreateGpuInstance(dev, 19)) for _ in range(7)]
    assert [(i.placement.start, i.id) for i in starts] == [
        (6, 13),
        (4, 11),
        (5, 12),
        (0, 7),
        (1, 8),
        (2, 9),
        (3, 10),
    ]
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        nv.nvmlDeviceCreateGpuInstance(dev, 19)
    got = [nv.nvmlGpuInstanceGetInfo(nv.nvmlDeviceCreateGpuInstance(a, p)) for p in (19, 19, 14)]
    assert [(i.placement.start, i.id) for i in got] == [(6, 13), (4, 11), (0, 3)]
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        nv.nvmlDeviceCreateGpuInstance(a, 9)
    got = [nv.nvmlGpuInstanceGetInfo(nv.nvmlDeviceCreateGpuInstance(b, p)) for p in (9, 19, 14, 19)]
    assert [i.placement.start for i in got] == [4, 0, 2, 1]


# ---- creation rules ------------------------------------------------------------------------


@pytest.mark.parametrize("model", CATALOG.models, ids=lambda m: m.name)
def test_invalid_starts_and_sizes(tmp_path: Path, model: GpuModel) -> None:
    nv, ctl = make(tmp_path, [model.name])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    for p in model.profiles:
        for start in range(model.memory_slots + 1):
            if start not in p.starts:
                with pytest.raises(pynvml.NVMLError_InvalidArgument):
                    gi_at(nv, dev, p.id, start, p.size)
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            gi_at(nv, dev, p.id, p.starts[0], p.size + 1)
    for bad_id in (1, 99, -1):
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            gi_at(nv, dev, bad_id, 0, 1)
    assert ctl.instances() == []


def test_overlap_and_occupied_spot_are_insufficient_resources(tmp_path: Path) -> None:
    nv, ctl = make(tmp_path, ["H200-141GB"])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    gi_at(nv, dev, 5, 0, 4)  # 4g at 0..3
    for pid, start, size in ((19, 2, 1), (15, 2, 2), (9, 0, 4), (0, 0, 8), (14, 0, 2)):
        with pytest.raises(pynvml.NVMLError_InsufficientResources):
            gi_at(nv, dev, pid, start, size)
    gi_at(nv, dev, 19, 6, 1)
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        gi_at(nv, dev, 19, 6, 1)  # the same spot again: not ALREADY_EXISTS
    assert len(ctl.instances()) == 2
    assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(dev, 9) == 0  # 3g at 4 overlaps slot 6
    assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(dev, 19) == 2  # 4 and 5


def test_me_only_once_per_gpu(tmp_path: Path) -> None:
    nv, _ = make(tmp_path, ["H200-141GB", "A30-24GB"])
    h200, a30 = nv.nvmlDeviceGetHandleByIndex(0), nv.nvmlDeviceGetHandleByIndex(1)
    gi_at(nv, h200, 20, 0, 1)
    assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(h200, 20) == 0
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        gi_at(nv, h200, 20, 3, 1)  # count over max (1) although slot 3 is free
    gi_at(nv, h200, 19, 3, 1)
    gi_at(nv, a30, 21, 0, 1)  # 1g.6gb+me takes the A30's only JPEG and OFA
    assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(a30, 6) == 0
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        gi_at(nv, a30, 6, 2, 2)  # 2g.12gb+me: engines exhausted
    gi_at(nv, a30, 5, 2, 2)  # a plain 2g still fits


def test_me_all_leaves_room_only_for_no_me(tmp_path: Path) -> None:
    nv, _ = make(tmp_path, ["RTX-PRO-6000", "RTX-PRO-6000"])
    dev, other = nv.nvmlDeviceGetHandleByIndex(0), nv.nvmlDeviceGetHandleByIndex(1)
    gi_at(nv, dev, 65, 0, 3)  # 1g.24gb+me.all
    for pid in (14, 21, 47, 65):  # plain, +me, +gfx, +me.all again
        assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(dev, pid) == 0
        with pytest.raises(pynvml.NVMLError_InsufficientResources):
            gi_at(nv, dev, pid, 3, 3)
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        gi_at(nv, dev, 64, 6, 6)  # 2g.48gb+me.all
    assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(dev, 67) == 3
    gi_at(nv, dev, 67, 3, 3)  # 1g.24gb-me
    gi_at(nv, dev, 66, 6, 6)  # 2g.48gb-me
    gi_at(nv, other, 14, 9, 3)  # the other way round: a plain 1g blocks +me.all
    assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(other, 65) == 0
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        gi_at(nv, other, 65, 0, 3)


def test_mig_disabled(tmp_path: Path) -> None:
    nv, ctl = make(tmp_path, ["H200-141GB"], mig="disabled")
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceGetMigMode(dev) == [0, 0]
    assert nv.nvmlDeviceGetMaxMigDeviceCount(dev) == 0
    # Like driver 580 on the real H200: profile info, placements and capacity still answer.
    remaining = [
        nv.nvmlDeviceGetGpuInstanceRemainingCapacity(dev, p.id)
        for p in CATALOG.model("H200-141GB").profiles  # type: ignore[union-attr]
    ]
    assert remaining == [7, 1, 4, 3, 2, 1, 1]
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceCreateGpuInstance(dev, 19)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        gi_at(nv, dev, 19, 0, 1)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceGetGpuInstances(dev, 19, (pynvml.c_nvmlGpuInstance_t * 7)(), ctypes.c_uint())
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceGetGpuInstanceById(dev, 7)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceGetMigDeviceHandleByIndex(dev, 0)
    ctl.set_capacity_without_mig(False)  # what nvml.h documents instead
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceGetGpuInstanceRemainingCapacity(dev, 19)


def test_profile_info_enums_like_the_h200(tmp_path: Path) -> None:
    nv, _ = make(tmp_path, ["H200-141GB"], mig="disabled")
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    real = json.loads((REPO / "tests/data/h200-141gb/nvml.json").read_text())
    for entry in real["devices"][0]["gi_profiles"]:
        enum = entry["profile"]
        if "info_err" in entry:
            cls = getattr(pynvml, entry["info_err"].split("(")[0])
            with pytest.raises(cls):
                nv.nvmlDeviceGetGpuInstanceProfileInfo(dev, enum)
            continue
        info = nv.nvmlDeviceGetGpuInstanceProfileInfo(dev, enum)
        for field in ("id", "isP2pSupported", "sliceCount", "instanceCount", "memorySizeMB"):
            assert getattr(info, field) == entry[field], field
        for field in ("multiprocessorCount", "copyEngineCount", "decoderCount", "encoderCount"):
            assert getattr(info, field) == entry[field], field
        assert (info.jpegCount, info.ofaCount, info.name) == (
            entry["jpegCount"],
            entry["ofaCount"],
            entry["name"],
        )
        assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(dev, info.id) == entry["remaining"]
        v1 = nv.nvmlDeviceGetGpuInstanceProfileInfo(dev, enum, 1)
        assert isinstance(v1, pynvml.c_nvmlGpuInstanceProfileInfo_t) and v1.id == info.id
        assert nv.nvmlDeviceGetGpuInstanceProfileInfoById(dev, info.id).name == entry["name"]
    for enum in (18, 99):
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            nv.nvmlDeviceGetGpuInstanceProfileInfo(dev, enum)


# ---- MIG mode ------------------------------------------------------------------------------


def test_ampere_mig_mode_is_pending_until_reset(tmp_path: Path) -> None:
    nv, ctl = make(tmp_path, ["A100-40GB"], mig="disabled")
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceSetMigMode(dev, 1) == pynvml.NVML_ERROR_RESET_REQUIRED
    assert nv.nvmlDeviceGetMigMode(dev) == [0, 1]
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceCreateGpuInstance(dev, 19)
    pid = ctl.add_process(nv.nvmlDeviceGetUUID(dev))
    with pytest.raises(EmulatorError, match="processes"):
        ctl.reset_gpu(0)  # a client holds the GPU: the reset is refused
    ctl.remove_process(nv.nvmlDeviceGetUUID(dev), pid)
    ctl.reset_gpu(0)
    assert nv.nvmlDeviceGetMigMode(dev) == [1, 1]
    gi = gi_at(nv, dev, 9, 4, 4)
    with_ci(nv, gi, 2)
    assert nv.nvmlDeviceSetMigMode(dev, 0) == pynvml.NVML_ERROR_RESET_REQUIRED
    assert nv.nvmlDeviceGetMigMode(dev) == [1, 0]
    assert len(ctl.instances()) == 1  # still there until the reset
    assert nv.nvmlDeviceSetMigMode(dev, 1) == pynvml.NVML_SUCCESS  # back to current: nothing
    assert nv.nvmlDeviceGetMigMode(dev) == [1, 1]
    nv.nvmlDeviceSetMigMode(dev, 0)
    ctl.reset_gpu(0)
    assert nv.nvmlDeviceGetMigMode(dev) == [0, 0] and ctl.instances() == []
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlGpuInstanceGetInfo(gi)


def test_hopper_mig_mode_is_immediate_unless_in_use(tmp_path: Path) -> None:
    nv, ctl = make(tmp_path, ["H200-141GB"], mig="disabled")
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    gpu_uuid = nv.nvmlDeviceGetUUID(dev)
    pid = ctl.add_process(gpu_uuid)
    with pytest.raises(pynvml.NVMLError_InUse):
        nv.nvmlDeviceSetMigMode(dev, 1)
    assert nv.nvmlDeviceGetMigMode(dev) == [0, 0]
    ctl.remove_process(gpu_uuid, pid)
    assert nv.nvmlDeviceSetMigMode(dev, 1) == pynvml.NVML_SUCCESS
    assert nv.nvmlDeviceGetMigMode(dev) == [1, 1]
    assert nv.nvmlDeviceGetMaxMigDeviceCount(dev) == 7
    gi = gi_at(nv, dev, 14, 0, 2)
    ci = with_ci(nv, gi, 1)
    mig = mig_uuid_of(nv, dev, nv.nvmlGpuInstanceGetInfo(gi).id, 0)
    ctl.add_process(mig)
    with pytest.raises(pynvml.NVMLError_InUse):
        nv.nvmlDeviceSetMigMode(dev, 0)
    ctl.remove_process(mig)
    with pytest.raises(pynvml.NVMLError_InUse):  # GPU instances exist [INF]
        nv.nvmlDeviceSetMigMode(dev, 0)
    ctl.set_disable_with_instances("destroy")
    assert nv.nvmlDeviceSetMigMode(dev, 0) == pynvml.NVML_SUCCESS  # destroys every GI/CI
    assert nv.nvmlDeviceGetMigMode(dev) == [0, 0] and ctl.instances() == []
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlGpuInstanceGetInfo(gi)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlComputeInstanceGetInfo(ci)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlDeviceSetMigMode(dev, 2)


def test_clients_of_the_whole_gpu_block_creation(tmp_path: Path) -> None:
    """`nvidia-smi mig -cgi` while nsys held /dev/nvidia0: "In use by another client"."""
    nv, ctl = make(tmp_path, ["H100-96GB"])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    ctl.add_process(nv.nvmlDeviceGetUUID(dev))
    with pytest.raises(pynvml.NVMLError_InUse):
        gi_at(nv, dev, 19, 0, 1)
    ctl.remove_process(nv.nvmlDeviceGetUUID(dev))
    gi_at(nv, dev, 19, 0, 1)


# ---- destroy, processes, MIG handles -------------------------------------------------------


def test_destroy_order_and_processes(tmp_path: Path) -> None:
    nv, ctl = make(tmp_path, ["H200-141GB"])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    gi = gi_at(nv, dev, 9, 0, 4)
    ci = with_ci(nv, gi, 2)
    with pytest.raises(pynvml.NVMLError_InUse):
        nv.nvmlGpuInstanceDestroy(gi)  # CI first
    uuid = ctl.instances()[0].mig_uuid
    assert uuid is not None
    p1, p2 = ctl.add_process(uuid), ctl.add_process(uuid)
    procs = nv.nvmlDeviceGetComputeRunningProcesses(dev)
    assert [(p.pid, p.gpuInstanceId, p.computeInstanceId) for p in procs] == [
        (p1, 1, 0),
        (p2, 1, 0),
    ]
    mig = nv.nvmlDeviceGetHandleByUUID(uuid)
    assert [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(mig)] == [p1, p2]
    assert nv.nvmlDeviceGetMemoryInfo(mig).used == 2 * (512 << 20)
    with pytest.raises(pynvml.NVMLError_InUse):
        nv.nvmlComputeInstanceDestroy(ci)
    ctl.remove_process(uuid, p1)
    with pytest.raises(pynvml.NVMLError_InUse):
        nv.nvmlComputeInstanceDestroy(ci)
    ctl.remove_process(uuid)
    assert nv.nvmlDeviceGetComputeRunningProcesses(dev) == []
    assert nv.nvmlComputeInstanceDestroy(ci) == pynvml.NVML_SUCCESS
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlComputeInstanceDestroy(ci)  # a destroyed CI's handle is stale
    with pytest.raises(pynvml.NVMLError_NotFound):
        nv.nvmlGpuInstanceGetComputeInstanceById(gi, 0)
    assert nv.nvmlGpuInstanceDestroy(gi) == pynvml.NVML_SUCCESS
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlGpuInstanceDestroy(gi)
    with pytest.raises(pynvml.NVMLError_NotFound):
        nv.nvmlDeviceGetGpuInstanceById(dev, 1)
    with pytest.raises(EmulatorError):
        ctl.add_process(uuid)  # the MIG device is gone


def test_mig_handle_walk_and_parent_device(tmp_path: Path) -> None:
    nv, _ = make(tmp_path, ["H200-141GB", "H200-141GB"])
    dev = nv.nvmlDeviceGetHandleByIndex(1)
    found = {}
    for pid, start, size, ci_enum in ((19, 6, 1, 0), (15, 0, 2, 7), (14, 2, 2, 1)):
        gi = gi_at(nv, dev, pid, start, size)
        ci = with_ci(nv, gi, ci_enum)
        ci_info = nv.nvmlComputeInstanceGetInfo(ci)
        assert addr(ci_info.device) == addr(dev)  # the PARENT, never the MIG device
        assert addr(ci_info.gpuInstance) == addr(gi)
        assert addr(nv.nvmlGpuInstanceGetComputeInstanceById(gi, ci_info.id)) == addr(ci)
        gi_id = nv.nvmlGpuInstanceGetInfo(gi).id
        found[(gi_id, ci_info.id)] = mig_uuid_of(nv, dev, gi_id, ci_info.id)
    uuids = set(found.values())
    assert len(uuids) == 3
    assert nv.nvmlDeviceGetUUID(dev) not in uuids
    for (gi_id, ci_id), uuid in found.items():
        mig = nv.nvmlDeviceGetHandleByUUID(uuid)
        assert nv.nvmlDeviceIsMigDeviceHandle(mig).value == 1
        assert (nv.nvmlDeviceGetGpuInstanceId(mig), nv.nvmlDeviceGetComputeInstanceId(mig)) == (
            gi_id,
            ci_id,
        )
        assert addr(nv.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)) == addr(dev)
    assert nv.nvmlDeviceIsMigDeviceHandle(dev).value == 0
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceGetGpuInstanceId(dev)
    names = {nv.nvmlDeviceGetName(nv.nvmlDeviceGetHandleByUUID(u)) for u in uuids}
    assert names == {f"NVIDIA H200 MIG {n}" for n in ("1g.18gb", "1g.35gb", "2g.35gb")}
    free = [i for i in range(7) if i >= 3]
    for i in free:
        with pytest.raises(pynvml.NVMLError_NotFound):
            nv.nvmlDeviceGetMigDeviceHandleByIndex(dev, i)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetMigDeviceHandleByIndex(dev, 7)
    with pytest.raises(pynvml.NVMLError_NotFound):
        nv.nvmlDeviceGetHandleByUUID("MIG-00000000-0000-0000-0000-000000000000")


def test_recreated_slice_gets_a_new_uuid_and_old_handles_go_stale(tmp_path: Path) -> None:
    nv, _ = make(tmp_path, ["H100-80GB"])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    seen = []
    handles = []
    for _ in range(3):
        gi = gi_at(nv, dev, 19, 3, 1)
        ci = with_ci(nv, gi)
        info = nv.nvmlGpuInstanceGetInfo(gi)
        assert info.id == 10
        seen.append(mig_uuid_of(nv, dev, info.id, 0))
        handles.append((gi, ci, nv.nvmlDeviceGetHandleByUUID(seen[-1])))
        nv.nvmlComputeInstanceDestroy(ci)
        nv.nvmlGpuInstanceDestroy(gi)
    assert len(set(seen)) == 3
    gi = gi_at(nv, dev, 19, 3, 1)  # same id 10 again; the old handles still refer to the past
    with_ci(nv, gi)
    for old_gi, old_ci, old_mig in handles:
        for call, handle in (
            (nv.nvmlGpuInstanceGetInfo, old_gi),
            (nv.nvmlComputeInstanceGetInfo, old_ci),
            (nv.nvmlDeviceGetUUID, old_mig),
        ):
            with pytest.raises(pynvml.NVMLError_InvalidArgument):
                call(handle)


def test_compute_instance_profiles(tmp_path: Path) -> None:
    nv, _ = make(tmp_path, ["H200-141GB"])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    g3 = gi_at(nv, dev, 9, 0, 4)
    infos = {e: nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(g3, e, 0) for e in (0, 1, 2)}
    assert {
        e: (i.sliceCount, i.instanceCount, i.multiprocessorCount) for e, i in infos.items()
    } == {
        0: (1, 3, 20),
        1: (2, 1, 40),
        2: (3, 1, 60),
    }
    assert infos[0].name == "MIG 1c.3g.71gb" and infos[2].name == "MIG 3g.71gb"
    assert infos[2].sharedDecoderCount == 3
    for enum in (3, 4, 7):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(g3, enum, 0)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(g3, 9, 0)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(g3, 0, 1)
    # Three 1c CIs share the 3g; then nothing else fits.
    cis = [nv.nvmlGpuInstanceCreateComputeInstance(g3, 0) for _ in range(3)]
    assert [nv.nvmlComputeInstanceGetInfo(c).placement.start for c in cis] == [0, 1, 2]
    assert nv.nvmlGpuInstanceGetComputeInstanceRemainingCapacity(g3, 1) == 0
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        nv.nvmlGpuInstanceCreateComputeInstance(g3, 1)
    count = ctypes.c_uint()
    arr = (pynvml.c_nvmlComputeInstance_t * 3)()
    nv.nvmlGpuInstanceGetComputeInstances(g3, 0, arr, ctypes.byref(count))
    assert count.value == 3 and [addr(arr[i]) for i in range(3)] == [addr(c) for c in cis]
    assert nv.nvmlDeviceGetMaxMigDeviceCount(dev) == 7
    # Hopper 1g with double memory: default CI 7 (26 SMs); the plain 1-slice CI has 16.
    g = gi_at(nv, dev, 15, 4, 2)
    rev1 = nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(g, 7, 0)
    plain = nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(g, 0, 0)
    assert (rev1.id, rev1.multiprocessorCount, plain.multiprocessorCount) == (7, 26, 16)
    nv.nvmlGpuInstanceCreateComputeInstance(g, 7)
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        nv.nvmlGpuInstanceCreateComputeInstance(g, 0)  # its one slice is taken
    g7 = gi_at(nv, nv.nvmlDeviceGetHandleByIndex(0), 19, 6, 1)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(g7, 7, 0)  # plain 1g: no REV1 CI
    ci = nv.nvmlGpuInstanceCreateComputeInstanceWithPlacement(
        g7, 0, pynvml.c_nvmlComputeInstancePlacement_t(0, 1)
    )
    assert nv.nvmlComputeInstanceGetInfo(ci).placement.size == 1


def test_go_nvlib_ci_rule_on_full_gpu(tmp_path: Path) -> None:
    nv, _ = make(tmp_path, ["A100-80GB"])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    g4 = gi_at(nv, dev, 5, 0, 4)
    ok = [e for e in range(9) if _has_ci(nv, g4, e)]
    assert ok == [0, 1, 3]  # 1c, 2c, 4g: no 3c in a 4g GI
    nv.nvmlGpuInstanceDestroy(g4)
    g7 = gi_at(nv, dev, 0, 0, 8)
    assert [e for e in range(9) if _has_ci(nv, g7, e)] == [0, 1, 2, 3, 4]
    sms = [
        nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(g7, e, 0).multiprocessorCount
        for e in (0, 1, 2, 4)
    ]
    assert sms == [14, 28, 42, 98]


def _has_ci(nv: EmulatedNvml, gi: Any, enum: int) -> bool:
    try:
        nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, enum, 0)
    except pynvml.NVMLError_NotSupported:
        return False
    return True


# ---- return shapes and names ---------------------------------------------------------------


def test_pynvml_shapes_and_names(tmp_path: Path) -> None:
    nv, _ = make(tmp_path, ["H200-141GB", "A30-24GB"])
    assert nv.NVMLError is pynvml.NVMLError
    assert nv.NVMLError_InsufficientResources is pynvml.NVMLError_InsufficientResources
    assert nv.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2 == 9 and nv.NVML_DEVICE_ARCH_HOPPER == 9
    assert nv.nvmlEventTypeXidCriticalError == pynvml.nvmlEventTypeXidCriticalError
    assert nv.c_nvmlGpuInstancePlacement_t is pynvml.c_nvmlGpuInstancePlacement_t
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        nv.nvmlDeviceGetPowerUsage(None)  # not emulated: like a driver without the symbol
    with pytest.raises(AttributeError):
        nv.nvmlNoSuchThing  # noqa: B018
    assert nv.nvmlSystemGetDriverVersion() == "580.159.04"
    assert nv.nvmlDeviceGetCount() == 2
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    assert isinstance(dev, pynvml.c_nvmlDevice_t)
    assert nv.nvmlDeviceGetName(dev) == "NVIDIA H200"
    assert nv.nvmlDeviceGetPciInfo(dev).pciDeviceId == 0x233510DE
    assert nv.nvmlDeviceGetMemoryInfo(dev).total == 143771 << 20
    assert nv.nvmlDeviceGetMemoryInfo(dev, pynvml.nvmlMemory_v2).version == pynvml.nvmlMemory_v2
    assert nv.nvmlDeviceGetArchitecture(dev) == pynvml.NVML_DEVICE_ARCH_HOPPER
    a30 = nv.nvmlDeviceGetHandleByIndex(1)
    assert nv.nvmlDeviceGetArchitecture(a30) == pynvml.NVML_DEVICE_ARCH_AMPERE
    assert (nv.nvmlDeviceGetIndex(a30), nv.nvmlDeviceGetMinorNumber(a30)) == (1, 1)
    assert nv.nvmlDeviceGetMaxMigDeviceCount(a30) == 4
    uuid = nv.nvmlDeviceGetUUID(dev)
    assert uuid.startswith("GPU-") and addr(nv.nvmlDeviceGetHandleByUUID(uuid)) == addr(dev)
    assert addr(nv.nvmlDeviceGetHandleByUUID(uuid.encode())) == addr(dev)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetHandleByIndex(2)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetName(None)
    # PossiblePlacements: NULL array to count, then a ctypes array; byref or pointer counts.
    count = ctypes.c_uint()
    fn = nv.nvmlDeviceGetGpuInstancePossiblePlacements
    assert fn(dev, 15, None, ctypes.byref(count)) == pynvml.NVML_SUCCESS and count.value == 4
    arr = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
    fn(dev, 15, arr, ctypes.pointer(count))
    assert [(p.start, p.size) for p in arr] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    with pytest.raises(pynvml.NVMLError_InsufficientSize):
        fn(dev, 19, (pynvml.c_nvmlGpuInstancePlacement_t * 2)(), ctypes.byref(count))
    # GetGpuInstances fills a caller's array of c_nvmlGpuInstance_t.
    created = [gi_at(nv, dev, 19, s, 1) for s in (5, 1)]
    gis = (pynvml.c_nvmlGpuInstance_t * 7)()
    nv.nvmlDeviceGetGpuInstances(dev, 19, gis, ctypes.byref(count))
    assert count.value == 2
    assert {nv.nvmlGpuInstanceGetInfo(gis[i]).placement.start for i in range(2)} == {1, 5}
    assert {addr(gis[i]) for i in range(2)} == {addr(g) for g in created}
    gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(dev, 19, ctypes.byref(at(3, 1)))
    assert nv.nvmlGpuInstanceGetInfo(gi).placement.start == 3
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlDeviceCreateGpuInstanceWithPlacement(dev, 19, (3, 1))


def test_handles_belong_to_their_node(tmp_path: Path) -> None:
    """One agent process may serve many emulated nodes: a handle of one is not another's."""
    a, _ = make(tmp_path, ["H200-141GB"], node="a")
    b, _ = make(tmp_path, ["H200-141GB"], node="b")
    dev_a, dev_b = a.nvmlDeviceGetHandleByIndex(0), b.nvmlDeviceGetHandleByIndex(0)
    assert a.nvmlDeviceGetUUID(dev_a) != b.nvmlDeviceGetUUID(dev_b)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        b.nvmlDeviceGetUUID(dev_a)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        b.nvmlGpuInstanceGetInfo(gi_at(a, dev_a, 19, 0, 1))


def test_init_and_provision(tmp_path: Path) -> None:
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        EmulatedNvml(tmp_path, "nobody").nvmlInit()
    provision(tmp_path, "a", ["B200-180GB"] * 2)
    nv = EmulatedNvml(tmp_path, "a")
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nv.nvmlDeviceGetCount()
    nv.nvmlInit()
    nv.nvmlInit()
    nv.nvmlShutdown()
    uuids = [nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByIndex(i)) for i in range(2)]
    assert provision(tmp_path, "a", ["B200-180GB"] * 2) == "kept"  # the same spec again
    assert nv.nvmlDeviceGetCount() == 2
    provision(tmp_path / "elsewhere", "a", ["B200-180GB"] * 2)  # same node: same UUIDs
    other = EmulatedNvml(tmp_path / "elsewhere", "a")
    other.nvmlInit()
    assert [other.nvmlDeviceGetUUID(other.nvmlDeviceGetHandleByIndex(i)) for i in (0, 1)] == uuids
    nv.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nv.nvmlShutdown()
    with pytest.raises(EmulatorError, match="unknown GPU model"):
        provision(tmp_path, "b", ["H300"])
    with pytest.raises(ValueError):
        EmulatedNvml(tmp_path, "../escape")
    with pytest.raises(EmulatorError, match="not provisioned"):
        EmulatorControl(tmp_path, "nobody").instances()


def test_state_codes_are_nvml_h_values() -> None:
    for name in ("INVALID_ARGUMENT", "NOT_SUPPORTED", "NOT_FOUND", "IN_USE", "GPU_IS_LOST"):
        assert getattr(st, name) == getattr(pynvml, f"NVML_ERROR_{name}")
    for name in ("INSUFFICIENT_RESOURCES", "RESET_REQUIRED", "TIMEOUT", "UNINITIALIZED"):
        assert getattr(st, name) == getattr(pynvml, f"NVML_ERROR_{name}")
    assert pynvml.nvmlEventTypeXidCriticalError == st.EVENT_XID
    assert rules.CI_PROFILE_COUNT == pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT


# ---- persistence and processes -------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import pynvml
    from nodeagent.emulator import EmulatedNvml
    nv = EmulatedNvml(Path(sys.argv[1]), sys.argv[2])
    nv.nvmlInit()
    ok = 0
    for spec in sys.argv[3:]:
        gpu, pid, start, size = map(int, spec.split(":"))
        dev = nv.nvmlDeviceGetHandleByIndex(gpu)
        try:
            gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(
                dev, pid, pynvml.c_nvmlGpuInstancePlacement_t(start, size))
            nv.nvmlGpuInstanceCreateComputeInstance(gi, 0)
            ok += 1
        except pynvml.NVMLError_InsufficientResources:
            pass
    print(ok)
    """
)


def run_child(tmp: Path, node: str, specs: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp), node, *specs],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )


def test_state_is_shared_between_processes(tmp_path: Path) -> None:
    nv, ctl = make(tmp_path, ["H200-141GB"])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    child = run_child(tmp_path, "n0", ["0:9:4:4"])
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0 and out.strip() == "1"
    gis = (pynvml.c_nvmlGpuInstance_t * 2)()
    count = ctypes.c_uint()
    nv.nvmlDeviceGetGpuInstances(dev, 9, gis, ctypes.byref(count))  # this process sees it
    assert count.value == 1 and nv.nvmlGpuInstanceGetInfo(gis[0]).placement.start == 4
    assert mig_uuid_of(nv, dev, 2, 0) == ctl.instances()[0].mig_uuid
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        gi_at(nv, dev, 9, 4, 4)


def test_concurrent_creates_never_overlap(tmp_path: Path) -> None:
    """Two processes race for every 1g slot (and then every profile): each slot is won once."""
    _, ctl = make(tmp_path, ["H200-141GB", "A30-24GB"])
    everything = [
        (g, p)
        for g, name in enumerate(["H200-141GB", "A30-24GB"])
        for p in CATALOG.model(name).profiles  # type: ignore[union-attr]
    ]
    plain_1g = ("1g.18gb", "1g.6gb")
    small = [f"{g}:{p.id}:{s}:1" for g, p in everything if p.name in plain_1g for s in p.starts]
    mixed = [f"{g}:{p.id}:{s}:{p.size}" for g, p in everything for s in p.starts]
    for specs, expected in ((small, 7 + 4), (mixed, None)):
        children = [run_child(tmp_path, "n0", specs), run_child(tmp_path, "n0", specs[::-1])]
        created = 0
        for child in children:
            out, _ = child.communicate(timeout=120)
            assert child.returncode == 0
            created += int(out)
        state = ctl.state()
        assert created == sum(len(g.gis) for g in state.gpus)
        assert expected is None or created == expected
        for gpu in state.gpus:
            model = gpu.spec
            mask = 0
            for gi in gpu.gis:
                p = model.profile_by_id(gi.profile_id)
                assert p is not None and gi.start in p.starts
                assert not mask & p.mask(gi.start)
                mask |= p.mask(gi.start)
            assert rules.engines_used(gpu, model).fits_within(model.full_engines)
        uuids = [r.mig_uuid for r in ctl.instances()]
        assert len(set(uuids)) == len(uuids) == created
        ctl.reboot(keep_mig_mode=True)


def test_reboot_clears_instances_and_changes_boot_id(tmp_path: Path) -> None:
    nv, ctl = make(tmp_path, ["A100-80GB", "H200-141GB"])
    a100, h200 = nv.nvmlDeviceGetHandleByIndex(0), nv.nvmlDeviceGetHandleByIndex(1)
    for dev in (a100, h200):
        with_ci(nv, gi_at(nv, dev, 19, 0, 1))
    nv.nvmlDeviceSetMigMode(a100, 0)  # pending on Ampere
    uuids = [nv.nvmlDeviceGetUUID(d) for d in (a100, h200)]
    boot = ctl.boot_id()
    ctl.add_process(uuids[1])
    new_boot = ctl.reboot()
    assert new_boot == ctl.boot_id() != boot
    assert ctl.instances() == []
    assert nv.nvmlDeviceGetComputeRunningProcesses(h200) == []
    assert nv.nvmlDeviceGetMigMode(a100) == [0, 0]  # the reboot applied the pending mode
    assert nv.nvmlDeviceGetMigMode(h200) == [0, 0]  # Hopper comes back with MIG off [INF]
    assert [nv.nvmlDeviceGetUUID(d) for d in (a100, h200)] == uuids
    nv.nvmlDeviceSetMigMode(h200, 1)
    ctl.reboot(keep_mig_mode=True)
    assert nv.nvmlDeviceGetMigMode(h200) == [1, 1]
    ctl.reboot(keep_mig_mode=False)
    assert nv.nvmlDeviceGetMigMode(h200) == [0, 0]


# ---- latency and injected failures ---------------------------------------------------------


def test_latency_is_slept_before_creates_and_destroys(tmp_path: Path) -> None:
    slept: list[float] = []
    nv, ctl = make(tmp_path, ["H200-141GB"], sleep=slept.append)
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    gi = gi_at(nv, dev, 19, 0, 1)
    assert slept == []
    ctl.set_latency(create_ms=250, destroy_ms=40)
    ci = with_ci(nv, gi)
    nv.nvmlComputeInstanceDestroy(ci)
    nv.nvmlGpuInstanceDestroy(gi)
    nv.nvmlDeviceGetGpuInstanceRemainingCapacity(dev, 19)  # queries are not delayed
    assert slept == [0.25, 0.04, 0.04]
    ctl.set_latency(create_ms=0)
    gi_at(nv, dev, 19, 0, 1)
    assert slept == [0.25, 0.04, 0.04]


def test_real_latency(tmp_path: Path) -> None:
    import time

    nv, ctl = make(tmp_path, ["H200-141GB"])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    ctl.set_latency(create_ms=60)
    t0 = time.monotonic()
    gi_at(nv, dev, 19, 0, 1)
    assert time.monotonic() - t0 >= 0.06


def test_fail_next(tmp_path: Path) -> None:
    nv, ctl = make(tmp_path, ["H200-141GB"])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    ctl.fail_next("create_gi", pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        gi_at(nv, dev, 19, 0, 1)
    assert ctl.instances() == []
    gi = gi_at(nv, dev, 19, 0, 1)  # only the next one failed
    ctl.fail_next("create_ci", pynvml.NVML_ERROR_UNKNOWN, count=2, skip=1)
    ci = with_ci(nv, gi)  # skipped
    nv.nvmlComputeInstanceDestroy(ci)
    for _ in range(2):
        with pytest.raises(pynvml.NVMLError_Unknown):
            with_ci(nv, gi)
    ci = with_ci(nv, gi)
    ctl.fail_next("destroy_ci", pynvml.NVML_ERROR_IN_USE)
    with pytest.raises(pynvml.NVMLError_InUse):
        nv.nvmlComputeInstanceDestroy(ci)
    assert ctl.instances()[0].ci_id == 0  # the CI survived the failed destroy
    nv.nvmlComputeInstanceDestroy(ci)
    ctl.fail_next("destroy_gi", pynvml.NVML_ERROR_TIMEOUT)
    ctl.clear_failures()
    nv.nvmlGpuInstanceDestroy(gi)
    with pytest.raises(EmulatorError):
        ctl.fail_next("explode", 3)  # type: ignore[arg-type]


# ---- lost GPUs and events ------------------------------------------------------------------


def test_gpu_lost_and_xid_events(tmp_path: Path) -> None:
    clock = FakeClock()
    t0 = clock.monotonic()
    nv, ctl = make(
        tmp_path, ["H200-141GB", "H200-141GB"], sleep=clock.step, monotonic=clock.monotonic
    )
    dev0, dev1 = nv.nvmlDeviceGetHandleByIndex(0), nv.nvmlDeviceGetHandleByIndex(1)
    gi = gi_at(nv, dev0, 19, 0, 1)
    ctl.emit_xid(0, 13)  # before the event set exists: never delivered
    events = nv.nvmlEventSetCreate()
    mask = nv.nvmlDeviceGetSupportedEventTypes(dev0)
    assert mask & pynvml.nvmlEventTypeXidCriticalError
    for dev in (dev0, dev1):
        nv.nvmlDeviceRegisterEvents(dev, pynvml.nvmlEventTypeXidCriticalError, events)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceRegisterEvents(dev0, pynvml.nvmlEventTypePState, events)
    with pytest.raises(pynvml.NVMLError_Timeout):
        nv.nvmlEventSetWait(events, 500)
    assert clock.monotonic() - t0 >= 0.5
    ctl.gpu_lost(0)
    ctl.emit_xid(1, 48, gi_id=3)
    first = nv.nvmlEventSetWait_v2(events, 1000)
    assert (first.eventType, first.eventData) == (pynvml.nvmlEventTypeXidCriticalError, 79)
    assert addr(first.device) == addr(dev0) and first.gpuInstanceId == 0xFFFFFFFF
    second = nv.nvmlEventSetWait(events, 1000)
    assert (second.eventData, addr(second.device), second.gpuInstanceId) == (48, addr(dev1), 3)
    for call in (
        lambda: nv.nvmlDeviceGetHandleByIndex(0),
        lambda: nv.nvmlDeviceGetUUID(dev0),
        lambda: nv.nvmlDeviceGetMigMode(dev0),
        lambda: nv.nvmlGpuInstanceGetInfo(gi),
        lambda: gi_at(nv, dev0, 19, 1, 1),
        lambda: nv.nvmlDeviceGetGpuInstanceProfileInfo(dev0, 0),
    ):
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            call()
    assert nv.nvmlDeviceGetCount() == 2
    gi_at(nv, dev1, 19, 1, 1)  # the other GPU is fine
    nv.nvmlEventSetFree(events)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlEventSetWait(events, 10)
    ctl.reset_gpu(0, force=True)
    assert nv.nvmlDeviceGetMigMode(nv.nvmlDeviceGetHandleByIndex(0)) == [1, 1]
    assert [r.gpu_index for r in ctl.instances()] == [1]


def test_events_from_another_process_are_delivered(tmp_path: Path) -> None:
    nv, _ = make(tmp_path, ["A100-40GB"])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    events = nv.nvmlEventSetCreate()
    nv.nvmlDeviceRegisterEvents(dev, pynvml.nvmlEventTypeXidCriticalError, events)
    cmd = "from nodeagent.emulator import EmulatorControl as C; import sys; "
    cmd += "C(sys.argv[1], 'n0').emit_xid(0, 94)"
    subprocess.run([sys.executable, "-c", cmd, str(tmp_path)], cwd=REPO, check=True)
    assert nv.nvmlEventSetWait(events, 5000).eventData == 94


def test_provision_gives_what_the_spec_says(tmp_path: Path) -> None:
    """Issue 24: a spec that changed a node's model, GPU count or MIG mode is provisioned
    anew (it once kept the old GPUs: `migMode: disabled` came up enabled); an unchanged
    spec keeps the state, instances included (a restart)."""
    assert provision(tmp_path, "a", ["H100-80GB"] * 2) == "created"
    ctl = EmulatorControl(tmp_path, "a")
    nv = EmulatedNvml(tmp_path, "a")
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    info = nv.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    nv.nvmlDeviceCreateGpuInstance(h, info.id)
    assert len(ctl.instances()) == 1
    assert provision(tmp_path, "a", ["H100-80GB"] * 2) == "kept"
    assert len(ctl.instances()) == 1  # a restart keeps what was made
    assert provision(tmp_path, "a", ["H100-80GB"] * 2, "disabled") == "replaced"
    assert [g.mig_current for g in ctl.state().gpus] == [0, 0] and ctl.instances() == []
    nv.nvmlDeviceSetMigMode(h, 1)  # MIG on demand: no change of the spec
    assert provision(tmp_path, "a", ["H100-80GB"] * 2, "disabled") == "kept"
    assert [g.mig_current for g in ctl.state().gpus] == [1, 0]
    assert provision(tmp_path, "a", ["A30-24GB"], "disabled") == "replaced"
    assert [g.model for g in ctl.state().gpus] == ["A30-24GB"]
