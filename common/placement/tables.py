"""Per-model placement tables and the per-GPU packing search, computed once and cached.

`model_tables(model)` turns a catalog `GpuModel` into bitmasks: for every profile its legal
starts and slot masks, engine vector and count limit; for every occupancy mask of the GPU
(256 on 8-slot parts, 4096 on the 12-unit RTX PRO) the *potential* — how many instances of
each placement shape could still be created, weighted by shape size squared. The potential
is what the `instaslice` policy protects: a candidate's loss is the drop in potential it
causes, so a 1g goes where it breaks the fewest 2-, 4- and 8-slot windows without stranding
a slot (slot 5 on an empty 8-slot GPU: the 4g start survives, and slot 7 stays usable by
the 1g(2xmem) at 6), and a GPU that is already broken is preferred to an intact one.

`mask_fit(tables, mask, demand, mode)` packs a small multiset of profiles into a GPU's free
slots — exhaustively, by the first slice's start and then the rest's own packing (`pack`,
LRU-cached), so each distinct (model, occupied slots, slices still to place) is solved once
however many GPUs, shares and demands reach it; `within_limits` checks the count, engine
and SM limits apart.
These caches are pure memoisation of pure functions; nothing else is kept between calls.
Each is an LRU with a cap: the allocator meets as many tables as node agents publish
(common/catalog/learned.py), so `model_tables` keeps the `MODEL_TABLES_CAP` last used, and
refuses a model past `MIG_MAX_MEMORY_SLOTS` (2^16 occupancy masks: docs/security.md) rather
than build a table that doubles with every slot. A table the allocator has not met yet is
built off its event loop (`warm`, from webhook/allocator/controller.py); these caches are
thread-safe (functools.lru_cache).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import IntEnum
from functools import lru_cache

from common.catalog import GpuModel
from common.constants import MIG_MAX_MEMORY_SLOTS

# A candidate's cost is loss * COST_SCALE + remaining potential of the GPUs it uses, so the
# loss decides and, among equal losses, the fuller GPU wins (best fit / pack).
COST_SCALE = 1 << 20

_BASE_NAME = re.compile(r"^[0-9]+g\.[0-9]+gb$")


class FitMode(IntEnum):  # an IntEnum: hashed in C, it is part of hot cache keys
    BEST = 0  # minimum loss of potential (the instaslice policy)
    LOWEST = 1  # lowest start first, first packing found (first fit, spread)
    STATIC = 2  # only the slices of the static all-balanced layout


@dataclass(frozen=True, eq=False, slots=True)
class ProfileTable:
    name: str
    index: int
    size: int
    starts: tuple[int, ...]
    masks: tuple[int, ...]
    max_count: int
    engines: tuple[int, ...]
    compute: int
    reach: int  # union of the masks: the slots this profile can ever use


@dataclass(frozen=True, eq=False, slots=True)
class ModelTables:
    """Identity-hashed (eq=False) so LRU keys that hold it hash in O(1)."""

    name: str
    slots: int
    profiles: dict[str, ProfileTable]
    by_index: tuple[ProfileTable, ...]
    potential: tuple[int, ...]  # indexed by occupancy mask
    full_engines: tuple[int, ...]
    compute_total: int
    layout: tuple[tuple[str, int], ...]  # static all-balanced layout: (profile, start)

    def offers(self, profile: str) -> bool:
        return profile in self.profiles


@dataclass(frozen=True, slots=True)
class GpuState:
    """What constrains new instances on one GPU: slots, per-profile counts, engines, SMs.
    Its hash is computed once (it keys the hot per-GPU caches)."""

    mask: int
    counts: tuple[int, ...]
    engines: tuple[int, ...]
    compute: int
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        h = hash((self.mask, self.counts, self.engines, self.compute))
        object.__setattr__(self, "_hash", h)

    def __hash__(self) -> int:
        return self._hash


@dataclass(frozen=True, slots=True)
class GpuFit:
    cost: int  # loss * COST_SCALE + potential left (BEST); 0 otherwise
    loss: int
    potential_after: int
    starts: tuple[int, ...]  # aligned with the demand tuple


# Weight of each free slot that is still usable; chosen on the benchmark (docs/placement.md).
_STRAND = 8


def _weight(size: int) -> int:
    return size * size


# Models whose tables are kept: every catalog model (10) and the tables nodes publish that
# differ from it (a handful per cluster), with room; more evicts the least recently used.
MODEL_TABLES_CAP = 64


class TableTooLarge(ValueError):
    """A model with more memory slots than MIG_MAX_MEMORY_SLOTS: no table is built for it."""


@lru_cache(maxsize=MODEL_TABLES_CAP)
def model_tables(model: GpuModel) -> ModelTables:
    if not 0 < model.memory_slots <= MIG_MAX_MEMORY_SLOTS:
        raise TableTooLarge(f"{model.name}: {model.memory_slots} memory slots")
    profiles: dict[str, ProfileTable] = {}
    by_index: list[ProfileTable] = []
    for i, p in enumerate(model.profiles):
        masks = tuple(p.mask(s) for s in p.starts)
        reach = 0
        for m in masks:
            reach |= m
        t = ProfileTable(
            name=p.name,
            index=i,
            size=p.memory_slots,
            starts=p.starts,
            masks=masks,
            max_count=p.max_count,
            engines=p.engines.as_tuple(),
            compute=p.compute_slices,
            reach=reach,
        )
        profiles[p.name] = t
        by_index.append(t)
    # Placement shapes: distinct (size, starts); variants (+me, -me, +gfx) share a shape.
    shapes: dict[tuple[int, tuple[int, ...]], int] = {}
    for t in by_index:
        key = (t.size, t.starts)
        shapes[key] = max(shapes.get(key, 0), t.max_count)
    shape_list = [
        (_weight(size), tuple(((1 << size) - 1) << s for s in starts), cap)
        for (size, starts), cap in shapes.items()
    ]
    potential = []
    all_masks = sorted({m for _, masks, _ in shape_list for m in masks})
    for occ in range(1 << model.memory_slots):
        v = 0
        for w, masks, cap in shape_list:
            free = sum(1 for m in masks if not occ & m)
            v += w * min(free, cap)
        if _STRAND:
            usable = 0
            for m in all_masks:
                if not occ & m:
                    usable |= m
            v += _STRAND * bin(usable).count("1")
        potential.append(v)
    return ModelTables(
        name=model.name,
        slots=model.memory_slots,
        profiles=profiles,
        by_index=tuple(by_index),
        potential=tuple(potential),
        full_engines=model.full_engines.as_tuple(),
        compute_total=model.compute_slices,
        layout=_balanced_layout(by_index, model.memory_slots),
    )


def warm(model: GpuModel) -> ModelTables:
    """`model`'s tables and every profile's `free_spots`: what the first decision on a GPU of
    it builds (`search.gpu_info`). Thread-safe; the allocator runs it off its event loop for
    a table it has not met, so the build, up to 2^16 masks, never stalls admission."""
    t = model_tables(model)
    for name in t.profiles:
        free_spots(t, name)
    return t


def _balanced_layout(profiles: list[ProfileTable], slots: int) -> tuple[tuple[str, int], ...]:
    """MIG Manager's `all-balanced`: 2x1g + 1x2g + 1x3g (no 3g on A30 / RTX PRO), each the
    smallest-memory plain profile of its compute size; the largest goes to its highest start,
    the rest to the lowest free start (the user guide's working order: 3g at 4, 1g at 0 and 1,
    2g at 2 on an A100)."""
    plain = [p for p in profiles if _BASE_NAME.match(p.name)]
    recipe: list[ProfileTable] = []
    for compute, count in ((3, 1), (2, 1), (1, 2)):
        options = [p for p in plain if p.compute == compute]
        if options:
            recipe.extend([min(options, key=lambda p: (p.size, p.name))] * count)
    recipe.sort(key=lambda p: -p.size)
    occ = 0
    layout: list[tuple[str, int]] = []
    for i, p in enumerate(recipe):
        order = sorted(zip(p.starts, p.masks, strict=True), reverse=(i == 0))
        for s, m in order:
            if not occ & m:
                occ |= m
                layout.append((p.name, s))
                break
    return tuple(sorted(layout, key=lambda e: e[1]))


def gpu_state(tables: ModelTables, occupied: tuple[tuple[int, int, str], ...]) -> GpuState:
    """State of a GPU from its occupied (start, size, profile) triples. A profile the model
    does not know still blocks its slots; its engines are unknown and not counted."""
    mask = 0
    counts = [0] * len(tables.by_index)
    engines = [0] * len(tables.full_engines)
    compute = 0
    for start, size, name in occupied:
        mask |= ((1 << size) - 1) << start
        t = tables.profiles.get(name)
        if t is not None:
            counts[t.index] += 1
            compute += t.compute
            for k, e in enumerate(t.engines):
                engines[k] += e
    return GpuState(mask, tuple(counts), tuple(engines), compute)


def addable(tables: ModelTables, state: GpuState) -> int:
    """Bit i set: one more instance of profile i passes the count, engine and SM limits on
    this GPU (its slots are a separate question: `single_table`)."""
    bits = 0
    for t in tables.by_index:
        if state.counts[t.index] >= t.max_count:
            continue
        if state.compute + t.compute > tables.compute_total:
            continue
        limits = zip(state.engines, t.engines, tables.full_engines, strict=True)
        if all(a + b <= c for a, b, c in limits):
            bits |= 1 << t.index
    return bits


SingleFit = tuple[int, int, int]  # (cost, loss, start)


@lru_cache(maxsize=256)
def single_table(tables: ModelTables, profile: str, mode: FitMode) -> tuple[SingleFit | None, ...]:
    """For every occupancy mask: where one `profile` instance goes under `mode`, by slots
    alone (pair it with `addable`). BEST: least cost, ties to the higher start; LOWEST:
    lowest free start; STATIC: lowest free start of the all-balanced layout."""
    t = tables.profiles[profile]
    spots = list(zip(t.starts, t.masks, strict=True))
    if mode is FitMode.STATIC:
        spots = [(s, m) for s, m in spots if (profile, s) in tables.layout]
    pot = tables.potential
    out: list[SingleFit | None] = []
    for mask in range(1 << tables.slots):
        before = pot[mask]
        best: SingleFit | None = None
        for s, m in spots:
            if mask & m:
                continue
            after = pot[mask | m]
            fit = ((before - after) * COST_SCALE + after, before - after, s)
            if mode is not FitMode.BEST:
                best = fit
                break
            if best is None or (fit[0], -fit[2]) < (best[0], -best[2]):
                best = fit
        out.append(best)
    return tuple(out)


def static_preference(tables: ModelTables) -> tuple[tuple[str, int], ...]:
    """Every (profile, start) of the model, the one InstaSlice would rather fill first on an
    empty GPU first: by the loss of potential an instance there costs (the measure
    `single_table`'s BEST mode minimises), ties to the higher start (as BEST's), then by
    name. Small profiles at high starts come first, the full GPU's profile at 0 last. The
    order a DRA driver publishes its devices in, for a first-fit scheduler (docs/dra.md)."""
    pot = tables.potential
    keyed = [
        (pot[0] - pot[m], -s, t.name, s)
        for t in tables.by_index
        for s, m in zip(t.starts, t.masks, strict=True)
    ]
    return tuple((name, s) for _, _, name, s in sorted(keyed))


@lru_cache(maxsize=256)
def free_spots(tables: ModelTables, profile: str) -> tuple[int, ...]:
    """For every occupancy mask: at how many of its starts one `profile` instance would
    find its slots free (the count, engine and SM limits are a separate question)."""
    return spots_by_shape(tables.slots, tables.profiles[profile].masks)


@lru_cache(maxsize=256)
def spots_by_shape(slots: int, masks: tuple[int, ...]) -> tuple[int, ...]:
    """`free_spots` by shape: variants (+me, -me) and models with the same masks share one."""
    return tuple(sum(1 for m in masks if not mask & m) for mask in range(1 << slots))


def can_add(tables: ModelTables, state: GpuState, t: ProfileTable, i: int) -> bool:
    """Whether an instance of `t` at its i-th start is legal on a GPU in `state`."""
    if state.mask & t.masks[i] or state.counts[t.index] >= t.max_count:
        return False
    if state.compute + t.compute > tables.compute_total:
        return False
    limits = zip(state.engines, t.engines, tables.full_engines, strict=True)
    return all(a + b <= c for a, b, c in limits)


def add(state: GpuState, t: ProfileTable, i: int) -> GpuState:
    counts = list(state.counts)
    counts[t.index] += 1
    return GpuState(
        state.mask | t.masks[i],
        tuple(counts),
        tuple(a + b for a, b in zip(state.engines, t.engines, strict=True)),
        state.compute + t.compute,
    )


def free_starts(tables: ModelTables, state: GpuState, t: ProfileTable) -> list[int]:
    """Indices (into t.starts) where one more instance of `t` is legal."""
    return [i for i in range(len(t.starts)) if can_add(tables, state, t, i)]


def within_limits(tables: ModelTables, state: GpuState, demand: tuple[str, ...]) -> bool:
    """Whether the count, engine and SM limits let `demand` join a GPU in `state`."""
    return needs_allowed(tables, state, demand_needs(tables, demand))


Needs = tuple[tuple[tuple[int, int, int], ...], int, tuple[int, ...]]  # demand_needs


def needs_allowed(tables: ModelTables, state: GpuState, needs: Needs) -> bool:
    """`within_limits` for a demand whose `demand_needs` the caller already has."""
    caps, compute, engines = needs
    if state.compute + compute > tables.compute_total:
        return False
    have = state.counts
    for index, n, cap in caps:
        if have[index] + n > cap:
            return False
    for a, b, c in zip(state.engines, engines, tables.full_engines, strict=True):
        if a + b > c:
            return False
    return True


@lru_cache(maxsize=1 << 12)
def demand_needs(tables: ModelTables, demand: tuple[str, ...]) -> Needs:
    """What `demand` adds to a GPU: (profile index, instances, the profile's cap) per
    profile, SMs, engines."""
    counts: dict[int, int] = {}
    compute = 0
    engines = [0] * len(tables.full_engines)
    for name in demand:
        t = tables.profiles[name]
        counts[t.index] = counts.get(t.index, 0) + 1
        compute += t.compute
        for k, e in enumerate(t.engines):
            engines[k] += e
    caps = tuple((i, n, tables.by_index[i].max_count) for i, n in counts.items())
    return caps, compute, tuple(engines)


def mask_fit(
    tables: ModelTables, occupied: int, demand: tuple[str, ...], mode: FitMode
) -> GpuFit | None:
    """Pack every profile of `demand` (sorted largest first) into the free slots of a GPU
    whose occupied slots are `occupied`, or None.

    BEST: the packing with the least loss of potential; ties go to higher slots (small
    slices high, HAMi's rule, keeps start 0 whole for a 4g). LOWEST: the first packing in
    lowest-start order. STATIC: the same, but only on free slices of the all-balanced layout.

    Slots only: counts, engines and SMs depend on which profiles are added, not where, and
    are checked apart (`within_limits`). So the search is keyed by the mask, not the whole
    GPU state, and shared by every GPU state that covers the same slots (256 masks on an
    8-slot part). The search itself is `pack`'s."""
    found = pack(tables, occupied, demand, mode)
    if found is None:
        return None
    pot = tables.potential
    before, after = pot[occupied], pot[found[0]]
    return GpuFit((before - after) * COST_SCALE + after, before - after, after, found[1])


@lru_cache(maxsize=1 << 16)
def pack(
    tables: ModelTables, occupied: int, demand: tuple[str, ...], mode: FitMode
) -> tuple[int, tuple[int, ...]] | None:
    """`mask_fit`'s packing as (occupied slots after, starts), or None. Exhaustive, by the
    first slice's start then the rest's own packing, which is this same function: every
    (slots, slices still to place) is solved once, whichever GPU, demand or share reached
    it first (the memo is this LRU cache).

    BEST ranks a packing by the potential left, then by the slots taken as a number (higher
    slots win), first in start order on a tie — the least loss, whatever the potential
    before (so a packing's rank does not depend on where the search started). One slice is
    `single_table`'s answer, which ranks its spots the same way."""
    if not demand:
        return occupied, ()
    t = tables.profiles[demand[0]]
    if len(demand) == 1:
        fit = single_table(tables, demand[0], mode)[occupied]
        if fit is None:
            return None
        start = fit[2]
        return occupied | t.masks[t.starts.index(start)], (start,)
    rest = demand[1:]
    layout = tables.layout if mode is FitMode.STATIC else None
    pot = tables.potential
    best: tuple[int, tuple[int, ...]] | None = None
    rank = (-1, -1)
    for s, m in zip(t.starts, t.masks, strict=True):
        if occupied & m or (layout is not None and (t.name, s) not in layout):
            continue
        sub = pack(tables, occupied | m, rest, mode)
        if sub is None:
            continue
        if mode is not FitMode.BEST:
            return sub[0], (s, *sub[1])
        got = (pot[sub[0]], sub[0])
        if got > rank:
            best, rank = (sub[0], (s, *sub[1])), got
    return best
