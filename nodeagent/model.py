"""What the node agent knows about its GPUs, as frozen values (no NVML, no I/O).

`nodeagent.nvml` turns NVML answers into these; every decision module (`reconcile`,
`report`, `cdi`) works on them alone, so the same decisions are unit-tested without a GPU and
run unchanged against real `nvidia-ml-py` or the emulator. `NvmlFailure` is the one error type
the rest of the agent sees from the hardware: the NVML return code, classified once here.
"""

from __future__ import annotations

from dataclasses import dataclass

# nvml.h return codes the agent acts on (docs/mig-facts.md §3.4).
NVML_INVALID_ARGUMENT = 2
NVML_NOT_SUPPORTED = 3
NVML_NO_PERMISSION = 4
NVML_NOT_FOUND = 6
NVML_TIMEOUT = 10
NVML_GPU_IS_LOST = 15
NVML_RESET_REQUIRED = 16
NVML_IN_USE = 19
NVML_INSUFFICIENT_RESOURCES = 23

MIG_ENABLED = "enabled"
MIG_DISABLED = "disabled"


class NvmlFailure(Exception):
    """An NVML call failed; `code` is the nvml.h return code, `call` the function name."""

    def __init__(self, code: int, call: str, text: str) -> None:
        super().__init__(f"{call}: {text} (NVML error {code})")
        self.code = code
        self.call = call
        self.text = text

    @property
    def code_name(self) -> str:
        """`NVML_ERROR_IN_USE` and the like (the first word of `text`)."""
        return self.text.split(":", 1)[0]

    @property
    def in_use(self) -> bool:
        return self.code == NVML_IN_USE

    @property
    def not_found(self) -> bool:
        return self.code == NVML_NOT_FOUND

    @property
    def gpu_lost(self) -> bool:
        return self.code == NVML_GPU_IS_LOST


@dataclass(frozen=True, slots=True)
class ProfileInfo:
    """One GPU-instance profile as NVML reports it on one GPU."""

    name: str  # NVIDIA spelling without the "MIG " prefix, e.g. "1g.18gb+me"
    id: int  # info.id: what Create*/Placements take and nvidia-smi prints
    enum: int  # NVML_GPU_INSTANCE_PROFILE_* value it was read with
    slice_count: int
    instance_count: int
    memory_mib: int
    multiprocessors: int
    placements: tuple[tuple[int, int], ...]  # (start, size) in memory slots
    engines: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)  # ce, dec, enc, jpeg, ofa


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """One physical GPU of the node."""

    index: int
    uuid: str
    name: str  # product name, e.g. "NVIDIA H200"
    pci_device_id: int  # e.g. 0x233510DE
    minor: int  # /dev/nvidia<minor>
    mig_current: str  # MIG_ENABLED | MIG_DISABLED
    mig_pending: str
    memory_total_mib: int
    model: str  # catalog model name, or the product name when the catalog lacks it
    profiles: tuple[ProfileInfo, ...] = ()
    warnings: tuple[str, ...] = ()  # catalog disagreements (NVML wins)
    architecture: str = ""  # ampere | hopper | blackwell | ... ("" unknown)
    compute_processes: int = 0  # nvmlDeviceGetComputeRunningProcesses on the whole GPU

    def profile(self, name: str) -> ProfileInfo | None:
        return next((p for p in self.profiles if p.name == name), None)

    def profile_by_id(self, profile_id: int) -> ProfileInfo | None:
        return next((p for p in self.profiles if p.id == profile_id), None)

    @property
    def mig_enabled(self) -> bool:
        return self.mig_current == MIG_ENABLED


@dataclass(frozen=True, slots=True)
class Instance:
    """A GPU instance that exists on a GPU, with its compute instance(s) if any."""

    gpu_index: int
    gpu_uuid: str
    gi_id: int
    profile_id: int
    start: int
    size: int
    ci_ids: tuple[int, ...] = ()
    mig_uuids: tuple[str, ...] = ()  # one per compute instance, same order as ci_ids

    @property
    def key(self) -> tuple[str, int]:
        return (self.gpu_uuid, self.gi_id)

    @property
    def mig_uuid(self) -> str | None:
        return self.mig_uuids[0] if self.mig_uuids else None


@dataclass(frozen=True, slots=True)
class Created:
    """Result of creating one slice's compute instance: ids and the MIG device UUID."""

    gi_id: int
    ci_id: int
    mig_uuid: str


@dataclass(frozen=True, slots=True)
class HealthEvent:
    """An NVML event that makes a GPU unhealthy (an XID, or the GPU fell off the bus)."""

    gpu_index: int
    kind: str  # "xid" | "lost"
    xid: int = 0
    gi_id: int | None = None
    ci_id: int | None = None

    @property
    def message(self) -> str:
        if self.kind == "lost":
            return "GPU is lost (fell off the bus or stopped answering NVML)"
        where = f" on GPU instance {self.gi_id}" if self.gi_id is not None else ""
        return f"XID {self.xid}{where}"


# Application-level XIDs that do not mean the GPU is broken (the NVIDIA device plugin skips
# the same set: graphics engine exception, GPU memory page fault, preemptive cleanup, ...).
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})


@dataclass(frozen=True, slots=True)
class Health:
    healthy: bool = True
    message: str = ""


@dataclass(frozen=True, slots=True)
class NodeInventory:
    """Everything discovery found on one node."""

    gpus: tuple[GpuInfo, ...]
    instances: tuple[Instance, ...] = ()
    driver_version: str = ""
    lost: tuple[int, ...] = ()  # GPUs that answered GPU_IS_LOST (placeholders in `gpus`)

    def gpu_by_uuid(self, uuid: str) -> GpuInfo | None:
        return next((g for g in self.gpus if g.uuid == uuid), None)

    def gpu_by_index(self, index: int) -> GpuInfo | None:
        return next((g for g in self.gpus if g.index == index), None)
