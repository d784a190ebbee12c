"""Wire shapes of InstaSlice's objects (docs/contract.md §3) and small builders/readers.

TypedDicts describe the JSON as it travels; the CRD schemas in manifests/base/crds are the
validating source of truth. The SliceAllocation model (parse and build) is common.allocation.
"""

from __future__ import annotations

import enum
import hashlib
import secrets
import string
from collections.abc import Mapping
from typing import Any, NotRequired, TypedDict

from common.constants import (
    API_VERSION,
    MIG_MAX_INSTANCES,
    MIG_MAX_MEMORY_SLOTS,
    MIG_MAX_MODEL_NAME,
    MIG_MAX_PROFILES,
    MIG_MAX_TABLE_PLACEMENTS,
    MIG_NODE_KIND,
    NODE_LABEL,
)

Obj = dict[str, Any]


class Phase(enum.StrEnum):
    PENDING = "Pending"
    CREATING = "Creating"
    READY = "Ready"
    RELEASING = "Releasing"
    FAILED = "Failed"


class SliceSpec(TypedDict):
    container: str
    profile: str
    gpuUUID: str
    gpuIndex: NotRequired[int]
    start: int
    size: int
    kind: NotRequired[str]  # mig (default) | gpu


class SliceStatus(TypedDict):
    container: str
    migUUID: NotRequired[str]  # a whole GPU: its GPU UUID (what NVIDIA_VISIBLE_DEVICES names)
    giID: NotRequired[int]
    ciID: NotRequired[int]
    gpuUUID: NotRequired[str]  # whole GPUs only


class AllocationSpec(TypedDict):
    podName: str
    podUID: str
    nodeName: str
    slices: list[SliceSpec]


class AllocationStatus(TypedDict, total=False):
    phase: str
    message: str
    bootID: str
    slices: list[SliceStatus]
    conditions: list[Obj]


class SlotRange(TypedDict):
    start: int
    size: int


class MigProfileStatus(TypedDict):
    name: str
    id: int
    memoryMiB: int
    multiprocessors: int
    maxCount: int
    placements: list[SlotRange]
    computeSlices: NotRequired[int]
    engines: NotRequired[Engines]


class Engines(TypedDict):
    """Engines of one GPU instance of a profile, as NVML's profile info counts them."""

    ce: int
    dec: int
    enc: int
    jpeg: int
    ofa: int


class MigSliceStatus(TypedDict):
    profile: str
    start: int
    size: int
    migUUID: str
    claim: NotRequired[str]
    # made ahead of demand, no pod's: free capacity that costs no NVML call to use
    # (docs/warm-slices.md)
    warm: NotRequired[bool]


class MigMode(TypedDict):
    current: str
    pending: str


class ModeChangeStatus(TypedDict):
    phase: str  # Changing | Draining | Resetting | Failed
    target: NotRequired[str]
    reason: NotRequired[str]  # DrainTimedOut: a Failed ask given up (not retried)
    message: NotRequired[str]
    time: NotRequired[str]


# "from" is a Python keyword: the functional form
LastModeChangeStatus = TypedDict("LastModeChangeStatus", {"from": str, "to": str, "time": str})


class GpuStatus(TypedDict):
    index: int
    uuid: str
    model: str
    migMode: MigMode
    healthy: bool
    message: NotRequired[str]
    profiles: list[MigProfileStatus]
    slices: list[MigSliceStatus]
    # MIG mode on demand (all optional: older agents do not write them)
    architecture: NotRequired[str]
    modeToggle: NotRequired[str]  # resetless | reset | none
    computeProcesses: NotRequired[int]
    modeChange: NotRequired[ModeChangeStatus]
    lastModeChange: NotRequired[LastModeChangeStatus]


def gpu_out_of_bounds(gpu: Mapping[str, Any]) -> str | None:
    """Why a MigNode GPU entry lies beyond the bounds of common.constants (`MIG_MAX_*`: the
    CRD's), or None. Only lengths and integers are read, so the answer costs what the entry's
    size does, whatever it claims: a GPU is refused before any table is built from it
    (docs/security.md). The entry's shape past that (names, ids, counts) is the reader's."""
    model = gpu.get("model", "")
    if not isinstance(model, str) or len(model) > MIG_MAX_MODEL_NAME:
        return f"its model name is longer than {MIG_MAX_MODEL_NAME} characters"
    profiles = gpu.get("profiles") or []
    if not isinstance(profiles, list) or len(profiles) > MIG_MAX_PROFILES:
        return f"it lists more than {MIG_MAX_PROFILES} profiles"
    shapes: set[tuple[tuple[int, int], ...]] = set()
    for p in profiles:
        placements = p.get("placements") or [] if isinstance(p, Mapping) else None
        if not isinstance(placements, list) or len(placements) > MIG_MAX_MEMORY_SLOTS:
            return f"a profile lists more than {MIG_MAX_MEMORY_SLOTS} placements"
        for r in placements:
            if not _in_slots(r):
                return f"a placement of profile {short_value(p.get('name'))} {_range(r)}"
        shapes.add(tuple(sorted((r.get("start", 0), r.get("size", 1)) for r in placements)))
    if sum(map(len, shapes)) > MIG_MAX_TABLE_PLACEMENTS:
        return f"its profiles' distinct placements number more than {MIG_MAX_TABLE_PLACEMENTS}"
    slices = gpu.get("slices") or []
    if not isinstance(slices, list) or len(slices) > MIG_MAX_INSTANCES:
        return f"it lists more than {MIG_MAX_INSTANCES} instances"
    for r in slices:
        if not _in_slots(r):
            return f"an instance {_range(r)}"
    return None


def _in_slots(r: object) -> bool:
    """A {start, size} inside MIG_MAX_MEMORY_SLOTS (size 1 when absent, as readers take it)."""
    if not isinstance(r, Mapping):
        return False
    start, size = r.get("start", 0), r.get("size", 1)
    if type(start) is not int or type(size) is not int:
        return False
    return start >= 0 and size >= 1 and start + size <= MIG_MAX_MEMORY_SLOTS


def _range(r: object) -> str:
    if not isinstance(r, Mapping):
        return "is not a {start, size}"
    return (
        f"(start {short_value(r.get('start'))}, size {short_value(r.get('size'))}) "
        f"lies beyond {MIG_MAX_MEMORY_SLOTS} memory slots"
    )


def short_value(value: object) -> str:
    """A published value for a message, cut short (a huge int is never converted whole)."""
    if type(value) is int:
        return str(value) if value.bit_length() <= 64 else "(a huge integer)"
    text = value if isinstance(value, str) else "?"
    return text if len(text) <= 24 else text[:21] + "..."


_ALNUM = string.ascii_lowercase + string.digits


def new_claim_id() -> str:
    """A fresh random DNS-1123 label (starts with a letter), unique per pod."""
    return "c" + "".join(secrets.choice(_ALNUM) for _ in range(15))


class DesiredGpu(TypedDict):
    """MigNode `spec.gpus[]`: an Ampere maintenance ask (docs/contract.md §3)."""

    uuid: str
    desiredMigMode: str  # enabled | disabled


DESIRED_MIG_MODES = ("enabled", "disabled")


def desired_modes(mig_node: Mapping[str, Any]) -> dict[str, str]:
    """GPU UUID → `spec.gpus[].desiredMigMode` of a MigNode (entries the CRD's enum would
    refuse are skipped)."""
    spec = mig_node.get("spec")
    gpus = spec.get("gpus") if isinstance(spec, dict) else None
    out: dict[str, str] = {}
    for g in gpus if isinstance(gpus, list) else []:
        if isinstance(g, dict) and g.get("desiredMigMode") in DESIRED_MIG_MODES:
            out[str(g.get("uuid", ""))] = str(g["desiredMigMode"])
    return out


_LABEL_VALUE_MAX = 63
_DIGEST_LEN = 12


def node_label_value(node: str) -> str:
    """The value of the label `instaslice.io/node` on Node `node` (docs/contract.md §3): its
    name when that is a label value (at most 63 characters); a longer name (a DNS subdomain
    may have 253) is cut to 50 and ends with `-` and 12 hex digits of its sha256, so every
    node has one value and the allocator computes the same as the agent."""
    if len(node) <= _LABEL_VALUE_MAX:
        return node
    digest = hashlib.sha256(node.encode()).hexdigest()[:_DIGEST_LEN]
    return f"{node[: _LABEL_VALUE_MAX - _DIGEST_LEN - 1]}-{digest}"


def node_labelled(labels: Mapping[str, str], node: str) -> bool:
    """Node `node` carries its own `instaslice.io/node` (its agent wrote it)."""
    return labels.get(NODE_LABEL) == node_label_value(node)


def mig_node(node: str) -> Obj:
    return {"apiVersion": API_VERSION, "kind": MIG_NODE_KIND, "metadata": {"name": node}}
