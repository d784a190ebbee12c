"""The MIG catalog: what each GPU model offers, as frozen data.

Loaded once from `models.json` (data, not code; every value traced to
shared/reference/mig.md or shared/hardware/). Fields marked inferred there are listed in
each entry's `inferred`. The placement axis is memory slots: a profile occupies
`[start, start + memory_slots)` and may only start at one of its listed `starts`.

The catalog does not talk to NVML: the node agent compares what NVML reports against it and
NVML wins on disagreement (with a warning); the allocator plans with what the node agent
published, falling back to the catalog for models it has not seen yet.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

ENGINE_NAMES = ("ce", "dec", "enc", "jpeg", "ofa")


@dataclass(frozen=True, slots=True)
class Engines:
    """Copy engines, decoders, encoders, JPEG decoders and optical-flow accelerators of a GI."""

    ce: int = 0
    dec: int = 0
    enc: int = 0
    jpeg: int = 0
    ofa: int = 0

    def __add__(self, other: Engines) -> Engines:
        return Engines(*(a + b for a, b in zip(self.as_tuple(), other.as_tuple(), strict=True)))

    def fits_within(self, limit: Engines) -> bool:
        return all(a <= b for a, b in zip(self.as_tuple(), limit.as_tuple(), strict=True))

    def as_tuple(self) -> tuple[int, int, int, int, int]:
        return (self.ce, self.dec, self.enc, self.jpeg, self.ofa)


@dataclass(frozen=True, slots=True)
class Profile:
    """One GPU-instance profile of one model (a row of `nvidia-smi mig -lgip`)."""

    name: str  # NVIDIA spelling, e.g. "1g.18gb+me"
    enum: int  # NVML_GPU_INSTANCE_PROFILE_* value passed to GetGpuInstanceProfileInfo
    id: int  # info.id, what nvidia-smi prints and Create*/Placements take
    compute_slices: int
    memory_slots: int  # placement size
    max_count: int
    starts: tuple[int, ...]
    memory_mib: int
    multiprocessors: int
    engines: Engines
    default_ci: int  # NVML_COMPUTE_INSTANCE_PROFILE_* enum of the default compute instance
    inferred: frozenset[str] = frozenset()

    @property
    def size(self) -> int:
        return self.memory_slots

    def mask(self, start: int) -> int:
        """Bitmask of the memory slots a GI of this profile at `start` occupies."""
        return ((1 << self.memory_slots) - 1) << start


@dataclass(frozen=True, slots=True)
class GpuModel:
    name: str  # catalog name, e.g. "H200-141GB"
    architecture: str  # ampere | hopper | blackwell
    nvml_arch: int  # nvmlDeviceGetArchitecture value
    pci_device_ids: tuple[int, ...]
    product_names: tuple[str, ...]
    memory_total_mib: int
    memory_slots: int
    compute_slices: int
    profiles: tuple[Profile, ...]
    source: str
    inferred: frozenset[str] = frozenset()
    _by_name: dict[str, Profile] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._by_name.update({p.name: p for p in self.profiles})

    def profile(self, name: str) -> Profile | None:
        return self._by_name.get(name)

    def profile_by_id(self, profile_id: int) -> Profile | None:
        return next((p for p in self.profiles if p.id == profile_id), None)

    def profile_by_enum(self, enum: int) -> Profile | None:
        return next((p for p in self.profiles if p.enum == enum), None)

    @property
    def full_engines(self) -> Engines:
        """Engine pool of the whole GPU: that of its largest (full) profile."""
        return max(self.profiles, key=lambda p: (p.memory_slots, p.compute_slices)).engines

    @property
    def resets_for_mig_mode(self) -> bool:
        """Ampere needs a GPU reset to change MIG mode; Hopper and newer switch at once."""
        return self.architecture == "ampere"


@dataclass(frozen=True, slots=True)
class Catalog:
    models: tuple[GpuModel, ...]

    def model(self, name: str) -> GpuModel | None:
        return next((m for m in self.models if m.name == name), None)

    def model_by_pci(self, pci_device_id: int) -> GpuModel | None:
        return next((m for m in self.models if pci_device_id in m.pci_device_ids), None)

    def model_by_product_name(self, product: str) -> GpuModel | None:
        return next((m for m in self.models if product in m.product_names), None)

    def models_offering(self, profile_name: str) -> tuple[GpuModel, ...]:
        return tuple(m for m in self.models if m.profile(profile_name) is not None)

    def profile_names(self) -> frozenset[str]:
        return frozenset(p.name for m in self.models for p in m.profiles)


def _profile(raw: dict[str, Any]) -> Profile:
    return Profile(
        name=raw["name"],
        enum=raw["enum"],
        id=raw["id"],
        compute_slices=raw["computeSlices"],
        memory_slots=raw["memorySlots"],
        max_count=raw["maxCount"],
        starts=tuple(raw["starts"]),
        memory_mib=raw["memoryMiB"],
        multiprocessors=raw["multiprocessors"],
        engines=Engines(**raw["engines"]),
        default_ci=raw["defaultCi"],
        inferred=frozenset(raw.get("inferred", ())),
    )


def parse_catalog(doc: dict[str, Any]) -> Catalog:
    models = []
    for raw in doc["models"]:
        models.append(
            GpuModel(
                name=raw["name"],
                architecture=raw["architecture"],
                nvml_arch=raw["nvmlArch"],
                pci_device_ids=tuple(int(x, 16) for x in raw["pciDeviceIds"]),
                product_names=tuple(raw["productNames"]),
                memory_total_mib=raw["memoryTotalMiB"],
                memory_slots=raw["memorySlots"],
                compute_slices=raw["computeSlices"],
                profiles=tuple(_profile(p) for p in raw["profiles"]),
                source=raw["source"],
                inferred=frozenset(raw.get("inferred", ())),
            )
        )
    return Catalog(models=tuple(models))


@cache
def load_catalog() -> Catalog:
    """The built-in catalog (parsed once, on first use; nothing happens at import)."""
    text = resources.files(__name__).joinpath("models.json").read_text()
    return parse_catalog(json.loads(text))
