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
from common.placement.tables import ModelTables, free_starts, gpu_state, model_tables

# One GPU: (model, sorted entries (start, size, profile, pod)).
_Gpu = tuple[str, tuple[tuple[int, int, str, str], ...]]
# One node: (cpu free, memory free, pods free, sorted GPUs).
_Node = tuple[int, int, int, tuple[_Gpu, ...]]
_State = tuple[_Node, ...]


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
        end = trace.end
        if end is None:
            end = max((e.t for e in trace.events), default=0.0)
        self.end = end
        leave: dict[int, float] = {}
        alive: dict[str, int] = {}
        for i, ev in enumerate(trace.events):
            if isinstance(ev, AddEvent):
                alive[ev.pod] = i
            elif ev.pod in alive:
                leave[alive.pop(ev.pod)] = ev.t
        self.duration = {
            i: max(0.0, leave.get(i, end) - ev.t)
            for i, ev in enumerate(trace.events)
            if isinstance(ev, AddEvent)
        }

    def table(self, model: str) -> ModelTables | None:
        if model not in self.tables:
            m = self.catalog.model(model)
            self.tables[model] = model_tables(m) if m is not None else None
        return self.tables[model]

    def initial(self) -> _State:
        """Only usable GPUs take part (unhealthy / MIG-disabled ones never hold a slice)."""
        return tuple(
            (
                n.cpu_millis,
                n.memory_bytes,
                n.pods,
                tuple(sorted((g.model, ()) for g in n.gpus if g.usable)),
            )
            for n in self.trace.nodes
        )

    def placements(self, state: _State, req: PodRequest) -> Iterator[tuple[_State, int]]:
        """Every distinct state after placing `req`, with the slots it took."""
        demand = sorted(
            ((s.profile, s.container) for s in req.slices for _ in range(s.count)),
            key=lambda d: profile_order(d[0]),
        )
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
            for new_gpus, slots in self._assign(list(gpus), demand, 0, req.name):
                key = tuple(sorted(new_gpus))
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
        for gi, (model, entries) in enumerate(gpus):
            if (model, entries) in tried:
                continue
            tried.add((model, entries))
            t = self.table(model)
            if t is None or profile not in t.profiles:
                continue
            pt = t.profiles[profile]
            st = gpu_state(t, tuple((s, z, p) for s, z, p, _ in entries))
            for i in free_starts(t, st, pt):
                entry = (pt.starts[i], pt.size, profile, pod)
                gpus[gi] = (model, tuple(sorted((*entries, entry))))
                for out, slots in self._assign(gpus, demand, k + 1, pod):
                    yield out, slots + pt.size
                gpus[gi] = (model, entries)

    @staticmethod
    def release(state: _State, pod: str, req: PodRequest) -> _State:
        """`pod` leaves: its slots, cpu, memory and pod slot are free again."""
        out = []
        for cpu, mem, pods, gpus in state:
            new = tuple(
                sorted((m, tuple(e for e in entries if e[3] != pod)) for m, entries in gpus)
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
                Gpu(k, model, True, True, tuple(Occupied(s, z, p) for s, z, p, _ in entries))
                for k, (model, entries) in enumerate(gpus)
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
    return sum(e[1] for _, _, _, gpus in state for _, entries in gpus for e in entries)


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
