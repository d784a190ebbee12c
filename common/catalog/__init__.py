"""The MIG catalog: what each GPU model offers, as frozen data.

Loaded once from `models.json` (data, not code; every value traced to
docs/mig-facts.md or tests/data/). Fields marked inferred there are listed in
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
from pathlib import Path
from typing import Any

import yaml

from common.constants import MIG_MAX_MEMORY_SLOTS

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


class CatalogError(ValueError):
    """A model table that cannot be understood; the message names the entry and field."""


def _field(raw: Any, key: str, where: str) -> Any:
    if not isinstance(raw, dict):
        raise CatalogError(f"{where}: not an object")
    if key not in raw:
        raise CatalogError(f"{where}: missing field {key!r}")
    return raw[key]


def _int(raw: Any, key: str, where: str, minimum: int = 0) -> int:
    value = _field(raw, key, where)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise CatalogError(f"{where}.{key}: {value!r} is not an integer >= {minimum}")
    return value


def _profile(raw: dict[str, Any], where: str = "profile") -> Profile:
    engines = _field(raw, "engines", where)
    if not isinstance(engines, dict) or not set(engines) <= set(ENGINE_NAMES):
        raise CatalogError(f"{where}.engines: an object with keys among {ENGINE_NAMES}")
    starts = _field(raw, "starts", where)
    if not isinstance(starts, list) or not all(isinstance(s, int) and s >= 0 for s in starts):
        raise CatalogError(f"{where}.starts: a list of slot numbers >= 0")
    return Profile(
        name=str(_field(raw, "name", where)),
        enum=_int(raw, "enum", where),
        id=_int(raw, "id", where),
        compute_slices=_int(raw, "computeSlices", where, 1),
        memory_slots=_int(raw, "memorySlots", where, 1),
        max_count=_int(raw, "maxCount", where, 1),
        starts=tuple(starts),
        memory_mib=_int(raw, "memoryMiB", where),
        multiprocessors=_int(raw, "multiprocessors", where),
        engines=Engines(**{k: _int(engines, k, f"{where}.engines") for k in engines}),
        default_ci=_int(raw, "defaultCi", where),
        inferred=frozenset(raw.get("inferred", ())),
    )


def parse_model(raw: dict[str, Any], where: str = "model") -> GpuModel:
    """One model entry (the schema of `models.json`); CatalogError names a bad field."""
    profiles = _field(raw, "profiles", where)
    if not isinstance(profiles, list) or not profiles:
        raise CatalogError(f"{where}.profiles: a non-empty list")
    model = GpuModel(
        name=str(_field(raw, "name", where)),
        architecture=str(_field(raw, "architecture", where)),
        nvml_arch=_int(raw, "nvmlArch", where),
        pci_device_ids=tuple(int(x, 16) for x in _field(raw, "pciDeviceIds", where)),
        product_names=tuple(str(x) for x in _field(raw, "productNames", where)),
        memory_total_mib=_int(raw, "memoryTotalMiB", where, 1),
        memory_slots=_int(raw, "memorySlots", where, 1),
        compute_slices=_int(raw, "computeSlices", where, 1),
        profiles=tuple(_profile(p, f"{where}.profiles[{i}]") for i, p in enumerate(profiles)),
        source=str(raw.get("source", "")),
        inferred=frozenset(raw.get("inferred", ())),
    )
    if model.memory_slots > MIG_MAX_MEMORY_SLOTS:  # placement tables double with each slot
        raise CatalogError(f"{where}.memorySlots: at most {MIG_MAX_MEMORY_SLOTS}")
    for i, p in enumerate(model.profiles):
        bad = [s for s in p.starts if s + p.memory_slots > model.memory_slots]
        if bad:
            raise CatalogError(
                f"{where}.profiles[{i}].starts: {bad} + size {p.memory_slots} run past the "
                f"{model.memory_slots} memory slots"
            )
    return model


def model_to_json(model: GpuModel) -> dict[str, Any]:
    """The inverse of `parse_model` (what an emulator state file keeps of a table model)."""
    return {
        "name": model.name,
        "architecture": model.architecture,
        "nvmlArch": model.nvml_arch,
        "pciDeviceIds": [f"{x:#010X}".replace("0X", "0x") for x in model.pci_device_ids],
        "productNames": list(model.product_names),
        "memoryTotalMiB": model.memory_total_mib,
        "memorySlots": model.memory_slots,
        "computeSlices": model.compute_slices,
        "source": model.source,
        "inferred": sorted(model.inferred),
        "profiles": [
            {
                "name": p.name,
                "enum": p.enum,
                "id": p.id,
                "computeSlices": p.compute_slices,
                "memorySlots": p.memory_slots,
                "maxCount": p.max_count,
                "starts": list(p.starts),
                "memoryMiB": p.memory_mib,
                "multiprocessors": p.multiprocessors,
                "engines": dict(zip(ENGINE_NAMES, p.engines.as_tuple(), strict=True)),
                "defaultCi": p.default_ci,
                "inferred": sorted(p.inferred),
            }
            for p in model.profiles
        ],
    }


def load_model_file(path: Path) -> GpuModel:
    """A GPU model defined by a table file alone (JSON or YAML, one `models.json` entry):
    how the emulator and `make dev-up` learn a model that is in no catalog."""
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise CatalogError(f"{path}: {exc}") from None
    if not isinstance(doc, dict):
        raise CatalogError(f"{path}: not a model table (an object)")
    return parse_model(doc, where=str(path))


def parse_catalog(doc: dict[str, Any]) -> Catalog:
    return Catalog(
        models=tuple(parse_model(raw, f"models[{i}]") for i, raw in enumerate(doc["models"]))
    )


@cache
def load_catalog() -> Catalog:
    """The built-in catalog (parsed once, on first use; nothing happens at import)."""
    text = resources.files(__name__).joinpath("models.json").read_text()
    return parse_catalog(json.loads(text))
