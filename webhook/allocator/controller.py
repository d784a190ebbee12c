"""The allocator loop: watched objects in, SliceAllocations and pod pins out.

Informers (list, watch, re-list on 410; common.kubeapi) feed `ClusterState` on every
replica, so a standby has a warm cache. Only the Lease holder acts (`lead`); every write
checks the Lease first. Three coroutines run while leading:

- the reconciler: level-triggered, per pod uid; decides from the cached pod and its
  allocations what the next step is (queue for placement, pin, release, finalize) and runs
  it as one task per pod, so each pod's steps are serialized and different pods proceed in
  parallel;
- the placer: pops gated pods in priority order and, for each, snapshot → place → assume →
  create (STYLE.md §3). Pods that do not fit are parked with their reason and requeued only
  when `ClusterState.epoch` says capacity may have grown;
- the timer: for pinned pods the scheduler cannot bind (`pinned_unschedulable_timeout_s`),
  and a sweep every `agent_sweep_s` that leaves out of placement the nodes whose agent has
  not renewed its Lease for the Lease's duration (a pod placed there would wait for an agent
  that may never come back); a renewal seen brings the node back and retries parked pods.
  Both on the injected clock.

What it deliberately does not do: talk to GPUs (the node agent does), retry on a clock
(write errors back off per pod; pending pods wait for a relevant change), bind pods
(the kube-scheduler does, once the pod is pinned and ungated), or move allocations off a
node whose agent is down once the agent has acted on them (they complete when it returns; a
node that is deleted releases them). One it never acted on (no status) is dropped and its
pod placed again.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Coroutine
from typing import Any, Literal

import structlog

from common.catalog import Catalog, load_catalog
from common.constants import (
    AGENT_LEASE_DURATION_S,
    GATE_NAME,
    MIG_NODE_PLURAL,
    NODEAGENT_COMPONENT,
    REASON_ALLOCATED,
    REASON_PENDING,
    REASON_PINNED_UNSCHEDULABLE,
    SLICE_ALLOCATION_PLURAL,
)
from common.kubeapi import (
    ApiError,
    EventType,
    Informer,
    Kube,
    Obj,
    core_path,
    group_path,
    instaslice_path,
)
from common.objects import Phase
from common.placement import Pending, Policy, place
from common.podspec import SliceRequestError
from webhook.allocator import pods as podlib
from webhook.allocator.clock import Clock, cancel_until_done, parse_time, wait_or_sleep
from webhook.allocator.leader import LeaderElector, NotLeader
from webhook.allocator.metrics import AllocatorMetrics, GaugeView
from webhook.allocator.queue import (
    AgentLeases,
    PendingTracker,
    PlacementQueue,
    UnschedulableTracker,
)
from webhook.allocator.state import SUMMARY_ANNOTATION, AllocView, ClusterState, PodView
from webhook.allocator.writes import Writes

log = structlog.get_logger("allocator")

INVALID_REQUEST = "InvalidRequest"
WRITE_ERROR = "WriteError"
INTERNAL_ERROR = "InternalError"
AGENT_DOWN = "NodeAgentDown"  # every MIG node is left out: no node agent renews its Lease
_ACTIVE_POD_SELECTOR = "status.phase!=Succeeded,status.phase!=Failed"
_AGENT_HOLDER = f"{NODEAGENT_COMPONENT}/"


class Controller:
    def __init__(
        self,
        kube: Kube,
        elector: LeaderElector,
        clock: Clock,
        metrics: AllocatorMetrics,
        *,
        policy: Policy = Policy.INSTASLICE,
        catalog: Catalog | None = None,
        pinned_unschedulable_timeout_s: float = 60.0,
        max_backoff_s: float = 30.0,
        node_selector: str | None = None,
        agent_namespace: str | None = None,
        agent_sweep_s: float = 5.0,
    ) -> None:
        self.kube = kube
        self.elector = elector
        self.clock = clock
        self.metrics = metrics
        self.policy = policy
        self.catalog = catalog if catalog is not None else load_catalog()
        self.timeout_s = pinned_unschedulable_timeout_s
        self.max_backoff_s = max_backoff_s
        self.writes = Writes(kube, elector, clock)
        self.state = ClusterState()
        self.queue = PlacementQueue()
        self.parked: dict[str, int] = {}  # pending pod uid -> metadata.generation parked at
        self.pending = PendingTracker()
        self.unschedulable = UnschedulableTracker()
        self.agents = AgentLeases()
        self.agent_sweep_s = agent_sweep_s
        self.failed_gpus: dict[str, set[tuple[str, str]]] = {}  # uid -> (node, gpu uuid)
        # When ours became the pod's only gate, on the monotonic clock (time-to-ungate metric).
        self.ungate_start: dict[str, float] = {}
        self._backoff: dict[str, float] = {}
        self._dirty: set[str] = set()
        self._busy: dict[str, asyncio.Task[None]] = {}
        self._retouch: set[str] = set()
        self._unstick_due: set[str] = set()
        self._inflight: dict[str, asyncio.Future[Obj]] = {}  # allocation key -> its create
        self._pinned: set[str] = set()  # pod uids this replica ungated
        self._seen_epoch = 0
        self._tg: asyncio.TaskGroup | None = None
        self._wake_reconcile = asyncio.Event()
        self._wake_placer = asyncio.Event()
        self._wake_timer = asyncio.Event()
        self.informers = [
            Informer(
                kube,
                core_path("pods"),
                self._on_pod,
                field_selector=_ACTIVE_POD_SELECTOR,
                name="pods",
            ),
            Informer(
                kube, core_path("nodes"), self._on_node, label_selector=node_selector, name="nodes"
            ),
            Informer(kube, instaslice_path(MIG_NODE_PLURAL), self._on_mig_node, name="mignodes"),
            Informer(
                kube,
                instaslice_path(SLICE_ALLOCATION_PLURAL),
                self._on_allocation,
                name="sliceallocations",
            ),
        ]
        self._lease_informer: Informer | None = None
        if agent_namespace is not None:  # the node agents' Leases (and our own, skipped)
            leases = group_path("coordination.k8s.io/v1", "leases", agent_namespace)
            self._lease_informer = Informer(kube, leases, self._on_lease, name="leases")
            self.informers.append(self._lease_informer)

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
        uid = podlib.uid(obj)
        if etype == "DELETED":
            self.state.remove_pod(obj)
        else:
            if uid not in self.ungate_start and podlib.only_our_gate(obj):
                self.ungate_start[uid] = self._since(podlib.created(obj), self.informers[0])
            self.state.upsert_pod(obj)
        self._touch(uid)
        self._after_change()

    async def _on_allocation(self, etype: EventType, obj: Obj) -> None:
        view = (
            self.state.remove_allocation(obj)
            if etype == "DELETED"
            else self.state.upsert_allocation(obj)
        )
        if view is not None:
            self._touch(view.pod_uid)
            if etype == "DELETED":  # a pod may have been waiting for the name to free up
                waiting = self.state.pod_by_claim(view.namespace, view.name)
                if waiting is not None:
                    self._touch(waiting.uid)
        self._after_change()

    async def _on_node(self, etype: EventType, obj: Obj) -> None:
        name = str(obj.get("metadata", {}).get("name", ""))
        if etype == "DELETED":
            self.state.remove_node(obj)
        else:
            self.state.upsert_node(obj)
        for alloc in self.state.allocations_on(name):
            self._touch(alloc.pod_uid)
        self._after_change()

    async def _on_mig_node(self, etype: EventType, obj: Obj) -> None:
        if etype == "DELETED":
            self.state.remove_mig_node(obj)
        else:
            self.state.upsert_mig_node(obj)
        self._after_change()

    async def _on_lease(self, etype: EventType, obj: Obj) -> None:
        spec = obj.get("spec") or {}
        if not str(spec.get("holderIdentity") or "").startswith(_AGENT_HOLDER):
            return  # not a node agent's heartbeat (e.g. the allocator's own Lease)
        node = str(obj.get("metadata", {}).get("name", ""))
        if etype == "DELETED":
            self.agents.forget(node)  # no heartbeat at all reads as unknown, not down
        else:
            renew = str(spec.get("renewTime") or "")
            duration = float(spec.get("leaseDurationSeconds") or AGENT_LEASE_DURATION_S)
            self.agents.observe(node, renew, duration, self._since(renew, self._lease_informer))
        now = self.clock.monotonic()
        if not self.agents.is_expired(node, now) and self.state.set_agent_down(node, False):
            log.info("node agent back; node offered to placement again", node=node)
            self._after_change()

    def _sweep_agents(self) -> None:
        now = self.clock.monotonic()
        expired = self.agents.expired(now)
        for node in sorted(expired - self.state.agents_down):
            self.state.set_agent_down(node, True)
            for alloc in self.state.allocations_on(node):
                self._touch(alloc.pod_uid)  # an untouched one moves elsewhere
            silent = self.agents.silent_s(node, now) or 0.0
            log.warning(
                "node agent's Lease not renewed; node left out of placement",
                node=node,
                silent_s=round(silent, 1),
            )
        # no revival here: a renewal (or a deleted Lease) is seen by _on_lease at once

    def _since(self, stamp: str | None, informer: Informer | None) -> float:
        """Now, or — for objects found by `informer`'s initial list — `stamp` (a creation
        or renewal time), as monotonic time."""
        now = self.clock.monotonic()
        when = parse_time(stamp)
        if informer is None or informer.synced.is_set() or when is None:
            return now
        return now - max(0.0, (self.clock.wall() - when).total_seconds())

    def _touch(self, uid: str) -> None:
        if uid:
            self._dirty.add(uid)
            self._wake_reconcile.set()

    def _after_change(self) -> None:
        """Capacity may have grown: give every parked pod another chance."""
        if self.state.epoch == self._seen_epoch:
            return
        self._seen_epoch = self.state.epoch
        for uid in list(self.parked):
            self._touch(uid)
        self.parked.clear()

    # --- leading ------------------------------------------------------------------------

    async def lead(self) -> None:
        """Act until cancelled (leadership lost or shutdown)."""
        await self.synced()
        await self._merge_allocations()
        self._dirty.update(self.state.pods)
        self._dirty.update(a.pod_uid for a in self.state.allocations.values())
        self._wake_reconcile.set()
        self.metrics.leader.set(1)
        self.metrics.state_gauges.source = self._gauge_view
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                tg.create_task(self._reconcile_loop(), name="reconciler")
                tg.create_task(self._placement_loop(), name="placer")
                tg.create_task(self._timer_loop(), name="timer")
                tg.create_task(self._agents_loop(), name="agents")
        finally:
            self.step_down()

    def step_down(self) -> None:
        """Forget everything that only makes sense while leading."""
        self._tg = None
        self._busy.clear()
        self._retouch.clear()
        self._backoff.clear()
        self.queue.clear()
        self.parked.clear()
        self.pending.clear_all()  # an event the term's end cut off is told by the next term
        self.state.drop_assumed(keep=self._inflight)
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

    def _spawn(self, uid: str, coro: Coroutine[Any, Any, None]) -> None:
        assert self._tg is not None
        task = self._tg.create_task(self._run(uid, coro), name=f"pod-{uid}")
        # A task cancelled before it ran (the term ended) never awaited `coro`: close it.
        task.add_done_callback(lambda _: coro.close())
        self._busy[uid] = task

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        if self._tg is None:
            coro.close()
            return
        self._tg.create_task(coro)

    async def _run(self, uid: str, coro: Coroutine[Any, Any, None]) -> None:
        """One step for one pod. A failed step keeps the pod busy for its backoff (doubling
        per failure, capped), then the pod is reconciled again from the cache."""
        retry = False
        try:
            try:
                await coro
                self._backoff.pop(uid, None)
            except NotLeader:
                # The Lease went unrenewed past the deadline. If it is lost for good this
                # term is about to be cancelled; if a late renewal keeps it, the step must
                # run again rather than be forgotten.
                retry = True
            except ApiError as exc:
                log.warning("allocator write failed", pod_uid=uid, error=str(exc))
                self.metrics.outcome("error")
                retry = True
            except Exception:
                log.exception("allocator step failed", pod_uid=uid)
                retry = True
            if retry:
                delay = min(self._backoff.get(uid, 0.1) * 2, self.max_backoff_s)
                self._backoff[uid] = delay
                await self.clock.sleep(delay)
        finally:
            self._busy.pop(uid, None)
        if retry or uid in self._retouch:
            self._retouch.discard(uid)
            self._touch(uid)

    # --- the reconciler -----------------------------------------------------------------

    async def _reconcile_loop(self) -> None:
        while True:
            await self._wake_reconcile.wait()
            self._wake_reconcile.clear()
            batch, self._dirty = self._dirty, set()
            for uid in sorted(batch):
                try:
                    self._reconcile(uid)
                except Exception:  # as in the placer: one pod's bug must not stop all pods
                    log.exception("reconcile failed; retried on the pod's next change", pod_uid=uid)
            await asyncio.sleep(0)

    def _reconcile(self, uid: str) -> None:
        if uid in self._busy:
            self._retouch.add(uid)
            return
        pod = self.state.pods.get(uid)
        if uid in self._unstick_due:
            self._unstick_due.discard(uid)
            if pod is not None and not pod.bound and GATE_NAME not in pod.gates:
                self._spawn(uid, self._unstick(pod))
                return
        allocs = self.state.allocations_of(uid)
        for alloc in allocs:
            step = self._allocation_step(pod, alloc)
            if step is not None:
                self._spawn(uid, step)
                return
        if pod is None:
            self._forget_pod(uid)
            return
        if pod.claim is None or pod.terminal:
            return
        if GATE_NAME in pod.gates:
            self.unschedulable.forget(uid)
            self._reconcile_gated(pod, allocs)
            return
        self.queue.remove(uid)
        self.parked.pop(uid, None)
        self.pending.clear(uid)
        waiting = pod.unschedulable and not pod.bound and not pod.deleting
        self.unschedulable.observe(uid, waiting, self.clock.monotonic())
        if waiting:
            self._wake_timer.set()

    def _allocation_step(
        self, pod: PodView | None, alloc: AllocView
    ) -> Coroutine[Any, Any, None] | None:
        if alloc.assumed:
            return None  # its create is in flight
        if alloc.node not in self.state.nodes:
            if alloc.finalizer or not alloc.deleting:
                return self._finalize(alloc)
            return None
        if alloc.deleting:
            return None  # the node agent destroys the slices and drops the finalizer
        if pod is None:
            return self._release_orphan(alloc)
        if pod.terminal:
            return self._release(alloc, "the pod finished")
        if pod.claim != alloc.name:
            return self._release(alloc, "the pod no longer carries this claim")
        if alloc.failed:
            return self._release_failed(alloc)
        if alloc.node in self.state.agents_down and alloc.phase == Phase.PENDING.value:
            return self._move_off_down_node(alloc)
        return None

    def _reconcile_gated(self, pod: PodView, allocs: list[AllocView]) -> None:
        uid = pod.uid
        if pod.gates != (GATE_NAME,) or pod.deleting:
            self.queue.remove(uid)  # another gate goes first (e.g. Kueue's)
            self.parked.pop(uid, None)
            return
        if not allocs:
            other = self.state.allocations.get(f"{pod.namespace}/{pod.claim}")
            if other is not None:
                self._touch(other.pod_uid)  # a stale record holds the name: release it first
                return
            generation = int(pod.obj.get("metadata", {}).get("generation") or 0)
            if self.parked.get(uid) == generation:
                return  # pending; waits for capacity to grow
            self.parked.pop(uid, None)
            self.queue.push(uid, priority=pod.priority, created=pod.created, key=pod.key)
            self._wake_placer.set()
            return
        self.queue.remove(uid)
        ready = [a for a in allocs if a.ready and not a.assumed and a.name == pod.claim]
        if ready and uid not in self._pinned:  # pinned already: the watch has not caught up
            self._spawn(uid, self._pin(pod, ready[0]))

    def _forget_pod(self, uid: str) -> None:
        self._pinned.discard(uid)
        self.queue.remove(uid)
        self.parked.pop(uid, None)
        self.pending.clear(uid)
        self.unschedulable.forget(uid)
        self.failed_gpus.pop(uid, None)
        self.ungate_start.pop(uid, None)
        self._backoff.pop(uid, None)

    def _gauge_view(self) -> GaugeView:
        depth = len(self.queue) + len(self.parked)
        return GaugeView(self.state, depth, self.pending.counts(), self.catalog)

    # --- the placer ---------------------------------------------------------------------

    async def _placement_loop(self) -> None:
        while True:
            await self._wake_placer.wait()
            self._wake_placer.clear()
            while (uid := self.queue.pop()) is not None:
                try:
                    self._decide(uid)
                except Exception:  # a bug met by one pod must not stop the allocator for all
                    log.exception("placement failed; pod parked", pod_uid=uid)
                    pod = self.state.pods.get(uid)
                    if pod is not None:
                        self._park(pod, INTERNAL_ERROR, "placement failed inside the allocator")
                await asyncio.sleep(0)  # let watch events and writes progress between pods

    def _decide(self, uid: str) -> None:
        pod = self.state.pods.get(uid)
        if uid in self._busy:
            self._retouch.add(uid)
            return
        if pod is None or pod.gates != (GATE_NAME,) or pod.deleting or pod.claim is None:
            return
        if (
            self.state.allocations_of(uid)
            or f"{pod.namespace}/{pod.claim}" in self.state.allocations
        ):
            return
        try:
            request = podlib.pod_request(pod.obj, pod.resources)
        except SliceRequestError as exc:
            self._park(pod, INVALID_REQUEST, f"cannot read the pod's slice requests: {exc}")
            return
        if not request.slices:
            return
        name_label = podlib.uses_name_field(pod.obj)
        excluded = self.failed_gpus.get(uid, set())
        result = place(
            self.state.snapshot(exclude=excluded, name_label=name_label),
            request,
            self.policy,
            self.catalog,
        )
        if isinstance(result, Pending) and excluded:
            # No other GPU will do: trying the one that failed again beats waiting forever.
            self.failed_gpus.pop(uid, None)
            result = place(
                self.state.snapshot(name_label=name_label), request, self.policy, self.catalog
            )
        if isinstance(result, Pending):
            self._park(pod, *self._pending_reason(result))
            return
        body = self.state.allocation_for(pod, result)
        self.state.assume(body)
        self.pending.clear(uid)
        self._spawn(uid, self._create(pod, body))

    def _pending_reason(self, result: Pending) -> tuple[str, str]:
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

    def _park(self, pod: PodView, reason: str, message: str) -> None:
        self.parked[pod.uid] = int(pod.obj.get("metadata", {}).get("generation") or 0)
        self.metrics.outcome("pending")
        if self.pending.observe(pod.uid, reason):  # the event waits out a late renewal
            log.info("pod pending", pod=pod.key, reason=reason, message=message)
            self._event(pod.obj, REASON_PENDING, message, "Warning")

    # --- steps (one task per pod; the writes themselves are in writes.py) ----------------

    async def _create(self, pod: PodView, body: Obj) -> None:
        key = f"{pod.namespace}/{body['metadata']['name']}"
        # The write is not a child of this term: a term that ends (Lease lost, then perhaps
        # won back at once) must not cut a create whose outcome it then could not know, or
        # the next term could promise the same slots while the request still lands. The
        # assumed record stays until the write's own outcome settles it (`_created`).
        write = asyncio.ensure_future(self.writes.create_allocation(body))
        self._inflight[key] = write
        write.add_done_callback(functools.partial(self._created, key))
        try:
            await asyncio.shield(write)
        except (ApiError, NotLeader) as exc:
            if isinstance(exc, ApiError) and exc.conflict:
                return  # it exists (another replica's, or ours before a restart): watch shows it
            if isinstance(exc, ApiError) and not exc.retryable:
                self.metrics.outcome("error")
                log.error("allocation refused", pod=pod.key, error=str(exc))
                self._park(pod, WRITE_ERROR, f"the SliceAllocation was refused: {exc.message}")
                return
            raise
        self.metrics.outcome("allocated")
        annotations = body["metadata"]["annotations"]
        message = f"node {body['spec']['nodeName']}: {annotations[SUMMARY_ANNOTATION]}"
        self._event(pod.obj, REASON_ALLOCATED, message, "Normal")  # off the pod's critical path

    def _created(self, key: str, write: asyncio.Future[Obj]) -> None:
        """Settle an assumed allocation by its create's outcome, whatever term it is now."""
        self._inflight.pop(key, None)
        if not write.cancelled() and write.exception() is None:
            self.state.confirm(write.result())
            return
        self.state.forget(key)
        self._after_change()

    def close(self) -> None:
        """Shutting down: stop creates still in flight (their outcome no longer matters)."""
        for write in list(self._inflight.values()):
            write.cancel()

    async def _pin(self, pod: PodView, alloc: AllocView) -> None:
        if not await self.writes.pin(pod.obj, alloc.node):
            return
        self._pinned.add(pod.uid)  # gates cannot come back: never pin this pod again
        start = self.ungate_start.pop(pod.uid, None)
        if start is not None:
            self.metrics.time_to_ungate.observe(max(0.0, self.clock.monotonic() - start))
        log.info("pod pinned", pod=pod.key, node=alloc.node, claim=alloc.name)

    async def _release(self, alloc: AllocView, why: str) -> None:
        log.info("releasing allocation", allocation=alloc.key, why=why)
        await self.writes.delete_allocation(alloc)
        self.state.mark_deleting(alloc)
        self.metrics.outcome("released")

    async def _release_orphan(self, alloc: AllocView) -> None:
        """The cache has no such pod. Ask the API server before believing it."""
        if await self.writes.pod_alive(alloc):
            return  # our cache lags; the pod's watch event will arrive
        await self._release(alloc, "its pod is gone")

    async def _release_failed(self, alloc: AllocView) -> None:
        message = str(alloc.obj.get("status", {}).get("message") or "no message")
        log.warning("allocation failed", allocation=alloc.key, node=alloc.node, message=message)
        self.failed_gpus.setdefault(alloc.pod_uid, set()).update(
            (alloc.node, s.gpu_uuid) for s in alloc.slices
        )
        self.metrics.outcome("failed")
        await self._release(alloc, f"the node agent failed it: {message}")

    async def _move_off_down_node(self, alloc: AllocView) -> None:
        """The node's agent is down and never acted on this allocation, so nothing was made
        for it: drop the record without the agent, and the pod (still gated: it is pinned
        only once Ready) is placed again, on a node with a running agent."""
        if not await self.writes.drop_finalizer_if_untouched(alloc):
            return  # the agent wrote a status after all (it finishes or releases it), or gone
        log.warning(
            "allocation on a node whose agent is down moved", allocation=alloc.key, node=alloc.node
        )
        await self.writes.delete_allocation(alloc)
        self.metrics.outcome("released")

    async def _finalize(self, alloc: AllocView) -> None:
        """The node is gone, so nothing is left to destroy: finish the record ourselves."""
        if await self.writes.node_exists(alloc.node):
            return  # it exists after all; the node watch will say so
        current = await self.writes.drop_finalizer(alloc)
        if current is None:
            return
        log.info("finalized allocation of a deleted node", allocation=alloc.key, node=alloc.node)
        if not current.get("metadata", {}).get("deletionTimestamp"):
            await self.writes.delete_allocation(AllocView.of(current))
        self.metrics.outcome("released")

    # --- pinned but unschedulable -------------------------------------------------------

    async def _timer_loop(self) -> None:
        while True:
            deadline = self.unschedulable.next_deadline(self.timeout_s)
            wait = None if deadline is None else max(0.0, deadline - self.clock.monotonic())
            await wait_or_sleep(self.clock, self._wake_timer, wait)
            self._wake_timer.clear()
            for uid in self.unschedulable.due(self.clock.monotonic(), self.timeout_s):
                self._unstick_due.add(uid)
                self._touch(uid)

    async def _agents_loop(self) -> None:
        while True:
            self._sweep_agents()
            await self.clock.sleep(self.agent_sweep_s)

    async def _unstick(self, pod: PodView) -> None:
        """CONTRACT.md §4 step 4: release the slices; a controller recreates its pod."""
        node = pod.node or "its node"
        cause = _scheduled_message(pod.obj)
        for alloc in self.state.allocations_of(pod.uid):
            if not alloc.deleting and not alloc.assumed:
                await self._release(alloc, "pinned pod stayed unschedulable")
        self.metrics.outcome("pinned_unschedulable")
        owner = podlib.controller_ref(pod.obj)
        if owner is not None:
            message = (
                f"pinned to {node} but unschedulable for {self.timeout_s:g}s ({cause}); "
                f"released its slices and deleted it so its {owner.get('kind', 'controller')} "
                "recreates it and it is placed again"
            )
            await self.writes.event(pod.obj, REASON_PINNED_UNSCHEDULABLE, message, "Warning")
            await self.writes.delete_pod(pod.obj)
        else:
            message = (
                f"pinned to {node} but unschedulable for {self.timeout_s:g}s ({cause}); "
                "released its slices; it has no controller to recreate it: delete and recreate "
                "the pod to have it placed again"
            )
            await self.writes.event(pod.obj, REASON_PINNED_UNSCHEDULABLE, message, "Warning")

    def _event(
        self, pod: Obj, reason: str, message: str, type_: Literal["Normal", "Warning"]
    ) -> None:
        """An event written in the background, off the pod's critical path."""
        self._background(self.writes.event(pod, reason, message, type_))


def _scheduled_message(pod: Obj) -> str:
    for cond in pod.get("status", {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled":
            return str(cond.get("message") or cond.get("reason") or "unschedulable")
    return "unschedulable"
