"""`place(snapshot, request, policy) -> Placement | Pending`: the pure placement decision.

All slices of a pod go to one node, spread over as many of its GPUs as needed. The node
must pass the pod's nodeSelector / required affinity / tolerations and have the pod's cpu,
memory and one pod slot free. Policies differ only in which legal placement they prefer:

- `instaslice`: fragmentation-aware best fit. Every candidate (node, GPUs, starts) is scored
  by the *loss of potential* it causes — the drop in the size²-weighted number of future
  placements of every shape, plus a term for slots left stranded (tables.py) — and the
  smallest loss wins; ties go to the fuller
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
from heapq import heapify, heappop

from common.catalog import Catalog
from common.placement import explain as explain_module
from common.placement import search
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
from common.placement.search import (
    RANK_SCALE,
    Context,
    NodeFit,
    bound_table,
    node_bound,
    node_may_fit,
    node_single,
    prune,
    rank_table,
)
from common.placement.selectors import mismatch
from common.placement.tables import COST_SCALE

__all__ = ["Policy", "clear_caches", "place"]


def clear_caches() -> None:
    """Forget every memoised answer, as a fresh process would (benchmarks, tests)."""
    search.clear_caches()
    explain_module.clear_caches()


def place(
    snapshot: Snapshot,
    request: PodRequest,
    policy: Policy = Policy.INSTASLICE,
    catalog: Catalog | None = None,
) -> Placement | Pending:
    """Where `request` goes in `snapshot` under `policy`, or why it cannot go anywhere now."""
    ctx = Context(catalog, policy, request)
    chosen = _choose(snapshot, request, ctx)
    if chosen is None:
        return explain(snapshot, request, ctx)
    node, fit = chosen
    return placement_of(node, fit, request, ctx)


# A multi-slice pod is scored exactly on the nodes in ascending order of a lower bound on
# its loss; after the first node that fits, at most this many more are scored (bounded work
# on a cold cache; the bound usually stops the scan much earlier).
MULTI_NODE_BUDGET = 4


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

    if ctx.policy is not Policy.INSTASLICE:
        nodes: Iterator[NodeState] | list[NodeState] = candidates()
        if ctx.policy is Policy.SPREAD:
            nodes = sorted(nodes, key=ctx.node_free_slots, reverse=True)
        for node in nodes:
            fit = ctx.node_fit(node)
            if fit is not None:
                return node, fit
        return None

    # instaslice: the least (cost, node potential) over all candidate nodes, first in
    # snapshot order on a tie — the fuller node wins, so the policy packs. The loops below
    # are the hot path (one pass over every node per decision), so they stay flat: no
    # per-node work beyond one memoised lookup.
    ct, policy = ctx.ct, ctx.policy
    if ctx.single is not None:
        profile = ctx.single
        ranks = rank_table(ct, profile, policy)
        prune(ranks, snapshot.nodes)
        best_rank = -1
        best_node: NodeState | None = None
        for node in snapshot.nodes:
            if node.pods_free < 1 or node.cpu_millis_free < cpu or node.memory_bytes_free < mem:
                continue
            if (filtered or node.taints or node.unschedulable) and mismatch(node, request):
                continue
            key = node.gpu_key
            r = ranks.get(key)
            if r is None:
                fit = node_single(ct, key, profile, policy)
                r = ranks[key] = -1 if fit is None else fit.rank[0] * RANK_SCALE + fit.rank[1]
            if r >= 0 and (best_node is None or r < best_rank):
                best_rank, best_node = r, node
        if best_node is None:
            return None
        fit = node_single(ct, best_node.gpu_key, profile, policy)
        assert fit is not None
        return best_node, fit
    if not ctx.profiles:
        return next(((node, NodeFit(0, 0, ())) for node in candidates()), None)
    bounded = []
    bounds = bound_table(ct, ctx.profiles)
    prune(bounds, snapshot.nodes)
    for order, node in enumerate(snapshot.nodes):
        if node.pods_free < 1 or node.cpu_millis_free < cpu or node.memory_bytes_free < mem:
            continue
        if (filtered or node.taints or node.unschedulable) and mismatch(node, request):
            continue
        key = node.gpu_key
        bound = bounds.get(key)
        if bound is None:
            found = node_bound(ct, key, ctx.profiles)
            bound = bounds[key] = -1 if found is None else found
        if bound >= 0:
            bounded.append((bound, order, node))
    heapify(bounded)  # (bound, snapshot order): popped in ascending order

    def ascending() -> Iterator[tuple[int, NodeState]]:
        while bounded:
            bound, _, node = heappop(bounded)
            yield bound, node

    return bounded_search(ctx, ascending())


def bounded_search(
    ctx: Context, candidates: Iterator[tuple[int, NodeState]]
) -> tuple[NodeState, NodeFit] | None:
    """A multi-slice pod's best node among `candidates` — the nodes that pass its filters,
    with their lower bound, in ascending (bound, snapshot order): each is scored exactly
    until the bound says no later node can win or the budget is spent."""
    best: tuple[NodeState, NodeFit] | None = None
    budget = MULTI_NODE_BUDGET
    for bound, node in candidates:
        if best is not None and (bound * COST_SCALE > best[1].cost or budget <= 0):
            break
        if not node_may_fit(ctx.ct, node.gpu_key, ctx.demand):
            continue
        fit = ctx.node_fit(node)
        if fit is None:
            continue
        if best is not None:
            budget -= 1
            if fit.rank >= best[1].rank:
                continue
        best = (node, fit)
    return best


def placement_of(node: NodeState, fit: NodeFit, request: PodRequest, ctx: Context) -> Placement:
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
                    s.container, s.profile, gpu.index, start, ctx.size(gpu.tables_key, s.profile)
                )
            )
    return Placement(node.name, tuple(slices))
