"""Prometheus metrics of the allocator, on a registry the caller owns (no import-time state).

- `instaslice_allocator_gate_removal_seconds` (histogram): pod creation → gate removed, i.e.
  how long a pod waited for its slices. Measured from when the allocator first saw the pod
  (watch latency, milliseconds) when it saw it being created, else from the pod's
  `creationTimestamp` (whole seconds).
- `instaslice_allocator_queue_depth` (gauge): pods waiting for a placement decision,
  including those parked as pending.
- `instaslice_allocator_allocations_total{outcome}` (counter): created, ready (pinned),
  failed (the node agent reported Failed), released, conflict, error.
- `instaslice_allocator_pending_pods{reason}` (gauge): pods that cannot be placed now, by
  reason (common.placement.PendingReason).
- `instaslice_allocator_leader` (gauge): 1 on the replica that holds the Lease.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client import Counter as PromCounter

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0)


class AllocatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.gate_removal = Histogram(
            "instaslice_allocator_gate_removal_seconds",
            "Pod creation to scheduling-gate removal",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "instaslice_allocator_queue_depth",
            "Gated pods waiting for a placement decision (queued or pending)",
            registry=self.registry,
        )
        self.allocations = PromCounter(
            "instaslice_allocator_allocations",
            "SliceAllocations by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.pending = Gauge(
            "instaslice_allocator_pending_pods",
            "Pods that cannot be placed now, by reason",
            ["reason"],
            registry=self.registry,
        )
        self.leader = Gauge(
            "instaslice_allocator_leader",
            "1 when this replica holds the allocator Lease",
            registry=self.registry,
        )
        self._pending_reasons: set[str] = set()

    def outcome(self, outcome: str) -> None:
        self.allocations.labels(outcome=outcome).inc()

    def set_pending(self, by_reason: Mapping[str, int]) -> None:
        counts = Counter(by_reason)
        for reason in self._pending_reasons | set(counts):
            self.pending.labels(reason=reason).set(counts.get(reason, 0))
        self._pending_reasons |= set(counts)

    def count(self, outcome: str) -> float:
        """The current value of one outcome counter (for tests and logs)."""
        value = self.registry.get_sample_value(
            "instaslice_allocator_allocations_total", {"outcome": outcome}
        )
        return value or 0.0
