"""When the placer plans a preemption, and how often (docs/allocator.md "Planning cost").

A preemption plan is the allocator's dearest decision: an exact search over windows and
victim sets, bounded only by `SEARCH_BUDGET` (common/placement/preempt.py), so a pod asking
dozens of slices of one node costs a second or more of CPU per plan on a large fleet, and a
sized ask one such plan per GPU model. A parked pod is retried whenever capacity may have
grown (`ClusterState.epoch`), which on a busy cluster is every few moments: planning anew on
each retry spent that CPU over and over on the same answer. Three guards, all pure:

- `PlanInputs`: what a plan read — the version of the slice holders and of the nodes and
  GPUs (`ClusterState.holders_version`), of the PodDisruptionBudgets, the pod's own spec
  and what it must avoid, and which nodes lack the cpu, memory or pod slot it asks. A plan
  that found nothing is kept with them in the pod's record (`PodTrack.no_plan`) and made
  again only when they change: a pod without slices leaving a node with room to spare does
  not plan again.
- `too_large`: an ask no node could ever hold, even empty (more slices of a profile than a
  node's GPUs offer together, more whole GPUs than it has, more memory slots than it has),
  on the nodes its own selectors allow. Such a pod is parked with `LargerThanAnyNode`,
  naming its count and the largest node's, and never planned for.
- `PlanRounds`: a CPU budget per placement round (`preemption_round_cpu_s`). Once a round
  has spent it on plans, the pods that still need one are deferred to the next round, which
  starts right after; a round serves deferred pods first, one per namespace in turn,
  starting after the namespace that planned last, so one namespace's huge asks cannot take
  every round from the others. A plan in progress is never cut: the budget is checked
  before each, so every round makes at least one.

`Planner` makes the plan for one pod the placer found no room for, within those guards:
the holders and the room they free (preemption.py), the search (common/placement/preempt.py,
preempt_whole.py, common/sizing.py), and on Ampere a whole-GPU plan's MIG mode change
(maintenance.py). It returns the preemption to record (`Planned`), or why there is none
(`NotPlanned`); the placer records it. No I/O.

What this module does not do: choose victims (common/placement/preempt.py) or decide who may
be one (preemption.py).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from common.allocation import allocation_for, summary
from common.catalog import Catalog
from common.constants import WHOLE_GPU_PROFILE
from common.placement import NodeState, Pending, PendingReason, PodRequest, Policy, Snapshot
from common.placement.preempt import Frees, Holder, PreemptionPlan, plan_preemption
from common.placement.preempt_whole import plan_whole_preemption
from common.placement.search import catalog_tables
from common.placement.selectors import Mismatch, mismatch
from common.placement.tables import ModelTables
from common.placement.whole import is_whole
from common.sizing import SizeAsk, plan_sized_preemption, resolved_on
from webhook.allocator import pods as podlib
from webhook.allocator.maintenance import Ampere
from webhook.allocator.preemption import (
    NO_RESET,
    Preemption,
    PreemptionSettings,
    Victim,
    holders,
    never_preempts,
    spare,
    whole_candidates,
)
from webhook.allocator.state import ClusterState
from webhook.allocator.views import PodView

TOO_LARGE = "LargerThanAnyNode"  # the AllocationPending reason of an ask no node holds


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
    kueue: frozenset[str] = frozenset()  # the namespaces whose pods Kueue manages
    away: frozenset[str] = frozenset()  # nodes its controller is backed off from
    # AskBook.holds: changes held back by the mode-change interval so far. The wall clock is
    # an input no version counts: a plan that met a GPU held back is planned again
    holds: int = 0


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


# --- asks no node holds --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Shape:
    """One node's GPUs: their models and the tables of those with known tables."""

    node: str
    models: tuple[str, ...]
    tables: tuple[ModelTables, ...]

    def describe(self) -> str:
        counts: dict[str, int] = {}
        for m in self.models:
            counts[m] = counts.get(m, 0) + 1
        return ", ".join(f"{n} x {m}" for m, n in sorted(counts.items()))


def node_shapes(
    nodes: Iterable[NodeState], request: PodRequest, catalog: Catalog
) -> tuple[_Shape, ...]:
    """The distinct GPU sets of the nodes `request` may run on by its own nodeSelector and
    required affinity (taints and cordons come and go), each with the first node that has it."""
    ct = catalog_tables(catalog)
    shapes: dict[tuple[str, ...], _Shape] = {}
    for n in nodes:
        if mismatch(n, request) in (Mismatch.SELECTOR, Mismatch.AFFINITY):
            continue
        key = tuple(g.tables_key for g in n.gpus)
        if key not in shapes:
            known = tuple(t for k in key if (t := ct.tables(k)) is not None)
            shapes[key] = _Shape(n.name, tuple(g.model for g in n.gpus), known)
    return tuple(shapes.values())


def too_large(
    shapes: Sequence[_Shape], request: PodRequest, sized: Sequence[SizeAsk], catalog: Catalog
) -> str | None:
    """Why no node of `shapes` (`node_shapes`) could hold `request` and its size asks even
    with nothing on it, naming the count and the largest node's; None when one could. Every
    GPU counts, healthy or not, in any MIG mode (the agent may change it)."""
    if not shapes:
        return None  # no node it may run on: placement says so (NoMatchingNode)
    asks: list[tuple[str | None, PodRequest]] = [(None, request)]
    if sized:  # resolved on each model, planned on its GPUs only, as the sized planner does
        models = {m for s in shapes for m in s.models}
        asks = [
            (name, on[0])
            for name in sorted(models)
            if (gm := catalog.model(name)) is not None
            and (on := resolved_on(gm, request, list(sized))) is not None
        ]
        if not asks:
            return None  # no model offers a fit: placement says so
    whys = []
    for shape in shapes:
        for model, ask in asks:
            part = shape if model is None else _of_model(shape, model)
            if not part.models:
                continue
            why = _short_of(part, ask)
            if why is None:
                return None
            whys.append(why)
    if not whys:
        return None
    return max(whys)[1]


def _of_model(shape: _Shape, model: str) -> _Shape:
    """The GPUs of `model` alone (their tables: the catalog's, as the sized planner's)."""
    models = tuple(m for m in shape.models if m == model)
    return _Shape(shape.node, models, tuple(t for t in shape.tables if t.name == model))


def _short_of(shape: _Shape, request: PodRequest) -> tuple[int, str] | None:
    """What an empty node of `shape` lacks to hold `request` (its size, for the largest
    node's message to win, and the message), or None when it holds it."""
    counts: dict[str, int] = {}
    for s in request.slices:
        counts[s.profile] = counts.get(s.profile, 0) + s.count
    size = sum(t.slots for t in shape.tables)
    where = f"the largest node it may run on, {shape.node} ({shape.describe() or 'no GPU'})"
    for profile, count in sorted(counts.items()):
        if profile == WHOLE_GPU_PROFILE:
            have = len(shape.models)
            if count > have:
                return size, f"it asks {count} whole GPUs; {where}, has {have}"
            continue
        have = sum(t.profiles[profile].max_count for t in shape.tables if profile in t.profiles)
        if count > have:
            return size, f"it asks {count} x {profile}; {where}, holds at most {have}"
    need = 0
    for profile, count in counts.items():
        sizes = [t.profiles[profile].size for t in shape.tables if profile in t.profiles]
        if profile != WHOLE_GPU_PROFILE and sizes:
            need += count * min(sizes)
    if need > size:
        return size, (
            f"its {sum(counts.values())} slices take {need} memory slots together; {where}, "
            f"has {size}"
        )
    return None


@dataclass(eq=False)
class SharedViews:
    """What the pods of a round share while the model hands out the same objects (its node
    states and snapshot stay the same tuple until something changes): the node shapes per
    selector (`too_large`) and the short nodes per cpu/memory ask. A round of many parked
    pods then walks the fleet once, not once per pod."""

    _nodes: tuple[NodeState, ...] | None = None
    _shapes: dict[Hashable, tuple[_Shape, ...]] = field(default_factory=dict)
    _snapshot: Snapshot | None = None
    _short: dict[tuple[int, int], Short] = field(default_factory=dict)

    def shapes(
        self, nodes: tuple[NodeState, ...], request: PodRequest, catalog: Catalog
    ) -> tuple[_Shape, ...]:
        if nodes is not self._nodes:
            self._nodes, self._shapes = nodes, {}
        key = (tuple(sorted(request.node_selector.items())), request.required_affinity)
        if key not in self._shapes:
            self._shapes[key] = node_shapes(nodes, request, catalog)
        return self._shapes[key]

    def short(self, snapshot: Snapshot, request: PodRequest) -> Short:
        if snapshot is not self._snapshot:
            self._snapshot, self._short = snapshot, {}
        key = (request.cpu_millis, request.memory_bytes)
        if key not in self._short:
            self._short[key] = short_nodes(snapshot, request)
        return self._short[key]


# --- rounds ----------------------------------------------------------------------------------


@dataclass
class PlanRounds:
    """The preemption planning of the placer's rounds: a CPU budget per round and the
    round-robin order of the pods a spent budget deferred (module docstring)."""

    budget_s: float = 0.5  # CPU seconds of planning per round (AllocatorSettings)
    cpu: Callable[[], float] = time.thread_time  # injectable: tests count plans, not time
    spent: float = 0.0  # this round's CPU seconds of planning
    plans: int = 0  # and its plans
    last: str = ""  # the namespace whose pod planned last
    deferred: set[str] = field(default_factory=set)  # uids, for the next round
    order: deque[str] = field(default_factory=deque)  # this round's deferred pods, in turn

    def start(self, namespaces: Mapping[str, str]) -> None:
        """A new round: the budget is whole again, and the deferred pods (`namespaces`: uid
        → its namespace, in the placement queue's order; pods gone left out) go first, one
        namespace after another, starting after the namespace that planned last."""
        self.spent, self.plans = 0.0, 0
        self.deferred.clear()
        by_ns: dict[str, deque[str]] = {}
        for uid, ns in namespaces.items():
            by_ns.setdefault(ns, deque()).append(uid)
        turn = sorted(by_ns, key=lambda ns: (ns <= self.last, ns))
        self.order.clear()
        while turn:
            for ns in list(turn):
                self.order.append(by_ns[ns].popleft())
                if not by_ns[ns]:
                    turn.remove(ns)

    def allows(self) -> bool:
        """May this round plan once more? Always its first plan (however large the budget)."""
        return self.plans == 0 or self.spent < self.budget_s

    def charge(self, namespace: str, seconds: float) -> None:
        self.spent += seconds
        self.plans += 1
        self.last = namespace

    def clear(self) -> None:
        self.deferred.clear()
        self.order.clear()
        self.spent, self.plans = 0.0, 0


# --- the plan ----------------------------------------------------------------------------------


class PlanRecord(Protocol):
    """What a plan reads and keeps of the pod's record (track.PodTrack)."""

    avoid: frozenset[str]
    refused: frozenset[str]
    failed_gpus: frozenset[tuple[str, str]]
    no_plan: tuple[PlanInputs, str] | None
    plan_deferred: bool


@dataclass(frozen=True, slots=True)
class Planned:
    """A preemption to record: its reservation (not assumed yet) and its victims."""

    preemption: Preemption


@dataclass(frozen=True, slots=True)
class NotPlanned:
    """No preemption: the pending reason and message the pod is told."""

    reason: str
    message: str


@dataclass(eq=False)
class Planner:
    """The preemption plan for one pod that does not fit (docs/allocator.md "Preemption"):
    who may be a victim, the search, and the guards above. Size asks are planned per GPU
    model, resolved as `place_sized` resolves them, so the reservation names the profiles
    they resolve to there."""

    state: ClusterState
    catalog: Catalog
    policy: Policy
    ampere: Ampere
    settings: PreemptionSettings | None
    rounds: PlanRounds
    shared: SharedViews

    def plan(
        self,
        pod: PodView,
        track: PlanRecord,
        request: PodRequest,
        sized: list[SizeAsk],
        snapshot: Snapshot,
        pending: Pending,
        told: tuple[str, str],
    ) -> Planned | NotPlanned:
        """`told`: the reason and message the pod is parked with when nothing is planned."""
        reason, message = told
        p = self.settings
        if pending.reason not in (PendingReason.FULL, PendingReason.FRAGMENTED):
            return NotPlanned(reason, message)
        shapes = self.shared.shapes(self.state.node_states(), request, self.catalog)
        if big := too_large(shapes, request, sized, self.catalog):
            why = f"{big}: no node can hold it, so no preemption is planned for it"
            return NotPlanned(TOO_LARGE, why)
        if p is None:
            return NotPlanned(reason, message)
        if never_preempts(pod.obj):
            why = f"{message}; its preemptionPolicy is Never: it preempts no pod"
            return NotPlanned(reason, why)
        owner = podlib.controller_ref(pod.obj)
        # its controller's pod was deleted there as pinned-unschedulable lately
        away = p.backoff.nodes(owner.get("uid") if owner else None, p.now())
        inputs = PlanInputs(
            holders=self.state.holders_version,
            budgets=p.budgets.version,
            generation=pod.generation,
            avoid=track.avoid | track.refused,
            excluded=track.failed_gpus,
            short=self.shared.short(snapshot, request),
            kueue=frozenset(p.kueue),
            away=frozenset(away),
            holds=self.ampere.asks.holds,
        )
        backed_off = ""
        if away:
            snapshot = Snapshot(tuple(n for n in snapshot.nodes if n.name not in away))
            names = sorted(away)
            more = f" and {len(names) - 5} more" if len(names) > 5 else ""
            backed_off = (
                f" (not planned on {', '.join(names[:5])}{more} for now: a pod of its "
                "controller was pinned there and stayed unschedulable)"
            )
        if track.no_plan is not None and track.no_plan[0] == inputs:
            return NotPlanned(reason, f"{message}; {track.no_plan[1]}")  # nothing changed
        if not self.rounds.allows():
            track.plan_deferred = True
            self.rounds.deferred.add(pod.uid)
            return NotPlanned(
                reason,
                f"{message}; preemption: planned in the next placement round (this round's "
                "planning budget is spent)",
            )
        start = self.rounds.cpu()
        held = holders(
            self.state,
            pod,
            p.budgets,
            kueue_ok=p.kueue_ok,
            kueue=p.kueue,
            avoid=track.avoid,
            refused=track.refused,
        )
        room = spare(self.state, pod, held, kueue_ok=p.kueue_ok, kueue=p.kueue)
        allowed = p.budgets.allowed()
        for h in held:  # the API server refused its eviction: its budgets are spent
            if h.refused:
                allowed.update(dict.fromkeys(h.pdbs, 0))
        resets: tuple[tuple[str, int], ...] = ()
        why = "preemption: no set of lower-priority pods frees a placement for it"
        if is_whole(request):  # every holder of one GPU (of N GPUs of one node)
            found, resets, waits = self._plan_whole(snapshot, request, held, allowed, room)
            if waits:
                why = (
                    "preemption: no set of lower-priority pods frees a GPU whose MIG mode goes "
                    f"off without a reset; a plan with a reset waits for the change under way "
                    f"on {waits} (Ampere maintenance)"
                )
        elif sized:
            found = plan_sized_preemption(
                snapshot,
                request,
                sized,
                held,
                catalog=self.catalog,
                pdb_allowed=allowed,
                policy=self.policy,
                spare=room,
            )
        else:
            found = plan_preemption(
                snapshot,
                request,
                held,
                pdb_allowed=allowed,
                policy=self.policy,
                catalog=self.catalog,
                spare=room,
            )
        self.rounds.charge(pod.namespace, self.rounds.cpu() - start)
        if found is None:  # the reason stays the engine's (metrics count Full/Fragmented)
            # planned again once what it read changes (a GPU held back by the mode-change
            # interval too: `PlanInputs.holds`)
            why = f"{why}{backed_off}"
            track.no_plan = (inputs, why)
            return NotPlanned(reason, f"{message}; {why}")
        track.no_plan = None
        assert pod.claim is not None
        node = found.placement.node
        body = allocation_for(
            namespace=pod.namespace,
            claim=pod.claim,
            pod=pod.obj,
            placement=found.placement,
            uuid=self.state.gpu_uuid(node),
        )
        victims = tuple(
            Victim(v.uid, v.namespace, v.name)
            for v in (self.state.pods.get(u) for u in found.victims)
            if v is not None
        )
        return Planned(
            Preemption(
                body=body,
                key=f"{pod.namespace}/{body['metadata']['name']}",
                node=node,
                victims=victims,
                waits_for=frozenset(found.victims) | frozenset(found.waits_for),
                deadline=p.now() + p.wait_s,
                summary=summary(found.placement),
                resets=resets,
                past_pdb=found.cost[0] > 0,
            )
        )

    def _plan_whole(
        self,
        snapshot: Snapshot,
        request: PodRequest,
        held: list[Holder],
        allowed: dict[str, int],
        room: dict[str, Frees],
    ) -> tuple[PreemptionPlan | None, tuple[tuple[str, int], ...], str]:
        """A whole-GPU preemption plan on GPUs whose MIG mode goes off without a reset; with
        the Ampere maintenance on and no change in flight, else on GPUs that need one too
        (returned: the Ampere maintenance is asked for them with the plan). Third: the GPUs
        whose change in flight kept a plan with a reset from being tried ("" if none)."""

        def plan(classes: tuple[str, ...]) -> PreemptionPlan | None:
            candidates = whole_candidates(self.state, snapshot, classes)
            if "reset" in classes:  # not a GPU whose last change went the other way lately
                candidates = frozenset(c for c in candidates if not self.ampere.held_back(*c))
            return plan_whole_preemption(
                snapshot,
                request,
                held,
                candidates,
                pdb_allowed=allowed,
                catalog=self.catalog,
                spare=room,
            )

        found = plan(NO_RESET)
        if found is not None or not self.ampere.on:
            return found, (), ""
        if busy := self.ampere.under_way(snapshot):  # one at a time: planned again after
            return None, (), busy
        found = plan((*NO_RESET, "reset"))
        if found is None:
            return None, (), ""
        node = found.placement.node
        resets = tuple(
            (node, s.gpu_index)
            for s in found.placement.slices
            if (g := self.state.gpu(node, s.gpu_index)) is not None and g.whole_if_idle == "reset"
        )
        return found, resets, ""
