"""Warm slices in placement: which spots a node agent keeps made, and when a pod takes one.

A warm slice is a GPU instance a node agent made ahead of demand (docs/warm-slices.md). To
the engine it is free capacity: it is never in `Gpu.occupied`, so packing is decided as if
it did not exist. Two pure helpers sit on either side of that decision:

- `next_picks`: where the `instaslice` policy would put the next slices of a profile on one
  node, in order — the spots an agent warms, so a warm slice sits where the allocator would
  place anyway;
- `prefer_warm`: after the engine chose a single-slice placement on a node, the same slice on
  a warm instance of that node instead, when that costs exactly what the engine's choice
  costs (same loss of potential, same potential left: the engine's own score). Packing is
  never given up for speed; a tie goes to the warm instance.

Multi-slice pods and ties across nodes are left to the engine as they are (a warm instance
then serves them only where the engine picks it): the tie-break stays one node's arithmetic,
off the fleet index's hot path. Pure; no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from common.catalog import Catalog
from common.placement.engine import place
from common.placement.model import (
    Gpu,
    NodeState,
    Occupied,
    PlacedSlice,
    Placement,
    PodRequest,
    Policy,
    SliceRequest,
    Snapshot,
)
from common.placement.search import CatalogTables, catalog_tables
from common.placement.tables import COST_SCALE, GpuState, ModelTables, can_add, gpu_state

WarmSpots = Mapping[int, Sequence[Occupied]]  # GPU index → its warm instances


def next_picks(
    node: NodeState, profile: str, count: int, catalog: Catalog | None = None
) -> list[PlacedSlice]:
    """The next `count` spots (at most) where the `instaslice` policy puts one slice of
    `profile` on `node`, each taken before the next is chosen."""
    out: list[PlacedSlice] = []
    ask = PodRequest(name="warm", slices=(SliceRequest("warm", profile),))
    free = replace(node, cpu_millis_free=1, memory_bytes_free=1, pods_free=1)
    for _ in range(count):
        got = place(Snapshot((free,)), ask, Policy.INSTASLICE, catalog)
        if not isinstance(got, Placement):
            break
        s = got.slices[0]
        out.append(s)
        gpus = tuple(
            replace(g, occupied=(*g.occupied, Occupied(s.start, s.size, profile)))
            if g.index == s.gpu_index
            else g
            for g in free.gpus
        )
        free = replace(free, gpus=gpus)
    return out


def _state(ct: CatalogTables, gpu: Gpu) -> tuple[ModelTables, GpuState] | None:
    t = ct.tables(gpu.tables_key)
    if t is None or not gpu.usable:
        return None
    return t, gpu_state(t, tuple((o.start, o.size, o.profile) for o in gpu.occupied))


def _cost(t: ModelTables, st: GpuState, profile: str, start: int) -> int | None:
    """The engine's cost of one `profile` slice at `start` on a GPU in `st` (tables.py:
    loss * COST_SCALE + potential left); None where it is not legal."""
    p = t.profiles.get(profile)
    if p is None or start not in p.starts:
        return None
    i = p.starts.index(start)
    if not can_add(t, st, p, i):
        return None
    before, after = t.potential[st.mask], t.potential[st.mask | p.masks[i]]
    return (before - after) * COST_SCALE + after


def prefer_warm(
    node: NodeState, placement: Placement, warm: WarmSpots, catalog: Catalog | None = None
) -> Placement:
    """`placement` (one slice, on `node`), moved onto a warm instance of `node` of the same
    profile whose cost equals the chosen spot's; unchanged when the pod asks for more than
    one slice, the choice is warm already, or no warm instance ties."""
    if len(placement.slices) != 1 or placement.node != node.name or not warm:
        return placement
    chosen = placement.slices[0]
    ct = catalog_tables(catalog)
    by_index = {g.index: g for g in node.gpus}
    if any(
        (w.start, w.size, w.profile) == (chosen.start, chosen.size, chosen.profile)
        for w in warm.get(chosen.gpu_index, ())
    ):
        return placement
    here = by_index.get(chosen.gpu_index)
    got = _state(ct, here) if here is not None else None
    if got is None:
        return placement
    cost = _cost(*got, chosen.profile, chosen.start)
    for index in sorted(warm):
        gpu = by_index.get(index)
        state = _state(ct, gpu) if gpu is not None else None
        if state is None:
            continue
        for w in sorted(warm[index], key=lambda o: -o.start):
            if w.profile != chosen.profile or w.size != chosen.size:
                continue
            if cost is not None and _cost(*state, w.profile, w.start) == cost:
                moved = replace(chosen, gpu_index=index, start=w.start)
                return replace(placement, slices=(moved,))
    return placement
