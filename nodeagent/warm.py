"""Warm slices, the pure part: what to keep made, and the handover (docs/warm-slices.md).

A warm slice is a GI + CI this agent made before any pod asked, recorded like an
allocation's slice: a `ClaimRecord` in state `warm` (uid `warm-<GPU UUID>-<start>`, one
slice, no namespace), written (fsynced) before NVML makes it. The record is the proof of
ownership, exactly as for a pod's slice (nodeagent/checkpoint.py), so a restart neither
leaks nor double-uses one: a warm record owns the instance at its placement, and a claim
takes it over by one checkpoint write that drops the warm record and names the instance in
the claim's record (`hand_over`). Either record owns it, never both, never neither.

Here, without I/O or clock (both are passed in):

- `Demand`: recent asks per profile on this node (a sliding window); the profiles most in
  demand, each with how many to keep: the busiest `burst_s` of the window, within the caps;
- `targets`: where to keep them — the next spots the allocator's own policy would pick on
  this node (common/placement/warm.py `next_picks`), on eligible GPUs only, at most
  `per_gpu` per GPU and `per_node` in all;
- `next_step`: one thing to do now (make one, destroy one, or nothing);
- `in_the_way` / `hand_over`: what a create must destroy first, and what it takes over.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Final, Literal, Protocol

from common.catalog import Catalog
from common.placement import Gpu, NodeState, Occupied
from common.placement.warm import next_picks
from nodeagent.checkpoint import Checkpoint, ClaimRecord, SliceRecord
from nodeagent.model import GpuInfo, Instance, NodeInventory
from nodeagent.reconcile import Ownership, match, overlaps

WARM: Final = "warm"
WARM_PREFIX = "warm-"


def is_warm(rec: ClaimRecord) -> bool:
    return rec.state == WARM


def warm_records(cp: Checkpoint) -> list[ClaimRecord]:
    return sorted((r for r in cp.claims.values() if is_warm(r)), key=lambda r: r.uid)


def warm_record(gpu: GpuInfo, profile: str, profile_id: int, start: int, size: int,
                boot_id: str) -> ClaimRecord:  # fmt: skip
    """The intent record of one warm slice, before NVML makes it."""
    uid = f"{WARM_PREFIX}{gpu.uuid}-{start}"
    s = SliceRecord("", profile, profile_id, gpu.uuid, gpu.index, start, size)
    return ClaimRecord(uid, "", uid, WARM, (s,), boot_id, time.time())


class WarmHooks(Protocol):
    """What a create asks of the warm pool (nodeagent/warmpool.py)."""

    async def clear_for(self, fresh: Sequence[SliceRecord]) -> None: ...
    def asked_for(self, fresh: Sequence[SliceRecord], taken: int) -> None: ...
    def released(self) -> None: ...


# ---- demand -------------------------------------------------------------------------------------


@dataclass
class Demand:
    """Asks per profile seen by this agent in the last `window_s` (monotonic seconds)."""

    window_s: float = 600.0
    burst_s: float = 10.0
    asks: dict[str, deque[float]] = field(default_factory=dict)

    def note(self, profile: str, now: float) -> None:
        self.asks.setdefault(profile, deque()).append(now)
        self._trim(now)

    def _trim(self, now: float) -> None:
        for profile in list(self.asks):
            q = self.asks[profile]
            while q and q[0] < now - self.window_s:
                q.popleft()
            if not q:
                del self.asks[profile]

    def wanted(self, now: float, profiles: int, per_profile: int) -> dict[str, int]:
        """The `profiles` most asked-for profiles (most asks first, then name), each with the
        most asks that fell within any `burst_s` of the window, at most `per_profile`."""
        self._trim(now)
        ranked = sorted(self.asks.items(), key=lambda kv: (-len(kv[1]), kv[0]))[:profiles]
        out: dict[str, int] = {}
        for profile, q in ranked:
            peak, lo = 0, 0
            times = list(q)
            for hi, t in enumerate(times):
                while times[lo] < t - self.burst_s:
                    lo += 1
                peak = max(peak, hi - lo + 1)
            out[profile] = min(per_profile, peak)
        return out


# ---- where --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Spot:
    gpu_index: int
    profile: str
    start: int
    size: int


def node_state(
    node: str,
    inv: NodeInventory,
    cp: Checkpoint,
    foreign: Sequence[Instance],
    eligible: Collection[int],
    promised: Sequence[tuple[str, int, int, str]] = (),
) -> NodeState:
    """This node as the allocator's engine sees it, warm slices left out (free capacity):
    every record's slices, the allocations' slices not recorded yet (`promised`: GPU UUID,
    start, size, profile) and foreign instances occupy; GPUs not `eligible` are unusable."""
    occ: dict[str, list[Occupied]] = {}
    for uuid, start, size, profile in promised:
        occ.setdefault(uuid, []).append(Occupied(start, size, profile))
    for rec in cp.claims.values():
        if is_warm(rec):
            continue
        for s in rec.slices:
            occ.setdefault(s.gpu_uuid, []).append(Occupied(s.start, s.size, s.profile))
    for f in foreign:
        g = inv.gpu_by_index(f.gpu_index)
        prof = g.profile_by_id(f.profile_id) if g is not None else None
        name = prof.name if prof is not None else f"id{f.profile_id}"
        occ.setdefault(f.gpu_uuid, []).append(Occupied(f.start, f.size, name))
    gpus = tuple(
        Gpu(g.index, g.model, g.mig_enabled, g.index in eligible, tuple(set(occ.get(g.uuid, ()))))
        for g in inv.gpus
    )
    return NodeState(name=node, pods_free=1, cpu_millis_free=1, memory_bytes_free=1, gpus=gpus)


def targets(
    state: NodeState,
    wanted: Mapping[str, int],
    per_gpu: int,
    per_node: int,
    catalog: Catalog | None = None,
) -> list[Spot]:
    """Where warm slices belong now: per wanted profile, the allocator's next picks on this
    node, stopping at a GPU that holds `per_gpu` targets already (a spot elsewhere is not
    where the allocator would place), `per_node` in all."""
    out: list[Spot] = []
    per: dict[int, int] = {}
    for profile, count in wanted.items():
        for pick in next_picks(state, profile, count, catalog):
            if len(out) >= per_node or per.get(pick.gpu_index, 0) >= per_gpu:
                break
            per[pick.gpu_index] = per.get(pick.gpu_index, 0) + 1
            out.append(Spot(pick.gpu_index, profile, pick.start, pick.size))
            state = _with(state, pick.gpu_index, Occupied(pick.start, pick.size, profile))
    return out


def _with(state: NodeState, index: int, occ: Occupied) -> NodeState:
    gpus = tuple(
        replace(g, occupied=(*g.occupied, occ)) if g.index == index else g for g in state.gpus
    )
    return replace(state, gpus=gpus)


# ---- what to do next ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Step:
    kind: Literal["make", "destroy"]
    spot: Spot | None = None  # make
    uid: str = ""  # destroy: the warm record's uid
    why: str = ""


def _spot(rec: ClaimRecord) -> Spot:
    s = rec.slices[0]
    return Spot(s.gpu_index, s.profile, s.start, s.size)


def next_step(
    cp: Checkpoint,
    want: Sequence[Spot],
    eligible: Collection[int],
    per_node: int,
    promised: Collection[Spot] = (),
) -> Step | None:
    """One change towards `want`: destroy a warm slice on a GPU no longer eligible, of a
    profile no longer wanted, or in the way of a wanted spot (or over the cap, to make room);
    else make the first wanted spot missing; None when nothing is to change. A warm slice
    exactly at a `promised` spot (an allocation here names it, its create will take it) is
    left alone and not counted."""
    have = [r for r in warm_records(cp) if _spot(r) not in promised]
    profiles = {s.profile for s in want}
    spots = set(want)
    for rec in have:
        sp = _spot(rec)
        if not rec.slices[0].done:
            return Step("destroy", uid=rec.uid, why="never finished")
        if sp.gpu_index not in eligible:
            return Step("destroy", uid=rec.uid, why="its GPU is not to be warmed")
        if sp.profile not in profiles:
            return Step("destroy", uid=rec.uid, why="no recent demand for its profile")
    extra = [r for r in have if _spot(r) not in spots]
    held = {_spot(r) for r in have}
    for spot in want:
        if spot in held:
            continue
        for rec in extra:
            sp = _spot(rec)
            same_gpu = sp.gpu_index == spot.gpu_index
            if same_gpu and overlaps(sp.start, sp.size, spot.start, spot.size):
                return Step("destroy", uid=rec.uid, why="in the way of a better spot")
        if len(have) >= per_node:
            if not extra:
                return None
            return Step("destroy", uid=extra[0].uid, why="room for a better spot")
        return Step("make", spot=spot)
    if len(have) > per_node and extra:
        return Step("destroy", uid=extra[0].uid, why="over the cap")
    return None


# ---- a create and the warm slices ---------------------------------------------------------------


def in_the_way(cp: Checkpoint, fresh: Sequence[SliceRecord]) -> list[ClaimRecord]:
    """Warm records a create of `fresh` must destroy first: those overlapping a planned
    slice without being exactly it, and every one on a GPU a whole-GPU slice takes (MIG goes
    off there)."""
    whole = {s.gpu_uuid for s in fresh if s.whole}
    out = []
    for rec in warm_records(cp):
        w = rec.slices[0]
        if w.gpu_uuid in whole:
            out.append(rec)
            continue
        for s in fresh:
            if s.whole or s.gpu_uuid != w.gpu_uuid:
                continue
            if _same(s, w):
                break
            if overlaps(s.start, s.size, w.start, w.size):
                out.append(rec)
                break
    return out


def _same(s: SliceRecord, w: SliceRecord) -> bool:
    a = (s.gpu_uuid, s.profile_id, s.start, s.size)
    return a == (w.gpu_uuid, w.profile_id, w.start, w.size)


def hand_over(cp: Checkpoint, claim: ClaimRecord) -> tuple[Checkpoint, int]:
    """`cp` with `claim` put, each of its slices not made yet that a made warm slice
    matches exactly taking that instance (ids copied into the claim's slice, the warm
    record dropped): one checkpoint change, so the instance is owned by one record at every
    moment. Also how many slices were handed over."""
    slices = list(claim.slices)
    gone: set[str] = set()
    for i, s in enumerate(slices):
        if s.whole or s.done:
            continue
        for rec in warm_records(cp):
            w = rec.slices[0]
            if rec.uid not in gone and w.done and _same(s, w):
                slices[i] = replace(s, gi_id=w.gi_id, ci_id=w.ci_id, mig_uuid=w.mig_uuid)
                gone.add(rec.uid)
                break
    out = cp
    for uid in gone:
        out = out.without(uid)
    return out.with_claim(replace(claim, slices=tuple(slices))), len(gone)


def settle(cp: Checkpoint, instances: Sequence[Instance]) -> tuple[Checkpoint, list[str]]:
    """At start: each warm record takes the ids of the instance at its placement, or is
    dropped when there is none (never made, or gone with a reboot). One whose GI exists
    without its CI is kept as it is: `next_step` destroys it. Returns the checkpoint and
    the uids dropped."""
    own: Ownership = match(cp, instances)
    out, dropped = cp, []
    for rec in warm_records(cp):
        inst = own.found.get((rec.uid, 0))
        if inst is None:
            out = out.without(rec.uid)
            dropped.append(rec.uid)
            continue
        if not inst.ci_ids:
            continue
        s = rec.slices[0]
        made = replace(s, gi_id=inst.gi_id, ci_id=inst.ci_ids[0], mig_uuid=inst.mig_uuids[0])
        if made != s:
            out = out.with_claim(replace(rec, slices=(made,)))
    return out, dropped
