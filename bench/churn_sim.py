"""Why `churn-realistic` has a long tail, without the machine's noise: a discrete-event model.

The `churn` scenario of `bench.latency` (Poisson arrivals at 4/s for 180 s, lifetimes
exponential with mean 20 s, 500 nodes x 8 H100-80GB, one `1g.10gb` a pod) replayed through
the real placement engine (`common.placement.replay.Cluster`, policy `instaslice`) onto a
model of the node agent's NVML lanes: the calls on one GPU run one at a time in the order
they were asked for (`nodeagent.device.NodeGpus.call_gpu`), at the benchmark's realistic
latency (300 ms per GI or CI create, 200 ms per destroy, 0 for reads). Each allocation's
worker asks for its calls one after another, so the calls of allocations queued on the same
GPU interleave, as in the agent:

- create: instance scan (0), then GI (300) + CI (300) + MIG UUID (0) in one trip
  (`lifecycle._gi_ci_uuid`; `--split-create`: three calls, as the agent asked before);
- release: instance scan (0), destroy CI (200), destroy GI (200); the slots are free for
  placement once the release is done (the allocation is deleted after its finalizer goes).

The API server, watches and CPU are left out (`--overhead-s` adds a constant per pod for
them): what is left is the queueing that per-GPU serial NVML and packing placement make.
It prints the create time (placement decided → slices made) per percentile and how many
creates were queued on the GPU when each one was asked for, for the current lane order and
for alternatives (`--order`): `fifo` (the agent before issue 25's lane work), `creates-first`
(the agent now, nodeagent/lane.py: per call, a queued create's call goes before the queued
calls of releases on the same GPU), `alloc` (a create's calls back to back: the GPU is handed
over per allocation, not per call), `alloc-creates-first` (`alloc`, and a queued create goes
before a queued release).

`--avoid-busy K` is the allocator's `--avoid-creates-in-flight K`: a GPU with K or more
slices placed and not made yet is left out of a first placement pass (the allocator counts
a slice until it sees the allocation `Ready`: `--ready-lag-s` adds that status write and
watch to the time a GPU counts as busy).

    python -m bench.churn_sim [--seed 1,2,3] [--order fifo,creates-first] [--avoid-busy 0,1,2]
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import random
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from common.placement.engine import place
from common.placement.model import (
    Gpu,
    Pending,
    Placement,
    PodRequest,
    Policy,
    SliceRequest,
    Snapshot,
)
from common.placement.replay import Cluster, TraceNode

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
    """One GPU's NVML calls, one at a time."""

    order: str
    busy_until: float = 0.0
    made: int = 0  # creates done whose `Ready` the allocator has not seen yet (--ready-lag-s)
    queue: deque[Job] = field(default_factory=deque)  # jobs waiting to run their next call
    holder: Job | None = None  # `alloc`/`creates-first`: the job the GPU is handed to
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


def percentile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))] if s else math.nan


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
) -> dict[str, Any]:
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


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.churn_sim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--nodes", type=int, default=500)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--seconds", type=float, default=180.0)
    ap.add_argument("--life-s", type=float, default=20.0)
    ap.add_argument("--seed", default="1", help="comma-separated seeds, one run each")
    ap.add_argument("--order", default=",".join(ORDERS))
    ap.add_argument(
        "--avoid-busy",
        default="0",
        help="comma-separated K: place away from GPUs with K creates waiting (0: never)",
    )
    ap.add_argument(
        "--ready-lag-s",
        type=float,
        default=0.0,
        help="a made slice counts as in flight this much longer (the Ready write and watch)",
    )
    ap.add_argument(
        "--keep-intact",
        action="store_true",
        help="with --avoid-busy: never break an intact GPU to avoid waiting",
    )
    ap.add_argument(
        "--split-create",
        action="store_true",
        help="a create's GI, CI and MIG UUID as three lane calls (the agent before one trip)",
    )
    args = ap.parse_args(argv)
    for order in args.order.split(","):
        if order not in ORDERS:
            ap.error(f"--order: {order!r} is not one of {', '.join(ORDERS)}")
        for k in (int(x) for x in args.avoid_busy.split(",")):
            for seed in (int(x) for x in args.seed.split(",")):
                res = simulate(
                    order,
                    nodes=args.nodes,
                    rate=args.rate,
                    seconds=args.seconds,
                    life_s=args.life_s,
                    seed=seed,
                    avoid_busy=k,
                    keep_intact=args.keep_intact,
                    ready_lag_s=args.ready_lag_s,
                    split_create=args.split_create,
                )
                print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
