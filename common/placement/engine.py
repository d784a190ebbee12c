"""`place(snapshot, request, policy) -> Placement | Pending`: the pure placement decision.

All slices of a pod go to one node, spread over as many of its GPUs as needed. The node
must pass the pod's nodeSelector / required affinity / tolerations and have the pod's cpu,
memory and one pod slot free. Policies differ only in which legal placement they prefer:

- `instaslice`: fragmentation-aware best fit. Every candidate (node, GPUs, starts) is scored
  by the *loss of potential* it causes — the drop in the size²-weighted number of future
  placements of every shape (tables.py) — and the smallest loss wins; ties go to the fuller
  GPU, then the fuller node, then snapshot order. Breaking an intact GPU costs its 7g and
  4g/3g windows, so the policy packs into already-broken GPUs and keeps whole ones whole.
- `first-fit`: nodes in order, GPUs in order, lowest start (NVIDIA's DRA driver, the old
  InstaSlice).
- `spread`: the node with the most free slots first, then its emptiest GPU, lowest start
  (Red Hat DAS).
- `static-balanced`: every GPU is pre-sliced in MIG Manager's all-balanced layout; a slice
  may only take a free layout slice of exactly its profile, first node / GPU in order.

No I/O, no clock, no state between calls beyond pure memoisation (tables.py). When nothing
fits, explain.py says why.
"""

from __future__ import annotations

from collections.abc import Iterator

from common.catalog import Catalog, load_catalog
from common.placement.explain import explain
from common.placement.model import (
    NodeState,
    Pending,
    PlacedSlice,
    Placement,
    PodRequest,
    Policy,
    Snapshot,
)
from common.placement.search import Context, NodeFit
from common.placement.selectors import mismatch

__all__ = ["Policy", "place"]


def place(
    snapshot: Snapshot,
    request: PodRequest,
    policy: Policy = Policy.INSTASLICE,
    catalog: Catalog | None = None,
) -> Placement | Pending:
    """Where `request` goes in `snapshot` under `policy`, or why it cannot go anywhere now."""
    ctx = Context(catalog if catalog is not None else load_catalog(), policy, request)
    chosen = _choose(snapshot, request, ctx)
    if chosen is None:
        return explain(snapshot, request, ctx)
    node, fit = chosen
    return _placement(node, fit, request, ctx)


def _choose(
    snapshot: Snapshot, request: PodRequest, ctx: Context
) -> tuple[NodeState, NodeFit] | None:
    filtered = bool(request.node_selector or request.required_affinity)
    cpu, mem = request.cpu_millis, request.memory_bytes

    def candidates() -> Iterator[NodeState]:
        for node in snapshot.nodes:
            if node.pods_free < 1 or node.cpu_millis_free < cpu or node.memory_bytes_free < mem:
                continue
            if (filtered or node.taints or node.unschedulable) and mismatch(node, request):
                continue
            yield node

    if ctx.policy is Policy.INSTASLICE:
        best: list[tuple[NodeState, NodeFit]] = []
        best_cost = -1
        for node in candidates():
            fit = ctx.node_fit(node)
            if fit is None:
                continue
            if not best or fit.cost < best_cost:
                best, best_cost = [(node, fit)], fit.cost
            elif fit.cost == best_cost:
                best.append((node, fit))
        if not best:
            return None
        if len(best) == 1:
            return best[0]
        # Pack: among equally good spots, the node with the least potential left.
        return min(enumerate(best), key=lambda e: (ctx.node_potential(e[1][0]), e[0]))[1]
    nodes: Iterator[NodeState] | list[NodeState] = candidates()
    if ctx.policy is Policy.SPREAD:
        nodes = sorted(nodes, key=ctx.node_free_slots, reverse=True)
    for node in nodes:
        fit = ctx.node_fit(node)
        if fit is not None:
            return node, fit
    return None


def _placement(node: NodeState, fit: NodeFit, request: PodRequest, ctx: Context) -> Placement:
    """Hand the node's (position, profile, start) triples to the request's slices in order."""
    pool: dict[str, list[tuple[int, int]]] = {}
    for pos, profile, start in sorted(fit.assignment):
        pool.setdefault(profile, []).append((pos, start))
    slices = []
    for s in request.slices:
        for _ in range(s.count):
            pos, start = pool[s.profile].pop(0)
            gpu = node.gpus[pos]
            slices.append(
                PlacedSlice(
                    s.container, s.profile, gpu.index, start, ctx.size(gpu.model, s.profile)
                )
            )
    return Placement(node.name, tuple(slices))
