"""Size-based slice requests: "a slice with at least 20 GiB", resolved per GPU model.

A user asks by size with one annotation per container (docs/contract.md §1):

    instaslice.io/mig-size.<container>: "memory>=20Gi"
    instaslice.io/mig-size.<container>: "memory>=20Gi,multiprocessors>=26,count=2"

`memory` (required) is a Kubernetes quantity compared with NVML's memory size in MiB, never
with the rounded profile names: H100-80GB `1g.20gb` is 20096 MiB = 19.6 GiB, so it does *not*
satisfy `memory>=20Gi`. `multiprocessors` (optional) is NVML's SM count of the GPU instance.
`count` (optional, default 1) is how many such slices the container gets.

On one GPU model the ask resolves to its *smallest* fitting profile (least memory, then fewest
memory slots, then fewest compute slices); media-extension profiles (`+me`, `-me`, `+gfx`) are
never chosen. `place_sized` tries every model of the snapshot, each on that model's GPUs only
(all of a pod's slices share a node), with the same MIG mode rules as a profile ask
(common/placement/modes.py: GPUs in MIG mode first, a mode change only when nothing else
fits, the same pending reasons), and keeps the decision that gives least memory. A pod
that does not fit is planned for preemption the same way (`plan_sized_preemption`): per
model, the asks resolved on it, `plan_preemption` on that model's GPUs, the cheapest plan by
the planner's own cost. Pure.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any, Final

from common.catalog import Catalog, GpuModel, Profile
from common.constants import SIZE_ANNOTATION_PREFIX
from common.placement import Pending, Policy, engine
from common.placement.model import PendingReason, PodRequest, SliceRequest, Snapshot
from common.placement.modes import ModePlacement, ModeView, PlaceFn, mode_steps
from common.placement.preempt import Cost, Frees, Holder, PreemptionPlan, plan_preemption
from common.podspec import holds_uncharged, iter_containers
from common.quantity import parse_quantity

MIB: Final = 1024 * 1024
_TERM = re.compile(r"^\s*(?P<key>[a-z]+)\s*(?P<op>>=|=)\s*(?P<value>[^\s,]+)\s*$")
_INT = re.compile(r"^[1-9][0-9]{0,5}$")


class SizeError(ValueError):
    """A size annotation that does not parse; the message names the term."""


@dataclass(frozen=True, slots=True)
class Size:
    """What one container asks: `count` slices, each ≥ `memory_mib` and ≥ `multiprocessors`."""

    memory_mib: int
    multiprocessors: int = 0
    count: int = 1

    def __str__(self) -> str:
        gib = Fraction(self.memory_mib, 1024)
        mem = f"{float(gib):g} GiB" if gib.denominator <= 1024 else f"{self.memory_mib} MiB"
        sm = f" and >= {self.multiprocessors} multiprocessors" if self.multiprocessors else ""
        return f">= {mem}{sm}"


@dataclass(frozen=True, slots=True)
class SizeAsk:
    container: str
    size: Size


def parse_size(text: str, *, max_count: int = 1024) -> Size:
    """`memory>=20Gi[,multiprocessors>=N][,count=N]` → Size; SizeError names what is wrong."""
    if not isinstance(text, str) or not text.strip():
        raise SizeError("is empty; write e.g. memory>=20Gi")
    seen: dict[str, str] = {}
    for term in text.split(","):
        m = _TERM.match(term)
        if m is None:
            raise SizeError(f"term {term.strip()!r} is not key>=value or count=N")
        key, op, value = m["key"], m["op"], m["value"]
        want = "=" if key == "count" else ">="
        if key not in ("memory", "multiprocessors", "count"):
            raise SizeError(f"unknown term {key!r} (known: memory, multiprocessors, count)")
        if op != want:
            raise SizeError(f"{key} takes {want!r}, not {op!r}")
        if key in seen:
            raise SizeError(f"{key} is given twice")
        seen[key] = value
    if "memory" not in seen:
        raise SizeError("memory>=<quantity> is required (e.g. memory>=20Gi)")
    try:
        memory = parse_quantity(seen["memory"])
    except ValueError:
        raise SizeError(f"memory {seen['memory']!r} is not a quantity (e.g. 20Gi)") from None
    if memory <= 0:
        raise SizeError(f"memory {seen['memory']!r} must be positive")
    memory_mib = -(-memory // MIB)  # a ceiling: ">= 1.5Mi" needs 2 MiB
    sm = seen.get("multiprocessors")
    count = seen.get("count", "1")
    for key, value in (("multiprocessors", sm), ("count", count)):
        if value is not None and not _INT.match(value):
            raise SizeError(f"{key} {value!r} is not a positive integer")
    if int(count) > max_count:
        raise SizeError(f"count {count} exceeds the limit of {max_count}")
    return Size(int(memory_mib), int(sm) if sm else 0, int(count))


def size_asks(pod: Mapping[str, Any]) -> list[SizeAsk]:
    """The size asks of a pod's annotations (raises SizeError, naming the annotation; an ask
    for an init container that is not a sidecar is one, as in `podspec.slice_requests`)."""
    meta = pod.get("metadata")
    annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
    if not isinstance(annotations, Mapping):
        return []
    held = {
        c.get("name")
        for fld, _, c in iter_containers(pod)
        if isinstance(c, Mapping) and holds_uncharged(fld, c)
    }
    out = []
    for key, value in sorted(annotations.items()):
        if isinstance(key, str) and key.startswith(SIZE_ANNOTATION_PREFIX):
            container = key[len(SIZE_ANNOTATION_PREFIX) :]
            if container in held:
                raise SizeError(
                    f"metadata.annotations[{key}]: names an init container that is not a "
                    "sidecar (restartPolicy: Always); no quota would count its slices"
                )
            try:
                out.append(SizeAsk(container, parse_size(value)))
            except SizeError as exc:
                raise SizeError(f"metadata.annotations[{key}]: {exc}") from None
    return out


def _plain(p: Profile) -> bool:
    return "+" not in p.name and "-me" not in p.name


def resolve(model: GpuModel, size: Size) -> Profile | None:
    """`model`'s smallest plain profile meeting `size`, or None."""
    fits = [
        p
        for p in model.profiles
        if _plain(p)
        and p.memory_mib >= size.memory_mib
        and p.multiprocessors >= size.multiprocessors
    ]
    return min(
        fits, key=lambda p: (p.memory_mib, p.memory_slots, p.compute_slices, p.name), default=None
    )


def largest(models: Iterable[GpuModel]) -> tuple[GpuModel, Profile] | None:
    """The plain profile with the most memory over `models` (for "largest offered" messages)."""
    pairs = [(m, p) for m in models for p in m.profiles if _plain(p)]
    return max(pairs, key=lambda mp: (mp[1].memory_mib, mp[1].multiprocessors), default=None)


def unsatisfiable(size: Size, models: Iterable[GpuModel], where: str) -> str:
    """Why no model (of `where`: "the catalog", "the cluster") offers `size`, naming the
    largest slice there is."""
    big = largest(models)
    tail = f" (largest: {big[0].name} {big[1].name} = {big[1].memory_mib} MiB)" if big else ""
    return f"no GPU model in {where} offers a slice with {size}{tail}"


def place_sized(
    snapshot: Snapshot,
    request: PodRequest,
    asks: Iterable[SizeAsk],
    policy: Policy,
    catalog: Catalog,
    modes: ModeView | Callable[[Snapshot], ModeView],
    place: PlaceFn = engine.place,
) -> ModePlacement:
    """Place `request` plus the size `asks`, resolved on each GPU model of `snapshot` (its
    GPUs in any MIG mode), with `place_with_modes`'s rules and reasons across the models:
    every model's GPUs in MIG mode first, then its GPUs whose MIG mode the agent would change
    (`modes`: as for `place_with_modes`; a function is given each model's own snapshot), and
    so on, one attempt at a time (`mode_steps`); among the models an attempt decides for, the
    least memory wins, then the fewest memory slots, then the model's name (when none
    places, the most advanced reason first, as the engine ranks its own)."""
    asks = list(asks)
    models = sorted({g.model for n in snapshot.nodes for g in n.gpus})
    offered: list[GpuModel] = []
    runs: list[tuple[tuple[int, int, str], Iterator[ModePlacement | None]]] = []
    for name in models:
        model = catalog.model(name)
        if model is None:
            continue
        offered.append(model)
        on_model = resolved_on(model, request, asks)
        if on_model is None:
            continue
        resolved, memory, slots = on_model
        sub = _of_model(snapshot, name)
        view = modes if callable(modes) else _within(modes, sub)
        steps = mode_steps(sub, resolved, view, policy, catalog, place)
        runs.append(((memory, slots, name), steps))
    while runs:  # each run's i-th step is the same attempt; the last attempt always decides
        decided = [(key, step) for key, steps in runs if (step := next(steps)) is not None]
        if decided:
            return min(decided, key=lambda d: (_advanced(d[1]), d[0]))[1]
    for a in asks:
        if all(resolve(m, a.size) is None for m in offered):
            why = unsatisfiable(a.size, offered, "the cluster")
            return ModePlacement(
                Pending(PendingReason.NO_PROFILE, f"container {a.container!r}: {why}")
            )
    return ModePlacement(
        Pending(
            PendingReason.NO_PROFILE,
            "no GPU model in the cluster offers every size this pod asks for on one GPU model",
        )
    )


def resolved_on(
    model: GpuModel, request: PodRequest, asks: list[SizeAsk]
) -> tuple[PodRequest, int, int] | None:
    """`request` with the size `asks` resolved on `model` added as profile asks, and the
    memory (MiB) and memory slots they take; None when `model` offers no fit for one."""
    resolved = [(a, p) for a in asks if (p := resolve(model, a.size)) is not None]
    if len(resolved) < len(asks):
        return None
    extra = tuple(SliceRequest(a.container, p.name, a.size.count) for a, p in resolved)
    memory = sum(p.memory_mib * a.size.count for a, p in resolved)
    slots = sum(p.memory_slots * a.size.count for a, p in resolved)
    return replace(request, slices=request.slices + extra), memory, slots


def plan_sized_preemption(
    snapshot: Snapshot,
    request: PodRequest,
    asks: Iterable[SizeAsk],
    holders: Iterable[Holder],
    *,
    catalog: Catalog,
    pdb_allowed: Mapping[str, int] | None = None,
    policy: Policy = Policy.INSTASLICE,
    spare: Mapping[str, Frees] | None = None,
) -> PreemptionPlan | None:
    """A preemption plan for `request` plus the size `asks`, as `place_sized` would place
    them: per GPU model of `snapshot`, the asks resolved on it and planned on its GPUs only
    (`plan_preemption`); the cheapest plan by the planner's own cost wins, then the least
    memory, the fewest slots, the model's name. Its placement names the resolved profiles.
    None when no model's plan exists."""
    asks, holders = list(asks), list(holders)
    best: tuple[tuple[Cost, int, int, str], PreemptionPlan] | None = None
    for name in sorted({g.model for n in snapshot.nodes for g in n.gpus}):
        model = catalog.model(name)
        on_model = None if model is None else resolved_on(model, request, asks)
        if on_model is None:
            continue
        resolved, memory, slots = on_model
        plan = plan_preemption(
            _of_model(snapshot, name),
            resolved,
            holders,
            pdb_allowed=pdb_allowed,
            policy=policy,
            catalog=catalog,
            spare=spare,
        )
        if plan is not None and (best is None or (plan.cost, memory, slots, name) < best[0]):
            best = ((plan.cost, memory, slots, name), plan)
    return None if best is None else best[1]


# The engine's precedence among its own reasons (explain.py), most advanced first: what would
# unblock the pod. Among the models' plain Pendings (the last attempt) the most advanced one
# tells, so a model the pod's selector leaves out never hides the one it picked being full.
_PRECEDENCE: Final = (
    PendingReason.NODE_RESOURCES,
    PendingReason.FRAGMENTED,
    PendingReason.FULL,
    PendingReason.GPU_UNAVAILABLE,
)


def _advanced(step: ModePlacement) -> int:
    """-1 for a placement (before any Pending); a Pending's place in `_PRECEDENCE` (the
    other reasons after)."""
    result = step.result
    if not isinstance(result, Pending):
        return -1
    return _PRECEDENCE.index(result.reason) if result.reason in _PRECEDENCE else len(_PRECEDENCE)


def _of_model(snapshot: Snapshot, name: str) -> Snapshot:
    """`snapshot` with the GPUs of model `name` only, and only the nodes that have one;
    `snapshot` itself when that is all of it (the allocator's fleet index answers then)."""
    if all(n.gpus and all(g.model == name for g in n.gpus) for n in snapshot.nodes):
        return snapshot
    return Snapshot(
        tuple(
            replace(n, gpus=tuple(g for g in n.gpus if g.model == name))
            for n in snapshot.nodes
            if any(g.model == name for g in n.gpus)
        )
    )


def _within(view: ModeView, snapshot: Snapshot) -> ModeView:
    """`view` less the GPUs not in `snapshot` (its messages count the GPUs in a state)."""
    if not (view.flex or view.needs_reset or view.under_way):
        return view
    gpus = {(n.name, g.index) for n in snapshot.nodes for g in n.gpus}
    return ModeView(view.flex & gpus, view.needs_reset & gpus, view.under_way & gpus)
