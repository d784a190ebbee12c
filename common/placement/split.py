"""How a pod's slices split over one node's GPUs: the dynamic programme behind `node_multi`.

Per node the slices are split between its GPUs by a small dynamic programme over (GPU, slices
still to place); each GPU's share is packed exactly by `tables.pack`. A demand's shares and
what each adds to a GPU are listed once per demand (`_shares`), a GPU whose free slots hold
no share is skipped before any lookup, the limits of a GPU that can take the whole demand
are not checked share by share, and every packing of (slots, slices still to place) is
solved once whichever GPU, share or demand reached it first. Which node, and the baselines'
slice-by-slice order, are search.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import product
from typing import NamedTuple

from common.placement.tables import (
    COST_SCALE,
    FitMode,
    GpuState,
    ModelTables,
    Needs,
    demand_needs,
    needs_allowed,
    pack,
)

Assignment = tuple[tuple[int, str, int], ...]  # (position in node.gpus, profile, start)


class UsableGpu(NamedTuple):  # a tuple: eight are built for every new node state
    pos: int  # position in node.gpus
    tables: ModelTables
    state: GpuState
    free: int  # free memory slots
    addable: int  # bit per profile index: count / engine / SM limits allow one more
    room: tuple[int, ...]  # per profile index: `gpu_room`, what `node_may_fit` adds up


def expand(profiles: tuple[str, ...], counts: tuple[int, ...]) -> tuple[str, ...]:
    return tuple(p for p, c in zip(profiles, counts, strict=True) for _ in range(c))


@dataclass(frozen=True, slots=True)
class _Radix:
    """Sub-vectors of a demand's count vector, numbered in mixed radix: a share `sub` of
    `rem` (sub <= rem digit by digit) leaves index(rem) - index(sub)."""

    size: int  # number of vectors 0 <= v <= counts
    subs: tuple[tuple[int, ...], ...]  # by index
    fits: tuple[tuple[bool, ...], ...]  # fits[r][s]: vector s <= vector r
    # pairs[s]: (r, r - s) for every non-zero r >= s: where a share s can be taken from
    pairs: tuple[tuple[tuple[int, int], ...], ...]


@lru_cache(maxsize=256)
def radix_of(counts: tuple[int, ...]) -> _Radix:
    vectors = sorted(product(*(range(c + 1) for c in counts)))  # index order = mixed radix
    fits = tuple(
        tuple(all(a <= b for a, b in zip(s, r, strict=True)) for s in vectors) for r in vectors
    )
    pairs = tuple(
        tuple((r, r - s) for r in range(1, len(vectors)) if fits[r][s]) for s in range(len(vectors))
    )
    return _Radix(len(vectors), tuple(vectors), fits, pairs)


@dataclass(frozen=True, slots=True)
class _Shares:
    """The non-empty shares of a demand a GPU of one model could take at all, largest index
    first — (share index, its slices in demand order, the slots they need); a share with a
    profile the model does not offer is left out — and what each adds to a GPU's counts,
    engines and SMs (`needs`, by share index; `cover`: the largest of them, which holds
    every other)."""

    entries: tuple[tuple[int, tuple[str, ...], int], ...]
    needs: dict[int, Needs]
    cover: Needs | None
    smallest: int  # the fewest slots a share needs (more than the GPU has: none)


@lru_cache(maxsize=1 << 10)
def _shares(tables: ModelTables, profiles: tuple[str, ...], counts: tuple[int, ...]) -> _Shares:
    sizes = [tables.profiles[p].size if p in tables.profiles else 0 for p in profiles]
    radix = radix_of(counts)
    entries = []
    for index in range(radix.size - 1, 0, -1):
        sub = radix.subs[index]
        if any(c and not z for c, z in zip(sub, sizes, strict=True)):
            continue
        slots = sum(c * z for c, z in zip(sub, sizes, strict=True))
        entries.append((index, expand(profiles, sub), slots))
    needs = {index: demand_needs(tables, demand) for index, demand, _ in entries}
    return _Shares(
        tuple(entries),
        needs,
        needs[entries[0][0]] if entries else None,
        min((slots for _, _, slots in entries), default=tables.slots + 1),
    )


Share = tuple[int, int, tuple[str, ...], tuple[int, ...]]  # sub index, cost, demand, starts


@lru_cache(maxsize=1 << 14)
def gpu_options(
    tables: ModelTables,
    state: GpuState,
    profiles: tuple[str, ...],
    counts: tuple[int, ...],
    mode: FitMode,
) -> tuple[Share, ...]:
    """Every non-empty share of the demand one GPU in `state` can take, with its packing,
    largest share first: the shares its free slots can take (`mask_options`) that the
    GPU's count, engine and SM limits allow (all of them when the largest share passes)."""
    options = mask_options(tables, state.mask, profiles, counts, mode)
    if not options:
        return options
    shares = _shares(tables, profiles, counts)
    assert shares.cover is not None
    if needs_allowed(tables, state, shares.cover):
        return options
    needs = shares.needs
    return tuple(share for share in options if needs_allowed(tables, state, needs[share[0]]))


@lru_cache(maxsize=1 << 14)
def mask_options(
    tables: ModelTables,
    occupied: int,
    profiles: tuple[str, ...],
    counts: tuple[int, ...],
    mode: FitMode,
) -> tuple[Share, ...]:
    """`gpu_options` by slots alone: keyed by the occupied slots, not the whole GPU state,
    so the searches are shared by every GPU state with the same mask."""
    free = tables.slots - occupied.bit_count()
    pot = tables.potential
    before = pot[occupied]
    out = []
    for index, demand, slots in _shares(tables, profiles, counts).entries:
        if slots > free:
            continue
        found = pack(tables, occupied, demand, mode)  # mask_fit, without its GpuFit
        if found is not None:
            after = pot[found[0]]
            out.append((index, (before - after) * COST_SCALE + after, demand, found[1]))
    return tuple(out)


def split(
    gpus: tuple[UsableGpu, ...] | list[UsableGpu],
    profiles: tuple[str, ...],
    counts: tuple[int, ...],
    mode: FitMode,
    want_best: bool,
) -> tuple[int, Assignment] | None:
    """Split the slices over the GPUs: the cheapest split (want_best) or the first one in
    GPU order, largest share first. A dynamic programme over (GPU, slices still to place),
    run backwards over the GPUs, each GPU's shares tried only where they fit what is left
    (`_Radix.pairs`); each GPU's shares are memoised per GPU state, so GPUs in the same
    state anywhere in the cluster are packed once. On equal cost the first GPU takes its
    largest share that still leads to the least total (test_placement_search.py checks it
    against brute force)."""
    radix = radix_of(counts)
    size, fits, pairs = radix.size, radix.fits, radix.pairs
    table = []
    smallest: dict[ModelTables, int] = {}
    for u in gpus:
        least = smallest.get(u.tables)
        if least is None:
            least = smallest[u.tables] = _shares(u.tables, profiles, counts).smallest
        if u.free < least:
            continue  # no share fits its free slots: it has no options
        opts = gpu_options(u.tables, u.state, profiles, counts, mode)
        if opts:
            table.append((u, opts))
    # after[i][r]: least cost to place the share numbered r on GPUs i.. (None: impossible)
    nothing: list[int | None] = [None] * size
    nothing[0] = 0
    after = [nothing]
    for _, opts in reversed(table):
        nxt = after[-1]
        row = nxt.copy()
        for s, cost, _, _ in opts:
            if not want_best:
                cost = 0
            for r, rest_at in pairs[s]:
                rest = nxt[rest_at]
                if rest is not None:
                    best = row[r]
                    if best is None or cost + rest < best:
                        row[r] = cost + rest
        after.append(row)
    after.reverse()
    total = after[0][size - 1]
    if total is None:
        return None
    out: list[tuple[int, str, int]] = []
    r = size - 1
    for i, (u, opts) in enumerate(table):
        if r == 0:
            break
        for s, cost, demand, starts in opts:
            rest = after[i + 1][r - s] if fits[r][s] else None
            if rest is not None and (not want_best or cost + rest == after[i][r]):
                out.extend((u.pos, p, st) for p, st in zip(demand, starts, strict=True))
                r -= s
                break
    return total, tuple(out)


def clear_caches() -> None:
    """Forget the split's memoised answers (search.clear_caches calls it)."""
    for f in (gpu_options, mask_options, _shares, radix_of):
        f.cache_clear()
