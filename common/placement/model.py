"""The placement engine's plain data: a cluster snapshot in, a Placement or a Pending out.

Frozen dataclasses only; no behaviour beyond small derived keys. The caller (the allocator,
the trace replayer, the benchmark) builds these from whatever it watches; free resources are
already net of what is bound to or promised on each node.

`Gpu` and `NodeState` precompute a string key of their state at construction (strings cache
their hash), so the engine can group identical GPUs and nodes across a 1000-node snapshot
with one dictionary lookup each instead of re-hashing nested tuples on every decision. A
caller that changes a node builds a new `NodeState` (a few microseconds); untouched nodes
are reused as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

from common.catalog import GpuModel
from common.placement import geometry as geometry_module

_EMPTY: Mapping[str, str] = MappingProxyType({})


def _empty() -> Mapping[str, str]:
    return _EMPTY


# Separators of the derived keys: ASCII control characters, which no model or profile name
# holds, so a key can be split back into its parts (parse_node_key).
_GPU_SEP, _FIELD_SEP, _OCC_SEP, _SUB_SEP = "\x1d", "\x1e", "\x1f", "\x1c"

GpuKeyParts = tuple[str, bool, tuple[tuple[int, int, str], ...]]


def parse_hw_key(key: str) -> tuple[tuple[str, bool], ...]:
    """`NodeState.hw_key` back to (model, usable) per GPU."""
    if not key:
        return ()
    return tuple(
        (model, flag == "u") for model, flag in (g.split(_FIELD_SEP) for g in key.split(_GPU_SEP))
    )


def gpu_keys(key: str) -> list[str]:
    """`NodeState.gpu_key` split into its GPUs' `Gpu.key`s, in index order."""
    return key.split(_GPU_SEP) if key else []


def parse_gpu_key(key: str) -> GpuKeyParts:
    """`Gpu.key` back to (model, usable, ((start, size, profile), ...))."""
    model, state, parts = key.split(_FIELD_SEP)
    occ = []
    if parts:
        for part in parts.split(_OCC_SEP):
            start, size, profile = part.split(_SUB_SEP)
            occ.append((int(start), int(size), profile))
    return model, state == "u", tuple(occ)


def parse_node_key(key: str) -> tuple[GpuKeyParts, ...]:
    """`NodeState.gpu_key` back to (model, usable, ((start, size, profile), ...)) per GPU."""
    return tuple(parse_gpu_key(gpu) for gpu in gpu_keys(key))


@dataclass(frozen=True, slots=True)
class Taint:
    key: str
    value: str = ""
    effect: str = "NoSchedule"  # NoSchedule | PreferNoSchedule | NoExecute


@dataclass(frozen=True, slots=True)
class Toleration:
    key: str = ""  # "" with operator Exists tolerates every taint
    operator: str = "Equal"  # Equal | Exists
    value: str = ""
    effect: str = ""  # "" tolerates every effect


@dataclass(frozen=True, slots=True)
class NodeSelectorRequirement:
    key: str
    operator: str  # In | NotIn | Exists | DoesNotExist | Gt | Lt
    values: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Occupied:
    """A GPU instance that exists or is promised: memory slots [start, start + size)."""

    start: int
    size: int
    profile: str

    @property
    def mask(self) -> int:
        return ((1 << self.size) - 1) << self.start


@dataclass(frozen=True, slots=True)
class Gpu:
    index: int  # the GPU's index on its node (what PlacedSlice.gpu_index names)
    model: str  # the model's name, e.g. "H100-80GB" (a catalog name unless `geometry` is set)
    mig_enabled: bool = True
    healthy: bool = True
    occupied: tuple[Occupied, ...] = ()
    # The GPU's own profile table (what its node published), when it is not the catalog's
    # entry for `model`: a model in no catalog, or one whose driver differs (geometry.py).
    geometry: GpuModel | None = None
    # Derived at construction: the GPU's state as a string, equal for interchangeable GPUs,
    # and the name the engine finds its tables by (`model`, or the geometry's token).
    key: str = field(init=False, repr=False, compare=False)
    mask: int = field(init=False, repr=False, compare=False)
    tables_key: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        tables_key = self.model if self.geometry is None else geometry_module.token(self.geometry)
        object.__setattr__(self, "tables_key", tables_key)
        occ = sorted(self.occupied, key=lambda o: (o.start, o.size, o.profile))
        mask = 0
        for o in occ:
            mask |= o.mask
        parts = _OCC_SEP.join(f"{o.start}{_SUB_SEP}{o.size}{_SUB_SEP}{o.profile}" for o in occ)
        state = "u" if self.mig_enabled and self.healthy else ("d" if self.healthy else "x")
        object.__setattr__(self, "key", _FIELD_SEP.join((tables_key, state, parts)))
        object.__setattr__(self, "mask", mask)

    @property
    def usable(self) -> bool:
        return self.mig_enabled and self.healthy


@dataclass(frozen=True, slots=True)
class NodeState:
    name: str
    labels: Mapping[str, str] = field(default_factory=_empty)
    taints: tuple[Taint, ...] = ()
    unschedulable: bool = False
    cpu_millis_free: int = 0
    memory_bytes_free: int = 0
    pods_free: int = 0
    gpus: tuple[Gpu, ...] = ()
    # Derived: the GPU states in index order (node-level grouping key), and the hardware
    # alone — models and usability, no occupancy (what a node can ever offer).
    gpu_key: str = field(init=False, repr=False, compare=False)
    hw_key: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "gpu_key", _GPU_SEP.join(g.key for g in self.gpus))
        hw = _GPU_SEP.join(
            f"{g.tables_key}{_FIELD_SEP}{'u' if g.usable else 'x'}" for g in self.gpus
        )
        object.__setattr__(self, "hw_key", hw)


@dataclass(frozen=True, slots=True)
class Snapshot:
    nodes: tuple[NodeState, ...]


@dataclass(frozen=True, slots=True)
class SliceRequest:
    container: str
    profile: str  # NVIDIA spelling, e.g. "3g.40gb" or "1g.18gb+me"
    count: int = 1


@dataclass(frozen=True, slots=True)
class PodRequest:
    """One pod's ask. Sidecars' slices are listed like any other container's: each container
    gets its own slices for the pod's lifetime; init containers that are not sidecars never
    ask (docs/placement.md). cpu/memory are the pod's effective requests (the scheduler's:
    max of init, sum of app and sidecars, plus overhead)."""

    name: str
    cpu_millis: int = 0
    memory_bytes: int = 0
    slices: tuple[SliceRequest, ...] = ()
    node_selector: Mapping[str, str] = field(default_factory=_empty)
    # requiredDuringSchedulingIgnoredDuringExecution: OR of terms, each an AND of requirements.
    required_affinity: tuple[tuple[NodeSelectorRequirement, ...], ...] = ()
    tolerations: tuple[Toleration, ...] = ()


@dataclass(frozen=True, slots=True)
class PlacedSlice:
    container: str
    profile: str
    gpu_index: int
    start: int
    size: int


@dataclass(frozen=True, slots=True)
class Placement:
    node: str
    slices: tuple[PlacedSlice, ...]  # in request order (count expanded in place)


class Policy(StrEnum):
    """How to choose among legal placements (engine.py describes each)."""

    INSTASLICE = "instaslice"
    FIRST_FIT = "first-fit"
    SPREAD = "spread"
    STATIC_BALANCED = "static-balanced"


class PendingReason(StrEnum):
    """Why a pod cannot be placed now (docs/contract.md §4 AllocationPending)."""

    NO_PROFILE = "NoProfile"  # no GPU model in the cluster offers a requested profile
    FULL = "Full"  # GPUs that offer it exist but have no room
    FRAGMENTED = "Fragmented"  # enough free slots in total, none at a legal start
    NODE_RESOURCES = "NodeResources"  # GPUs would fit; node cpu/memory/pods short
    GPU_UNAVAILABLE = "GpuUnavailable"  # the GPUs that offer it are unhealthy / MIG off
    NO_MATCHING_NODE = "NoMatchingNode"  # nodeSelector / affinity / taints exclude all
    NEEDS_MIG_MODE_CHANGE = "NeedsMigModeChange"  # fits only after a reset (modes.py)
    MIG_MODE_CHANGE_UNDER_WAY = "MigModeChangeUnderWay"  # fits once one asked is done


@dataclass(frozen=True, slots=True)
class Pending:
    reason: PendingReason
    message: str
