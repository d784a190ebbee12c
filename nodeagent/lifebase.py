"""What every step of an allocation's life shares: the state, status writes, NVML destroys,
the CDI file, the rollback.

`Lifecycle` (nodeagent/lifecycle.py) decides and routes, `Create` (nodeagent/create.py) makes
slices; both stand on this. It holds the primitives, not a path: nothing here decides what
an allocation needs next (that is `reconcile.decide`). The rollback lives here, not with
release, because a create that fails gives up through it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import structlog

from common.allocation import SliceAllocation
from common.catalog import Catalog
from common.clock import Clock, SystemClock, kube_time
from common.conditions import allocation_status, condition, with_condition
from common.constants import EventReason, qualified_cdi_device
from common.kubeapi import Kube
from nodeagent import cdi, writes
from nodeagent.binding import Binding
from nodeagent.checkpoint import ClaimRecord, SliceRecord
from nodeagent.device import NodeGpus
from nodeagent.metrics import AgentMetrics
from nodeagent.modechange import ModeChanger
from nodeagent.model import Instance, NvmlFailure
from nodeagent.reconcile import adopt_from_status, match
from nodeagent.report import status_failed
from nodeagent.settings import Settings
from nodeagent.state import AgentNode

log = structlog.get_logger("lifecycle")  # one logger name for the whole life

REASON_FAILED = EventReason.SLICE_CREATE_FAILED


@dataclass(kw_only=True, eq=False)
class LifeBase:
    st: AgentNode
    gpus: NodeGpus
    kube: Kube
    settings: Settings
    catalog: Catalog
    numbers: cdi.DeviceNumbers
    common_edits: cdi.Obj
    binding: Binding
    metrics: AgentMetrics
    clock: Clock = field(default_factory=SystemClock)
    cdi_dir: Path = field(init=False)
    modes: ModeChanger = field(init=False)

    def __post_init__(self) -> None:
        self.cdi_dir = self.settings.node_cdi_dir(self.st.node)
        self.modes = ModeChanger(st=self.st, gpus=self.gpus, metrics=self.metrics, clock=self.clock)

    # ---- helpers ---------------------------------------------------------------------------

    def note_nvml(self, exc: NvmlFailure, gpu_index: int | None) -> None:
        self.metrics.nvml_errors.labels(self.st.node, exc.call, exc.code_name).inc()
        if exc.gpu_lost and gpu_index is not None:
            self.st.lost.add(gpu_index)
            if self.st.healthy(gpu_index):
                self.st.set_unhealthy(gpu_index, "GPU is lost (NVML: GPU_IS_LOST)")

    async def instances(
        self, gpu_indexes: set[int], first: bool = False, with_cis: bool = True
    ) -> list[Instance]:
        """The GPUs' instances; `first`: a create's scan, ahead of other queued calls;
        without `with_cis`, their GIs only (`NvmlSession.instances`)."""
        call = self.gpus.call_gpu_first if first else self.gpus.call_gpu
        out: list[Instance] = []
        for g in self.st.inv.gpus:
            if g.index in gpu_indexes and not self.st.is_lost(g.index):
                out += await call(g.index, self.gpus.s.instances, g, with_cis)
        return out

    async def status(self, alloc: SliceAllocation, body: cdi.Obj) -> bool:
        """False when the allocation is gone. Every write carries the conditions whole, the
        `Ready` summary derived from the phase (common.conditions.allocation_status)."""
        full = allocation_status(
            body["status"], self.conditions(alloc), alloc.phase, alloc.generation, kube_time()
        )
        written = await writes.patch_alloc_status(
            self.kube, alloc.namespace, alloc.name, {"status": full}
        )
        return written is not None

    def conditions(self, alloc: SliceAllocation) -> list[cdi.Obj]:
        obj = self.st.allocs.get(alloc.uid) or {}
        return list((obj.get("status") or {}).get("conditions") or [])

    async def fail(self, alloc: SliceAllocation, message: str) -> None:
        log.warning("allocation failed", claim=alloc.key, reason=message)
        self.metrics.creates.labels(self.st.node, "failed").inc()
        # final for this uid (reconcile.decide); holds no slice: the rollback came first.
        # Noted before the write: a view of it handled from the moment Failed can be seen
        # (our own late Creating event) is answered with Failed, never made; a write that
        # fails is written again (Action.REFAIL)
        rec = ClaimRecord(alloc.uid, alloc.namespace, alloc.name, "failed", (), self.st.boot_id)
        self.st.put(replace(rec, updated=time.time(), message=message))  # in memory only
        await self.write_failed(alloc, message)
        await writes.event(self.kube, alloc, REASON_FAILED, message, True)

    async def write_failed(self, alloc: SliceAllocation, message: str) -> None:
        conds = with_condition(
            self.conditions(alloc), condition("Ready", False, "CreateFailed", message, kube_time())
        )
        await self.status(alloc, status_failed(message, conds))

    async def destroy(self, inst: Instance) -> None:
        """CI(s) first, then the GI (docs/mig-facts.md §3.3); NOT_FOUND counts as done."""
        i = inst.gpu_index
        if self.st.is_lost(i):
            log.warning("GPU lost; its instances went with it", gpu=i)
            return
        try:
            for ci in inst.ci_ids:
                await self.gpus.call_gpu(i, self.gpus.s.destroy_ci, i, inst.gi_id, ci)
            await self.gpus.call_gpu(i, self.gpus.s.destroy_gi, i, inst.gi_id)
        except NvmlFailure as exc:
            self.note_nvml(exc, inst.gpu_index)
            raise

    def cdi_nodes(self, rec: ClaimRecord) -> dict[str, list[cdi.SliceNodes]]:
        out: dict[str, list[cdi.SliceNodes]] = {}
        for s in rec.slices:
            gpu = self.st.inv.gpu_by_uuid(s.gpu_uuid)
            assert gpu is not None and s.done
            if s.whole:
                nodes = self.numbers.gpu_nodes(gpu.uuid, gpu.minor)
            else:
                assert s.gi_id is not None and s.ci_id is not None
                nodes = self.numbers.slice_nodes(str(s.mig_uuid), gpu.minor, s.gi_id, s.ci_id)
            out.setdefault(s.container, []).append(nodes)
        return out

    async def write_cdi(self, rec: ClaimRecord) -> None:
        spec = cdi.build_spec(
            rec.namespace, rec.name, self.cdi_nodes(rec), self.common_edits, uid=rec.uid
        )
        await asyncio.to_thread(cdi.write_spec, self.cdi_dir, rec.namespace, rec.name, spec)

    # ---- giving up, rolling back, telling the binding ---------------------------------------

    async def destroy_held(self, rec: ClaimRecord) -> None:
        """Mark the record `releasing` (persisted), then destroy every instance it owns."""
        if rec.state != "releasing":
            rec = replace(rec, state="releasing", updated=time.time())
        if self.st.cp.claims.get(rec.uid) != rec:
            self.st.put(rec)
            await self.st.persist()
        instances = await self.instances({s.gpu_index for s in rec.slices})
        own = match(self.st.cp, instances)
        for i in range(len(rec.slices)):
            inst = own.found.get((rec.uid, i))
            if inst is not None:
                await self.destroy(inst)

    async def give_up(self, alloc: SliceAllocation, rec: ClaimRecord, message: str) -> bool:
        """Creating failed: roll back, then write Failed. When NVML refuses the rollback, the
        record stays `releasing` with the message, and this allocation's worker retries the
        rollback (decide: ROLLBACK; garbage collection kicks it too) until it goes and
        Failed is written: never Creating forever. True when done."""
        if await self.rollback(rec):
            await self.fail(alloc, message)
            return True
        kept = self.st.cp.claims.get(rec.uid)
        if kept is not None:
            self.st.put(replace(kept, message=message))
        return False

    async def rollback(self, rec: ClaimRecord) -> bool:
        """Destroy what the record holds, remove its CDI file and drop it. False (record
        kept as `releasing`, for garbage collection to retry) if NVML refused."""
        try:
            await self.destroy_held(rec)
        except NvmlFailure as exc:
            log.error(
                "could not destroy slices; garbage collection retries",
                claim=rec.key,
                error=str(exc),
            )
            return False
        await asyncio.to_thread(cdi.remove_spec, self.cdi_dir, rec.namespace, rec.name, rec.uid)
        self.st.drop(rec.uid)
        await self.st.persist()
        self.st.publish.set()
        return True

    def adoptable(
        self, alloc: SliceAllocation, fresh: list[SliceRecord], instances: list[Instance]
    ) -> tuple[SliceRecord, ...] | None:
        """`adopt_from_status`, unless another record owns one of those instances: a corrupt
        or forged status naming another allocation's MIG device must never make this one
        its owner (on release it would destroy the other pod's slice)."""
        adopted = adopt_from_status(alloc, fresh, instances)
        if not adopted:
            return None
        taken = match(self.st.cp.without(alloc.uid), instances).owner
        named = {s.mig_uuid for s in adopted}
        if any(i.key in taken for i in instances if i.mig_uuid in named):
            log.warning("status names another allocation's MIG devices; not adopted",
                        claim=alloc.key)  # fmt: skip
            return None
        return adopted

    async def announce(self, alloc: SliceAllocation) -> None:
        """Tell the binding the allocation's devices are ready (idempotent). Also on verify,
        once per process: a restarted agent must still hand a Ready slice to a kubelet that
        admits its pod later (issue 17 #2; tests/e2e/test_realnode.py on a real kubelet)."""
        devices = {
            c: qualified_cdi_device(alloc.namespace, alloc.name, c) for c in alloc.containers()
        }
        await self.binding.slices_ready(alloc.namespace, alloc.name, devices)
