"""MIG rules of one GPU as pure functions: `Gpu` in, a new `Gpu` (or `Rejected`) out.

What the driver enforces (docs/mig-facts.md §6.1, §7) and the emulator copies:
- a GI occupies memory slots `[start, start + size)`, starts only at one of its profile's
  listed starts (else INVALID_ARGUMENT) and may not overlap another GI
  (INSUFFICIENT_RESOURCES, also for an occupied spot: the driver never says ALREADY_EXISTS);
- at most `max_count` GIs per profile, and the engines (CE/DEC/ENC/JPEG/OFA) of all GIs
  together fit in those of the full profile [INF]. That single sum gives "one `+me` per GPU"
  and "`+me.all` leaves room only for `-me`" without special cases;
- MIG must be enabled to create, list or destroy; clients of the whole GPU block creation;
- a GI with compute instances, or a CI with processes, is IN_USE on destroy;
- CI profiles inside a GI follow go-nvlib (C <= G, and 2C <= G+1 when C < G) [CODE].
GI ids follow the binary-tree numbering seen on real parts (docs/mig-facts.md §2.12; lowest free id
when a size does not fit the tree); CI ids are the lowest free 0..7.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Final

from common.catalog import Engines, GpuModel, Profile
from nodeagent.emulator.state import (
    GPU_IS_LOST,
    IN_USE,
    INSUFFICIENT_RESOURCES,
    INVALID_ARGUMENT,
    MIG_DISABLE,
    MIG_ENABLE,
    NOT_FOUND,
    NOT_SUPPORTED,
    RESET_REQUIRED,
    SUCCESS,
    ComputeInstance,
    Gpu,
    GpuInstance,
    Rejected,
)

MAX_GI_IDS: Final = 15  # /dev/nvidia-caps lists gi0..gi14
MAX_CI_IDS: Final = 8  # ... and ci0..ci7
GI_PROFILE_COUNT: Final = 17  # enums >= this are INVALID_ARGUMENT (driver 580 on the H200)
CI_PROFILE_COUNT: Final = 9  # NVML_COMPUTE_INSTANCE_PROFILE_COUNT
CI_ENGINE_PROFILE_COUNT: Final = 1  # only NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
CI_REV1: Final = 7  # NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1
_CI_ENUM_BY_SLICES: Final = {1: 0, 2: 1, 3: 2, 4: 3, 6: 6, 7: 4, 8: 5}

# nvidia-smi's default placement on 8-slot parts: 7x 1g fill 6,4,5,0,1,2,3; the first 2g
# (and 1g with double memory) goes to 4, then 0, 2; a 3g on an empty GPU to 4
# (docs/mig-facts.md §2.12).
_DEFAULT_ORDER_8: Final = {1: (6, 4, 5, 0, 1, 2, 3), 2: (4, 0, 2, 6), 4: (4, 0), 8: (0,)}


@dataclass(frozen=True, slots=True)
class CiProfile:
    """One compute-instance profile available inside a GI of a given GI profile."""

    enum: int
    slices: int
    instance_count: int
    multiprocessors: int
    name: str

    def starts(self, gi_slices: int) -> tuple[int, ...]:
        return tuple(range(0, gi_slices - self.slices + 1, self.slices))


# ---- GPU instances -------------------------------------------------------------------------


def gi_mask(start: int, size: int) -> int:
    return ((1 << size) - 1) << start


def occupied(gpu: Gpu) -> int:
    mask = 0
    for gi in gpu.gis:
        mask |= gi_mask(gi.start, gi.size)
    return mask


def engines_used(gpu: Gpu, model: GpuModel) -> Engines:
    total = Engines()
    for gi in gpu.gis:
        profile = model.profile_by_id(gi.profile_id)
        if profile is not None:
            total = total + profile.engines
    return total


def count_of(gpu: Gpu, profile_id: int) -> int:
    return sum(1 for gi in gpu.gis if gi.profile_id == profile_id)


def placement_problem(gpu: Gpu, model: GpuModel, profile: Profile, start: int) -> Rejected | None:
    """Why a GI of `profile` cannot be created at `start` now, or None if it can."""
    if start not in profile.starts:
        return Rejected(INVALID_ARGUMENT, f"{profile.name}: {start} is not one of {profile.starts}")
    if occupied(gpu) & profile.mask(start):
        return Rejected(INSUFFICIENT_RESOURCES, f"{profile.name} at {start}: slots in use")
    if count_of(gpu, profile.id) >= profile.max_count:
        return Rejected(INSUFFICIENT_RESOURCES, f"{profile.name}: {profile.max_count} exist")
    if not (engines_used(gpu, model) + profile.engines).fits_within(model.full_engines):
        return Rejected(INSUFFICIENT_RESOURCES, f"{profile.name}: engines exhausted")
    return None


def remaining_capacity(gpu: Gpu, model: GpuModel, profile: Profile) -> int:
    """GIs of `profile` that could still be created together (listed starts never overlap
    within one profile, so free starts, the count limit and the engine pool decide)."""
    taken = occupied(gpu)
    free = sum(1 for s in profile.starts if not taken & profile.mask(s))
    n = min(free, profile.max_count - count_of(gpu, profile.id))
    left = model.full_engines.as_tuple()
    used = engines_used(gpu, model).as_tuple()
    for need, cap, have in zip(profile.engines.as_tuple(), left, used, strict=True):
        if need:
            n = min(n, (cap - have) // need)
    return max(n, 0)


def default_start_order(model: GpuModel, profile: Profile) -> tuple[int, ...]:
    """Where CreateGpuInstance (no placement) tries, in order: small profiles go high."""
    if model.memory_slots == 8 and profile.size in _DEFAULT_ORDER_8:
        preferred = [s for s in _DEFAULT_ORDER_8[profile.size] if s in profile.starts]
        return tuple(preferred + [s for s in profile.starts if s not in preferred])
    if 2 * profile.size <= model.memory_slots:  # [INF] no dump of other parts' default order
        return tuple(sorted(profile.starts, reverse=True))
    return tuple(sorted(profile.starts))


def tree_gi_id(slots: int, start: int, size: int) -> int | None:
    """Binary-tree GI id: 0 full, 1-2 halves, 3-6 quarters, 7-14 eighths (by start)."""
    if size <= 0 or slots % size or start % size:
        return None
    parts = slots // size
    if parts & (parts - 1):
        return None
    return parts - 1 + start // size


def _new_gi_id(gpu: Gpu, model: GpuModel, start: int, size: int) -> int | None:
    used = {gi.id for gi in gpu.gis}
    tree = tree_gi_id(model.memory_slots, start, size)
    if tree is not None and tree < MAX_GI_IDS and tree not in used:
        return tree
    return next((i for i in range(MAX_GI_IDS) if i not in used), None)


def create_gi(
    gpu: Gpu, profile_id: int, placement: tuple[int, int] | None, serial: int
) -> tuple[Gpu, GpuInstance] | Rejected:
    """CreateGpuInstance(WithPlacement): `placement` is (start, size) or None for default."""
    if gpu.lost:
        return Rejected(GPU_IS_LOST, f"GPU {gpu.index} is lost")
    if gpu.mig_current != MIG_ENABLE:
        return Rejected(NOT_SUPPORTED, f"GPU {gpu.index}: MIG mode is disabled")
    model = gpu.spec
    profile = model.profile_by_id(profile_id)
    if profile is None:
        return Rejected(INVALID_ARGUMENT, f"{model.name} has no GI profile id {profile_id}")
    if gpu.processes:
        return Rejected(IN_USE, f"GPU {gpu.index}: in use by another client")
    if placement is not None:
        start, size = placement
        if size != profile.size:
            return Rejected(INVALID_ARGUMENT, f"{profile.name}: size {size} != {profile.size}")
        problem = placement_problem(gpu, model, profile, start)
        if problem is not None:
            return problem
    else:
        order = default_start_order(model, profile)
        fits = [s for s in order if placement_problem(gpu, model, profile, s) is None]
        if not fits:
            return Rejected(INSUFFICIENT_RESOURCES, f"{profile.name}: no free placement")
        start = fits[0]
    gi_id = _new_gi_id(gpu, model, start, profile.size)
    if gi_id is None:
        return Rejected(INSUFFICIENT_RESOURCES, "no free GPU instance id")
    gi = GpuInstance(id=gi_id, profile_id=profile.id, start=start, size=profile.size, serial=serial)
    return replace(gpu, gis=(*gpu.gis, gi)), gi


def destroy_gi(gpu: Gpu, gi_id: int) -> Gpu | Rejected:
    if gpu.lost:
        return Rejected(GPU_IS_LOST, f"GPU {gpu.index} is lost")
    gi = gpu.gi(gi_id)
    if gi is None:
        return Rejected(NOT_FOUND, f"GPU {gpu.index}: no GPU instance {gi_id}")
    if gi.cis:
        return Rejected(IN_USE, f"GI {gi_id} still has compute instances")
    return replace(gpu, gis=tuple(g for g in gpu.gis if g.id != gi_id))


# ---- compute instances ---------------------------------------------------------------------


def ci_profiles(model: GpuModel, gi_profile: Profile) -> tuple[CiProfile, ...]:
    """CI profiles a GI of `gi_profile` offers, by enum. A smaller CI gets a proportional
    share of the GI's SMs [INF]; the full-size CI gets them all."""
    g = gi_profile.compute_slices
    out: list[CiProfile] = []
    for c, enum in sorted(_CI_ENUM_BY_SLICES.items()):
        if c > g or (c < g and 2 * c > g + 1):
            continue
        sms = gi_profile.multiprocessors if c == g else gi_profile.multiprocessors * c // g
        name = gi_profile.name if c == g else f"{c}c.{gi_profile.name}"
        out.append(CiProfile(enum, c, g // c, sms, name))
    if gi_profile.default_ci == CI_REV1:
        # Hopper+ 1g with double memory: the REV1 CI has the GI's SMs (26 on H100/H200); the
        # plain 1-slice CI only a plain 1g's, which is why the DRA driver picks the CI with
        # the most SMs (docs/mig-facts.md §2.11) [INF for the plain one's count].
        plain = model.profile_by_enum(0)
        plain_sms = plain.multiprocessors if plain is not None else gi_profile.multiprocessors
        out = [replace(p, multiprocessors=plain_sms) if p.enum == 0 else p for p in out]
        out.append(CiProfile(CI_REV1, 1, 1, gi_profile.multiprocessors, gi_profile.name))
    return tuple(sorted(out, key=lambda p: p.enum))


def ci_profile(model: GpuModel, gi_profile: Profile, enum: int) -> CiProfile | Rejected:
    if not 0 <= enum < CI_PROFILE_COUNT:
        return Rejected(INVALID_ARGUMENT, f"CI profile {enum} out of range")
    found = next((p for p in ci_profiles(model, gi_profile) if p.enum == enum), None)
    if found is None:
        return Rejected(NOT_SUPPORTED, f"{gi_profile.name} offers no CI profile {enum}")
    return found


def _ci_mask(start: int, size: int) -> int:
    return ((1 << size) - 1) << start


def ci_remaining(gi: GpuInstance, gi_profile: Profile, prof: CiProfile) -> int:
    taken = 0
    for c in gi.cis:
        taken |= _ci_mask(c.start, c.size)
    same = sum(1 for c in gi.cis if c.profile == prof.enum)
    free = sum(
        1 for s in prof.starts(gi_profile.compute_slices) if not taken & _ci_mask(s, prof.slices)
    )
    return max(0, min(free, prof.instance_count - same))


def create_ci(
    gpu: Gpu, gi_id: int, enum: int, start: int | None, serial: int, uuid: str
) -> tuple[Gpu, ComputeInstance] | Rejected:
    if gpu.lost:
        return Rejected(GPU_IS_LOST, f"GPU {gpu.index} is lost")
    gi = gpu.gi(gi_id)
    if gi is None:
        return Rejected(NOT_FOUND, f"GPU {gpu.index}: no GPU instance {gi_id}")
    model = gpu.spec
    gi_profile = model.profile_by_id(gi.profile_id)
    assert gi_profile is not None
    prof = ci_profile(model, gi_profile, enum)
    if isinstance(prof, Rejected):
        return prof
    starts = prof.starts(gi_profile.compute_slices)
    taken = 0
    for c in gi.cis:
        taken |= _ci_mask(c.start, c.size)
    if sum(1 for c in gi.cis if c.profile == enum) >= prof.instance_count:
        return Rejected(INSUFFICIENT_RESOURCES, f"{prof.name}: {prof.instance_count} exist")
    if start is not None:
        if start not in starts:
            return Rejected(INVALID_ARGUMENT, f"{prof.name}: CI start {start} not in {starts}")
        if taken & _ci_mask(start, prof.slices):
            return Rejected(INSUFFICIENT_RESOURCES, f"{prof.name} at {start}: slices in use")
    else:
        start = next((s for s in starts if not taken & _ci_mask(s, prof.slices)), None)
        if start is None:
            return Rejected(INSUFFICIENT_RESOURCES, f"GI {gi_id}: no free compute slices")
    ci_id = next((i for i in range(MAX_CI_IDS) if gi.ci(i) is None), None)
    used_index = {c.mig_index for g in gpu.gis for c in g.cis}
    mig_index = next((i for i in range(model.compute_slices) if i not in used_index), None)
    if ci_id is None or mig_index is None:
        return Rejected(INSUFFICIENT_RESOURCES, "no free compute instance id")
    ci = ComputeInstance(ci_id, enum, start, prof.slices, uuid, mig_index, serial)
    new_gi = replace(gi, cis=(*gi.cis, ci))
    return replace(gpu, gis=tuple(new_gi if g.id == gi_id else g for g in gpu.gis)), ci


def destroy_ci(gpu: Gpu, gi_id: int, ci_id: int) -> Gpu | Rejected:
    if gpu.lost:
        return Rejected(GPU_IS_LOST, f"GPU {gpu.index} is lost")
    gi = gpu.gi(gi_id)
    ci = gi.ci(ci_id) if gi is not None else None
    if gi is None or ci is None:
        return Rejected(NOT_FOUND, f"GPU {gpu.index}: no compute instance {gi_id}/{ci_id}")
    if ci.processes:
        return Rejected(IN_USE, f"{ci.uuid}: {len(ci.processes)} processes attached")
    new_gi = replace(gi, cis=tuple(c for c in gi.cis if c.id != ci_id))
    return replace(gpu, gis=tuple(new_gi if g.id == gi_id else g for g in gpu.gis))


# ---- MIG mode and resets -------------------------------------------------------------------


def set_mig_mode(
    gpu: Gpu, mode: int, *, vm: bool = False, destroy_instances: bool = False
) -> tuple[Gpu, int] | Rejected:
    """SetMigMode → (new GPU, activationStatus).

    Ampere only records the pending mode; it takes effect at the next GPU reset, and the
    activation status says RESET_REQUIRED until then (user guide). So does every GPU in a
    pass-through VM (`vm`), where nvml.h says a VM reboot is required. Hopper and newer
    switch at once (NVIDIA's DRA driver, gpu-operator#2603) unless a process uses the GPU
    (IN_USE, nvml.h) or, when disabling, GPU instances exist: IN_USE too [INF: unverified on
    hardware; mig-parted always destroys them first] unless `destroy_instances`, which drops
    them instead.
    """
    if gpu.lost:
        return Rejected(GPU_IS_LOST, f"GPU {gpu.index} is lost")
    if mode not in (MIG_DISABLE, MIG_ENABLE):
        return Rejected(INVALID_ARGUMENT, f"MIG mode {mode}")
    if gpu.spec.resets_for_mig_mode or vm:
        status = SUCCESS if mode == gpu.mig_current else RESET_REQUIRED
        return replace(gpu, mig_pending=mode), status
    if mode == gpu.mig_current:
        return replace(gpu, mig_pending=mode), SUCCESS
    if gpu.all_processes():
        return Rejected(IN_USE, f"GPU {gpu.index}: processes running")
    if mode == MIG_DISABLE and gpu.gis and not destroy_instances:
        return Rejected(IN_USE, f"GPU {gpu.index}: {len(gpu.gis)} GPU instances exist")
    gis = gpu.gis if mode == MIG_ENABLE else ()
    return replace(gpu, mig_current=mode, mig_pending=mode, gis=gis), SUCCESS


def mode_after_reboot(gpu: Gpu, keep_mig_mode: bool | None) -> int:
    """The MIG mode a GPU comes back with. Ampere keeps it (an InfoROM bit; user guide:
    "persistent across reboots"), so its pending mode applies. Hopper and newer come back
    with MIG disabled [INF: NVIDIA in gpu-operator#2600 and gpu-admin-tools#2, "from Hopper
    the bit is gone"; not seen on our hardware]. `keep_mig_mode` overrides the model."""
    if keep_mig_mode is None:
        keep_mig_mode = gpu.spec.resets_for_mig_mode
    return gpu.mig_pending if keep_mig_mode else MIG_DISABLE


def reset(gpu: Gpu, *, force: bool = False, vm: bool = False, held: bool = False) -> Gpu | Rejected:
    """`nvidia-smi -r`: the pending MIG mode takes effect; no GI/CI survives a reset.
    A pass-through VM refuses it ("Resetting GPU ... is not supported", gpu-operator#1606);
    so does a GPU a driver client holds open (`held`: DCGM, persistenced) [INF]."""
    if vm:
        return Rejected(NOT_SUPPORTED, f"GPU {gpu.index}: resetting is not supported in a VM")
    if held and not force:
        return Rejected(IN_USE, f"GPU {gpu.index}: a driver client (DCGM, persistenced) holds it")
    if gpu.all_processes() and not force:
        return Rejected(IN_USE, f"GPU {gpu.index}: processes running")
    return replace(gpu, mig_current=gpu.mig_pending, lost=False, processes=(), gis=())
