"""The node agent for one node: startup reconcile, then the node's loops in one TaskGroup.

Startup: discover GPUs and instances (NVML), load the checkpoint, forget instance ids if
the node rebooted, sort instances into ours (claimed by a record) and foreign, publish.
Then, concurrently: the allocation queue (one worker per SliceAllocation, `Lifecycle`),
the publisher (MigNode status and Node capacity, on change only), the Lease heartbeat,
garbage collection (orphaned records after the grace period, stale CDI files, a fresh
NVML scan) and health (NVML XID / GPU-lost events → MigNode, capacity, allocations).

Allocation events come from one informer per process (`on_event`), shared by all nodes
that process serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Sequence
from typing import Any

import structlog

from common.allocation import SliceAllocation
from common.catalog import Catalog
from common.clock import Clock, SystemClock, kube_time
from common.conditions import observed, with_condition
from common.constants import AllocationMode, EventReason
from common.kubeapi import ApiError, EventType, Kube
from common.workqueue import KeyedQueue
from nodeagent import cdi, checkpoint, heartbeat, modes, writes
from nodeagent.binding import Binding
from nodeagent.device import HealthHub, NodeGpus
from nodeagent.dra.carve import DraClaims
from nodeagent.dra.pool import pool_slices
from nodeagent.dra.publish import PoolPublisher
from nodeagent.lifecycle import Lifecycle
from nodeagent.maintenance import Maintenance, Reset
from nodeagent.metrics import AgentMetrics
from nodeagent.model import APPLICATION_XIDS, Health, HealthEvent, NvmlFailure
from nodeagent.reconcile import after_reboot, match, orphans, vanished_claims
from nodeagent.report import (
    CONFLICT_KINDS,
    capacity,
    capacity_patch,
    conflict_condition,
    conflicts,
    label_patch,
    mig_node_status,
    node_labels,
    slot_capacity,
    stamped,
)
from nodeagent.settings import Settings
from nodeagent.state import AgentNode
from nodeagent.warm import Demand
from nodeagent.warmpool import WarmPool

log = structlog.get_logger("agent")
Obj = dict[str, Any]
REASON_UNHEALTHY = EventReason.GPU_UNHEALTHY
STOP_PUBLISH_S = 2.0  # a stopping agent lists the slices it made just before, if it can


class NodeAgent:
    def __init__(
        self,
        *,
        node: str,
        kube: Kube,
        gpus: NodeGpus,
        settings: Settings,
        catalog: Catalog,
        boot_id: str,
        numbers: cdi.DeviceNumbers,
        base_spec: Obj | None,
        binding: Binding,
        health_hub: HealthHub,
        synced: asyncio.Event,
        metrics: AgentMetrics | None = None,
        clock: Clock | None = None,
        node_conditions: Sequence[Obj] = (),
        reset: Reset | None = None,
    ) -> None:
        self.node = node
        # findings about the node itself (e.g. BaseCdiSpecFound), fixed for the process's life;
        # published on the MigNode, and each False one told once as a Warning event on it
        now = kube_time()
        self.node_conditions = stamped(node_conditions, now)
        self._startup_conditions = list(self.node_conditions)
        self._conflicts_checked: float | None = None
        self._vanished_prev: set[str] = set()
        self._conditions_told = False
        self.metrics = metrics or AgentMetrics()
        self.kube = kube
        self.gpus = gpus
        self.settings = settings
        self.hub = health_hub
        self.synced = synced
        self.clock = clock or SystemClock()
        self.st = AgentNode(node, boot_id, settings.checkpoint_path(node))
        self.life = Lifecycle(
            st=self.st,
            gpus=gpus,
            kube=kube,
            settings=settings,
            catalog=catalog,
            numbers=numbers,
            common_edits=cdi.common_edits(base_spec, numbers),
            binding=binding,
            metrics=self.metrics,
            clock=self.clock,
        )
        self.queue = KeyedQueue(self.life.work, name=f"alloc-{node}")
        self.maint = Maintenance(
            st=self.st,
            gpus=gpus,
            kube=kube,
            changer=self.life.modes,
            reset=reset,
            wait_s=settings.maintenance_wait_s,
            drain_timeout_s=settings.maintenance_drain_timeout_s,
            clock=self.clock,
        )
        self.started = asyncio.Event()
        # garbage collection passes ended (failed ones too): a test proves by it that the
        # agent had its chance to act before it asserts that nothing happened
        self.gc_passes = 0
        self._health_q: asyncio.Queue[HealthEvent] = asyncio.Queue()
        self._orphan_seen: dict[str, float] = {}
        self._last_status: Obj | None = None
        self._status_writing = False  # a MigNode status write is out (publish_once)
        self._last_capacity: dict[str, str] | None = None
        self._capacity_written = False  # once: later writes undo another writer's (logged)
        self._node_uid = ""  # of our Node as last seen (watched): a new one republishes all
        self._last_labels: dict[str, str | None] | None = None
        self.idle_mode: str | None = None  # the Node's instaslice.io/idle-mig-mode (modes.py)
        # DRA mode: the node's ResourceSlices, written with the MigNode (docs/dra.md)
        dra = settings.allocation is AllocationMode.DRA
        self.pool = PoolPublisher(kube, node, self.st.publish.set) if dra else None
        self.claims = DraClaims(self.life, kube) if dra else None  # ResourceClaims allocated here
        self._idle_mode_told = ""
        self.warm: WarmPool | None = None  # warm slices (gate mode, --warm-slices)
        if settings.warm_slices and not dra:
            self.warm = WarmPool(
                life=self.life,
                per_gpu=settings.warm_per_gpu,
                per_node=settings.warm_per_node,
                profiles=settings.warm_profiles,
                demand=Demand(window_s=settings.warm_window_s),
                asked=lambda: self.maint.desired,
                idle_mode=lambda: self.idle_mode,
            )
            self.life.warm = self.warm

    # ---- informer → agent --------------------------------------------------------------------

    def on_event(self, etype: EventType, obj: Obj) -> None:
        uid = obj.get("metadata", {}).get("uid", "")
        if etype == "DELETED":
            self.st.allocs.pop(uid, None)
            self.st.live_added.discard(uid)
        else:
            if etype == "ADDED" and self.synced.is_set():
                self.st.live_added.add(uid)
            self.st.allocs[uid] = obj
        self.queue.kick(uid)

    def on_mig_node(self, etype: EventType, obj: Obj) -> None:
        """Our MigNode changed: its `spec.gpus[].desiredMigMode` asks for maintenance. A spec
        generation acted on is published as `status.observedGeneration`."""
        self.maint.on_mig_node({} if etype == "DELETED" else obj)
        if self.warm is not None:
            self.warm.kick.set()  # a GPU asked a mode has its warm slices destroyed
        # Only a generation not yet written: our own MigNode's ADDED event (generation 1, often
        # seen while the write that made it is still out) is written by that write, and a wake
        # for it would list a slice made meanwhile early (`create.SLICES_LISTED_WITHIN_S`).
        if not self._status_writing and self.maint.observed_generation != self._written_generation:
            self.st.publish.set()

    def on_node(self, etype: EventType, obj: Obj) -> None:
        """Our Node changed: when its `instaslice.io/mig-*` capacity is not what we last wrote
        (the Node was deleted and registered again, or another writer reset it), forget what
        we wrote so the publisher writes it again. A Node registered anew (another UID) gets
        the MigNode written again too: the allocator deletes the MigNode of a node gone for
        longer than its grace (`--node-gone-grace`)."""
        uid = "" if etype == "DELETED" else str(obj.get("metadata", {}).get("uid") or "")
        if uid and uid != self._node_uid:
            if self._node_uid:
                log.info("Node registered anew; publishing again", node=self.node)
                self._last_status = None
                self.st.publish.set()
            self._node_uid = uid
        labels = {} if etype == "DELETED" else obj.get("metadata", {}).get("labels") or {}
        was = self.idle_mode
        self.note_idle_mode(labels)
        if self.warm is not None and self.idle_mode != was:
            self.warm.kick.set()  # idle-mig-mode disabled: no warm slices
        # the instaslice.io/gpu-* and instaslice.io/node labels, likewise
        if self._last_labels is not None and label_patch(self._last_labels, labels) is not None:
            self._last_labels = None
            self.st.publish.set()
        if self._last_capacity is None:
            return
        current = {} if etype == "DELETED" else obj.get("status", {}).get("capacity") or {}
        if capacity_patch(self._last_capacity, current, prune=self._prune) is not None:
            # Often only an event older than our own write (at 5000 nodes, once per node at
            # start): the publisher reads the Node and writes, and says so, only if it must.
            self._last_capacity = None
            self.st.publish.set()

    def note_idle_mode(self, labels: dict[str, str]) -> None:
        """The resting mode the Node's label asks for; a bad value is logged once (naming
        the label) and read as `any`."""
        try:
            self.idle_mode = modes.idle_mode(labels)
        except modes.BadIdleMode as exc:
            self.idle_mode = None
            if self._idle_mode_told != str(exc):
                self._idle_mode_told = str(exc)
                log.warning("bad node label", node=self.node, error=str(exc))

    # ---- run ---------------------------------------------------------------------------------

    async def run(self) -> None:
        await self.startup()
        try:
            async with asyncio.TaskGroup() as tg:
                self.queue.start(tg)
                if self.claims is not None:
                    self.claims.queue.start(tg)
                tg.create_task(self._publisher(), name=f"publish-{self.node}")
                tg.create_task(self._lease(), name=f"lease-{self.node}")
                tg.create_task(self._gc_loop(), name=f"gc-{self.node}")
                tg.create_task(self._health(), name=f"health-{self.node}")
                tg.create_task(self.maint.run(), name=f"maintenance-{self.node}")
                if self.warm is not None:
                    tg.create_task(self.warm.run(), name=f"warm-{self.node}")
                self.started.set()
        finally:
            self.hub.remove(self.node)

    async def startup(self) -> None:
        st = self.st
        st.inv = await self.gpus.call(self.gpus.s.inventory)
        for i in st.inv.lost:
            st.health[i] = Health(False, "GPU is lost (NVML: GPU_IS_LOST)")
        for g in st.inv.gpus:
            for w in g.warnings:
                log.warning("NVML differs from the catalog; NVML wins", gpu=g.index, detail=w)
        path = self.settings.checkpoint_path(self.node)
        cp = await asyncio.to_thread(checkpoint.load, path, self.node)
        if cp.boot_id and cp.boot_id != st.boot_id:
            log.warning("node rebooted: recorded instances are gone", records=len(cp.claims))
        st.set_checkpoint(after_reboot(cp, st.boot_id))
        await st.persist()
        await self.life.modes.resolve_intents()  # a crash between intent and SetMigMode
        await self.maint.recover()  # a crash mid-maintenance: labels back, no pending mode
        own = match(st.cp, st.inv.instances)
        st.foreign = own.foreign
        log.info(
            "node discovered",
            node=self.node,
            gpus=len(st.inv.gpus),
            instances=len(st.inv.instances),
            ours=len(own.owner),
            foreign=len(own.foreign),
            records=len(st.cp.claims),
        )
        for f in own.foreign:
            log.warning(
                "instance InstaSlice did not create; left alone",
                gpu=f.gpu_index,
                gi=f.gi_id,
                placement=f"{f.start}:{f.size}",
            )
        healthy = [g.index for g in st.inv.gpus if g.index not in st.inv.lost]
        self.hub.add(self.node, self.gpus.event_session(), healthy, self._health_q.put_nowait)
        await self._first_conflict_check()
        st.publish.set()

    async def _first_conflict_check(self) -> None:
        """Before the first publish, so that its MigNode status carries ConflictFree: one
        status write per node at start. Left to the first GC pass, the condition was a second
        write of every MigNode; at 5000 nodes that wave was still flowing 15 minutes after
        startup (issue 25). The Node not there yet, or the API server refusing: that pass
        checks."""
        try:
            checked = await self.check_conflicts()
        except ApiError as exc:
            log.warning("conflict check failed", node=self.node, error=str(exc))
            return
        if checked:
            self._conflicts_checked = self.clock.monotonic()

    # ---- publishing ----------------------------------------------------------------------------

    async def _publisher(self) -> None:
        try:
            await self._publish_changes()
        finally:
            if self.st.publish_due:  # a slice made in the last second: list it before going
                with contextlib.suppress(ApiError, TimeoutError):
                    async with asyncio.timeout(STOP_PUBLISH_S):
                        await self.publish_once()

    async def _publish_changes(self) -> None:
        retry: float | None = None
        while True:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a
            # cancellation that races with the event (gh-86296) and this loop never ends
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(retry):
                    await self.st.publish.wait()
            self.st.publish.clear()
            await asyncio.sleep(0.02)  # coalesce a burst of changes into one write
            try:
                retry = await self.publish_once()
            except ApiError as exc:
                log.warning("publish failed", node=self.node, error=str(exc))
                retry = 2.0

    @property
    def _written_generation(self) -> int | None:
        """The `observedGeneration` last written; None before the first write."""
        if self._last_status is None:
            return None
        return int(self._last_status.get("observedGeneration") or 0)

    @property
    def _prune(self) -> bool:
        """Whether the agent owns the `instaslice.io/mig-*` capacity (not in device-plugin
        mode, where the kubelet advertises what the plugin lists)."""
        return self.settings.binding != "device-plugin"

    async def publish_once(self) -> float | None:
        """Write MigNode status and Node capacity (env binding only) if they changed; a retry
        delay if the Node object does not exist yet."""
        st = self.st
        modes = self.life.modes
        if self.pool is not None:
            await self.pool.publish(
                pool_slices(st.inv, st.health, modes.can_enable, modes.can_be_whole)
            )
        status = mig_node_status(
            st.inv,
            st.health,
            st.cp,
            st.foreign,
            version=self.settings.version,
            boot_id=st.boot_id,
            conditions=self.node_conditions,
            modes=self.life.modes.status(),
            generation=self.maint.observed_generation,
            now=kube_time(),
        )
        self.node_conditions = status["conditions"]  # Ready too: its transition time holds
        if status != self._last_status:
            self._status_writing = True
            try:
                created = await writes.patch_mig_node_status(self.kube, self.node, status)
            finally:
                self._status_writing = False
            if created:  # made just now, spec empty: generation 1 observed, nothing to redo
                self.maint.observed_generation = created
                status = {**status, "observedGeneration": created}
                status["conditions"] = observed(status["conditions"], created, "")
            self._last_status = status
            if self.maint.observed_generation != self._written_generation:
                self.st.publish.set()  # observed while the write was out (on_mig_node)
            if not self._conditions_told:  # those known at start; later ones tell themselves
                self._conditions_told = True
                for c in self._startup_conditions:
                    if c["status"] == "False":
                        log.warning(
                            "node condition", node=self.node, type=c["type"], reason=c["reason"]
                        )
                        await writes.mig_node_event(self.kube, self.node, c)
            for g in st.inv.gpus:
                self.metrics.gpu_healthy.labels(self.node, str(g.index)).set(st.healthy(g.index))
            ours = sum(len(r.slices) for r in st.cp.claims.values())
            self.metrics.slices.labels(self.node, "instaslice").set(ours)
            self.metrics.slices.labels(self.node, "foreign").set(len(st.foreign))
        desired = slot_capacity(
            st.inv, st.health, self.life.catalog, modes.can_enable, modes.can_be_whole
        )
        if self._prune:
            # The kubelet advertises what the device plugin lists. A direct write would let the
            # kubelet admit a pod before the plugin registered, and that pod's containers ran
            # without their slice (seen on the real node, tests/e2e/test_realnode.py). Memory
            # slots are no device: written directly in both modes.
            desired |= capacity(st.inv, st.health, modes.can_enable, modes.can_be_whole)
        labels = node_labels(self.node, st.inv)
        if desired == self._last_capacity and labels == self._last_labels:
            return None
        node = await writes.get_node(self.kube, self.node)
        if node is None:
            log.info("Node object not found; capacity waits", node=self.node)
            return 5.0
        current = node.get("status", {}).get("capacity") or {}
        body = capacity_patch(desired, current, prune=self._prune)
        if body is not None:
            if self._capacity_written:
                log.info("Node capacity is not what we wrote; writing it again", node=self.node)
            await writes.patch_node_status(self.kube, self.node, body)
        self._last_capacity = desired
        self._capacity_written = True
        body = label_patch(labels, node.get("metadata", {}).get("labels") or {})
        if body is not None:  # gpu-model for Kueue flavors, node for placeholders' NotIn
            await writes.patch_node(self.kube, self.node, body)
        self._last_labels = labels
        return None

    async def _lease(self) -> None:
        """Renew the Lease at once, then on this node's cadence (nodeagent/heartbeat.py)."""
        period = heartbeat.renewal_period(self.settings.lease_duration_s)
        cadence = heartbeat.phase(self.clock.monotonic(), period)
        while True:
            try:
                await writes.renew_lease(
                    self.kube, self.settings.namespace, self.node, self.settings.lease_duration_s
                )
            except ApiError as exc:
                log.warning("lease renewal failed", node=self.node, error=str(exc))
            now = self.clock.monotonic()
            await asyncio.sleep(heartbeat.next_renewal(now, cadence, period) - now)

    # ---- garbage collection ----------------------------------------------------------------------

    async def _gc_loop(self) -> None:
        await self.synced.wait()
        while True:
            try:
                await self.gc()
            except (ApiError, NvmlFailure) as exc:
                log.warning("garbage collection failed", node=self.node, error=str(exc))
            self.gc_passes += 1
            # jittered: agents that started together (one process serving 500 emulated nodes,
            # or a fleet after a rollout) must not all rescan NVML in the same second; in
            # lockstep the scans stalled creates for ~5 s (churn p99, docs/benchmarks-history.md)
            await asyncio.sleep(self.settings.gc_period_s * random.uniform(0.75, 1.25))

    async def gc(self) -> None:
        """Destroy what orphaned records hold (after the grace period), have refused rollbacks
        retried (by their allocation's worker, never beside it), remove CDI files nobody
        claims, and rescan NVML for foreign instances."""
        st = self.st
        live = set(st.allocs) | (self.claims.live() if self.claims is not None else set())
        due, self._orphan_seen = orphans(
            st.cp, live, self._orphan_seen, self.clock.monotonic(), self.settings.gc_grace_s
        )
        stuck = [
            uid
            for uid, rec in st.cp.claims.items()
            if uid in st.allocs
            and rec.state == "releasing"
            and not SliceAllocation.parse(st.allocs[uid]).deleting
        ]
        for uid in stuck:  # a refused rollback: its allocation's worker retries it, in turn
            self.queue.kick(uid)
        for uid in due:
            rec = st.cp.claims.get(uid)
            if rec is not None:
                log.warning("destroying slices no allocation claims", claim=rec.key)
                await self.life.rollback(rec)
        await self._gc_cdi()
        await self.life.modes.refresh()  # MIG modes and processes changed underneath us
        await self.life.modes.rest(
            self.idle_mode, self.settings.idle_mig_mode_after_s, asked=self.maint.desired
        )
        if self.maint.desired or self.st.cp.maintenance is not None:
            self.maint.kick.set()  # draining GPUs: idle yet?
        if self.warm is not None:
            self.warm.kick.set()  # demand ages, GPUs change: the pool looks again
        scan_started = time.time()
        instances = await self.life.instances({g.index for g in st.inv.gpus})
        own = match(st.cp, instances)
        if own.foreign != st.foreign:
            st.foreign = own.foreign
            st.publish.set()
        self.note_vanished(vanished_claims(st.cp, own, st.is_lost, before=scan_started))
        now = self.clock.monotonic()
        period = self.settings.conflict_check_period_s
        if self._conflicts_checked is None or now - self._conflicts_checked >= period:
            self._conflicts_checked = now
            await self.check_conflicts()

    def note_vanished(self, gone: set[str]) -> None:
        """Ready records whose instances are gone in two scans in a row (the second guards
        against a scan that raced a change) are marked: their allocation's queue is kicked
        and lifecycle.verify sets its condition and tells the pod."""
        st = self.st
        confirmed = gone & self._vanished_prev
        self._vanished_prev = gone
        st.vanished &= set(st.cp.claims)  # released ones are done with
        for uid in sorted(confirmed - st.vanished):
            st.vanished.add(uid)
            log.warning("instances vanished (driver reload or GPU reset?)", claim=uid)
            self.queue.kick(uid)

    async def check_conflicts(self) -> bool:
        """Another MIG manager on this node (NVIDIA's device plugin, MIG Manager, instances we
        did not create): the MigNode condition ConflictFree, a Warning event when it turns
        False, and the conflicts gauge. Checked at start and by the GC pass every
        conflict_check_period_s; False when the Node does not exist (yet)."""
        labels = await writes.node_labels(self.kube, self.node)
        if labels is None:
            return False
        found = conflicts(labels, len(self.st.foreign))
        for kind in CONFLICT_KINDS:
            self.metrics.conflicts.labels(self.node, kind).set(kind in found)
        now = kube_time()
        new = conflict_condition(found, now)
        old = next((c for c in self.node_conditions if c["type"] == new["type"]), None)
        if old is not None and (old["status"], old["message"]) == (new["status"], new["message"]):
            return True
        self.node_conditions = with_condition(self.node_conditions, new)
        self.st.publish.set()
        if new["status"] == "False":
            log.warning("another manager on this node's GPUs", node=self.node, reason=new["reason"])
            await writes.mig_node_event(self.kube, self.node, new)
        return True

    async def _gc_cdi(self) -> None:
        """Remove CDI files no allocation owns. A file naming its allocation's UID is kept
        while that UID has a record or a live allocation — whatever else holds its name —
        and removed only if it still names that UID (a newer allocation of the same name
        may have rewritten it meanwhile); a file without a UID goes by its name."""
        st, cdi_dir = self.st, self.life.cdi_dir
        for ns, claim in await asyncio.to_thread(cdi.our_spec_files, cdi_dir):
            uid = await asyncio.to_thread(cdi.spec_uid, cdi_dir, ns, claim)
            if uid is None or (uid and (uid in st.cp.claims or uid in st.allocs)):
                continue
            if not uid and (ns, claim) in self._claim_keys():
                continue
            if await asyncio.to_thread(cdi.remove_spec, cdi_dir, ns, claim, uid):
                log.info("removed stale CDI spec", claim=f"{ns}/{claim}", uid=uid)

    def _claim_keys(self) -> set[tuple[str, str]]:
        keys = {(r.namespace, r.name) for r in self.st.cp.claims.values()}
        return keys | {
            (a["metadata"]["namespace"], a["metadata"]["name"]) for a in self.st.allocs.values()
        }

    # ---- health ----------------------------------------------------------------------------------

    async def _health(self) -> None:
        while True:
            ev = await self._health_q.get()
            await self.on_health(ev)

    async def on_health(self, ev: HealthEvent) -> None:
        if ev.kind == "xid" and ev.xid in APPLICATION_XIDS:
            log.info("application XID (GPU stays healthy)", gpu=ev.gpu_index, xid=ev.xid)
            return
        gpu = self.st.inv.gpu_by_index(ev.gpu_index)
        if gpu is None:
            return
        if ev.kind == "lost":
            self.st.lost.add(ev.gpu_index)
        if not self.st.healthy(ev.gpu_index):
            return
        self.st.set_unhealthy(ev.gpu_index, ev.message)
        log.warning("GPU unhealthy", node=self.node, gpu=ev.gpu_index, reason=ev.message)
        for uid, obj in list(self.st.allocs.items()):
            alloc = SliceAllocation.parse(obj)
            if any(s.gpu_uuid == gpu.uuid for s in alloc.slices):
                self.queue.kick(uid)
                await writes.event(
                    self.kube,
                    alloc,
                    REASON_UNHEALTHY,
                    f"GPU {gpu.index} ({gpu.uuid}) on {self.node} is unhealthy: {ev.message}",
                    warning=True,
                )
