"""How each step of `next_step` is carried out: the one executor of one pod's record.

`Steps.run(track, step)` executes any step — the bookkeeping ones on the record and the
queues (`Wait`, `Forget`, `Dequeue`, `Unserved`, `Queue`, `Kick`, `Settled`, `AwaitVictims`,
`GiveUp`), the write ones against the API server (through `writes`, every write
Lease-checked) — and records in the pod's record what it did: the create in flight, the
pin written, the allocations it deleted, the retry backoff. It answers when to
look at the pod again (None: when a watch event says). Deciding is not done here
(webhook.allocator.track); the controller's worker only asks `next_step` and runs this.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

from common.allocation import SUMMARY_ANNOTATION, SliceAllocation
from common.clock import Clock
from common.constants import (
    REASON_ALLOCATED,
    REASON_PINNED_UNSCHEDULABLE,
    REASON_PREEMPTED,
    REASON_PREEMPTING,
)
from common.kubeapi import ApiError, Obj
from webhook.allocator import pods as podlib
from webhook.allocator.bookkeeping import Bookkeeping
from webhook.allocator.leader import NotLeader
from webhook.allocator.metrics import AllocatorMetrics
from webhook.allocator.placer import WRITE_ERROR, Placer
from webhook.allocator.preemption import Victim
from webhook.allocator.state import ClusterState
from webhook.allocator.track import (
    Act,
    AwaitVictims,
    Create,
    Evict,
    OnAllocation,
    Pin,
    PodTrack,
    Step,
    Tracks,
    Unstick,
    UnstickPod,
)
from webhook.allocator.views import PodView
from webhook.allocator.writes import Tell, Writes

log = structlog.get_logger("allocator")


_FIRST_BACKOFF_S = 0.2


@dataclass(eq=False)
class Steps:
    writes: Writes
    state: ClusterState
    tracks: Tracks
    placer: Placer
    metrics: AllocatorMetrics
    clock: Clock
    timeout_s: float  # pinned_unschedulable_timeout_s, for the message
    max_backoff_s: float  # the longest retry delay after failed writes
    tell: Tell  # an event, in the background
    after_change: Callable[[], None]  # capacity may have grown (a create failed)
    make_room: Callable[[str, str], Awaitable[None]]  # scale-up signals to go before a pin
    book: Bookkeeping  # the bookkeeping steps

    async def run(self, track: PodTrack, step: Step) -> float | None:
        """Carry out `step` for `track`'s pod; in how many seconds to look again (None:
        when a watch event says). A failed write is retried after a backoff (0.2 s,
        doubling per failure, capped); a kick in between tries it at once."""
        if track.unstick is Unstick.DUE and not isinstance(step, UnstickPod):
            track.unstick = Unstick.DONE  # no longer applicable (UnstickPod says when it is done)
        if self.book.run(track, step):
            if isinstance(step, AwaitVictims):  # then gives up
                return max(0.0, step.deadline - self.clock.monotonic())
            return None
        if isinstance(step, Create) and track.preempt is not None:
            self.tracks.end_preempt(track)  # the reservation is sent: an ordinary create now
        try:
            await self._write(track, step)
        except NotLeader:
            # The Lease went unrenewed past the deadline. If it is lost for good this term
            # is about to be cancelled; if a late renewal keeps it, the step runs again.
            pass
        except ApiError as exc:
            log.warning("allocator write failed", pod_uid=track.uid, error=str(exc))
            self.metrics.outcome("error")
        except Exception:
            log.exception("allocator step failed", pod_uid=track.uid)
        else:
            track.backoff_s = 0.0
            if isinstance(step, Evict):  # a refusal changes nothing watched; a wait has a deadline
                return 0.0
            return None  # what comes next is told by the watch events the write causes
        track.backoff_s = min(max(track.backoff_s * 2, _FIRST_BACKOFF_S), self.max_backoff_s)
        return track.backoff_s

    # --- writes ---------------------------------------------------------------------------

    async def _write(self, track: PodTrack, step: Step) -> None:
        match step:
            case Create(pod, body):
                await self.create(track, pod, body)
            case Pin(pod, alloc):
                await self.pin(track, pod, alloc)
            case OnAllocation(Act.RELEASE, alloc, why):
                await self.release(track, alloc, why)
            case OnAllocation(Act.RELEASE_ORPHAN, alloc):
                if not await self.writes.pod_alive(alloc):  # the cache may lag: ask first
                    await self.release(track, alloc, "its pod is gone")
            case OnAllocation(Act.RELEASE_FAILED, alloc):
                await self.release_failed(track, alloc)
            case OnAllocation(Act.MOVE_OFF, alloc):
                await self.move_off_down_node(track, alloc)
            case OnAllocation(Act.FINALIZE, alloc):
                await self.finalize(alloc)
            case UnstickPod(pod):
                await self.unstick(track, pod)
            case Evict(pod, victims):
                await self.evict(track, pod, victims)
            case _:
                raise AssertionError(f"not a write step: {step}")

    # --- create and pin -----------------------------------------------------------------

    async def create(self, track: PodTrack, pod: PodView, body: Obj) -> None:
        key = f"{pod.namespace}/{body['metadata']['name']}"
        track.create = None
        track.preempt = None  # a reservation whose victims are gone is sent like any decision
        # The write is not a child of this term: a term that ends (Lease lost, then perhaps
        # won back at once) must not cut a create whose outcome it then could not know, or
        # the next term could promise the same slots while the request still lands. The
        # assumed record stays until the write's own outcome settles it (`_created`).
        write = asyncio.ensure_future(self.writes.create_allocation(body))
        track.creating, track.creating_key = write, key
        write.add_done_callback(functools.partial(self._created, key))
        try:
            await asyncio.shield(write)
        except (ApiError, NotLeader) as exc:
            if isinstance(exc, ApiError) and exc.conflict:
                return  # it exists (another replica's, or ours before a restart): watch shows it
            if isinstance(exc, ApiError) and not exc.retryable:
                self.metrics.outcome("error")
                log.error("allocation refused", pod=pod.key, error=str(exc))
                why = f"the SliceAllocation was refused: {exc.message}"
                self.placer.park(pod, WRITE_ERROR, why)
                return
            raise
        self.metrics.outcome("allocated")
        annotations = body["metadata"]["annotations"]
        message = f"node {body['spec']['nodeName']}: {annotations[SUMMARY_ANNOTATION]}"
        self.tell(pod.obj, REASON_ALLOCATED, message, "Normal")  # off the critical path

    def _created(self, key: str, write: asyncio.Future[Obj]) -> None:
        """Settle an assumed allocation by its create's outcome, whatever term it is now."""
        if not write.cancelled() and write.exception() is None:
            self.state.confirm(write.result())
            return
        self.state.forget(key)
        self.after_change()

    async def pin(self, track: PodTrack, pod: PodView, alloc: SliceAllocation) -> None:
        await self.make_room(pod.uid, alloc.node)
        written = await self.writes.pin(pod.obj, alloc.node)
        if written is None:
            return
        # gates cannot come back: never pin this pod again
        track.pinned = True
        if track.ungate_start is not None:
            waited = max(0.0, self.clock.monotonic() - track.ungate_start)
            self.metrics.time_to_ungate.observe(waited)
            track.ungate_start = None
        log.info("pod pinned", pod=pod.key, node=alloc.node, claim=alloc.name)

    # --- releases -----------------------------------------------------------------------

    async def release(self, track: PodTrack, alloc: SliceAllocation, why: str) -> None:
        log.info("releasing allocation", allocation=alloc.key, why=why)
        await self.writes.delete_allocation(alloc)
        if alloc.uid:
            track.released = track.released | {alloc.uid}
        self.state.mark_deleting(alloc)
        self.metrics.outcome("released")

    async def release_failed(self, track: PodTrack, alloc: SliceAllocation) -> None:
        message = alloc.message or "no message"
        log.warning("allocation failed", allocation=alloc.key, node=alloc.node, message=message)
        track.failed_gpus = track.failed_gpus | {(alloc.node, s.gpu_uuid) for s in alloc.slices}
        self.metrics.outcome("failed")
        await self.release(track, alloc, f"the node agent failed it: {message}")

    async def move_off_down_node(self, track: PodTrack, alloc: SliceAllocation) -> None:
        """The node's agent is down and never acted on this allocation, so nothing was made
        for it: drop the record without the agent, and the pod (still gated: it is pinned
        only once Ready) is placed again, on a node with a running agent."""
        if not await self.writes.drop_finalizer_if_untouched(alloc):
            return  # the agent wrote a status after all (it finishes or releases it), or gone
        log.warning(
            "allocation on a node whose agent is down moved", allocation=alloc.key, node=alloc.node
        )
        await self.release(track, alloc, "its node's agent is down and never acted on it")

    async def finalize(self, alloc: SliceAllocation) -> None:
        """The node is gone, so nothing is left to destroy: finish the record ourselves.

        Its pod goes first when it was already ungated (pinned to the node, or bound there):
        gates cannot be re-added, and a Node deleted and registered again under its name
        (a kubelet re-registering, a re-created VM) would have the scheduler bind the pinned
        pod there and start it on slots this release hands to another pod — a double
        booking (chaos soak, seed 7). As for a pinned pod stuck unschedulable, the delete is
        of the pod as just read, and the record is finished only once it is done; its
        controller, if any, recreates it and it is placed again."""
        if await self.writes.node_exists(alloc.node):
            return  # it exists after all; the node watch will say so
        if not await self._delete_ungated_pod(alloc):
            return  # the pod changed since it was read: its watch event brings it back here
        current = await self.writes.drop_finalizer(alloc)
        if current is None:
            return
        log.info("finalized allocation of a deleted node", allocation=alloc.key, node=alloc.node)
        if not current.get("metadata", {}).get("deletionTimestamp"):
            await self.writes.delete_allocation(SliceAllocation.parse(current))
        self.metrics.outcome("released")

    async def _delete_ungated_pod(self, alloc: SliceAllocation) -> bool:
        """Delete the allocation's pod as read when it is ungated (see `finalize`): True when
        the record may be finished (no such pod, or deleted), False when the pod changed
        since the read."""
        if not alloc.pod_name:
            return True
        ref = {"metadata": {"namespace": alloc.namespace, "name": alloc.pod_name}}
        current = await self.writes.read_pod(ref)
        if current is None or not podlib.ungated_on(current, alloc.pod_uid, alloc.name):
            return True
        if not await self.writes.delete_pod_as_read(current):
            log.info("pod of a deleted node changed since it was read", pod=podlib.key(current))
            return False
        log.warning(
            "pod ungated onto a deleted node deleted", pod=podlib.key(current), node=alloc.node
        )
        return True

    # --- preemption ---------------------------------------------------------------------

    async def evict(self, track: PodTrack, pod: PodView, victims: tuple[Victim, ...]) -> None:
        """Evict the preemption's victims through the Eviction API (policy/v1), which keeps
        PodDisruptionBudgets and graceful termination. A refusal (429) of a plan that keeps
        every PDB as far as the cached budgets tell is recorded: the next step gives this
        preemption up and plans again, that pod a victim only as a last resort from then
        on. A refusal of a plan that is that last resort (`past_pdb`: no plan keeping every
        PDB exists) is answered with a delete of the pod (UID precondition, its grace
        period), as kube-scheduler's preemption deletes its victims whatever their PDBs
        (docs/allocator.md "Preemption")."""
        p = track.preempt
        assert p is not None
        if not p.told:
            names = ", ".join(f"{v.namespace}/{v.name}" for v in p.victims)
            message = (
                f"preempting {len(p.victims)} lower-priority pod(s) to free {p.summary} "
                f"on node {p.node}: {names}"
            )
            self.tell(pod.obj, REASON_PREEMPTING, message, "Normal")
            p.told = True
        for v in victims:
            victim = self.state.pods.get(v.uid)  # read first: the eviction may remove it
            past = ""
            if not await self.writes.evict(v.namespace, v.name, v.uid):
                log.warning("eviction refused", preemptor=pod.key, victim=f"{v.namespace}/{v.name}")
                if not p.past_pdb:
                    p.refused = v.uid
                    return
                await self.writes.delete_pod(v.namespace, v.name, v.uid)
                past = " past its PodDisruptionBudget (no plan keeping every budget exists)"
            p.evicted = p.evicted | {v.uid}
            self.metrics.outcome("preempted")
            log.info("victim evicted", preemptor=pod.key, victim=f"{v.namespace}/{v.name}",
                     past_pdb=bool(past))  # fmt: skip
            if victim is not None:
                message = (
                    f"preempted by {pod.key} (priority {pod.priority}) to free {p.summary} "
                    f"on node {p.node}{past}"
                )
                self.tell(victim.obj, REASON_PREEMPTED, message, "Normal")

    # --- pinned but unschedulable -------------------------------------------------------

    async def unstick(self, track: PodTrack, pod: PodView) -> None:
        """Delete a pinned pod the scheduler cannot place, then release its slices: its
        controller, if any, recreates it and it is placed again (docs/allocator.md "Pinned
        but unschedulable"). A bare pod is deleted too: gates cannot be re-added, and an
        ungated pod still asking for `instaslice.io/mig-*` without slices would, once
        scheduled, be handed another pod's slice by the kubelet (device-plugin mode).

        The delete comes first, and only of the pod as just read (UID and resourceVersion):
        a pod the scheduler binds after the read is left alone with its slices, and a delete
        that fails (API server away, term over) releases nothing. Releasing first left such
        a pod ungated without slices; bound later, it would run on slots given to another
        pod (a double booking, issue 17). Until the delete is done the
        record stays due, so a failed step is retried."""
        current = await self.writes.read_pod(pod.obj)  # the cache may lag: still stuck?
        if current is None or not podlib.stuck_pinned(current, pod.uid):
            log.info("pinned pod no longer unschedulable; left alone", pod=pod.key)
            track.unstick = Unstick.DONE
            return
        if not await self.writes.delete_pod_as_read(current):
            # changed since the read (bound, or its status written): the change's watch
            # event brings it back here, still due, and it is read again
            log.info("pinned pod changed since it was read; looked at again", pod=pod.key)
            return
        track.unstick = Unstick.DONE
        log.info("pinned pod stayed unschedulable; deleted", pod=pod.key)
        if pod.node:  # its controller's next pods preempt nobody there for a while
            self.placer.back_off(pod, pod.node)
        node = pod.node or "its node"
        cause = _scheduled_message(current)
        for alloc in self.state.allocations_of(pod.uid):
            if not alloc.deleting and not self.state.is_assumed(alloc.key):
                await self.release(track, alloc, "pinned pod stayed unschedulable")
        self.metrics.outcome("pinned_unschedulable")
        owner = podlib.controller_ref(pod.obj)
        waited = f"pinned to {node} but unschedulable for {self.timeout_s:g}s ({cause})"
        if owner is not None:
            then = f"its {owner.get('kind', 'controller')} recreates it and it is placed again"
        else:
            then = "it has no controller to recreate it: create it again to have it placed"
        message = f"{waited}; deleted it and released its slices; {then}"
        await self.writes.event(pod.obj, REASON_PINNED_UNSCHEDULABLE, message, "Warning")


def _scheduled_message(pod: Obj) -> str:
    for cond in pod.get("status", {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled":
            return str(cond.get("message") or cond.get("reason") or "unschedulable")
    return "unschedulable"
