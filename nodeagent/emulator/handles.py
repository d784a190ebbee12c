"""Emulated NVML handles: real pynvml ctypes pointer types whose address encodes an object.

Callers treat handles as opaque, store them in the ctypes arrays pynvml's list calls fill,
and read them back out of info structs (`c_nvmlGpuInstanceInfo_t.device`), so emulated
handles must be the same ctypes types as real ones. The "address" is never dereferenced;
it packs what the handle names:

    bits 0-3 kind | 4-11 GPU index | 12-15 GI id | 16-19 CI id | 20-51 serial | 52-59 node

The serial is the GI's (for GI handles) or CI's (for CI and MIG-device handles) creation
serial, so a handle to a destroyed instance stays invalid even when the same id is reused.
The node tag (a hash of the node name) makes a handle of one emulated node invalid on
another, as it would be in two real NVML processes (one agent may serve many nodes).
"""

from __future__ import annotations

import ctypes
import zlib
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import pynvml


class Kind(IntEnum):
    DEVICE = 1
    MIG_DEVICE = 2
    GPU_INSTANCE = 3
    COMPUTE_INSTANCE = 4
    EVENT_SET = 5


_POINTER_TYPES: dict[Kind, Any] = {
    Kind.DEVICE: pynvml.c_nvmlDevice_t,
    Kind.MIG_DEVICE: pynvml.c_nvmlDevice_t,
    Kind.GPU_INSTANCE: pynvml.c_nvmlGpuInstance_t,
    Kind.COMPUTE_INSTANCE: pynvml.c_nvmlComputeInstance_t,
    Kind.EVENT_SET: pynvml.c_nvmlEventSet_t,
}


@dataclass(frozen=True, slots=True)
class Ref:
    kind: Kind
    gpu: int = 0
    gi: int = 0
    ci: int = 0
    serial: int = 0
    node: int = 0  # node_tag() of the node the handle belongs to

    def address(self) -> int:
        return (
            int(self.kind)
            | (self.gpu & 0xFF) << 4
            | (self.gi & 0xF) << 12
            | (self.ci & 0xF) << 16
            | (self.serial & 0xFFFFFFFF) << 20
            | (self.node & 0xFF) << 52
        )


def node_tag(node: str) -> int:
    return zlib.crc32(node.encode()) & 0xFF


def make(ref: Ref) -> Any:
    """The ctypes handle for `ref` (c_nvmlDevice_t, c_nvmlGpuInstance_t, ...)."""
    return ctypes.cast(ctypes.c_void_p(ref.address()), _POINTER_TYPES[ref.kind])


def read(handle: object) -> Ref | None:
    """What an emulated handle names; None for anything else (NULL, garbage, foreign)."""
    if not isinstance(handle, ctypes._Pointer):
        return None
    address = ctypes.cast(handle, ctypes.c_void_p).value
    if not address or address >> 60:
        return None
    try:
        kind = Kind(address & 0xF)
    except ValueError:
        return None
    return Ref(
        kind=kind,
        gpu=(address >> 4) & 0xFF,
        gi=(address >> 12) & 0xF,
        ci=(address >> 16) & 0xF,
        serial=(address >> 20) & 0xFFFFFFFF,
        node=(address >> 52) & 0xFF,
    )
