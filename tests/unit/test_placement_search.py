"""The exact split (search.node_multi, split.gpu_options, tables.mask_fit) against brute force.

Covers: on random legal GPU states of every catalog model (instances of every profile,
`+me` variants included, so count and engine limits bind) and random multi-slice demands,
under the three fit modes, every share `gpu_options` lists — and every share it leaves out
— agrees with a brute force written here from `can_add` / `add`: the same shares, the same
cost and starts (the least (cost, fuller GPU) in start order; the first legal packing for
the baselines). The search is keyed by the occupied slots alone and the limits are checked
apart, so two states with one mask and different instances must still get their own answer.
A packing is memoised per (slots, slices still to place) whichever search reached it first
(`tables.pack`), so asking in another order must give the same answers. A node's split of
a demand over its GPUs is the brute force's too: the least total cost, and among equal
costs the first in GPU order, each GPU's largest share first (instaslice), or None exactly
when no split exists (every policy).
Leaves out: which node a pod goes to (test_placement*.py, test_placement_index.py).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import replace
from itertools import product

from hypothesis import given, settings
from hypothesis import strategies as st

from common.catalog import load_catalog
from common.placement.engine import clear_caches
from common.placement.model import NodeState, Policy
from common.placement.search import catalog_tables, node_info, node_multi, profile_order
from common.placement.split import expand, gpu_options, radix_of
from common.placement.tables import (
    COST_SCALE,
    FitMode,
    GpuState,
    ModelTables,
    add,
    can_add,
    free_spots,
    free_starts,
    gpu_state,
    mask_fit,
    model_tables,
)
from tests.unit.test_placement_properties import MODELS, nodes


def brute(
    t: ModelTables, state: GpuState, demand: tuple[str, ...], mode: FitMode, limits: bool = True
) -> tuple[int, tuple[int, ...]] | None:
    """(cost, starts) of the mode's packing of `demand` on the GPU, by trying every start
    (`limits`: the count, engine and SM limits too, else the slots alone)."""
    tables = [t.profiles[name] for name in demand]
    before = t.potential[state.mask]
    best: tuple[tuple[int, int], tuple[int, ...]] | None = None
    for picks in product(*(range(len(p.starts)) for p in tables)):
        st_ = state
        for p, i in zip(tables, picks, strict=True):
            if mode is FitMode.STATIC and (p.name, p.starts[i]) not in t.layout:
                break
            if st_.mask & p.masks[i] if not limits else not can_add(t, st_, p, i):
                break
            st_ = add(st_, p, i)
        else:
            after = t.potential[st_.mask]
            cost = (before - after) * COST_SCALE + after if mode is FitMode.BEST else 0
            starts = tuple(p.starts[i] for p, i in zip(tables, picks, strict=True))
            if mode is not FitMode.BEST:
                return cost, starts
            if best is None or (cost, -st_.mask) < best[0]:
                best = ((cost, -st_.mask), starts)
    return None if best is None else (best[0][0], best[1])


@st.composite
def cases(draw: st.DrawFn) -> tuple[ModelTables, GpuState, tuple[str, ...], tuple[int, ...]]:
    model = load_catalog().model(draw(st.sampled_from(MODELS)))
    assert model is not None
    t = model_tables(model)
    state = gpu_state(t, ())
    for _ in range(draw(st.integers(0, 6))):  # random legal instances, any profile
        p = t.by_index[draw(st.integers(0, len(t.by_index) - 1))]
        options = free_starts(t, state, p)
        if options:
            state = add(state, p, draw(st.sampled_from(options)))
    names = sorted({p.name for p in t.by_index if p.size <= 4}, key=profile_order)
    profiles = tuple(
        sorted(draw(st.sets(st.sampled_from(names), min_size=1, max_size=3)), key=profile_order)
    )
    counts = tuple(draw(st.integers(1, 2)) for _ in profiles)
    return t, state, profiles, counts


@settings(max_examples=300, deadline=None)
@given(cases(), st.sampled_from(list(FitMode)))
def test_gpu_options_are_the_brute_force_packings_of_every_share(
    case: tuple[ModelTables, GpuState, tuple[str, ...], tuple[int, ...]], mode: FitMode
) -> None:
    t, state, profiles, counts = case
    radix = radix_of(counts)
    want = []
    for index in range(radix.size - 1, 0, -1):
        demand = expand(profiles, radix.subs[index])
        found = brute(t, state, demand, mode)
        if found is not None:
            want.append((index, found[0], demand, found[1]))
    got = [
        (index, cost if mode is FitMode.BEST else 0, demand, starts)
        for index, cost, demand, starts in gpu_options(t, state, profiles, counts, mode)
    ]
    assert got == want


def test_two_states_with_one_mask_keep_their_own_limits() -> None:
    """H100: one 1g.10gb+me per GPU. Two GPUs with slot 6 taken, one by a 1g.10gb and one by
    a 1g.10gb+me, share the slots' search but not the answer for another +me."""
    model = load_catalog().model("H100-80GB")
    assert model is not None
    t = model_tables(model)
    plain = gpu_state(t, ((6, 1, "1g.10gb"),))
    me = gpu_state(t, ((6, 1, "1g.10gb+me"),))
    assert plain.mask == me.mask and plain != me
    demand = (("1g.10gb+me",), (1,))
    assert [s[2] for s in gpu_options(t, plain, *demand, FitMode.BEST)] == [("1g.10gb+me",)]
    assert gpu_options(t, me, *demand, FitMode.BEST) == ()


@settings(max_examples=100, deadline=None)
@given(cases(), st.sampled_from(list(FitMode)), st.randoms(use_true_random=False))
def test_a_packing_is_the_same_whichever_search_reached_it_first(
    case: tuple[ModelTables, GpuState, tuple[str, ...], tuple[int, ...]],
    mode: FitMode,
    rng: random.Random,
) -> None:
    """Every share's packing from fresh caches, asked in two orders (each share's memo
    entries then come from another search first), is the brute force's by slots alone."""
    t, state, profiles, counts = case
    radix = radix_of(counts)
    demands = [expand(profiles, radix.subs[i]) for i in range(1, radix.size)]
    answers = []
    for order in (demands, rng.sample(demands, len(demands))):
        clear_caches()
        got = {d: mask_fit(t, state.mask, d, mode) for d in order}
        answers.append({d: None if f is None else (f.cost, f.starts) for d, f in got.items()})
    assert answers[0] == answers[1]
    for demand, found in answers[0].items():
        want = brute(t, state, demand, mode, limits=False)
        cost = None if found is None else found[0] if mode is FitMode.BEST else 0
        assert (None if found is None else (cost, found[1])) == want


def test_free_spots_counts_the_starts_whose_slots_are_free() -> None:
    for name in MODELS:
        model = load_catalog().model(name)
        assert model is not None
        t = model_tables(model)
        for p in t.by_index:
            table = free_spots(t, p.name)
            assert len(table) == 1 << t.slots
            for mask in range(1 << t.slots):
                assert table[mask] == sum(1 for m in p.masks if not mask & m)


def _splits(
    gpus: list[tuple[int, ModelTables, GpuState]],
    profiles: tuple[str, ...],
    rem: tuple[int, ...],
    mode: FitMode,
) -> Iterator[tuple[int, tuple[tuple[int, str, int], ...]]]:
    """Every split of `rem` over the GPUs by brute force, as (total cost, assignment), in
    the order the engine breaks ties in: the first GPU's shares largest first (by share
    number, the mixed radix of the counts), taking nothing last, then the next GPU's."""
    if not gpus:
        if not any(rem):
            yield 0, ()
        return
    (pos, t, state), rest = gpus[0], gpus[1:]
    radix = radix_of(rem)
    for index in range(radix.size - 1, -1, -1):
        share = radix.subs[index]
        if not any(share):
            yield from _splits(rest, profiles, rem, mode)
            continue
        demand = expand(profiles, share)
        if any(p not in t.profiles for p in demand):
            continue
        packed = brute(t, state, demand, mode)
        if packed is None:
            continue
        cost, starts = packed
        left = tuple(r - c for r, c in zip(rem, share, strict=True))
        mine = tuple((pos, p, s) for p, s in zip(demand, starts, strict=True))
        for total, assignment in _splits(rest, profiles, left, mode):
            yield cost + total, mine + assignment


@st.composite
def split_cases(draw: st.DrawFn) -> tuple[NodeState, tuple[tuple[str, int], ...]]:
    node = draw(nodes(0))
    if len(node.gpus) > 1 and draw(st.booleans()):  # twins: where ties need breaking
        first = node.gpus[0]
        node = replace(node, gpus=tuple(replace(first, index=g.index) for g in node.gpus))
    names = sorted(
        {p.name for g in node.gpus for p in _tables_of(g.tables_key).by_index if p.size <= 4},
        key=profile_order,
    )
    if not names:
        names = ["1g.10gb"]
    picked = sorted(
        draw(st.sets(st.sampled_from(names), min_size=1, max_size=3)), key=profile_order
    )
    counts = [draw(st.integers(1, 2)) for _ in picked]
    while sum(counts) > 3:  # keeps the brute force small
        counts[counts.index(max(counts))] -= 1
    return node, tuple(zip(picked, counts, strict=True))


def _tables_of(key: str) -> ModelTables:
    t = catalog_tables(None).tables(key)
    assert t is not None
    return t


@settings(max_examples=150, deadline=None)
@given(split_cases(), st.sampled_from(list(Policy)))
def test_a_node_splits_a_demand_as_the_brute_force_does(
    case: tuple[NodeState, tuple[tuple[str, int], ...]], policy: Policy
) -> None:
    node, demand = case
    ct = catalog_tables(None)
    profiles = tuple(p for p, _ in demand)
    counts = tuple(c for _, c in demand)
    info = node_info(ct, node.gpu_key)
    gpus = [(u.pos, u.tables, u.state) for u in info.gpus]
    mode = FitMode.BEST if policy is Policy.INSTASLICE else FitMode.LOWEST
    if policy is Policy.STATIC_BALANCED:
        mode = FitMode.STATIC
    splits = list(_splits(gpus, profiles, counts, mode))
    got = node_multi(ct, node.gpu_key, demand, policy)
    assert (got is None) == (not splits)
    if got is None or policy is not Policy.INSTASLICE:
        return
    least = min(total for total, _ in splits)
    want = next(assignment for total, assignment in splits if total == least)
    assert (got.cost, got.assignment) == (least, want)
    assert got.loss == least // COST_SCALE
