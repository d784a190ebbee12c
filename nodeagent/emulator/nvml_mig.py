"""GPU-instance and compute-instance calls, shaped like pynvml's.

Profile queries answer with MIG disabled, as driver 580 does on the H200; creating,
listing and destroying need MIG enabled (NOT_SUPPORTED otherwise). Placement arguments are
accepted as pynvml callers pass them: the placement struct itself, `byref(placement)` or
`pointer(placement)`. Create/destroy calls sleep the node's configured latency first and
may fail by injection (`EmulatorControl.fail_next`).
"""

from __future__ import annotations

import ctypes
from typing import Any

import pynvml

from common.catalog import Profile
from nodeagent.emulator import node, rules
from nodeagent.emulator.handles import Kind
from nodeagent.emulator.nvml_base import NvmlBase, fail
from nodeagent.emulator.state import (
    INVALID_ARGUMENT,
    MIG_ENABLE,
    NOT_FOUND,
    NOT_SUPPORTED,
    SUCCESS,
    ComputeInstance,
    EmulatorState,
    Gpu,
    GpuInstance,
    Rejected,
)


def _placement(placement: object) -> tuple[int, int]:
    inner = getattr(placement, "_obj", None)  # byref(placement)
    if inner is not None:
        placement = inner
    elif isinstance(placement, ctypes._Pointer):
        placement = placement.contents
    start, size = getattr(placement, "start", None), getattr(placement, "size", None)
    if not isinstance(start, int) or not isinstance(size, int):
        fail(INVALID_ARGUMENT, "expected a c_nvmlGpuInstancePlacement_t")
    return start, size


def _gi_profile_info(profile: Profile, version: int) -> Any:
    if version == 2:
        info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
        info.name = f"MIG {profile.name}"
    elif version == 1:
        info = pynvml.c_nvmlGpuInstanceProfileInfo_t()
    else:
        fail(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, f"no profile info version {version}")
    e = profile.engines
    info.id = profile.id
    info.isP2pSupported = 0
    info.sliceCount = profile.compute_slices
    info.instanceCount = profile.max_count
    info.multiprocessorCount = profile.multiprocessors
    info.copyEngineCount, info.decoderCount, info.encoderCount = e.ce, e.dec, e.enc
    info.jpegCount, info.ofaCount = e.jpeg, e.ofa
    info.memorySizeMB = profile.memory_mib
    return info


class MigCalls(NvmlBase):
    # ---- GI profiles -----------------------------------------------------------------------

    @staticmethod
    def _profile_by_enum(gpu: Gpu, enum: int) -> Profile:
        if not 0 <= enum < rules.GI_PROFILE_COUNT:
            fail(INVALID_ARGUMENT, f"GI profile enum {enum} out of range")
        profile = gpu.spec.profile_by_enum(enum)
        if profile is None:
            fail(NOT_SUPPORTED, f"{gpu.spec.name} has no GI profile enum {enum}")
        return profile

    @staticmethod
    def _profile_by_id(gpu: Gpu, profile_id: int) -> Profile:
        profile = gpu.spec.profile_by_id(profile_id)
        if profile is None:
            fail(INVALID_ARGUMENT, f"{gpu.spec.name} has no GI profile id {profile_id}")
        return profile

    def nvmlDeviceGetGpuInstanceProfileInfo(
        self, device: object, profile: int, version: int = 2
    ) -> Any:
        gpu = self._device(self._read(), device)
        return _gi_profile_info(self._profile_by_enum(gpu, profile), version)

    nvmlDeviceGetGpuInstanceProfileInfoV = nvmlDeviceGetGpuInstanceProfileInfo

    def nvmlDeviceGetGpuInstanceProfileInfoById(self, device: object, profileId: int) -> Any:
        gpu = self._device(self._read(), device)
        return _gi_profile_info(self._profile_by_id(gpu, profileId), 2)

    nvmlDeviceGetGpuInstanceProfileInfoByIdV = nvmlDeviceGetGpuInstanceProfileInfoById

    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, device: object, profileId: int) -> int:
        state = self._read()
        gpu = self._device(state, device)
        profile = self._profile_by_id(gpu, profileId)
        if gpu.mig_current != MIG_ENABLE and not state.settings.capacity_without_mig:
            fail(NOT_SUPPORTED, f"GPU {gpu.index}: MIG mode is disabled")
        return rules.remaining_capacity(gpu, gpu.spec, profile)

    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, device: object, profileId: int, placementsRef: object, countRef: object
    ) -> int:
        gpu = self._device(self._read(), device)
        profile = self._profile_by_id(gpu, profileId)
        items = [pynvml.c_nvmlGpuInstancePlacement_t(s, profile.size) for s in profile.starts]
        self._fill(placementsRef, countRef, items)
        return SUCCESS

    nvmlDeviceGetGpuInstancePossiblePlacements_v2 = nvmlDeviceGetGpuInstancePossiblePlacements

    # ---- GPU instances ---------------------------------------------------------------------

    def _create_gi(self, device: object, profile_id: int, at: tuple[int, int] | None) -> Any:
        def change(state: EmulatorState) -> tuple[EmulatorState, Any]:
            gpu = self._device(state, device)
            self._require_mig(gpu)
            state, gi = node.apply_create_gi(state, gpu.index, profile_id, at)
            return state, gi if isinstance(gi, Rejected) else (gpu, gi)

        gpu, gi = self._mutate("create_gi", change)
        return self._gi_handle(gpu, gi)

    def nvmlDeviceCreateGpuInstance(self, device: object, profileId: int) -> Any:
        return self._create_gi(device, profileId, None)

    def nvmlDeviceCreateGpuInstanceWithPlacement(
        self, device: object, profileId: int, placement: object
    ) -> Any:
        return self._create_gi(device, profileId, _placement(placement))

    def nvmlGpuInstanceDestroy(self, gpuInstance: object) -> int:
        def change(state: EmulatorState) -> tuple[EmulatorState, Rejected | None]:
            gpu, gi = self._gpu_instance(state, gpuInstance)
            return node.apply_destroy_gi(state, gpu.index, gi.id)

        self._mutate("destroy_gi", change)
        return SUCCESS

    def nvmlDeviceGetGpuInstances(
        self, device: object, profileId: int, gpuInstancesRef: object, countRef: object
    ) -> int:
        gpu = self._device(self._read(), device)
        self._require_mig(gpu)
        self._profile_by_id(gpu, profileId)
        found = sorted((g for g in gpu.gis if g.profile_id == profileId), key=lambda g: g.id)
        self._fill(gpuInstancesRef, countRef, [self._gi_handle(gpu, g) for g in found])
        return SUCCESS

    def nvmlDeviceGetGpuInstanceById(self, device: object, gpuInstanceId: int) -> Any:
        gpu = self._device(self._read(), device)
        self._require_mig(gpu)
        gi = gpu.gi(gpuInstanceId)
        if gi is None:
            fail(NOT_FOUND, f"GPU {gpu.index}: no GPU instance {gpuInstanceId}")
        return self._gi_handle(gpu, gi)

    def nvmlGpuInstanceGetInfo(self, gpuInstance: object) -> Any:
        gpu, gi = self._gpu_instance(self._read(), gpuInstance)
        info = pynvml.c_nvmlGpuInstanceInfo_t()
        info.device = self._device_handle(gpu)
        info.id, info.profileId = gi.id, gi.profile_id
        info.placement = pynvml.c_nvmlGpuInstancePlacement_t(gi.start, gi.size)
        return info

    # ---- compute instances -----------------------------------------------------------------

    def _ci_profile_of(self, gpu: Gpu, gi: GpuInstance, enum: int) -> rules.CiProfile:
        gi_profile = self._profile_by_id(gpu, gi.profile_id)
        found = rules.ci_profile(gpu.spec, gi_profile, enum)
        if isinstance(found, Rejected):
            fail(found.code, found.reason)
        return found

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, device: object, profile: int, engProfile: int, version: int = 2
    ) -> Any:
        gpu, gi = self._gpu_instance(self._read(), device)
        if engProfile != pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
            fail(INVALID_ARGUMENT, f"engine profile {engProfile}")
        prof = self._ci_profile_of(gpu, gi, profile)
        if version == 2:
            info = pynvml.c_nvmlComputeInstanceProfileInfo_v2_t()
            info.name = f"MIG {prof.name}"
        elif version == 1:
            info = pynvml.c_nvmlComputeInstanceProfileInfo_t()
        else:
            fail(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, f"no profile info version {version}")
        e = self._profile_by_id(gpu, gi.profile_id).engines
        info.id, info.sliceCount = prof.enum, prof.slices
        info.instanceCount, info.multiprocessorCount = prof.instance_count, prof.multiprocessors
        info.sharedCopyEngineCount, info.sharedDecoderCount = e.ce, e.dec
        info.sharedEncoderCount, info.sharedJpegCount, info.sharedOfaCount = e.enc, e.jpeg, e.ofa
        return info

    nvmlGpuInstanceGetComputeInstanceProfileInfoV = nvmlGpuInstanceGetComputeInstanceProfileInfo

    def nvmlGpuInstanceGetComputeInstanceRemainingCapacity(
        self, gpuInstance: object, profileId: int
    ) -> int:
        gpu, gi = self._gpu_instance(self._read(), gpuInstance)
        prof = self._ci_profile_of(gpu, gi, profileId)
        return rules.ci_remaining(gi, self._profile_by_id(gpu, gi.profile_id), prof)

    def nvmlGpuInstanceGetComputeInstancePossiblePlacements(
        self, gpuInstance: object, profileId: int, placementsRef: object, countRef: object
    ) -> int:
        gpu, gi = self._gpu_instance(self._read(), gpuInstance)
        prof = self._ci_profile_of(gpu, gi, profileId)
        g = self._profile_by_id(gpu, gi.profile_id).compute_slices
        items = [pynvml.c_nvmlComputeInstancePlacement_t(s, prof.slices) for s in prof.starts(g)]
        self._fill(placementsRef, countRef, items)
        return SUCCESS

    def _create_ci(self, gpu_instance: object, enum: int, start: int | None) -> Any:
        def change(state: EmulatorState) -> tuple[EmulatorState, Any]:
            gpu, gi = self._gpu_instance(state, gpu_instance)
            state, ci = node.apply_create_ci(state, gpu.index, gi.id, enum, start)
            return state, ci if isinstance(ci, Rejected) else (gpu, gi, ci)

        gpu, gi, ci = self._mutate("create_ci", change)
        return self._ci_handle(gpu, gi, ci, Kind.COMPUTE_INSTANCE)

    def nvmlGpuInstanceCreateComputeInstance(self, gpuInstance: object, profileId: int) -> Any:
        return self._create_ci(gpuInstance, profileId, None)

    def nvmlGpuInstanceCreateComputeInstanceWithPlacement(
        self, gpuInstance: object, profileId: int, placement: object
    ) -> Any:
        start, size = _placement(placement)
        gpu, gi = self._gpu_instance(self._read(), gpuInstance)
        if size != self._ci_profile_of(gpu, gi, profileId).slices:
            fail(INVALID_ARGUMENT, f"CI placement size {size}")
        return self._create_ci(gpuInstance, profileId, start)

    def nvmlComputeInstanceDestroy(self, computeInstance: object) -> int:
        def change(state: EmulatorState) -> tuple[EmulatorState, Rejected | None]:
            gpu, gi, ci = self._compute_instance(state, computeInstance)
            return node.apply_destroy_ci(state, gpu.index, gi.id, ci.id)

        self._mutate("destroy_ci", change)
        return SUCCESS

    def nvmlGpuInstanceGetComputeInstances(
        self, gpuInstance: object, profileId: int, computeInstancesRef: object, countRef: object
    ) -> int:
        gpu, gi = self._gpu_instance(self._read(), gpuInstance)
        self._ci_profile_of(gpu, gi, profileId)
        found = sorted((c for c in gi.cis if c.profile == profileId), key=lambda c: c.id)
        items = [self._ci_handle(gpu, gi, c, Kind.COMPUTE_INSTANCE) for c in found]
        self._fill(computeInstancesRef, countRef, items)
        return SUCCESS

    def nvmlGpuInstanceGetComputeInstanceById(
        self, gpuInstance: object, computeInstanceId: int
    ) -> Any:
        gpu, gi = self._gpu_instance(self._read(), gpuInstance)
        ci: ComputeInstance | None = gi.ci(computeInstanceId)
        if ci is None:
            fail(NOT_FOUND, f"GI {gi.id}: no compute instance {computeInstanceId}")
        return self._ci_handle(gpu, gi, ci, Kind.COMPUTE_INSTANCE)

    def nvmlComputeInstanceGetInfo_v2(self, computeInstance: object) -> Any:
        gpu, gi, ci = self._compute_instance(self._read(), computeInstance)
        info = pynvml.c_nvmlComputeInstanceInfo_t()
        info.device = self._device_handle(gpu)  # the PARENT device, as nvml.h says
        info.gpuInstance = self._gi_handle(gpu, gi)
        info.id, info.profileId = ci.id, ci.profile
        info.placement = pynvml.c_nvmlComputeInstancePlacement_t(ci.start, ci.size)
        return info

    def nvmlComputeInstanceGetInfo(self, computeInstance: object) -> Any:
        return self.nvmlComputeInstanceGetInfo_v2(computeInstance)
