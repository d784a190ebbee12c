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

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from common.allocation import allocation_for
from common.catalog import Catalog
from common.constants import GPU_MODEL_LABEL, REASON_PENDING, EventReason
from common.placement import Pending, PendingReason, Placement, PodRequest, Policy, Snapshot
from common.placement.modes import ModePlacement, ModeView, place_with_modes
from common.placement.whole import WholePlacement, is_whole, place_whole
from common.podspec import SliceRequestError
from common.sizing import SizeAsk, SizeError, place_sized, resolved_on, size_asks
from webhook.allocator import pods as podlib
from webhook.allocator.maintenance import Ampere
from webhook.allocator.metrics import AllocatorMetrics
from webhook.allocator.planning import Planned, Planner, PlanRounds, SharedViews
from webhook.allocator.preemption import Preemption, PreemptionSettings
from webhook.allocator.queue import PlacementQueue
from webhook.allocator.state import ClusterState
from webhook.allocator.track import PodTrack, Tracks, placeable
from webhook.allocator.views import PodView

Obj = dict[str, Any]
log = structlog.get_logger("allocator")

INVALID_REQUEST = "InvalidRequest"
WRITE_ERROR = "WriteError"
INTERNAL_ERROR = "InternalError"
AGENT_DOWN = "NodeAgentDown"  # every MIG node is left out: no node agent renews its Lease

# (pod, reason, message): a Warning event, written in the background (writes.Tell's, its
# type fixed)
Warn = Callable[[Obj, EventReason, str], None]


class Pendings(Protocol):
    """Told of each pending verdict and each decision (webhook.allocator.scaleup)."""

    def pending(
        self, pod: PodView, request: PodRequest, result: Pending, name_label: bool
    ) -> None: ...

    def placed(self, uid: str) -> None: ...


@dataclass(eq=False)
class Placer:
    state: ClusterState
    tracks: Tracks
    metrics: AllocatorMetrics
    policy: Policy
    catalog: Catalog
    kick: Callable[[str], None]  # the pod's worker carries the decision out
    tell: Warn
    queue: PlacementQueue = field(default_factory=PlacementQueue)
    pendings: Pendings | None = None  # the autoscaler signal, when on
    preemption: PreemptionSettings | None = None  # None: preemption off
    rounds: PlanRounds = field(default_factory=PlanRounds)  # preemption planning per round
    shared: SharedViews = field(default_factory=SharedViews)  # what a round's pods share
    # the Ampere maintenance (webhook/allocator/maintenance.py): off until the controller
    # wires its writes
    ampere: Ampere = field(init=False)

    def __post_init__(self) -> None:
        self.ampere = Ampere(self.state, retry=self._retry)

    def _retry(self, uid: str) -> None:
        track = self.tracks.get(uid)
        if track is not None:
            self.tracks.unpark(track)
        self.kick(uid)

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
        self.ampere.asks.clear()

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
        if not self.ampere.on:
            return
        track, pod = self.tracks.get(uid), self.state.pods.get(uid)
        told = track.told if track is not None and track.parked_at is not None else None
        self.ampere.decided(uid, pod.namespace if pod is not None else None, told)

    def _decide(self, uid: str) -> None:
        pod = self.state.pods.get(uid)
        track = self.tracks.get(uid)
        if track is None or pod is None or not placeable(pod) or pod.claim is None:
            return
        if track.create is not None or track.preempt is not None:
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
            and self.ampere.on
        ):
            result = self.ampere.ask(uid, pod.namespace, snapshot, request, plan.resets, result)
        if isinstance(result, Pending):
            planner = Planner(
                self.state,
                self.catalog,
                self.policy,
                self.ampere,
                self.preemption,
                self.rounds,
                self.shared,
            )
            told = self.pending_reason(result)
            planned = planner.plan(pod, track, request, sized, snapshot, result, told)
            if isinstance(planned, Planned):  # room on an existing node, no new one
                self._preempt(pod, track, planned.preemption)
                if self.pendings is not None:
                    self.pendings.placed(uid)
                return
            told = planned.reason, planned.message
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
        assert pod.claim is not None
        if not plan.resets and not plan.toggles:  # a tie goes to a warm slice (docs/warm-slices.md)
            result = self.state.prefer_warm(result, self.catalog)
        body = allocation_for(
            namespace=pod.namespace,
            claim=pod.claim,
            pod=pod.obj,
            placement=result,
            uuid=self.state.gpu_uuid(result.node),
        )
        self.state.assume(body)
        track.create = body
        track.told = None
        self.kick(uid)

    def _preempt(self, pod: PodView, track: PodTrack, record: Preemption) -> None:
        """Record a planned preemption: its slots reserved at once (nobody else is given
        them), its Ampere reset asked, the pod's worker evicts the victims."""
        self.state.assume(record.body)
        if record.resets:  # the agent drains (the victims go), resets
            self.ampere.turn_off(record.node, record.resets)
        self.tracks.begin_preempt(track, record)
        track.told = None
        self.metrics.outcome("preempting")
        log.info(
            "preempting",
            pod=pod.key,
            node=record.node,
            victims=[f"{v.namespace}/{v.name}" for v in record.victims],
            waits_for=len(record.waits_for - {v.uid for v in record.victims}),
        )
        self.kick(pod.uid)

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
