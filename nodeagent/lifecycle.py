"""One allocation's life on the node: create → Ready, verify, release → finalizer gone.

`work(uid)` is the KeyedQueue worker: it reads the latest SliceAllocation, asks
`reconcile.decide` what to do and does it. Every step is idempotent and ordered intent
first (docs/style.md §6):

create   plan → intent record → MIG mode → GI, CI, MIG UUID per slice → CDI file → status
         Ready; on an NVML error roll back and write Failed (nodeagent/create.py).
verify   a Ready allocation's record, CDI file and GPU health as they should be; vanished
         instances said, never re-made under a running pod (here).
release  record `releasing` → destroy CI then GI (IN_USE: status says so, pod event once,
         retry with backoff) → remove the CDI file → drop the record → drop the finalizer
         (here; the destroying and rollback in nodeagent/lifebase.py).

A crash anywhere leaves a record that the next start finishes (create) or repeats
(release); NVML NOT_FOUND on destroy counts as done, so nothing is made or destroyed twice.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import structlog

from common.allocation import SliceAllocation
from common.clock import kube_time
from common.conditions import condition, with_condition
from common.constants import REASON_RELEASED, EventReason
from common.kubeapi import ApiError
from common.objects import Phase
from nodeagent import cdi, writes
from nodeagent.checkpoint import ClaimRecord
from nodeagent.create import Create
from nodeagent.model import NvmlFailure
from nodeagent.reconcile import Action, decide, plan
from nodeagent.report import gpu_condition, status_releasing

log = structlog.get_logger("lifecycle")  # one logger name for the whole life

REASON_LOST = EventReason.SLICE_LOST
SLICES_PRESENT = "SlicesPresent"
REASON_IN_USE = EventReason.SLICE_IN_USE
API_RETRY_S = 1.0


class Lifecycle(Create):
    """One allocation's worker (`work`) and the paths beside creating: verify, release."""

    # ---- the worker ------------------------------------------------------------------------

    async def work(self, uid: str) -> float | None:
        obj = self.st.allocs.get(uid)
        if obj is None:
            self.waited_out.discard(uid)
            return None  # gone from the API; an orphaned record is garbage collection's
        alloc = SliceAllocation.parse(obj)
        d = decide(alloc, self.st.cp.claims.get(uid), self.st.boot_id)
        try:
            if d.action in (Action.CREATE, Action.RECREATE):
                return await self.create(alloc, d.reason)
            elif d.action is Action.VERIFY:
                return await self.verify(alloc)
            elif d.action is Action.ROLLBACK:
                rec = self.st.cp.claims[alloc.uid]
                why = rec.message or "creating failed; its slices were destroyed on a retry"
                if not await self.give_up(alloc, rec, why):
                    return self.settings.gc_period_s  # NVML refused again: later
            elif d.action is Action.REFAIL:
                rec = self.st.cp.claims[alloc.uid]
                log.warning("allocation failed earlier; Failed again", claim=alloc.key)
                await self.write_failed(alloc, rec.message)
            elif d.action is Action.RELEASE:
                return await self.release(alloc)
        except ApiError as exc:
            log.warning("api write failed; retrying", claim=alloc.key, error=str(exc))
            return API_RETRY_S if (exc.retryable or exc.conflict) else 10 * API_RETRY_S
        except NvmlFailure as exc:
            self.note_nvml(exc, None)
            log.warning("nvml failed; retrying", claim=alloc.key, error=str(exc))
            return 5.0
        return None

    # ---- verify (Ready) -----------------------------------------------------------------------

    async def verify(self, alloc: SliceAllocation) -> float | None:
        """A Ready allocation's slices and files as they should be; re-created if they
        vanished (a delay as `create`'s)."""
        rec = self.st.cp.claims.get(alloc.uid)
        if rec is not None and rec.state == "ready" and all(s.done for s in rec.slices):
            if alloc.uid in self.st.vanished:
                await self.mark_vanished(alloc)
                return None
            on_disk = await asyncio.to_thread(cdi.spec_uid, self.cdi_dir, rec.namespace, rec.name)
            if on_disk != rec.uid:  # missing, written before specs carried UIDs, or another's
                log.warning("CDI file missing or not this allocation's; rewriting",
                            claim=alloc.key, found_uid=on_disk)  # fmt: skip
                await self.write_cdi(rec)
            if not rec.announced:  # made by an earlier process: tell the binding again
                await self.announce(alloc)
                self.st.put(replace(rec, announced=True))
            await self.sync_health(alloc, rec)
            return None
        fresh = plan(alloc, self.st.inv, self.st.health, self.modes.problem)
        if not isinstance(fresh, str):
            instances = await self.instances({s.gpu_index for s in fresh})
            adopted = self.adoptable(alloc, fresh, instances)
            if adopted:
                rec = ClaimRecord(
                    alloc.uid,
                    alloc.namespace,
                    alloc.name,
                    "ready",
                    adopted,
                    self.st.boot_id,
                    time.time(),
                )
                self.st.put(rec)
                await self.st.persist(durable=True)  # the record is now the only proof
                await self.write_cdi(rec)
                await self.announce(alloc)
                self.st.put(replace(rec, announced=True))
                self.st.publish.set()
                log.info("adopted slices from allocation status", claim=alloc.key)
                return None
        return await self.create(alloc, "slices vanished from the GPU; re-creating")

    async def mark_vanished(self, alloc: SliceAllocation) -> None:
        """The allocation's instances are gone while its pod runs (agent.note_vanished): say
        so on the allocation (condition SlicesPresent=False) and to the pod, once. Nothing is
        re-created under a running pod (its processes lost the device; new instances would
        have new MIG UUIDs); the reservation stays until the pod goes, and release treats the
        missing instances as destroyed."""
        if any(
            c.get("type") == SLICES_PRESENT and c.get("status") == "False"
            for c in self.conditions(alloc)
        ):
            return
        msg = (
            f"the MIG instances of this allocation vanished from node {self.st.node} "
            "(a driver reload or GPU reset); the pod cannot use its slices: delete it "
            "(or let its controller replace it) to get new ones"
        )
        cond = condition(SLICES_PRESENT, False, "InstancesVanished", msg, kube_time())
        body: cdi.Obj = {
            "status": {"conditions": with_condition(self.conditions(alloc), cond), "message": msg}
        }
        await self.status(alloc, body)
        await writes.event(self.kube, alloc, REASON_LOST, msg,
            warning=True,
        )  # fmt: skip

    async def sync_health(self, alloc: SliceAllocation, rec: ClaimRecord) -> None:
        """Keep the allocation's GPUHealthy condition in line with its GPUs' health."""
        want = gpu_condition(self.st.health, [s.gpu_index for s in rec.slices], kube_time())
        have = next((c for c in self.conditions(alloc) if c.get("type") == "GPUHealthy"), None)
        if have is not None and (have.get("status"), have.get("message")) == (
            want["status"],
            want["message"],
        ):
            return
        conds = with_condition(self.conditions(alloc), want)
        body: cdi.Obj = {"status": {"conditions": conds}}
        if want["status"] == "False":
            body["status"]["message"] = f"slice GPU unhealthy: {want['message']}"
        await self.status(alloc, body)

    # ---- release ------------------------------------------------------------------------------

    async def release(self, alloc: SliceAllocation) -> float | None:
        uid = alloc.uid
        rec = self.st.cp.claims.get(uid)
        if rec is None and alloc.status_slices:
            fresh = plan(alloc, self.st.inv, self.st.health, self.modes.problem)
            if not isinstance(fresh, str):
                instances = await self.instances({s.gpu_index for s in fresh})
                adopted = self.adoptable(alloc, fresh, instances)
                if adopted:  # the status's MIG UUIDs prove these are ours
                    rec = ClaimRecord(uid, alloc.namespace, alloc.name, "releasing", adopted)
        if alloc.has_finalizer and alloc.phase != Phase.RELEASING:
            await self.status(alloc, status_releasing())
        if rec is not None:
            try:
                await self.destroy_held(rec)
            except NvmlFailure as exc:
                if not exc.in_use:
                    raise
                return await self.in_use(alloc, exc)
            rec = self.st.cp.claims.get(uid, rec)  # as destroy_held and in_use left it
        await asyncio.to_thread(cdi.remove_spec, self.cdi_dir, alloc.namespace, alloc.name, uid)
        self.st.drop(uid)
        await self.st.persist()
        self.st.publish.set()
        if self.warm is not None:
            self.warm.released()
        await self.binding.slices_released(alloc.namespace, alloc.name, uid)
        dropped = alloc.has_finalizer and await writes.drop_finalizer(
            self.kube, alloc.namespace, alloc.name, list(alloc.finalizers)
        )
        told = rec is not None and rec.in_use_told
        if not (dropped or rec is not None):
            # A repeat pass from a stale view (our Releasing write's watch event arriving
            # after the finalizer went): released and told already, by the first pass.
            return None
        log.info("slices released", claim=alloc.key, after_in_use=told)
        self.metrics.releases.labels(self.st.node, "released").inc()
        await writes.event(
            self.kube,
            alloc,
            REASON_RELEASED,
            f"MIG slices released on {self.st.node}",
        )
        return None

    async def in_use(self, alloc: SliceAllocation, exc: NvmlFailure) -> float:
        """A process still holds the slice: retry the release later (doubling), tell once.
        The delay and the telling live in the record (`destroy_held` put it there)."""
        rec = self.st.cp.claims[alloc.uid]
        delay = rec.retry_s or self.settings.release_backoff_s
        told = rec.in_use_told
        doubled = min(delay * 2, self.settings.release_backoff_max_s)
        self.st.put(replace(rec, retry_s=doubled, in_use_told=True))
        msg = f"slice still in use by a process ({exc.text}); retrying with backoff"
        await self.status(alloc, status_releasing(msg))
        if not told:
            await writes.event(self.kube, alloc, REASON_IN_USE, msg, True)
        log.info("release waits: slice in use", claim=alloc.key, retry_s=delay)
        self.metrics.releases.labels(self.st.node, "in_use").inc()
        return delay
