"""`EmulatedNvml`: one emulated node, used exactly like the `pynvml` module.

    nvml = EmulatedNvml(state_dir, "node-a")
    nvml.nvmlInit()
    dev = nvml.nvmlDeviceGetHandleByIndex(0)
    info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(dev, nvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(
        dev, info.id, nvml.c_nvmlGpuInstancePlacement_t(6, 1))

Code written against `pynvml` runs unchanged against an instance: same function names,
argument order, return shapes, ctypes handle and struct types, and `pynvml.NVMLError`
subclasses for failures. The calls live in `nvml_device.py` and `nvml_mig.py`.
"""

from __future__ import annotations

from nodeagent.emulator.nvml_device import DeviceCalls
from nodeagent.emulator.nvml_mig import MigCalls


class EmulatedNvml(DeviceCalls, MigCalls):
    """The pynvml call surface for the GPUs of one emulated node (see the module docstring)."""

    @property
    def node(self) -> str:
        return self._store.node
