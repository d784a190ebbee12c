"""One allocation's life on the node: create → Ready, verify, release → finalizer gone.

`work(uid)` is the KeyedQueue worker: it reads the latest SliceAllocation, asks
`reconcile.decide` what to do and does it. Every step is idempotent and ordered intent
first (docs/style.md §6):

create   plan (pure) → status Creating → check the placements are free → write the intent
         record → bring each GPU to the MIG mode its slices need (`modechange`) → per
         slice: GI at exactly the placement (or adopt the one the record claims), its
         default CI, MIG UUID by walking MIG handles → CDI file → record `ready` → status
         Ready + pod event. On an NVML error: destroy what the record holds, drop it,
         status Failed with the NVML error.
release  record `releasing` → destroy CI then GI (IN_USE: status says so, pod event once,
         retry with backoff) → remove the CDI file → drop the record → drop the finalizer.

A crash anywhere leaves a record that the next start finishes (create) or repeats
(release); NVML NOT_FOUND on destroy counts as done, so nothing is made or destroyed twice.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal, TypeVar

import structlog

from common.allocation import SliceAllocation
from common.catalog import Catalog
from common.clock import Clock, SystemClock, kube_time, wait_or_sleep
from common.constants import REASON_READY, REASON_RELEASED, qualified_cdi_device
from common.kubeapi import ApiError, Kube
from common.objects import Phase, SliceStatus
from nodeagent import cdi, writes
from nodeagent.binding import Binding
from nodeagent.checkpoint import ClaimRecord, SliceRecord
from nodeagent.device import NodeGpus
from nodeagent.metrics import AgentMetrics
from nodeagent.modechange import ModeChanger
from nodeagent.model import Health, Instance, NvmlFailure
from nodeagent.nvml import NvmlSession
from nodeagent.reconcile import (
    Action,
    adopt_from_status,
    blocked,
    decide,
    held_by_release,
    match,
    merge_plan,
    plan,
)
from nodeagent.report import (
    condition,
    gpu_condition,
    status_creating,
    status_failed,
    status_ready,
    status_releasing,
    with_condition,
)
from nodeagent.settings import Settings
from nodeagent.state import AgentNode

log = structlog.get_logger("lifecycle")
A = TypeVar("A")
B = TypeVar("B")

CREATE_GI = "nvmlDeviceCreateGpuInstanceWithPlacement"
NOT_OURS = -1  # a GI id no instance has: the slice claims nothing
REASON_FAILED = "SliceCreateFailed"
REASON_LOST = "SliceLost"
SLICES_PRESENT = "SlicesPresent"
REASON_IN_USE = "SliceInUse"
API_RETRY_S = 1.0
# A slice made is listed on the MigNode within this long. Nobody waits for it: the allocator
# counts the slots from the SliceAllocation, and a MigNode status patch (~24 KB for 8 GPUs,
# schema-validated) right after Ready competed with the pod's pin for the API server: one
# per pod in the sequential benchmark, the costliest write of the path (docs/benchmarks-history.md).
SLICES_LISTED_WITHIN_S = 1.0
# A create waits this long at most for a release holding its slots (`wait_for_releases`);
# after that the placement check fails it, as it did before creates went first.
RELEASE_WAIT_S = 30.0
# After such a wait the claim is decided afresh (its allocation, the plan may have changed
# meanwhile): `work` runs again after this delay.
AFTER_RELEASE_WAIT_S = 0.0
WaitOutcome = Literal["free", "released", "still held"]


async def wait_for_releases(
    st: AgentNode, clock: Clock, key: str, uid: str, fresh: list[SliceRecord], cap_s: float
) -> WaitOutcome:
    """Until no other record still being released (`releasing`) holds slots `fresh` needs
    ("released"), or `cap_s` of `clock` have passed ("still held"); "free" when none held
    any. A create's NVML calls go ahead of a release's on the GPU's lane (nodeagent/lane.py),
    so one that needs the release's slots waits for it here, outside the lane. (The
    allocator places on slots only once their allocation is gone, after its release: this
    guards what it cannot see, such as a rollback still destroying.)"""
    holder = held_by_release(st.cp, uid, fresh)
    if holder is None:
        return "free"
    t0 = clock.monotonic()
    log.info("create waits for a release holding its slots", claim=key, release_uid=holder)
    while holder is not None and (left := t0 + cap_s - clock.monotonic()) > 0:
        await wait_or_sleep(clock, st.next_drop(), left)
        holder = held_by_release(st.cp, uid, fresh)
    ms = round((clock.monotonic() - t0) * 1000, 1)
    if holder is None:
        log.info("create's slots released", claim=key, ms=ms)
        return "released"
    log.warning("create's slots still held by a release", claim=key, release_uid=holder, ms=ms)
    return "still held"


async def _both(a: Awaitable[A], b: Awaitable[B]) -> tuple[A, B]:
    """Run `a` and `b` side by side until both have ended; both results, or the first one's
    exception. Neither is cut short when the other fails: a checkpoint write cancelled while
    its thread still writes would free the state lock for a second write beside it."""
    ta, tb = asyncio.ensure_future(a), asyncio.ensure_future(b)
    await asyncio.wait((ta, tb))
    for t in (ta, tb):
        if (exc := t.exception()) is not None:
            (tb if t is ta else ta).exception()  # retrieved: not reported as never retrieved
            raise exc
    return ta.result(), tb.result()


def _gi_ci_uuid(
    nv: NvmlSession,
    i: int,
    profile_id: int,
    start: int,
    size: int,
    gi: int | None,
    gi_slices: int,
    hint: int | None,
) -> tuple[int, int, str]:
    """One slice on GPU `i`: its GI at exactly the placement (unless `gi` is adopted), the
    default CI, the MIG UUID. One trip to the GPU's NVML lane, not three: each trip is a hand-off
    to a thread and back and a wait for the lane, ~1 ms on a busy loop. An NVML error of any
    step propagates as before; a GI made before it is the record's (same placement) and the
    rollback destroys it."""
    if gi is None:
        gi = nv.create_gi(i, profile_id, start, size)
    ci = nv.create_ci(i, gi, gi_slices, hint)
    return gi, ci, nv.mig_uuid(i, gi, ci)


async def _timed(aw: Awaitable[A], took: dict[str, float], name: str, clock: Clock) -> A:
    """`aw`'s result; how long it took (ms) in `took[name]`, for the "slices ready" log: a
    phase runs a write and a record side by side, and only this tells which one it waited on."""
    t0 = clock.monotonic()
    try:
        return await aw
    finally:
        took[name] = round((clock.monotonic() - t0) * 1000, 1)


def _steps(t0: float, marks: dict[str, float] | None) -> dict[str, float] | None:
    """ms each phase of a create took (`marks`: when each ended, in order), for the log: where
    an agent's share of a pod's time to slice goes (docs/benchmarks-history.md)."""
    if not marks:
        return None
    out, last = {}, t0
    for name, at in marks.items():
        out[name] = round((at - last) * 1000, 1)
        last = at
    return out


@dataclass(kw_only=True, eq=False)
class Lifecycle:
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
    # claims whose wait for a release ran RELEASE_WAIT_S: the next create goes on at once
    waited_out: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.cdi_dir = self.settings.node_cdi_dir(self.st.node)
        self.modes = ModeChanger(st=self.st, gpus=self.gpus, metrics=self.metrics, clock=self.clock)

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

    # ---- helpers ---------------------------------------------------------------------------

    def note_nvml(self, exc: NvmlFailure, gpu_index: int | None) -> None:
        self.metrics.nvml_errors.labels(self.st.node, exc.call, exc.code_name).inc()
        if exc.gpu_lost and gpu_index is not None:
            self.st.lost.add(gpu_index)
            if self.st.healthy(gpu_index):
                self.st.health[gpu_index] = Health(False, "GPU is lost (NVML: GPU_IS_LOST)")
                self.st.publish.set()

    async def instances(self, gpu_indexes: set[int], first: bool = False) -> list[Instance]:
        """The GPUs' instances; `first`: a create's scan, ahead of other queued calls."""
        call = self.gpus.call_gpu_first if first else self.gpus.call_gpu
        out: list[Instance] = []
        for g in self.st.inv.gpus:
            if g.index in gpu_indexes and not self.st.is_lost(g.index):
                out += await call(g.index, self.gpus.s.instances, g)
        return out

    async def waited_for_releases(self, alloc: SliceAllocation, fresh: list[SliceRecord]) -> bool:
        """Whether the create waited for a release (`wait_for_releases`): it is then decided
        afresh. A claim whose wait ran its cap goes on at once the next time (the placement
        check then fails it, as before creates went first)."""
        if alloc.uid in self.waited_out:
            self.waited_out.discard(alloc.uid)
            return False
        got = await wait_for_releases(
            self.st, self.clock, alloc.key, alloc.uid, fresh, RELEASE_WAIT_S
        )
        if got == "still held":
            self.waited_out.add(alloc.uid)
        return got != "free"

    async def status(self, alloc: SliceAllocation, body: cdi.Obj) -> bool:
        """False when the allocation is gone."""
        return (
            await writes.patch_alloc_status(self.kube, alloc.namespace, alloc.name, body)
            is not None
        )

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
        await writes.event(
            self.kube, alloc.namespace, alloc.pod_name, alloc.pod_uid, REASON_FAILED, message, True
        )

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

    # ---- create ------------------------------------------------------------------------------

    async def create(self, alloc: SliceAllocation, reason: str = "") -> float | None:
        """Make the allocation's slices; a delay when it is to be decided afresh after it
        (it waited for a release: its allocation or plan may have changed meanwhile)."""
        t0 = self.clock.monotonic()
        uid = alloc.uid
        rec = self.st.cp.claims.get(uid)
        if (
            rec is not None
            and rec.state == "ready"
            and rec.boot_id == self.st.boot_id
            and all(s.done for s in rec.slices)
        ):
            # made already (a crash before the Ready write): say so again
            await self.ready(alloc, rec, t0)
            return None
        if alloc.node != self.st.node:  # the node label says us; spec.nodeName does not
            await self.fail(alloc, f"spec.nodeName {alloc.node} is not on node {self.st.node}")
            return None
        fresh = plan(alloc, self.st.inv, self.st.health, self.modes.problem)
        if isinstance(fresh, str):
            cannot = f"{reason}; cannot re-create: {fresh}" if reason else fresh
            await (self.give_up(alloc, rec, cannot) if rec else self.fail(alloc, cannot))
            return None
        if await self.waited_for_releases(alloc, fresh):
            return AFTER_RELEASE_WAIT_S
        took: dict[str, float] = {}
        intent = _timed(self.intent(alloc, rec, fresh), took, "intent_record", self.clock)
        if alloc.phase != Phase.CREATING or reason:
            # The Creating status and the intent record side by side (an API round trip
            # beside a placement check and an fsync): both are done before NVML makes
            # anything, which is all their order has to guarantee.
            write = self.status(alloc, status_creating(reason))
            creating = _timed(write, took, "creating_write", self.clock)
            alive, (made, instances) = await _both(creating, intent)
        else:
            alive, (made, instances) = True, await intent
        marks = {"intent": self.clock.monotonic()}  # phase ends, for the "slices ready" log
        if not alive:  # deleted meanwhile (e.g. moved off while this agent was down): make nothing
            if rec is None and isinstance(made, ClaimRecord):
                self.st.drop(uid)  # the record written beside the status write claims nothing
                await self.st.persist()
            return None
        if isinstance(made, str):
            await self.fail(alloc, made)
            return None
        rec = made
        own = match(self.st.cp, instances)
        why = blocked(rec.slices, uid, instances, own)
        if why:
            await self.give_up(alloc, rec, why)
            return None
        why = await self.modes.ensure(uid, rec.slices)  # MIG mode on demand, lazily
        if why:
            await self.give_up(alloc, rec, f"{reason}; cannot re-create: {why}" if reason else why)
            return None
        slices = list(rec.slices)
        marks["modes"] = self.clock.monotonic()
        for i, s in enumerate(slices):
            try:
                slices[i] = await self.make_slice(s, own.found.get((uid, i)))
            except NvmlFailure as exc:
                self.note_nvml(exc, s.gpu_index)
                if exc.call == CREATE_GI:
                    # NVML refused the GI: whatever sits at that placement is someone else's
                    # (it appeared after our check); the rollback must not claim it
                    slices[i] = replace(s, gi_id=NOT_OURS)
                self.st.put(replace(rec, slices=tuple(slices)))
                msg = (
                    f"creating slice {i} ({s.container}: {s.profile} on GPU {s.gpu_index} "
                    f"at {s.start}:{s.size}): {exc}"
                )
                await self.give_up(alloc, self.st.cp.claims[uid], msg)
                return None
        rec = replace(rec, slices=tuple(slices))
        self.st.put(rec)
        marks["nvml"] = self.clock.monotonic()
        try:
            await self.write_cdi(rec)
        except (cdi.CdiError, OSError) as exc:  # e.g. mig-minors lacks the new GI
            await self.give_up(alloc, rec, f"writing the CDI spec: {exc}")
            return None
        rec = replace(rec, state="ready", updated=time.time())
        self.st.put(rec)
        marks["cdi"] = self.clock.monotonic()
        await self.ready(alloc, rec, t0, persist=True, marks=marks, took=took)
        return None

    async def intent(
        self, alloc: SliceAllocation, rec: ClaimRecord | None, fresh: list[SliceRecord]
    ) -> tuple[ClaimRecord | str, list[Instance]]:
        """The create's intent record, on disk before NVML makes anything, and the GPUs'
        instances; or why not. Intent first, but only for placements that are free: an
        instance already at one is not ours, and a new record would otherwise claim it."""
        instances = await self.instances({s.gpu_index for s in fresh}, first=True)
        if rec is None:
            why = blocked(fresh, alloc.uid, instances, match(self.st.cp, instances))
            if why:
                return why, instances
        made = ClaimRecord(
            uid=alloc.uid,
            namespace=alloc.namespace,
            name=alloc.name,
            state="creating",
            slices=merge_plan(rec, fresh),
            boot_id=self.st.boot_id,
            updated=time.time(),
            announced=rec.announced if rec is not None else False,  # re-made: told once
        )
        self.st.put(made)
        await self.st.persist(durable=True)
        return made, instances

    async def make_slice(self, s: SliceRecord, inst: Instance | None) -> SliceRecord:
        """One slice: adopt what the record already claims, create only what is missing."""
        gpu = self.st.inv.gpu_by_uuid(s.gpu_uuid)
        assert gpu is not None
        if s.whole:  # nothing to create: MIG is off on it (ModeChanger.ensure)
            return replace(s, mig_uuid=gpu.uuid)
        prof = gpu.profile_by_id(s.profile_id)
        assert prof is not None
        if inst is not None and inst.ci_ids:
            return replace(s, gi_id=inst.gi_id, ci_id=inst.ci_ids[0], mig_uuid=inst.mig_uuids[0])
        model = self.catalog.model(gpu.model)
        known = model.profile_by_id(s.profile_id) if model else None
        hint = known.default_ci if known else None
        gi = None if inst is None else inst.gi_id
        i = s.gpu_index
        made = await self.gpus.call_gpu_first(
            i,
            _gi_ci_uuid,
            self.gpus.s,
            i,
            s.profile_id,
            s.start,
            s.size,
            gi,
            prof.slice_count,
            hint,
        )
        return replace(s, gi_id=made[0], ci_id=made[1], mig_uuid=made[2])

    async def ready(
        self,
        alloc: SliceAllocation,
        rec: ClaimRecord,
        t0: float,
        persist: bool = False,
        marks: dict[str, float] | None = None,
        took: dict[str, float] | None = None,
    ) -> None:
        """Status Ready (and, with `persist`, the record's `ready` written once that write is
        answered: nothing waits for the record, a restart that lost it finds a `creating`
        record whose slices exist and a Ready allocation, adopts them and says Ready again;
        see decide/verify). Not beside the write: the record's JSON on a worker thread held
        the interpreter while the write's answer waited for it (docs/benchmarks-history.md)."""
        slices: list[SliceStatus] = [
            {"container": s.container, "migUUID": str(s.mig_uuid), "gpuUUID": s.gpu_uuid}
            if s.whole  # the device the container sees is the GPU itself
            else {
                "container": s.container,
                "migUUID": str(s.mig_uuid),
                "giID": int(s.gi_id or 0),
                "ciID": int(s.ci_id or 0),
            }
            for s in rec.slices
        ]
        now = kube_time()
        uuids = ", ".join(f"{s['container']}: {s['migUUID']}" for s in slices)
        conds = with_condition(
            self.conditions(alloc), condition("Ready", True, "SlicesCreated", uuids, now)
        )
        gpu_idx = [s.gpu_index for s in rec.slices]
        conds = with_condition(conds, gpu_condition(self.st.health, gpu_idx, now))
        took = {} if took is None else took
        # the binding knows the slices before Ready is written: Ready ungates the pod, and a
        # kubelet's Allocate can follow within milliseconds (it was refused once, in the
        # window of the record's write, and the pod failed UnexpectedAdmissionError)
        await self.announce(alloc)
        write = self.status(alloc, status_ready(slices, self.st.boot_id, conds))
        await _timed(write, took, "ready_write", self.clock)
        if marks is not None:
            marks["ready"] = self.clock.monotonic()
        if persist:
            await _timed(self.st.persist(), took, "ready_record", self.clock)
        self.st.publish_soon(SLICES_LISTED_WITHIN_S)
        if rec.announced:
            return
        self.st.put(replace(rec, announced=True))
        self.metrics.creates.labels(self.st.node, "ready").inc()
        self.metrics.create_seconds.labels(self.st.node).observe(self.clock.monotonic() - t0)
        ms = round((self.clock.monotonic() - t0) * 1000, 1)
        log.info(
            "slices ready", claim=alloc.key, uuids=uuids, ms=ms, steps=_steps(t0, marks),
            took=took or None,
        )  # fmt: skip
        await writes.event(
            self.kube,
            alloc.namespace,
            alloc.pod_name,
            alloc.pod_uid,
            REASON_READY,
            f"{'whole GPUs' if all(s.whole for s in rec.slices) else 'MIG slices'} ready on "
            f"{self.st.node}: {uuids}",
        )

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
        await writes.event(
            self.kube, alloc.namespace, alloc.pod_name, alloc.pod_uid, REASON_LOST, msg,
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
            alloc.namespace,
            alloc.pod_name,
            alloc.pod_uid,
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
            await writes.event(
                self.kube, alloc.namespace, alloc.pod_name, alloc.pod_uid, REASON_IN_USE, msg, True
            )
        log.info("release waits: slice in use", claim=alloc.key, retry_s=delay)
        self.metrics.releases.labels(self.st.node, "in_use").inc()
        return delay
