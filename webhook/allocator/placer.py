"""The placer: one gated pod at a time, in priority order, snapshot → place → assume.

Decisions are serialized on purpose (docs/style.md §3): each one sees every earlier decision in
the model (assumed before its create is sent), so two pods are never promised the same
slots. The placer writes nothing itself: a decision is recorded in the pod's record
(`PodTrack.create`) and the pod's worker sends the create; a pod that does not fit is
parked with its reason and told once per reason (`AllocationPending`). With
`avoid_creates_in_flight` on, a first pass leaves out the GPUs busy making slices
(`_calm`, webhook/allocator/inflight.py). How often a preemption is planned — a failed plan
kept until what it read changes, asks no node holds never planned, a CPU budget per round
shared round-robin across namespaces — is webhook/allocator/planning.py's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from common.allocation import build_allocation
from common.catalog import Catalog
from common.constants import (
    GATE_NAME,
    GPU_MODEL_LABEL,
    KIND_GPU,
    REASON_PENDING,
    WHOLE_GPU_PROFILE,
    EventReason,
)
from common.objects import SliceSpec
from common.placement import Pending, PendingReason, Placement, PodRequest, Policy, Snapshot
from common.placement.modes import ModePlacement, ModeView, place_with_modes
from common.placement.preempt import Frees, Holder, PreemptionPlan, plan_preemption
from common.placement.preempt_whole import plan_whole_preemption
from common.placement.whole import WholePlacement, is_whole, place_whole
from common.podspec import SliceRequestError
from common.sizing import (
    SizeAsk,
    SizeError,
    place_sized,
    plan_sized_preemption,
    resolved_on,
    size_asks,
)
from webhook.allocator import pods as podlib
from webhook.allocator.maintenance import AskBook, in_flight
from webhook.allocator.metrics import AllocatorMetrics
from webhook.allocator.planning import (
    TOO_LARGE,
    PlanInputs,
    PlanRounds,
    SharedViews,
    too_large,
)
from webhook.allocator.preemption import (
    NO_RESET,
    Budgets,
    OwnerBackoff,
    Preemption,
    Victim,
    holders,
    never_preempts,
    spare,
    whole_candidates,
)
from webhook.allocator.queue import PlacementQueue
from webhook.allocator.state import ClusterState
from webhook.allocator.track import PodTrack, Tracks
from webhook.allocator.views import PodView

Obj = dict[str, Any]
log = structlog.get_logger("allocator")

INVALID_REQUEST = "InvalidRequest"
WRITE_ERROR = "WriteError"
INTERNAL_ERROR = "InternalError"
AGENT_DOWN = "NodeAgentDown"  # every MIG node is left out: no node agent renews its Lease
SUMMARY_ANNOTATION = "instaslice.io/summary"  # the SliceAllocation "Slices" printer column

Tell = Callable[
    [Obj, EventReason, str], None
]  # (pod, reason, message): a Warning event, in the background


class Pendings(Protocol):
    """Told of each pending verdict and each decision (webhook.allocator.scaleup)."""

    def pending(
        self, pod: PodView, request: PodRequest, result: Pending, name_label: bool
    ) -> None: ...

    def placed(self, uid: str) -> None: ...


@dataclass(frozen=True)
class PreemptionSettings:
    budgets: Budgets  # the PodDisruptionBudgets, kept by a watch
    kueue_ok: bool  # Kueue-managed pods may be victims
    wait_s: float  # how long victims may take to release their slices
    now: Callable[[], float]  # monotonic
    # the namespaces whose pods are Kueue-managed (the admin's selector; a watch keeps it)
    kueue: Collection[str] = frozenset()
    # controllers whose pod was deleted as pinned-unschedulable: no preemption on that node
    backoff: OwnerBackoff = field(default_factory=OwnerBackoff)


@dataclass(eq=False)
class Placer:
    state: ClusterState
    tracks: Tracks
    metrics: AllocatorMetrics
    policy: Policy
    catalog: Catalog
    kick: Callable[[str], None]  # the pod's worker carries the decision out
    tell: Tell
    queue: PlacementQueue = field(default_factory=PlacementQueue)
    pendings: Pendings | None = None  # the autoscaler signal, when on
    preemption: PreemptionSettings | None = None  # None: preemption off
    # Ampere maintenance (webhook/allocator/maintenance.py), when on: (node, {GPU UUID:
    # mode}) → the MigNode's desiredMigMode is written in the background
    ask_modes: Callable[[str, dict[str, str]], None] | None = None
    # ... and withdrawn (node, GPU UUIDs) when no parked pod needs it any more; the record
    # of the asks, and the wall clock their minimum interval is measured on
    withdraw_modes: Callable[[str, set[str]], None] | None = None
    asks: AskBook = field(default_factory=AskBook)
    wall: Callable[[], float] = time.time
    rounds: PlanRounds = field(default_factory=PlanRounds)  # preemption planning per round
    shared: SharedViews = field(default_factory=SharedViews)  # what a round's pods share

    def start_round(self) -> None:
        """A placement round begins (the loop's, each time it is woken): the planning budget
        is whole again, and the pods whose plan the last round deferred go first, one
        namespace after another (planning.PlanRounds)."""
        waiting = []
        for uid in self.rounds.deferred:
            track, pod = self.tracks.get(uid), self.state.pods.get(uid)
            if track is not None and track.plan_deferred and pod is not None:
                waiting.append(pod)
        waiting.sort(key=lambda p: (-p.priority, p.created, p.key))
        self.rounds.start({p.uid: p.namespace for p in waiting})

    def waiting(self) -> int:
        """Pods this round has yet to decide for."""
        return len(self.queue) + len(self.rounds.order)

    def clear(self) -> None:
        """The term ended: nothing queued, nothing deferred."""
        self.queue.clear()
        self.rounds.clear()
        self.asks.clear()

    def _next(self) -> str | None:
        while self.rounds.order:
            uid = self.rounds.order.popleft()
            track = self.tracks.get(uid)
            if track is not None and track.plan_deferred:  # not decided for since
                self.queue.remove(uid)
                self.tracks.unpark(track)
                return uid
        return self.queue.pop()

    def place_queued(self) -> None:
        """Decide for one pod: those whose plan was deferred first, then the queued ones (the
        highest first); the loop calls it until `waiting()` is 0."""
        uid = self._next()
        if uid is None:
            return
        try:
            self.decide(uid)
        except Exception:  # a bug met by one pod must not stop the allocator for all
            log.exception("placement failed; pod parked", pod_uid=uid)
            pod = self.state.pods.get(uid)
            if pod is not None:
                self.park(pod, INTERNAL_ERROR, "placement failed inside the allocator")

    def decide(self, uid: str) -> None:
        self._decide(uid)
        if self.ask_modes is None:
            return
        track, pod = self.tracks.get(uid), self.state.pods.get(uid)
        told = track.told if track is not None and track.parked_at is not None else None
        if told == PendingReason.MIG_MODE_CHANGE_UNDER_WAY.value and pod is not None:
            self.asks.under_way(uid, pod.namespace)  # it needs the ask in flight
        elif uid not in self.asks.pods:
            return
        elif told is None:
            self.release_asks(uid)  # placed, preempting, or not ours to place any more
        elif told != PendingReason.NEEDS_MIG_MODE_CHANGE.value:
            self._stop_waiting(uid)  # pending for another reason; its asks still needed

    def _decide(self, uid: str) -> None:
        pod = self.state.pods.get(uid)
        track = self.tracks.get(uid)
        if track is None or pod is None or pod.gates != (GATE_NAME,) or pod.deleting:
            return
        if pod.claim is None or track.create is not None or track.preempt is not None:
            return
        track.plan_deferred = False
        if self.state.allocations_of(uid) or f"{pod.namespace}/{pod.claim}" in (
            self.state.allocations
        ):
            return
        try:
            request = podlib.pod_request(pod.obj, pod.resources)
            sized = size_asks(pod.obj)
        except (SliceRequestError, SizeError) as exc:
            self.park(pod, INVALID_REQUEST, f"cannot read the pod's slice requests: {exc}")
            return
        if not request.slices and not sized:
            return
        name_label = podlib.uses_name_field(pod.obj)
        excluded = track.failed_gpus
        snapshot = self.state.snapshot(exclude=excluded, name_label=name_label)
        calm = self._calm(request, sized, excluded, name_label)
        plan = ModePlacement(calm) if calm is not None else self._place(snapshot, request, sized)
        if isinstance(plan.result, Pending) and excluded:
            # No other GPU will do: trying the one that failed again beats waiting forever.
            track.failed_gpus = frozenset()
            snapshot = self.state.snapshot(name_label=name_label)
            plan = self._place(snapshot, request, sized)
        result = plan.result
        if (
            isinstance(result, Pending)
            and result.reason is PendingReason.NEEDS_MIG_MODE_CHANGE
            and self.ask_modes is not None
        ):
            result = self.ask_maintenance(pod, snapshot, request, plan.resets, result)
        if isinstance(result, Pending):
            told = self.preempt(pod, track, request, sized, snapshot, result)
            if told is None:  # a preemption is planned: room on an existing node, no new one
                if self.pendings is not None:
                    self.pendings.placed(uid)
                return
            if track.plan_deferred:  # planned next round: neither served nor refused yet,
                self.tracks.park(track, pod.generation)  # so told nothing new until then
                log.debug("preemption plan deferred", pod=pod.key, why=told[1])
                return
            # Only what preemption cannot serve asks the autoscaler for a node (size-based
            # asks only on one model: docs/autoscaling.md "Preemption, sizes, whole GPUs").
            signal = self._signal_request(request, sized)
            if self.pendings is not None and signal is not None:
                self.pendings.pending(pod, signal, result, name_label)
            self.park(pod, *told)
            return
        if self.pendings is not None:
            self.pendings.placed(uid)
        body = self.allocation_for(pod, result)
        self.state.assume(body)
        track.create = body
        track.told = None
        self.kick(uid)

    def _signal_request(self, request: PodRequest, sized: list[SizeAsk]) -> PodRequest | None:
        """What an autoscaler signal for a pending pod asks for: its request, its size asks
        resolved on the GPU model its `nodeSelector` names (`instaslice.io/gpu-model`, as a
        Kueue flavor's `nodeLabels` set it); None when it has size asks and names no catalog
        model (or one offering no fit): a size is then no one resource a node offers."""
        if not sized:
            return request
        model = self.catalog.model(request.node_selector.get(GPU_MODEL_LABEL, ""))
        on_model = None if model is None else resolved_on(model, request, sized)
        return None if on_model is None else on_model[0]

    def _place(
        self, snapshot: Snapshot, request: PodRequest, sized: list[SizeAsk]
    ) -> ModePlacement | WholePlacement:
        """The decision (and the GPUs it needs reset), one path per kind of ask, each on
        `snapshot` as given: whole GPUs on GPUs of their own (common/placement/whole.py);
        slices on GPUs in MIG mode first, on GPUs whose MIG mode the agent would change only
        when nothing else fits (common/placement/modes.py), size-based asks so too, resolved
        per GPU model (common/sizing.py). Every slice decision goes through
        `ClusterState.place`: the fleet index answers when `snapshot` is the state's own,
        the engine's scan otherwise (same answers)."""
        if is_whole(request):
            view = self.state.whole_view(snapshot)
            return place_whole(snapshot, request, view, self.catalog)
        modes, place = self.state.mode_view, self.state.place
        if sized:
            return place_sized(snapshot, request, sized, self.policy, self.catalog, modes, place)
        return place_with_modes(snapshot, request, modes, self.policy, self.catalog, place)

    def _calm(
        self,
        request: PodRequest,
        sized: list[SizeAsk],
        excluded: frozenset[tuple[str, str]],
        name_label: bool,
    ) -> Placement | None:
        """The first pass of `avoid_creates_in_flight`: the decision with the GPUs busy
        making slices left out, or None (off, none busy, or no other GPU takes the pod: the
        normal pass decides). Whole GPUs never go to a GPU holding slices, and a MIG mode
        change is never chosen here: waiting behind a create beats a mode change."""
        if not self.state.any_busy() or is_whole(request):
            return None
        if sized or excluded or name_label:  # the engine's scan of a snapshot of their own
            busy = self.state.busy_gpus()
            calm = self.state.snapshot(exclude=excluded | busy, name_label=name_label)
            if sized:  # an empty mode view: no MIG mode change here
                found = place_sized(
                    calm, request, sized, self.policy, self.catalog, ModeView()
                ).result
            else:
                found = self.state.place(calm, request, self.policy, self.catalog)
        else:
            found = self.state.decide_calm(request, self.policy, self.catalog)
        return found if isinstance(found, Placement) else None

    def ask_maintenance(
        self,
        pod: PodView,
        snapshot: Snapshot,
        request: PodRequest,
        resets: tuple[tuple[str, int], ...],
        pending: Pending,
    ) -> Pending:
        """Ask for the MIG mode change the pod needs on Ampere GPUs, `resets` (its plan's;
        one ask in the cluster at a time, round the namespaces, opposite changes on one GPU
        spaced; webhook/allocator/maintenance.py); the pod waits NeedsMigModeChange."""
        assert self.ask_modes is not None
        target = "disabled" if is_whole(request) else "enabled"  # whole GPUs need MIG off
        gpus = [(n, g) for n, i in resets if (g := self.state.gpu(n, i)) is not None]
        if names := self._changes_under_way(snapshot):
            self.asks.wait(pod.uid, pod.namespace, {g.uuid: target for _, g in gpus})
            return Pending(
                pending.reason,
                f"it fits only after a MIG mode change (a GPU reset); one is under way on "
                f"{names} (Ampere maintenance), asked again once it is done",
            )
        if not resets:
            self._stop_waiting(pod.uid)
            return pending
        node = resets[0][0]
        wants = {g.uuid: target for n, g in gpus if n == node}
        names = ", ".join(f"{node}/GPU {i}" for _, i in resets)
        held = [u for n, g in gpus if (u := self.asks.held_until(g.last_change, target))]
        if held and (until := max(held)) > self.wall():
            self._stop_waiting(pod.uid)
            self.asks.hold(until)
            return Pending(
                pending.reason,
                f"it fits only after a MIG mode change on {names}, whose last change went the "
                f"other way less than {self.asks.min_interval_s:g} s ago "
                "(--ampere-mode-change-interval); asked once that has passed (Ampere "
                "maintenance)",
            )
        turn = self.asks.turn(pod.namespace)
        if turn != pod.namespace:
            self.asks.wait(pod.uid, pod.namespace, wants)
            self._kick_waiters(turn)
            return Pending(
                pending.reason,
                f"it fits only after a MIG mode change on {names}; the one change at a time "
                f"goes round the namespaces waiting for one, and namespace {turn} is next "
                "(Ampere maintenance)",
            )
        self.ask_modes(node, wants)
        self.asks.grant(pod.uid, pod.namespace, node, wants)
        log.info("MIG mode change asked (Ampere maintenance)", node=node, gpus=sorted(wants))
        return Pending(
            pending.reason,
            f"it fits only after a MIG mode change on {names}: asked for (Ampere maintenance: "
            "the node agent drains the GPU, pauses the GPU Operator's clients, resets it); "
            "the pod is placed once it is done",
        )

    def _held_back(self, node: str, index: int) -> bool:
        """A whole-GPU plan may not turn MIG off on this Ampere GPU yet (its last change, to
        MIG on, was less than the interval ago); the controller looks again when it may."""
        g = self.state.gpu(node, index)
        if g is None or g.whole_if_idle != "reset":
            return False
        until = self.asks.held_until(g.last_change, "disabled")
        if until is None or until <= self.wall():
            return False
        self.asks.hold(until)
        return True

    def release_asks(self, uid: str) -> None:
        """Pod `uid` was placed or left: the asks it alone needed are withdrawn, unless the
        agent is already resetting the GPU (that change completes and is withdrawn then)."""
        if uid not in self.asks.pods:
            return
        orphans = self.asks.release(uid)
        self._turn_moved()
        for node, uuids in orphans.items():
            views = {g.uuid: g for g in self.state.gpus.get(node, ())}
            stop = {u for u in uuids if (g := views.get(u)) is None or g.phase != "Resetting"}
            if stop and self.withdraw_modes is not None:
                log.info(
                    "MIG mode change no longer needed; withdrawn", node=node, gpus=sorted(stop)
                )
                self.withdraw_modes(node, stop)

    def _stop_waiting(self, uid: str) -> None:
        if self.asks.stop_waiting(uid):
            self._turn_moved()

    def _turn_moved(self) -> None:
        """A namespace stopped waiting for the slot: with the slot free, the next one's pods
        are looked at again (they may have been turned away for its turn)."""
        head = self.asks.head()
        if head is not None and not in_flight(self.state.gpus):
            self._kick_waiters(head)

    def _kick_waiters(self, namespace: str) -> None:
        for uid in self.asks.waiters(namespace):
            track = self.tracks.get(uid)
            if track is not None:
                self.tracks.unpark(track)
            self.kick(uid)

    def _changes_under_way(self, snapshot: Snapshot) -> str:
        """The GPUs with an Ampere MIG mode change in flight on nodes in `snapshot` (one at a
        time in the cluster; an ask on a node that is down waits), named for a message
        ("node/GPU i, ..."); "" when there is none."""
        placeable = {n.name for n in snapshot.nodes}
        busy = [(n, g) for n, g in in_flight(self.state.gpus) if n in placeable]
        return ", ".join(f"{n}/GPU {g.index}" for n, g in busy[:4])

    def pending_reason(self, result: Pending) -> tuple[str, str]:
        """The placement engine's reason and message, telling which nodes were left out
        because their agent is down; `NodeAgentDown` when that is every MIG node."""
        down = self.state.down_agents_placeable()
        if not down:
            return result.reason.value, result.message
        names = ", ".join(down[:5]) + (f" and {len(down) - 5} more" if len(down) > 5 else "")
        why = f"{len(down)} node(s) whose node agent is not running (Lease not renewed): {names}"
        if len(down) == len(self.state.node_states()):
            return AGENT_DOWN, f"every MIG node is left out: {why}"
        return result.reason.value, f"{result.message}; left out: {why}"

    def preempt(
        self,
        pod: PodView,
        track: PodTrack,
        request: PodRequest,
        sized: list[SizeAsk],
        snapshot: Snapshot,
        pending: Pending,
    ) -> tuple[str, str] | None:
        """Plan a preemption for a pod that does not fit (docs/allocator.md "Preemption"):
        None when one is planned (its slots reserved at once), else the pending reason. Size
        asks are planned per GPU model, resolved as `place_sized` resolves them, so the
        reservation names the profiles they resolve to there."""
        reason, message = self.pending_reason(pending)
        p = self.preemption
        if pending.reason not in (PendingReason.FULL, PendingReason.FRAGMENTED):
            return reason, message
        shapes = self.shared.shapes(self.state.node_states(), request, self.catalog)
        if big := too_large(shapes, request, sized, self.catalog):
            return TOO_LARGE, f"{big}: no node can hold it, so no preemption is planned for it"
        if p is None:
            return reason, message
        if never_preempts(pod.obj):
            return reason, f"{message}; its preemptionPolicy is Never: it preempts no pod"
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
            return reason, f"{message}; {track.no_plan[1]}"  # nothing it read has changed
        if not self.rounds.allows():
            track.plan_deferred = True
            self.rounds.deferred.add(pod.uid)
            return reason, (
                f"{message}; preemption: planned in the next placement round (this round's "
                "planning budget is spent)"
            )
        start, holds = self.rounds.cpu(), self.asks.holds
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
            # planned again once what it read changes, or at once when a GPU was held back
            # by the mode-change interval (the wall clock is an input no version counts)
            why = f"{why}{backed_off}"
            track.no_plan = (inputs, why) if self.asks.holds == holds else None
            return reason, f"{message}; {why}"
        track.no_plan = None
        body = self.allocation_for(pod, found.placement)
        self.state.assume(body)  # reserved: nobody else is given these slots
        victims = tuple(
            Victim(v.uid, v.namespace, v.name)
            for v in (self.state.pods.get(u) for u in found.victims)
            if v is not None
        )
        record = Preemption(
            body=body,
            key=f"{pod.namespace}/{body['metadata']['name']}",
            node=found.placement.node,
            victims=victims,
            waits_for=frozenset(found.victims) | frozenset(found.waits_for),
            deadline=p.now() + p.wait_s,
            summary=summary(found.placement),
            resets=resets,
            past_pdb=found.cost[0] > 0,
        )
        if resets and self.ask_modes is not None:  # the agent drains (the victims go), resets
            wants = {g.uuid: "disabled" for n, i in resets if (g := self.state.gpu(n, i))}
            self.ask_modes(found.placement.node, wants)
        self.tracks.begin_preempt(track, record)
        track.told = None
        self.metrics.outcome("preempting")
        log.info(
            "preempting",
            pod=pod.key,
            node=found.placement.node,
            victims=[f"{v.namespace}/{v.name}" for v in victims],
            waits_for=len(found.waits_for),
        )
        self.kick(pod.uid)
        return None

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
                candidates = frozenset(c for c in candidates if not self._held_back(*c))
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
        if found is not None or self.ask_modes is None:
            return found, (), ""
        if busy := self._changes_under_way(snapshot):  # one at a time: planned again after
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

    def back_off(self, pod: PodView, node: str) -> None:
        """`pod`, pinned to `node`, was deleted as unschedulable there: its controller's
        next pods plan no preemption on that node for a while (preemption.OwnerBackoff)."""
        owner = podlib.controller_ref(pod.obj)
        if self.preemption is not None and owner is not None and owner.get("uid"):
            self.preemption.backoff.note(str(owner["uid"]), node, self.preemption.now())

    def park(self, pod: PodView, reason: str, message: str) -> None:
        """Pending: wait for capacity to grow (or the pod's spec to change); tell the pod
        when the reason is new."""
        track = self.tracks.ensure(pod.uid)
        self.tracks.park(track, pod.generation)
        self.metrics.outcome("pending")
        if track.told != reason:
            track.told = reason
            log.info("pod pending", pod=pod.key, reason=reason, message=message)
            self.tell(pod.obj, REASON_PENDING, message)

    def allocation_for(self, pod: PodView, placement: Placement) -> Obj:
        """The SliceAllocation to create for `placement` (GPU indexes become UUIDs)."""
        slices: list[SliceSpec] = []
        for s in placement.slices:
            gpu = self.state.gpu(placement.node, s.gpu_index)
            assert gpu is not None, "placement named a GPU outside the snapshot"
            spec: SliceSpec = {
                "container": s.container,
                "profile": s.profile,
                "gpuUUID": gpu.uuid,
                "gpuIndex": s.gpu_index,
                "start": s.start,
                "size": s.size,
            }
            if s.profile == WHOLE_GPU_PROFILE:
                spec["kind"] = KIND_GPU
            slices.append(spec)
        assert pod.claim is not None
        body = build_allocation(
            namespace=pod.namespace,
            claim=pod.claim,
            pod=pod.obj,
            node=placement.node,
            slices=slices,
        )
        body["metadata"]["annotations"] = {SUMMARY_ANNOTATION: summary(placement)}
        return body


def summary(placement: Placement) -> str:
    """`main: 1g.18gb@gpu0[0:1], 3g.71gb@gpu1[4:4]` — the "Slices" printer column."""
    parts = [
        f"{s.container}: {s.profile}@gpu{s.gpu_index}[{s.start}:{s.size}]" for s in placement.slices
    ]
    return ", ".join(parts)
