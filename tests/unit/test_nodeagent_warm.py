"""Warm slices, the agent's pure part (nodeagent/warm.py): demand learned from recent asks,
where to keep warm slices, one step at a time, what a create destroys first, and the
handover that moves one instance from a warm record to a claim's in one checkpoint change.

Not here: the running pool and NVML (tests/integration/test_nodeagent_warm.py).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from common.placement import Gpu, NodeState, Occupied
from nodeagent.checkpoint import Checkpoint, ClaimRecord, SliceRecord
from nodeagent.model import Instance
from nodeagent.warm import (
    Demand,
    Spot,
    hand_over,
    in_the_way,
    next_step,
    settle,
    targets,
    warm_records,
)

U0, U1 = "GPU-0", "GPU-1"
ONE_G = 19  # 1g.10gb's profile id on an H100


def _slice(start: int, size: int = 1, profile: str = "1g.10gb", pid: int = ONE_G,
           gpu: str = U0, gi: int | None = None, kind: str = "mig") -> SliceRecord:  # fmt: skip
    idx = 0 if gpu == U0 else 1
    made = {} if gi is None else {"gi_id": gi, "ci_id": 0, "mig_uuid": f"MIG-{gpu}-{gi}"}
    return SliceRecord("c", profile, pid, gpu, idx, start, size, kind=kind, **made)  # type: ignore[arg-type]


def _warm(start: int, gi: int | None = None, gpu: str = U0) -> ClaimRecord:
    uid = f"warm-{gpu}-{start}"
    return ClaimRecord(
        uid, "", uid, "warm", (replace(_slice(start, gpu=gpu, gi=gi), container=""),)
    )


def _cp(*recs: ClaimRecord) -> Checkpoint:
    cp = Checkpoint(node="n")
    for r in recs:
        cp = cp.with_claim(r)
    return cp


def _claim(*slices: SliceRecord) -> ClaimRecord:
    return ClaimRecord("u1", "ns", "c1", "creating", slices)


# ---- demand --------------------------------------------------------------------------------


def test_demand_keeps_the_busiest_profiles_and_their_burst() -> None:
    d = Demand(window_s=100, burst_s=10)
    for t in (0, 1, 2, 50):  # three within 10 s, then one
        d.note("1g.10gb", t)
    d.note("3g.40gb", 3)
    d.note("2g.20gb", 4)
    d.note("2g.20gb", 60)
    assert d.wanted(60, profiles=2, per_profile=5) == {"1g.10gb": 3, "2g.20gb": 1}
    assert d.wanted(60, profiles=2, per_profile=2) == {"1g.10gb": 2, "2g.20gb": 1}


def test_demand_ages_out_of_the_window() -> None:
    d = Demand(window_s=100, burst_s=10)
    d.note("1g.10gb", 0)
    assert d.wanted(99, 2, 2) == {"1g.10gb": 1}
    assert d.wanted(101, 2, 2) == {}


# ---- where, and what next -------------------------------------------------------------------


def _node(*occupied: tuple[Occupied, ...], usable: tuple[bool, ...] = (True, True)) -> NodeState:
    gpus = tuple(
        Gpu(i, "H100-80GB", healthy=usable[i], occupied=occ) for i, occ in enumerate(occupied)
    )
    return NodeState("n", pods_free=1, cpu_millis_free=1, memory_bytes_free=1, gpus=gpus)


def test_targets_follow_the_engine_and_respect_the_caps() -> None:
    node = _node((Occupied(6, 1, "1g.10gb"),), ())
    assert targets(node, {"1g.10gb": 3}, per_gpu=1, per_node=4) == [Spot(0, "1g.10gb", 5, 1)]
    two = targets(node, {"1g.10gb": 3}, per_gpu=2, per_node=4)
    assert two == [Spot(0, "1g.10gb", 5, 1), Spot(0, "1g.10gb", 4, 1)]
    assert targets(node, {"1g.10gb": 3}, per_gpu=2, per_node=1) == two[:1]
    assert targets(_node((), (), usable=(False, False)), {"1g.10gb": 1}, 1, 2) == []


def test_next_step_makes_what_is_missing_and_keeps_what_is_there() -> None:
    want = [Spot(0, "1g.10gb", 5, 1)]
    assert next_step(_cp(), want, {0}, 2) == next_step(_cp(), want, {0, 1}, 2)
    step = next_step(_cp(), want, {0}, 2)
    assert step is not None and step.kind == "make" and step.spot == want[0]
    assert next_step(_cp(_warm(5, gi=3)), want, {0}, 2) is None


@pytest.mark.parametrize(
    ("recs", "want", "eligible", "why"),
    [
        ((_warm(5, gi=3),), [Spot(0, "1g.10gb", 5, 1)], set(), "its GPU is not to be warmed"),
        ((_warm(5, gi=3),), [], {0}, "no recent demand for its profile"),
        ((_warm(5),), [Spot(0, "1g.10gb", 5, 1)], {0}, "never finished"),
        ((_warm(4, gi=3),), [Spot(0, "2g.20gb", 4, 2), Spot(0, "1g.10gb", 6, 1)], {0},
         "in the way of a better spot"),
        ((_warm(3, gi=3), _warm(2, gi=4)), [Spot(0, "1g.10gb", 5, 1)], {0},
         "room for a better spot"),
    ],
)  # fmt: skip
def test_next_step_destroys(
    recs: tuple[ClaimRecord, ...], want: list[Spot], eligible: set[int], why: str
) -> None:
    step = next_step(_cp(*recs), want, eligible, per_node=2)
    assert step is not None and (step.kind, step.why) == ("destroy", why)


def test_a_warm_slice_an_allocation_names_is_left_for_it() -> None:
    """The allocator placed a pod on it: its create takes it; the pool must not destroy it
    meanwhile, whatever it would now rather warm."""
    cp = _cp(_warm(5, gi=3))
    want = [Spot(0, "1g.10gb", 4, 1)]
    assert next_step(cp, want, {0}, 1) is not None  # over the cap: destroyed for a better spot
    step = next_step(cp, want, {0}, 1, promised={Spot(0, "1g.10gb", 5, 1)})
    assert step is not None and step.kind == "make" and step.spot == want[0]


# ---- a create and the warm slices -------------------------------------------------------------


def test_hand_over_moves_the_instance_in_one_change() -> None:
    cp = _cp(_warm(5, gi=3), _warm(4, gi=7))
    after, taken = hand_over(cp, _claim(_slice(5), _slice(0, 2, "2g.20gb", 14)))
    assert taken == 1
    assert [r.uid for r in warm_records(after)] == ["warm-GPU-0-4"]
    got = after.claims["u1"].slices
    assert (got[0].gi_id, got[0].mig_uuid) == (3, "MIG-GPU-0-3")
    assert got[1].gi_id is None  # nothing warm there: made by NVML


def test_hand_over_takes_only_a_made_warm_slice_of_the_same_profile() -> None:
    cp = _cp(_warm(5), _warm(4, gi=7))
    after, taken = hand_over(cp, _claim(_slice(5), _slice(4, 1, "1g.20gb", 15)))
    assert taken == 0 and after.claims["u1"].slices[0].gi_id is None
    assert len(warm_records(after)) == 2


def test_in_the_way() -> None:
    cp = _cp(_warm(5, gi=3), _warm(6, gi=4), _warm(2, gi=5, gpu=U1))
    assert [r.uid for r in in_the_way(cp, [_slice(5)])] == []  # exactly it: handed over
    assert [r.uid for r in in_the_way(cp, [_slice(4, 2, "2g.20gb", 14)])] == ["warm-GPU-0-5"]
    whole = _slice(0, 8, "gpu", -1, gpu=U1, kind="gpu")
    assert [r.uid for r in in_the_way(cp, [whole])] == ["warm-GPU-1-2"]


def test_settle_after_a_restart() -> None:
    """A warm record takes the ids of the instance at its placement; one whose make never
    happened goes; one with a GI but no CI stays, for the pool to destroy."""
    cp = _cp(_warm(5), _warm(4), _warm(3))
    insts = [
        Instance(0, U0, 9, ONE_G, 5, 1, (0,), ("MIG-a",)),
        Instance(0, U0, 8, ONE_G, 3, 1),
    ]
    after, dropped = settle(cp, insts)
    assert dropped == ["warm-GPU-0-4"]
    assert after.claims["warm-GPU-0-5"].slices[0].mig_uuid == "MIG-a"
    assert after.claims["warm-GPU-0-3"].slices[0].gi_id is None
