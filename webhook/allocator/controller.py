"""The allocator's shell: it wires the parts and routes between them.

Informers (list, watch, re-list on 410; common.kubeapi) feed `ClusterState` through the
handlers (handlers.py) on every replica, so a standby has a warm cache. Only the Lease
holder acts (`lead`): one term at a time, it runs

- one worker per pod (common.workqueue.KeyedQueue: a pod's steps serialized, different
  pods in parallel), which reads the pod's record and the caches, asks the pure
  `track.next_step` what to do and hands the step to the one executor, `steps.Steps.run`
  (a failed step is retried after a backoff that doubles per failure);
- the placer's rounds, the pinned-unschedulable timer and the agents' sweep (loops.py),
  and the autoscaler signal's round (scaleup.py).

Every API write goes through the one `writes.Writes` built here (each Lease-checked).
What it deliberately does not do: talk to GPUs (the node agent does), retry on a clock
(pending pods wait for a relevant change), bind pods (the kube-scheduler does, once the pod
is pinned and ungated), or move allocations off a node whose agent is down once the agent
has acted on them (they complete when it returns; a deleted node releases them).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from common.catalog import load_catalog
from common.clock import cancel_until_done
from common.constants import EventReason
from common.kubeapi import Informer, Kube, Obj
from common.workqueue import KeyedQueue
from webhook.allocator.agents import AgentWatch
from webhook.allocator.bookkeeping import Bookkeeping
from webhook.allocator.handlers import Handlers, informers
from webhook.allocator.leader import LeaderElector
from webhook.allocator.loops import Loops
from webhook.allocator.maintenance import ASK_DRAIN
from webhook.allocator.metrics import AllocatorMetrics, GaugeView
from webhook.allocator.placer import Placer
from webhook.allocator.planning import PlanRounds
from webhook.allocator.preemption import Budgets, OwnerBackoff, PreemptionSettings, parse_selector
from webhook.allocator.scaleup import ScaleUp
from webhook.allocator.settings import AllocatorSettings
from webhook.allocator.state import ClusterState
from webhook.allocator.steps import Steps
from webhook.allocator.track import Tracks, next_step
from webhook.allocator.writes import EventType_, MigNodeWrites, Writes


class Controller:
    pods_informer: Informer
    lease_informer: Informer

    def __init__(
        self,
        kube: Kube,
        elector: LeaderElector,
        metrics: AllocatorMetrics,
        settings: AllocatorSettings,
    ) -> None:
        self.kube, self.elector, self.metrics, self.settings = kube, elector, metrics, settings
        self.clock = clock = settings.clock
        self.catalog = settings.catalog if settings.catalog is not None else load_catalog()
        self.state = state = ClusterState(
            self.catalog, avoid_creates_in_flight=settings.avoid_creates_in_flight
        )
        self.tracks = tracks = Tracks()
        self.writes = Writes(kube, elector, clock, settings.instance)  # the one writer
        self.modes = MigNodeWrites(self.writes, state, self._spawn)
        self.agents = AgentWatch(state, clock, self.kick, self._after_change)
        self.placer = placer = Placer(
            state,
            tracks,
            metrics,
            settings.policy,
            self.catalog,
            kick=self.kick,
            tell=lambda pod, reason, message: self._event(pod, reason, message, "Warning"),
        )
        if settings.ampere_mode_changes == ASK_DRAIN:
            ampere = placer.ampere
            ampere.ask_modes = lambda node, wants: self.modes.set(node, wants, set())
            ampere.withdraw_modes = lambda node, uuids: self.modes.set(node, {}, uuids)
            ampere.asks.min_interval_s = settings.ampere_mode_change_interval_s
            ampere.wall = lambda: clock.wall().timestamp()
        self.budgets = Budgets()
        placer.rounds = PlanRounds(settings.preemption_round_cpu_s)
        self._leading = False
        self.handlers = Handlers(
            state,
            tracks,
            clock,
            self.catalog,
            self.agents,
            self.budgets,
            placer.ampere,
            leading=lambda: self._leading,
            kick=self.kick,
            after_change=self._after_change,
            set_modes=self.modes.set,
            warn=self.modes.warn,
            leases_synced=lambda: self.lease_informer.synced.is_set(),
            # namespaces whose pods are Kueue-managed: the admin's selector on namespace
            # labels (never a pod's own label, which its owner could set: docs/kueue.md)
            kueue_selector=parse_selector(settings.kueue_namespace_selector),
        )
        self.opted_in = self.handlers.opted_in
        self.whole_gpu = self.handlers.whole_gpu
        self.kueue_namespaces = self.handlers.kueue_namespaces
        if settings.preemption:
            placer.preemption = PreemptionSettings(
                self.budgets,
                kueue_ok=settings.preempt_kueue_pods,
                wait_s=settings.preemption_wait_s,
                now=clock.monotonic,
                kueue=self.kueue_namespaces,
                backoff=OwnerBackoff(settings.preemption_backoff_s),
            )
        self.scale_up = ScaleUp(
            kube,
            self.writes,
            state,
            settings.scale_up,
            settings.policy,
            self.catalog,
            clock,
            tell=self._event,
        )
        if self.scale_up.on:
            placer.pendings = self.scale_up
        self.loops = Loops(tracks, placer, self.agents, self.writes, clock, settings, self.kick)
        book = Bookkeeping(
            state,
            tracks,
            placer,
            metrics,
            clock,
            tell=self._event,
            after_change=self._after_change,
            kick=self.kick,
            wake_placer=self.loops.wake_placer.set,
            wake_timer=self.loops.wake_timer.set,
            withdraw_modes=lambda node, uuids: self.modes.set(node, {}, uuids),
        )
        self.steps = Steps(
            self.writes,
            state,
            tracks,
            placer,
            metrics,
            clock,
            settings.pinned_unschedulable_timeout_s,
            settings.max_backoff_s,
            tell=self._event,
            after_change=self._after_change,
            make_room=self.scale_up.make_room,
            book=book,
        )
        self.work = KeyedQueue(self._work, name="allocator", clock=clock)
        self._tg: asyncio.TaskGroup | None = None
        self._seen_epoch = 0
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
        self.handlers.merge_allocations(await self.writes.list_allocations())
        self.metrics.leader.set(1)
        self.metrics.state_gauges.source = self._gauge_view
        await self.term(revisit=True)

    async def term(self, *, revisit: bool) -> None:
        """The loops of one leadership term, until cancelled. `revisit`: look at every pod
        InstaSlice places and every allocation's pod first (tests feed events by hand)."""
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                tg.create_task(self.scale_up.run(), name="scale-up")
                # the autoscaler signal's watches list first: a pin's make_room then reads
                # the signals as listed, never waiting for them (docs/autoscaling.md)
                await self.scale_up.listed()
                self._leading = True
                self.work.start(tg)
                if revisit:
                    self.handlers.revisit()
                tg.create_task(self.loops.placement(), name="placer")
                tg.create_task(self.loops.timer(), name="timer")
                tg.create_task(self.loops.agents_sweep(), name="agents")
        finally:
            self.step_down()

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

    def close(self) -> None:
        """Shutting down: stop creates still in flight (their outcome no longer matters)."""
        for track in self.tracks.values():
            if track.creating is not None:
                track.creating.cancel()

    # --- routes ---------------------------------------------------------------------------

    async def _work(self, uid: str) -> float | None:
        """One pass for one pod: the next step, carried out (`steps.Steps.run`)."""
        track = self.tracks.ensure(uid)
        return await self.steps.run(track, next_step(track, self.handlers.seen(uid, track)))

    def _gauge_view(self) -> GaugeView:
        depth = len(self.placer.queue) + len(self.tracks.parked)
        return GaugeView(self.state, depth, self.tracks.pending_counts(), self.catalog)

    def _spawn(self, write: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """A MigNode write in the background, made only while leading."""
        if self._tg is not None and self._leading:
            self._tg.create_task(write())

    def _event(self, pod: Obj, reason: EventReason, message: str, type_: EventType_) -> None:
        """An event written in the background, off the pod's critical path."""
        if self._tg is None:
            return
        self._tg.create_task(self.writes.event(pod, reason, message, type_))
