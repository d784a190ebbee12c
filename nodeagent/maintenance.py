"""Ampere maintenance: a MIG mode change that needs a GPU reset, asked for, never per pod.

On Ampere (A100, A30) `SetMigMode` only makes the mode pending; a GPU reset applies it, and
a reset is refused while any driver client (DCGM, dcgm-exporter, persistenced) holds the GPU
(MIG user guide, "deployment considerations"). So this is not part of realising an
allocation: the MigNode's `spec.gpus[].desiredMigMode` asks for it (written by the allocator
under `--ampere-mode-changes=drain`, or by an admin), and the agent carries it out here, for
the asked GPUs whose mode only a reset changes (docs/nodeagent.md "Ampere maintenance"):

1. Drain: the allocator stops placing on a GPU that has a desired mode (docs/allocator.md);
   the agent waits (MigNode `modeChange.phase: Draining`, checked with each GC pass) until no
   SliceAllocation, record, instance or compute process is on it — for a GPU that needs a
   reset (Ampere), at most `--maintenance-drain-timeout-s`; a reset-less (Hopper) ask waits
   as long as the work runs. Nothing is evicted: a drain that runs out gives the ask up
   (`modeChange.phase: Failed`, `reason: DrainTimedOut`, naming what is still on the GPU; a
   Warning event `MigModeDrainTimedOut` on the MigNode), the GPU serves its current mode
   again, and the same ask is not carried out again until it is written anew. (Only
   `kubectl drain --timeout`'s giving up compares: kubectl drain does evict, and this
   drain never does.) The drain's start and the give-up are kept in the checkpoint
   (`checkpoint.DrainClock`): a restarted agent neither starts the clock afresh nor
   carries out an ask it gave up.
2. The intent record (`checkpoint.MaintenanceIntent`: the targets and the GPU Operator
   labels as they were), fsynced, before anything is touched.
3. Pause the Operator's clients on this node through its own labels:
   `nvidia.com/gpu.deploy.<component>=paused-for-mig-change` for each component label that
   is present and not `false` — NVIDIA's MIG Manager does the same
   (NVIDIA/mig-parted@bd7160f4 pkg/mig/reconfigure/reconfigure.go:L42-46 the labels,
   L371-385 `shutdownKubernetesGPUClients`, L581-586 `maybeSetPaused`).
4. Per GPU, in its NVML queue: re-check idle, `SetMigMode` (pending), reset (retried while a
   client still holds the GPU, up to `--maintenance-wait-s`: the agent may not list pods, so
   it waits for the reset to be accepted rather than for the Operator's pods to go), verify
   `GetMigMode == (target, target)`, read the GPU afresh.
5. Restore the labels exactly as they were (MIG Manager sets `true`; we put back what was
   there), drop the record, republish MigNode.

A failure takes the pending mode back, restores the labels and marks the GPU for the
back-off (`modeChange.phase: Failed`); a refused reset in a VM marks it `modeToggle: none`.
Never a loop: nothing is retried within the back-off, and the allocator withdraws its ask
when it sees the failure. A record found at start (a crash mid-way) restores the labels and
takes back a pending mode before anything else; the desired mode, if still asked, is then
carried out again from the start.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import structlog

from common.clock import Clock, SystemClock, kube_time
from common.constants import DRAIN_TIMED_OUT as GIVEN_UP_REASON
from common.constants import EventReason
from common.kubeapi import ApiError, Kube
from common.objects import desired_modes
from nodeagent import modes, writes
from nodeagent.checkpoint import DrainClock, MaintenanceIntent
from nodeagent.device import NodeGpus
from nodeagent.modechange import ModeChanger, NotIdle
from nodeagent.model import MIG_DISABLED, MIG_ENABLED, NVML_RESET_REQUIRED, GpuInfo, NvmlFailure
from nodeagent.nvml import NvmlSession
from nodeagent.state import AgentNode

log = structlog.get_logger("maintenance")

# NVIDIA/mig-parted@bd7160f4 pkg/mig/reconfigure/reconfigure.go:L42-46, in its order
OPERATOR_COMPONENTS = ("device-plugin", "gpu-feature-discovery", "dcgm-exporter", "dcgm", "nvsm")
DEPLOY_LABEL_PREFIX = "nvidia.com/gpu.deploy."
PAUSED = "paused-for-mig-change"
DESIRED_CLAIM = "desired-mig-mode"  # the `claim` of a reset-less change's intent record
DRAIN_TIMED_OUT = (
    EventReason.MIG_MODE_DRAIN_TIMED_OUT
)  # the Warning event's reason (docs/contract.md)


class ResetRefused(Exception):
    """The GPU reset did not happen (a client holds the GPU, or resets are not supported)."""

    def __init__(self, message: str, *, final: bool = False) -> None:
        super().__init__(message)
        self.final = final  # retrying cannot help (a VM guest: "not supported")


Reset = Callable[[int], None]  # GPU index → reset it, or raise ResetRefused


# ---- pure ------------------------------------------------------------------------------------


def to_pause(labels: Mapping[str, str]) -> dict[str, str]:
    """The Operator component labels to pause, with their values now: those present and not
    `false` (an admin forced that one off; MIG Manager leaves it too) nor paused already."""
    out = {}
    for c in OPERATOR_COMPONENTS:
        key = DEPLOY_LABEL_PREFIX + c
        if key in labels and labels[key] not in ("false", PAUSED):
            out[key] = labels[key]
    return out


def due(
    desired: Mapping[str, str],
    gpus: tuple[GpuInfo, ...],
    toggle: Callable[[GpuInfo], modes.Toggle],
    failures: Mapping[str, modes.ModeFailure],
    now: float,
) -> dict[str, str]:
    """GPU UUID → target of the asked changes this path carries out now: GPUs whose mode
    a reset changes (or a reset-less change: an admin's ask on a Hopper GPU is simply
    carried out), not there yet, not failed within the back-off."""
    out = {}
    for g in gpus:
        target = desired.get(g.uuid)
        if target is None or toggle(g) == "none" or modes.in_mode(g, target):
            continue
        failure = failures.get(g.uuid)
        if failure is not None and now < failure.until:
            continue
        out[g.uuid] = target
    return out


def drain_clocks(
    draining: Mapping[str, str],
    started: Mapping[str, tuple[str, float]],
    now: float,
    timeout_s: float,
) -> tuple[dict[str, tuple[str, float]], set[str]]:
    """The drain clocks to keep (GPU UUID → (target, wall-time start)) for the GPUs draining
    now (UUID → target), and those whose drain has run `timeout_s` or longer (0: never). A
    GPU that stopped draining, or whose target changed, starts afresh."""
    clocks = {}
    for uuid, target in draining.items():
        was = started.get(uuid)
        clocks[uuid] = was if was is not None and was[0] == target else (target, now)
    if timeout_s <= 0:
        return clocks, set()
    return clocks, {u for u, (_, since) in clocks.items() if now - since >= timeout_s}


# ---- in a GPU's NVML queue -------------------------------------------------------------------


def reset_into(s: NvmlSession, index: int, target: str, reset: Reset, wait_s: float) -> GpuInfo:
    """Re-check idle, make `target` pending, reset (retried while refused, up to `wait_s`),
    verify; the GPU read afresh. On failure the pending mode is taken back."""
    current, pending = s.mig_mode(index)
    if (current, pending) == (target, target):
        return s.gpu_info(index)
    processes = s.compute_processes(index)
    instances = s.instances(s.gpu_info(index)) if current == MIG_ENABLED else []
    why = modes.idle_problem(index, MIG_DISABLED, processes, instances)
    if why:
        raise NotIdle(why)
    try:
        s.set_mig_mode(index, target)
    except NvmlFailure as exc:
        if exc.code != NVML_RESET_REQUIRED:  # the expected answer on Ampere
            raise
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                reset(index)
                break
            except ResetRefused as exc:
                if exc.final or time.monotonic() >= deadline:
                    raise
                time.sleep(min(1.0, wait_s / 10))
        s.forget(index)  # the handle may not survive a reset
        now = s.mig_mode(index)
        if now != (target, target):
            raise ResetRefused(f"MIG mode is {now[0]} (pending {now[1]}) after the reset")
    except Exception:
        with contextlib.suppress(NvmlFailure):
            s.forget(index)
            cur = s.mig_mode(index)[0]
            s.call("nvmlDeviceSetMigMode", s.handle(index), 1 if cur == MIG_ENABLED else 0)
        raise
    return s.gpu_info(index)


# ---- the shell --------------------------------------------------------------------------------


@dataclass(kw_only=True, eq=False)
class Maintenance:
    st: AgentNode
    gpus: NodeGpus
    kube: Kube
    changer: ModeChanger
    reset: Reset | None  # None: this node cannot reset GPUs (nothing is done)
    wait_s: float = 300.0
    drain_timeout_s: float = 1800.0  # 0: a drain waits as long as the workload runs
    clock: Clock = field(default_factory=SystemClock)
    desired: dict[str, str] = field(default_factory=dict)  # from the MigNode's spec
    # drain_clocks, by wall time (they outlive a restart: the checkpoint's `drains`)
    drains: dict[str, tuple[str, float]] = field(default_factory=dict)
    # GPU UUID → an ask whose drain ran out: not carried out again while the MigNode asks the
    # same (an ask removed, or changed, is forgotten here); in the checkpoint too
    given_up: dict[str, DrainClock] = field(default_factory=dict)
    kick: asyncio.Event = field(default_factory=asyncio.Event)
    restored: bool = False  # drains and given_up read from the checkpoint (once, at start)
    steps: int = 0  # steps ended, failed ones too (a test's proof that one had its chance)
    generation: int = 0  # the MigNode's metadata.generation last read
    observed_generation: int = 0  # the last one a step carried out (or had nothing to do for)

    def on_mig_node(self, obj: Mapping[str, object]) -> None:
        desired = desired_modes(obj)
        meta = obj.get("metadata")
        generation = meta.get("generation") if isinstance(meta, dict) else None
        self.generation = generation if isinstance(generation, int) else 0
        # a recorded drain or give-up is checked against every spec (an ask removed while
        # the agent was down is forgotten then, not when it is written anew)
        if desired != self.desired or self.st.cp.drains:
            self.desired = desired
            self.kick.set()
        elif not self.kick.is_set():  # nothing to carry out: observed as read
            self.observed_generation = max(self.observed_generation, self.generation)

    def restore(self) -> None:
        """The drain clocks and given-up asks from the checkpoint, once it is loaded."""
        if self.restored:
            return
        self.restored = True
        for uuid, rec in self.st.cp.drains.items():
            if rec.given_up:
                self.given_up[uuid] = rec
            else:
                self.drains[uuid] = (rec.target, rec.since)

    async def _save_drains(self) -> None:
        st = self.st
        drains = {u: DrainClock(t, since) for u, (t, since) in self.drains.items()}
        drains.update(self.given_up)
        if drains != st.cp.drains:
            st.set_checkpoint(st.cp.with_drains(drains))
            await st.persist()

    def _resets(self, uuid: str) -> bool:
        gpu = self.st.inv.gpu_by_uuid(uuid)
        return gpu is not None and self.changer.toggle_of(gpu) == "reset"

    async def run(self) -> None:
        while True:
            await self.kick.wait()
            self.kick.clear()
            generation = self.generation
            try:
                await self.step()
            except (ApiError, NvmlFailure) as exc:  # labels restored by step's finally, or
                # at the next step from the record; the next GC pass kicks again
                log.warning("maintenance step failed", node=self.st.node, error=str(exc))
            else:
                if generation > self.observed_generation:
                    self.observed_generation = generation  # MigNode status.observedGeneration
                    self.st.publish.set()
            self.steps += 1

    async def step(self) -> None:
        """Carry out what is asked and due (module docstring); idempotent."""
        st = self.st
        self.restore()
        if st.cp.maintenance is not None:
            await self.recover()
        now = self.clock.monotonic()
        self.given_up = {
            u: rec for u, rec in self.given_up.items() if self.desired.get(u) == rec.target
        }
        for uuid, rec in self.given_up.items():
            self._keep_failed(uuid, rec, now)
        todo = due(self.desired, st.inv.gpus, self.changer.toggle_of, st.mode_failures, now)
        todo = {u: t for u, t in todo.items() if u not in self.given_up}
        busy = self.changer.busy_now() | {g.uuid for g in st.inv.gpus if g.compute_processes}
        draining = {u: t for u, t in todo.items() if u in busy}
        # the clock runs only where a reset is needed (Ampere): a reset-less (Hopper) ask is
        # carried out once the GPU is idle, however long its work runs
        timed = {u: t for u, t in draining.items() if self._resets(u)}
        wall = self.clock.wall().timestamp()
        self.drains, ran_out = drain_clocks(timed, self.drains, wall, self.drain_timeout_s)
        for uuid in sorted(ran_out):
            await self._give_up(uuid, draining[uuid])
        await self._save_drains()
        phase = {u: "Draining" for u in draining if u not in ran_out}
        ready = {u: t for u, t in todo.items() if u not in busy}
        if phase != st.mode_phase:
            st.mode_phase = phase
            st.publish.set()
        for uuid, target in sorted(ready.items()):
            gpu = st.inv.gpu_by_uuid(uuid)
            if gpu is not None and self.changer.toggle_of(gpu) == "resetless":
                del ready[uuid]
                async with self.changer.lock(uuid):  # no reset, no Operator pause needed
                    fresh = st.inv.gpu_by_uuid(uuid)
                    if fresh is not None and uuid not in self.changer.busy_now():
                        await self.changer.change(fresh, target, DESIRED_CLAIM)
        if not ready or self.reset is None:
            return
        labels = await writes.node_labels(self.kube, st.node)
        if labels is None:
            return
        originals = to_pause(labels)
        st.set_checkpoint(st.cp.with_maintenance(MaintenanceIntent(dict(ready), originals)))
        await st.persist(durable=True)  # the intent, on disk before any label or GPU changes
        st.mode_phase = {**phase, **dict.fromkeys(ready, "Resetting")}
        st.publish.set()
        try:
            if originals:
                log.info("pausing GPU Operator clients", node=st.node, labels=sorted(originals))
                await writes.patch_node(
                    self.kube, st.node, {"metadata": {"labels": dict.fromkeys(originals, PAUSED)}}
                )
            for uuid, target in sorted(ready.items()):
                await self._one(uuid, target)
        finally:
            await self.recover()
            st.mode_phase = phase
            st.publish.set()

    async def _give_up(self, uuid: str, target: str) -> None:
        """The drain ran out: the ask is given up (module docstring); nothing is evicted."""
        st = self.st
        _, since = self.drains.pop(uuid, (target, 0.0))
        gpu = st.inv.gpu_by_uuid(uuid)
        if gpu is None:
            return
        message = (
            f"drain timed out after {self.drain_timeout_s:g} s (--maintenance-drain-timeout-s): "
            f"{self._occupants(gpu)} still on GPU {gpu.index}; nothing was evicted, the GPU "
            f"serves its current mode again, and this ask ({target}) is not carried out again "
            "until spec.gpus[].desiredMigMode is written anew"
        )
        self.given_up[uuid] = DrainClock(target, since, message, kube_time())
        await self.changer.failed(gpu, target, message, reason=GIVEN_UP_REASON)
        await writes.mig_node_warning(self.kube, st.node, DRAIN_TIMED_OUT, message)

    def _keep_failed(self, uuid: str, rec: DrainClock, now: float) -> None:
        """A given-up ask still asked: its failure stays shown (the allocator leaves the GPU's
        mode alone); it ends one back-off after the ask goes. After a restart it is shown
        again from the checkpoint."""
        st = self.st
        failure = st.mode_failures.get(uuid)
        if failure is None or failure.reason != GIVEN_UP_REASON:
            failure = modes.ModeFailure(
                rec.target, rec.given_up, rec.given_up_time, now, GIVEN_UP_REASON
            )
            st.publish.set()
        elif failure.until - now >= modes.BACKOFF_S / 2:
            return
        st.mode_failures[uuid] = dataclasses.replace(failure, until=now + modes.BACKOFF_S)
        asyncio.get_running_loop().call_later(modes.BACKOFF_S, st.publish.set)

    def _occupants(self, gpu: GpuInfo) -> str:
        """What keeps `gpu` busy, for the failure's message."""
        st = self.st
        allocs = sorted(
            f"{meta.get('namespace', '')}/{meta.get('name', '')}"
            for obj in st.allocs.values()
            for meta in [obj.get("metadata") or {}]
            if any(
                s.get("gpuUUID") == gpu.uuid for s in (obj.get("spec") or {}).get("slices") or []
            )
        )
        parts = [f"SliceAllocation {', '.join(allocs[:5])}"] if allocs else []
        if len(allocs) > 5:
            parts[-1] += f" and {len(allocs) - 5} more"
        if gpu.compute_processes:
            parts.append(f"{gpu.compute_processes} compute process(es)")
        if any(f.gpu_index == gpu.index for f in st.foreign):
            parts.append("instances InstaSlice did not make")
        if not allocs and any(
            s.gpu_uuid == gpu.uuid for r in st.cp.claims.values() for s in r.slices
        ):
            parts.append("slices still being released")
        return "; ".join(parts) or "work"

    async def _one(self, uuid: str, target: str) -> None:
        st, reset = self.st, self.reset
        assert reset is not None
        async with self.changer.lock(uuid):
            gpu = st.inv.gpu_by_uuid(uuid)
            if gpu is None or modes.in_mode(gpu, target):
                return
            if uuid in self.changer.busy_now():  # an allocation arrived after all
                return
            before = gpu.mig_current
            try:
                fresh = await self.gpus.call_gpu(
                    gpu.index, reset_into, self.gpus.s, gpu.index, target, reset, self.wait_s
                )
            except ResetRefused as exc:
                if exc.final:
                    st.toggle_refused.add(uuid)  # a VM guest: never again in this process
                await self.changer.failed(gpu, target, f"GPU reset: {exc}")
                return
            except (NotIdle, NvmlFailure) as exc:
                await self.changer.failed(gpu, target, str(exc))
                return
            st.replace_gpu(fresh)
            st.mode_failures.pop(uuid, None)
            st.mode_phase.pop(uuid, None)
            st.mode_changed[uuid] = modes.ModeChanged(before, fresh.mig_current, kube_time())
            self.changer.metrics.mode_changes.labels(st.node, target, "done").inc()
            log.info("MIG mode changed by a GPU reset", gpu=gpu.index, mode=target)

    async def recover(self) -> None:
        """Undo what a maintenance record says may be half done: restore the Operator labels
        exactly, take back a mode left pending, drop the record. At start (a crash mid-way)
        and at the end of every run."""
        st = self.st
        self.restore()
        intent = st.cp.maintenance
        if intent is None:
            return
        if intent.labels:
            try:
                await writes.patch_node(
                    self.kube, st.node, {"metadata": {"labels": dict(intent.labels)}}
                )
            except ApiError as exc:  # the record stays: tried again at the next step
                log.warning("restoring GPU Operator labels failed", node=st.node, error=str(exc))
                return
            log.info("GPU Operator labels restored", node=st.node, labels=dict(intent.labels))
        for uuid in intent.modes:
            gpu = st.inv.gpu_by_uuid(uuid)
            if gpu is None or st.is_lost(gpu.index):
                continue
            try:
                fresh = await self.gpus.call_gpu(gpu.index, _settled, self.gpus.s, gpu.index)
            except NvmlFailure as exc:  # read again by the GC pass's rescan
                log.warning("reading a GPU after maintenance failed", gpu=gpu.index, error=str(exc))
                continue
            st.replace_gpu(fresh)
        st.set_checkpoint(st.cp.with_maintenance(None))
        await st.persist(durable=True)
        st.publish.set()


def _settled(s: NvmlSession, index: int) -> GpuInfo:
    """The GPU with no mode left pending (a crash between SetMigMode and the reset)."""
    current, pending = s.mig_mode(index)
    if current != pending:
        with contextlib.suppress(NvmlFailure):
            s.call("nvmlDeviceSetMigMode", s.handle(index), 1 if current == MIG_ENABLED else 0)
    return s.gpu_info(index)


def command_reset(command: tuple[str, ...], timeout_s: float = 120.0) -> Reset:
    """A real node's reset: `command` with `{index}` replaced (default `nvidia-smi
    --gpu-reset -i {index}`, run in the agent's container, which the NVIDIA Container Toolkit
    gives nvidia-smi). Untested on hardware in this project: the shared test GPUs' MIG mode is
    never changed."""

    def reset(index: int) -> None:
        argv = [a.replace("{index}", str(index)) for a in command]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ResetRefused(f"{argv[0]}: {exc}", final=True) from None
        if done.returncode != 0:
            out = (done.stdout + done.stderr).strip()[-500:]
            raise ResetRefused(
                out or f"exit status {done.returncode}", final="not supported" in out
            )

    return reset
