"""When the placer plans a preemption, and how often (docs/allocator.md "Planning cost").

A preemption plan is the allocator's dearest decision: an exact search over windows and
victim sets, bounded only by `SEARCH_BUDGET` (common/placement/preempt.py), so a pod asking
dozens of slices of one node costs a second or more of CPU per plan on a large fleet, and a
sized ask one such plan per GPU model. A parked pod is retried whenever capacity may have
grown (`ClusterState.epoch`), which on a busy cluster is every few moments: planning anew on
each retry spent that CPU over and over on the same answer.

`PlanInputs` is what a plan read — the version of the slice holders and of the nodes and
GPUs (`ClusterState.holders_version`), of the PodDisruptionBudgets, the pod's own spec and
what it must avoid, and which nodes lack the cpu, memory or pod slot it asks. A plan that
found nothing is kept with them in the pod's record (`PodTrack.no_plan`) and made again only
when they change: a pod without slices leaving a node with room to spare does not plan
again. Pure.

What this module does not do: choose victims (common/placement/preempt.py) or decide who may
be one (preemption.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.placement import PodRequest, Snapshot

# --- what a plan read --------------------------------------------------------------------

Short = tuple[tuple[str, int, int, bool], ...]  # (node, cpu millis, memory bytes, no pod slot)


@dataclass(frozen=True, slots=True)
class PlanInputs:
    """What a preemption plan for one pod read: equal inputs, equal plan."""

    holders: int  # ClusterState.holders_version: allocations, their pods, nodes, GPUs
    budgets: int  # Budgets.version: the PodDisruptionBudgets
    generation: int  # the pod's spec (its asks, selectors, tolerations)
    avoid: frozenset[str]  # pods it never preempts again (PodTrack.avoid)
    excluded: frozenset[tuple[str, str]]  # GPUs left out of its snapshot
    short: Short  # the nodes short of its cpu / memory / a pod slot


def short_nodes(snapshot: Snapshot, request: PodRequest) -> Short:
    """The nodes that lack what `request` asks of cpu, memory or a pod slot, with what they
    lack. A node with room to spare reads the same however much room it has, so a pod
    leaving it changes nothing here; the plans that count the preemptor's cpu and memory on
    a node (its victims' freed) read no more than this."""
    cpu, memory = request.cpu_millis, request.memory_bytes
    out = []
    for n in snapshot.nodes:
        lacks = (max(0, cpu - n.cpu_millis_free), max(0, memory - n.memory_bytes_free))
        if lacks != (0, 0) or n.pods_free < 1:
            out.append((n.name, *lacks, n.pods_free < 1))
    return tuple(out)


@dataclass(eq=False)
class SharedViews:
    """What the pods of a round share while the model hands out the same objects (its
    snapshot stays the same until something changes): the short nodes per cpu/memory ask.
    A round of many parked pods then walks the fleet once, not once per pod."""

    _snapshot: Snapshot | None = None
    _short: dict[tuple[int, int], Short] = field(default_factory=dict)

    def short(self, snapshot: Snapshot, request: PodRequest) -> Short:
        if snapshot is not self._snapshot:
            self._snapshot, self._short = snapshot, {}
        key = (request.cpu_millis, request.memory_bytes)
        if key not in self._short:
            self._short[key] = short_nodes(snapshot, request)
        return self._short[key]
