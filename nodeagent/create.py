"""Making an allocation's slices: create → Ready (nodeagent/lifecycle.py says when).

plan (pure) → check the placements are free → write the intent record → bring each GPU to
the MIG mode its slices need (`modechange`) → per slice: GI at exactly the placement (or
adopt the one the record claims), its default CI, MIG UUID by walking MIG handles → CDI
file → status Ready → record `ready` + pod event. On an NVML error: destroy what the record
holds, drop it, status Failed with the NVML error (`LifeBase.give_up`).

`Creating` is optional (docs/contract.md §3): written only once a create has taken
`creating_after_s` (`LateCreating`), and before anything is made only where the agent's view
of the allocation may be stale — one found by its first list (the allocator may be moving it
off a node whose agent was down, docs/allocator.md) or a re-create. A fresh allocation the
watch brought goes without it: one write and one link fewer on a pod's path. The write was
also the check that the allocation still exists; without it, the `Ready` write is: an
allocation found gone by either write has what was made destroyed (`gone`).

A create whose slots a release still holds waits for it here, outside the GPU's NVML lane
(`wait_for_releases`; nodeagent/lane.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol, TypeVar

import structlog

from common.allocation import SliceAllocation
from common.clock import Clock, kube_time, wait_or_sleep
from common.conditions import condition, with_condition
from common.constants import REASON_READY
from common.objects import Phase, SliceStatus
from nodeagent import cdi, writes
from nodeagent.checkpoint import ClaimRecord, SliceRecord
from nodeagent.lifebase import LifeBase
from nodeagent.model import Instance, NvmlFailure
from nodeagent.nvml import NvmlSession
from nodeagent.reconcile import blocked, held_by_release, match, merge_plan, plan
from nodeagent.report import gpu_condition, status_creating, status_ready
from nodeagent.state import AgentNode
from nodeagent.warm import WarmHooks, hand_over, warm_records

log = structlog.get_logger("lifecycle")  # one logger name for the whole life
A = TypeVar("A")
B = TypeVar("B")


class Claimed(Protocol):
    """What an intent record names: a SliceAllocation, or a ResourceClaim (DRA mode)."""

    @property
    def uid(self) -> str: ...
    @property
    def namespace(self) -> str: ...
    @property
    def name(self) -> str: ...


CREATE_GI = "nvmlDeviceCreateGpuInstanceWithPlacement"
NOT_OURS = -1  # a GI id no instance has: the slice claims nothing
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


gi_ci_uuid = _gi_ci_uuid  # the warm pool's makes (nodeagent/warmpool.py) take the same trip


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


class LateCreating:
    """`Creating`, written only once a create has taken `after_s` (docs/protocol.md): a fast
    create says nothing until `Ready`. `settled` waits for a write already under way (so
    `Ready` is never overtaken by it) and says whether the allocation was still there;
    `finish` drops the timer if it has not fired."""

    def __init__(
        self, write: Callable[[], Awaitable[bool]], after_s: float, clock: Clock, key: str
    ) -> None:
        self._writing = False
        self._task = asyncio.ensure_future(self._after(write, after_s, clock, key))

    async def _after(
        self, write: Callable[[], Awaitable[bool]], after_s: float, clock: Clock, key: str
    ) -> bool:
        await clock.sleep(after_s)
        self._writing = True
        log.info("create takes long; Creating written", claim=key, after_s=after_s)
        return await write()

    async def settled(self) -> bool:
        """False when the write ran and found the allocation gone; an API error raises."""
        if not self._writing:
            self._task.cancel()
            return True
        return await self._task

    async def finish(self) -> None:
        """The timer stopped; a write under way ended (its outcome is `settled`'s to use)."""
        if not self._writing:
            self._task.cancel()
        await asyncio.wait((self._task,))
        if not self._task.cancelled():
            self._task.exception()  # retrieved: `settled` raised it where it mattered


@dataclass(kw_only=True, eq=False)
class Create(LifeBase):
    # claims whose wait for a release ran RELEASE_WAIT_S: the next create goes on at once
    waited_out: set[str] = field(default_factory=set)
    # warm slices (nodeagent/warmpool.py): cleared out of a create's way, handed over to it
    warm: WarmHooks | None = None

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
        if self.warm is not None and rec is None:
            await self.warm.clear_for(fresh)
        if await self.waited_for_releases(alloc, fresh):
            return AFTER_RELEASE_WAIT_S
        took: dict[str, float] = {}
        intent = _timed(self.intent(alloc, rec, fresh, took), took, "intent_record", self.clock)
        late: LateCreating | None = None
        if reason or (alloc.phase != Phase.CREATING and uid not in self.st.live_added):
            # A view that may be stale (or a re-create): the Creating status first, as the
            # check that the allocation still exists, side by side with the intent record (an
            # API round trip beside a placement check and an fsync): both are done before NVML
            # makes anything, which is all their order has to guarantee.
            write = self.status(alloc, status_creating(reason))
            creating = _timed(write, took, "creating_write", self.clock)
            alive, (made, instances) = await _both(creating, intent)
        elif alloc.phase == Phase.CREATING:  # said already (a create resumed)
            alive, (made, instances) = True, await intent
        else:  # a fresh allocation: Creating is said only when making it takes long
            late = LateCreating(
                lambda: self.status(alloc, status_creating()),
                self.settings.creating_after_s,
                self.clock,
                alloc.key,
            )
            alive = True
        try:
            if late is not None:
                made, instances = await intent
            marks = {"intent": self.clock.monotonic()}  # phase ends, for the "slices ready" log
            if not alive:  # deleted meanwhile (moved off while the agent was down): make nothing
                if rec is None and isinstance(made, ClaimRecord):
                    self.st.drop(uid)  # the record written beside the status write claims nothing
                    await self.st.persist()
                return None
            await self._make(alloc, rec, made, instances, reason, t0, marks, took, late)
        finally:
            if late is not None:
                # A late Creating under way is awaited before Ready is written (`settled`); one
                # landing after a Failed write is answered with Failed again (reconcile.decide)
                await late.finish()
        return None

    async def _make(
        self,
        alloc: SliceAllocation,
        rec: ClaimRecord | None,
        made: ClaimRecord | str,
        instances: list[Instance],
        reason: str,
        t0: float,
        marks: dict[str, float],
        took: dict[str, float],
        late: LateCreating | None,
    ) -> None:
        """The create past its intent record: check, make, write the CDI file, say Ready."""
        uid = alloc.uid
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
        if late is not None and not await late.settled():  # its write found the allocation gone
            await self.gone(alloc, rec)
            return None
        await self.ready(alloc, rec, t0, persist=True, marks=marks, took=took)
        return None

    async def gone(self, alloc: SliceAllocation, rec: ClaimRecord) -> None:
        """The allocation was deleted while its slices were made (a status write found it
        gone): destroy them, remove the CDI file, drop the record, tell the binding. What
        NVML refuses stays `releasing` for garbage collection (`rollback`)."""
        log.info("allocation gone while its slices were made; destroying them", claim=alloc.key)
        if await self.rollback(rec):
            await self.binding.slices_released(alloc.namespace, alloc.name, alloc.uid)

    async def intent(
        self,
        alloc: Claimed,
        rec: ClaimRecord | None,
        fresh: list[SliceRecord],
        took: dict[str, float] | None = None,
    ) -> tuple[ClaimRecord | str, list[Instance]]:
        """The create's intent record, on disk before NVML makes anything, and the GPUs'
        instances; or why not. Intent first, but only for placements that are free: an
        instance already at one is not ours, and a new record would otherwise claim it.
        Without a record yet and nothing handed over, the GIs alone say that (an instance at a
        placement fails the create; none is adopted): the scan skips the MIG walk for their
        CIs, most of its NVML calls (issue 37)."""
        took = {} if took is None else took
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
        warm = any(True for _ in warm_records(self.st.cp))  # a handover adopts their CIs
        gpus = {s.gpu_index for s in fresh}
        scan = self.instances(gpus, first=True, with_cis=rec is not None or warm)
        instances = await _timed(scan, took, "scan", self.clock)
        # a warm slice at exactly a planned placement becomes this claim's in the same
        # checkpoint change that records the claim (nodeagent/warm.py): no NVML call
        cp, taken = hand_over(self.st.cp, made)
        if rec is None:  # placements free, but for the instances handed over
            handed = {
                (s.gpu_uuid, s.gi_id) for s in cp.claims[alloc.uid].slices if s.gi_id is not None
            }
            rest = [i for i in instances if i.key not in handed]
            why = blocked(fresh, alloc.uid, rest, match(cp.without(alloc.uid), rest))
            if why:
                return why, instances
        if taken:  # the warm records' drop must be on disk with the claim: the whole snapshot
            self.st.set_checkpoint(cp)
            await _timed(self.st.persist(durable=True), took, "intent_write", self.clock)
        else:  # the claim alone: one journal line (nodeagent/state.py persist_intent)
            await _timed(self.st.persist_intent(made), took, "intent_write", self.clock)
        if self.warm is not None and rec is None:
            self.warm.asked_for(fresh, taken)
        return self.st.cp.claims[alloc.uid], instances

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
        # due before the Ready write, not after it: an agent stopped once Ready is seen (its
        # write's answer or the record's persist still out) lists the slices as it stops
        self.st.publish_soon(SLICES_LISTED_WITHIN_S)
        write = self.status(alloc, status_ready(slices, self.st.boot_id, conds))
        if not await _timed(write, took, "ready_write", self.clock):
            await self.gone(alloc, rec)  # deleted meanwhile: nothing may outlive it
            return
        if marks is not None:
            marks["ready"] = self.clock.monotonic()
        if persist:
            await _timed(self.st.persist(), took, "ready_record", self.clock)
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
            alloc,
            REASON_READY,
            f"{'whole GPUs' if all(s.whole for s in rec.slices) else 'MIG slices'} ready on "
            f"{self.st.node}: {uuids}",
        )
