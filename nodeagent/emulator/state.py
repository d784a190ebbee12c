"""The emulated node as plain, frozen data: GPUs, GPU/compute instances, processes, faults.

This module only defines shapes and a few lookups; the rules that change a state live in
`rules.py` (pure functions) and the file they are kept in is `store.py`. Nothing here knows
about `pynvml`: error codes below are the nvml.h values (a unit test pins them to pynvml's).

Identity: GPU-instance and compute-instance ids are what NVML reports (opaque to callers);
`serial` is an emulator-private number, never reused on a node, so a handle to an instance
that was destroyed and re-created at the same spot is recognised as stale.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Final, Literal

from common.catalog import GpuModel, load_catalog

# nvml.h return codes (the subset the emulator produces).
SUCCESS: Final = 0
UNINITIALIZED: Final = 1
INVALID_ARGUMENT: Final = 2
NOT_SUPPORTED: Final = 3
NOT_FOUND: Final = 6
INSUFFICIENT_SIZE: Final = 7
DRIVER_NOT_LOADED: Final = 9
TIMEOUT: Final = 10
FUNCTION_NOT_FOUND: Final = 13
GPU_IS_LOST: Final = 15
RESET_REQUIRED: Final = 16
IN_USE: Final = 19
INSUFFICIENT_RESOURCES: Final = 23

MIG_DISABLE: Final = 0
MIG_ENABLE: Final = 1

# NVML_VALUE_NOT_AVAILABLE for unsigned ids: "no GPU/compute instance" in events and processes.
NO_ID: Final = 0xFFFFFFFF
EVENT_XID: Final = 0x8  # nvmlEventTypeXidCriticalError
XID_FELL_OFF_BUS: Final = 79
EVENT_HISTORY: Final = 256  # events kept in the state file for event sets to read

Op = Literal["create_gi", "create_ci", "destroy_ci", "destroy_gi", "set_mig_mode"]
OPS: Final[tuple[Op, ...]] = ("create_gi", "create_ci", "destroy_ci", "destroy_gi", "set_mig_mode")


@dataclass(frozen=True, slots=True)
class Rejected:
    """An NVML call the rules refuse: the nvml.h code to return and a reason for humans."""

    code: int
    reason: str


@dataclass(frozen=True, slots=True)
class ComputeInstance:
    id: int
    profile: int  # NVML_COMPUTE_INSTANCE_PROFILE_* enum; NVML reports it as the CI profile id
    start: int  # compute slices inside the GPU instance
    size: int
    uuid: str  # "MIG-<uuid>" of the MIG device this CI is; new on every creation
    mig_index: int  # its index for nvmlDeviceGetMigDeviceHandleByIndex
    serial: int
    processes: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class GpuInstance:
    id: int
    profile_id: int  # GI profile id (info.id), not the enum
    start: int  # memory slots
    size: int
    serial: int
    cis: tuple[ComputeInstance, ...] = ()

    def ci(self, ci_id: int) -> ComputeInstance | None:
        return next((c for c in self.cis if c.id == ci_id), None)


@dataclass(frozen=True, slots=True)
class Gpu:
    index: int
    model: str  # catalog model name, or the name of `table`
    uuid: str
    mig_current: int
    mig_pending: int
    lost: bool = False
    processes: tuple[int, ...] = ()  # clients of the whole GPU (not of a MIG device)
    gis: tuple[GpuInstance, ...] = ()
    # A model defined only by a table file (a GPU in no catalog); None: the catalog's.
    table: GpuModel | None = None

    @property
    def spec(self) -> GpuModel:
        if self.table is not None:
            return self.table
        found = load_catalog().model(self.model)
        if found is None:  # a state file naming a model this catalog lacks
            raise LookupError(f"GPU {self.index}: unknown model {self.model!r}")
        return found

    def gi(self, gi_id: int) -> GpuInstance | None:
        return next((g for g in self.gis if g.id == gi_id), None)

    def all_processes(self) -> tuple[int, ...]:
        on_mig = tuple(p for g in self.gis for c in g.cis for p in c.processes)
        return self.processes + on_mig


@dataclass(frozen=True, slots=True)
class FailRule:
    """Fail `count` calls of `op` with `code`, after letting `skip` calls through."""

    op: Op
    code: int
    count: int = 1
    skip: int = 0


@dataclass(frozen=True, slots=True)
class Settings:
    """Per-node knobs another process (a test, `make chaos`) may set."""

    create_ms: int = 0  # added to every GI/CI create
    destroy_ms: int = 0  # added to every GI/CI destroy
    # Driver 580 on the H200 answered RemainingCapacity with MIG disabled although nvml.h
    # documents NOT_SUPPORTED; True copies the hardware.
    capacity_without_mig: bool = True
    fail: tuple[FailRule, ...] = ()
    mode_ms: int = 0  # added to every MIG mode change that takes effect (SetMigMode, reset)
    # A pass-through VM guest [INF, from nvml.h and gpu-operator#1606]: SetMigMode only records
    # the pending mode (RESET_REQUIRED) on every architecture, and `reset_gpu` is refused.
    vm: bool = False
    # Hopper+ SetMigMode(DISABLE) while GPU instances exist [INF, unverified (design R1.1)]:
    # "in_use" refuses it (mig-parted always destroys them first); "destroy" drops them.
    disable_with_instances: Literal["in_use", "destroy"] = "in_use"
    # GPUs (indexes) a driver client holds open — DCGM, dcgm-exporter, nvidia-persistenced
    # [INF, from gpu-operator#118 and the MIG user guide: "all daemons holding handles on
    # driver modules need to be stopped"]: `reset_gpu` is refused on them.
    driver_clients: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Event:
    seq: int
    gpu: int
    event_type: int
    data: int  # the XID for XID events
    gi_id: int = NO_ID
    ci_id: int = NO_ID


@dataclass(frozen=True, slots=True)
class EmulatorState:
    """Everything about one emulated node; what `<state dir>/<node>.json` holds."""

    node: str
    boot_id: str
    gpus: tuple[Gpu, ...]
    settings: Settings = field(default_factory=Settings)
    events: tuple[Event, ...] = ()  # the last EVENT_HISTORY events, oldest first
    next_serial: int = 1
    next_event: int = 1
    next_pid: int = 4000
    # The MIG mode the node was provisioned with (MIG_ENABLE/MIG_DISABLE; -1: unknown, an
    # older state file). `provision` compares the spec with it, not with the current mode,
    # which the agent may have changed on demand since.
    provisioned_mode: int = -1

    def gpu(self, index: int) -> Gpu | None:
        return self.gpus[index] if 0 <= index < len(self.gpus) else None

    def with_gpu(self, gpu: Gpu) -> EmulatorState:
        gpus = tuple(gpu if g.index == gpu.index else g for g in self.gpus)
        return replace(self, gpus=gpus)

    def find_uuid(self, uuid: str) -> tuple[Gpu, GpuInstance | None, ComputeInstance | None]:
        """The GPU (and GI/CI, for a MIG UUID) a UUID names; LookupError if none."""
        for g in self.gpus:
            if g.uuid == uuid:
                return g, None, None
            for gi in g.gis:
                for ci in gi.cis:
                    if ci.uuid == uuid:
                        return g, gi, ci
        raise LookupError(uuid)
