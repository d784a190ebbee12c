"""GPU models learned from what a node agent published (MigNode `status.gpus[].profiles`).

The node agent reports what NVML says each GPU offers: profile names and ids, instance
counts, placements, memory, SMs, and (since v1alpha1's additive `computeSlices` and
`engines`) compute slices and engines. That table, not the catalog, is what a GPU can do:
a model in no catalog is served from it, and a catalog model whose driver reports other
profiles or placements is planned with what the driver reports (NVML wins).

`Geometries.of(model, profiles)` answers with the `GpuModel` to plan a GPU with: None when
the catalog's entry for `model` says the same (the shared, cached catalog tables are used),
else the model learned from the published table. Answers are memoised per distinct table,
so a thousand nodes of one model share one object (and one set of engine tables).

What it cannot learn: the NVML enum of each profile and its default compute-instance
profile (the agent probes those itself), and, from an agent older than the `engines` field,
engine limits (then only counts, slots and SMs constrain the learned model).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from common.catalog import ENGINE_NAMES, Catalog, Engines, GpuModel, Profile
from common.profiles import ProfileNameError, parse_profile

# One published profile, reduced to what planning uses (hashable: the memo key).
_Row = tuple[str, int, int, tuple[tuple[int, int], ...], int, int, int | None, Engines | None]


def _row(raw: Mapping[str, Any]) -> _Row | None:
    try:
        placements = tuple(
            sorted((int(p["start"]), int(p["size"])) for p in raw.get("placements") or [])
        )
        engines = raw.get("engines")
        slices = raw.get("computeSlices")
        return (
            str(raw["name"]),
            int(raw["id"]),
            int(raw.get("maxCount") or 0),
            placements,
            int(raw.get("memoryMiB") or 0),
            int(raw.get("multiprocessors") or 0),
            None if slices is None else int(slices),
            None
            if not isinstance(engines, Mapping)
            else Engines(*(int(engines.get(k) or 0) for k in ENGINE_NAMES)),
        )
    except (KeyError, TypeError, ValueError):
        return None


def _compute_slices(row: _Row) -> int:
    if row[6] is not None:
        return row[6]
    try:
        return parse_profile(row[0]).gi_slices
    except ProfileNameError:
        return 1


def learn(name: str, rows: Sequence[_Row]) -> GpuModel | None:
    """A GpuModel from published rows; None when no row has a usable placement."""
    profiles = []
    for r in rows:
        sizes = {size for _, size in r[3]}
        if len(sizes) != 1 or r[2] <= 0:
            continue  # no placement, or sizes NVML never mixes: not placeable
        profiles.append(
            Profile(
                name=r[0],
                enum=-1,  # not published; the agent reads it from NVML itself
                id=r[1],
                compute_slices=_compute_slices(r),
                memory_slots=sizes.pop(),
                max_count=r[2],
                starts=tuple(s for s, _ in r[3]),
                memory_mib=r[4],
                multiprocessors=r[5],
                engines=r[7] or Engines(),
                default_ci=-1,
            )
        )
    if not profiles:
        return None
    return GpuModel(
        name=name,
        architecture="unknown",
        nvml_arch=0,
        pci_device_ids=(),
        product_names=(name,),
        memory_total_mib=max(p.memory_mib for p in profiles),  # the full profile's
        memory_slots=max(s + p.memory_slots for p in profiles for s in p.starts),
        compute_slices=max(p.compute_slices for p in profiles),
        profiles=tuple(profiles),
        source="learned from the node agent's MigNode (NVML)",
    )


def learn_profiles(name: str, profiles: Sequence[Mapping[str, Any]]) -> GpuModel | None:
    """`learn` from MigNode profile entries (`status.gpus[].profiles`) as published."""
    return learn(name, [r for r in (_row(p) for p in profiles) if r is not None])


def agrees(model: GpuModel, rows: Sequence[_Row]) -> bool:
    """Whether the published rows say what the catalog entry says, for planning."""
    if len(rows) != len(model.profiles):
        return False
    for r in rows:
        p = model.profile(r[0])
        if p is None or p.id != r[1] or p.max_count != r[2]:
            return False
        if r[3] != tuple((s, p.memory_slots) for s in sorted(p.starts)):
            return False
        if r[6] is not None and r[6] != p.compute_slices:
            return False
        if r[7] is not None and r[7] != p.engines:
            return False
    return True


class Geometries:
    """Memo of published tables -> the GpuModel to plan with (see the module docstring)."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self._memo: dict[tuple[str, tuple[_Row, ...]], GpuModel | None] = {}

    def of(self, model: str, profiles: Sequence[Mapping[str, Any]]) -> GpuModel | None:
        rows = tuple(r for r in (_row(p) for p in profiles) if r is not None)
        key = (model, rows)
        try:
            return self._memo[key]
        except KeyError:
            pass
        known = self.catalog.model(model)
        if known is not None and (not rows or agrees(known, rows)):
            found = None  # the catalog's entry (an older agent that published nothing: too)
        else:
            found = learn(model, rows)
        if len(self._memo) > 4096:  # bounded: tables come and go with driver upgrades
            self._memo.clear()
        self._memo[key] = found
        return found
