"""Prometheus metrics of the allocator, on a registry the caller owns (no import-time state).

Names follow docs/metrics.md:
- `instaslice_allocator_time_to_ungate_seconds` (histogram): from the pod's creation — or,
  when another gate (e.g. Kueue's) held it, from when ours became its only gate — to the
  allocator lifting the gate. Measured on the allocator's monotonic clock from when it saw
  the pod (watch latency, milliseconds); pods already there when it started are measured
  from `creationTimestamp` (whole seconds).
- `instaslice_allocator_queue_depth` (gauge): gated pods waiting for a placement decision,
  queued or parked as pending.
- `instaslice_allocations_total{outcome}` (counter): `allocated` (SliceAllocation written),
  `pending` (a decision that found no placement), `failed` (the node agent failed it),
  `released` (deleted by the allocator: pod finished or gone, failed, node gone),
  `pinned_unschedulable` (docs/contract.md §4 step 4), `error` (a write the API server refused).
- `instaslice_pending_pods{reason}` (gauge): pods that cannot be placed now, by
  `common.placement.PendingReason` (plus `InvalidRequest` / `WriteError` /
  `LargerThanAnyNode`).
- `instaslice_slices{profile, model}` (gauge): slices held by live SliceAllocations.
- `instaslice_gpu_slots_used{node, gpu, model}` / `instaslice_gpu_slots{...}` (gauges):
  occupied and total memory slots per GPU (occupied includes foreign instances).
- `instaslice_allocator_leader` (gauge): 1 on the replica that holds the Lease.
- `instaslice_allocator_gpus_refused{node, gpu}` (gauge): 1 per GPU whose MigNode entry lies
  beyond the bounds (views.refused_gpu: nothing is placed there).

The gauges computed from the allocator's model (queue depth, pending pods, slices, GPU slots)
are read from it when Prometheus scrapes (`StateCollector`), not refreshed on every change:
keeping per-GPU series current on every decision walked the fleet and cost 12 % of the
allocator's CPU in a 1000-pod burst (docs/benchmarks-history.md). Only the leader exports them: a
standby's cache would double-count.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client import Counter as PromCounter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common.catalog import Catalog
from common.placement import Gpu, PendingReason

if TYPE_CHECKING:
    from webhook.allocator.state import ClusterState

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0)
OUTCOMES = ("allocated", "pending", "failed", "released", "pinned_unschedulable", "error")


@dataclass(frozen=True)
class GaugeView:
    """What the state gauges are computed from, at scrape time."""

    state: ClusterState
    queue_depth: int
    pending: Mapping[str, int]
    catalog: Catalog


class StateCollector(Collector):
    """The gauges derived from the allocator's model, computed when scraped. `source`
    returns None while this replica does not lead (then only the names are exported)."""

    def __init__(self) -> None:
        self.source: Callable[[], GaugeView | None] = lambda: None

    def describe(self) -> Iterator[Metric]:
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        queue, pending, slices, used, total, down, refused = families = self._families()
        view = self.source()
        if view is None:
            return iter(families)
        queue.add_metric([], view.queue_depth)
        for name, views in sorted(view.state.gpus.items()):
            for v in views:
                if v.refused:
                    refused.add_metric([name, str(v.index)], 1)
        down.add_metric([], len(view.state.down_agents_placeable()))
        for reason in sorted({r.value for r in PendingReason} | set(view.pending)):
            pending.add_metric([reason], view.pending.get(reason, 0))
        models: dict[str, str] = {}
        for node in view.state.node_states():
            for gpu in view.state.gpus.get(node.name, ()):
                models[gpu.uuid] = gpu.model
            for g in node.gpus:
                labels = [node.name, str(g.index), g.model]
                used.add_metric(labels, g.mask.bit_count())
                total.add_metric(labels, _slots(view.catalog, g))
        by_profile: Counter[tuple[str, str]] = Counter()
        for (profile, _, gpu_uuid), n in view.state.slice_counts.items():
            by_profile[(profile, models.get(gpu_uuid, "unknown"))] += n
        for (profile, model), n in sorted(by_profile.items()):
            if n:
                slices.add_metric([profile, model], n)
        return iter(families)

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, ...]:
        gpu = ["node", "gpu", "model"]
        return (
            GaugeMetricFamily(
                "instaslice_allocator_queue_depth",
                "Gated pods waiting for a placement decision (queued or pending)",
            ),
            GaugeMetricFamily(
                "instaslice_pending_pods",
                "Gated pods that cannot be placed now, by reason",
                labels=["reason"],
            ),
            GaugeMetricFamily(
                "instaslice_slices",
                "MIG slices held by live SliceAllocations",
                labels=["profile", "model"],
            ),
            GaugeMetricFamily(
                "instaslice_gpu_slots_used",
                "Occupied memory slots of one GPU (InstaSlice's slices and foreign instances)",
                labels=gpu,
            ),
            GaugeMetricFamily("instaslice_gpu_slots", "Memory slots of one GPU", labels=gpu),
            GaugeMetricFamily(
                "instaslice_nodes_agent_down",
                "MIG nodes left out of placement because their node agent's Lease went stale",
            ),
            GaugeMetricFamily(
                "instaslice_allocator_gpus_refused",
                "GPUs whose MigNode entry lies beyond InstaSlice's bounds: nothing is placed there",
                labels=["node", "gpu"],
            ),
        )


class AllocatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.time_to_ungate = Histogram(
            "instaslice_allocator_time_to_ungate_seconds",
            "Pod creation (or its last other gate lifted) to the allocation gate removed",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.allocations = PromCounter(
            "instaslice_allocations",
            "Placement decisions and releases, by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.leader = Gauge(
            "instaslice_allocator_leader",
            "1 when this replica holds the allocator Lease",
            registry=self.registry,
        )
        for outcome in OUTCOMES:  # export zeros, so rate() works from the start
            self.allocations.labels(outcome=outcome)
        self.state_gauges = StateCollector()
        self.registry.register(self.state_gauges)

    def outcome(self, outcome: str) -> None:
        self.allocations.labels(outcome=outcome).inc()

    def count(self, outcome: str) -> float:
        """The current value of one outcome counter (for tests and logs)."""
        value = self.registry.get_sample_value("instaslice_allocations_total", {"outcome": outcome})
        return value or 0.0


def _slots(catalog: Catalog, gpu: Gpu) -> int:
    found = gpu.geometry or catalog.model(gpu.model)
    return found.memory_slots if found is not None else 0
