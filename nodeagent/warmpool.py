"""Warm slices, the running part: keep them made, hand them over, get them out of the way.

One `WarmPool` per node (off unless `--warm-slices`; never in DRA mode). Its loop wakes on
a kick (an allocation asked, a slice released, a GC pass) and takes one step at a time
(nodeagent/warm.py `next_step`): make one warm slice, or destroy one. A make is recorded
(fsynced) before NVML, like a pod's slice, and queues on the GPU's NVML lane behind a pod's
create (nodeagent/lane.py: creates go first). A create asks the pool first (`clear_for`):
warm slices overlapping its placement, or on a GPU it needs whole, are destroyed, and a make
under way on its slots is waited for; the create's intent record then takes over a warm
slice at exactly its placement (`warm.hand_over`): no NVML call.

Eligible GPUs: in MIG mode (current and pending), healthy, not lost, no mode change recorded
or under way, not asked a mode by the MigNode spec, no whole-GPU record, and none at all
while the Node's resting mode is `disabled` (docs/nodeagent.md). A GPU that stops being
eligible has its warm slices destroyed. Not here: what to warm (warm.py decides).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace

import structlog

from nodeagent.checkpoint import ClaimRecord, SliceRecord
from nodeagent.create import Create, gi_ci_uuid
from nodeagent.model import MIG_DISABLED, MIG_ENABLED, NvmlFailure
from nodeagent.reconcile import overlaps
from nodeagent.warm import (
    Demand,
    Spot,
    in_the_way,
    is_warm,
    next_step,
    node_state,
    settle,
    targets,
    warm_record,
    warm_records,
)

log = structlog.get_logger("warm")

# With nothing asked, demand still ages out of the window: the pool looks again this often.
IDLE_LOOK_S = 30.0
# A create waits at most this long for a make under way on its slots.
MAKE_WAIT_S = 30.0


@dataclass(kw_only=True, eq=False)
class WarmPool:
    life: Create
    per_gpu: int = 1
    per_node: int = 2
    profiles: int = 2
    demand: Demand = field(default_factory=Demand)
    # GPU UUIDs the MigNode spec asks a mode of, and the Node's resting mode (the agent's)
    asked: Callable[[], Collection[str]] = lambda: ()
    idle_mode: Callable[[], str | None] = lambda: None
    kick: asyncio.Event = field(default_factory=asyncio.Event)
    making: str | None = None  # the warm record whose NVML make is under way
    _made: asyncio.Event = field(default_factory=asyncio.Event)

    # ---- hooks of a create (nodeagent/create.py) ---------------------------------------------

    def asked_for(self, fresh: Sequence[SliceRecord], taken: int) -> None:
        """A create's slices: demand noted, hits and misses counted, the pool kicked."""
        st, now = self.life.st, self.life.clock.monotonic()
        mig = [s for s in fresh if not s.whole]
        for s in mig:
            self.demand.note(s.profile, now)
        m = self.life.metrics.warm
        if taken:
            m.labels(st.node, "hit").inc(taken)
        if len(mig) > taken:
            m.labels(st.node, "miss").inc(len(mig) - taken)
        self.kick.set()

    def released(self) -> None:
        """Slots were freed: the allocator's next picks may have moved."""
        self.kick.set()

    async def clear_for(self, fresh: Sequence[SliceRecord]) -> None:
        """Before a create of `fresh`: a make under way on its slots ends first; warm slices
        overlapping it (but not exactly one of its slices) or on a GPU it needs whole are
        destroyed."""
        st = self.life.st
        while True:
            making = st.cp.claims.get(self.making or "")
            if making is not None and _touches(making, fresh):
                self._made.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(MAKE_WAIT_S):
                        await self._made.wait()
                continue
            way = in_the_way(st.cp, fresh)
            if not way:
                return
            for rec in way:
                log.info("warm slice in the way; destroying it", node=st.node, warm=rec.uid)
                await self._destroy(rec)

    # ---- the loop ----------------------------------------------------------------------------

    async def run(self) -> None:
        await self._settle()
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(IDLE_LOOK_S):
                    await self.kick.wait()
            self.kick.clear()
            try:
                while await self.step():
                    pass
            except NvmlFailure as exc:
                log.warning("warm slices: NVML failed", node=self.life.st.node, error=str(exc))

    async def _settle(self) -> None:
        """Warm records against NVML after a restart: made ones take their ids, the rest
        go (nodeagent/warm.py `settle`)."""
        st = self.life.st
        if not any(is_warm(r) for r in st.cp.claims.values()):
            return
        instances = await self.life.instances({g.index for g in st.inv.gpus})
        cp, dropped = settle(st.cp, instances)
        if dropped:
            log.info("warm records without an instance dropped", node=st.node, uids=dropped)
        now = self.life.clock.monotonic()
        for rec in warm_records(cp):  # they were made for a demand: it counts afresh
            self.demand.note(rec.slices[0].profile, now)
        st.set_checkpoint(cp)
        await st.persist()
        st.publish.set()

    def eligible(self) -> set[int]:
        st = self.life.st
        if self.idle_mode() == MIG_DISABLED:
            return set()
        asked = set(self.asked())
        whole = {s.gpu_uuid for r in st.cp.claims.values() for s in r.slices if s.whole}
        return {
            g.index
            for g in st.inv.gpus
            if g.mig_current == MIG_ENABLED
            and g.mig_pending == MIG_ENABLED
            and st.healthy(g.index)
            and not st.is_lost(g.index)
            and g.uuid not in st.cp.mode_changes
            and g.uuid not in st.mode_phase
            and g.uuid not in asked
            and g.uuid not in whole
        }

    def plan(self) -> list[Spot]:
        """Where warm slices belong now (nodeagent/warm.py `targets`), the slices of every
        allocation this agent has seen counted as taken (a create not yet recorded)."""
        st = self.life.st
        elig = self.eligible()
        wanted = self.demand.wanted(self.life.clock.monotonic(), self.profiles, self.per_node)
        if not wanted or not elig:
            return []
        state = node_state(st.node, st.inv, st.cp, st.foreign, elig, self.promised())
        return targets(state, wanted, self.per_gpu, self.per_node, self.life.catalog)

    def promised(self) -> list[tuple[str, int, int, str]]:
        """The MIG slices of every allocation this agent has seen: (GPU UUID, start, size,
        profile); a create not recorded yet holds its slots already."""
        return [
            (str(x.get("gpuUUID", "")), int(x.get("start", 0)), int(x.get("size", 1)),
             str(x.get("profile", "")))
            for obj in self.life.st.allocs.values()
            for x in (obj.get("spec") or {}).get("slices") or []
            if x.get("kind", "mig") != "gpu"
        ]  # fmt: skip

    def promised_spots(self) -> set[Spot]:
        st = self.life.st
        out = set()
        for uuid, start, size, profile in self.promised():
            gpu = st.inv.gpu_by_uuid(uuid)
            if gpu is not None:
                out.add(Spot(gpu.index, profile, start, size))
        return out

    async def step(self) -> bool:
        """One change towards the plan; False when nothing is to change."""
        st = self.life.st
        todo = next_step(st.cp, self.plan(), self.eligible(), self.per_node, self.promised_spots())
        if todo is None:
            return False
        if todo.kind == "destroy":
            rec = st.cp.claims.get(todo.uid)
            if rec is not None:
                log.info("destroying a warm slice", node=st.node, warm=rec.uid, why=todo.why)
                await self._destroy(rec)
            return True
        assert todo.spot is not None
        return await self._make(todo.spot)

    async def _make(self, spot: Spot) -> bool:
        life, st = self.life, self.life.st
        gpu = st.inv.gpu_by_index(spot.gpu_index)
        prof = gpu.profile(spot.profile) if gpu is not None else None
        if gpu is None or prof is None:
            return False
        rec = warm_record(gpu, spot.profile, prof.id, spot.start, spot.size, st.boot_id)
        st.put(rec)
        await st.persist(durable=True)  # the intent, on disk before NVML makes anything
        model = life.catalog.model(gpu.model)
        known = model.profile_by_id(prof.id) if model else None
        self.making = rec.uid
        hint = known.default_ci if known else None
        try:
            # two trips to the GPU's NVML lane, GI then CI: a pod's create queued meanwhile
            # goes between them (nodeagent/lane.py), waiting for one call, not both
            nv, i = life.gpus.s, gpu.index
            gi = await life.gpus.call_gpu(i, nv.create_gi, i, prof.id, spot.start, spot.size)
            gi, ci, uuid = await life.gpus.call_gpu(
                i, gi_ci_uuid, nv, i, prof.id, spot.start, spot.size, gi, prof.slice_count, hint
            )
        except NvmlFailure as exc:
            life.note_nvml(exc, gpu.index)
            log.warning("could not make a warm slice", node=st.node, warm=rec.uid, error=str(exc))
            await self._destroy(st.cp.claims.get(rec.uid, rec))  # whatever was made of it
            return False
        finally:
            self.making = None
            self._made.set()
        s = replace(rec.slices[0], gi_id=gi, ci_id=ci, mig_uuid=uuid)
        st.put(replace(rec, slices=(s,)))
        await st.persist()
        st.publish.set()
        life.metrics.warm.labels(st.node, "made").inc()
        log.info("warm slice made", node=st.node, warm=rec.uid, profile=spot.profile)
        return True

    async def _destroy(self, rec: ClaimRecord) -> None:
        if await self.life.rollback(rec):
            self.life.metrics.warm.labels(self.life.st.node, "destroyed").inc()


def _touches(rec: ClaimRecord, fresh: Sequence[SliceRecord]) -> bool:
    w = rec.slices[0]
    return any(
        s.gpu_uuid == w.gpu_uuid and (s.whole or overlaps(s.start, s.size, w.start, w.size))
        for s in fresh
    )
