"""The DRA health stream's content (nodeagent/dra/health.py `device_health`): pure. The
stream itself, with the fake kubelet and an NVML event: tests/integration/test_dra_plugin.py."""

from __future__ import annotations

from nodeagent.checkpoint import ClaimRecord, SliceRecord
from nodeagent.dra.health import DeviceHealth, device_health
from nodeagent.model import Health


def held(*devices: tuple[str, int]) -> ClaimRecord:
    slices = tuple(SliceRecord(d, "1g.10gb", 19, f"GPU-{g}", g, 0, 1) for d, g in devices)
    return ClaimRecord("u", "ns", "c", "ready", slices)


def test_each_held_device_has_its_gpus_health() -> None:
    records = [held(("gpu-0-mig-19-0", 0), ("gpu-1-mig-19-0", 1)), held(("gpu-2-mig-19-0", 2))]
    health = {1: Health(False, "XID 48: double-bit ECC error"), 0: Health()}
    assert device_health(records, health, lost=[2]) == [
        DeviceHealth("gpu-0-mig-19-0", True, ""),
        DeviceHealth("gpu-1-mig-19-0", False, "XID 48: double-bit ECC error"),
        DeviceHealth("gpu-2-mig-19-0", False, "GPU is lost (NVML: GPU_IS_LOST)"),
    ]


def test_nothing_held_nothing_listed_and_messages_are_bounded() -> None:
    assert device_health([], {}, lost=[]) == []
    (d,) = device_health([held(("gpu-0", 0))], {0: Health(False, "x" * 5000)}, lost=[])
    assert len(d.message) == 1024
