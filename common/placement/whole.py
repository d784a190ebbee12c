"""Whole-GPU placement: a pod's `nvidia.com/gpu` asks, each an entire GPU with MIG off.

A whole GPU needs MIG mode off (a GPU in MIG mode without instances runs no CUDA work,
docs/mig-facts.md §3.1), and never shares its GPU: the allocation occupies every memory slot
(`Occupied(0, slots, "gpu")`), so the slice engine never places a MIG slice beside it.
The caller lists, per GPU (node, index), which GPUs may serve (`WholeView`):

- `right_mode`: MIG off, idle, nothing on it: a whole GPU as it is;
- `toggle`: MIG on but empty and idle, on a GPU whose agent turns MIG off without a reset;
- `needs_reset`: MIG on but empty, on a GPU whose mode only changes with a reset (Ampere);
- `under_way`: empty, its change to MIG off asked (Ampere maintenance) and not done yet.

All of a pod's whole GPUs go to one node that passes its selectors, taints and cpu/memory/
pods. Among the nodes that can host them, the fewest mode changes win (never a toggle while
GPUs in the right mode suffice), then the tightest fit (fewest spare whole GPUs left, which
keeps other nodes' GPUs for MIG), then snapshot order. GPUs that need a reset are never
chosen; when only they would do, the reason is NeedsMigModeChange, naming them. GPUs under
way take nothing new; when they would complete a node, the pod waits for them
(MigModeChangeUnderWay, naming them), whatever else it waits for; when they would complete
a node only together with GPUs that need a reset (and no reset alone would do), it waits
for them too, the message naming the resets needed after.

Pure: data in, a decision out. A pod asking MIG slices and whole GPUs together is refused at
admission (not supported yet), so it never reaches here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from common.catalog import Catalog, load_catalog
from common.constants import WHOLE_GPU_PROFILE
from common.placement.model import (
    Gpu,
    NodeState,
    Pending,
    PendingReason,
    PlacedSlice,
    Placement,
    PodRequest,
    Snapshot,
)
from common.placement.modes import under_way_pending
from common.placement.search import resources_fit
from common.placement.selectors import mismatch

GpuRef = tuple[str, int]


@dataclass(frozen=True, slots=True)
class WholeView:
    right_mode: frozenset[GpuRef] = frozenset()
    toggle: frozenset[GpuRef] = frozenset()
    needs_reset: frozenset[GpuRef] = frozenset()
    under_way: frozenset[GpuRef] = frozenset()


@dataclass(frozen=True, slots=True)
class WholePlacement:
    result: Placement | Pending
    toggles: tuple[int, ...] = ()  # GPU indexes on the chosen node whose MIG mode goes off
    # NeedsMigModeChange: the reset GPUs of the first node that would do after MIG off on
    # them (the allocator's Ampere maintenance asks for exactly these)
    resets: tuple[GpuRef, ...] = ()


def is_whole(request: PodRequest) -> bool:
    return any(s.profile == WHOLE_GPU_PROFILE for s in request.slices)


def wanted(request: PodRequest) -> int:
    return sum(s.count for s in request.slices if s.profile == WHOLE_GPU_PROFILE)


def place_whole(
    snapshot: Snapshot, request: PodRequest, view: WholeView, catalog: Catalog | None = None
) -> WholePlacement:
    cat = catalog or load_catalog()
    n = wanted(request)
    best: tuple[tuple[int, int, int], NodeState, list[Gpu], list[Gpu]] | None = None
    eligible = fits_gpus = 0
    reset_refs: list[GpuRef] = []
    resets: tuple[GpuRef, ...] = ()
    waits: tuple[GpuRef, ...] = ()  # the first node's GPUs under way that would complete it
    # the first node that GPUs under way and GPUs needing a reset would complete together:
    # (those under way, those to reset after)
    mixed: tuple[tuple[GpuRef, ...], tuple[GpuRef, ...]] | None = None
    for order, node in enumerate(snapshot.nodes):
        if mismatch(node, request) is not None:
            continue
        eligible += 1
        right = [g for g in node.gpus if (node.name, g.index) in view.right_mode and g.healthy]
        toggle = [g for g in node.gpus if (node.name, g.index) in view.toggle and g.healthy]
        reset = [g for g in node.gpus if (node.name, g.index) in view.needs_reset and g.healthy]
        if len(right) + len(toggle) < n:
            under = [g for g in node.gpus if (node.name, g.index) in view.under_way]
            short = n - len(right) - len(toggle)
            if not waits and len(under) >= short and resources_fit(node, request):
                waits = tuple((node.name, g.index) for g in under[:short])
            elif mixed is None and under and len(under) + len(reset) >= short:
                rest = reset[: short - len(under)] if resources_fit(node, request) else None
                if rest is not None:
                    mixed = (_refs(node, under), _refs(node, rest))
            if len(right) + len(toggle) + len(reset) >= n:
                reset_refs += [(node.name, g.index) for g in reset]
                if not resets and resources_fit(node, request):
                    need = reset[: n - len(right) - len(toggle)]
                    resets = tuple((node.name, g.index) for g in need)
            continue
        fits_gpus += 1
        if not resources_fit(node, request):
            continue
        toggles = max(0, n - len(right))
        key = (toggles, len(right) + len(toggle) - n, order)
        if best is None or key < best[0]:
            best = (key, node, right, toggle)
    if best is not None:
        _, node, right, toggle = best
        chosen = (right + toggle)[:n]
        toggled = tuple(sorted(g.index for g in chosen[len(right) :]))
        return WholePlacement(Placement(node.name, _slices(request, chosen, cat)), toggled)
    if waits:
        return WholePlacement(under_way_pending(f"{_what(n)} fit", waits, "off"))
    if mixed is not None and not resets:  # the change under way first, then a reset
        return WholePlacement(under_way_pending(f"{_what(n)} fit", mixed[0], "off", mixed[1]))
    return WholePlacement(_pending(n, eligible, fits_gpus, reset_refs), resets=resets)


def _slices(request: PodRequest, gpus: Sequence[Gpu], cat: Catalog) -> tuple[PlacedSlice, ...]:
    out: list[PlacedSlice] = []
    it = iter(gpus)
    for s in request.slices:
        for _ in range(s.count if s.profile == WHOLE_GPU_PROFILE else 0):
            g = next(it)
            model = cat.model(g.model)
            slots = model.memory_slots if model is not None else 8
            out.append(PlacedSlice(s.container, WHOLE_GPU_PROFILE, g.index, 0, slots))
    return tuple(out)


def _refs(node: NodeState, gpus: Sequence[Gpu]) -> tuple[GpuRef, ...]:
    return tuple((node.name, g.index) for g in gpus)


def _what(n: int) -> str:
    return f"{n} whole GPU{'s' if n > 1 else ''}"


def _pending(n: int, eligible: int, fits_gpus: int, reset_refs: list[GpuRef]) -> Pending:
    what = _what(n)
    if eligible == 0:
        return Pending(
            PendingReason.NO_MATCHING_NODE,
            f"no node matches the pod's nodeSelector, affinity and tolerations ({what} asked)",
        )
    if fits_gpus:
        return Pending(
            PendingReason.NODE_RESOURCES,
            f"{fits_gpus} node(s) have {what} free but not the pod's cpu, memory or pod slot",
        )
    if reset_refs:
        names = ", ".join(f"{node}/GPU {i}" for node, i in reset_refs[:8])
        return Pending(
            PendingReason.NEEDS_MIG_MODE_CHANGE,
            f"{what} fit only after turning MIG off on {names}, which on these GPUs (Ampere) "
            "needs a GPU reset; InstaSlice never resets a GPU for a pod",
        )
    return Pending(
        PendingReason.FULL,
        f"no node has {what} free: a whole GPU needs a GPU with nothing on it whose MIG mode "
        "is off or can be turned off without a reset",
    )
