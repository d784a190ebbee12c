"""The per-GPU packing search (tables.mask_fit, search.gpu_options) against brute force.

Covers: on random legal GPU states of every catalog model (instances of every profile,
`+me` variants included, so count and engine limits bind) and random multi-slice demands,
under the three fit modes, every share `gpu_options` lists — and every share it leaves out
— agrees with a brute force written here from `can_add` / `add`: the same shares, the same
cost and starts (the least (cost, fuller GPU) in start order; the first legal packing for
the baselines). The search is keyed by the occupied slots alone and the limits are checked
apart, so two states with one mask and different instances must still get their own answer.
Leaves out: how a node splits a demand over its GPUs (test_placement*.py).
"""

from __future__ import annotations

from itertools import product

from hypothesis import given, settings
from hypothesis import strategies as st

from common.catalog import load_catalog
from common.placement.search import _expand, _radix, gpu_options, profile_order
from common.placement.tables import (
    COST_SCALE,
    FitMode,
    GpuState,
    ModelTables,
    add,
    can_add,
    free_starts,
    gpu_state,
    model_tables,
)
from tests.unit.test_placement_properties import MODELS


def brute(
    t: ModelTables, state: GpuState, demand: tuple[str, ...], mode: FitMode
) -> tuple[int, tuple[int, ...]] | None:
    """(cost, starts) of the mode's packing of `demand` on the GPU, by trying every start."""
    tables = [t.profiles[name] for name in demand]
    before = t.potential[state.mask]
    best: tuple[tuple[int, int], tuple[int, ...]] | None = None
    for picks in product(*(range(len(p.starts)) for p in tables)):
        st_ = state
        for p, i in zip(tables, picks, strict=True):
            if mode is FitMode.STATIC and (p.name, p.starts[i]) not in t.layout:
                break
            if not can_add(t, st_, p, i):
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
    radix = _radix(counts)
    want = []
    for index in range(radix.size - 1, 0, -1):
        demand = _expand(profiles, radix.subs[index])
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
