"""Device-level calls: system info, device queries, MIG mode, MIG device handles, processes,
and the event-set API (XID events written to the node's event log by any process).

Return shapes follow pynvml exactly: strings are `str`, MIG mode is `[current, pending]`,
`nvmlDeviceIsMigDeviceHandle` returns a `c_uint` (pynvml forgets `.value` there too), the
process list holds pynvml's friendly objects, events are `c_nvmlEventData_t`.
"""

from __future__ import annotations

from typing import Any

import pynvml

from nodeagent.emulator import node as node_ops
from nodeagent.emulator import rules
from nodeagent.emulator.handles import Kind
from nodeagent.emulator.nvml_base import EventSet, NvmlBase, fail
from nodeagent.emulator.state import (
    GPU_IS_LOST,
    INVALID_ARGUMENT,
    NO_ID,
    NOT_FOUND,
    NOT_SUPPORTED,
    TIMEOUT,
    EmulatorState,
    Gpu,
    Rejected,
)

DRIVER_VERSION = "580.159.04"  # what the real H200 in tests/data/ ran
NVML_VERSION = "13.580.159.04"
CUDA_DRIVER_VERSION = 13000
PROCESS_MEMORY = 512 << 20  # bytes each emulated process "uses"
SUPPORTED_EVENTS: int = (
    pynvml.nvmlEventTypeXidCriticalError
    | pynvml.nvmlEventTypeDoubleBitEccError
    | pynvml.nvmlEventTypeSingleBitEccError
)
_POLL_S = 0.02


class DeviceCalls(NvmlBase):
    # ---- system ----------------------------------------------------------------------------

    def nvmlSystemGetDriverVersion(self) -> str:
        self._read()
        return DRIVER_VERSION

    def nvmlSystemGetNVMLVersion(self) -> str:
        self._read()
        return NVML_VERSION

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._read()
        return CUDA_DRIVER_VERSION

    def nvmlDeviceGetCount(self) -> int:
        return len(self._read().gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        gpu = self._read().gpu(index)
        if gpu is None:
            fail(INVALID_ARGUMENT, f"no GPU {index}")
        if gpu.lost:
            fail(GPU_IS_LOST, f"GPU {index} fell off the bus")
        return self._device_handle(gpu)

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> Any:
        """GPU-... gives the GPU's handle, MIG-... the MIG device's (as real NVML does)."""
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        state = self._read()
        try:
            gpu, gi, ci = state.find_uuid(text)
        except LookupError:
            fail(NOT_FOUND, f"no device {text}")
        if gpu.lost:
            fail(GPU_IS_LOST, f"GPU {gpu.index} fell off the bus")
        if gi is None or ci is None:
            return self._device_handle(gpu)
        return self._ci_handle(gpu, gi, ci, Kind.MIG_DEVICE)

    # ---- device queries --------------------------------------------------------------------

    def nvmlDeviceGetUUID(self, handle: object) -> str:
        gpu, mig = self._any_device(self._read(), handle)
        return gpu.uuid if mig is None else mig[1].uuid

    def nvmlDeviceGetName(self, handle: object) -> str:
        gpu, mig = self._any_device(self._read(), handle)
        product = gpu.spec.product_names[0]
        if mig is None:
            return product
        gi, ci = mig
        return f"{product} MIG {self._ci_profile(gpu, gi.profile_id, ci.profile).name}"

    @staticmethod
    def _ci_profile(gpu: Gpu, profile_id: int, enum: int) -> rules.CiProfile:
        gi_profile = gpu.spec.profile_by_id(profile_id)
        assert gi_profile is not None
        found = rules.ci_profile(gpu.spec, gi_profile, enum)
        assert not isinstance(found, Rejected)
        return found

    def nvmlDeviceGetPciInfo(self, handle: object) -> Any:
        gpu, _ = self._any_device(self._read(), handle)
        info = pynvml.nvmlPciInfo_t()
        bus_id = f"00000000:{0x18 + gpu.index * 0x10:02X}:00.0"
        info.busIdLegacy = bus_id
        info.busId = bus_id
        info.domain = 0
        info.bus = 0x18 + gpu.index * 0x10
        info.device = 0
        info.pciDeviceId = gpu.spec.pci_device_ids[0]
        info.pciSubSystemId = 0x17D310DE
        return info

    nvmlDeviceGetPciInfo_v3 = nvmlDeviceGetPciInfo

    def nvmlDeviceGetMemoryInfo(self, handle: object, version: int | None = None) -> Any:
        gpu, mig = self._any_device(self._read(), handle)
        if mig is None:
            total = gpu.spec.memory_total_mib << 20
            used = len(gpu.processes) * PROCESS_MEMORY
        else:
            profile = gpu.spec.profile_by_id(mig[0].profile_id)
            assert profile is not None
            total = profile.memory_mib << 20
            used = sum(len(c.processes) for c in mig[0].cis) * PROCESS_MEMORY
        if version:
            memory = pynvml.c_nvmlMemory_v2_t()
            memory.version = version
            memory.reserved = 0
        else:
            memory = pynvml.c_nvmlMemory_t()
        memory.total, memory.used, memory.free = total, used, total - used
        return memory

    def nvmlDeviceGetArchitecture(self, handle: object) -> int:
        gpu, _ = self._any_device(self._read(), handle)
        return gpu.spec.nvml_arch

    def nvmlDeviceGetIndex(self, handle: object) -> int:
        return self._device(self._read(), handle).index

    def nvmlDeviceGetMinorNumber(self, handle: object) -> int:
        return self._device(self._read(), handle).index

    # ---- MIG mode --------------------------------------------------------------------------

    def nvmlDeviceGetMigMode(self, handle: object) -> list[int]:
        gpu = self._device(self._read(), handle)
        return [gpu.mig_current, gpu.mig_pending]

    def nvmlDeviceSetMigMode(self, handle: object, mode: int) -> int:
        """The node's `mode_ms` is slept first when the call would change the mode."""
        state = self._read()
        gpu = self._device(state, handle)
        if state.settings.mode_ms > 0 and mode != gpu.mig_current:
            self._sleep(state.settings.mode_ms / 1000)

        def change(state: EmulatorState) -> tuple[EmulatorState, int | Rejected]:
            gpu = self._device(state, handle)
            state, failed = node_ops.take_failure(state, "set_mig_mode")
            if failed is not None:
                return state, failed
            s = state.settings
            destroy = s.disable_with_instances == "destroy"
            res = rules.set_mig_mode(gpu, mode, vm=s.vm, destroy_instances=destroy)
            if isinstance(res, Rejected):
                return state, res
            return state.with_gpu(res[0]), res[1]

        return self._mutate(None, change)

    # ---- MIG device handles ----------------------------------------------------------------

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: object) -> int:
        gpu = self._device(self._read(), handle)
        on = gpu.mig_current == pynvml.NVML_DEVICE_MIG_ENABLE
        return gpu.spec.compute_slices if on else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: object, index: int) -> Any:
        gpu = self._device(self._read(), handle)
        self._require_mig(gpu)
        if not 0 <= index < gpu.spec.compute_slices:
            fail(INVALID_ARGUMENT, f"MIG device index {index} out of range")
        for gi in gpu.gis:
            for ci in gi.cis:
                if ci.mig_index == index:
                    return self._ci_handle(gpu, gi, ci, Kind.MIG_DEVICE)
        fail(NOT_FOUND, f"no MIG device at index {index}")

    def nvmlDeviceIsMigDeviceHandle(self, handle: object) -> Any:
        _, mig = self._any_device(self._read(), handle)
        return pynvml.c_uint(0 if mig is None else 1)

    def _mig_only(self, handle: object) -> tuple[Gpu, Any, Any]:
        gpu, mig = self._any_device(self._read(), handle)
        if mig is None:
            fail(NOT_SUPPORTED, "not a MIG device handle")
        return gpu, mig[0], mig[1]

    def nvmlDeviceGetGpuInstanceId(self, handle: object) -> int:
        return int(self._mig_only(handle)[1].id)

    def nvmlDeviceGetComputeInstanceId(self, handle: object) -> int:
        return int(self._mig_only(handle)[2].id)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: object) -> Any:
        gpu, mig = self._any_device(self._read(), handle)
        if mig is None:
            fail(INVALID_ARGUMENT, "not a MIG device handle")
        return self._device_handle(gpu)

    # ---- processes -------------------------------------------------------------------------

    def nvmlDeviceGetComputeRunningProcesses(self, handle: object) -> list[Any]:
        gpu, mig = self._any_device(self._read(), handle)
        if mig is None:
            rows = [(pid, NO_ID, NO_ID) for pid in gpu.processes]
            rows += [(p, gi.id, ci.id) for gi in gpu.gis for ci in gi.cis for p in ci.processes]
        else:
            gi, ci = mig
            rows = [(p, gi.id, ci.id) for p in ci.processes]
        out = []
        for pid, gi_id, ci_id in rows:
            info = pynvml.c_nvmlProcessInfo_v3_t()
            info.pid, info.usedGpuMemory = pid, PROCESS_MEMORY
            info.gpuInstanceId, info.computeInstanceId = gi_id, ci_id
            out.append(pynvml.nvmlStructToFriendlyObject(info))
        return out

    nvmlDeviceGetComputeRunningProcesses_v3 = nvmlDeviceGetComputeRunningProcesses

    # ---- events ----------------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> Any:
        state = self._read()
        with self._lock:
            number = self._next_event_set
            self._next_event_set += 1
            self._event_sets[number] = EventSet(cursor=state.next_event - 1)
        return self._make(Kind.EVENT_SET, serial=number)

    def _event_set(self, event_set: object) -> EventSet:
        ref = self._ref(event_set)
        found = self._event_sets.get(ref.serial) if ref and ref.kind is Kind.EVENT_SET else None
        if found is None:
            fail(INVALID_ARGUMENT, "not a live event set")
        return found

    def nvmlDeviceRegisterEvents(self, handle: object, eventTypes: int, eventSet: object) -> None:
        state = self._read()
        gpu = self._device(state, handle)
        es = self._event_set(eventSet)
        if eventTypes & ~SUPPORTED_EVENTS:
            fail(NOT_SUPPORTED, f"event types {eventTypes:#x} not all supported")
        with self._lock:
            mask, since = es.registered.get(gpu.index, (0, state.next_event - 1))
            es.registered[gpu.index] = (mask | eventTypes, since)

    def nvmlDeviceGetSupportedEventTypes(self, handle: object) -> int:
        self._device(self._read(), handle)
        return SUPPORTED_EVENTS

    def nvmlEventSetWait_v2(self, eventSet: object, timeoutms: int) -> Any:
        """The next registered event after the cursor; NVMLError_Timeout when none comes."""
        es = self._event_set(eventSet)
        deadline = self._monotonic() + timeoutms / 1000
        while True:
            for event in self._read().events:
                if event.seq <= es.cursor:
                    continue
                es.cursor = event.seq
                mask, since = es.registered.get(event.gpu, (0, 0))
                if event.event_type & mask and event.seq > since:
                    data = pynvml.c_nvmlEventData_t()
                    data.device = self._make(Kind.DEVICE, event.gpu)
                    data.eventType = event.event_type
                    data.eventData = event.data
                    data.gpuInstanceId = event.gi_id
                    data.computeInstanceId = event.ci_id
                    return data
            left = deadline - self._monotonic()
            if left <= 0:
                fail(TIMEOUT, f"no event within {timeoutms} ms")
            self._sleep(min(_POLL_S, left))

    def nvmlEventSetWait(self, eventSet: object, timeoutms: int) -> Any:
        return self.nvmlEventSetWait_v2(eventSet, timeoutms)

    def nvmlEventSetFree(self, eventSet: object) -> None:
        self._event_set(eventSet)
        ref = self._ref(eventSet)
        assert ref is not None
        with self._lock:
            del self._event_sets[ref.serial]
