"""Pure decisions of the node agent: (allocation, intent record, NVML instances) → action.

No I/O, no clock, no NVML here (docs/style.md §2); `nodeagent.agent` executes what these return.
The rules (docs/nodeagent.md "Checkpoint and reconcile"):

- An allocation being deleted is released; Pending/Creating ones are created (idempotently:
  what the record already claims is adopted, only what is missing is made); a Ready one is
  verified, and re-created when its boot ID is not the node's (the node rebooted, and MIG
  geometry never survives a reboot) or its instances vanished.
- Instances are owned only through a record: same GPU, profile and placement, and the same
  GI id once the record knows it. Everything else is foreign and never destroyed.
- A record whose allocation no longer exists is an orphan; its instances are destroyed once
  it has been an orphan for the grace period (the informer may lag behind a fresh create).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from common.allocation import AllocSlice, SliceAllocation
from common.objects import Phase
from nodeagent.checkpoint import Checkpoint, ClaimRecord, SliceRecord
from nodeagent.model import MIG_DISABLED, MIG_ENABLED, GpuInfo, Health, Instance, NodeInventory

WHOLE_GPU_PROFILE_ID = -1  # no GI profile has it: a whole GPU never matches an instance

Obj = dict[str, Any]


# --- what to do with one allocation ------------------------------------------------------------


class Action(enum.StrEnum):
    CREATE = "create"  # make what is missing, then Ready
    RECREATE = "recreate"  # the instances are gone (reboot): make them again, then Ready
    VERIFY = "verify"  # Ready: check the record and the CDI file; adopt from status if needed
    RELEASE = "release"  # being deleted: destroy, remove CDI file, drop the finalizer
    REFAIL = "refail"  # we wrote Failed, and a later write says otherwise: say Failed again
    ROLLBACK = "rollback"  # a failed create's rollback NVML refused: retry it, then Failed
    NONE = "none"


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    reason: str = ""


def decide(alloc: SliceAllocation, record: ClaimRecord | None, boot_id: str) -> Decision:
    """The action for one allocation, from it and this agent's record of it. Our own writes
    come back as watch events, maybe late: the record says what we wrote (docs/style.md §12c)."""
    if alloc.deleting:
        return Decision(Action.RELEASE, "allocation deleted")
    phase = alloc.phase
    if record is not None and record.state == "failed":
        # We wrote Failed, and it is final: never made after all (the allocator deletes it and
        # places the pod anew); creating now would write Ready over Failed while the allocator
        # releases it (`make chaos`). A Pending/Creating view is usually our own Creating write
        # arriving late; whatever it is, a phase other than Failed is answered with Failed.
        if phase == Phase.FAILED:
            return Decision(Action.NONE, "failed by this agent: final")
        return Decision(Action.REFAIL, "failed by this agent: final")
    if record is not None and record.state == "releasing":
        # A create that failed and whose rollback NVML refused (or a process that stopped in
        # the middle of one): retry the rollback, then write Failed; never make it again.
        return Decision(Action.ROLLBACK, "a failed create's rollback is pending")
    if phase in (Phase.PENDING, Phase.CREATING):
        if record is not None and record.announced and _made(record, boot_id):
            # We wrote Ready already: this is our own Creating write arriving late (its watch
            # event trails the Ready response). Writing Ready again would cost one status
            # patch per allocation (docs/benchmarks-history.md).
            return Decision(Action.NONE, "ready and told already")
        return Decision(Action.CREATE)
    if phase == Phase.READY:
        if alloc.boot_id and alloc.boot_id != boot_id:
            return Decision(Action.RECREATE, "the node rebooted (boot ID changed)")
        return Decision(Action.VERIFY)
    if phase == Phase.FAILED and record is not None and record.state != "ready":
        # a rollback that could not finish: keep destroying what the record holds
        return Decision(Action.NONE, "failed; leftovers are retried by garbage collection")
    return Decision(Action.NONE)


def _made(record: ClaimRecord, boot_id: str) -> bool:
    """Every slice of `record` was made during this boot."""
    return (
        record.state == "ready" and record.boot_id == boot_id and all(s.done for s in record.slices)
    )


# --- ownership: which instances are ours --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ownership:
    owner: Mapping[tuple[str, int], tuple[str, int]]  # instance key → (claim uid, slice index)
    found: Mapping[tuple[str, int], Instance]  # (claim uid, slice index) → instance
    foreign: tuple[Instance, ...]


def slice_matches(s: SliceRecord, inst: Instance, profile_id: int | None = None) -> bool:
    pid = s.profile_id if profile_id is None else profile_id
    if inst.gpu_uuid != s.gpu_uuid or (inst.profile_id, inst.start, inst.size) != (
        pid,
        s.start,
        s.size,
    ):
        return False
    return s.gi_id is None or s.gi_id == inst.gi_id


def match(cp: Checkpoint, instances: Sequence[Instance]) -> Ownership:
    owner: dict[tuple[str, int], tuple[str, int]] = {}
    found: dict[tuple[str, int], Instance] = {}
    for uid, rec in sorted(cp.claims.items()):
        for i, s in enumerate(rec.slices):
            for inst in instances:
                if inst.key not in owner and slice_matches(s, inst):
                    owner[inst.key] = (uid, i)
                    found[(uid, i)] = inst
                    break
    foreign = tuple(i for i in instances if i.key not in owner)
    return Ownership(owner, found, foreign)


def overlaps(a_start: int, a_size: int, b_start: int, b_size: int) -> bool:
    return a_start < b_start + b_size and b_start < a_start + a_size


def clashes(s: SliceRecord, gpu_uuid: str, start: int, size: int) -> bool:
    """Does planned slice `s` need a slot of what sits at `start:size` on GPU `gpu_uuid`?"""
    return s.gpu_uuid == gpu_uuid and overlaps(s.start, s.size, start, size)


def blocked(
    plan: Sequence[SliceRecord], uid: str, instances: Sequence[Instance], own: Ownership
) -> str | None:
    """Why a planned slice cannot be created: an instance we do not own for this claim
    overlaps its memory slots. None when every placement is free or already ours."""
    for i, s in enumerate(plan):
        for inst in instances:
            if not clashes(s, inst.gpu_uuid, inst.start, inst.size):
                continue
            holder = own.owner.get(inst.key)
            if holder == (uid, i):
                continue
            who = (
                f"an instance of another allocation (uid {holder[0]})"
                if holder
                else "an instance InstaSlice did not create"
            )
            return (
                f"slice {i} ({s.profile} at GPU {s.gpu_index} slots {s.start}:{s.size}) "
                f"overlaps {who}: GI {inst.gi_id} at {inst.start}:{inst.size}"
            )
    return None


def held_by_release(cp: Checkpoint, uid: str, plan: Sequence[SliceRecord]) -> str | None:
    """The uid of another claim still being released (`releasing`) whose MIG slices overlap
    a slot `plan` needs; None when no release holds one. A create waits for it (its calls
    go ahead of a release's on the GPU: nodeagent/lane.py)."""
    for other in cp.claims.values():
        if other.uid == uid or other.state != "releasing":
            continue
        for held in other.slices:
            if held.whole:
                continue  # no instance: nothing to destroy
            if any(clashes(s, held.gpu_uuid, held.start, held.size) for s in plan):
                return other.uid
    return None


# --- create plan ---------------------------------------------------------------------------------


def plan(
    alloc: SliceAllocation,
    inv: NodeInventory,
    health: Mapping[int, Health],
    mode_problem: Callable[[GpuInfo, str], str | None] | None = None,
) -> list[SliceRecord] | str:
    """Slice records for the allocation's spec, or the reason it cannot be made here.
    A GPU with MIG disabled is planned for when `mode_problem` (GPU, target mode) says the
    agent can enable it (MIG mode on demand); without one, MIG must be on already."""
    out: list[SliceRecord] = []
    for i, s in enumerate(alloc.slices):
        gpu: GpuInfo | None = inv.gpu_by_uuid(s.gpu_uuid)
        where = f"slice {i} ({s.container}: {s.profile} at {s.start}:{s.size})"
        if gpu is None:
            return f"{where}: GPU {s.gpu_uuid} is not on node {alloc.node}"
        if s.kind == "gpu":
            whole = _plan_whole(where, s, gpu, health, mode_problem)
            if isinstance(whole, str):
                return whole
            out.append(whole)
            continue
        if not gpu.mig_enabled:
            why = mode_problem(gpu, MIG_ENABLED) if mode_problem else "it is not changed here"
            if why:
                return f"{where}: MIG mode is {gpu.mig_current} on GPU {gpu.index}: {why}"
        h = health.get(gpu.index, Health())
        if not h.healthy:
            return f"{where}: GPU {gpu.index} is unhealthy ({h.message})"
        prof = gpu.profile(s.profile)
        if prof is None:
            return f"{where}: GPU {gpu.index} ({gpu.model}) has no profile {s.profile}"
        if (s.start, s.size) not in prof.placements:
            allowed = ", ".join(f"{a}:{b}" for a, b in prof.placements)
            return f"{where}: not a placement of {s.profile} (allowed: {allowed})"
        out.append(
            SliceRecord(
                container=s.container,
                profile=s.profile,
                profile_id=prof.id,
                gpu_uuid=gpu.uuid,
                gpu_index=gpu.index,
                start=s.start,
                size=s.size,
            )
        )
    for i, a in enumerate(out):
        for b in out[i + 1 :]:
            if a.gpu_uuid == b.gpu_uuid and overlaps(a.start, a.size, b.start, b.size):
                return (
                    f"slices overlap on GPU {a.gpu_index}: "
                    f"{a.start}:{a.size} and {b.start}:{b.size}"
                )
    return out


def _plan_whole(
    where: str,
    s: AllocSlice,
    gpu: GpuInfo,
    health: Mapping[int, Health],
    mode_problem: Callable[[GpuInfo, str], str | None] | None,
) -> SliceRecord | str:
    """A whole GPU: healthy, and MIG off or turned off by this agent (no instance on it)."""
    h = health.get(gpu.index, Health())
    if not h.healthy:
        return f"{where}: GPU {gpu.index} is unhealthy ({h.message})"
    if gpu.mig_current != MIG_DISABLED or gpu.mig_pending != MIG_DISABLED:
        why = mode_problem(gpu, MIG_DISABLED) if mode_problem else "it is not changed here"
        if why:
            return f"{where}: MIG mode is {gpu.mig_current} on GPU {gpu.index}: {why}"
    return SliceRecord(
        container=s.container,
        profile=s.profile,
        profile_id=WHOLE_GPU_PROFILE_ID,
        gpu_uuid=gpu.uuid,
        gpu_index=gpu.index,
        start=s.start,
        size=s.size,
        kind="gpu",
    )


def merge_plan(record: ClaimRecord | None, fresh: Sequence[SliceRecord]) -> tuple[SliceRecord, ...]:
    """Keep what the record already knows about each slice (ids from an interrupted create)."""
    if record is None or len(record.slices) != len(fresh):
        return tuple(fresh)
    out = []
    for old, new in zip(record.slices, fresh, strict=True):
        same = (old.gpu_uuid, old.profile_id, old.start, old.size) == (
            new.gpu_uuid,
            new.profile_id,
            new.start,
            new.size,
        )
        out.append(old if same else new)
    return tuple(out)


def adopt_from_status(
    alloc: SliceAllocation, fresh: Sequence[SliceRecord], instances: Sequence[Instance]
) -> tuple[SliceRecord, ...] | None:
    """A Ready allocation without a usable record (checkpoint lost): adopt its instances when
    every status slice names a MIG UUID that NVML still shows at the spec placement. The UUID
    is new on every create, so it proves the instance is the one this agent made."""
    if len(alloc.status_slices) != len(fresh):
        return None
    out = []
    for st, s in zip(alloc.status_slices, fresh, strict=True):
        uuid = st.get("migUUID")
        inst = next(
            (
                x
                for x in instances
                if uuid and uuid in x.mig_uuids and slice_matches(s.cleared(), x)
            ),
            None,
        )
        if inst is None:
            return None
        ci = inst.ci_ids[inst.mig_uuids.index(str(uuid))]
        out.append(replace(s, gi_id=inst.gi_id, ci_id=ci, mig_uuid=str(uuid)))
    return tuple(out)


# --- reboot and garbage collection -------------------------------------------------------------


def after_reboot(cp: Checkpoint, boot_id: str) -> Checkpoint:
    """MIG geometry never survives a reboot: forget every id the records hold."""
    if cp.boot_id == boot_id:
        return cp
    if not cp.boot_id:
        return replace(cp, boot_id=boot_id)
    claims = {
        uid: replace(rec, slices=tuple(s.cleared() for s in rec.slices))
        for uid, rec in cp.claims.items()
    }
    # a maintenance record survives: the Operator labels it paused must still be restored;
    # so do the drain clocks (a given-up ask stays given up)
    return Checkpoint(
        node=cp.node,
        boot_id=boot_id,
        claims=claims,
        maintenance=cp.maintenance,
        drains=cp.drains,
    )


def orphans(
    cp: Checkpoint,
    live_uids: set[str],
    first_seen: Mapping[str, float],
    now: float,
    grace_s: float,
) -> tuple[list[str], dict[str, float]]:
    """Records without a live allocation: those orphaned for `grace_s` are due for
    destruction. Returns (due uids, the updated first-seen map)."""
    seen = {
        uid: first_seen.get(uid, now)
        for uid, rec in cp.claims.items()
        if uid not in live_uids and rec.state != "warm"  # warm slices: no allocation's
    }
    due = sorted(uid for uid, t in seen.items() if now - t >= grace_s)
    return due, seen


def vanished_claims(
    cp: Checkpoint, own: Ownership, is_lost: Callable[[int], bool], *, before: float
) -> set[str]:
    """Uids of Ready records (last written before `before`, when the scan began) one of whose
    made slices has no instance on a GPU that is not lost: a driver reload or GPU reset
    removed it underneath a running pod (same boot, so after_reboot does not apply)."""
    return {
        rec.uid
        for rec in cp.claims.values()
        if rec.state == "ready"
        and rec.updated < before
        and any(
            s.done and not s.whole and not is_lost(s.gpu_index) and (rec.uid, i) not in own.found
            for i, s in enumerate(rec.slices)
        )
    }
