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
  `pinned_unschedulable` (CONTRACT.md §4 step 4), `error` (a write the API server refused).
- `instaslice_pending_pods{reason}` (gauge): pods that cannot be placed now, by
  `common.placement.PendingReason` (plus `InvalidRequest` / `WriteError`).
- `instaslice_slices{profile, model}` (gauge): slices held by live SliceAllocations.
- `instaslice_gpu_slots_used{node, gpu, model}` / `instaslice_gpu_slots{...}` (gauges):
  occupied and total memory slots per GPU (occupied includes foreign instances).
- `instaslice_allocator_leader` (gauge): 1 on the replica that holds the Lease.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client import Counter as PromCounter

from common.catalog import Catalog
from common.placement import PendingReason

if TYPE_CHECKING:
    from webhook.allocator.state import ClusterState

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0)
OUTCOMES = ("allocated", "pending", "failed", "released", "pinned_unschedulable", "error")


class AllocatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.time_to_ungate = Histogram(
            "instaslice_allocator_time_to_ungate_seconds",
            "Pod creation (or its last other gate lifted) to the allocation gate removed",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "instaslice_allocator_queue_depth",
            "Gated pods waiting for a placement decision (queued or pending)",
            registry=self.registry,
        )
        self.allocations = PromCounter(
            "instaslice_allocations",
            "Placement decisions and releases, by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.pending = Gauge(
            "instaslice_pending_pods",
            "Gated pods that cannot be placed now, by reason",
            ["reason"],
            registry=self.registry,
        )
        self.slices = Gauge(
            "instaslice_slices",
            "MIG slices held by live SliceAllocations",
            ["profile", "model"],
            registry=self.registry,
        )
        self.gpu_slots_used = Gauge(
            "instaslice_gpu_slots_used",
            "Occupied memory slots of one GPU (InstaSlice's slices and foreign instances)",
            ["node", "gpu", "model"],
            registry=self.registry,
        )
        self.gpu_slots = Gauge(
            "instaslice_gpu_slots",
            "Memory slots of one GPU",
            ["node", "gpu", "model"],
            registry=self.registry,
        )
        self.leader = Gauge(
            "instaslice_allocator_leader",
            "1 when this replica holds the allocator Lease",
            registry=self.registry,
        )
        for outcome in OUTCOMES:  # export zeros, so rate() works from the start
            self.allocations.labels(outcome=outcome)
        for reason in PendingReason:
            self.pending.labels(reason=reason.value).set(0)
        self._pending_reasons = {r.value for r in PendingReason}
        self._slice_keys: set[tuple[str, str]] = set()
        self._gpu_labels: dict[str, set[tuple[str, str]]] = {}  # node -> {(gpu, model)}

    def outcome(self, outcome: str) -> None:
        self.allocations.labels(outcome=outcome).inc()

    def count(self, outcome: str) -> float:
        """The current value of one outcome counter (for tests and logs)."""
        value = self.registry.get_sample_value("instaslice_allocations_total", {"outcome": outcome})
        return value or 0.0

    def set_pending(self, by_reason: Mapping[str, int]) -> None:
        for reason in self._pending_reasons | set(by_reason):
            self.pending.labels(reason=reason).set(by_reason.get(reason, 0))
        self._pending_reasons |= set(by_reason)

    def set_slices(self, by_profile_model: Mapping[tuple[str, str], int]) -> None:
        for profile, model in self._slice_keys - set(by_profile_model):
            self.slices.remove(profile, model)
        for (profile, model), n in by_profile_model.items():
            self.slices.labels(profile=profile, model=model).set(n)
        self._slice_keys = set(by_profile_model)

    def set_node_gpus(self, node: str, gpus: Iterable[tuple[int, str, int, int]]) -> None:
        """One node's GPUs as (index, model, used slots, total slots); empty drops the node."""
        fresh = {(str(i), m): (used, total) for i, m, used, total in gpus}
        for gpu, model in self._gpu_labels.get(node, set()) - set(fresh):
            self.gpu_slots_used.remove(node, gpu, model)
            self.gpu_slots.remove(node, gpu, model)
        for (gpu, model), (used, total) in fresh.items():
            self.gpu_slots_used.labels(node=node, gpu=gpu, model=model).set(used)
            self.gpu_slots.labels(node=node, gpu=gpu, model=model).set(total)
        if fresh:
            self._gpu_labels[node] = set(fresh)
        else:
            self._gpu_labels.pop(node, None)

    def publish(
        self,
        state: ClusterState,
        queue_depth: int,
        pending: Mapping[str, int],
        catalog: Catalog,
    ) -> None:
        """Refresh the gauges from the model; per-GPU series only for nodes that changed."""
        self.queue_depth.set(queue_depth)
        self.set_pending(pending)
        changed = state.take_changed_nodes()
        if not changed:
            return
        for name in changed:
            node = state.node_state(name)
            gpus = node.gpus if node is not None else ()
            self.set_node_gpus(
                name,
                [(g.index, g.model, g.mask.bit_count(), _slots(catalog, g.model)) for g in gpus],
            )
        models = {g.uuid: g.model for gpus in state.gpus.values() for g in gpus}
        by_profile: Counter[tuple[str, str]] = Counter()
        for (profile, _, gpu_uuid), n in state.slice_counts.items():
            by_profile[(profile, models.get(gpu_uuid, "unknown"))] += n
        self.set_slices(by_profile)


def _slots(catalog: Catalog, model: str) -> int:
    found = catalog.model(model)
    return found.memory_slots if found is not None else 0
