"""The bookkeeping steps of `next_step`: the ones that change only the pod's record and the
queues (`Wait`, `Forget`, `Dequeue`, `Unserved`, `Queue`, `Kick`, `Settled`, `AwaitVictims`,
`GiveUp`). Carried out by the one executor (steps.Steps.run), which hands them here; no
API write but the background `AllocationPending` event of `Unserved` and the withdrawal of
a given-up preemption's Ampere reset.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import structlog

from common.clock import Clock
from common.constants import REASON_PENDING
from webhook.allocator.metrics import AllocatorMetrics
from webhook.allocator.placer import Placer
from webhook.allocator.state import ClusterState
from webhook.allocator.track import (
    AwaitVictims,
    Dequeue,
    Forget,
    GiveUp,
    Kick,
    PodTrack,
    Queue,
    Settled,
    Step,
    Tracks,
    Unserved,
    Wait,
)
from webhook.allocator.writes import Tell

log = structlog.get_logger("allocator")


@dataclass(eq=False)
class Bookkeeping:
    state: ClusterState
    tracks: Tracks
    placer: Placer
    metrics: AllocatorMetrics
    clock: Clock
    tell: Tell  # an event, in the background
    after_change: Callable[[], None]  # capacity may have grown (a reservation dropped)
    kick: Callable[[str], None]  # look at a pod again (its worker)
    wake_placer: Callable[[], None]  # a pod was queued
    wake_timer: Callable[[], None]  # a pinned pod may be unschedulable
    # (node, GPU UUIDs): their desiredMigMode entries go, written in the background
    withdraw_modes: Callable[[str, set[str]], None]

    def run(self, track: PodTrack, step: Step) -> bool:
        """Carry out a bookkeeping step; False for a write step."""
        uid, queue = track.uid, self.placer.queue
        match step:
            case Wait() | AwaitVictims():
                pass
            case Forget():
                if track.create is not None:  # decided, but the pod left before the create
                    meta = track.create["metadata"]
                    self.state.forget(f"{meta['namespace']}/{meta['name']}")
                    self.after_change()
                self.tracks.forget(uid)
                queue.remove(uid)
                self.placer.ampere.release(uid)  # a MIG mode change it alone needed: withdrawn
            case Dequeue():
                queue.remove(uid)
                self.tracks.unpark(track)
                self.placer.ampere.release(uid)
            case Unserved(pod, reason, message):
                queue.remove(uid)
                self.tracks.unpark(track)
                if track.told != reason:
                    track.told = reason
                    log.info("pod not served", pod=pod.key, reason=reason, message=message)
                    self.tell(pod.obj, REASON_PENDING, message, "Warning")
            case Queue(pod):
                self.tracks.unpark(track)
                queue.push(uid, priority=pod.priority, created=pod.created, key=pod.key)
                self.wake_placer()
            case GiveUp(why, avoid, refused):
                self.give_up(track, why, avoid, refused)
                self.kick(uid)
            case Kick(other):
                self.kick(other)  # a stale record holds the name: release it first
            case Settled(waiting):
                queue.remove(uid)
                self.tracks.unpark(track)
                track.told = None
                self.tracks.observe_unschedulable(track, waiting, self.clock.monotonic())
                if waiting:
                    self.wake_timer()
            case _:
                return False
        return True

    def give_up(
        self,
        track: PodTrack,
        why: str,
        avoid: frozenset[str],
        refused: frozenset[str] = frozenset(),
    ) -> None:
        """Drop a preemption: its reservation is forgotten (capacity back for the others)
        and the pod is placed anew, never again preempting `avoid`, and `refused` only as a
        last resort (a PodDisruptionBudget violation)."""
        p = self.tracks.end_preempt(track)
        if p is None:
            return
        track.avoid = track.avoid | avoid
        track.refused = track.refused | refused
        self.state.forget(p.key)
        # its Ampere reset, not reached yet, is withdrawn: left standing, the agent would
        # drain the GPU (for up to its drain timeout, no other Ampere change meanwhile) and
        # reset it for nobody
        undo: dict[str, set[str]] = {}
        for node, index in p.resets:
            g = self.state.gpu(node, index)
            if g is not None and g.desired == "disabled" and g.mig_enabled:
                undo.setdefault(node, set()).add(g.uuid)
        for node, uuids in undo.items():
            self.withdraw_modes(node, uuids)
        self.metrics.outcome("preemption_abandoned")
        log.info("preemption given up", pod_uid=track.uid, why=why, avoid=len(avoid),
                 refused=len(refused))  # fmt: skip
        self.after_change()
