"""Python's garbage collector in a process that holds the cluster in memory."""

from __future__ import annotations

import gc

# Container objects allocated (net) before a young collection; CPython's default is 700.
YOUNG_THRESHOLD = 20_000


def settle_collector() -> None:
    """Freeze what the process holds now and collect the young generation less often.

    Called once a process has listed the cluster. Its caches (nodes, pods, MigNodes) live
    as long as the process, yet every full collection walked all of them again: at 5000
    nodes about a million objects, 180 to 800 ms of CPU inside one placement decision. And a
    young collection every 700 allocations ran during one decision in ten, which made the
    decision p99 (docs/benchmarks-history.md, "The collector"). Frozen objects are still freed by
    reference counting when a cache drops them; only a cycle among them would outlive its
    use, and the caches hold none.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, 20, 20)
