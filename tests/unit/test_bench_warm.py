"""bench/warm.py: the agent's warm-slice counters summed over nodes, and a scenario's hit rate
from the scrapes before and after it. Not here: the scrape itself (bench.latency runs it)."""

from __future__ import annotations

from bench.warm import warm_counts, warm_summary

TEXT = """# HELP instaslice_nodeagent_warm_slices_total Warm slices
# TYPE instaslice_nodeagent_warm_slices_total counter
instaslice_nodeagent_warm_slices_total{event="hit",node="a"} 3.0
instaslice_nodeagent_warm_slices_total{event="hit",node="b"} 5.0
instaslice_nodeagent_warm_slices_total{event="miss",node="a"} 2.0
instaslice_nodeagent_warm_slices_total{event="made",node="a"} 9.0
instaslice_nodeagent_warm_slices_created{event="hit",node="a"} 1.7e9
instaslice_nodeagent_slices{node="a",owner="foreign"} 1.0
"""


def test_counts_sum_over_nodes() -> None:
    assert warm_counts(TEXT) == {"hit": 8.0, "miss": 2.0, "made": 9.0}


def test_summary_is_the_difference() -> None:
    got = warm_summary({"hit": 2.0, "miss": 1.0}, warm_counts(TEXT))
    assert got == {"hits": 6, "misses": 1, "made": 9, "destroyed": 0, "hit_rate": 0.857}
    assert warm_summary({}, {}) is None  # warm slices off: nothing to say
