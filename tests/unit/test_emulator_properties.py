"""Property tests: random create/destroy sequences on random GPU models.

Each step is checked against a brute-force model written independently of `rules.py`: a
create succeeds iff its start is listed, its slots are free, the profile's count is below
its maximum and the engines of all GIs still fit the full profile's; GIs never overlap;
RemainingCapacity of every profile equals the largest set of free listed starts that can be
created together (subsets enumerated); a GI with compute instances refuses to go (IN_USE).
The pure rules get many examples; the pynvml-shaped facade (file-backed) fewer. An
exhaustive walk over every model's geometries shows the inferred engine rule only ever
limits `+me`/`+me.all` combinations.
Leaves out: MIG mode, processes, faults (test_emulator.py covers those by example).
"""

from __future__ import annotations

import itertools
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pynvml
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from common.catalog import Engines, GpuModel, Profile, load_catalog
from nodeagent.emulator import EmulatedNvml, EmulatorControl, provision, rules
from nodeagent.emulator.state import (
    IN_USE,
    MIG_ENABLE,
    ComputeInstance,
    Gpu,
    GpuInstance,
    Rejected,
)

MODELS = load_catalog().models


@dataclass(frozen=True)
class Create:
    profile: int  # index into the model's profiles
    start: int | None  # None: default placement
    listed: bool = False  # start picks one of the profile's listed starts (modulo)

    def resolve(self, p: Profile) -> int | None:
        if self.start is None or not self.listed:
            return self.start
        return p.starts[self.start % len(p.starts)]


@dataclass(frozen=True)
class Destroy:
    pick: int  # which GI (modulo how many exist)


@dataclass(frozen=True)
class AddCi:
    pick: int


Op = Create | Destroy | AddCi


@hs.composite
def scenarios(draw: hs.DrawFn, max_ops: int = 25) -> tuple[GpuModel, list[Op]]:
    model = draw(hs.sampled_from(MODELS))
    n = len(model.profiles)
    profile = hs.integers(0, n - 1)
    op = hs.one_of(
        hs.builds(Create, profile, hs.integers(0, 11), hs.just(True)),  # mostly listed starts
        hs.builds(Create, profile, hs.integers(0, 11), hs.just(True)),
        hs.builds(Create, profile, hs.one_of(hs.none(), hs.integers(0, model.memory_slots))),
        hs.builds(Destroy, hs.integers(0, 14)),
        hs.builds(AddCi, hs.integers(0, 14)),
    )
    return model, draw(hs.lists(op, min_size=1, max_size=max_ops))


# ---- brute force, independent of rules.py --------------------------------------------------


def slots(start: int, size: int) -> set[int]:
    return set(range(start, start + size))


def used_slots(gpu: Gpu) -> set[int]:
    out: set[int] = set()
    for gi in gpu.gis:
        out |= slots(gi.start, gi.size)
    return out


def engine_sum(model: GpuModel, profiles: list[Profile]) -> Engines:
    total = Engines()
    for p in profiles:
        total = total + p.engines
    return total


def existing(model: GpuModel, gpu: Gpu) -> list[Profile]:
    found = [model.profile_by_id(gi.profile_id) for gi in gpu.gis]
    assert all(p is not None for p in found)
    return [p for p in found if p is not None]


def legal(model: GpuModel, gpu: Gpu, p: Profile, start: int) -> bool:
    if start not in p.starts or slots(start, p.size) & used_slots(gpu):
        return False
    if sum(1 for q in existing(model, gpu) if q.id == p.id) >= p.max_count:
        return False
    return engine_sum(model, [*existing(model, gpu), p]).fits_within(model.full_engines)


def brute_capacity(model: GpuModel, gpu: Gpu, p: Profile) -> int:
    taken = used_slots(gpu)
    free = [s for s in p.starts if not slots(s, p.size) & taken]
    have = existing(model, gpu)
    count = sum(1 for q in have if q.id == p.id)
    for r in range(len(free), 0, -1):
        if count + r > p.max_count:
            continue
        if not engine_sum(model, have + [p] * r).fits_within(model.full_engines):
            continue
        for combo in itertools.combinations(free, r):
            sets = [slots(s, p.size) for s in combo]
            if all(not a & b for a, b in itertools.combinations(sets, 2)):
                return r
    return 0


def check_invariants(model: GpuModel, gpu: Gpu) -> None:
    seen: set[int] = set()
    for gi in gpu.gis:
        p = model.profile_by_id(gi.profile_id)
        assert p is not None and gi.start in p.starts and gi.size == p.size
        assert not slots(gi.start, gi.size) & seen, "overlap"
        seen |= slots(gi.start, gi.size)
        assert gi.id == rules.tree_gi_id(model.memory_slots, gi.start, gi.size)
    assert len({gi.id for gi in gpu.gis}) == len(gpu.gis)
    have = existing(model, gpu)
    for p in model.profiles:
        assert sum(1 for q in have if q.id == p.id) <= p.max_count
    assert engine_sum(model, have).fits_within(model.full_engines)


# ---- the pure rules ------------------------------------------------------------------------


def empty_gpu(model: GpuModel) -> Gpu:
    return Gpu(0, model.name, "GPU-x", MIG_ENABLE, MIG_ENABLE)


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_rules_agree_with_brute_force(scenario: tuple[GpuModel, list[Op]]) -> None:
    model, ops = scenario
    gpu = empty_gpu(model)
    serial = 1
    for op in ops:
        if isinstance(op, Create):
            p = model.profiles[op.profile]
            start = op.resolve(p)
            placement = None if start is None else (start, p.size)
            res = rules.create_gi(gpu, p.id, placement, serial)
            if start is None:
                expect = any(legal(model, gpu, p, s) for s in p.starts)
            else:
                expect = legal(model, gpu, p, start)
            assert isinstance(res, tuple) == expect, (op, res)
            if isinstance(res, tuple):
                new, gi = res
                assert legal(model, gpu, p, gi.start) and gi.profile_id == p.id
                assert start is None or gi.start == start
                gpu = new
            serial += 1
        elif gpu.gis:
            gi = gpu.gis[op.pick % len(gpu.gis)]
            if isinstance(op, AddCi):
                gpu = _add_ci(model, gpu, gi, serial)
                serial += 1
            else:
                res2 = rules.destroy_gi(gpu, gi.id)
                if gi.cis:
                    assert isinstance(res2, Rejected) and res2.code == IN_USE
                    for ci in gi.cis:
                        after = rules.destroy_ci(gpu, gi.id, ci.id)
                        assert isinstance(after, Gpu)
                        gpu = after
                    res2 = rules.destroy_gi(gpu, gi.id)
                assert isinstance(res2, Gpu) and gi.id not in {g.id for g in res2.gis}
                gpu = res2
        check_invariants(model, gpu)
        for p in model.profiles:
            assert rules.remaining_capacity(gpu, model, p) == brute_capacity(model, gpu, p), p.name


def _add_ci(model: GpuModel, gpu: Gpu, gi: GpuInstance, serial: int) -> Gpu:
    p = model.profile_by_id(gi.profile_id)
    assert p is not None
    res = rules.create_ci(gpu, gi.id, p.default_ci, None, serial, f"MIG-{serial}")
    if gi.cis:  # the default CI is full-size: a second never fits
        assert isinstance(res, Rejected)
        return gpu
    assert isinstance(res, tuple)
    new, ci = res
    assert isinstance(ci, ComputeInstance) and ci.profile == p.default_ci
    indices = [c.mig_index for g in new.gis for c in g.cis]
    assert len(set(indices)) == len(indices) and max(indices) < model.compute_slices
    return new


# ---- the facade, end to end ----------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(scenarios(max_ops=15))
def test_facade_agrees_with_brute_force(scenario: tuple[GpuModel, list[Op]]) -> None:
    model, ops = scenario
    with tempfile.TemporaryDirectory() as tmp:
        provision(Path(tmp), "p", [model.name])
        nv = EmulatedNvml(Path(tmp), "p")
        nv.nvmlInit()
        control = EmulatorControl(Path(tmp), "p")
        dev = nv.nvmlDeviceGetHandleByIndex(0)
        live: list[object] = []
        for op in ops:
            gpu = control.state().gpus[0]
            if isinstance(op, Create):
                p = model.profiles[op.profile]
                resolved = op.resolve(p)
                start = p.starts[0] if resolved is None else resolved
                expect = legal(model, gpu, p, start)
                place = pynvml.c_nvmlGpuInstancePlacement_t(start, p.size)
                try:
                    live.append(nv.nvmlDeviceCreateGpuInstanceWithPlacement(dev, p.id, place))
                    assert expect, op
                except pynvml.NVMLError as exc:
                    assert not expect, (op, exc)
                    assert exc.value in (
                        pynvml.NVML_ERROR_INVALID_ARGUMENT,
                        pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES,
                    )
            elif live:
                nv.nvmlGpuInstanceDestroy(live.pop(op.pick % len(live)))
            gpu = control.state().gpus[0]
            check_invariants(model, gpu)
            for p in model.profiles:
                got = nv.nvmlDeviceGetGpuInstanceRemainingCapacity(dev, p.id)
                assert got == brute_capacity(model, gpu, p), p.name
        nv.nvmlShutdown()


# ---- the engine rule, exhaustively ---------------------------------------------------------


def blocked_by_engines(model: GpuModel) -> list[tuple[str, ...]]:
    """Every set of GIs legal by slots and counts whose engines do not fit (DFS)."""
    candidates = [(p, s) for p in model.profiles for s in p.starts]
    blocked: list[tuple[str, ...]] = []
    stack: list[tuple[int, set[int], list[Profile]]] = [(0, set(), [])]
    while stack:
        first, taken, chosen = stack.pop()
        for j in range(first, len(candidates)):
            p, s = candidates[j]
            if slots(s, p.size) & taken or chosen.count(p) >= p.max_count:
                continue
            now = [*chosen, p]
            if engine_sum(model, now).fits_within(model.full_engines):
                stack.append((j + 1, taken | slots(s, p.size), now))
            else:
                blocked.append(tuple(q.name for q in now))
    return blocked


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
def test_engine_sum_only_ever_limits_media_extension_profiles(model: GpuModel) -> None:
    """Every geometry that is legal by slots and counts fits the engines, unless it holds a
    `+me`/`+me.all` profile: the [INF] engine rule adds no limit the hardware lacks."""
    blocked = blocked_by_engines(model)
    for names in blocked:
        assert any("+me" in n for n in names), names
    # Only where two media-extension profiles can meet does the rule bite at all.
    assert bool(blocked) == (model.name in ("A30-24GB", "RTX-PRO-6000"))
