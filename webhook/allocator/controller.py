"""The allocator loop: watched objects in, SliceAllocations and pod pins out.

Informers (list, watch, re-list on 410; common.kubeapi) feed `ClusterState` on every
replica, so a standby has a warm cache. Only the Lease holder acts (`lead`); every write
checks the Lease first. While leading:

- one worker per pod (common.workqueue.KeyedQueue: a pod's steps serialized, different
  pods in parallel) reads the pod's record and the caches, asks the pure
  `track.next_step` what to do, and carries it out (`steps.Steps`); a failed step is
  retried after a backoff that doubles per failure;
- the placer loop pops gated pods in priority order and decides for each on a snapshot
  (`placer.Placer`). Pods that do not fit are parked and retried only when
  `ClusterState.epoch` says capacity may have grown. Each wake-up is a round with a CPU
  budget for preemption planning; pods whose plan a spent budget deferred go first in the
  next round, which starts at once (webhook/allocator/planning.py);
- the timer, for pinned pods the scheduler cannot bind (`pinned_unschedulable_timeout_s`),
  and the sweep every `agent_sweep_s` that leaves out of placement the nodes whose agent
  has not renewed its Lease for the Lease's duration; a renewal seen brings the node back
  and retries parked pods. Both on the injected clock.

What it deliberately does not do: talk to GPUs (the node agent does), retry on a clock
(pending pods wait for a relevant change), bind pods (the kube-scheduler does, once the pod
is pinned and ungated), or move allocations off a node whose agent is down once the agent
has acted on them (they complete when it returns; a deleted node releases them).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Literal

import structlog

from common.catalog import load_catalog
from common.clock import cancel_until_done, monotonic_at, wait_or_sleep
from common.constants import (
    GATE_NAME,
    SLICE_ALLOCATION_PLURAL,
    AllocationMode,
    EventReason,
)
from common.kubeapi import (
    Informer,
    Kube,
    Obj,
    instaslice_path,
)
from common.workqueue import KeyedQueue
from webhook.allocator.agents import AgentWatch
from webhook.allocator.bookkeeping import Bookkeeping
from webhook.allocator.claimwrites import ClaimWrites
from webhook.allocator.handlers import Handlers, informers
from webhook.allocator.leader import LeaderElector
from webhook.allocator.maintenance import ASK_DRAIN
from webhook.allocator.metrics import AllocatorMetrics, GaugeView
from webhook.allocator.placer import Placer
from webhook.allocator.planning import PlanRounds
from webhook.allocator.preemption import (
    Budgets,
    OwnerBackoff,
    PreemptionSettings,
    parse_selector,
)
from webhook.allocator.scaleup import ScaleUp
from webhook.allocator.settings import AllocatorSettings
from webhook.allocator.state import ClusterState
from webhook.allocator.steps import Steps
from webhook.allocator.track import (
    Tracks,
    next_step,
)
from webhook.allocator.writes import MigNodeWrites, Writes

log = structlog.get_logger("allocator")


class Controller:
    pods_informer: Informer
    lease_informer: Informer
    modes: MigNodeWrites

    def __init__(
        self,
        kube: Kube,
        elector: LeaderElector,
        metrics: AllocatorMetrics,
        settings: AllocatorSettings,
    ) -> None:
        self.kube = kube
        self.elector = elector
        self.metrics = metrics
        self.settings = settings
        self.clock = settings.clock
        self.catalog = settings.catalog if settings.catalog is not None else load_catalog()
        self.state = ClusterState(
            self.catalog, avoid_creates_in_flight=settings.avoid_creates_in_flight
        )
        self.tracks = Tracks()
        self.agents = AgentWatch(self.state, self.clock, self.kick, self._after_change)
        self.placer = Placer(
            self.state,
            self.tracks,
            metrics,
            settings.policy,
            self.catalog,
            kick=self.kick,
            tell=lambda pod, reason, message: self._event(pod, reason, message, "Warning"),
        )
        if settings.ampere_mode_changes == ASK_DRAIN:
            ampere = self.placer.ampere
            ampere.ask_modes = lambda node, wants: self.modes.set(node, wants, set())
            ampere.withdraw_modes = lambda node, uuids: self.modes.set(node, {}, uuids)
            ampere.asks.min_interval_s = settings.ampere_mode_change_interval_s
            ampere.wall = lambda: self.clock.wall().timestamp()
        self.budgets = Budgets()
        self.placer.rounds = PlanRounds(settings.preemption_round_cpu_s)
        self._leading = False
        self.handlers = Handlers(
            self.state,
            self.tracks,
            self.clock,
            self.catalog,
            self.agents,
            self.budgets,
            self.placer.ampere,
            leading=lambda: self._leading,
            kick=self.kick,
            after_change=self._after_change,
            set_modes=lambda node, add, drop: self.modes.set(node, add, drop),
            warn=lambda node, reason, message: self.modes.warn(node, reason, message),
            leases_synced=lambda: self.lease_informer.synced.is_set(),
            # namespaces whose pods are Kueue-managed: the admin's selector on namespace
            # labels (never a pod's own label, which its owner could set: docs/kueue.md)
            kueue_selector=parse_selector(settings.kueue_namespace_selector),
        )
        self.opted_in = self.handlers.opted_in
        self.whole_gpu = self.handlers.whole_gpu
        self.kueue_namespaces = self.handlers.kueue_namespaces
        if settings.preemption:
            self.placer.preemption = PreemptionSettings(
                self.budgets,
                kueue_ok=settings.preempt_kueue_pods,
                wait_s=settings.preemption_wait_s,
                now=self.clock.monotonic,
                kueue=self.kueue_namespaces,
                backoff=OwnerBackoff(settings.preemption_backoff_s),
            )
        self.scale_up = ScaleUp(
            kube,
            elector,
            self.state,
            settings.scale_up,
            settings.policy,
            self.catalog,
            self.clock,
            tell=self._event,
            instance=settings.instance,
        )
        if self.scale_up.on:
            self.placer.pendings = self.scale_up
        self._wake_placer = asyncio.Event()
        self._wake_timer = asyncio.Event()
        book = Bookkeeping(
            self.state,
            self.tracks,
            self.placer,
            metrics,
            self.clock,
            tell=self._event,
            after_change=self._after_change,
            kick=self.kick,
            wake_placer=self._wake_placer.set,
            wake_timer=self._wake_timer.set,
            withdraw_modes=lambda node, uuids: self.modes.set(node, {}, uuids),
        )
        writes = (
            ClaimWrites(kube, elector, self.clock, settings.instance, state=self.state)
            if settings.allocation_mode is AllocationMode.DRA
            else Writes(kube, elector, self.clock, settings.instance)
        )
        self.steps = Steps(
            writes,
            self.state,
            self.tracks,
            self.placer,
            metrics,
            self.clock,
            settings.pinned_unschedulable_timeout_s,
            settings.max_backoff_s,
            tell=self._event,
            after_change=self._after_change,
            make_room=self.scale_up.make_room,
            book=book,
        )
        self.modes = MigNodeWrites(self.steps.writes, self.state, self._spawn)
        self.work = KeyedQueue(self._work, name="allocator", clock=self.clock)
        self._tg: asyncio.TaskGroup | None = None
        self._seen_epoch = 0
        self._held_wake: float | None = None  # the placer's asks.wake the timer waits for
        self.pods_informer, self.lease_informer, self.informers = informers(
            kube, settings, self.handlers
        )

    @property
    def parked(self) -> dict[str, int]:
        """Pods parked as pending: uid → the generation they were parked at."""
        return self.tracks.parked

    # --- informers (every replica) ------------------------------------------------------

    async def watch(self) -> None:
        tasks = [asyncio.create_task(i.run(), name=f"informer-{i.name}") for i in self.informers]
        try:
            await asyncio.gather(*tasks)
        finally:
            await cancel_until_done(tasks)

    async def synced(self) -> None:
        for informer in self.informers:
            await informer.synced.wait()

    def _sweep_agents(self) -> None:
        self.agents.sweep()

    def kick(self, uid: str) -> None:
        """Look at this pod again (leading only: a standby keeps caches, not records)."""
        if uid and self._leading:
            self.work.kick(uid)

    def _after_change(self) -> None:
        """Capacity may have grown: give every parked pod another chance."""
        if self.state.epoch == self._seen_epoch:
            return
        self._seen_epoch = self.state.epoch
        for uid in self.tracks.take_parked():
            self.kick(uid)

    # --- leading ------------------------------------------------------------------------

    async def lead(self) -> None:
        """Act until cancelled (leadership lost or shutdown)."""
        await self.synced()
        await self._merge_allocations()
        self.metrics.leader.set(1)
        self.metrics.state_gauges.source = self._gauge_view
        await self.term(revisit=True)

    async def term(self, *, revisit: bool) -> None:
        """The loops of one leadership term, until cancelled. `revisit`: look at every pod
        InstaSlice places and every allocation's pod first (tests feed events by hand)."""
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                self._leading = True
                self.work.start(tg)
                if revisit:
                    self._revisit()
                tg.create_task(self._placement_loop(), name="placer")
                tg.create_task(self._timer_loop(), name="timer")
                tg.create_task(self._agents_loop(), name="agents")
                tg.create_task(self.scale_up.run(), name="scale-up")
        finally:
            self.step_down()

    def _revisit(self) -> None:
        ours = {a.pod_uid for a in self.state.allocations.values()}
        for pod in list(self.state.pods.values()):
            if pod.claim is not None:
                ours.add(pod.uid)
                track = self.tracks.ensure(pod.uid)
                if track.ungate_start is None and pod.gates == (GATE_NAME,):
                    # seen before this term: timed from its creation (whole seconds)
                    track.ungate_start = monotonic_at(self.clock, pod.created)
        for uid in sorted(ours):
            self.kick(uid)

    def step_down(self) -> None:
        """Forget everything that only makes sense while leading."""
        self._leading = False
        self._tg = None
        self.work.stop()
        self.placer.clear()
        self.tracks.end_term()
        creating = {
            t.creating_key for t in self.tracks.values() if t.creating and not t.creating.done()
        }
        self.state.drop_assumed(keep=creating)
        self.metrics.leader.set(0)
        self.metrics.state_gauges.source = lambda: None

    async def _merge_allocations(self) -> None:
        """Add allocations a previous leader may have written that our watch has not shown
        yet (a quorum list). Add-only: seeing too much is safe, too little is not."""
        listing = await self.kube.list(instaslice_path(SLICE_ALLOCATION_PLURAL))
        for item in listing.get("items", []):
            meta = item.get("metadata", {})
            if f"{meta.get('namespace')}/{meta.get('name')}" not in self.state.allocations:
                self.state.upsert_allocation(item)

    def close(self) -> None:
        """Shutting down: stop creates still in flight (their outcome no longer matters)."""
        for track in self.tracks.values():
            if track.creating is not None:
                track.creating.cancel()

    # --- one pod's worker ---------------------------------------------------------------

    async def _work(self, uid: str) -> float | None:
        """One pass for one pod: the next step, carried out (`steps.Steps.run`)."""
        track = self.tracks.ensure(uid)
        return await self.steps.run(track, next_step(track, self.handlers.seen(uid, track)))

    def _gauge_view(self) -> GaugeView:
        depth = len(self.placer.queue) + len(self.tracks.parked)
        return GaugeView(self.state, depth, self.tracks.pending_counts(), self.catalog)

    # --- loops --------------------------------------------------------------------------

    async def _placement_loop(self) -> None:
        while True:
            await self._wake_placer.wait()
            self._wake_placer.clear()
            self.placer.start_round()
            while self.placer.waiting():
                self.placer.place_queued()
                if self.placer.ampere.asks.wake != self._held_wake:  # a MIG mode change held back
                    self._wake_timer.set()
                await asyncio.sleep(0)  # let watch events and writes progress between pods
            if self.placer.rounds.deferred:  # plans a spent budget deferred: the next round
                self._wake_placer.set()

    async def _timer_loop(self) -> None:
        timeout = self.settings.pinned_unschedulable_timeout_s
        while True:
            deadline = self.tracks.next_deadline(timeout)
            wait = None if deadline is None else max(0.0, deadline - self.clock.monotonic())
            # a MIG mode change held back by --ampere-mode-change-interval: parked pods are
            # looked at again when it may be asked (a wall-clock time: the agent's)
            self._held_wake = self.placer.ampere.asks.wake
            if self._held_wake is not None:
                held = max(0.0, self._held_wake - self.clock.wall().timestamp())
                wait = held if wait is None else min(wait, held)
            await wait_or_sleep(self.clock, self._wake_timer, wait)
            self._wake_timer.clear()
            for uid in self.tracks.due(self.clock.monotonic(), timeout):
                self.kick(uid)
            wake = self.placer.ampere.asks.wake
            if wake is not None and self.clock.wall().timestamp() >= wake:
                self.placer.ampere.asks.wake = None
                for uid in self.tracks.take_parked():
                    self.kick(uid)

    async def _agents_loop(self) -> None:
        while True:
            self._sweep_agents()
            await self.agents.forget_gone_nodes(
                self.steps.writes, self.settings.namespace, self.settings.node_gone_grace_s
            )
            await self.clock.sleep(self.settings.agent_sweep_s)

    def _spawn(self, write: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """A MigNode write in the background, made only while leading."""
        if self._tg is not None and self._leading:
            self._tg.create_task(write())

    def _event(
        self, pod: Obj, reason: EventReason, message: str, type_: Literal["Normal", "Warning"]
    ) -> None:
        """An event written in the background, off the pod's critical path."""
        if self._tg is None:
            return
        self._tg.create_task(self.steps.writes.event(pod, reason, message, type_))
