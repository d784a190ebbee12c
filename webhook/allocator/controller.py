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
from typing import Literal

import structlog

from common.catalog import GpuModel, load_catalog
from common.clock import cancel_until_done, monotonic_at, wait_or_sleep
from common.constants import (
    ENABLED_KEY,
    GATE_NAME,
    LEASE_API_VERSION,
    MIG_NODE_PAGE_SIZE,
    MIG_NODE_PLURAL,
    REASON_GPU_OUT_OF_BOUNDS,
    REASON_PENDING,
    SLICE_ALLOCATION_PLURAL,
    WHOLE_GPU_KEY,
    EventReason,
)
from common.kubeapi import (
    ApiError,
    EventType,
    Informer,
    Kube,
    Obj,
    core_path,
    group_path,
    identity,
    instaslice_path,
    lean,
)
from common.placeholders import is_placeholder
from common.placement.geometry import token
from common.placement.search import catalog_tables
from common.placement.tables import TableTooLarge, warm
from common.workqueue import KeyedQueue
from webhook.allocator import pods as podlib
from webhook.allocator.agents import AgentWatch
from webhook.allocator.leader import LeaderElector, NotLeader
from webhook.allocator.maintenance import ASK_DRAIN, spec_patch, withdrawals
from webhook.allocator.metrics import AllocatorMetrics, GaugeView
from webhook.allocator.placer import Placer, PreemptionSettings
from webhook.allocator.planning import PlanRounds
from webhook.allocator.preemption import Budgets, OwnerBackoff, parse_selector, selects
from webhook.allocator.scaleup import ScaleUp
from webhook.allocator.settings import AllocatorSettings
from webhook.allocator.state import ClusterState
from webhook.allocator.steps import Steps
from webhook.allocator.track import (
    AwaitVictims,
    Create,
    Dequeue,
    Evict,
    Forget,
    GiveUp,
    Kick,
    PodTrack,
    Queue,
    Seen,
    Settled,
    Tracks,
    Unserved,
    Unstick,
    UnstickPod,
    Wait,
    next_step,
)
from webhook.allocator.views import GpuView, gpus_of
from webhook.allocator.writes import Writes

log = structlog.get_logger("allocator")

_ACTIVE_POD_SELECTOR = "status.phase!=Succeeded,status.phase!=Failed"


def _warm_all(models: list[GpuModel]) -> None:
    """`tables.warm` each model (in a worker thread); one past the slot bound has no tables."""
    for model in models:
        try:
            warm(model)
        except TableTooLarge:
            continue


def _cached_pod(obj: Obj) -> Obj:
    return podlib.slim(lean(obj))


_FIRST_BACKOFF_S = 0.2


class Controller:
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
            self.placer.ask_modes = self._ask_modes
            self.placer.withdraw_modes = lambda node, uuids: self._set_modes(node, {}, uuids)
            self.placer.asks.min_interval_s = settings.ampere_mode_change_interval_s
            self.placer.wall = lambda: self.clock.wall().timestamp()
        self.budgets = Budgets()
        self.placer.rounds = PlanRounds(settings.preemption_round_cpu_s)
        # namespaces whose pods are Kueue-managed: the admin's selector on namespace labels
        # (never a pod's own label, which its owner could set: docs/kueue.md "Preemption")
        self.kueue_selector = parse_selector(settings.kueue_namespace_selector)
        self.kueue_namespaces: set[str] = set()
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
        )
        if self.scale_up.on:
            self.placer.pendings = self.scale_up
        self.steps = Steps(
            Writes(kube, elector, self.clock, settings.instance),
            self.state,
            self.placer,
            metrics,
            self.clock,
            settings.pinned_unschedulable_timeout_s,
            tell=self._event,
            after_change=self._after_change,
            make_room=self.scale_up.make_room,
        )
        self.work = KeyedQueue(self._work, name="allocator", clock=self.clock)
        self._leading = False
        self._tg: asyncio.TaskGroup | None = None
        self._seen_epoch = 0
        self._gone_since: dict[str, float] = {}  # MigNodes without a Node, since when
        self._wake_placer = asyncio.Event()
        self._wake_timer = asyncio.Event()
        self._held_wake: float | None = None  # the placer's asks.wake the timer waits for
        self.pods_informer = Informer(
            kube,
            core_path("pods"),
            self._on_pod,
            field_selector=_ACTIVE_POD_SELECTOR,
            name="pods",
            # every pod of the cluster is cached: of most, only what placement reads
            transform=_cached_pod,
        )
        leases = group_path(LEASE_API_VERSION, "leases", settings.namespace)
        self.lease_informer = Informer(kube, leases, self._on_lease, name="leases", transform=lean)
        # Nodes and MigNodes are parsed into `state` (NodeView, GpuView): their informers keep
        # only each object's identity, not the object (a MigNode is 83 KB in memory).
        self.informers = [
            self.pods_informer,
            Informer(
                kube,
                core_path("nodes"),
                self._on_node,
                label_selector=settings.node_selector,
                name="nodes",
                keep=identity,
            ),
            Informer(
                kube,
                instaslice_path(MIG_NODE_PLURAL),
                self._on_mig_node,
                name="mignodes",
                keep=identity,
                page_size=MIG_NODE_PAGE_SIZE,
            ),
            Informer(
                kube,
                instaslice_path(SLICE_ALLOCATION_PLURAL),
                self._on_allocation,
                name="sliceallocations",
            ),
            self.lease_informer,  # the node agents' heartbeats (and our own Lease, skipped)
            Informer(kube, core_path("namespaces"), self._on_namespace, name="namespaces"),
        ]
        if settings.preemption:  # which victims a PodDisruptionBudget protects
            pdbs = group_path("policy/v1", "poddisruptionbudgets")
            self.informers.append(Informer(kube, pdbs, self._on_pdb, name="pdbs"))
        self.opted_in: set[str] = set()  # namespaces labelled ENABLED_KEY=true
        self.whole_gpu: set[str] = set()  # namespaces labelled WHOLE_GPU_KEY=true

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

    async def _on_pod(self, etype: EventType, obj: Obj) -> None:
        if etype != "DELETED" and is_placeholder(obj):
            # a placeholder stands for demand: it must not hold a node's cpu in our model.
            # Recognised by all InstaSlice gives one, never by its label alone (tenants can
            # write labels: docs/security.md); and a removal is never skipped, so a pod seen
            # before still leaves the model and has its slices released
            return
        uid = podlib.uid(obj)
        if etype == "DELETED":
            self.state.remove_pod(obj)
            track = self.tracks.get(uid) if self._leading else None
            if track is not None:  # released without asking again (finished pods too)
                track.gone = "the pod finished" if podlib.is_terminal(obj) else "its pod is gone"
            elif not self._leading:
                self.tracks.forget(uid)
            if track is not None or self.state.allocations_of(uid):
                self.kick(uid)
        else:
            view = self.state.upsert_pod(obj)
            if self._leading and view.claim is not None:
                track = self.tracks.ensure(uid)
                fresh = track.ungate_start is None and track.pinned_rv is None
                if fresh and view.gates == (GATE_NAME,):  # ours became its only gate now
                    track.ungate_start = self.clock.monotonic()
            if view.claim is not None or self.tracks.get(uid) or self.state.allocations_of(uid):
                self.kick(uid)
        self._after_change()

    async def _on_allocation(self, etype: EventType, obj: Obj) -> None:
        view = (
            self.state.remove_allocation(obj)
            if etype == "DELETED"
            else self.state.upsert_allocation(obj)
        )
        if view is not None:
            self.kick(view.pod_uid)
            if etype == "DELETED":  # a pod may have been waiting for the name to free up
                waiting = self.state.pod_by_claim(view.namespace, view.name)
                if waiting is not None:
                    self.kick(waiting.uid)
                for uid in self.tracks.preempting():  # or for a victim's slots
                    self.kick(uid)
        self._after_change()

    async def _on_node(self, etype: EventType, obj: Obj) -> None:
        name = str(obj.get("metadata", {}).get("name", ""))
        if etype == "DELETED":
            self.state.remove_node(obj)
        else:
            self.state.upsert_node(obj)
        for alloc in self.state.allocations_on(name):
            self.kick(alloc.pod_uid)
        self._after_change()

    async def _on_mig_node(self, etype: EventType, obj: Obj) -> None:
        if etype == "DELETED":
            self.state.remove_mig_node(obj)
        else:
            name = str(obj["metadata"]["name"])
            gpus = gpus_of(obj, self.state.geometries)  # GPUs beyond the bounds: refused
            await self._warm(gpus)
            before = self.state.gpus.get(name, ())
            self.state.upsert_mig_node(obj, gpus)
            self._tell_refused(name, before, gpus)
            done = withdrawals(obj) if self.placer.ask_modes is not None else set()
            if done:  # the asked mode is reached, or the agent failed it: withdraw the ask
                self._set_modes(str(obj["metadata"]["name"]), {}, done)
                self.placer.asks.done(done)
            for uid in self.tracks.preempting():  # one may wait for a GPU's MIG mode
                self.kick(uid)
        self._after_change()

    async def _warm(self, gpus: tuple[GpuView, ...]) -> None:
        """Build the tables of the models these GPUs bring that placement has not met, in a
        worker thread: a new table (up to 2^16 occupancy masks, tables.MIG_MAX_MEMORY_SLOTS)
        must not stall admission and the Lease renewal on this loop. Placement then finds
        them built (tables.warm: what its first decision on such a GPU reads)."""
        ct = catalog_tables(self.catalog)
        fresh: dict[str, GpuModel] = {}
        for g in gpus:
            key = token(g.geometry) if g.geometry is not None else g.model
            model = g.geometry or self.catalog.model(g.model)
            if model is not None and not ct.known(key):
                fresh[key] = model
        if not fresh:
            return
        await asyncio.to_thread(_warm_all, list(fresh.values()))
        for key in fresh:
            ct.tables(key)  # built: only kept here, on the loop

    def _tell_refused(
        self, node: str, before: tuple[GpuView, ...], gpus: tuple[GpuView, ...]
    ) -> None:
        """A Warning event `GpuOutOfBounds` on the MigNode when the GPUs it refuses (or why)
        change; the gauge `instaslice_allocator_gpus_refused` and `kubectl instaslice nodes`
        show them meanwhile (docs/troubleshooting.md). Only the agent writes MigNode status,
        so this is no condition there (docs/security.md)."""
        now = [g for g in gpus if g.refused]
        if not now or {(g.uuid, g.refused) for g in now} == {
            (g.uuid, g.refused) for g in before if g.refused
        }:
            return
        message = "; ".join(f"GPU {g.index} ({g.uuid[:48]}): {g.refused}" for g in now)
        message += "; nothing is placed on it until its node agent publishes it within bounds"
        log.warning("MigNode GPUs beyond bounds, not used", node=node, why=message)
        if self._tg is not None and self._leading:
            writes = self.steps.writes
            self._tg.create_task(writes.mig_node_warning(node, REASON_GPU_OUT_OF_BOUNDS, message))

    def _ask_modes(self, node: str, wants: dict[str, str]) -> None:
        self._set_modes(node, wants, set())

    def _set_modes(self, node: str, add: dict[str, str], drop: set[str]) -> None:
        """MigNode `node`'s desiredMigMode entries, written in the background (leader only)."""
        if self._tg is None or not self._leading:
            return
        current = {g.uuid: g.desired for g in self.state.gpus.get(node, ()) if g.desired}
        body = spec_patch(current, add, drop)
        self._tg.create_task(self._write_modes(node, body))

    async def _write_modes(self, node: str, body: Obj) -> None:
        try:
            await self.steps.writes.set_desired_modes(node, body)
        except ApiError as exc:  # the next MigNode event or pending pod asks again
            log.warning("could not write desired MIG modes", node=node, error=str(exc))

    async def _on_namespace(self, etype: EventType, obj: Obj) -> None:
        """Only opted-in namespaces are served: a pod carrying InstaSlice's marks elsewhere
        (the admission policy refuses to create one; this is the second line) is not placed;
        nor is a pod asking for whole GPUs in a namespace that did not opt in to them."""
        meta = obj.get("metadata") or {}
        name = str(meta.get("name") or "")
        labels = meta.get("labels") or {}
        kueue = self.kueue_selector is not None and etype != "DELETED"
        if kueue and selects(self.kueue_selector or {}, labels):
            self.kueue_namespaces.add(name)
        else:
            self.kueue_namespaces.discard(name)
        changed = False
        for key, names in ((ENABLED_KEY, self.opted_in), (WHOLE_GPU_KEY, self.whole_gpu)):
            on = etype != "DELETED" and labels.get(key) == "true"
            if on != (name in names):
                changed = True
                if on:
                    names.add(name)
                else:
                    names.discard(name)
        if not changed:
            return
        for pod in list(self.state.pods.values()):
            if pod.namespace == name and pod.claim is not None:
                self.kick(pod.uid)

    async def _on_pdb(self, etype: EventType, obj: Obj) -> None:
        if etype == "DELETED":
            self.budgets.remove(obj)
        else:
            self.budgets.upsert(obj)

    async def _on_lease(self, etype: EventType, obj: Obj) -> None:
        await self.agents.on_lease(etype, obj, initial=not self.lease_informer.synced.is_set())

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

    def _seen(self, uid: str, track: PodTrack | None = None) -> Seen:
        pod = self.state.pods.get(uid)
        alive: frozenset[str] = frozenset()
        holding: frozenset[str] = frozenset()
        pending = False
        p = track.preempt if track is not None else None
        if p is not None:
            pods = [self.state.pods.get(v.uid) for v in p.victims]
            alive = frozenset(v.uid for v in pods if v and not (v.deleting or v.terminal))
            holding = frozenset(u for u in p.waits_for if self.state.allocations_of(u))
            modes = [self.state.gpu(n, i) for n, i in p.resets]
            pending = any(g is None or g.maintenance or g.whole_if_idle != "off" for g in modes)
        allocs = tuple(self.state.allocations_of(uid))
        holder = None
        if pod is not None and pod.claim is not None and not allocs:
            other = self.state.allocations.get(f"{pod.namespace}/{pod.claim}")
            holder = other.pod_uid if other is not None else None
        return Seen(
            pod=pod,
            allocations=allocs,
            assumed=frozenset(a.key for a in allocs if self.state.is_assumed(a.key)),
            nodes=frozenset(a.node for a in allocs if a.node in self.state.nodes),
            agents_down=frozenset(a.node for a in allocs if a.node in self.state.agents_down),
            name_holder=holder,
            opted_in=pod is not None and pod.namespace in self.opted_in,
            whole_gpu=pod is not None and pod.namespace in self.whole_gpu,
            victims_alive=alive,
            holding=holding,
            modes_pending=pending,
            now=self.clock.monotonic(),
        )

    async def _work(self, uid: str) -> float | None:
        """One pass for one pod: the next step, carried out. A failed step is retried after
        a backoff (doubling per failure, capped); a kick in between tries it at once."""
        track = self.tracks.ensure(uid)
        step = next_step(track, self._seen(uid, track))
        if track.unstick is Unstick.DUE and not isinstance(step, UnstickPod):
            track.unstick = Unstick.DONE  # no longer applicable (UnstickPod says when it is done)
        match step:
            case Wait():
                return None
            case Forget():
                if track.create is not None:  # decided, but the pod left before the create
                    meta = track.create["metadata"]
                    self.state.forget(f"{meta['namespace']}/{meta['name']}")
                    self._after_change()
                self.tracks.forget(uid)
                self.placer.queue.remove(uid)
                self.placer.release_asks(uid)  # a MIG mode change it alone needed is withdrawn
                return None
            case Dequeue():
                self.placer.queue.remove(uid)
                self.tracks.unpark(track)
                self.placer.release_asks(uid)
                return None
            case Unserved(pod, reason, message):
                self.placer.queue.remove(uid)
                self.tracks.unpark(track)
                if track.told != reason:
                    track.told = reason
                    log.info("pod not served", pod=pod.key, reason=reason, message=message)
                    self._event(pod.obj, REASON_PENDING, message, "Warning")
                return None
            case Queue(pod):
                self.tracks.unpark(track)
                self.placer.queue.push(uid, priority=pod.priority, created=pod.created, key=pod.key)
                self._wake_placer.set()
                return None
            case AwaitVictims(deadline):
                return max(0.0, deadline - self.clock.monotonic())  # then gives up
            case GiveUp(why, avoid, refused):
                self._give_up(track, why, avoid, refused)
                self.kick(uid)
                return None
            case Kick(other):
                self.kick(other)  # a stale record holds the name: release it first
                return None
            case Settled(waiting):
                self.placer.queue.remove(uid)
                self.tracks.unpark(track)
                track.told = None
                self.tracks.observe_unschedulable(track, waiting, self.clock.monotonic())
                if waiting:
                    self._wake_timer.set()
                return None
        if isinstance(step, Create) and track.preempt is not None:
            self.tracks.end_preempt(track)  # the reservation is sent: an ordinary create now
        try:
            await self.steps.run(track, step)
        except NotLeader:
            # The Lease went unrenewed past the deadline. If it is lost for good this term
            # is about to be cancelled; if a late renewal keeps it, the step runs again.
            pass
        except ApiError as exc:
            log.warning("allocator write failed", pod_uid=uid, error=str(exc))
            self.metrics.outcome("error")
        except Exception:
            log.exception("allocator step failed", pod_uid=uid)
        else:
            track.backoff_s = 0.0
            if isinstance(step, Evict):  # a refusal changes nothing watched; a wait has a deadline
                return 0.0
            return None  # what comes next is told by the watch events the write causes
        track.backoff_s = min(
            max(track.backoff_s * 2, _FIRST_BACKOFF_S), self.settings.max_backoff_s
        )
        return track.backoff_s

    def _give_up(
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
            self._set_modes(node, {}, uuids)
        self.metrics.outcome("preemption_abandoned")
        log.info("preemption given up", pod_uid=track.uid, why=why, avoid=len(avoid),
                 refused=len(refused))  # fmt: skip
        self._after_change()

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
                if self.placer.asks.wake != self._held_wake:  # a MIG mode change held back
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
            self._held_wake = self.placer.asks.wake
            if self._held_wake is not None:
                held = max(0.0, self._held_wake - self.clock.wall().timestamp())
                wait = held if wait is None else min(wait, held)
            await wait_or_sleep(self.clock, self._wake_timer, wait)
            self._wake_timer.clear()
            for uid in self.tracks.due(self.clock.monotonic(), timeout):
                self.kick(uid)
            wake = self.placer.asks.wake
            if wake is not None and self.clock.wall().timestamp() >= wake:
                self.placer.asks.wake = None
                for uid in self.tracks.take_parked():
                    self.kick(uid)

    async def _agents_loop(self) -> None:
        while True:
            self._sweep_agents()
            await self._forget_gone_nodes()
            await self.clock.sleep(self.settings.agent_sweep_s)

    async def _forget_gone_nodes(self) -> None:
        """A MigNode whose Node has been gone for the grace period (the node was removed for
        good) is deleted, with its agent's Lease; a node back within it keeps them."""
        now = self.clock.monotonic()
        gone = set(self.state.gpus) - set(self.state.nodes)
        for name in [n for n in self._gone_since if n not in gone]:
            del self._gone_since[name]
        for name in sorted(gone):
            since = self._gone_since.setdefault(name, now)
            if now - since < self.settings.node_gone_grace_s:
                continue
            del self._gone_since[name]  # looked at again after another grace if it stays
            try:
                if await self.steps.writes.forget_node(name, self.settings.namespace):
                    log.info("node gone; its MigNode and agent Lease deleted", node=name)
            except ApiError as exc:
                log.warning("could not delete a gone node's records", node=name, error=str(exc))

    def _event(
        self, pod: Obj, reason: EventReason, message: str, type_: Literal["Normal", "Warning"]
    ) -> None:
        """An event written in the background, off the pod's critical path."""
        if self._tg is None:
            return
        self._tg.create_task(self.steps.writes.event(pod, reason, message, type_))
