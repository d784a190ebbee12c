"""Carrying out a MIG mode change on one GPU, as a step of realising an allocation.

Order (docs/nodeagent.md "MIG mode on demand"; docs/style.md §6): `modes.mode_problem` says the
agent may change it at all → the intent record (`checkpoint.ModeIntent`), fsynced → in the
GPU's own NVML queue: re-check that no process (and, when disabling, no GPU instance) is on
it, SetMigMode, verify GetMigMode, read the GPU afresh (minor number, profiles, placements
may change) → drop the intent → republish MigNode. A failure marks the GPU for
`modes.BACKOFF_S` (MigNode `modeChange.phase: Failed`), so the allocator places elsewhere
and nobody loops on it. RESET_REQUIRED on a GPU believed reset-less marks it `none` for
the life of the process (a VM guest).

What it does not do: reset a GPU (Ampere), or change a mode nobody asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Collection
from dataclasses import dataclass, field

import structlog

from common.clock import Clock, SystemClock, kube_time
from nodeagent import modes
from nodeagent.checkpoint import ModeIntent, SliceRecord
from nodeagent.device import NodeGpus
from nodeagent.metrics import AgentMetrics
from nodeagent.model import (
    MIG_DISABLED,
    MIG_ENABLED,
    NVML_RESET_REQUIRED,
    GpuInfo,
    NvmlFailure,
)
from nodeagent.nvml import NvmlSession
from nodeagent.state import AgentNode

log = structlog.get_logger("modechange")


class NotIdle(Exception):
    """The re-check right before SetMigMode found the GPU busy."""


def toggle_now(s: NvmlSession, index: int, target: str) -> GpuInfo:
    """In the GPU's NVML queue: re-check, set, verify, re-read. Idempotent: a GPU already in
    `target` is only re-read."""
    if s.mig_mode(index) == (target, target):
        return s.gpu_info(index)
    processes = s.compute_processes(index)
    instances = s.instances(s.gpu_info(index)) if target != MIG_ENABLED else []
    why = modes.idle_problem(index, target, processes, instances)
    if why:
        raise NotIdle(why)
    try:
        return s.set_mig_mode(index, target)
    except NvmlFailure as exc:
        if exc.code == NVML_RESET_REQUIRED:
            # only pending now (a VM guest): take it back, so that no later reset or reboot
            # surprises anyone with a mode nobody serves
            with contextlib.suppress(NvmlFailure):
                s.set_mig_mode(index, s.mig_mode(index)[0])
        raise


def _fresh(s: NvmlSession, gpu: GpuInfo) -> GpuInfo | None:
    """`gpu` with its current MIG mode and process count; read whole again when the mode
    changed (profiles and the minor number may have). None when nothing changed."""
    mode = s.mig_mode(gpu.index)
    processes = s.compute_processes(gpu.index)
    if mode != (gpu.mig_current, gpu.mig_pending):
        return s.gpu_info(gpu.index)
    if processes != gpu.compute_processes:
        return dataclasses.replace(gpu, compute_processes=processes)
    return None


@dataclass(kw_only=True, eq=False)
class ModeChanger:
    st: AgentNode
    gpus: NodeGpus
    metrics: AgentMetrics
    clock: Clock = field(default_factory=SystemClock)
    # one change of a GPU's mode at a time, whoever asks (an allocation, the resting mode,
    # maintenance): the asker re-reads the GPU's mode under the lock
    locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    idle_since: dict[str, float] = field(default_factory=dict)  # GPU UUID → monotonic

    def lock(self, uuid: str) -> asyncio.Lock:
        return self.locks.setdefault(uuid, asyncio.Lock())

    def toggle_of(self, gpu: GpuInfo) -> modes.Toggle:
        return modes.toggle(gpu, gpu.uuid in self.st.toggle_refused)

    def can_enable(self, gpu: GpuInfo) -> bool:
        """May this GPU serve MIG slices after a change the agent makes itself? (capacity:
        a fixed upper bound, so a passing back-off does not count)."""
        return gpu.mig_enabled or (
            gpu.mig_current == gpu.mig_pending and self.toggle_of(gpu) == "resetless"
        )

    def can_be_whole(self, gpu: GpuInfo) -> bool:
        """May this GPU serve as a whole GPU (MIG off now, or turned off by this agent)?"""
        off = gpu.mig_current == gpu.mig_pending == MIG_DISABLED
        return off or (gpu.mig_current == gpu.mig_pending and self.toggle_of(gpu) == "resetless")

    def status(self) -> dict[str, modes.Obj]:
        """GPU UUID → the mode fields of its MigNode entry (`modes.mode_status`)."""
        now = self.clock.monotonic()
        st = self.st
        return {
            g.uuid: modes.mode_status(
                self.toggle_of(g),
                st.mode_failures.get(g.uuid),
                st.mode_changed.get(g.uuid),
                g.uuid in st.cp.mode_changes,
                now,
                phase=st.mode_phase.get(g.uuid),
            )
            for g in st.inv.gpus
        }

    def problem(self, gpu: GpuInfo, target: str) -> str | None:
        """Why `gpu` cannot be brought to `target` by this agent now (pure check)."""
        failure = self.st.mode_failures.get(gpu.uuid)
        now = self.clock.monotonic()
        return modes.mode_problem(gpu, target, self.toggle_of(gpu), failure, now)

    async def ensure(self, uid: str, slices: tuple[SliceRecord, ...]) -> str | None:
        """Bring every GPU the slices use to the mode they need; why not, or None."""
        for uuid, target in sorted(modes.needed_modes(slices).items()):
            async with self.lock(uuid):  # a resting change may be running: read after it
                gpu = self.st.inv.gpu_by_uuid(uuid)
                if gpu is None:
                    return f"GPU {uuid} is not on node {self.st.node}"
                if modes.in_mode(gpu, target):
                    continue
                why = await self.change(gpu, target, uid)
            if why:
                return why
        return None

    async def rest(self, target: str | None, after_s: float, asked: Collection[str] = ()) -> None:
        """The resting mode (docs/nodeagent.md): bring each reset-less GPU that has been
        idle (no allocation, record, instance or process on it) for longer than `after_s`
        to `target`. Checked again under the GPU's lock; the change itself re-checks NVML
        for processes and instances right before SetMigMode. `asked`: GPUs whose MigNode asks
        a mode (desiredMigMode wins over the resting mode: never the two in turn)."""
        now = self.clock.monotonic()
        busy = self.busy_now() | set(asked)
        for g in self.st.inv.gpus:
            if g.uuid in busy or g.compute_processes or self.st.is_lost(g.index):
                self.idle_since.pop(g.uuid, None)
                continue
            idle_for = now - self.idle_since.setdefault(g.uuid, now)
            if modes.rest_target(g, target, self.toggle_of(g), False, idle_for, after_s) is None:
                continue
            async with self.lock(g.uuid):
                gpu = self.st.inv.gpu_by_uuid(g.uuid)
                if gpu is None or target is None or g.uuid in self.busy_now():
                    continue  # an allocation arrived meanwhile
                if modes.in_mode(gpu, target) or self.problem(gpu, target) is not None:
                    continue  # changed meanwhile, or failed within the back-off
                log.info("GPU idle: resting MIG mode", gpu=gpu.index, mode=target)
                await self.change(gpu, target, modes.RESTING_CLAIM)

    def busy_now(self) -> set[str]:
        """GPU UUIDs an allocation (any phase), a record or an instance is on."""
        st = self.st
        busy = {s.gpu_uuid for r in st.cp.claims.values() for s in r.slices}
        for obj in st.allocs.values():
            for s in (obj.get("spec") or {}).get("slices") or []:
                busy.add(str(s.get("gpuUUID", "")))
        for f in st.foreign:
            g = st.inv.gpu_by_index(f.gpu_index)
            if g is not None:
                busy.add(g.uuid)
        return busy

    async def change(self, gpu: GpuInfo, target: str, uid: str) -> str | None:
        why = self.problem(gpu, target)
        if why:
            return why
        st = self.st
        st.set_checkpoint(st.cp.with_mode_intent(ModeIntent(gpu.uuid, gpu.index, target, uid)))
        await st.persist(durable=True)  # the intent, on disk before SetMigMode
        before = gpu.mig_current
        try:
            fresh = await self.gpus.call_gpu(gpu.index, toggle_now, self.gpus.s, gpu.index, target)
        except NotIdle as exc:
            return await self.failed(gpu, target, str(exc))
        except NvmlFailure as exc:
            self.metrics.nvml_errors.labels(st.node, exc.call, exc.code_name).inc()
            if exc.code == NVML_RESET_REQUIRED:
                st.toggle_refused.add(gpu.uuid)  # never again in this process: no loop
                return await self.failed(gpu, target, f"{exc}: a GPU reset would be needed")
            return await self.failed(gpu, target, str(exc))
        st.replace_gpu(fresh)
        st.mode_failures.pop(gpu.uuid, None)
        if before != fresh.mig_current:
            st.mode_changed[gpu.uuid] = modes.ModeChanged(before, fresh.mig_current, kube_time())
        st.set_checkpoint(st.cp.without_mode_intent(gpu.uuid))
        await st.persist()
        st.publish.set()
        self.metrics.mode_changes.labels(st.node, target, "done").inc()
        log.info("MIG mode changed", gpu=gpu.index, mode=target, claim_uid=uid)
        return None

    async def failed(self, gpu: GpuInfo, target: str, message: str, reason: str = "") -> str:
        st = self.st
        until = self.clock.monotonic() + modes.BACKOFF_S
        failure = modes.ModeFailure(target, message, kube_time(), until, reason)
        st.mode_failures[gpu.uuid] = failure
        st.set_checkpoint(st.cp.without_mode_intent(gpu.uuid))
        await st.persist()
        st.publish.set()
        # MigNode shows the failure for the back-off; republish when it ends
        asyncio.get_running_loop().call_later(modes.BACKOFF_S, st.publish.set)
        self.metrics.mode_changes.labels(st.node, target, "failed").inc()
        log.warning(
            "MIG mode change failed; GPU avoided", gpu=gpu.index, mode=target, error=message
        )
        return f"changing MIG mode of GPU {gpu.index} to {target}: {message}"

    async def refresh(self) -> None:
        """Re-read each GPU's MIG mode and compute processes (garbage collection's rescan):
        a mode changed underneath the agent (an admin, a reset) is read afresh, with its
        profiles and minor number, and published. GPUs with a change in flight are skipped."""
        st = self.st
        for g in st.inv.gpus:
            if st.is_lost(g.index) or g.uuid in st.cp.mode_changes:
                continue
            fresh = await self.gpus.call_gpu(g.index, _fresh, self.gpus.s, g)
            current = st.inv.gpu_by_index(g.index)
            if fresh is None or current is None or current.uuid in st.cp.mode_changes:
                continue
            if (fresh.mig_current, fresh.mig_pending, fresh.compute_processes) != (
                current.mig_current,
                current.mig_pending,
                current.compute_processes,
            ):
                if fresh.mig_current != current.mig_current:
                    log.warning(
                        "MIG mode changed outside InstaSlice",
                        gpu=g.index,
                        mode=fresh.mig_current,
                        pending=fresh.mig_pending,
                    )
                st.replace_gpu(fresh)
                st.publish.set()

    async def resolve_intents(self) -> None:
        """At start: intents a crash left behind. The mode is whatever GetMigMode says now
        (`st.inv` was just read); the allocation's create repeats the change if still needed."""
        st = self.st
        if not st.cp.mode_changes:
            return
        for intent in list(st.cp.mode_changes.values()):
            gpu = st.inv.gpu_by_uuid(intent.gpu_uuid)
            done = gpu is not None and modes.in_mode(gpu, intent.target)
            log.warning(
                "MIG mode change intent found at start",
                gpu=intent.gpu_index,
                target=intent.target,
                claim_uid=intent.claim,
                state="completed" if done else "not done; the allocation's create repeats it",
            )
            st.set_checkpoint(st.cp.without_mode_intent(intent.gpu_uuid))
        await st.persist(durable=True)
