"""`plan_preemption`: which lower-priority pods to evict so a pod's MIG slices fit (pure).

Called only after `place` found no room. A MIG slice needs a *legal, contiguous* window of
memory slots, so kube-scheduler's remove-all-then-reprieve (which assumes fungible
resources) does not apply; instead every window is enumerated exactly: for each (node, GPU,
legal start) of each slice, the victims are fixed — the holders of every instance
overlapping the window — and a placement is legal only if none of them is a blocker (a
foreign instance, a pod of equal or higher priority, anything the caller marked not
preemptible). The slices of one pod are planned jointly (a depth-first search over one
window per slice, windows of one pod never overlapping), and every victim set found is
confirmed by the placement engine on the node with those victims removed (so per-GPU count,
engine and compute limits hold too).

Victims are whole pods: evicting one frees all its slices. Holders already terminating
(`doomed`) free their slots without an eviction: their slots count as free here and the
plan lists the ones it waits for. Victims are chosen for slots; the pod's cpu, memory and
pod slot are kube-scheduler's to free once the pod is pinned (its own preemption evicts
lower-priority pods of the node), but only a node where they *can* be freed is planned on
(a pod pinned where it never fits is deleted after the pinned-unschedulable timeout and,
recreated, would evict again: docs/allocator.md "Preemption"). That is kube-scheduler's own
test (`SelectVictimsOnNode` removes every lower-priority pod, then checks the fit): what the
node has free, plus what every preemptible and doomed holder there frees (`Holder.frees`),
plus the caller's `spare` — what the other lower-priority pods there use (bound pods holding
no slices). Equal- or higher-priority pods, and holders that may not be victims, free
nothing. A node failing it is skipped before any search.

Cost, lexicographic, smallest wins (kube-scheduler's `pickOneNodeForPreemption` order, then
MIG terms):

1. PodDisruptionBudget violations (victims beyond what each PDB still allows, plus each
   victim whose eviction the API server already refused: `Holder.refused`);
2. the highest victim priority;
3. the number of victims;
4. victim slots freed beyond what the pod needs (collateral);
5. the latest earliest start time among the highest-priority victims (less work lost);
6. the placement quality afterwards: the node's potential left (tables.py), larger better;

then snapshot order. Every term grows (or stays) when a victim is added, so the cheapest
set is always minimal and a partial set's cost bounds the search.

Limit: a window is freed by evicting what overlaps it; a placement blocked only by a
per-GPU instance limit (a second `+me` instance on a GPU that allows one) is not planned.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from common.catalog import Catalog
from common.placement.engine import place
from common.placement.model import (
    Gpu,
    NodeState,
    Placement,
    PodRequest,
    Policy,
    Snapshot,
)
from common.placement.search import CatalogTables, catalog_tables, profile_order
from common.placement.selectors import mismatch

# Bounds on one plan: depth-first steps and engine confirmations. Past either the best plan
# found so far is returned (the cheapest of those seen, not proven cheapest).
SEARCH_BUDGET = 200_000
CONFIRM_BUDGET = 4_096


@dataclass(frozen=True, slots=True)
class Frees:
    """The cpu, memory and pod slots a pod's leaving frees on its node."""

    cpu_millis: int = 0
    memory_bytes: int = 0
    pods: int = 0

    def __add__(self, other: Frees) -> Frees:
        return Frees(
            self.cpu_millis + other.cpu_millis,
            self.memory_bytes + other.memory_bytes,
            self.pods + other.pods,
        )


NOTHING = Frees()


@dataclass(frozen=True, slots=True)
class Holder:
    """A pod holding slices on one node: a possible victim, or a blocker."""

    uid: str
    node: str
    slices: tuple[tuple[int, int, int], ...]  # (gpu index, start, size)
    priority: int = 0
    start_time: float = 0.0  # seconds since the epoch; later = less work lost
    pdbs: tuple[str, ...] = ()  # the PodDisruptionBudgets selecting it
    preemptible: bool = True  # False: never a victim (the caller decided why)
    doomed: bool = False  # terminating already: its slots free without an eviction
    frees: Frees = NOTHING  # what its leaving frees on the node (its requests, one pod)
    refused: bool = False  # its eviction was refused (429): evicting it violates a PDB


Cost = tuple[int, int, int, int, float, int]


@dataclass(frozen=True, slots=True)
class PreemptionPlan:
    placement: Placement
    victims: tuple[str, ...]  # uids to evict, sorted
    waits_for: tuple[str, ...]  # doomed holders whose slots the placement uses, sorted
    cost: Cost


@dataclass(frozen=True, slots=True)
class _Window:
    pos: int  # position in node.gpus
    mask: int
    owners: frozenset[str]  # preemptible holders overlapping it


def victim_cost(
    victims: Iterable[Holder], request_slots: int, pdb_allowed: Mapping[str, int]
) -> tuple[int, int, int, int, float]:
    """Terms 1-5 of the cost of evicting `victims` (quality is the planner's)."""
    vs = list(victims)
    per_pdb: dict[str, int] = {}
    for v in vs:
        for p in v.pdbs:
            per_pdb[p] = per_pdb.get(p, 0) + 1
    violations = sum(max(0, n - max(0, pdb_allowed.get(p, 0))) for p, n in per_pdb.items())
    violations += sum(1 for v in vs if v.refused)
    if not vs:
        return (violations, -(1 << 62), 0, 0, 0.0)
    top = max(v.priority for v in vs)
    freed = sum(size for v in vs for _, _, size in v.slices)
    earliest = min(v.start_time for v in vs if v.priority == top)
    return (violations, top, len(vs), max(0, freed - request_slots), -earliest)


def plan_preemption(
    snapshot: Snapshot,
    request: PodRequest,
    holders: Iterable[Holder],
    *,
    pdb_allowed: Mapping[str, int] | None = None,
    policy: Policy = Policy.INSTASLICE,
    catalog: Catalog | None = None,
    spare: Mapping[str, Frees] | None = None,
) -> PreemptionPlan | None:
    """The cheapest set of preemptible holders whose eviction lets `request` fit, with the
    placement after it; None when no such set exists. `spare`: per node, what lower-priority
    pods holding no slices free there once kube-scheduler preempts them (module doc)."""
    allowed = pdb_allowed or {}
    by_node: dict[str, list[Holder]] = {}
    for h in holders:
        by_node.setdefault(h.node, []).append(h)
    slices = sorted((s.profile for s in request.slices for _ in range(s.count)), key=profile_order)
    if not slices:
        return None
    search = _Search(request, slices, allowed, policy, catalog)
    for order, node in enumerate(snapshot.nodes):
        mine = by_node.get(node.name, [])
        if not any(h.preemptible or h.doomed for h in mine):
            continue  # nothing to free here (and `place` found no room as it is)
        filtered = request.node_selector or request.required_affinity
        if (filtered or node.taints or node.unschedulable) and mismatch(node, request):
            continue
        room = room_for(node, mine, (spare or {}).get(node.name, NOTHING))
        if not fits(room, request):
            continue  # cpu, memory or pods short even with every lower-priority pod gone
        search.node(order, room, mine)
    return search.best


def room_for(node: NodeState, holders: list[Holder], spare: Frees) -> NodeState:
    """The node with the cpu, memory and pod slots that pods of lower priority than the
    preemptor hold added to what is free: every holder that is a possible victim or doomed,
    and `spare` (the node's other lower-priority pods)."""
    return freed_by(node, [h for h in holders if h.preemptible or h.doomed], spare)


def freed_by(node: NodeState, gone: Iterable[Holder], extra: Frees = NOTHING) -> NodeState:
    """The node's cpu, memory and pod slots once `gone` have left and `extra` is freed."""
    total = extra
    for h in gone:
        total = total + h.frees
    if total == NOTHING:
        return node
    return replace(
        node,
        cpu_millis_free=node.cpu_millis_free + total.cpu_millis,
        memory_bytes_free=node.memory_bytes_free + total.memory_bytes,
        pods_free=node.pods_free + total.pods,
    )


def fits(node: NodeState, request: PodRequest) -> bool:
    """The pod's cpu, memory and one pod slot fit what the node has free (as `place` checks)."""
    return (
        node.pods_free >= 1
        and node.cpu_millis_free >= request.cpu_millis
        and node.memory_bytes_free >= request.memory_bytes
    )


def waits_for(
    room: NodeState, request: PodRequest, holders: list[Holder], placement: Placement
) -> tuple[str, ...]:
    """The doomed holders a plan waits for: those whose slots it takes, and every doomed
    holder of the node when the pod's cpu, memory or pod slot fit `room` only with theirs."""
    doomed = [h for h in holders if h.doomed]
    less = Frees()
    for h in doomed:
        less = less + h.frees
    without_doomed = freed_by(room, (), Frees(-less.cpu_millis, -less.memory_bytes, -less.pods))
    if fits(without_doomed, request):
        return waits_for_doomed(holders, placement)
    return tuple(sorted(h.uid for h in doomed))


class _Search:
    def __init__(
        self,
        request: PodRequest,
        slices: list[str],
        allowed: Mapping[str, int],
        policy: Policy,
        catalog: Catalog | None,
    ) -> None:
        self.request = request
        self.slices = slices
        self.allowed = allowed
        self.policy = policy
        self.catalog = catalog
        self.ct = catalog_tables(catalog)
        self.best: PreemptionPlan | None = None
        self.best_key: tuple[Cost, int] | None = None
        self.steps = SEARCH_BUDGET
        self.confirms = CONFIRM_BUDGET

    def node(self, order: int, room: NodeState, holders: list[Holder]) -> None:
        """Search one node; `room`: the node with its lower-priority pods' cpu, memory and
        pod slots counted free (`room_for`)."""
        self.tried: set[frozenset[str]] = set()  # victim sets confirmed on this node
        freed, owner_of, blocked = free_doomed(room, holders)
        self.owner_of = owner_of
        victims = {h.uid: h for h in holders if h.preemptible and not h.doomed}
        request_slots = 0
        windows: list[list[_Window]] = []
        for profile in self.slices:
            options = []
            for pos, gpu in enumerate(freed.gpus):
                t = self.ct.tables(gpu.model) if gpu.usable else None
                pt = t.profiles.get(profile) if t is not None else None
                if pt is None:
                    continue
                for mask in pt.masks:
                    if mask & blocked.get(pos, 0):
                        continue
                    owners = frozenset(
                        owner_of[(pos, o.start, o.size)] for o in gpu.occupied if o.mask & mask
                    )
                    options.append(_Window(pos, mask, owners))
            if not options:
                return
            request_slots += options[0].mask.bit_count()
            windows.append(options)
        self._dfs(order, freed, holders, victims, windows, 0, {}, frozenset(), request_slots, -1)

    def _dfs(
        self,
        order: int,
        freed: NodeState,
        holders: list[Holder],
        victims: dict[str, Holder],
        windows: list[list[_Window]],
        depth: int,
        used: dict[int, int],
        owners: frozenset[str],
        request_slots: int,
        last: int,
    ) -> None:
        if self.steps <= 0:
            return
        self.steps -= 1
        if self.best_key is not None:
            partial = victim_cost((victims[u] for u in owners), request_slots, self.allowed)
            if partial[:4] > self.best_key[0][:4]:
                return  # every completion costs at least this much
        if depth == len(windows):
            self._confirm(order, freed, holders, victims, owners, request_slots)
            return
        same = depth > 0 and self.slices[depth] == self.slices[depth - 1]
        for i, w in enumerate(windows[depth]):
            if same and i <= last:
                continue  # identical slices: one order of windows is enough
            if used.get(w.pos, 0) & w.mask:
                continue
            used[w.pos] = used.get(w.pos, 0) | w.mask
            self._dfs(
                order,
                freed,
                holders,
                victims,
                windows,
                depth + 1,
                used,
                owners | w.owners,
                request_slots,
                i,
            )
            used[w.pos] ^= w.mask

    def _confirm(
        self,
        order: int,
        freed: NodeState,
        holders: list[Holder],
        victims: dict[str, Holder],
        owners: frozenset[str],
        request_slots: int,
    ) -> None:
        if self.confirms <= 0 or owners in self.tried:
            return
        self.tried.add(owners)
        chosen = [victims[u] for u in sorted(owners)]
        terms = victim_cost(chosen, request_slots, self.allowed)
        if self.best_key is not None and terms > self.best_key[0][:5]:
            return  # dearer whatever the placement: no need to ask the engine
        self.confirms -= 1
        after = without(freed, chosen, self.owner_of)
        result = place(Snapshot((after,)), self.request, self.policy, self.catalog)
        if not isinstance(result, Placement):
            return
        quality = -self._potential(after, result)
        cost: Cost = (*terms, quality)
        key = (cost, order)
        if self.best_key is not None and key >= self.best_key:
            return
        self.best_key = key
        self.best = PreemptionPlan(
            placement=result,
            victims=tuple(sorted(owners)),
            waits_for=waits_for(freed, self.request, holders, result),
            cost=cost,
        )

    def _potential(self, node: NodeState, placement: Placement) -> int:
        return potential_after(self.ct, node, placement)


def potential_after(ct: CatalogTables, node: NodeState, placement: Placement) -> int:
    """Cost term 6: the node's free-slot potential left once `placement` is on it."""
    masks = {g.index: g.mask for g in node.gpus}
    for s in placement.slices:
        masks[s.gpu_index] |= ((1 << s.size) - 1) << s.start
    total = 0
    for g in node.gpus:
        t = ct.tables(g.model) if g.usable else None
        if t is not None:
            total += t.potential[masks[g.index]]
    return total


def free_doomed(
    node: NodeState, holders: list[Holder]
) -> tuple[NodeState, dict[tuple[int, int, int], str], dict[int, int]]:
    """The node with the slots only doomed holders hold made free; which preemptible holder
    owns each remaining instance; and per GPU position the slots nothing may take.

    One instance may be held by several holders (a reservation overlaps the pods it waits
    for): it is freed only if every holder of it is doomed, owned only if its one live
    holder is preemptible, and blocked otherwise."""
    pos_of = {g.index: pos for pos, g in enumerate(node.gpus)}
    doomed: set[tuple[int, int, int]] = set()
    owners: dict[tuple[int, int, int], set[str]] = {}
    fixed: set[tuple[int, int, int]] = set()  # held by a holder that is never a victim
    for h in holders:
        for index, start, size in h.slices:
            pos = pos_of.get(index)
            if pos is None:
                continue
            entry = (pos, start, size)
            if h.doomed:
                doomed.add(entry)
            elif h.preemptible:
                owners.setdefault(entry, set()).add(h.uid)
            else:
                fixed.add(entry)
    owner_of = {e: next(iter(u)) for e, u in owners.items() if len(u) == 1 and e not in fixed}
    gpus = []
    blocked: dict[int, int] = {}
    for pos, g in enumerate(node.gpus):
        occ = []
        for o in g.occupied:
            entry = (pos, o.start, o.size)
            if entry in doomed and entry not in owners and entry not in fixed:
                continue  # free once the doomed holders are gone
            occ.append(o)
            if entry not in owner_of:
                blocked[pos] = blocked.get(pos, 0) | o.mask
        gpus.append(replace(g, occupied=tuple(occ)) if len(occ) != len(g.occupied) else g)
    return replace(node, gpus=tuple(gpus)), owner_of, blocked


def without(
    node: NodeState, victims: list[Holder], owner_of: dict[tuple[int, int, int], str]
) -> NodeState:
    """The node with the instances the victims alone hold removed."""
    chosen = {v.uid for v in victims}
    gpus: list[Gpu] = []
    for pos, g in enumerate(node.gpus):
        keep = tuple(o for o in g.occupied if owner_of.get((pos, o.start, o.size)) not in chosen)
        gpus.append(replace(g, occupied=keep) if len(keep) != len(g.occupied) else g)
    return replace(node, gpus=tuple(gpus))


def waits_for_doomed(holders: list[Holder], placement: Placement) -> tuple[str, ...]:
    """Doomed holders whose slots the placement takes: it waits until they are gone."""
    out = set()
    for h in holders:
        if not h.doomed:
            continue
        for index, start, size in h.slices:
            mask = ((1 << size) - 1) << start
            for s in placement.slices:
                if s.gpu_index == index and mask & (((1 << s.size) - 1) << s.start):
                    out.add(h.uid)
    return tuple(sorted(out))
