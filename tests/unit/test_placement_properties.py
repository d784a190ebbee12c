"""Hypothesis properties of the placement engine on small random snapshots.

Covers, for every policy: (1) every returned Placement is legal — an eligible node (selector,
taints, cpu/memory/pods), usable GPUs of a model that offers the profile, a listed start
(a layout slice under static-balanced), the profile's size, no overlap with what is there or
with sibling slices, count / engine / SM limits of the model respected, slices in request
order; (2) Pending only when a brute-force search (written here from the catalog, not from
the engine's tables) finds no legal placement; (3) the Pending reason agrees with brute
force: NODE_RESOURCES exactly when GPUs alone would fit, NO_PROFILE when a profile is offered
by no GPU model present. GPUs are drawn from catalog models and from geometries the GPUs
carry themselves (`Gpu.geometry`): the synthetic 10-slot X10 of hack/specs/models and a
variant of the H100 that keeps the catalog's name but not its placements, so an answer the
engine cached for the catalog's H100 would show up as an illegal placement here.
Leaves out: which legal placement a policy prefers (test_placement.py, the benchmark).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.catalog import Engines, GpuModel, load_catalog, load_model_file
from common.placement import (
    Gpu,
    NodeState,
    Occupied,
    Pending,
    PendingReason,
    Placement,
    PodRequest,
    Policy,
    SliceRequest,
    Snapshot,
    Taint,
    place,
)
from common.placement.selectors import mismatch
from common.placement.tables import model_tables

CATALOG = load_catalog()
MODELS = ["A100-40GB", "H100-80GB", "H200-141GB", "A30-24GB", "RTX-PRO-6000"]
REPO = Path(__file__).resolve().parents[2]
X10 = load_model_file(REPO / "hack/specs/models/x10-120gb.yaml")


def _h100_variant() -> GpuModel:
    """The catalog's H100 name with other placements: 1g only at even starts, 3g only at 0."""
    h100 = CATALOG.model("H100-80GB")
    assert h100 is not None
    profiles = tuple(
        replace(p, starts=tuple(s for s in p.starts if s % 2 == 0))
        if p.memory_slots == 1
        else replace(p, starts=(0,))
        if p.name == "3g.40gb"
        else p
        for p in h100.profiles
    )
    return replace(h100, profiles=profiles, _by_name={})


# Geometries carried by the GPU itself, by a label of the test's own.
GEOMETRIES = {"X10-120GB": X10, "H100-80GB/variant": _h100_variant()}


def _model(name: str) -> GpuModel:
    m = CATALOG.model(name)
    assert m is not None
    return m


def spec(g: Gpu) -> GpuModel:
    """What the engine must plan `g` with: its own geometry, else the catalog's entry."""
    return g.geometry if g.geometry is not None else _model(g.model)


def legal(model: GpuModel, occupied: list[tuple[str, int]]) -> bool:
    """(profile, start) pairs: listed starts, no overlap, counts, engines, SM slices."""
    mask = 0
    engines = Engines()
    compute = 0
    counts: dict[str, int] = {}
    for name, start in occupied:
        p = model.profile(name)
        if p is None or start not in p.starts:
            return False
        m = p.mask(start)
        if mask & m:
            return False
        mask |= m
        engines = engines + p.engines
        compute += p.compute_slices
        counts[name] = counts.get(name, 0) + 1
        if counts[name] > p.max_count:
            return False
    return engines.fits_within(model.full_engines) and compute <= model.compute_slices


@st.composite
def gpus(draw: st.DrawFn, index: int) -> Gpu:
    name = draw(st.sampled_from([*MODELS, *GEOMETRIES]))
    geometry = GEOMETRIES.get(name)
    model = geometry if geometry is not None else _model(name)
    occupied: list[tuple[str, int]] = []
    for _ in range(draw(st.sampled_from([0, 0, 1, 2, 3]))):
        p = draw(st.sampled_from(model.profiles))
        start = draw(st.sampled_from(p.starts))
        if legal(model, [*occupied, (p.name, start)]):
            occupied.append((p.name, start))
    mig = draw(st.integers(0, 9)) > 0
    healthy = draw(st.integers(0, 9)) > 0
    occ = tuple(Occupied(s, model.profile(p).memory_slots, p) for p, s in occupied)  # type: ignore[union-attr]
    return Gpu(index, model.name, mig, healthy, occ, geometry=geometry)


@st.composite
def nodes(draw: st.DrawFn, i: int) -> NodeState:
    n = draw(st.integers(1, 3))
    gs = tuple(draw(gpus(k)) for k in range(n))
    labels = {"zone": draw(st.sampled_from(["a", "b"]))}
    taints = (Taint("dedicated", "x", "NoSchedule"),) if draw(st.integers(0, 9)) == 0 else ()
    return NodeState(
        f"n{i}",
        labels,
        taints,
        draw(st.integers(0, 19)) == 0,
        draw(st.sampled_from([0, 1000, 8000, 8000, 8000])),
        draw(st.sampled_from([0, 1 << 30, 64 << 30, 64 << 30])),
        draw(st.sampled_from([0, 1, 10, 10])),
        gs,
    )


@st.composite
def snapshots(draw: st.DrawFn) -> Snapshot:
    return Snapshot(tuple(draw(nodes(i)) for i in range(draw(st.integers(1, 2)))))


@st.composite
def requests(draw: st.DrawFn, snap: Snapshot) -> PodRequest:
    # Mostly profiles of one model that is present (the satisfiable case), sometimes any.
    home = draw(st.sampled_from([spec(g) for n in snap.nodes for g in n.gpus]))
    present = sorted({p.name for n in snap.nodes for g in n.gpus for p in spec(g).profiles})
    anywhere = [*present, "1g.5gb", "3g.40gb", "9g.99gb"]
    local = [p.name for p in home.profiles]
    slices = tuple(
        SliceRequest(
            draw(st.sampled_from(["init", "a", "b"])),
            draw(st.sampled_from(local if draw(st.integers(0, 4)) else anywhere)),
            draw(st.sampled_from([1, 1, 1, 2])),
        )
        for _ in range(draw(st.sampled_from([1, 1, 2, 3])))
    )
    selector = {"zone": "a"} if draw(st.integers(0, 9)) == 0 else {}
    return PodRequest(
        "pod",
        draw(st.sampled_from([0, 1000, 1000, 4000])),
        draw(st.sampled_from([0, 1 << 30])),
        slices,
        selector,
    )


def _demand(req: PodRequest) -> list[str]:
    return [s.profile for s in req.slices for _ in range(s.count)]


def _fits_resources(node: NodeState, req: PodRequest) -> bool:
    return (
        node.pods_free >= 1
        and node.cpu_millis_free >= req.cpu_millis
        and node.memory_bytes_free >= req.memory_bytes
    )


def _spots(gpu: Gpu, profile: str, policy: Policy) -> Iterator[int]:
    model = spec(gpu)
    if not gpu.usable:
        return
    p = model.profile(profile)
    if p is None:
        return
    if policy is Policy.STATIC_BALANCED:
        yield from (s for name, s in model_tables(model).layout if name == profile)
    else:
        yield from p.starts


def brute_force(snap: Snapshot, req: PodRequest, policy: Policy, resources: bool = True) -> bool:
    """Is there any legal placement of every slice on one eligible node?"""
    demand = _demand(req)
    for node in snap.nodes:
        if mismatch(node, req) is not None or (resources and not _fits_resources(node, req)):
            continue
        extra: list[list[tuple[str, int]]] = [[] for _ in node.gpus]

        def assign(
            k: int, node: NodeState = node, extra: list[list[tuple[str, int]]] = extra
        ) -> bool:
            if k == len(demand):
                return True
            for gi, g in enumerate(node.gpus):
                model = spec(g)
                base = [(o.profile, o.start) for o in g.occupied]
                for start in _spots(g, demand[k], policy):
                    trial = [*base, *extra[gi], (demand[k], start)]
                    if legal(model, trial):
                        extra[gi].append((demand[k], start))
                        if assign(k + 1):
                            return True
                        extra[gi].pop()
            return False

        if assign(0):
            return True
    return False


def check_legal(snap: Snapshot, req: PodRequest, policy: Policy, p: Placement) -> None:
    node = next(n for n in snap.nodes if n.name == p.node)
    assert mismatch(node, req) is None
    assert _fits_resources(node, req)
    assert [(s.container, s.profile) for s in p.slices] == [
        (r.container, r.profile) for r in req.slices for _ in range(r.count)
    ]
    by_gpu: dict[int, list[tuple[str, int]]] = {}
    for s in p.slices:
        g = next(g for g in node.gpus if g.index == s.gpu_index)
        assert g.usable
        model = spec(g)
        prof = model.profile(s.profile)
        assert prof is not None
        assert s.size == prof.memory_slots
        assert s.start in set(_spots(g, s.profile, policy))
        by_gpu.setdefault(s.gpu_index, []).append((s.profile, s.start))
    for index, added in by_gpu.items():
        g = next(g for g in node.gpus if g.index == index)
        assert legal(spec(g), [(o.profile, o.start) for o in g.occupied] + added)


SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(st.data())
def test_placements_are_legal_and_pending_only_when_nothing_fits(data: st.DataObject) -> None:
    snap = data.draw(snapshots())
    req = data.draw(requests(snap))
    for policy in Policy:
        result = place(snap, req, policy)
        exists = brute_force(snap, req, policy)
        if isinstance(result, Placement):
            check_legal(snap, req, policy, result)
        else:
            assert not exists, (policy, result)
        assert isinstance(result, Placement) == exists


@SETTINGS
@given(st.data())
def test_pending_reason_agrees_with_brute_force(data: st.DataObject) -> None:
    snap = data.draw(snapshots())
    req = data.draw(requests(snap))
    result = place(snap, req)
    if not isinstance(result, Pending):
        return
    gpus_alone = brute_force(snap, req, Policy.INSTASLICE, resources=False)
    assert (result.reason is PendingReason.NODE_RESOURCES) == gpus_alone, result
    offered = {p.name for n in snap.nodes for g in n.gpus for p in spec(g).profiles}
    if any(s.profile not in offered for s in req.slices):
        assert result.reason is PendingReason.NO_PROFILE
    if result.reason in (PendingReason.FULL, PendingReason.FRAGMENTED):
        # Some usable GPU offers every profile on a node the pod may use.
        assert any(mismatch(n, req) is None for n in snap.nodes)


@SETTINGS
@given(st.data())
def test_placing_again_after_applying_stays_legal(data: st.DataObject) -> None:
    """Decisions chain: apply a placement, place the next pod on the new snapshot."""
    snap = data.draw(snapshots())
    for k in range(3):
        req = replace(data.draw(requests(snap)), name=f"p{k}")
        result = place(snap, req)
        if not isinstance(result, Placement):
            assert not brute_force(snap, req, Policy.INSTASLICE)
            continue
        check_legal(snap, req, Policy.INSTASLICE, result)
        nodes = []
        for n in snap.nodes:
            if n.name == result.node:
                gs = tuple(
                    replace(
                        g,
                        occupied=g.occupied
                        + tuple(
                            Occupied(s.start, s.size, s.profile)
                            for s in result.slices
                            if s.gpu_index == g.index
                        ),
                    )
                    for g in n.gpus
                )
                n = replace(
                    n,
                    gpus=gs,
                    cpu_millis_free=n.cpu_millis_free - req.cpu_millis,
                    memory_bytes_free=n.memory_bytes_free - req.memory_bytes,
                    pods_free=n.pods_free - 1,
                )
            nodes.append(n)
        snap = Snapshot(tuple(nodes))
