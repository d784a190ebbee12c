"""`plan_whole_preemption`: which lower-priority pods to evict so a pod's whole GPUs fit (pure).

The whole-GPU counterpart of `plan_preemption` (common/placement/preempt.py), called only
after `place_whole` found no room (`Full`). A whole GPU needs a GPU with nothing on it, so
the victims of one GPU are fixed: every holder of an instance on it. A GPU is out when any
instance on it has no single preemptible holder (a foreign MIG instance, another
preemptor's reservation, a pod of equal or higher priority, anything the caller marked not
preemptible), and when the caller does not list it in `candidates`: the GPUs that, once
empty, serve a whole GPU without a reset (MIG off, or MIG on and turned off by the agent
without one; Ampere GPUs, which need a reset, are never planned on). A pod asking N whole
GPUs gets N of them on one node; every N-subset of a node's open GPUs is a candidate victim
set (the union of their holders), confirmed by `place_whole` on the node with those
victims removed, which also picks the GPUs.

Cost: exactly `plan_preemption`'s (`victim_cost`, terms 1-5, then the node's potential left
by the placement, then snapshot order); the slots the pod needs are the chosen GPUs' memory
slots. Holders already terminating (`doomed`) cost nothing and are waited for, as there.
A node where the pod's cpu, memory and pod slot do not fit even with every lower-priority
pod gone is skipped, as there (`room_for`, with the caller's `spare`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from itertools import combinations

from common.catalog import Catalog, load_catalog
from common.placement.model import Gpu, NodeState, Placement, PodRequest, Snapshot
from common.placement.preempt import (
    CONFIRM_BUDGET,
    NOTHING,
    SEARCH_BUDGET,
    Cost,
    Frees,
    Holder,
    PreemptionPlan,
    fits,
    free_doomed,
    potential_after,
    room_for,
    victim_cost,
    waits_for,
    without,
)
from common.placement.search import catalog_tables
from common.placement.selectors import mismatch
from common.placement.whole import GpuRef, WholeView, place_whole, wanted


def plan_whole_preemption(
    snapshot: Snapshot,
    request: PodRequest,
    holders: Iterable[Holder],
    candidates: frozenset[GpuRef],
    *,
    pdb_allowed: Mapping[str, int] | None = None,
    catalog: Catalog | None = None,
    spare: Mapping[str, Frees] | None = None,
) -> PreemptionPlan | None:
    """The cheapest set of preemptible holders whose eviction empties `wanted(request)` GPUs
    of `candidates` on one node, with the placement after it; None when no such set exists."""
    n = wanted(request)
    if n <= 0:
        return None
    cat = catalog or load_catalog()
    ct = catalog_tables(catalog)
    allowed = pdb_allowed or {}
    by_node: dict[str, list[Holder]] = {}
    for h in holders:
        by_node.setdefault(h.node, []).append(h)
    best: PreemptionPlan | None = None
    best_key: tuple[Cost, int] | None = None
    steps, confirms = SEARCH_BUDGET, CONFIRM_BUDGET
    for order, node in enumerate(snapshot.nodes):
        mine = by_node.get(node.name, [])
        if not any(h.preemptible or h.doomed for h in mine) or mismatch(node, request):
            continue  # nothing to free here, or the pod may not run here
        room = room_for(node, mine, (spare or {}).get(node.name, NOTHING))
        if not fits(room, request):
            continue  # cpu, memory or pods short even with every lower-priority pod gone
        freed, owner_of, blocked = free_doomed(room, mine)
        victims = {h.uid: h for h in mine if h.preemptible and not h.doomed}
        options: list[tuple[Gpu, frozenset[str]]] = []  # (GPU, the holders that empty it)
        for pos, g in enumerate(freed.gpus):
            if (node.name, g.index) in candidates and g.healthy and not blocked.get(pos, 0):
                owners = frozenset(owner_of[(pos, o.start, o.size)] for o in g.occupied)
                options.append((g, owners))
        tried: set[frozenset[str]] = set()
        for combo in combinations(options, n):
            steps -= 1
            if steps <= 0 or confirms <= 0:
                return best  # the cheapest of those seen
            owners = frozenset().union(*(o for _, o in combo))
            if owners in tried:
                continue
            tried.add(owners)
            chosen = [victims[u] for u in sorted(owners)]
            need = sum(_slots(cat, g) for g, _ in combo)
            terms = victim_cost(chosen, need, allowed)
            if best_key is not None and terms > best_key[0][:5]:
                continue  # dearer whatever the placement
            confirms -= 1
            after = without(freed, chosen, owner_of)
            result = place_whole(Snapshot((after,)), request, _view(after, candidates), cat).result
            if not isinstance(result, Placement):
                continue
            cost: Cost = (*terms, -potential_after(ct, after, result))
            if best_key is not None and (cost, order) >= best_key:
                continue
            best_key = (cost, order)
            best = PreemptionPlan(
                placement=result,
                victims=tuple(sorted(owners)),
                waits_for=waits_for(freed, request, mine, result),
                cost=cost,
            )
    return best


def _view(node: NodeState, candidates: frozenset[GpuRef]) -> WholeView:
    """The candidate GPUs left empty, as `place_whole` classes them: MIG off as they are, MIG
    on after a reset-less toggle."""
    open_ = [
        g for g in node.gpus if not g.occupied and g.healthy and (node.name, g.index) in candidates
    ]
    return WholeView(
        right_mode=frozenset((node.name, g.index) for g in open_ if not g.mig_enabled),
        toggle=frozenset((node.name, g.index) for g in open_ if g.mig_enabled),
    )


def _slots(cat: Catalog, gpu: Gpu) -> int:
    """The memory slots a whole GPU occupies (as `place_whole` sets them)."""
    model = cat.model(gpu.model)
    return model.memory_slots if model is not None else 8
