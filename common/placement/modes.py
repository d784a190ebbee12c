"""Placement with MIG modes: GPUs that serve MIG slices only after a mode change.

The allocator owns each GPU's mode as a placement dimension (docs/placement.md "MIG modes").
The caller derives each GPU's class from its MigNode and lists two kinds in `ModeView`:

- `flex`: MIG off, idle, and its agent can enable MIG without a reset (Hopper and newer);
- `needs_reset`: MIG off on a GPU whose mode only changes with a GPU reset (Ampere).

Every other GPU is as the snapshot says (`Gpu.mig_enabled`). `place_with_modes` places on
the GPUs already in MIG mode first, and only when nothing fits there, again with the flex
GPUs counted as empty MIG GPUs: a mode change is never chosen while a GPU in the right mode
fits (hysteresis; the engine is complete, so "nothing fits" is exact). GPUs that need a reset
are never placed on; when they alone could serve the pod, the pending reason says so and
names them (`NeedsMigModeChange`). A third kind, `under_way`: GPUs whose change to MIG on
was asked (Ampere maintenance) and is not done; they take nothing new, but a pod that would
fit there once it is done waits for it, and the reason names them
(`MigModeChangeUnderWay`), before any new reset is considered. A pod that needs both a
GPU under way and a GPU that needs a reset on the same node (and no reset alone would do)
waits `MigModeChangeUnderWay` too, naming the reset it needs after. `mode_steps` yields
these attempts one by one, for callers that weigh several requests attempt by attempt (size
asks, one request per GPU model: common/sizing.py).

Pure: snapshots in, a decision out. No I/O, no clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

from common.catalog import Catalog
from common.placement import engine
from common.placement.model import (
    Pending,
    PendingReason,
    Placement,
    PodRequest,
    Policy,
    Snapshot,
)

GpuRef = tuple[str, int]  # (node, GPU index)


@dataclass(frozen=True, slots=True)
class ModeView:
    flex: frozenset[GpuRef] = frozenset()
    needs_reset: frozenset[GpuRef] = frozenset()
    under_way: frozenset[GpuRef] = frozenset()  # asked to turn MIG on, not done yet


@dataclass(frozen=True, slots=True)
class ModePlacement:
    result: Placement | Pending
    toggles: tuple[int, ...] = ()  # GPU indexes on the chosen node whose MIG mode changes
    # NeedsMigModeChange: the GPUs a reset would open for it, all on one node (the
    # allocator's Ampere maintenance asks for exactly these)
    resets: tuple[GpuRef, ...] = ()


def with_mig(snapshot: Snapshot, gpus: Collection[GpuRef]) -> Snapshot:
    """`snapshot` with `gpus` shown as MIG-enabled (they hold no instance with MIG off)."""
    if not gpus:
        return snapshot
    by_node: dict[str, set[int]] = {}
    for node, index in gpus:
        by_node.setdefault(node, set()).add(index)
    nodes = []
    for n in snapshot.nodes:
        chosen = by_node.get(n.name)
        if chosen:
            n = dataclasses.replace(
                n,
                gpus=tuple(
                    dataclasses.replace(g, mig_enabled=True) if g.index in chosen else g
                    for g in n.gpus
                ),
            )
        nodes.append(n)
    return Snapshot(nodes=tuple(nodes))


PlaceFn = Callable[[Snapshot, PodRequest, Policy, Catalog | None], Placement | Pending]


def place_with_modes(
    snapshot: Snapshot,
    request: PodRequest,
    modes: ModeView | Callable[[Snapshot], ModeView],
    policy: Policy = Policy.INSTASLICE,
    catalog: Catalog | None = None,
    place: PlaceFn = engine.place,
) -> ModePlacement:
    """`modes`: the view, or how to derive it from `snapshot` (only after a Pending, so the
    common case is one engine call). `place`: the engine's `place`, or an equal function (the
    allocator's answers its own snapshot from the fleet index, index.py)."""
    steps = mode_steps(snapshot, request, modes, policy, catalog, place)
    return next(step for step in steps if step is not None)


def mode_steps(
    snapshot: Snapshot,
    request: PodRequest,
    modes: ModeView | Callable[[Snapshot], ModeView],
    policy: Policy = Policy.INSTASLICE,
    catalog: Catalog | None = None,
    place: PlaceFn = engine.place,
) -> Iterator[ModePlacement | None]:
    """`place_with_modes`'s attempts in its order of preference, lazily, one item each: None
    while an attempt decides nothing, then the first decision (the last attempt, the plain
    Pending, always decides). So the i-th item of two requests' steps comes from the same
    attempt: a caller weighing several requests (a size ask resolved per GPU model,
    common/sizing.py) advances them together and chooses among the first decisions."""
    first = place(snapshot, request, policy, catalog)
    if isinstance(first, Placement):
        yield ModePlacement(first)
        return
    yield None
    if callable(modes):
        modes = modes(snapshot)
    if modes.flex:
        second = place(with_mig(snapshot, modes.flex), request, policy, catalog)
        if isinstance(second, Placement):
            used = {s.gpu_index for s in second.slices if (second.node, s.gpu_index) in modes.flex}
            yield ModePlacement(second, tuple(sorted(used)))
            return
    yield None
    if modes.under_way:
        waits = _under_way(snapshot, request, modes, policy, catalog, place)
        if waits is not None:
            yield ModePlacement(waits)
            return
    yield None
    if modes.needs_reset:
        hypothetical = with_mig(snapshot, modes.flex | modes.needs_reset)
        third = place(hypothetical, request, policy, catalog)
        if isinstance(third, Placement):
            resets = sorted({(third.node, s.gpu_index) for s in third.slices} & modes.needs_reset)
            yield ModePlacement(_needs_reset(third, modes, first), resets=tuple(resets))
            return
    yield None
    if modes.under_way and modes.needs_reset:  # only the change under way and a reset: wait
        waits = _under_way(snapshot, request, modes, policy, catalog, place, resets=True)
        if waits is not None:
            yield ModePlacement(waits)
            return
    yield None
    yield ModePlacement(first)


def _under_way(
    snapshot: Snapshot,
    request: PodRequest,
    modes: ModeView,
    policy: Policy,
    catalog: Catalog | None,
    place: PlaceFn,
    resets: bool = False,
) -> Pending | None:
    """MigModeChangeUnderWay when the pod would fit once the changes under way are done.
    Only their nodes are tried (anywhere else it would fit now, or after a toggle: tried
    first), with those GPUs shown healthy and in MIG mode (their asked mode). `resets`: the
    GPUs that need a reset shown in MIG mode too (tried only once no reset alone would do):
    the pod waits for the change under way first, and the message names the resets after."""
    nodes = {name for name, _ in modes.under_way}
    after = []
    for n in snapshot.nodes:
        if n.name in nodes:
            gpus = tuple(
                dataclasses.replace(g, mig_enabled=True, healthy=True)
                if (n.name, g.index) in modes.under_way
                else g
                for g in n.gpus
            )
            after.append(dataclasses.replace(n, gpus=gpus))
    shown = modes.flex | modes.needs_reset if resets else modes.flex
    would = place(with_mig(Snapshot(tuple(after)), shown), request, policy, catalog)
    if not isinstance(would, Placement):
        return None
    on = {(would.node, s.gpu_index) for s in would.slices}
    used = sorted(on & modes.under_way)
    then = sorted(on & modes.needs_reset) if resets else []
    return under_way_pending("it fits", used, "on", then) if used else None


def under_way_pending(
    what: str, gpus: Collection[GpuRef], mode: str, resets: Collection[GpuRef] = ()
) -> Pending:
    """The pod waits for the MIG mode changes under way on `gpus` (Ampere maintenance);
    `resets`: the GPUs it needs changed too after that, each by a GPU reset of its own."""
    names = ", ".join(f"{node}/GPU {i}" for node, i in gpus)
    after = ""
    if resets:
        more = ", ".join(f"{node}/GPU {i}" for node, i in resets)
        after = (
            f", and then a MIG mode change on {more} too (MIG {mode}), which needs a GPU reset "
            "of its own (one change is asked at a time)"
        )
    return Pending(
        PendingReason.MIG_MODE_CHANGE_UNDER_WAY,
        f"{what} once the MIG mode change under way on {names} is done (MIG {mode}; Ampere "
        f"maintenance: the GPU takes nothing new while its node agent drains and resets it)"
        f"{after}; the pod is placed then",
    )


def _needs_reset(would: Placement, modes: ModeView, first: Pending) -> Pending:
    on_node = sorted(
        {s.gpu_index for s in would.slices if (would.node, s.gpu_index) in modes.needs_reset}
    )
    names = ", ".join(f"{would.node}/GPU {i}" for i in on_node)
    others = len(modes.needs_reset) - len(on_node)
    more = f" ({others} more GPU(s) in the same state)" if others > 0 else ""
    return Pending(
        PendingReason.NEEDS_MIG_MODE_CHANGE,
        f"it fits only after a MIG mode change on {names}{more}, which on these GPUs "
        "(Ampere) needs a GPU reset; InstaSlice never resets a GPU for a pod. An admin can "
        f"enable MIG there (nvidia-smi -mig 1, then a reset). Otherwise: {first.message}",
    )
