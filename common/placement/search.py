"""The node search behind `place`: how each policy hosts a pod's slices on one node.

Per node the pod's slices are split between its GPUs by a small dynamic programme over
(GPU, slices still to place), each GPU's share packed exactly by `tables.pack` (split.py).
The split is the one part of a decision that is computed, not looked up, for every candidate
node whose GPUs changed, so its pieces are cheap by construction (split.py says how).

Speed comes from keys, not from shortcuts. A node's GPU state is one string
(`NodeState.gpu_key`, hash cached by Python), and every node-level answer is a pure function
of (catalog, that key, the demand, the policy), memoised in bounded LRU caches. One decision
over 1000 nodes x 8 GPUs is then one cache lookup per node; only nodes whose GPUs changed
since the last decision — usually one — are recomputed, and identical nodes share a result.

The search is complete for every policy: if any legal placement exists on a node, it is
found. The `instaslice` policy takes the split with the least total loss of potential; the
baselines place slice by slice, largest first, each at their preferred spot that still
leaves the rest placeable (a backtracking scheduler would do the same).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any

from common.catalog import Catalog, load_catalog
from common.lru import Lru
from common.placement import geometry
from common.placement.model import (
    NodeState,
    PodRequest,
    Policy,
    gpu_keys,
    parse_gpu_key,
)
from common.placement.split import Assignment, UsableGpu, expand, split
from common.placement.split import clear_caches as clear_split_caches
from common.placement.tables import (
    COST_SCALE,
    MODEL_TABLES_CAP,
    FitMode,
    GpuState,
    ModelTables,
    ProfileTable,
    SingleFit,
    TableTooLarge,
    add,
    addable,
    demand_needs,
    free_spots,
    free_starts,
    gpu_state,
    model_tables,
    pack,
    single_table,
    spots_by_shape,
)
from common.profiles import ProfileNameError, parse_profile

_MODE = {
    Policy.INSTASLICE: FitMode.BEST,
    Policy.FIRST_FIT: FitMode.LOWEST,
    Policy.SPREAD: FitMode.LOWEST,
    Policy.STATIC_BALANCED: FitMode.STATIC,
}

Demand = tuple[tuple[str, int], ...]  # (profile, count), largest profile first


@lru_cache(maxsize=1 << 10)
def profile_order(name: str) -> tuple[int, int, str]:
    """Largest first (memory, then compute), a model-independent proxy for slot size."""
    try:
        p = parse_profile(name)
    except ProfileNameError:
        return (0, 0, name)
    return (-p.memory_gb, -p.gi_slices, name)


class CatalogTables:
    """The tables of one catalog's models, and of the geometries GPUs carry themselves (found
    by token, geometry.py), built on first use; the `MODEL_TABLES_CAP` last used are kept
    (so an evicted table is freed, not held here). A model past the slot bound has none
    (tables.TableTooLarge): its GPUs are of no known model. Identity-hashed: it is the cheap
    cache key that stands for its catalog."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self._tables: Lru[str, ModelTables | None] = Lru(MODEL_TABLES_CAP)

    def tables(self, model: str) -> ModelTables | None:
        try:
            return self._tables[model]
        except KeyError:
            m = self.catalog.model(model) or geometry.lookup(model)
            try:
                t = model_tables(m) if m is not None else None
            except TableTooLarge:
                t = None
            self._tables.put(model, t)
            return t

    def known(self, model: str) -> bool:
        """Whether `model`'s tables (or the answer that it has none) are at hand."""
        return model in self._tables

    def __len__(self) -> int:
        return len(self._tables)


@cache
def _builtin_tables() -> CatalogTables:
    return CatalogTables(load_catalog())


@lru_cache(maxsize=8)
def _custom_tables(catalog: Catalog) -> CatalogTables:
    return CatalogTables(catalog)


def catalog_tables(catalog: Catalog | None) -> CatalogTables:
    if catalog is None or catalog is load_catalog():
        return _builtin_tables()
    return _custom_tables(catalog)


@dataclass(frozen=True, slots=True)
class NodeInfo:
    gpus: tuple[UsableGpu, ...]  # usable GPUs of a known model, in position order
    potential: int  # sum of the usable GPUs' potentials (smaller = fuller node)
    models: tuple[str, ...]  # every GPU's model, in position order
    usable: tuple[bool, ...]  # every GPU's usability, in position order


@dataclass(frozen=True, slots=True)
class NodeFit:
    """One node's way to host every slice of the pod."""

    cost: int  # loss * COST_SCALE + potential left on the GPUs used (instaslice); else 0
    loss: int
    assignment: Assignment
    rank: tuple[int, int] = (0, 0)  # (cost, node potential): smaller is better (packs)


@lru_cache(maxsize=1 << 14)
def node_info(ct: CatalogTables, node_key: str) -> NodeInfo:
    gpus = []
    potential = 0
    models = []
    usable = []
    for pos, key in enumerate(gpu_keys(node_key)):
        model, ok, part = gpu_info(ct, key)
        models.append(model)
        usable.append(ok)
        if part is not None:
            t, st, free, bits, pot, room = part
            gpus.append(UsableGpu(pos, t, st, free, bits, room))
            potential += pot
    return NodeInfo(tuple(gpus), potential, tuple(models), tuple(usable))


# tables, state, free slots, addable, potential, room
GpuPart = tuple[ModelTables, GpuState, int, int, int, tuple[int, ...]]


@lru_cache(maxsize=1 << 15)
def gpu_info(ct: CatalogTables, gpu_key: str) -> tuple[str, bool, GpuPart | None]:
    """One GPU of `node_info`, memoised on its own key: a node whose one GPU changed
    rebuilds that GPU only (None: not usable, or a model the catalog does not know)."""
    model, usable, occupied = parse_gpu_key(gpu_key)
    t = ct.tables(model)
    if t is None or not usable:
        return model, usable, None
    st = gpu_state(t, occupied)
    free = t.slots - bin(st.mask).count("1")
    bits = addable(t, st)
    return model, usable, (t, st, free, bits, t.potential[st.mask], gpu_room(t, st, bits))


def gpu_room(tables: ModelTables, state: GpuState, bits: int) -> tuple[int, ...]:
    """Per profile index, how many instances of it a GPU in `state` has room for by
    `node_may_fit`'s count: its free starts, at most what the count limit still allows;
    0 where `bits` (`addable`) says no instance may be added."""
    return tuple(
        min(free_spots(tables, t.name)[state.mask], t.max_count - state.counts[t.index])
        if bits >> t.index & 1
        else 0
        for t in tables.by_index
    )


def _spread_order(gpus: tuple[UsableGpu, ...] | list[UsableGpu]) -> list[UsableGpu]:
    return sorted(gpus, key=lambda u: (-u.free, u.pos))


@lru_cache(maxsize=1 << 16)
def node_single(ct: CatalogTables, node_key: str, profile: str, policy: Policy) -> NodeFit | None:
    """The policy's spot for one slice of `profile` on the node, or None."""
    info = node_info(ct, node_key)
    mode = _MODE[policy]
    gpus = _spread_order(info.gpus) if policy is Policy.SPREAD else info.gpus
    best: SingleFit | None = None  # (cost, loss, start) of the first cheapest GPU
    at = 0
    tables: ModelTables | None = None  # the GPU before's: its lookups are reused
    t: ProfileTable | None = None
    fits: tuple[SingleFit | None, ...] | None = None
    for u in gpus:
        if u.tables is not tables:
            tables = u.tables
            t = tables.profiles.get(profile)
            fits = single_table(tables, profile, mode) if t is not None else None
        if t is None or fits is None or not u.addable >> t.index & 1:
            continue
        fit = fits[u.state.mask]
        if fit is None:
            continue
        if mode is not FitMode.BEST:
            return NodeFit(0, 0, ((u.pos, profile, fit[2]),))
        if best is None or fit[0] < best[0]:
            best, at = fit, u.pos
    if best is None:
        return None
    cost, loss, start = best
    return NodeFit(cost, loss, ((at, profile, start),), (cost, info.potential))


# A node's single-slice rank as one int, cost * RANK_SCALE + node potential (potentials of
# all GPUs of a node stay far below it), so the hot loop compares plain ints.
RANK_SCALE = 1 << 24
RANK_TABLE_LIMIT = 1 << 15


def prune(table: dict[str, Any], nodes: tuple[NodeState, ...]) -> None:
    """Keep a memo table bounded: past RANK_TABLE_LIMIT entries, drop those of node states
    no longer in the snapshot (once in thousands of decisions; the live ones stay warm)."""
    if len(table) <= RANK_TABLE_LIMIT:
        return
    live = {n.gpu_key for n in nodes}
    for key in [k for k in table if k not in live]:
        del table[key]
    if len(table) > RANK_TABLE_LIMIT:  # a snapshot bigger than the limit: start over
        table.clear()


def clear_caches() -> None:
    """Forget every memoised answer (a fresh process). For benchmarks and tests."""
    for f in (
        node_info,
        gpu_info,
        node_single,
        node_bound,
        node_may_fit,
        node_multi,
        rank_table,
        loss_table,
        bound_table,
        _builtin_tables,
        _custom_tables,
        pack,
        demand_needs,
        single_table,
        free_spots,
        spots_by_shape,
        model_tables,
        profile_order,
    ):
        f.cache_clear()
    clear_split_caches()


@lru_cache(maxsize=256)
def rank_table(ct: CatalogTables, profile: str, policy: Policy) -> dict[str, int]:
    """Memo of node key -> single-slice rank (-1: does not fit) for one (profile, policy):
    a plain dict, so the per-node lookup in `place` is one dictionary probe. The caller
    fills it from `node_single` and prunes it with `prune`."""
    return {}


@lru_cache(maxsize=256)
def loss_table(ct: CatalogTables, profile: str) -> dict[str, int]:
    """Memo of node key -> the instaslice loss of one `profile` slice there (-1: does not
    fit), like rank_table: what the fleet index orders a multi-slice pod's nodes by."""
    return {}


@lru_cache(maxsize=256)
def bound_table(ct: CatalogTables, profiles: tuple[str, ...]) -> dict[str, int]:
    """Memo of node key -> `node_bound` (-1: some profile fits nowhere), like rank_table."""
    return {}


@lru_cache(maxsize=1 << 15)
def node_bound(ct: CatalogTables, node_key: str, profiles: tuple[str, ...]) -> int | None:
    """A lower bound on the instaslice loss of placing all of `profiles` (and more) on the
    node — placing more slices never raises the potential, so it is at least the loss of
    the dearest single one — or None when one of them fits nowhere on the node."""
    bound = 0
    for p in profiles:
        fit = node_single(ct, node_key, p, Policy.INSTASLICE)
        if fit is None:
            return None
        bound = max(bound, fit.loss)
    return bound


@lru_cache(maxsize=1 << 15)
def node_may_fit(ct: CatalogTables, node_key: str, demand: Demand) -> bool:
    """A quick necessary condition for the demand on the node: its GPUs can hold `count`
    instances of each profile (each profile on its own) and the free slots add up. Checked
    before the exact split, which then runs only where it may succeed."""
    info = node_info(ct, node_key)
    need = 0
    for p, count in demand:
        room = 0
        size = 0
        tables: ModelTables | None = None  # the GPU before's: its lookup is reused
        t: ProfileTable | None = None
        for u in info.gpus:
            if u.tables is not tables:
                tables = u.tables
                t = tables.profiles.get(p)
            if t is None or not u.addable >> t.index & 1:
                continue
            room += u.room[t.index]
            size = t.size if not size else min(size, t.size)
        if room < count:
            return False
        need += count * size
    return need <= sum(u.free for u in info.gpus)


@lru_cache(maxsize=1 << 13)
def node_multi(ct: CatalogTables, node_key: str, demand: Demand, policy: Policy) -> NodeFit | None:
    """The policy's way to host several slices on the node, or None."""
    info = node_info(ct, node_key)
    gpus = info.gpus
    if not gpus:
        return None
    profiles = tuple(p for p, _ in demand)
    counts = tuple(c for _, c in demand)
    if policy is Policy.INSTASLICE:
        found = split(gpus, profiles, counts, FitMode.BEST, want_best=True)
        if found is None:
            return None
        return NodeFit(found[0], found[0] // COST_SCALE, found[1], (found[0], info.potential))
    return _sequential(gpus, profiles, counts, policy)


def _sequential(
    gpus: tuple[UsableGpu, ...], profiles: tuple[str, ...], counts: tuple[int, ...], policy: Policy
) -> NodeFit | None:
    """Baselines: each slice, largest first, at the policy's first preferred spot that keeps
    the remaining slices placeable (so the search stays complete)."""
    mode = _MODE[policy]
    if split(gpus, profiles, counts, mode, want_best=False) is None:
        return None
    current = list(gpus)
    rem = list(counts)
    out: list[tuple[int, str, int]] = []
    for profile in expand(profiles, counts):
        rem[profiles.index(profile)] -= 1
        order = _spread_order(current) if policy is Policy.SPREAD else current
        placed = False
        for u in order:
            t = u.tables.profiles.get(profile)
            if t is None:
                continue
            for i in free_starts(u.tables, u.state, t):
                if mode is FitMode.STATIC and (profile, t.starts[i]) not in u.tables.layout:
                    continue
                st = add(u.state, t, i)
                bits = addable(u.tables, st)
                room = gpu_room(u.tables, st, bits)
                after = UsableGpu(u.pos, u.tables, st, u.free - t.size, bits, room)
                trial = [after if g.pos == u.pos else g for g in current]
                if split(trial, profiles, tuple(rem), mode, want_best=False) is not None:
                    current = trial
                    out.append((u.pos, profile, t.starts[i]))
                    placed = True
                    break
            if placed:
                break
        assert placed, "a feasible split lost feasibility"
    return NodeFit(0, 0, tuple(out))


def resources_fit(node: NodeState, request: PodRequest) -> bool:
    return (
        node.pods_free >= 1
        and node.cpu_millis_free >= request.cpu_millis
        and node.memory_bytes_free >= request.memory_bytes
    )


class Context:
    """One decision's view: the request's demand plus the cached per-node answers."""

    def __init__(self, catalog: Catalog | None, policy: Policy, request: PodRequest) -> None:
        self.ct = catalog_tables(catalog)
        self.catalog = self.ct.catalog
        self.policy = policy
        counts: dict[str, int] = {}
        for s in request.slices:
            if s.count > 0:
                counts[s.profile] = counts.get(s.profile, 0) + s.count
        self.profiles: tuple[str, ...] = tuple(sorted(counts, key=profile_order))
        self.counts: tuple[int, ...] = tuple(counts[p] for p in self.profiles)
        self.demand: Demand = tuple(zip(self.profiles, self.counts, strict=True))
        self.single = self.profiles[0] if self.counts == (1,) else None

    def tables(self, model: str) -> ModelTables | None:
        return self.ct.tables(model)

    def node_fit(self, node: NodeState) -> NodeFit | None:
        """How this policy would host the pod's slices on `node` (resources ignored)."""
        if not self.profiles:
            return NodeFit(0, 0, ())
        if self.single is not None:
            return node_single(self.ct, node.gpu_key, self.single, self.policy)
        return node_multi(self.ct, node.gpu_key, self.demand, self.policy)

    def node_free_slots(self, node: NodeState) -> int:
        return sum(u.free for u in node_info(self.ct, node.gpu_key).gpus)

    def size(self, model: str, profile: str) -> int:
        t = self.ct.tables(model)
        assert t is not None
        return t.profiles[profile].size
