"""Warm slices in placement (common/placement/warm.py): a tie goes to a warm slice, packing is
never given up for it (hypothesis: the chosen spot's score with warm slices is the engine's
score without them), and the agent's targets are the engine's own next picks.

Not here: the agent's pool and handover (tests/unit/test_nodeagent_warm.py,
tests/integration/test_nodeagent_warm.py), the allocator's use (test_allocator_*).
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.placement import (
    Gpu,
    NodeState,
    Occupied,
    Placement,
    PodRequest,
    SliceRequest,
    Snapshot,
    place,
)
from common.placement.search import catalog_tables
from common.placement.tables import COST_SCALE, gpu_state
from common.placement.warm import next_picks, prefer_warm

WarmSpots = dict[int, tuple[Occupied, ...]]

H100 = "H100-80GB"
PROFILES = ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb")


def _node(*occupied: tuple[Occupied, ...]) -> NodeState:
    gpus = tuple(Gpu(i, H100, occupied=occ) for i, occ in enumerate(occupied))
    return NodeState("n", cpu_millis_free=1000, memory_bytes_free=1 << 30, pods_free=10, gpus=gpus)


def _one(profile: str) -> PodRequest:
    return PodRequest("p", slices=(SliceRequest("c", profile),))


def _score(node: NodeState, gpu: int, profile: str, start: int) -> int:
    """The engine's cost of one slice there (common/placement/tables.py), from scratch."""
    t = catalog_tables(None).tables(H100)
    assert t is not None
    g = node.gpus[gpu]
    st_ = gpu_state(t, tuple((o.start, o.size, o.profile) for o in g.occupied))
    p = t.profiles[profile]
    mask = p.masks[p.starts.index(start)]
    assert not st_.mask & mask, "the spot overlaps what is there"
    before, after = t.potential[st_.mask], t.potential[st_.mask | mask]
    return (before - after) * COST_SCALE + after


def test_a_tie_goes_to_the_warm_slice() -> None:
    """Two empty GPUs: the engine takes GPU 0; the same spot on GPU 1 is warm and ties."""
    node = _node((), ())
    chosen = place(Snapshot((node,)), _one("1g.10gb"))
    assert isinstance(chosen, Placement) and chosen.slices[0].gpu_index == 0
    s = chosen.slices[0]
    warm = {1: (Occupied(s.start, s.size, s.profile),)}
    moved = prefer_warm(node, chosen, warm)
    assert (moved.slices[0].gpu_index, moved.slices[0].start) == (1, s.start)


def test_packing_beats_a_warm_slice() -> None:
    """GPU 0 is partly used (the engine packs there); a warm slice on the empty GPU 1
    would break an intact GPU: it does not tie, the engine's choice stands."""
    node = _node((Occupied(6, 1, "1g.10gb"),), ())
    chosen = place(Snapshot((node,)), _one("1g.10gb"))
    assert isinstance(chosen, Placement) and chosen.slices[0].gpu_index == 0
    warm = {1: (Occupied(6, 1, "1g.10gb"),)}
    assert prefer_warm(node, chosen, warm) == chosen


def test_next_picks_are_the_engine_s_choices_in_turn() -> None:
    node = _node((Occupied(6, 1, "1g.10gb"),), ())
    picks = next_picks(node, "1g.10gb", 3)
    state = node
    for p in picks:
        got = place(Snapshot((state,)), _one("1g.10gb"))
        assert isinstance(got, Placement)
        assert (got.slices[0].gpu_index, got.slices[0].start) == (p.gpu_index, p.start)
        gpus = tuple(
            Gpu(g.index, H100, occupied=(*g.occupied, Occupied(p.start, p.size, p.profile)))
            if g.index == p.gpu_index
            else g
            for g in state.gpus
        )
        state = NodeState("n", cpu_millis_free=1000, memory_bytes_free=1 << 30, pods_free=10,
                          gpus=gpus)  # fmt: skip
    assert len(picks) == 3


@st.composite
def _cases(draw: st.DrawFn) -> tuple[NodeState, dict[int, tuple[Occupied, ...]], str]:
    """A node of 1-3 H100s, each partly filled by legal slices, some free spots warm."""
    t = catalog_tables(None).tables(H100)
    assert t is not None
    gpus, warm = [], {}
    for i in range(draw(st.integers(1, 3))):
        used = 0
        occ: list[Occupied] = []
        hot: list[Occupied] = []
        for _ in range(draw(st.integers(0, 6))):
            name = draw(st.sampled_from(PROFILES))
            p = t.profiles[name]
            k = draw(st.integers(0, len(p.starts) - 1))
            if used & p.masks[k]:
                continue
            used |= p.masks[k]
            (hot if draw(st.booleans()) else occ).append(Occupied(p.starts[k], p.size, name))
        gpus.append(Gpu(i, H100, occupied=tuple(occ)))
        if hot:
            warm[i] = tuple(hot)
    node = NodeState("n", cpu_millis_free=1000, memory_bytes_free=1 << 30, pods_free=10,
                     gpus=tuple(gpus))  # fmt: skip
    return node, warm, draw(st.sampled_from(PROFILES))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_a_warm_slice_never_costs_packing(case: tuple[NodeState, WarmSpots, str]) -> None:
    """With warm slices, the spot chosen scores exactly what the engine's choice without
    them scores (the engine's loss of potential and potential left), on the same node; and
    it is either the engine's spot or a warm slice."""
    node, warm, profile = case
    chosen = place(Snapshot((node,)), _one(profile))
    if not isinstance(chosen, Placement):
        return
    got = prefer_warm(node, chosen, warm)
    c, g = chosen.slices[0], got.slices[0]
    assert got.node == chosen.node
    assert _score(node, g.gpu_index, profile, g.start) == _score(
        node, c.gpu_index, profile, c.start
    )
    if got != chosen:
        assert Occupied(g.start, g.size, profile) in warm.get(g.gpu_index, ())
