"""One record per pod and the pure decision of what to do next for it (docs/style.md §12a).

`PodTrack` is everything the leading allocator knows and has promised about one pod: that it
is parked as pending (and which reason the pod was told), the GPUs that failed it, when it
became unschedulable while pinned, the create it decided and the write in flight, that its
pin was written (so a watch event older than the pin is recognised: see `PodTrack.pinned`),
the allocations it deleted (so an older watch event of one is never trusted), and its retry
backoff.

`next_step(track, seen)` reads that record and what the caches show (`Seen`) and returns one
`Step`; it does no I/O and keeps no clock. The controller executes steps, one pod at a time
(common.workqueue), and the placer decides placements (webhook.allocator.placer). Every
branch has a row in tests/unit/test_allocator_track.py. The order of the checks is the
order of precedence:

0. a decision the placer recorded: `Create` (its slots are assumed; it is always sent);
   a preemption in flight (its slots reserved): `Evict` its victims, `AwaitVictims` until
   their allocations are gone (and a reserved Ampere GPU's MIG mode is off), then `Create`;
   `GiveUp` when the pod stops waiting, an eviction is refused, or the victims (or the mode
   change) outlive the deadline;
1. a pinned pod unschedulable past the timeout (the timer marked it): `Unstick`;
2. per allocation of the pod: finalize one on a gone node, release one whose pod is gone,
   finished or no longer claims it, release a failed one, move one the agent never touched
   off a node whose agent is down;
3. no pod (or no claim) and nothing left to release: `Forget`;
4. gated by ours alone: `Unserved` when it asks for whole GPUs its namespace did not opt in
   to, else wait for a running create, `Queue` for placement (unless parked or another
   pod's stale record holds the name: `Kick` that pod), or `Pin` once Ready;
5. ungated: `Settled` (the timer watches whether the scheduler can place it).
"""

from __future__ import annotations

import asyncio
import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from common.allocation import SliceAllocation
from common.constants import GATE_NAME, INSTASLICE_GPU, WHOLE_GPU_KEY
from common.objects import Phase
from webhook.allocator.planning import PlanInputs
from webhook.allocator.preemption import Preemption, Victim
from webhook.allocator.views import PodView

Obj = dict[str, Any]


class Unstick(enum.Enum):
    NO = "no"
    DUE = "due"  # the timer found it unschedulable for the whole timeout
    DONE = "done"  # handled once; never again for this pod


@dataclass
class PodTrack:
    uid: str
    parked_at: int | None = None  # parked as pending at this metadata.generation
    told: str | None = None  # the AllocationPending reason the pod was last told
    failed_gpus: frozenset[tuple[str, str]] = frozenset()  # (node, gpu uuid) that failed it
    ungate_start: float | None = None  # monotonic: ours became its only gate
    unschedulable_since: float | None = None  # monotonic: pinned, and the scheduler gave up
    unstick: Unstick = Unstick.NO
    backoff_s: float = 0.0  # the last retry delay after a failed step (0: none failed)
    create: Obj | None = None  # decided and assumed; its create not sent yet
    creating: asyncio.Future[Obj] | None = field(default=None, repr=False)  # create in flight
    creating_key: str = ""  # namespace/name of the allocation being created
    # our pin+ungate update was written. No resourceVersion is needed to recognise its echo:
    # the API server only ever removes scheduling gates (adding one to an existing pod is
    # refused), so once the pin is written every view still carrying our gate is older than
    # it, and every later one is ungated. A resourceVersion, opaque (equality only), could
    # tell no more, and a re-list that skips the echo would leave it unmatched.
    pinned: bool = False
    released: frozenset[str] = frozenset()  # uids of allocations we deleted
    gone: str | None = None  # why the pod left the cache (DELETED event), if it did
    preempt: Preemption | None = None  # a preemption in flight: its slots reserved
    avoid: frozenset[str] = frozenset()  # uids never to preempt for it (did not terminate)
    refused: frozenset[str] = frozenset()  # uids whose eviction a PDB refused for it
    # a preemption plan that found nothing: what it read and what the pod was told; planned
    # again only when those inputs change (webhook/allocator/planning.py)
    no_plan: tuple[PlanInputs, str] | None = None
    plan_deferred: bool = False  # its plan waits for the next placement round (budget spent)

    def end_term(self) -> None:
        """What only a leadership term may hold: the next term decides afresh (and tells a
        pending reason again; an event the term's end cut off is told by the next term)."""
        self.parked_at = None
        self.told = None
        self.backoff_s = 0.0
        self.create = None
        self.preempt = None  # its reservation was assumed in this term only: planned afresh
        self.no_plan = None
        self.plan_deferred = False


@dataclass(frozen=True, slots=True)
class Seen:
    """What the caches show for one pod, as `next_step` needs it."""

    pod: PodView | None
    allocations: tuple[SliceAllocation, ...]  # the pod's, by key
    assumed: frozenset[str] = frozenset()  # keys of those whose create has not returned
    nodes: frozenset[str] = frozenset()  # of the allocations' nodes, those with a Node
    agents_down: frozenset[str] = frozenset()
    name_holder: str | None = None  # uid of another pod whose record holds our claim name
    opted_in: bool = True  # the pod's namespace is labelled instaslice.io/enabled=true
    whole_gpu: bool = True  # ... and instaslice.io/whole-gpu=true (whole GPUs may be asked)
    # a preemption in flight (track.preempt): its victims whose pods still run (not
    # terminating), and the pods it waits for that still hold allocations
    victims_alive: frozenset[str] = frozenset()
    holding: frozenset[str] = frozenset()
    # and, for whole GPUs on Ampere, whether a reserved GPU's MIG mode is not off yet
    modes_pending: bool = False
    now: float = 0.0  # monotonic


# --- steps ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Wait:
    """Nothing to do until something changes (a write's echo, a create's outcome)."""

    why: str


@dataclass(frozen=True, slots=True)
class UnstickPod:
    """Pinned, and unschedulable for the whole timeout: release its slices."""

    pod: PodView


@dataclass(frozen=True, slots=True)
class Queue:
    """Gated by ours alone, nothing held: the placer decides."""

    pod: PodView


class Act(enum.Enum):
    """What to do with one allocation of the pod."""

    FINALIZE = "finalize"  # its node is gone: drop the finalizer ourselves (after a GET)
    RELEASE = "release"  # delete it; `why` says why
    RELEASE_ORPHAN = "release-orphan"  # the cache never saw the pod: ask the API server first
    RELEASE_FAILED = "release-failed"  # the agent failed it: release, avoid its GPUs next time
    MOVE_OFF = "move-off"  # its node's agent is down and never acted on it: drop it


@dataclass(frozen=True, slots=True)
class OnAllocation:
    act: Act
    alloc: SliceAllocation
    why: str = ""


@dataclass(frozen=True, slots=True)
class Forget:
    """The pod is gone (or not InstaSlice's) and holds nothing: drop its record."""


@dataclass(frozen=True, slots=True)
class Dequeue:
    """Not ours to place now (another gate first, being deleted, or its namespace did not
    opt in)."""


@dataclass(frozen=True, slots=True)
class Unserved:
    """Gated by ours alone, but asking for what its namespace did not opt in to (whole GPUs
    without `instaslice.io/whole-gpu`): not placed; the pod is told `message` once, as an
    AllocationPending with `reason` (the namespace's opt-in kicks it again)."""

    pod: PodView
    reason: str
    message: str


WHOLE_GPU_NOT_OPTED_IN = "WholeGpuNotOptedIn"


@dataclass(frozen=True, slots=True)
class Kick:
    """Another pod's stale record holds this pod's claim name: look at that pod first."""

    uid: str


@dataclass(frozen=True, slots=True)
class Create:
    pod: PodView
    body: Obj


@dataclass(frozen=True, slots=True)
class Pin:
    pod: PodView
    alloc: SliceAllocation


@dataclass(frozen=True, slots=True)
class Evict:
    """Preempting: evict these victims (policy/v1 Eviction: PDBs and grace respected)."""

    pod: PodView
    victims: tuple[Victim, ...]


@dataclass(frozen=True, slots=True)
class AwaitVictims:
    """Preempting: the slots stay reserved until every victim's allocation is gone."""

    deadline: float  # monotonic: looked at again then
    holding: int


@dataclass(frozen=True, slots=True)
class GiveUp:
    """Drop the preemption and its reservation; `avoid`: pods never to preempt for this pod
    again (victims that did not terminate); `refused`: pods whose eviction a PDB refused,
    victims for it from now on only as a last resort (a PDB violation). The pod is placed
    anew."""

    why: str
    avoid: frozenset[str] = frozenset()
    refused: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Settled:
    """Ungated: nothing to write; `waiting` says the scheduler cannot bind it now."""

    waiting: bool


Step = (
    Wait
    | UnstickPod
    | OnAllocation
    | Forget
    | Dequeue
    | Unserved
    | Queue
    | Kick
    | Create
    | Pin
    | Settled
    | Evict
    | AwaitVictims
    | GiveUp
)


def placeable(pod: PodView) -> bool:
    """The one eligibility check (next_step's, the placer's, the autoscaler signal's): the
    pod carries a claim, ours is its only scheduling gate (other gates, Kueue's, go first),
    and it is neither being deleted nor finished. Whether its namespace opted in is `Seen`'s
    (the caches'); whether it holds or was decided anything, the record's."""
    return (
        pod.claim is not None
        and pod.gates == (GATE_NAME,)
        and not pod.deleting
        and not pod.terminal
    )


def next_step(track: PodTrack, seen: Seen) -> Step:
    pod = seen.pod
    if track.create is not None and pod is not None:
        # decided and assumed: send it whatever happened since (a pod being deleted now gets
        # its allocation released as usual); never leave the assumed slots unsent
        return Create(pod, track.create)
    if track.preempt is not None:
        return _preempt_step(track.preempt, seen)
    due = track.unstick is Unstick.DUE
    if due and pod is not None and not pod.bound and GATE_NAME not in pod.gates:
        return UnstickPod(pod)
    for alloc in seen.allocations:
        step = _allocation_step(track, seen, alloc)
        if step is not None:
            return step
    if pod is None or pod.claim is None:
        return Forget()  # gone, or not a pod InstaSlice places: nothing to remember
    if pod.terminal:
        return Wait("finished; nothing to place")
    if GATE_NAME in pod.gates:
        return _gated_step(track, seen, pod)
    return Settled(waiting=pod.unschedulable and not pod.bound and not pod.deleting)


def _allocation_step(track: PodTrack, seen: Seen, alloc: SliceAllocation) -> Step | None:
    if alloc.key in seen.assumed:
        return None  # its create is in flight
    if alloc.node not in seen.nodes:
        if alloc.has_finalizer or not alloc.deleting:
            return OnAllocation(Act.FINALIZE, alloc)
        return None
    if alloc.deleting or alloc.uid in track.released:
        return None  # the node agent destroys the slices and drops the finalizer
    pod = seen.pod
    if pod is None:
        if track.gone is not None:  # the watch said so: no need to ask again
            return OnAllocation(Act.RELEASE, alloc, track.gone)
        return OnAllocation(Act.RELEASE_ORPHAN, alloc)
    if pod.terminal:
        return OnAllocation(Act.RELEASE, alloc, "the pod finished")
    if pod.claim != alloc.name:
        return OnAllocation(Act.RELEASE, alloc, "the pod no longer carries this claim")
    if alloc.namespace != pod.namespace:
        return OnAllocation(Act.RELEASE, alloc, "it is not in the pod's namespace")
    if alloc.failed:
        return OnAllocation(Act.RELEASE_FAILED, alloc)
    if alloc.node in seen.agents_down and alloc.phase == Phase.PENDING:
        return OnAllocation(Act.MOVE_OFF, alloc)
    return None


def _gated_step(track: PodTrack, seen: Seen, pod: PodView) -> Step:
    if not placeable(pod) or not seen.opted_in:
        return Dequeue()
    if pod.whole and not seen.whole_gpu and not seen.allocations:
        message = (
            f"asks for whole GPUs ({INSTASLICE_GPU}), but namespace {pod.namespace} did not opt "
            f'in to them: annotate it {WHOLE_GPU_KEY}: "true" (docs/contract.md §1)'
        )
        return Unserved(pod, WHOLE_GPU_NOT_OPTED_IN, message)
    if track.creating is not None and not track.creating.done():
        return Wait("its create is in flight")
    if not seen.allocations:
        if seen.name_holder is not None:
            return Kick(seen.name_holder)
        if track.parked_at == pod.generation:
            return Wait("pending; waits for capacity to grow")
        return Queue(pod)
    if track.pinned:
        return Wait("pinned already; the watch has not caught up")
    for alloc in seen.allocations:
        usable = alloc.key not in seen.assumed and alloc.uid not in track.released
        ours = alloc.name == pod.claim and alloc.namespace == pod.namespace
        if alloc.ready and usable and ours:
            return Pin(pod, alloc)
    return Wait("the node agent is making its slices")


def _preempt_step(p: Preemption, seen: Seen) -> Step:
    pod = seen.pod
    if pod is None or pod.claim is None or pod.deleting or pod.terminal:
        return GiveUp("the preemptor is gone")
    if not placeable(pod) or not seen.opted_in or (pod.whole and not seen.whole_gpu):
        return GiveUp("the preemptor is no longer InstaSlice's to place")
    if p.refused:
        why = "an eviction was refused (PodDisruptionBudget)"
        return GiveUp(why, refused=frozenset({p.refused}))
    if seen.now >= p.deadline and seen.holding:
        return GiveUp("victims did not release their slices in time", seen.holding)
    if seen.now >= p.deadline and seen.modes_pending:
        return GiveUp("the MIG mode change (Ampere maintenance) was not done in time")
    left = tuple(v for v in p.victims if v.uid not in p.evicted and v.uid in seen.victims_alive)
    if left:
        return Evict(pod, left)
    if not seen.holding and not seen.modes_pending:
        return Create(pod, p.body)  # every victim's slots are free: the reservation is sent
    return AwaitVictims(p.deadline, len(seen.holding))


# --- the records --------------------------------------------------------------------------


class Tracks:
    """The leader's records, by pod uid, with the two small indexes its loops scan: pods
    parked as pending (retried when capacity may have grown) and pinned pods the scheduler
    cannot place (the pinned-unschedulable timer). Records are made while leading and
    dropped when their pod is gone, so a standby holds none of its own."""

    def __init__(self) -> None:
        self._by_uid: dict[str, PodTrack] = {}
        self._parked: set[str] = set()
        self._stuck: set[str] = set()
        self._preempting: set[str] = set()

    def get(self, uid: str) -> PodTrack | None:
        return self._by_uid.get(uid)

    def ensure(self, uid: str) -> PodTrack:
        track = self._by_uid.get(uid)
        if track is None:
            track = self._by_uid[uid] = PodTrack(uid)
        return track

    def forget(self, uid: str) -> None:
        self._by_uid.pop(uid, None)
        self._parked.discard(uid)
        self._stuck.discard(uid)
        self._preempting.discard(uid)

    def values(self) -> list[PodTrack]:
        return list(self._by_uid.values())

    def __len__(self) -> int:
        return len(self._by_uid)

    # parked pods

    def park(self, track: PodTrack, generation: int) -> None:
        track.parked_at = generation
        self._parked.add(track.uid)

    def unpark(self, track: PodTrack) -> None:
        track.parked_at = None
        self._parked.discard(track.uid)

    def take_parked(self) -> list[str]:
        """Unpark every parked pod (capacity may have grown); their uids, to look at again."""
        out = sorted(self._parked)
        for uid in out:
            self._by_uid[uid].parked_at = None
        self._parked.clear()
        return out

    @property
    def parked(self) -> dict[str, int]:
        """uid → the generation each parked pod was parked at."""
        return {u: g for u in self._parked if (g := self._by_uid[u].parked_at) is not None}

    def pending_counts(self) -> Counter[str]:
        """Pods told a pending reason (and not placed since), by reason."""
        return Counter(t.told for t in self._by_uid.values() if t.told is not None)

    # preemptions in flight

    def begin_preempt(self, track: PodTrack, preemption: Preemption) -> None:
        track.preempt = preemption
        self._preempting.add(track.uid)

    def end_preempt(self, track: PodTrack) -> Preemption | None:
        p, track.preempt = track.preempt, None
        self._preempting.discard(track.uid)
        return p

    def preempting(self) -> list[str]:
        """Pods whose preemption is in flight (looked at when an allocation goes)."""
        return sorted(self._preempting)

    # pinned but unschedulable

    def observe_unschedulable(self, track: PodTrack, waiting: bool, now: float) -> None:
        if waiting:
            if track.unschedulable_since is None:
                track.unschedulable_since = now
            self._stuck.add(track.uid)
        else:
            track.unschedulable_since = None
            track.unstick = Unstick.NO
            self._stuck.discard(track.uid)

    def _unhandled(self) -> list[PodTrack]:
        tracks = (self._by_uid[u] for u in self._stuck)
        return [t for t in tracks if t.unstick is Unstick.NO and t.unschedulable_since is not None]

    def next_deadline(self, timeout: float) -> float | None:
        times = [t.unschedulable_since for t in self._unhandled()]
        return min(t for t in times if t is not None) + timeout if times else None

    def due(self, now: float, timeout: float) -> list[str]:
        """Pods unschedulable for at least `timeout`, not handled yet; marks them due."""
        out = []
        for t in self._unhandled():
            assert t.unschedulable_since is not None
            if now - t.unschedulable_since >= timeout:
                t.unstick = Unstick.DUE
                out.append(t.uid)
        return sorted(out)

    def end_term(self) -> None:
        for track in self._by_uid.values():
            track.end_term()
        self._parked.clear()
        self._preempting.clear()
