"""The no-cluster scenarios of `make bench-placement` around the placer: what the allocator's
own model pays and decides, beyond the engine's quality and speed (bench/placement.py).

Each scenario is a function of `quick` returning JSON; `SCENARIOS` registers them by name
(`python -m bench.placement --scenarios inflight,keepoff`), and `bench.placement` writes
their results to `.dev/bench/placement-scenarios.json`. CPU times are `process_time`, so
another process on the machine slows the wall clock, not them (much).

- `inflight`: what `--avoid-creates-in-flight` costs per decision, on the allocator's own
  placer and cluster model (`webhook.allocator.placer.Placer`, `ClusterState`): N nodes x 8
  H100-80GB, pods of one `1g.10gb` decided one after another; a placed allocation is `Ready`
  `ready_after` decisions later and its pod leaves `life` decisions after it was placed, so
  the fleet stays partly full as under churn. Per setting: decision CPU p50/p99/mean and the
  GPUs broken open (the same pods and event order for every setting).
- `keepoff`: the cost of keeping Karpenter placeholders off nodes that cannot serve their
  pod (docs/autoscaling.md). The full fleet (the worst case: every 8-GPU H100-80GB node full
  of 7g.80gb with cpu to spare, so every one is listed): `kept_off` over the fleet, the
  placeholder's JSON size, `misplaced` per node. The mixed fleet (`ClusterState` fed Nodes,
  MigNodes and bound pods: 30 % H200-141GB, 20 % A100-40GB full of 7g.40gb, half with their
  cpu taken, 50 % H100-80GB: half full of 1g.10gb, a quarter full of 7g.80gb with cpu to
  spare, a quarter full of 3g.40gb that took the cpu): the list without the advertised room
  (`all`) and with it (`room`; `room_again` with every node's room kept).
- `kinds`: one decision of every pod kind (one slice of each size, `+me`, several slices,
  a model by node selector, whole GPUs, size asks, one that fits nowhere) through the
  allocator's placer at 5000 nodes x 8 GPUs, per kind (bench/decision_kinds.py).
- `lanes`: why a churn has a long tail, without the machine's noise: `bench.latency`'s
  churn (Poisson arrivals at 4/s for 180 s, lifetimes exponential with mean 20 s, 500 nodes
  x 8 H100-80GB, one `1g.10gb` a pod) replayed through the real engine
  (`common.placement.replay.Cluster`) onto a model of the agent's NVML lanes: one GPU's
  calls run one at a time (`nodeagent.device.NodeGpus.call_gpu`), 300 ms per GI or CI create
  and 200 ms per destroy. A create is a scan, then GI + CI + MIG UUID in one trip; a release
  a scan and two destroys. Orders: `fifo` (the agent before issue 25), `creates-first` (the
  agent now, nodeagent/lane.py: a queued create's call goes before queued releases' calls);
  `avoid_busy` K is the allocator's `--avoid-creates-in-flight K`. The create time (placed →
  slices made) per percentile, and the creates queued ahead on the GPU.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from bench import decision_kinds
from common.catalog import load_catalog
from common.constants import NODE_LABEL
from common.objects import Phase
from common.placement import Gpu, NodeState, Occupied, Policy
from common.placement.engine import place
from common.placement.model import Pending, Placement, PodRequest, SliceRequest, Snapshot
from common.placement.modes import ModeView
from common.placement.replay import Cluster, TraceNode
from common.placement.whole import WholeView
from testkit.builders import make_mig_node, make_node, make_pod, quiet_placer
from webhook.allocator import pods as podlib
from webhook.allocator.autoscale import kept_off, misplaced, placeholder_pod
from webhook.allocator.state import ClusterState

Obj = dict[str, Any]


def percentile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))] if s else math.nan


# ---- inflight: --avoid-creates-in-flight per decision ------------------------------------------


def inflight(nodes: int, pods: int, limit: int, ready_after: int = 3, life: int = 80) -> Obj:
    state = ClusterState(avoid_creates_in_flight=limit)
    for i in range(nodes):
        name = f"n{i:05d}"
        state.upsert_node(make_node(name, cpu="256", memory="2Ti", pods=250, gpus=8))
        state.upsert_mig_node(make_mig_node(name, ["H100-80GB"] * 8))
    placer = quiet_placer(state)
    making: deque[tuple[int, Obj]] = deque()  # (ready at decision, allocation)
    living: deque[tuple[int, Obj]] = deque()  # (leaves at decision, allocation)
    cpu: list[float] = []
    broken: set[tuple[str, int]] = set()
    unplaced = 0
    for i in range(pods):
        while making and making[0][0] <= i:
            body = making.popleft()[1]
            state.upsert_allocation({**body, "status": {"phase": Phase.READY.value}})
        while living and living[0][0] <= i:
            body = living.popleft()[1]
            state.remove_allocation(body)
            state.remove_pod(state.pods[body["spec"]["podUID"]].obj)
        uid = f"p{i}"
        state.upsert_pod(make_pod(uid, uid=uid, claim=f"c{i}", cpu="1", memory="1Gi"))
        track = placer.tracks.ensure(uid)
        t0 = time.process_time()
        placer.decide(uid)
        cpu.append(time.process_time() - t0)
        placed = track.create
        placer.tracks.forget(uid)
        if placed is None:
            unplaced += 1
            continue
        state.confirm(placed)
        making.append((i + ready_after, placed))
        living.append((i + life, placed))
        for s in placed["spec"]["slices"]:
            broken.add((placed["spec"]["nodeName"], s["gpuIndex"]))
    return {
        "nodes": nodes,
        "pods": pods,
        "avoid_creates_in_flight": limit,
        "ready_after": ready_after,
        "life": life,
        "unplaced": unplaced,
        "gpus_broken": len(broken),
        "decision_cpu_p50_ms": round(percentile(cpu, 0.5) * 1e3, 3),
        "decision_cpu_p99_ms": round(percentile(cpu, 0.99) * 1e3, 3),
        "decision_cpu_mean_ms": round(sum(cpu) / len(cpu) * 1e3, 3),
    }


def _inflight(quick: bool) -> Obj:
    nodes, pods = (50, 400) if quick else (1000, 4000)
    return {f"limit-{k}": inflight(nodes, pods, k) for k in (0, 1, 2)}


# ---- keepoff: Karpenter placeholders kept off the nodes that cannot serve them ----------------

# (share of the fleet, model, what fills each GPU: (profile, count, cpu, memory) per pod)
MIXED = (
    (30, "H200-141GB", ("7g.141gb", 1, "16", "128Gi")),
    (10, "A100-40GB", ("7g.40gb", 1, "8", "64Gi")),  # cpu to spare: looks free, is not
    (10, "A100-40GB", ("7g.40gb", 1, "24", "64Gi")),  # all the cpu taken
    (25, "H100-80GB", ("1g.10gb", 7, "7", "56Gi")),  # 1g.10gb used up as advertised
    (12.5, "H100-80GB", ("7g.80gb", 1, "16", "128Gi")),  # cpu to spare: looks free, is not
    (12.5, "H100-80GB", ("3g.40gb", 1, "12", "64Gi")),  # 2 a GPU: all the cpu taken
)


def _node_name(i: int) -> str:
    return f"ip-10-{i // 250}-{i % 250}-7.ec2.internal"


def full_fleet(nodes: int, gpus: int) -> list[NodeState]:
    full = (Occupied(0, 8, "7g.80gb"),)
    return [
        NodeState(
            name,
            {NODE_LABEL: name},
            (),
            False,
            64_000,
            1 << 40,
            110,
            tuple(Gpu(g, "H100-80GB", True, True, full) for g in range(gpus)),
        )
        for name in (_node_name(i) for i in range(nodes))
    ]


def mixed_fleet(nodes: int, gpus: int) -> ClusterState:
    state = ClusterState()
    catalog = load_catalog()
    bounds = [0.0]
    for share, *_ in MIXED:
        bounds.append(bounds[-1] + share * nodes / 100)
    for i in range(nodes):
        kind = next(k for k in range(len(MIXED)) if i < bounds[k + 1])
        _, model, (profile, count, cpu, memory) = MIXED[kind]
        name = _node_name(i)
        state.upsert_node(
            make_node(name, cpu=str(24 * gpus), memory=f"{256 * gpus}Gi",
                      labels={NODE_LABEL: name}, model=model, gpus=gpus)
        )  # fmt: skip
        state.upsert_mig_node(make_mig_node(name, [model] * gpus))
        gpu_model = catalog.model(model)
        per_gpu = gpu_model.profile(profile) if gpu_model is not None else None
        assert per_gpu is not None, (model, profile)
        for j in range(gpus * (per_gpu.max_count // count)):
            state.upsert_pod(
                make_pod(f"w-{i}-{j}", slices={"main": {profile: count}}, cpu=cpu,
                         memory=memory, gates=(), claim=None, uid=f"w-{i}-{j}", node_name=name)
            )  # fmt: skip
    return state


def _timed(fn: Callable[[], list[str]]) -> tuple[list[str], float]:
    t0 = time.process_time()
    out = fn()
    return out, time.process_time() - t0


def keepoff(nodes: int, gpus: int) -> Obj:
    catalog = load_catalog()
    fleet = full_fleet(nodes, gpus)
    pod = make_pod("p", slices={"main": {"1g.10gb": 1}}, uid="u1")
    request = podlib.pod_request(pod)
    avoid, kept_s = _timed(lambda: kept_off(fleet, request))
    body = placeholder_pod(pod, request, avoid)
    checks = fleet[: min(1000, nodes)]
    t0 = time.process_time()
    bad = sum(
        misplaced(n, request, (), Policy.INSTASLICE, catalog, ModeView(), WholeView())
        for n in checks
    )
    per_check_s = (time.process_time() - t0) / len(checks)
    assert bad == len(checks) and len(avoid) == nodes  # every node full: every one kept off

    state = mixed_fleet(nodes, gpus)
    wants = make_pod("q", slices={"main": {"1g.10gb": 1}}, cpu="4", memory="32Gi", uid="u2")
    asks = podlib.pod_request(wants)
    states = state.node_states()
    every, every_s = _timed(lambda: kept_off(states, asks))
    some, some_s = _timed(lambda: kept_off(states, asks, state.room))  # builds each Room
    again, again_s = _timed(lambda: kept_off(states, asks, state.room))  # kept since
    assert again == some
    assert set(some) <= set(every) and len(every) == nodes
    return {
        "nodes": nodes,
        "gpus_per_node": gpus,
        "kept_off_ms_cpu": round(kept_s * 1000, 2),
        "placeholder_json_bytes": len(json.dumps(body)),
        "misplaced_us_cpu_per_node": round(per_check_s * 1e6, 1),
        "mixed": {
            "pods_bound": sum(1 for p in state.pods.values() if p.bound),
            "all_listed": len(every),
            "all_ms_cpu": round(every_s * 1000, 2),
            "all_placeholder_json_bytes": len(json.dumps(placeholder_pod(wants, asks, every))),
            "room_listed": len(some),
            "room_ms_cpu": round(some_s * 1000, 2),
            "room_again_ms_cpu": round(again_s * 1000, 2),
            "room_placeholder_json_bytes": len(json.dumps(placeholder_pod(wants, asks, some))),
        },
    }


def _keepoff(quick: bool) -> Obj:
    return keepoff(100 if quick else 5000, 8)


# ---- lanes: the churn's create tail on a model of the NVML lanes -------------------------------

ORDERS = ("fifo", "creates-first", "alloc", "alloc-creates-first")
CREATE = (0.0, 0.6)  # scan, then GI + CI + MIG UUID in one trip
SPLIT_CREATE = (0.0, 0.3, 0.3, 0.0)  # scan, GI, CI, MIG UUID
RELEASE = (0.0, 0.2, 0.2)  # scan, destroy CI, destroy GI


@dataclass
class Job:
    pod: str
    create: bool
    calls: deque[float]
    asked: float  # when the allocation's work was asked for


@dataclass
class Lane:
    """One GPU's NVML calls, one at a time. `alloc*` orders hand the GPU over per
    allocation (a create's calls back to back), the others per call."""

    order: str
    busy_until: float = 0.0
    made: int = 0  # creates done whose `Ready` the allocator has not seen yet (ready_lag_s)
    queue: deque[Job] = field(default_factory=deque)  # jobs waiting to run their next call
    holder: Job | None = None  # `alloc*`: the job the GPU is handed to
    running: Job | None = None  # whose call runs now (or ran last)

    def creates(self) -> int:
        """Creates asked for and not done yet on this GPU."""
        running = self.running is not None and self.running.create
        return sum(1 for j in self.queue if j.create) + running

    def next_job(self) -> Job | None:
        if self.holder is not None:
            return self.holder
        if not self.queue:
            return None
        if self.order.endswith("creates-first"):
            for job in self.queue:
                if job.create:
                    self.queue.remove(job)
                    return job
        return self.queue.popleft()


def _avoiding(snapshot: Snapshot, busy: set[tuple[str, int]], intact_too: bool) -> Snapshot:
    """`snapshot` with the `busy` GPUs left out (marked unhealthy), and with `intact_too`
    the GPUs nothing occupies as well (waiting is then avoided only on GPUs already broken)."""
    nodes = []
    for node in snapshot.nodes:
        gpus = tuple(
            replace(g, healthy=False)
            if (node.name, g.index) in busy or (intact_too and not g.occupied)
            else g
            for g in node.gpus
        )
        nodes.append(replace(node, gpus=gpus) if gpus != node.gpus else node)
    return Snapshot(tuple(nodes))


def simulate(
    order: str,
    *,
    nodes: int,
    rate: float,
    seconds: float,
    life_s: float,
    seed: int,
    avoid_busy: int = 0,
    keep_intact: bool = False,
    ready_lag_s: float = 0.0,
    split_create: bool = False,
) -> Obj:
    rnd = random.Random(seed)
    gpus = tuple(Gpu(i, "H100-80GB") for i in range(8))
    fleet = [TraceNode(f"n{i}", 128_000, 2**40, 250, gpus, {}, ()) for i in range(nodes)]
    cluster = Cluster(fleet)
    lanes: dict[tuple[str, int], Lane] = {}
    events: list[tuple[float, int, str, Any]] = []
    seq = itertools.count()

    def at(t: float, kind: str, data: Any) -> None:
        heapq.heappush(events, (t, next(seq), kind, data))

    t = 0.0
    n = 0
    while t < seconds:
        at(t, "arrive", f"p{n}")
        n += 1
        t += rnd.expovariate(rate)
    lifetimes = {f"p{i}": rnd.expovariate(1 / life_s) for i in range(n)}
    where: dict[str, tuple[str, int]] = {}
    create_s: dict[str, float] = {}
    queued_ahead: dict[str, int] = {}
    unplaced = 0

    def kick(key: tuple[str, int], now: float) -> None:
        lane = lanes[key]
        if lane.busy_until > now:
            return
        job = lane.next_job()
        if job is None:
            return
        cost = job.calls.popleft()
        lane.running = job
        lane.busy_until = now + cost
        lane.holder = job if job.calls and order.startswith("alloc") else None
        at(now + cost, "call_done", (key, job))

    def ask(key: tuple[str, int], job: Job, now: float) -> None:
        lane = lanes.setdefault(key, Lane(order))
        lane.queue.append(job)
        kick(key, now)

    while events:
        now, _, kind, data = heapq.heappop(events)
        if kind == "arrive":
            req = PodRequest(data, 100, 2**27, (SliceRequest("main", "1g.10gb"),))
            placed: Placement | Pending | None = None
            if avoid_busy:  # GPUs with that many creates waiting are left out, if others fit
                busy = {k for k, lane in lanes.items() if lane.creates() + lane.made >= avoid_busy}
                if busy:
                    avoiding = _avoiding(cluster.snapshot, busy, keep_intact)
                    placed = place(avoiding, req, Policy.INSTASLICE)
            if not isinstance(placed, Placement):
                placed = cluster.decide(req)
            if not isinstance(placed, Placement):
                unplaced += 1
                continue
            cluster.assume(req, placed)
            key = (placed.node, placed.slices[0].gpu_index)
            where[data] = key
            lane = lanes.setdefault(key, Lane(order))
            queued_ahead[data] = lane.creates()
            ask(key, Job(data, True, deque(SPLIT_CREATE if split_create else CREATE), now), now)
        elif kind == "call_done":
            key, job = data
            lane = lanes[key]
            lane.running = None
            if job.calls:
                if not order.startswith("alloc"):
                    lane.queue.append(job)  # the worker asks for its next call: at the back
            else:
                if job.create:
                    create_s[job.pod] = now - job.asked
                    at(now + lifetimes[job.pod], "leave", job.pod)
                    lane.made += 1
                    at(now + ready_lag_s, "ready_seen", key)
                else:
                    cluster.remove(job.pod)
            kick(key, now)
        elif kind == "ready_seen":
            lanes[data].made -= 1
        elif kind == "leave":
            ask(where[data], Job(data, False, deque(RELEASE), now), now)
    xs = list(create_s.values())
    return {
        "order": order,
        "split_create": split_create,
        "avoid_busy": avoid_busy,
        "ready_lag_s": ready_lag_s,
        "keep_intact": keep_intact,
        "seed": seed,
        "pods": n,
        "unplaced": unplaced,
        "gpus_used": len(lanes),
        "create_p50_s": round(percentile(xs, 0.5), 2),
        "create_p90_s": round(percentile(xs, 0.9), 2),
        "create_p99_s": round(percentile(xs, 0.99), 2),
        "create_max_s": round(max(xs, default=math.nan), 2),
        "queued_creates_ahead_p99": percentile(list(queued_ahead.values()), 0.99),
        "queued_creates_ahead_max": max(queued_ahead.values(), default=0),
    }


TAIL = ("create_p50_s", "create_p99_s", "create_max_s")


def _lanes(quick: bool) -> Obj:
    nodes, seconds, life_s = (20, 40.0, 10.0) if quick else (500, 180.0, 20.0)
    out: Obj = {}
    for order in ("fifo", "creates-first"):
        for k in (0, 2):
            runs = [
                simulate(order, nodes=nodes, rate=4.0, seconds=seconds, life_s=life_s, seed=s,
                         avoid_busy=k)
                for s in (1, 2, 3)
            ]  # fmt: skip
            out[f"{order}-avoid-{k}"] = {
                "seeds": [r["seed"] for r in runs],
                "unplaced": sum(r["unplaced"] for r in runs),
                **{f: max(r[f] for r in runs) for f in TAIL},  # the worst of the seeds
                "queued_creates_ahead_max": max(r["queued_creates_ahead_max"] for r in runs),
            }
    return out


def _kinds(quick: bool) -> Obj:
    return decision_kinds.run(100 if quick else 5000, per_kind=40 if quick else 300)


# ---- the registry ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    run: Callable[[bool], Obj]  # quick -> its JSON


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "inflight", "--avoid-creates-in-flight 0/1/2: decision CPU, GPUs broken", _inflight
        ),
        Scenario("keepoff", "Karpenter placeholders: kept_off list, size, CPU", _keepoff),
        Scenario("lanes", "churn on a model of the NVML lanes: create tail per order", _lanes),
        Scenario(
            "kinds",
            "one decision of every pod kind at 5000 nodes (bench/decision_kinds.py)",
            _kinds,
        ),
    )
}


def run(names: Sequence[str], quick: bool) -> Obj:
    """Each named scenario's JSON, and the CPU seconds it took."""
    out: Obj = {"quick": quick, "took_cpu_s": {}}
    for name in names:
        t0 = time.process_time()
        out[name] = SCENARIOS[name].run(quick)
        out["took_cpu_s"][name] = round(time.process_time() - t0, 1)
    return out


def table(results: Obj) -> str:
    lines = []
    for key, r in (results.get("inflight") or {}).items():
        lines.append(
            f"inflight {key}: decision CPU p50 {r['decision_cpu_p50_ms']} ms, p99 "
            f"{r['decision_cpu_p99_ms']} ms; {r['gpus_broken']} GPUs broken open, "
            f"{r['unplaced']} unplaced"
        )
    if k := results.get("keepoff"):
        m = k["mixed"]
        lines.append(
            f"keepoff {k['nodes']} nodes: full fleet {k['kept_off_ms_cpu']} ms, "
            f"{k['placeholder_json_bytes']} B; mixed: {m['room_listed']} of {m['all_listed']} "
            f"named, {m['room_ms_cpu']} ms ({m['room_again_ms_cpu']} ms rooms kept), "
            f"{m['room_placeholder_json_bytes']} B"
        )
    if k := results.get("kinds"):
        lines.extend(decision_kinds.lines(k))
    for key, r in (results.get("lanes") or {}).items():
        lines.append(
            f"lanes {key}: create p50 {r['create_p50_s']} s, p99 {r['create_p99_s']} s, "
            f"max {r['create_max_s']} s, {r['queued_creates_ahead_max']} queued ahead at most"
        )
    return "\n".join(lines)
