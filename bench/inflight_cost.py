"""What `--avoid-creates-in-flight` costs the allocator per decision, on its own model.

The allocator's placer and cluster model (`webhook.allocator.placer.Placer`,
`webhook.allocator.state.ClusterState`), no API server: N nodes x 8 H100-80GB, pods of one
`1g.10gb` decided one after another. A placed allocation is `Ready` (its create no longer
in flight) `--ready-after` decisions later, and its pod leaves `--life` decisions after
it was placed, so GPUs are busy and the fleet stays partly full as under churn. Prints,
per setting, the CPU time of a decision (p50, p99, mean) and how many GPUs were broken
open; the same pods and the same event order for every setting.

    python -m bench.inflight_cost [--nodes 1000] [--pods 4000] [--limits 0,1,2]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from common.objects import Phase
from common.placement import Policy
from testkit.builders import make_mig_node, make_node, make_pod
from webhook.allocator.metrics import AllocatorMetrics
from webhook.allocator.placer import Placer
from webhook.allocator.state import ClusterState
from webhook.allocator.track import Tracks

Obj = dict[str, Any]


def percentile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))] if s else math.nan


def quiet_placer(state: ClusterState) -> Placer:
    """The allocator's placer on `state`, telling and kicking nobody (decisions only)."""
    return Placer(
        state,
        Tracks(),
        AllocatorMetrics(),
        Policy.INSTASLICE,
        state.geometries.catalog,
        kick=lambda uid: None,
        tell=lambda pod, reason, message: None,
    )


def run(nodes: int, pods: int, limit: int, ready_after: int, life: int) -> dict[str, Any]:
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


def main(argv: Sequence[str] | None = None) -> int:
    raw = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser(
        "python -m bench.inflight_cost", None, __doc__, formatter_class=raw
    )
    for flag, default, what in (
        ("--nodes", 1000, "fleet size (8 H100 each)"),
        ("--pods", 4000, "pods decided one after another"),
        ("--ready-after", 3, "decisions until a placed allocation is Ready"),
        ("--life", 80, "decisions until a placed pod leaves"),
    ):
        ap.add_argument(flag, type=int, default=default, help=what)
    ap.add_argument("--limits", default="0,1,2", help="comma-separated settings to compare")
    args = ap.parse_args(argv)
    for limit in (int(x) for x in args.limits.split(",")):
        res = run(args.nodes, args.pods, limit, args.ready_after, args.life)
        print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
