"""The placement engine: where a pod's MIG slices go (pure; see docs/placement.md)."""

from common.placement.engine import place
from common.placement.model import (
    Gpu,
    NodeSelectorRequirement,
    NodeState,
    Occupied,
    Pending,
    PendingReason,
    PlacedSlice,
    Placement,
    PodRequest,
    Policy,
    SliceRequest,
    Snapshot,
    Taint,
    Toleration,
)

__all__ = [
    "Gpu",
    "NodeSelectorRequirement",
    "NodeState",
    "Occupied",
    "Pending",
    "PendingReason",
    "PlacedSlice",
    "Placement",
    "PodRequest",
    "Policy",
    "SliceRequest",
    "Snapshot",
    "Taint",
    "Toleration",
    "place",
]
