"""Preemption benchmark: what a high-priority 4g/7g waits on a full cluster, and how many
victims the planner evicts against the brute-force minimum.

Part of `make bench-placement` (bench/placement.py calls `run`); `python -m bench.preemption`
runs it alone. Pure simulation of the allocator's decisions (the engine and
`plan_preemption`, no API server):

- **wait**: a fleet of H100 nodes kept full by low-priority pods (Poisson arrivals above
  capacity, exponential lifetimes, the placement benchmark's size mix; a low pod that does not
  fit on arrival is dropped); high-priority 4g and 7g pods arrive among them and, when
  pending, are retried in priority order whenever something leaves. With preemption `off` a
  high pod waits for departures; with `gpu` it reserves its planned slots at once and starts
  once its victims are gone (`GRACE_S`: the default 30 s termination grace plus a few seconds
  of slice release). Reported per profile: wait p50 / p95 / max / mean and the victims per
  preemption. Simplification: the victims' slots outside the reserved window are freed at the
  decision, `GRACE_S` early.
- **minimal**: seeded small clusters (≤ 2 nodes x 2 H100, random fills and priorities) where
  every subset of possible victims is tried: the planner's victim count against the
  brute-force minimum cost set's, and against the fewest victims that free any placement
  (ignoring priorities).
- **speed**: one plan on a full 100-node x 8-GPU fleet of 1g pods (ms; the allocator runs it
  only for a pod that does not fit), for MIG profiles and for 1 and 4 whole GPUs
  (`plan_whole_preemption`).
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Any

from common.catalog import load_catalog
from common.constants import WHOLE_GPU_PROFILE
from common.placement.engine import place
from common.placement.model import (
    Gpu,
    NodeState,
    Occupied,
    Placement,
    PodRequest,
    SliceRequest,
    Snapshot,
)
from common.placement.preempt import Holder, plan_preemption, victim_cost
from common.placement.preempt_whole import plan_whole_preemption

MODEL = "H100-80GB"
GRACE_S = 35.0
LOW_MIX = {"1g.10gb": 0.35, "1g.20gb": 0.10, "2g.20gb": 0.20, "3g.40gb": 0.15, "4g.40gb": 0.10}
HIGH_PROFILES = ("4g.40gb", "7g.80gb")
OUT_DIR = Path(".dev/bench")
_SIZE = {p.name: p.memory_slots for p in load_catalog().model(MODEL).profiles}  # type: ignore[union-attr]
_STARTS = {p.name: p.starts for p in load_catalog().model(MODEL).profiles}  # type: ignore[union-attr]


@dataclass
class _Pod:
    name: str
    profile: str
    priority: int
    arrival: float
    lifetime: float
    node: str = ""
    slices: tuple[tuple[int, int, int, str], ...] = ()  # (gpu, start, size, profile)
    started: float = -1.0


@dataclass
class _Sim:
    nodes: int
    gpus: int
    preemption: bool
    running: dict[str, _Pod] = field(default_factory=dict)
    queue: list[_Pod] = field(default_factory=list)
    waits: dict[str, list[float]] = field(default_factory=dict)
    victims: list[int] = field(default_factory=list)

    def snapshot(self) -> Snapshot:
        occ: dict[tuple[str, int], list[Occupied]] = {}
        for p in self.running.values():
            for g, start, size, profile in p.slices:
                occ.setdefault((p.node, g), []).append(Occupied(start, size, profile))
        return Snapshot(
            tuple(
                NodeState(
                    f"n{i}",
                    cpu_millis_free=1 << 30,
                    memory_bytes_free=1 << 50,
                    pods_free=1000,
                    gpus=tuple(
                        Gpu(g, MODEL, occupied=tuple(occ.get((f"n{i}", g), ())))
                        for g in range(self.gpus)
                    ),
                )
                for i in range(self.nodes)
            )
        )

    def holders(self, priority: int) -> list[Holder]:
        return [
            Holder(
                p.name,
                p.node,
                tuple((g, s, z) for g, s, z, _ in p.slices),
                p.priority,
                start_time=p.started,
                preemptible=p.priority < priority,
            )
            for p in self.running.values()
        ]

    def start(self, pod: _Pod, placement: Placement, at: float, events: list[Any]) -> None:
        pod.node = placement.node
        pod.slices = tuple((s.gpu_index, s.start, s.size, s.profile) for s in placement.slices)
        pod.started = at
        self.running[pod.name] = pod
        heapq.heappush(events, (at + pod.lifetime, 1, pod.name, "leave"))
        if pod.priority > 0:
            self.waits.setdefault(pod.profile, []).append(at - pod.arrival)

    def schedule(self, now: float, events: list[Any]) -> None:
        self.queue.sort(key=lambda p: (-p.priority, p.arrival))
        left = []
        for pod in self.queue:
            request = PodRequest(pod.name, 0, 0, (SliceRequest("main", pod.profile),))
            snapshot = self.snapshot()
            result = place(snapshot, request)
            if isinstance(result, Placement):
                self.start(pod, result, now, events)
                continue
            if self.preemption and pod.priority > 0:
                plan = plan_preemption(snapshot, request, self.holders(pod.priority))
                if plan is not None:
                    for uid in plan.victims:  # evicted; the reservation holds their window
                        del self.running[uid]
                    self.victims.append(len(plan.victims))
                    self.start(pod, plan.placement, now + GRACE_S, events)
                    continue
            if pod.priority > 0:  # low pods that do not fit are dropped (the load stays high)
                left.append(pod)
        self.queue = left


def wait_experiment(
    seed: int, *, nodes: int, gpus: int, horizon: float, preemption: bool
) -> dict[str, Any]:
    rng = random.Random(seed)
    sim = _Sim(nodes, gpus, preemption)
    slots = nodes * gpus * 8
    mean_slots = sum(w * _SIZE[p] for p, w in LOW_MIX.items()) / sum(LOW_MIX.values())
    life = 600.0
    rate = 1.3 * slots / mean_slots / life  # offered load 130 % of the fleet
    events: list[Any] = []
    t, n = 0.0, 0
    while t < horizon:
        t += rng.expovariate(rate)
        profile = rng.choices(list(LOW_MIX), weights=list(LOW_MIX.values()))[0]
        pod = _Pod(f"low{n}", profile, 0, t, rng.expovariate(1 / life))
        heapq.heappush(events, (t, 0, pod, "arrive"))
        n += 1
    t, k = horizon * 0.2, 0  # after the fleet filled up
    while t < horizon:
        t += rng.expovariate(1 / 120.0)
        pod = _Pod(f"high{k}", HIGH_PROFILES[k % 2], 1000, t, rng.expovariate(1 / life))
        heapq.heappush(events, (t, 0, pod, "arrive"))
        k += 1
    while events:
        now, _, what, kind = heapq.heappop(events)
        if kind == "arrive":
            sim.queue.append(what)
        else:
            sim.running.pop(what, None)
        sim.schedule(now, events)
    out: dict[str, Any] = {}
    for profile in HIGH_PROFILES:
        w = sorted(sim.waits.get(profile, []))
        never = sum(1 for p in sim.queue if p.profile == profile and p.priority > 0)
        out[profile] = {
            "placed": len(w),
            "never_placed": never,
            "wait_p50_s": round(_pct(w, 0.5), 1),
            "wait_p95_s": round(_pct(w, 0.95), 1),
            "wait_max_s": round(w[-1], 1) if w else None,
            "wait_mean_s": round(statistics.fmean(w), 1) if w else None,
        }
    if preemption:
        out["victims_per_preemption"] = (
            round(statistics.fmean(sim.victims), 2) if sim.victims else 0
        )
        out["preemptions"] = len(sim.victims)
    return out


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(q * len(values)))]


# --- victims against the brute force -------------------------------------------------------


def small_case(rng: random.Random) -> tuple[Snapshot, list[Holder], PodRequest]:
    profiles = [p for p in _SIZE if "+me" not in p]
    holders: list[Holder] = []
    nodes = []
    for i in range(rng.randint(1, 2)):
        gpus = []
        for g in range(rng.randint(1, 2)):
            used, occ = 0, []
            for k in range(rng.randint(3, 7)):
                profile = rng.choice(profiles)
                size = _SIZE[profile]
                start = next(
                    (s for s in _STARTS[profile] if not used >> s & ((1 << size) - 1)), None
                )
                if start is None:
                    continue
                used |= ((1 << size) - 1) << start
                occ.append(Occupied(start, size, profile))
                prio = rng.randint(0, 3)
                holders.append(
                    Holder(
                        f"n{i}-{g}-{k}",
                        f"n{i}",
                        ((g, start, size),),
                        prio,
                        start_time=float(rng.randint(0, 3)),
                        preemptible=prio < 2,
                    )
                )
            gpus.append(Gpu(g, MODEL, occupied=tuple(occ)))
        nodes.append(NodeState(f"n{i}", pods_free=10, gpus=tuple(gpus)))
    request = PodRequest(
        "hi",
        0,
        0,
        (SliceRequest("main", rng.choice(["3g.40gb", "4g.40gb", "7g.80gb", "2g.20gb"])),),
    )
    return Snapshot(tuple(nodes)), holders, request


def brute(snapshot: Snapshot, holders: list[Holder], request: PodRequest) -> tuple[Any, int] | None:
    """(least cost terms 1-5, fewest victims of any freeing subset) over every subset."""
    slots = sum(_SIZE[s.profile] for s in request.slices)
    best, fewest = None, None
    for node in snapshot.nodes:
        cands = [h for h in holders if h.node == node.name and h.preemptible]
        allh = [h for h in holders if h.node == node.name]
        for k in range(len(allh) + 1):
            for subset in combinations(allh, k):
                drop = {(g, s) for h in subset for g, s, _ in h.slices}
                gpus = tuple(
                    Gpu(
                        g.index,
                        g.model,
                        occupied=tuple(o for o in g.occupied if (g.index, o.start) not in drop),
                    )
                    for g in node.gpus
                )
                if not isinstance(
                    place(Snapshot((NodeState(node.name, pods_free=1, gpus=gpus),)), request),
                    Placement,
                ):
                    continue
                fewest = k if fewest is None else min(fewest, k)
                if all(h in cands for h in subset):
                    cost = victim_cost(subset, slots, {})
                    best = cost if best is None or cost < best else best
    return (best, fewest) if best is not None and fewest is not None else None


def minimal_experiment(seed: int, cases: int) -> dict[str, Any]:
    rng = random.Random(seed)
    tried = same = 0
    ours, minimum, fewest_any = [], [], []
    for _ in range(cases):
        snapshot, holders, request = small_case(rng)
        if isinstance(place(snapshot, request), Placement):
            continue
        expected = brute(snapshot, holders, request)
        got = plan_preemption(snapshot, request, holders)
        if expected is None:
            assert got is None, "the planner found a plan the brute force did not"
            continue
        assert got is not None, "the brute force found a plan the planner did not"
        tried += 1
        same += got.cost[:5] == expected[0]
        ours.append(len(got.victims))
        minimum.append(expected[0][2])
        fewest_any.append(expected[1])
    return {
        "cases_needing_preemption": tried,
        "planner_cost_equals_brute_force": same,
        "victims_planner_mean": round(statistics.fmean(ours), 3) if ours else None,
        "victims_brute_force_min_cost_mean": round(statistics.fmean(minimum), 3)
        if minimum
        else None,
        "victims_fewest_any_priority_mean": round(statistics.fmean(fewest_any), 3)
        if fewest_any
        else None,
    }


def speed(nodes: int = 100, repeats: int = 5) -> dict[str, Any]:
    gpus = tuple(
        Gpu(g, MODEL, occupied=tuple(Occupied(s, 1, "1g.10gb") for s in range(7))) for g in range(8)
    )
    snapshot = Snapshot(tuple(NodeState(f"n{i}", pods_free=10, gpus=gpus) for i in range(nodes)))
    holders = [
        Holder(f"n{i}-{g}-{s}", f"n{i}", ((g, s, 1),), 0, start_time=float(s))
        for i in range(nodes)
        for g in range(8)
        for s in range(7)
    ]
    out = {}
    for profile in ("1g.10gb", "3g.40gb", "7g.80gb"):
        request = PodRequest("hi", 0, 0, (SliceRequest("main", profile),))
        times = []
        for _ in range(repeats):
            t0 = time.process_time()
            plan = plan_preemption(snapshot, request, holders)
            times.append(time.process_time() - t0)
        assert plan is not None
        out[profile] = {
            "cpu_ms_median": round(statistics.median(times) * 1000, 1),
            "victims": len(plan.victims),
        }
    every = frozenset((n.name, g.index) for n in snapshot.nodes for g in n.gpus)
    for count in (1, 4):  # whole GPUs: every holder of `count` GPUs of one node
        request = PodRequest("hi", 0, 0, (SliceRequest("main", WHOLE_GPU_PROFILE, count),))
        times = []
        for _ in range(repeats):
            t0 = time.process_time()
            whole = plan_whole_preemption(snapshot, request, holders, every)
            times.append(time.process_time() - t0)
        assert whole is not None
        out[f"whole x{count}"] = {
            "cpu_ms_median": round(statistics.median(times) * 1000, 1),
            "victims": len(whole.victims),
        }
    return {"fleet": f"{nodes} nodes x 8 {MODEL}, every GPU 7 x 1g", **out}


def run(quick: bool) -> dict[str, Any]:
    nodes, horizon = (4, 6000.0) if quick else (8, 10000.0)
    wait = {
        mode: wait_experiment(1, nodes=nodes, gpus=8, horizon=horizon, preemption=mode == "gpu")
        for mode in ("off", "gpu")
    }
    return {
        "wait": {"fleet": f"{nodes} nodes x 8 {MODEL}", "horizon_s": horizon, **wait},
        "minimal": minimal_experiment(2, 60 if quick else 400),
        "speed": speed(20 if quick else 100, 2 if quick else 5),
    }


def table(results: dict[str, Any]) -> str:
    lines = [f"preemption: high-priority wait on a full fleet ({results['wait']['fleet']})"]
    lines.append(
        f"{'profile':<10}{'mode':<6}{'placed':>7}{'never':>7}{'p50 s':>9}{'p95 s':>9}{'max s':>9}"
    )
    for profile in HIGH_PROFILES:
        for mode in ("off", "gpu"):
            r = results["wait"][mode][profile]
            lines.append(
                f"{profile:<10}{mode:<6}{r['placed']:>7}{r['never_placed']:>7}"
                f"{r['wait_p50_s']:>9}{r['wait_p95_s']:>9}{r['wait_max_s']!s:>9}"
            )
    gpu = results["wait"]["gpu"]
    lines.append(
        f"preemptions {gpu['preemptions']}, victims per preemption {gpu['victims_per_preemption']}"
    )
    m = results["minimal"]
    lines.append(
        f"victims vs brute force ({m['cases_needing_preemption']} small cases): cost equal in "
        f"{m['planner_cost_equals_brute_force']}; "
        f"mean victims planner {m['victims_planner_mean']}, "
        f"brute-force min-cost {m['victims_brute_force_min_cost_mean']}, fewest ignoring priority "
        f"{m['victims_fewest_any_priority_mean']}"
    )
    s = results["speed"]
    lines.append(
        f"plan speed ({s['fleet']}): "
        + ", ".join(f"{p} {s[p]['cpu_ms_median']} ms" for p in ("1g.10gb", "3g.40gb", "7g.80gb"))
        + "; whole GPUs: "
        + ", ".join(f"{n} {s[f'whole x{n}']['cpu_ms_median']} ms" for n in (1, 4))
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.preemption", description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    results = run(args.quick)
    print(table(results))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "preemption.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
