"""When the node agent renews its Lease (nodeagent.heartbeat): a quarter of the duration, on
a fixed cadence from a random phase, so that many nodes started together (one process serving
5000 emulated nodes) renew spread over the period, and stay spread after an API server stall."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nodeagent.heartbeat import next_renewal, phase, renewal_period


@pytest.mark.parametrize(
    ("duration", "period"),
    [(40, 10.0), (1200, 300.0), (8, 2.0), (2, 1.0), (1, 1.0)],
)
def test_a_quarter_of_the_duration_at_least_one_second(duration: int, period: float) -> None:
    assert renewal_period(duration) == period


@pytest.mark.parametrize(
    ("now", "cadence", "period", "expected"),
    [
        (0.0, 3.0, 10.0, 3.0),  # the first slot, within a period of the start
        (3.0, 3.0, 10.0, 13.0),  # renewed on the slot: the next one
        (3.5, 3.0, 10.0, 13.0),  # a renewal that took 0.5 s: still the next slot
        (27.0, 3.0, 10.0, 33.0),  # a stall past two slots: skipped, not caught up
        (-4.0, 3.0, 10.0, 3.0),
    ],
)
def test_next_renewal_table(now: float, cadence: float, period: float, expected: float) -> None:
    assert next_renewal(now, cadence, period) == pytest.approx(expected)


def test_a_period_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="period must be positive"):
        next_renewal(1.0, 0.0, 0.0)


@given(
    now=st.floats(-1e6, 1e6),
    cadence=st.floats(-1e6, 1e6),
    period=st.floats(1.0, 1e4),
)
def test_the_next_renewal_is_on_the_cadence_and_within_one_period(
    now: float, cadence: float, period: float
) -> None:
    t = next_renewal(now, cadence, period)
    assert now < t <= now + period * (1 + 1e-9) + 1e-6
    k = (t - cadence) / period
    assert abs(k - round(k)) < 1e-6


@given(start=st.floats(0, 1e6), period=st.floats(1.0, 1e4), seed=st.integers(0, 2**32))
def test_the_phase_is_within_one_period_of_the_start(
    start: float, period: float, seed: int
) -> None:
    p = phase(start, period, random.Random(seed))
    assert start <= p <= start + period


def _buckets(times: list[float], period: float, n: int = 10) -> Counter[int]:
    return Counter(int((t % period) / period * n) % n for t in times)


def test_nodes_started_together_renew_spread_over_the_period() -> None:
    """1000 nodes whose heartbeats start in the same second: their renewals fill every tenth
    of the period about evenly (each tenth ~100), not one wave of 1000."""
    rng, period, nodes = random.Random(7), 300.0, 1000
    cadences = [phase(rng.uniform(0.0, 1.0), period, rng) for _ in range(nodes)]
    firsts = [next_renewal(0.0 + 1.0, c, period) for c in cadences]
    counts = _buckets(firsts, period)
    assert len(counts) == 10
    assert max(counts.values()) < 150, counts


def test_a_stall_that_ends_every_renewal_at_once_does_not_line_them_up() -> None:
    """An API server stall: every node's renewal returns at the same moment. The next
    renewals keep each node's own phase (spread), where renewing `period` after the
    renewal returned put all 1000 in the same instant, for every period after."""
    rng, period, nodes = random.Random(11), 10.0, 1000
    cadences = [phase(0.0, period, rng) for _ in range(nodes)]
    stall_ends = 47.3
    after = [next_renewal(stall_ends, c, period) for c in cadences]
    counts = _buckets(after, period)
    assert max(counts.values()) < 150, counts
    assert all(stall_ends < t <= stall_ends + period for t in after)
