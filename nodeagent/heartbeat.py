"""When the node agent renews its Lease: every quarter of its duration, on a fixed cadence
from a random phase (pure).

A kubelet renews its node Lease every 10 s (a quarter of 40 s) and kubelets that started at
different times renew at different times. One process serving many emulated nodes, or a
fleet rolled out at once, starts every node's heartbeat in the same few seconds; renewed
`period` after each renewal, they stay together and come as one wave per period (5000 PATCH
leases within a minute, then none: issue 25's scale run). A random phase spreads them over
the period; a fixed cadence (not `period` after each renewal ends) keeps them spread after
an API server stall, which otherwise ends every delayed renewal at once and lines them up
again.
"""

from __future__ import annotations

import math
import random


def renewal_period(lease_duration_s: float) -> float:
    """A quarter of the Lease's duration (as the kubelet), at least 1 s."""
    return max(1.0, lease_duration_s / 4)


def phase(start: float, period: float, rng: random.Random | None = None) -> float:
    """This node's cadence: renewals at `phase + k * period`, the first within one period
    of `start` (the Lease itself is written at `start`)."""
    return start + (rng or random).uniform(0.0, period)


def next_renewal(now: float, phase: float, period: float) -> float:
    """The first time on the cadence `phase + k * period` after `now`: never more than one
    period away, whatever a renewal cost; slots a stall missed are skipped, not caught up."""
    if period <= 0:
        raise ValueError(f"period must be positive, not {period}")
    k = math.floor((now - phase) / period) + 1
    return phase + k * period
