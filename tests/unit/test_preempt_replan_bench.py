"""`python -m bench.preempt_replan` in miniature: the allocator's own loop with a parked
49-slice preemptor no plan serves, then pods without slices deleted: the first pass plans,
the deletions retry the pod (one decision each) and plan nothing again. Leaves out the
100-node run and timings (this machine is shared; the numbers are in docs/allocator.md)."""

from __future__ import annotations

import pytest

from bench import preempt_replan

pytestmark = pytest.mark.timeout(60)


async def test_unrelated_deletions_retry_the_parked_pod_without_planning_again() -> None:
    r = await preempt_replan.measure(nodes=3, slices=49, deletions=3)
    assert r["deletions"] == 3 and r["decisions"] == 4  # every deletion retried it
    assert r["plans"] == 1  # the first pass only
    assert r["events"] == 1  # told once
    assert r["first_pass_cpu_ms"] > 0 and r["per_deletion_cpu_ms_max"] is not None
