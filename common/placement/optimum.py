"""The exact optimum of a small trace: the best placement decisions with perfect hindsight.

Same rules as every policy: a pod that can be placed when it arrives must be placed (this
module chooses *where*, not *whether*), one that cannot is dropped, removals free slots. The
search branches over every distinct legal placement of each arriving pod and memoises on
(event, cluster state); GPUs of a node are interchangeable, so their states are sorted.
Objectives: the number of accepted pods, or the slot-time served (memory slots x time held
within the trace). Exponential in the worst case: meant for a handful of GPUs and a few
dozen events; it gives up (returns None) past `budget` explored states.

The result is an upper bound for any policy that places whenever it can — `instaslice`,
`first-fit`, `spread`. (`static-balanced` plays by other rules: fixed slices.)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum

from common.catalog import Catalog, load_catalog
from common.placement.engine import place
from common.placement.model import (
    Gpu,
    NodeState,
    Occupied,
    Pending,
    PendingReason,
    PodRequest,
    Snapshot,
)
from common.placement.replay import AddEvent, RemoveEvent, Trace
from common.placement.search import profile_order
from common.placement.tables import (
    GpuState,
    ModelTables,
    ProfileTable,
    add,
    can_add,
    free_starts,
    gpu_state,
    model_tables,
)

# One GPU: (model, slots of anonymous instances, sorted named entries (start, size,
# profile, pod)). A pod that never leaves within the trace is anonymous: only its slots
# matter (when count and engine limits cannot bind, see _limits_never_bind).
_Gpu = tuple[str, int, tuple[tuple[int, int, str, str], ...]]
# One node: (cpu free, memory free, pods free, sorted GPUs).
_Node = tuple[int, int, int, tuple[_Gpu, ...]]
_State = tuple[_Node, ...]


def _automorphisms(tables: ModelTables) -> tuple[tuple[int, ...], ...]:
    """Slot permutations that map every profile's placements onto that profile's placements
    (on 8-slot parts: swap slots 0/1, 2/3, 4/5 and the pairs 0-1/2-3: 16 in all). Two GPU
    states related by one have the same future, so the search keeps one of them."""
    n = tables.slots
    if n > 8:
        return (tuple(range(n)),)
    shapes = [frozenset(t.masks) for t in tables.by_index]
    found: list[tuple[int, ...]] = []
    perm: list[int] = []

    def image(mask: int) -> int:
        out = 0
        for i in range(n):
            if mask >> i & 1:
                out |= 1 << perm[i]
        return out

    def ok_so_far() -> bool:
        done = (1 << len(perm)) - 1
        for masks in shapes:
            for m in masks:
                if m & ~done == 0 and image(m) not in masks:
                    return False
        return True

    def extend() -> None:
        if len(perm) == n:
            found.append(tuple(perm))
            return
        for j in range(n):
            if j not in perm:
                perm.append(j)
                if ok_so_far():
                    extend()
                perm.pop()

    extend()
    return tuple(found)


def _limits_never_bind(tables: ModelTables, profiles: set[str]) -> bool:
    """True when no set of non-overlapping placements of `profiles` breaks a count, engine
    or SM limit — then a GPU's future depends on its occupied slots alone."""
    ts = [tables.profiles[p] for p in sorted(profiles) if p in tables.profiles]
    spots = [(t, m) for t in ts for m in t.masks]
    ok = True

    def walk(k: int, st: GpuState) -> None:
        nonlocal ok
        if not ok:
            return
        for j in range(k, len(spots)):
            t, m = spots[j]
            if st.mask & m:
                continue
            i = t.masks.index(m)
            if not can_add(tables, st, t, i):
                ok = False
                return
            walk(j + 1, add(st, t, i))

    walk(0, gpu_state(tables, ()))
    return ok


class Objective(Enum):
    PODS = "pods"
    SLOT_TIME = "slot_time"


@dataclass(frozen=True, slots=True)
class OptimumRun:
    accepted_pods: int
    slot_time: float
    dropped: tuple[tuple[str, PendingReason], ...]
    explored: int


class _Budget(Exception):
    pass


class _Search:
    def __init__(self, trace: Trace, objective: Objective, catalog: Catalog, budget: int):
        self.trace = trace
        self.objective = objective
        self.catalog = catalog
        self.budget = budget
        self.explored = 0
        self.memo: dict[tuple[int, _State], tuple[float, _State | None]] = {}
        self.tables: dict[str, ModelTables | None] = {}
        self.moves: dict[str, tuple[tuple[dict[tuple[int, int], int], tuple[int, ...]], ...]]
        self.moves = {}
        self.canons: dict[_Gpu, _Gpu] = {}
        self.states: dict[_Gpu, GpuState] = {}
        self.frees: dict[tuple[_Gpu, str], list[int]] = {}
        self.demands: dict[str, list[tuple[str, str]]] = {}
        end = trace.end
        if end is None:
            end = max((e.t for e in trace.events), default=0.0)
        self.end = end
        leave: dict[int, float] = {}
        alive: dict[str, int] = {}
        self.leaving: set[str] = set()
        for i, ev in enumerate(trace.events):
            if isinstance(ev, AddEvent):
                alive[ev.pod] = i
            elif ev.pod in alive:
                leave[alive.pop(ev.pod)] = ev.t
                self.leaving.add(ev.pod)
        used: dict[str, set[str]] = {}
        for n in trace.nodes:
            for g in n.gpus:
                used.setdefault(g.model, set())
        for ev in trace.events:
            if isinstance(ev, AddEvent):
                for sl in ev.request.slices:
                    for model in used:
                        used[model].add(sl.profile)
        self.mask_only = all(
            (t := self.table(model)) is None or _limits_never_bind(t, profiles)
            for model, profiles in used.items()
        )
        self.duration = {
            i: max(0.0, leave.get(i, end) - ev.t)
            for i, ev in enumerate(trace.events)
            if isinstance(ev, AddEvent)
        }

    def table(self, model: str) -> ModelTables | None:
        if model not in self.tables:
            m = self.catalog.model(model)
            t = model_tables(m) if m is not None else None
            self.tables[model] = t
            perms = _automorphisms(t) if t is not None else ()
            spans = {(s, p.size) for p in (t.by_index if t else ()) for s in p.starts}
            self.moves[model] = tuple(
                ({(s, z): min(perm[i] for i in range(s, s + z)) for s, z in spans}, perm)
                for perm in perms
                if perm != tuple(range(len(perm)))
            )
        return self.tables[model]

    def canon(self, gpu: _Gpu) -> _Gpu:
        """The least of the GPU's symmetric images (see _automorphisms)."""
        hit = self.canons.get(gpu)
        if hit is not None:
            return hit
        model, anon, entries = gpu
        best = (anon, entries)
        if (anon or entries) and self.table(model) is not None:
            for moved, bits in self.moves[model]:
                image = 0
                for i, j in enumerate(bits):
                    if anon >> i & 1:
                        image |= 1 << j
                cand = (image, tuple(sorted((moved[s, z], z, p, pod) for s, z, p, pod in entries)))
                if cand < best:
                    best = cand
        out = (model, best[0], best[1])
        self.canons[gpu] = out
        return out

    def initial(self) -> _State:
        """Only usable GPUs take part (unhealthy / MIG-disabled ones never hold a slice)."""
        return tuple(
            (
                n.cpu_millis,
                n.memory_bytes,
                n.pods,
                tuple(sorted((g.model, 0, ()) for g in n.gpus if g.usable)),
            )
            for n in self.trace.nodes
        )

    def placements(self, state: _State, req: PodRequest) -> Iterator[tuple[_State, int]]:
        """Every distinct state after placing `req`, with the slots it took."""
        demand = self.demands.get(req.name)
        if demand is None:
            demand = sorted(
                ((s.profile, s.container) for s in req.slices for _ in range(s.count)),
                key=lambda d: profile_order(d[0]),
            )
            self.demands[req.name] = demand
        spec = self.trace.nodes
        for ni, (cpu, mem, pods, gpus) in enumerate(state):
            if cpu < req.cpu_millis or mem < req.memory_bytes or pods < 1:
                continue
            node = spec[ni]
            if node.labels is not None and any(
                node.labels.get(k) != v for k, v in req.node_selector.items()
            ):
                continue
            seen: set[tuple[_Gpu, ...]] = set()
            # A pod that never leaves within the trace needs no name: anonymous entries let
            # states that differ only in who holds a slot merge (a batch is then tiny).
            token = req.name if req.name in self.leaving else ""
            for new_gpus, slots in self._assign(list(gpus), demand, 0, token):
                key = tuple(sorted(self.canon(g) for g in new_gpus))
                if key in seen:
                    continue
                seen.add(key)
                node_state = (cpu - req.cpu_millis, mem - req.memory_bytes, pods - 1, key)
                yield (*state[:ni], node_state, *state[ni + 1 :]), slots

    def _assign(
        self,
        gpus: list[_Gpu],
        demand: list[tuple[str, str]],
        k: int,
        pod: str,
    ) -> Iterator[tuple[list[_Gpu], int]]:
        if k == len(demand):
            yield list(gpus), 0
            return
        profile = demand[k][0]
        tried: set[_Gpu] = set()
        for gi, gpu in enumerate(gpus):
            if gpu in tried:
                continue
            tried.add(gpu)
            model, anon, entries = gpu
            t = self.table(model)
            if t is None or profile not in t.profiles:
                continue
            pt = t.profiles[profile]
            for i in self.free(gpu, t, pt):
                if pod or not self.mask_only:
                    entry = (pt.starts[i], pt.size, profile, pod)
                    gpus[gi] = (model, anon, tuple(sorted((*entries, entry))))
                else:
                    gpus[gi] = (model, anon | pt.masks[i], entries)
                for out, slots in self._assign(gpus, demand, k + 1, pod):
                    yield out, slots + pt.size
                gpus[gi] = gpu

    def free(self, gpu: _Gpu, t: ModelTables, pt: ProfileTable) -> list[int]:
        """Indices of the starts where one more `pt` fits on `gpu` (memoised)."""
        key = (gpu, pt.name)
        hit = self.frees.get(key)
        if hit is not None:
            return hit
        st = self.states.get(gpu)
        if st is None:
            _, anon, entries = gpu
            named = gpu_state(t, tuple((s, z, p) for s, z, p, _ in entries))
            st = GpuState(named.mask | anon, named.counts, named.engines, named.compute)
            self.states[gpu] = st
        out = free_starts(t, st, pt)
        self.frees[key] = out
        return out

    def release(self, state: _State, pod: str, req: PodRequest) -> _State:
        """`pod` leaves: its slots, cpu, memory and pod slot are free again."""
        out = []
        for cpu, mem, pods, gpus in state:
            new = tuple(
                sorted(
                    self.canon((m, anon, tuple(e for e in entries if e[3] != pod)))
                    for m, anon, entries in gpus
                )
            )
            if new != gpus:
                out.append((cpu + req.cpu_millis, mem + req.memory_bytes, pods + 1, new))
            else:
                out.append((cpu, mem, pods, gpus))
        return tuple(out)

    def best(self, i: int, state: _State) -> float:
        events = self.trace.events
        if i == len(events):
            return 0.0
        key = (i, state)
        hit = self.memo.get(key)
        if hit is not None:
            return hit[0]
        self.explored += 1
        if self.explored > self.budget:
            raise _Budget
        ev = events[i]
        value: float
        choice: _State | None
        if isinstance(ev, RemoveEvent):
            req = self.request_of(ev.pod, i)
            nxt = self.release(state, ev.pod, req) if req is not None else state
            value, choice = self.best(i + 1, nxt), nxt
        else:
            value, choice = -1.0, None
            for nxt, slots in self.placements(state, ev.request):
                gain = 1.0 if self.objective is Objective.PODS else slots * self.duration[i]
                v = gain + self.best(i + 1, nxt)
                if v > value:
                    value, choice = v, nxt
            if choice is None:
                value, choice = self.best(i + 1, state), None
        self.memo[key] = (value, choice)
        return value

    def request_of(self, pod: str, before: int) -> PodRequest | None:
        for j in range(before - 1, -1, -1):
            ev = self.trace.events[j]
            if isinstance(ev, AddEvent) and ev.pod == pod:
                return ev.request
        return None

    def snapshot(self, state: _State) -> Snapshot:
        nodes = []
        for spec, (cpu, mem, pods, gpus) in zip(self.trace.nodes, state, strict=True):
            built = tuple(
                Gpu(
                    k,
                    model,
                    occupied=tuple(Occupied(s, z, p) for s, z, p, _ in entries)
                    + tuple(Occupied(i, 1, "") for i in range(anon.bit_length()) if anon >> i & 1),
                )
                for k, (model, anon, entries) in enumerate(gpus)
            )
            nodes.append(
                NodeState(spec.name, spec.labels, spec.taints, False, cpu, mem, pods, built)
            )
        return Snapshot(tuple(nodes))

    def walk(self) -> OptimumRun:
        """Follow the memoised best choices from the start and measure that run."""
        state = self.initial()
        accepted, slot_time = 0, 0.0
        dropped: list[tuple[str, PendingReason]] = []
        for i, ev in enumerate(self.trace.events):
            self.best(i, state)
            _, choice = self.memo.get((i, state), (0.0, state))
            if isinstance(ev, AddEvent):
                if choice is None:
                    result = place(self.snapshot(state), ev.request, catalog=self.catalog)
                    assert isinstance(result, Pending)
                    dropped.append((ev.pod, result.reason))
                else:
                    accepted += 1
                    used = _slots(choice) - _slots(state)
                    slot_time += used * self.duration[i]
                    state = choice
            elif choice is not None:
                state = choice
        return OptimumRun(accepted, slot_time, tuple(dropped), self.explored)


def _slots(state: _State) -> int:
    return sum(
        bin(anon).count("1") + sum(e[1] for e in entries)
        for _, _, _, gpus in state
        for _, anon, entries in gpus
    )


def optimum(
    trace: Trace,
    objective: Objective = Objective.SLOT_TIME,
    catalog: Catalog | None = None,
    budget: int = 200_000,
) -> OptimumRun | None:
    """The hindsight-optimal run of `trace` for `objective`, or None if over budget."""
    search = _Search(trace, objective, catalog if catalog is not None else load_catalog(), budget)
    try:
        search.best(0, search.initial())
        return search.walk()
    except _Budget:
        return None
