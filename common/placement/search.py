"""The node search behind `place`: how each policy hosts a pod's slices on one node.

Per node the pod's slices are split between its GPUs by a small dynamic programme over
(GPU, slices still to place); each GPU's share is packed exactly by `tables.gpu_fit`, which
is memoised per (model, GPU state, share). `Context` holds the per-call caches that make
one decision over 1000 nodes x 8 GPUs cheap: GPU states and node results are computed once
per distinct GPU / node key (model.py) — a fleet of identical or identically-filled GPUs is
scored once, not per GPU.

The search is complete for every policy: if any legal placement exists on a node, it is
found. The `instaslice` policy takes the split with the least total loss of potential; the
baselines place slice by slice, largest first, each at their preferred spot that still
leaves the rest placeable (a backtracking scheduler would do the same).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import product

from common.catalog import Catalog
from common.placement.model import Gpu, NodeState, PodRequest, Policy
from common.placement.selectors import mismatch
from common.placement.tables import (
    FitMode,
    GpuFit,
    GpuState,
    ModelTables,
    add,
    free_starts,
    gpu_fit,
    gpu_state,
    model_tables,
)
from common.profiles import ProfileNameError, parse_profile

_MODE = {
    Policy.INSTASLICE: FitMode.BEST,
    Policy.FIRST_FIT: FitMode.LOWEST,
    Policy.SPREAD: FitMode.LOWEST,
    Policy.STATIC_BALANCED: FitMode.STATIC,
}


def profile_order(name: str) -> tuple[int, int, str]:
    """Largest first (memory, then compute), a model-independent proxy for slot size."""
    try:
        p = parse_profile(name)
    except ProfileNameError:
        return (0, 0, name)
    return (-p.memory_gb, -p.gi_slices, name)


@dataclass(frozen=True, slots=True)
class NodeFit:
    """One node's best way to host every slice: (position in node.gpus, profile, start)."""

    cost: int
    assignment: tuple[tuple[int, str, int], ...]


@dataclass(frozen=True, slots=True)
class _Usable:
    pos: int
    tables: ModelTables
    state: GpuState


class Context:
    """Per-call caches: one entry per distinct GPU state and per distinct node state."""

    def __init__(self, catalog: Catalog, policy: Policy, request: PodRequest) -> None:
        self.catalog = catalog
        self.policy = policy
        self.mode = _MODE[policy]
        counts: dict[str, int] = {}
        for s in request.slices:
            if s.count > 0:
                counts[s.profile] = counts.get(s.profile, 0) + s.count
        self.profiles: tuple[str, ...] = tuple(sorted(counts, key=profile_order))
        self.counts: tuple[int, ...] = tuple(counts[p] for p in self.profiles)
        self.single = self.profiles[0] if self.counts == (1,) else None
        self._tables: dict[str, ModelTables | None] = {}
        self._states: dict[str, GpuState | None] = {}
        self._single: dict[str, GpuFit | None] = {}
        self._nodes: dict[str, NodeFit | None] = {}
        self._potentials: dict[str, int] = {}

    def tables(self, model: str) -> ModelTables | None:
        try:
            return self._tables[model]
        except KeyError:
            m = self.catalog.model(model)
            t = model_tables(m) if m is not None else None
            self._tables[model] = t
            return t

    def state(self, gpu: Gpu) -> GpuState | None:
        """None for a GPU that cannot take slices (unhealthy, MIG off, unknown model)."""
        try:
            return self._states[gpu.key]
        except KeyError:
            t = self.tables(gpu.model)
            st = None
            if t is not None and gpu.usable:
                st = gpu_state(t, tuple((o.start, o.size, o.profile) for o in gpu.occupied))
            self._states[gpu.key] = st
            return st

    def usable(self, node: NodeState) -> list[_Usable]:
        out = []
        for pos, g in enumerate(node.gpus):
            st = self.state(g)
            if st is not None:
                t = self.tables(g.model)
                assert t is not None
                out.append(_Usable(pos, t, st))
        return out

    def node_fit(self, node: NodeState) -> NodeFit | None:
        """How this policy would host the pod's slices on `node` (resources ignored)."""
        key = node.gpu_key
        try:
            return self._nodes[key]
        except KeyError:
            fit = self._single_fit(node) if self.single is not None else self._multi_fit(node)
            self._nodes[key] = fit
            return fit

    def _gpu_single(self, gpu: Gpu, profile: str) -> GpuFit | None:
        try:
            return self._single[gpu.key]
        except KeyError:
            fit = None
            st = self.state(gpu)
            if st is not None:
                t = self.tables(gpu.model)
                if t is not None and profile in t.profiles:
                    fit = gpu_fit(t, st, (profile,), self.mode)
            self._single[gpu.key] = fit
            return fit

    def _single_fit(self, node: NodeState) -> NodeFit | None:
        profile = self.single
        assert profile is not None
        positions: list[int] | range = range(len(node.gpus))
        if self.policy is Policy.SPREAD:
            positions = self._spread_order(node, list(positions))
        best: tuple[int, int, int] | None = None
        for pos in positions:
            fit = self._gpu_single(node.gpus[pos], profile)
            if fit is None:
                continue
            if self.mode is not FitMode.BEST:
                return NodeFit(0, ((pos, profile, fit.starts[0]),))
            if best is None or fit.cost < best[0]:
                best = (fit.cost, pos, fit.starts[0])
        if best is None:
            return None
        return NodeFit(best[0], ((best[1], profile, best[2]),))

    # --- several slices --------------------------------------------------------------
    def _demand(self, counts: tuple[int, ...]) -> tuple[str, ...]:
        return tuple(p for p, c in zip(self.profiles, counts, strict=True) for _ in range(c))

    def _fits(self, u: _Usable, counts: tuple[int, ...], mode: FitMode) -> GpuFit | None:
        demand = self._demand(counts)
        if not demand:
            return None
        if any(p not in u.tables.profiles for p in demand):
            return None
        free = u.tables.slots - bin(u.state.mask).count("1")
        if sum(u.tables.profiles[p].size for p in demand) > free:
            return None
        return gpu_fit(u.tables, u.state, demand, mode)

    def _dp(
        self, gpus: list[_Usable], counts: tuple[int, ...], mode: FitMode, want_best: bool
    ) -> tuple[int, tuple[tuple[int, str, int], ...]] | None:
        """Split `counts` over `gpus`: the cheapest split (want_best) or any split."""
        memo: dict[tuple[int, tuple[int, ...]], tuple[int, tuple[tuple[int, str, int], ...]] | None]
        memo = {}

        def go(i: int, rem: tuple[int, ...]) -> tuple[int, tuple[tuple[int, str, int], ...]] | None:
            if not any(rem):
                return (0, ())
            if i == len(gpus):
                return None
            key = (i, rem)
            if key in memo:
                return memo[key]
            best: tuple[int, tuple[tuple[int, str, int], ...]] | None = None
            for sub in _sub_vectors(rem):
                if any(sub):
                    fit = self._fits(gpus[i], sub, mode)
                    if fit is None:
                        continue
                    rest = go(i + 1, tuple(r - s for r, s in zip(rem, sub, strict=True)))
                    if rest is None:
                        continue
                    here = tuple(
                        (gpus[i].pos, p, s)
                        for p, s in zip(self._demand(sub), fit.starts, strict=True)
                    )
                    cand = (fit.cost + rest[0], here + rest[1])
                else:
                    skip = go(i + 1, rem)
                    if skip is None:
                        continue
                    cand = skip
                if best is None or cand[0] < best[0]:
                    best = cand
                    if not want_best:
                        break
            memo[key] = best
            return best

        return go(0, counts)

    def _multi_fit(self, node: NodeState) -> NodeFit | None:
        usable = self.usable(node)
        if not usable or not self.profiles:
            return None if self.profiles else NodeFit(0, ())
        if self.mode is FitMode.BEST:
            found = self._dp(usable, self.counts, FitMode.BEST, want_best=True)
            return None if found is None else NodeFit(found[0], found[1])
        return self._sequential(node, usable)

    def _sequential(self, node: NodeState, usable: list[_Usable]) -> NodeFit | None:
        """Baselines: each slice, largest first, at the policy's first preferred spot that
        keeps the remaining slices placeable (so the search is still complete)."""
        if self._dp(usable, self.counts, self.mode, want_best=False) is None:
            return None
        states = {u.pos: u for u in usable}
        rem = list(self.counts)
        out: list[tuple[int, str, int]] = []
        for k, profile in enumerate(self._demand(self.counts)):
            idx = self.profiles.index(profile)
            rem[idx] -= 1
            order = list(states)
            if self.policy is Policy.SPREAD:
                order = self._spread_order_states(states)
            placed = False
            for pos in order:
                u = states[pos]
                t = u.tables.profiles.get(profile)
                if t is None:
                    continue
                for i in free_starts(u.tables, u.state, t):
                    if (
                        self.mode is FitMode.STATIC
                        and (profile, t.starts[i]) not in u.tables.layout
                    ):
                        continue
                    trial = dict(states)
                    trial[pos] = _Usable(pos, u.tables, add(u.state, t, i))
                    if self._dp(list(trial.values()), tuple(rem), self.mode, False) is not None:
                        states = trial
                        out.append((pos, profile, t.starts[i]))
                        placed = True
                        break
                if placed:
                    break
            assert placed, f"slice {k} lost feasibility"
        return NodeFit(0, tuple(out))

    def _spread_order(self, node: NodeState, positions: list[int]) -> list[int]:
        def free(pos: int) -> int:
            g = node.gpus[pos]
            t = self.tables(g.model)
            return 0 if t is None else t.slots - bin(g.mask).count("1")

        return sorted(positions, key=lambda p: (-free(p), p))

    @staticmethod
    def _spread_order_states(states: dict[int, _Usable]) -> list[int]:
        return sorted(
            states,
            key=lambda p: (-(states[p].tables.slots - bin(states[p].state.mask).count("1")), p),
        )

    def node_free_slots(self, node: NodeState) -> int:
        total = 0
        for u in self.usable(node):
            if any(p in u.tables.profiles for p in self.profiles):
                total += u.tables.slots - bin(u.state.mask).count("1")
        return total

    def node_potential(self, node: NodeState) -> int:
        key = node.gpu_key
        v = self._potentials.get(key)
        if v is None:
            v = sum(u.tables.potential[u.state.mask] for u in self.usable(node))
            self._potentials[key] = v
        return v

    def size(self, model: str, profile: str) -> int:
        t = self.tables(model)
        assert t is not None
        return t.profiles[profile].size


def _sub_vectors(rem: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """All vectors 0 <= sub <= rem, largest first (so 'any split' finds packing quickly)."""
    return product(*(range(r, -1, -1) for r in rem))


def resources_fit(node: NodeState, request: PodRequest) -> bool:
    return (
        node.pods_free >= 1
        and node.cpu_millis_free >= request.cpu_millis
        and node.memory_bytes_free >= request.memory_bytes
    )


def eligible(node: NodeState, request: PodRequest) -> bool:
    return resources_fit(node, request) and mismatch(node, request) is None
