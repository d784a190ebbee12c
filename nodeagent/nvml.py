"""The hardware seam: the only module that speaks NVML (docs/style.md §5).

Everything here is written against the `pynvml` call surface and receives "the nvml module"
as a dependency — the real `pynvml` (nvidia-ml-py) on a node, an `EmulatedNvml` under
`--emulate` — so one code path runs on both. Calls block, so `NvmlSession` is synchronous;
`nodeagent.device.NodeGpus` runs its calls off the event loop, in order per GPU and the GPUs
of a node in parallel.

What it does not do: decide anything. It reads inventories and instances, creates one GI at
exactly a placement plus its default CI, finds the MIG UUID by walking MIG device handles
(the CI info's `device` is the PARENT GPU, docs/mig-facts.md §3.2), destroys CI then GI,
and waits for health events. NVML errors become `NvmlFailure` (code + call name), classified in
`nodeagent.model`.

`ReadOnly` wraps a module and refuses every call not on the read-only list; `--discover-only`
runs behind it, so on a real node it cannot change anything even by a bug.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from typing import Any

import pynvml

from common.catalog import Catalog, GpuModel
from nodeagent.model import (
    MIG_DISABLED,
    MIG_ENABLED,
    NVML_GPU_IS_LOST,
    NVML_INVALID_ARGUMENT,
    NVML_NO_PERMISSION,
    NVML_NOT_FOUND,
    NVML_NOT_SUPPORTED,
    NVML_TIMEOUT,
    GpuInfo,
    HealthEvent,
    Instance,
    NodeInventory,
    NvmlFailure,
    ProfileInfo,
)

NvmlModule = Any  # the pynvml module, or an object with its names (EmulatedNvml)

_ERROR_NAMES = {getattr(pynvml, n): n for n in dir(pynvml) if n.startswith("NVML_ERROR_")}
_NO_ID = 0xFFFFFFFF
# NVML_GPU_INSTANCE_PROFILE_COUNT in nvml.h of driver 580 (docs/mig-facts.md §1)
GI_PROFILE_COUNT = 18
CI_PROFILE_COUNT = 9
CI_ENGINE_SHARED = 0

# Every NVML function discovery may call. None changes GPU state.
READ_ONLY_CALLS = frozenset(
    {
        "nvmlInit",
        "nvmlShutdown",
        "nvmlSystemGetDriverVersion",
        "nvmlDeviceGetCount",
        "nvmlDeviceGetHandleByIndex",
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetName",
        "nvmlDeviceGetPciInfo",
        "nvmlDeviceGetMinorNumber",
        "nvmlDeviceGetMigMode",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetGpuInstanceProfileInfo",
        "nvmlDeviceGetGpuInstancePossiblePlacements",
        "nvmlDeviceGetGpuInstances",
        "nvmlGpuInstanceGetInfo",
        "nvmlDeviceGetMaxMigDeviceCount",
        "nvmlDeviceGetMigDeviceHandleByIndex",
        "nvmlDeviceGetGpuInstanceId",
        "nvmlDeviceGetComputeInstanceId",
        "nvmlDeviceGetArchitecture",
        "nvmlDeviceGetComputeRunningProcesses",
    }
)
# nvmlDeviceGetArchitecture values (nvml.h NVML_DEVICE_ARCH_*)
ARCHITECTURES = {7: "ampere", 8: "ada", 9: "hopper", 10: "blackwell"}


def _mode(value: int) -> str:
    return MIG_ENABLED if value == 1 else MIG_DISABLED


def error_name(code: int) -> str:
    return _ERROR_NAMES.get(code, f"NVML_ERROR_{code}")


def real_nvml() -> NvmlModule:
    """The real library binding (loads libnvidia-ml.so at nvmlInit)."""
    return pynvml


class ReadOnly:
    """A module proxy that refuses any nvml* function outside READ_ONLY_CALLS."""

    def __init__(self, nv: NvmlModule, allowed: Iterable[str] = READ_ONLY_CALLS) -> None:
        self._nv = nv
        self._allowed = frozenset(allowed)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("nvml") and name not in self._allowed:
            raise PermissionError(f"{name} is not a read-only NVML call")
        return getattr(self._nv, name)


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _addr(handle: Any) -> int:
    return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)


class NvmlSession:
    """One NVML session for one node. Not thread-safe: call it from one thread."""

    def __init__(self, nv: NvmlModule, catalog: Catalog) -> None:
        self.nv = nv
        self.catalog = catalog
        self._handles: dict[int, Any] = {}

    # ---- plumbing ------------------------------------------------------------------------

    def call(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self.nv, name)(*args)
        except pynvml.NVMLError as exc:
            code = int(getattr(exc, "value", 999))
            notes = "; ".join(getattr(exc, "__notes__", ()))
            text = error_name(code) + (f": {notes}" if notes else "")
            raise NvmlFailure(code, name, text) from exc

    def open(self) -> None:
        self.call("nvmlInit")

    def close(self) -> None:
        self._handles.clear()
        self.call("nvmlShutdown")

    def handle(self, index: int) -> Any:
        h = self._handles.get(index)
        if h is None:
            h = self._handles[index] = self.call("nvmlDeviceGetHandleByIndex", index)
        return h

    # ---- discovery (read-only) -------------------------------------------------------------

    def inventory(self) -> NodeInventory:
        """GPUs and their instances. A GPU that fell off the bus becomes a placeholder
        (no profiles, MIG unknown) listed in `lost`, so the rest of the node still works."""
        driver = _text(self.call("nvmlSystemGetDriverVersion"))
        gpus: list[GpuInfo] = []
        lost: list[int] = []
        instances: list[Instance] = []
        for i in range(int(self.call("nvmlDeviceGetCount"))):
            try:
                g = self.gpu_info(i)
                instances += self.instances(g)
            except NvmlFailure as exc:
                if not exc.gpu_lost:
                    raise
                self._handles.pop(i, None)
                lost.append(i)
                g = lost_gpu(i)
            gpus.append(g)
        return NodeInventory(
            gpus=tuple(gpus), instances=tuple(instances), driver_version=driver, lost=tuple(lost)
        )

    def gpu_info(self, index: int) -> GpuInfo:
        h = self.handle(index)
        uuid = _text(self.call("nvmlDeviceGetUUID", h))
        name = _text(self.call("nvmlDeviceGetName", h))
        pci_id = int(self.call("nvmlDeviceGetPciInfo", h).pciDeviceId)
        minor = int(self.call("nvmlDeviceGetMinorNumber", h))
        total = int(self.call("nvmlDeviceGetMemoryInfo", h).total) >> 20
        try:
            cur, pend = self.call("nvmlDeviceGetMigMode", h)
        except NvmlFailure as exc:
            if exc.code != NVML_NOT_SUPPORTED:
                raise
            cur = pend = 0  # not MIG-capable
        model = self.catalog.model_by_pci(pci_id) or self.catalog.model_by_product_name(name)
        profiles, warnings = self._profiles(h, model)
        if model is None:
            warnings.append(f"{name} (PCI {pci_id:#010x}) is not in the catalog")
        else:
            warnings += catalog_diff(model, profiles)
        return GpuInfo(
            index=index,
            uuid=uuid,
            name=name,
            pci_device_id=pci_id,
            minor=minor,
            mig_current=MIG_ENABLED if cur == 1 else MIG_DISABLED,
            mig_pending=MIG_ENABLED if pend == 1 else MIG_DISABLED,
            memory_total_mib=total,
            model=model.name if model else name,
            profiles=profiles,
            warnings=tuple(warnings),
            architecture=self._architecture(h, model),
            compute_processes=self.compute_processes(index),
        )

    def _architecture(self, h: Any, model: GpuModel | None) -> str:
        try:
            arch = int(self.call("nvmlDeviceGetArchitecture", h))
        except NvmlFailure as exc:
            if exc.code != NVML_NOT_SUPPORTED:
                raise
            arch = -1
        return ARCHITECTURES.get(arch) or (model.architecture if model else "")

    def compute_processes(self, index: int) -> int:
        """Compute processes NVML lists on the whole GPU (0 when it cannot tell)."""
        try:
            return len(self.call("nvmlDeviceGetComputeRunningProcesses", self.handle(index)))
        except NvmlFailure as exc:
            if exc.code not in (NVML_NOT_SUPPORTED, NVML_NO_PERMISSION):
                raise
            return 0

    def forget(self, index: int) -> None:
        """Drop GPU `index`'s cached handle (after a GPU reset)."""
        self._handles.pop(index, None)

    def mig_mode(self, index: int) -> tuple[str, str]:
        cur, pend = self.call("nvmlDeviceGetMigMode", self.handle(index))
        return (_mode(cur), _mode(pend))

    def set_mig_mode(self, index: int, target: str) -> GpuInfo:
        """SetMigMode(target) on an idle GPU, verified, then the GPU read afresh (nvml.h:
        the minor number may change). The caller re-checked idleness and wrote its intent.
        RESET_REQUIRED (the change only became pending) raises NvmlFailure with that code."""
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if target == MIG_ENABLED else 0
        status = int(self.call("nvmlDeviceSetMigMode", self.handle(index), mode))
        if status != pynvml.NVML_SUCCESS:
            raise NvmlFailure(status, "nvmlDeviceSetMigMode", error_name(status))
        self._handles.pop(index, None)
        now = self.mig_mode(index)
        if now != (target, target):
            raise NvmlFailure(
                NVML_INVALID_ARGUMENT,
                "nvmlDeviceGetMigMode",
                f"MIG mode is {now[0]} (pending {now[1]}) after setting {target}",
            )
        return self.gpu_info(index)

    def _profiles(
        self, h: Any, model: GpuModel | None
    ) -> tuple[tuple[ProfileInfo, ...], list[str]]:
        out: list[ProfileInfo] = []
        warnings: list[str] = []
        for enum in range(GI_PROFILE_COUNT):
            try:
                info = self.call("nvmlDeviceGetGpuInstanceProfileInfo", h, enum)
            except NvmlFailure as exc:
                if exc.code == NVML_INVALID_ARGUMENT:
                    break  # past this driver's profile count
                if exc.code in (NVML_NOT_SUPPORTED, NVML_NOT_FOUND):
                    continue
                raise
            known = model.profile_by_id(int(info.id)) if model else None
            raw_name = _text(getattr(info, "name", "")).removeprefix("MIG ").strip()
            name = raw_name or (known.name if known else f"{info.sliceCount}g.id{info.id}")
            try:
                placements = self._placements(h, int(info.id))
            except NvmlFailure as exc:
                if exc.code != NVML_NO_PERMISSION or known is None:
                    raise
                warnings.append(f"{name}: placements not readable ({exc.text}); catalog used")
                placements = tuple((s, known.size) for s in known.starts)
            out.append(
                ProfileInfo(
                    name=name,
                    id=int(info.id),
                    enum=enum,
                    slice_count=int(info.sliceCount),
                    instance_count=int(info.instanceCount),
                    memory_mib=int(info.memorySizeMB),
                    multiprocessors=int(info.multiprocessorCount),
                    placements=placements,
                    engines=(
                        int(info.copyEngineCount),
                        int(info.decoderCount),
                        int(info.encoderCount),
                        int(info.jpegCount),
                        int(info.ofaCount),
                    ),
                )
            )
        return tuple(out), warnings

    def _placements(self, h: Any, profile_id: int) -> tuple[tuple[int, int], ...]:
        count = ctypes.c_uint(0)
        fn = "nvmlDeviceGetGpuInstancePossiblePlacements"
        self.call(fn, h, profile_id, None, ctypes.byref(count))
        if count.value == 0:
            return ()
        arr = (self.nv.c_nvmlGpuInstancePlacement_t * count.value)()
        self.call(fn, h, profile_id, arr, ctypes.byref(count))
        return tuple(sorted((int(arr[i].start), int(arr[i].size)) for i in range(count.value)))

    def mig_devices(
        self, gpu_index: int, want: tuple[int, int] | None = None
    ) -> dict[tuple[int, int], str]:
        """(GI id, CI id) → MIG UUID, by walking the GPU's MIG device handles (stopping
        at `want` when given)."""
        h = self.handle(gpu_index)
        out: dict[tuple[int, int], str] = {}
        for i in range(int(self.call("nvmlDeviceGetMaxMigDeviceCount", h))):
            try:
                m = self.call("nvmlDeviceGetMigDeviceHandleByIndex", h, i)
            except NvmlFailure as exc:
                if exc.code in (NVML_NOT_FOUND, NVML_INVALID_ARGUMENT):
                    continue
                raise
            gi = int(self.call("nvmlDeviceGetGpuInstanceId", m))
            ci = int(self.call("nvmlDeviceGetComputeInstanceId", m))
            if want is not None and (gi, ci) != want:
                continue
            out[(gi, ci)] = _text(self.call("nvmlDeviceGetUUID", m))
            if want is not None:
                break
        return out

    def instances(self, gpu: GpuInfo, with_cis: bool = True) -> list[Instance]:
        """Every GPU instance on `gpu`, found per profile; `with_cis`: its CIs and MIG UUIDs
        too, by the MIG walk (most of a scan's calls: a check that placements are free needs
        only the GIs)."""
        if not gpu.mig_enabled:
            return []
        h = self.handle(gpu.index)
        migs = self.mig_devices(gpu.index) if with_cis else {}
        out: list[Instance] = []
        for p in gpu.profiles:
            count = ctypes.c_uint(0)
            arr = (self.nv.c_nvmlGpuInstance_t * max(1, p.instance_count))()
            self.call("nvmlDeviceGetGpuInstances", h, p.id, arr, ctypes.byref(count))
            for i in range(count.value):
                info = self.call("nvmlGpuInstanceGetInfo", arr[i])
                gi_id = int(info.id)
                cis = sorted((c, u) for (g, c), u in migs.items() if g == gi_id)
                out.append(
                    Instance(
                        gpu_index=gpu.index,
                        gpu_uuid=gpu.uuid,
                        gi_id=gi_id,
                        profile_id=int(info.profileId),
                        start=int(info.placement.start),
                        size=int(info.placement.size),
                        ci_ids=tuple(c for c, _ in cis),
                        mig_uuids=tuple(u for _, u in cis),
                    )
                )
        return sorted(out, key=lambda x: (x.start, x.gi_id))

    # ---- create / destroy ------------------------------------------------------------------

    def create_gi(self, gpu_index: int, profile_id: int, start: int, size: int) -> int:
        """Create a GPU instance at exactly (start, size); returns its GI id."""
        placement = self.nv.c_nvmlGpuInstancePlacement_t()
        placement.start, placement.size = start, size
        gi = self.call(
            "nvmlDeviceCreateGpuInstanceWithPlacement",
            self.handle(gpu_index),
            profile_id,
            ctypes.byref(placement),
        )
        return int(self.call("nvmlGpuInstanceGetInfo", gi).id)

    def _gi(self, gpu_index: int, gi_id: int) -> Any:
        return self.call("nvmlDeviceGetGpuInstanceById", self.handle(gpu_index), gi_id)

    def create_ci(self, gpu_index: int, gi_id: int, gi_slices: int, hint: int | None) -> int:
        """Create the GI's default (full-size) compute instance; returns its CI id.

        The default is the CI profile spanning all the GI's compute slices with the most
        SMs (Hopper has two 1-slice CI profiles; docs/mig-facts.md §2.11). `hint` (the catalog's
        default CI enum) is tried first to save the probe.
        """
        gi = self._gi(gpu_index, gi_id)
        info = None
        if hint is not None:
            info = self._ci_profile(gi, hint)
        if info is None or int(info.sliceCount) != gi_slices:
            best = None
            for enum in range(CI_PROFILE_COUNT):
                cand = self._ci_profile(gi, enum)
                if cand is not None and int(cand.sliceCount) == gi_slices:
                    sms = int(cand.multiprocessorCount)
                    if best is None or sms > int(best.multiprocessorCount):
                        best = cand
            info = best
        if info is None:
            raise NvmlFailure(NVML_NOT_SUPPORTED, "create_ci", "no full-size CI profile")
        ci = self.call("nvmlGpuInstanceCreateComputeInstance", gi, int(info.id))
        return int(self.call("nvmlComputeInstanceGetInfo", ci).id)

    def _ci_profile(self, gi: Any, enum: int) -> Any:
        try:
            return self.call(
                "nvmlGpuInstanceGetComputeInstanceProfileInfo", gi, enum, CI_ENGINE_SHARED
            )
        except NvmlFailure as exc:
            if exc.code in (NVML_NOT_SUPPORTED, NVML_INVALID_ARGUMENT, NVML_NOT_FOUND):
                return None
            raise

    def mig_uuid(self, gpu_index: int, gi_id: int, ci_id: int) -> str:
        uuid = self.mig_devices(gpu_index, want=(gi_id, ci_id)).get((gi_id, ci_id))
        if uuid is None:
            raise NvmlFailure(
                NVML_NOT_FOUND, "mig_uuid", f"no MIG device for GI {gi_id} CI {ci_id}"
            )
        return uuid

    def destroy_ci(self, gpu_index: int, gi_id: int, ci_id: int) -> bool:
        """Destroy one CI; False if it (or its GI) no longer exists."""
        try:
            gi = self._gi(gpu_index, gi_id)
            ci = self.call("nvmlGpuInstanceGetComputeInstanceById", gi, ci_id)
        except NvmlFailure as exc:
            if exc.not_found:
                return False
            raise
        self.call("nvmlComputeInstanceDestroy", ci)
        return True

    def destroy_gi(self, gpu_index: int, gi_id: int) -> bool:
        """Destroy a GI (its CIs must be gone); False if it no longer exists."""
        try:
            gi = self._gi(gpu_index, gi_id)
        except NvmlFailure as exc:
            if exc.not_found:
                return False
            raise
        self.call("nvmlGpuInstanceDestroy", gi)
        return True

    def ci_ids(self, gpu_index: int, gi_id: int) -> list[int]:
        return sorted(c for (g, c) in self.mig_devices(gpu_index) if g == gi_id)


class EventWatcher:
    """XID and GPU-lost events of one node's GPUs, from an NVML event set.

    `wait(timeout_ms)` blocks in nvmlEventSetWait; run it on its own thread. GPUs are told
    apart by handle address (a lost GPU cannot answer nvmlDeviceGetUUID any more).
    """

    def __init__(self, session: NvmlSession, gpu_indexes: Iterable[int]) -> None:
        self.s = session
        self.indexes = list(gpu_indexes)
        self._set: Any = None
        self._by_addr: dict[int, int] = {}

    def open(self) -> list[HealthEvent]:
        """Register for XID events; returns GPUs already lost."""
        lost: list[HealthEvent] = []
        self._set = self.s.call("nvmlEventSetCreate")
        for i in self.indexes:
            try:
                h = self.s.handle(i)
                self._by_addr[_addr(h)] = i
                supported = int(self.s.call("nvmlDeviceGetSupportedEventTypes", h))
                mask = supported & int(self.s.nv.nvmlEventTypeXidCriticalError)
                if mask:
                    self.s.call("nvmlDeviceRegisterEvents", h, mask, self._set)
            except NvmlFailure as exc:
                if not exc.gpu_lost:
                    raise
                lost.append(HealthEvent(gpu_index=i, kind="lost"))
        return lost

    def wait(self, timeout_ms: int) -> HealthEvent | None:
        try:
            data = self.s.call("nvmlEventSetWait", self._set, timeout_ms)
        except NvmlFailure as exc:
            if exc.code == NVML_TIMEOUT:
                return None
            if exc.code == NVML_GPU_IS_LOST:
                return HealthEvent(gpu_index=-1, kind="lost")  # caller probes which one
            raise
        index = self._by_addr.get(_addr(data.device), -1)
        xid = int(data.eventData)
        gi = int(getattr(data, "gpuInstanceId", _NO_ID))
        ci = int(getattr(data, "computeInstanceId", _NO_ID))
        return HealthEvent(
            gpu_index=index,
            kind="lost" if xid == 79 else "xid",
            xid=xid,
            gi_id=None if gi == _NO_ID else gi,
            ci_id=None if ci == _NO_ID else ci,
        )

    def probe_lost(self) -> list[int]:
        """GPUs that answer GPU_IS_LOST to a cheap query."""
        out = []
        for i in self.indexes:
            try:
                self.s.call("nvmlDeviceGetMigMode", self.s.handle(i))
            except NvmlFailure as exc:
                if exc.gpu_lost:
                    out.append(i)
        return out

    def close(self) -> None:
        if self._set is not None:
            try:
                self.s.call("nvmlEventSetFree", self._set)
            finally:
                self._set = None


def lost_gpu(index: int) -> GpuInfo:
    return GpuInfo(
        index=index,
        uuid=f"GPU-lost-{index}",
        name="unknown",
        pci_device_id=0,
        minor=index,
        mig_current=MIG_DISABLED,
        mig_pending=MIG_DISABLED,
        memory_total_mib=0,
        model="unknown",
    )


# --- catalog comparison (pure) ---------------------------------------------------------------


def catalog_diff(model: GpuModel, profiles: Iterable[ProfileInfo]) -> list[str]:
    """Where NVML disagrees with the catalog (NVML wins; the agent logs these)."""
    out: list[str] = []
    seen: set[int] = set()
    for p in profiles:
        seen.add(p.id)
        known = model.profile_by_id(p.id)
        if known is None:
            out.append(f"profile {p.name} (id {p.id}) is not in the catalog for {model.name}")
            continue
        if known.name != p.name:
            out.append(f"profile id {p.id}: NVML names it {p.name}, catalog {known.name}")
        want = tuple((s, known.size) for s in known.starts)
        if p.placements != want:
            out.append(f"{p.name}: NVML placements {p.placements}, catalog {want}")
        if p.instance_count != known.max_count:
            out.append(f"{p.name}: NVML max {p.instance_count}, catalog {known.max_count}")
    for known in model.profiles:
        if known.id not in seen:
            out.append(f"catalog profile {known.name} (id {known.id}) not reported by NVML")
    return out
