"""Placement benchmark: quality of every policy on seeded traces, and decision speed.

`python -m bench.placement` (make bench-placement) replays seeded traces through the
engine under each policy — `instaslice`, `first-fit`, `spread`, `static-balanced` — and,
where the instance is small enough, through the exact hindsight optimum (optimum.py):

- churn-*: Poisson arrivals, exponential lifetimes, offered load above capacity, on H100,
  H200, A100 and mixed A100+H100 fleets; a size mix of 1g … 7g with some multi-slice pods.
- fill-*: a batch that asks for more than the fleet holds, arriving at once, never leaving.
- trap-*: the known fragmentation traps (the issue's and the reference's); counter-*: a
  sequence where no online policy can be right for every future (first fit wins it);
  removal-*: dra-driver-nvidia-gpu#933, where the order of departures decides.
- opt-*: small churn and batch instances where the optimum is computed.

Metrics per (trace, policy): accepted pods; slot utilisation = time-averaged share of the
fleet's memory slots held (slot-time served / (slots x trace length)); pods dropped as
FRAGMENTED. Decision speed: `place` on a 1000-node x 8-GPU snapshot with random legal
occupancy, as the allocator calls it (snapshot updated between calls, caches warm).

Then the priority traces of bench/preemption.py: how long a high-priority 4g/7g waits on a
full fleet with and without preemption, and the victims chosen against a brute force
(`.dev/bench/preemption.json`); then the allocator-model scenarios of
bench/placement_scenarios.py (`--scenarios`: `--avoid-creates-in-flight`'s cost, Karpenter
placeholders' keep-off list, the churn's create tail on a model of the NVML lanes;
`.dev/bench/placement-scenarios.json`).

Prints a table, writes `.dev/bench/placement.json` and `.dev/bench/placement.png`, and
dumps every trace to `.dev/bench/traces/` so `instaslice-place` can replay it. `--quick`
runs small versions of the same (seconds; `make test` runs it via the unit tests).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import placement_scenarios, preemption
from common.catalog import GpuModel, load_catalog
from common.heap import settle_collector
from common.placement.engine import clear_caches
from common.placement.model import (
    Pending,
    PendingReason,
    PlacedSlice,
    Placement,
    PodRequest,
    Policy,
)
from common.placement.optimum import Objective, optimum
from common.placement.replay import AddEvent, Cluster, Trace, parse_trace
from common.placement.tables import add, free_starts, gpu_state, model_tables

TIMING_NODES = (1000, 5000)  # fleet sizes of the decision-speed measurement (x 8 GPUs)
POLICIES = (Policy.INSTASLICE, Policy.FIRST_FIT, Policy.SPREAD, Policy.STATIC_BALANCED)
OUT_DIR = Path(".dev/bench")

# Share of single-slice pods by size class; "1g2x" is the 1g with twice the memory (2 slots).
MIX_DEFAULT = {"1g": 0.35, "1g2x": 0.10, "2g": 0.20, "3g": 0.15, "4g": 0.10, "7g": 0.10}
MIX_BIMODAL = {"1g": 0.60, "2g": 0.05, "3g": 0.10, "4g": 0.15, "7g": 0.10}
MIX_SMALL = {"1g": 0.5, "1g2x": 0.2, "2g": 0.3}  # for the extra containers of multi-slice pods
_PLAIN = re.compile(r"^[0-9]+g\.[0-9]+gb$")


def class_profiles(model: GpuModel) -> dict[str, str]:
    """Size class -> this model's plain profile name (1g, 1g2x, 2g, 3g, 4g, 7g)."""
    out: dict[str, str] = {}
    for p in model.profiles:
        if not _PLAIN.match(p.name):
            continue
        if p.compute_slices == 1:
            out["1g" if p.memory_slots == 1 else "1g2x"] = p.name
        elif p.memory_slots == model.memory_slots:
            out["7g"] = p.name
        else:
            out[f"{p.compute_slices}g"] = p.name
    return out


@dataclass(frozen=True)
class Fleet:
    name: str
    groups: tuple[tuple[str, int, str, int], ...]  # (prefix, nodes, model, gpus per node)

    def nodes_json(self) -> list[dict[str, Any]]:
        return [
            {
                "name": f"{prefix}-{i}",
                "cpu": "128",
                "memory": "1Ti",
                "pods": 110,
                "gpus": [{"model": model}] * gpus,
            }
            for prefix, count, model, gpus in self.groups
            for i in range(count)
        ]

    @property
    def profiles(self) -> dict[str, str]:
        model = load_catalog().model(self.groups[0][2])
        assert model is not None
        return class_profiles(model)

    @property
    def slots(self) -> int:
        cat = load_catalog()
        total = 0
        for _, count, model, gpus in self.groups:
            m = cat.model(model)
            assert m is not None
            total += count * gpus * m.memory_slots
        return total


def _pick(rng: random.Random, mix: dict[str, float]) -> str:
    return rng.choices(list(mix), weights=list(mix.values()))[0]


def _pod(
    rng: random.Random, name: str, fleet: Fleet, mix: dict[str, float], multi: float
) -> dict[str, Any]:
    names = fleet.profiles
    if rng.random() < multi:
        containers = []
        for c in range(rng.randint(1, 2)):
            slices: dict[str, int] = {}
            for _ in range(rng.randint(1, 2)):
                p = names[_pick(rng, MIX_SMALL)]
                slices[p] = slices.get(p, 0) + 1
            containers.append({"name": f"c{c}", "slices": slices})
    else:
        containers = [{"name": "main", "slices": {names[_pick(rng, mix)]: 1}}]
    return {"op": "add", "pod": name, "cpu": "1", "memory": "4Gi", "containers": containers}


def _mean_slots(fleet: Fleet, mix: dict[str, float], multi: float) -> float:
    m = load_catalog().model(fleet.groups[0][2])
    assert m is not None
    size = {
        cls: p.memory_slots
        for cls, name in class_profiles(m).items()
        if (p := m.profile(name)) is not None
    }
    single = sum(w * size[c] for c, w in mix.items()) / sum(mix.values())
    small = sum(w * size[c] for c, w in MIX_SMALL.items())
    return (1 - multi) * single + multi * 1.5 * 1.5 * small


def churn_trace(
    seed: int,
    fleet: Fleet,
    arrivals: int,
    mix: dict[str, float] = MIX_DEFAULT,
    load: float = 1.2,
    lifetime: float = 10.0,
    multi: float = 0.15,
) -> dict[str, Any]:
    """Poisson arrivals at `load` x the fleet's slot capacity, exponential lifetimes."""
    rng = random.Random(seed)
    rate = load * fleet.slots / (_mean_slots(fleet, mix, multi) * lifetime)
    t = 0.0
    pending: list[tuple[float, str]] = []
    events: list[dict[str, Any]] = []
    for i in range(arrivals):
        t += rng.expovariate(rate)
        pending.sort()
        while pending and pending[0][0] <= t:
            leave, gone = pending.pop(0)
            events.append({"op": "remove", "pod": gone, "t": round(leave, 6)})
        pod = _pod(rng, f"p{i}", fleet, mix, multi)
        pod["t"] = round(t, 6)
        events.append(pod)
        pending.append((t + rng.expovariate(1 / lifetime), f"p{i}"))
    return {"nodes": fleet.nodes_json(), "events": events, "end": round(t, 6)}


def fill_trace(
    seed: int,
    fleet: Fleet,
    overfill: float = 1.25,
    mix: dict[str, float] = MIX_DEFAULT,
    multi: float = 0.15,
) -> dict[str, Any]:
    """A batch asking for `overfill` x the fleet's slots, all at t=0, never leaving."""
    rng = random.Random(seed)
    want = overfill * fleet.slots
    events: list[dict[str, Any]] = []
    asked = 0.0
    i = 0
    mean = _mean_slots(fleet, mix, multi)
    while asked < want:
        pod = _pod(rng, f"p{i}", fleet, mix, multi)
        pod["t"] = 0.0
        events.append(pod)
        asked += mean
        i += 1
    return {"nodes": fleet.nodes_json(), "events": events, "end": 1.0}


def sequence_trace(
    model: str, gpus: int, pods: Sequence[dict[str, int] | str], nodes: int = 1
) -> dict[str, Any]:
    """Pods one after another (t = 0, 1, 2, …); "-pN" removes pod N; end one step later."""
    events: list[dict[str, Any]] = []
    for i, p in enumerate(pods):
        if isinstance(p, str):
            events.append({"op": "remove", "pod": p[1:], "t": float(i)})
        else:
            events.append(
                {
                    "op": "add",
                    "pod": f"p{i}",
                    "cpu": "1",
                    "memory": "1Gi",
                    "containers": [{"name": "main", "slices": dict(p)}],
                    "t": float(i),
                }
            )
    fleet = Fleet("x", (("n", nodes, model, gpus),))
    return {"nodes": fleet.nodes_json(), "events": events, "end": float(len(pods))}


# Why a baseline beats instaslice on a trace, where the cause is known by construction.
WHY = {
    "counter-a100-1g-1g-2g-3g": (
        "the first 1g must go to slots 0-3 for the later 3g to fit, but that is where it "
        "kills the only 4g start (trap-a100-1g-4g); instaslice keeps the 4g"
    ),
    "counter-h100-1g-2g-1g-7g-3g": (
        "same conflict: only a first 1g low in a GPU lets 1g+2g+1g+3g share it; instaslice "
        "puts it high to keep the 4g start"
    ),
}


def traps() -> dict[str, dict[str, Any]]:
    """The fragmentation traps every policy is measured on (tiny; optimum computed)."""
    return {
        # NVIDIA DRA / first fit puts the 1g at slot 0, the only start of a 4g.
        "trap-a100-1g-4g": sequence_trace("A100-40GB", 1, [{"1g.5gb": 1}, {"4g.20gb": 1}]),
        # First fit: 3g@0 on both GPUs, so the 4g (start 0 only) has nowhere to go.
        "trap-h200-3g-1g-3g-4g": sequence_trace(
            "H200-141GB",
            2,
            [{"3g.71gb": 1}, {"1g.18gb": 1}, {"3g.71gb": 1}, {"4g.71gb": 1}],
        ),
        # One pod: only 3g@4 + {2g, 1g, 1g} in slots 0-3 fits.
        "trap-a100-one-pod-1g-1g-2g-3g": sequence_trace(
            "A100-40GB", 1, [{"3g.20gb": 1, "1g.5gb": 2, "2g.10gb": 1}]
        ),
        # A 3g at slot 0 (first fit) takes the 4g's only start.
        "trap-h100-3g-4g": sequence_trace("H100-80GB", 1, [{"3g.40gb": 1}, {"4g.40gb": 1}]),
        # Spreading 1g pods over both GPUs (DAS) leaves no whole GPU for the 7g.
        "trap-h100-1g-1g-7g": sequence_trace(
            "H100-80GB", 2, [{"1g.10gb": 1}, {"1g.10gb": 1}, {"7g.80gb": 1}]
        ),
        # dra-driver-nvidia-gpu#933: which pods leave decides whether islands remain (1g at
        # 0, 2, 4 under first fit). Unknowable online: no policy is safe; the optimum is.
        "removal-a100-1g-x6": sequence_trace(
            "A100-40GB",
            1,
            [{"1g.5gb": 1}] * 6 + ["-p1", "-p3", "-p5", {"3g.20gb": 1}, {"1g.5gb": 1}],
        ),
        # All five fit only if one GPU takes the 7g and the other 3g@4 + 2g + 1g + 1g in
        # slots 0-3: the first 1g must go low, which is what trap-a100-1g-4g punishes.
        "counter-h100-1g-2g-1g-7g-3g": sequence_trace(
            "H100-80GB",
            2,
            [{"1g.10gb": 1}, {"2g.20gb": 1}, {"1g.10gb": 1}, {"7g.80gb": 1}, {"3g.40gb": 1}],
        ),
        # The user guide's `-cgi 19,19,14,9` as separate pods: only a first 1g in slots 0-3
        # leaves room for the 3g — the opposite of what trap-a100-1g-4g needs. No online
        # policy wins both; first fit wins this one.
        "counter-a100-1g-1g-2g-3g": sequence_trace(
            "A100-40GB", 1, [{"1g.5gb": 1}, {"1g.5gb": 1}, {"2g.10gb": 1}, {"3g.20gb": 1}]
        ),
    }


def suite(quick: bool) -> dict[str, dict[str, Any]]:
    """Every trace of the benchmark, by name (seeded: the same on every run)."""
    if quick:
        n, per, arrivals = 4, 4, 300
    else:
        n, per, arrivals = 16, 8, 3000
    fleets = {
        "h100": Fleet("h100", (("h100", n, "H100-80GB", per),)),
        "h200": Fleet("h200", (("h200", n, "H200-141GB", per),)),
        "a100": Fleet("a100", (("a100", n, "A100-40GB", per),)),
        "mixed": Fleet(
            "mixed", (("a100", n // 2, "A100-80GB", per), ("h100", n // 2, "H100-80GB", per))
        ),
    }
    traces: dict[str, dict[str, Any]] = {}
    for seed, (name, fleet) in enumerate(fleets.items(), start=1):
        traces[f"churn-{name}"] = churn_trace(seed, fleet, arrivals)
    traces["churn-bimodal-h100"] = churn_trace(11, fleets["h100"], arrivals, MIX_BIMODAL)
    traces["churn-light-h200"] = churn_trace(12, fleets["h200"], arrivals, load=0.8)
    for seed, (name, fleet) in enumerate(fleets.items(), start=21):
        traces[f"fill-{name}"] = fill_trace(seed, fleet)
    traces.update(traps())
    # Small enough for the exact optimum (optimum.py).
    a100x2 = Fleet("a100x2", (("a100", 1, "A100-40GB", 2),))
    h200x1 = Fleet("h200x1", (("h200", 1, "H200-141GB", 1),))
    traces["opt-fill-a100x2"] = fill_trace(33, a100x2, overfill=1.4)
    traces["opt-churn-h200x1"] = churn_trace(31, h200x1, 14, load=1.3)
    if not quick:
        h100x4 = Fleet("h100x4", (("h100", 1, "H100-80GB", 4),))
        h200x2 = Fleet("h200x2", (("h200", 1, "H200-141GB", 2),))
        traces["opt-fill-h100x4"] = fill_trace(34, h100x4, overfill=1.4)
        traces["opt-churn-h200x2"] = churn_trace(35, h200x2, 18, load=1.3)
        traces["opt-churn-a100x2"] = churn_trace(36, a100x2, 18, load=1.3)
    return traces


# --- measuring ------------------------------------------------------------------------
@dataclass
class Run:
    accepted_pods: int = 0
    slot_time: float = 0.0
    slot_utilization: float = 0.0
    pending: Counter[str] = field(default_factory=Counter)

    def as_json(self) -> dict[str, Any]:
        return {
            "accepted_pods": self.accepted_pods,
            "slot_utilization": round(self.slot_utilization, 4),
            "pending_fragmented": self.pending.get(str(PendingReason.FRAGMENTED), 0),
            "slot_time": round(self.slot_time, 3),
            "dropped": sum(self.pending.values()),
            "pending": dict(self.pending),
        }


def _span(trace: Trace) -> float:
    end = trace.end if trace.end is not None else max((e.t for e in trace.events), default=0)
    return max(end, 1e-9)


def run_policy(trace: Trace, policy: Policy) -> Run:
    cluster = Cluster(trace.nodes, policy)
    run = Run()
    last = 0.0
    for ev in trace.events:
        run.slot_time += cluster.used_slots * (ev.t - last)
        last = ev.t
        if isinstance(ev, AddEvent):
            result = cluster.add(ev.request)
            if isinstance(result, Placement):
                run.accepted_pods += 1
            else:
                run.pending[str(result.reason)] += 1
        else:
            cluster.remove(ev.pod)
    span = _span(trace)
    run.slot_time += cluster.used_slots * (span - last)
    run.slot_utilization = run.slot_time / (cluster.total_slots * span)
    return run


def run_optimum(trace: Trace, budget: int) -> Run | None:
    by_slots = optimum(trace, Objective.SLOT_TIME, budget=budget)
    by_pods = optimum(trace, Objective.PODS, budget=budget)
    if by_slots is None or by_pods is None:
        return None
    total = Cluster(trace.nodes).total_slots
    run = Run(by_pods.accepted_pods, by_slots.slot_time)
    run.slot_utilization = by_slots.slot_time / (total * _span(trace))
    run.pending.update(str(reason) for _, reason in by_pods.dropped)
    return run


def timing_cluster(
    rng: random.Random, nodes: int = 1000, gpus: int = 8
) -> tuple[Cluster, list[str]]:
    """A nodes x gpus H100/H200 cluster with random legal occupancy (about 60 % of slots)."""
    cat = load_catalog()
    half = nodes // 2
    fleet = Fleet(
        "timing", (("h100", half, "H100-80GB", gpus), ("h200", nodes - half, "H200-141GB", gpus))
    )
    trace = parse_trace({"nodes": fleet.nodes_json(), "events": []})
    cluster = Cluster(trace.nodes, Policy.INSTASLICE)
    # Random legal occupancy, about 60 % of the slots, without calling the engine.
    held: list[str] = []
    for ni, node in enumerate(trace.nodes):
        for g in node.gpus:
            model = cat.model(g.model)
            assert model is not None
            t = model_tables(model)
            names = class_profiles(model)
            st = gpu_state(t, ())
            target = rng.choice([3, 6, 7, 8, 8, 8, 8, 8])
            occupied: list[tuple[str, int]] = []
            for _ in range(12):
                if bin(st.mask).count("1") >= target:
                    break
                pt = t.profiles[names[_pick(rng, MIX_DEFAULT)]]
                options = free_starts(t, st, pt)
                if options:
                    i = rng.choice(options)
                    st = add(st, pt, i)
                    occupied.append((pt.name, pt.starts[i]))
            for k, (profile, start) in enumerate(occupied):
                name = f"pre-{ni}-{g.index}-{k}"
                req = PodRequest(name, 1000, 4 << 30)
                size = t.profiles[profile].size
                slices = (PlacedSlice("main", profile, g.index, start, size),)
                cluster.assume(req, Placement(node.name, slices))
                held.append(name)
    return cluster, held


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _stats(cpu: list[float], wall: list[float]) -> dict[str, float]:
    return {
        "p50": round(_percentile(cpu, 0.5), 3),
        "p99": round(_percentile(cpu, 0.99), 3),
        "max": round(max(cpu), 3),
        "wall_p50": round(_percentile(wall, 0.5), 3),
        "wall_p99": round(_percentile(wall, 0.99), 3),
    }


@dataclass
class _Timed:
    results: list[Placement | Pending] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)
    kinds: dict[str, list[float]] = field(
        default_factory=lambda: {"single slice": [], "several slices": [], "pending": []}
    )
    gc: list[float] = field(default_factory=list)  # CPU ms the collector took, per decision
    cold: float = 0.0
    occupancy: float = 0.0


def _timed_decisions(
    samples: int, warmup: int, nodes: int, gpus: int, seed: int, *, indexed: bool
) -> _Timed:
    """One pass of `decision_timing`: the same pods on the same cluster for a given seed,
    decided through the index or by the scan, from cold caches (a fresh process)."""
    rng = random.Random(seed)
    clear_caches()
    cluster, held = timing_cluster(rng, nodes, gpus)
    cluster.indexed = indexed
    thresholds = gc.get_threshold()
    settle_collector()  # as the allocator does once it has listed the cluster
    pod_fleets = [Fleet("t", ((m, 1, m, 8),)) for m in ("H100-80GB", "H200-141GB")]
    out = _Timed()
    collector = [0.0, 0.0]  # CPU seconds the collector took; when the running one started

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collector[1] = time.process_time()
        else:
            collector[0] += time.process_time() - collector[1]

    gc.callbacks.append(on_gc)
    try:
        _decide_all(cluster, held, rng, pod_fleets, samples, warmup, indexed, out, collector)
    finally:
        gc.callbacks.remove(on_gc)
        gc.unfreeze()  # the next pass starts from cold caches
        gc.set_threshold(*thresholds)
    out.occupancy = round(cluster.used_slots / cluster.total_slots, 3)
    return out


def _decide_all(
    cluster: Cluster,
    held: list[str],
    rng: random.Random,
    pod_fleets: list[Fleet],
    samples: int,
    warmup: int,
    indexed: bool,
    out: _Timed,
    collector: list[float],
) -> None:
    for i in range(warmup + samples):
        raw = _pod(rng, f"t{i}", rng.choice(pod_fleets), MIX_DEFAULT, 0.15)
        ev = parse_trace({"nodes": [], "events": [raw]}).events[0]
        assert isinstance(ev, AddEvent)
        if not indexed:
            cluster.snapshot  # noqa: B018 - built outside the clock, as the allocator's is
        g0 = collector[0]
        c0, w0 = time.process_time(), time.perf_counter()
        result = cluster.decide(ev.request)
        c1, w1 = time.process_time(), time.perf_counter()
        if i == 0:
            out.cold = (w1 - w0) * 1000
        if i >= warmup:
            out.results.append(result)
            out.cpu.append((c1 - c0) * 1000)
            out.wall.append((w1 - w0) * 1000)
            out.gc.append((collector[0] - g0) * 1000)
            if isinstance(result, Placement):
                several = sum(x.count for x in ev.request.slices) > 1
                out.kinds["several slices" if several else "single slice"].append(out.cpu[-1])
            else:
                out.kinds["pending"].append(out.cpu[-1])
        if isinstance(result, Placement):
            cluster.assume(ev.request, result)
            held.append(ev.request.name)
        # Keep the load steady: one random departure per decision.
        cluster.remove(held.pop(rng.randrange(len(held))))


def decision_timing(
    samples: int, warmup: int, nodes: int = 1000, gpus: int = 8, seed: int = 7
) -> dict[str, Any]:
    """Time a decision as the allocator makes it: one pod at a time on a nodes x gpus
    cluster, the cluster updated between calls (one placement, one departure). The same
    seeded sequence runs twice from cold caches — through the fleet index (what the
    allocator calls; the top-level numbers) and by the engine's scan of the snapshot
    (`scan`: the code before the index) — and every answer must be equal. The first
    `warmup` decisions fill the engine's caches as a running allocator's are and are not
    counted (the very first one is reported as `cold_ms`). Times are process CPU time
    (what the decision costs, whatever else the machine runs) and wall time."""
    index = _timed_decisions(samples, warmup, nodes, gpus, seed, indexed=True)
    scan = _timed_decisions(samples, warmup, nodes, gpus, seed, indexed=False)
    if index.results != scan.results:
        first = next(
            i for i, (a, b) in enumerate(zip(index.results, scan.results, strict=True)) if a != b
        )
        raise AssertionError(
            f"index and scan differ at decision {first}: "
            f"{index.results[first]} != {scan.results[first]}"
        )
    cpu, wall, kinds = index.cpu, index.wall, index.kinds
    without = [c - g for c, g in zip(cpu, index.gc, strict=True)]
    return {
        "nodes": nodes,
        "gpus_per_node": gpus,
        **_stats(cpu, wall),
        "cold_ms": round(index.cold, 1),
        "clock": "process CPU time (wall_* : wall clock on a shared machine)",
        "by_kind": {
            kind: {
                "count": len(ts),
                "p50": round(_percentile(ts, 0.5), 3),
                "p99": round(_percentile(ts, 0.99), 3),
            }
            for kind, ts in kinds.items()
            if ts
        },
        "collector": {  # decisions during which Python's collector ran, and without it
            "decisions": sum(1 for g in index.gc if g > 0),
            "p50_without": round(_percentile(without, 0.5), 3),
            "p99_without": round(_percentile(without, 0.99), 3),
        },
        "scan": {**_stats(scan.cpu, scan.wall), "cold_ms": round(scan.cold, 1)},
        "identical_to_scan": True,
        "samples": samples,
        "warmup": warmup,
        "placed": len(kinds["single slice"]) + len(kinds["several slices"]),
        "pending": len(kinds["pending"]),
        "occupancy": index.occupancy,
    }


# --- reporting ------------------------------------------------------------------------
def _cell(r: dict[str, Any] | None) -> str:
    if r is None:
        return "-"
    return (
        f"{r['accepted_pods']:>5} {100 * r['slot_utilization']:5.1f}% f{r['pending_fragmented']:<3}"
    )


def table(results: dict[str, Any]) -> str:
    names = [str(p) for p in POLICIES] + ["optimum"]
    head = f"{'trace':<31}{'pods':>5}  " + "".join(f"{n:<21}" for n in names)
    lines = [
        "accepted pods, slot utilisation (time-averaged), f = pods dropped as fragmented",
        head,
        "-" * len(head),
    ]
    for name, tr in results["traces"].items():
        cells = "".join(f"{_cell(tr['policies'].get(n)):<21}" for n in names)
        lines.append(f"{name:<31}{tr['pods']:>5}  {cells}")
    tot = results["totals"]
    lines.append("-" * len(head))
    lines.append(
        f"{'total accepted pods':<38}"
        + "".join(f"{tot[str(p)]['accepted_pods']:<21}" for p in POLICIES)
    )
    lines.append(
        f"{'total slot-time vs instaslice':<38}"
        + "".join(f"{100 * tot[str(p)]['slot_time_vs_instaslice']:<20.1f}%" for p in POLICIES)
    )
    for d in results.get("decision_ms_by_nodes", {}).values() or [results["decision_ms"]]:
        lines.extend(timing_lines(d))
    for w in results["baseline_wins"]:
        lines.append(
            f"baseline win: {w['trace']}: {w['policy']} {w['metric']} "
            f"{w['baseline']} > instaslice {w['instaslice']} — {w['why']}"
        )
    return "\n".join(lines)


def timing_lines(d: dict[str, Any]) -> list[str]:
    scan = d["scan"]
    return [
        f"decision at {d['nodes']} nodes x {d['gpus_per_node']} GPUs ({d['samples']} decisions "
        f"after {d['warmup']} warm-up, {d['pending']} pending, occupancy "
        f"{100 * d['occupancy']:.0f} %): CPU p50 {d['p50']} ms, p99 {d['p99']} ms, "
        f"max {d['max']} ms; wall p50 {d['wall_p50']} ms, p99 {d['wall_p99']} ms; "
        f"first (cold) decision {d['cold_ms']} ms",
        "  CPU by kind: "
        + "; ".join(
            f"{kind} ({k['count']}): p50 {k['p50']} ms, p99 {k['p99']} ms"
            for kind, k in d["by_kind"].items()
        ),
        f"  Python's garbage collector ran during {d['collector']['decisions']} of them; "
        f"without its time: CPU p50 {d['collector']['p50_without']} ms, "
        f"p99 {d['collector']['p99_without']} ms",
        f"  the same decisions by the scan (no index): CPU p50 {scan['p50']} ms, "
        f"p99 {scan['p99']} ms, max {scan['max']} ms; identical answers",
    ]


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["traces"])
    policies = [str(p) for p in POLICIES] + ["optimum"]
    fig, axes = plt.subplots(2, 1, figsize=(max(10, len(names) * 0.9), 9), sharex=True)
    width = 0.8 / len(policies)
    for k, pol in enumerate(policies):
        xs, util, rel = [], [], []
        for i, n in enumerate(names):
            r = results["traces"][n]["policies"].get(pol)
            if r is None:
                continue
            base = results["traces"][n]["policies"]["instaslice"]["accepted_pods"] or 1
            xs.append(i + (k - len(policies) / 2) * width + width / 2)
            util.append(100 * r["slot_utilization"])
            rel.append(100 * r["accepted_pods"] / base)
        axes[0].bar(xs, util, width, label=pol)
        axes[1].bar(xs, rel, width, label=pol)
    axes[0].set_ylabel("slot utilisation (%)")
    axes[1].set_ylabel("accepted pods (% of instaslice)")
    top = max(
        100 * r["accepted_pods"] / max(1, t["policies"]["instaslice"]["accepted_pods"])
        for t in results["traces"].values()
        for r in t["policies"].values()
    )
    axes[1].set_ylim(0, max(110, top + 10))
    axes[1].set_xticks(range(len(names)))
    axes[1].set_xticklabels(names, rotation=45, ha="right", fontsize=8)
    axes[0].legend(ncol=len(policies), fontsize=8)
    d = results["decision_ms"]
    axes[0].set_title(
        f"InstaSlice placement benchmark — decision CPU p50 {d['p50']} ms / p99 {d['p99']} ms "
        f"at {d['nodes']} nodes x {d['gpus_per_node']} GPUs"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(
    quick: bool,
    out_dir: Path | None = OUT_DIR,
    timing_samples: int | None = None,
    timing_nodes: Sequence[int] = TIMING_NODES,
) -> dict[str, Any]:
    """Run the whole benchmark; write JSON/PNG/traces under `out_dir` (None: write nothing)."""
    traces = suite(quick)
    budget = 50_000 if quick else 400_000
    results: dict[str, Any] = {"traces": {}, "quick": quick}
    for name, doc in traces.items():
        trace = parse_trace(doc)
        entry: dict[str, Any] = {
            "pods": sum(isinstance(e, AddEvent) for e in trace.events),
            "gpus": sum(len(n.gpus) for n in trace.nodes),
            "policies": {},
        }
        for policy in POLICIES:
            entry["policies"][str(policy)] = run_policy(trace, policy).as_json()
        if name.startswith(("trap-", "counter-", "removal-", "opt-")):
            best = run_optimum(trace, budget)
            if best is not None:
                entry["policies"]["optimum"] = best.as_json()
        results["traces"][name] = entry
    results["totals"] = _totals(results["traces"])
    results["baseline_wins"] = _wins(results["traces"])
    samples = timing_samples if timing_samples is not None else (200 if quick else 2000)
    warmup = 100 if quick else 500
    by_nodes = {n: decision_timing(samples, warmup, nodes=n) for n in timing_nodes}
    results["decision_ms"] = by_nodes.get(1000) or next(iter(by_nodes.values()))
    results["decision_ms_by_nodes"] = {str(n): d for n, d in by_nodes.items()}
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "placement.json").write_text(json.dumps(results, indent=1) + "\n")
        plot(results, out_dir / "placement.png")
        tdir = out_dir / "traces"
        tdir.mkdir(exist_ok=True)
        for name, doc in traces.items():
            (tdir / f"{name}.json").write_text(json.dumps(doc) + "\n")
    return results


def _totals(traces: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in POLICIES:
        pods = sum(t["policies"][str(p)]["accepted_pods"] for t in traces.values())
        st = sum(t["policies"][str(p)]["slot_time"] for t in traces.values())
        out[str(p)] = {"accepted_pods": pods, "slot_time": round(st, 3)}
    base = out[str(Policy.INSTASLICE)]["slot_time"] or 1.0
    for p in POLICIES:
        out[str(p)]["slot_time_vs_instaslice"] = round(out[str(p)]["slot_time"] / base, 4)
    return out


def _reasons(run: dict[str, Any]) -> str:
    return ", ".join(f"{n} {r}" for r, n in sorted(run["pending"].items())) or "none"


def _wins(traces: dict[str, Any]) -> list[dict[str, Any]]:
    wins = []
    for name, t in traces.items():
        ours = t["policies"][str(Policy.INSTASLICE)]
        for p in POLICIES[1:]:
            other = t["policies"][str(p)]
            for metric in ("accepted_pods", "slot_time"):
                if other[metric] > ours[metric] + 1e-9:
                    why = WHY.get(name) or (
                        f"online trade-off: instaslice dropped {ours['dropped']} pods "
                        f"({_reasons(ours)}), {p} {other['dropped']} ({_reasons(other)})"
                    )
                    wins.append(
                        {
                            "trace": name,
                            "policy": str(p),
                            "metric": metric,
                            "baseline": other[metric],
                            "instaslice": ours[metric],
                            "why": why,
                        }
                    )
    return wins


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.placement", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small traces (seconds)")
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="output directory")
    parser.add_argument(
        "--timing-only", action="store_true", help="only the decision-speed measurement"
    )
    parser.add_argument(
        "--timing-nodes",
        default=",".join(str(n) for n in TIMING_NODES),
        help="fleet sizes (x 8 GPUs) of the decision-speed measurement, comma-separated "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--scenarios",
        default=",".join(placement_scenarios.SCENARIOS),
        help="allocator-model scenarios after the traces, comma-separated, '' for none "
        "(default %(default)s; bench/placement_scenarios.py)",
    )
    args = parser.parse_args(argv)
    scenarios = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    if unknown := [n for n in scenarios if n not in placement_scenarios.SCENARIOS]:
        parser.error(
            f"--scenarios: unknown {unknown}; known: {', '.join(placement_scenarios.SCENARIOS)}"
        )
    try:
        timing_nodes = [int(n) for n in args.timing_nodes.split(",") if n.strip()]
    except ValueError:
        parser.error(
            f"--timing-nodes: expected comma-separated integers, got {args.timing_nodes!r}"
        )
    if not timing_nodes or min(timing_nodes) < 2:
        parser.error("--timing-nodes: expected fleet sizes of at least 2 nodes")
    started = time.perf_counter()
    if args.timing_only:
        for n in timing_nodes:
            d = decision_timing(200 if args.quick else 2000, 100 if args.quick else 500, nodes=n)
            print("\n".join(timing_lines(d)))
            print(json.dumps(d, indent=1))
        return 0
    results = run(args.quick, args.out, timing_nodes=timing_nodes)
    print(table(results))
    preempt = preemption.run(args.quick)  # priority traces (bench/preemption.py)
    (args.out / "preemption.json").write_text(json.dumps(preempt, indent=1) + "\n")
    print(preemption.table(preempt))
    if scenarios:
        extra = placement_scenarios.run(scenarios, args.quick)
        (args.out / "placement-scenarios.json").write_text(json.dumps(extra, indent=1) + "\n")
        print(placement_scenarios.table(extra))
    print(
        f"wrote {args.out / 'placement.json'}, {args.out / 'placement.png'} and "
        f"{args.out / 'traces'}/ in {time.perf_counter() - started:.0f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
