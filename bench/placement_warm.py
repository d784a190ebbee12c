"""Placement replay with warm slices (docs/warm-slices.md): pods served with and without.

`python -m bench.placement_warm [--quick]` replays the churn and fill traces of
bench/placement.py under the `instaslice` policy twice: as the engine decides, and with each
node keeping warm slices where the node agent would (nodeagent/warm.py: the profiles most
asked for on that node, at the engine's next picks, within the caps), every single-slice
decision taking a warm slice where it ties (common/placement/warm.py). Warm slices are free
capacity to the engine, so the served counts should match; the target is within 1 %.
Warm slices are made at once here (no NVML time): the hit rate is an upper bound of what
the agent achieves, which bench.latency measures. Writes `.dev/bench/placement-warm.json`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.placement import run_policy, suite
from common.placement import NodeState, Occupied, Placement, Policy
from common.placement.replay import AddEvent, Cluster, Trace, parse_trace
from common.placement.warm import prefer_warm
from nodeagent.warm import Demand, targets

OUT = Path(".dev/bench/placement-warm.json")
Warm = dict[int, tuple[Occupied, ...]]


def _warm_of(node: NodeState, demand: Demand, now: float, per_gpu: int, per_node: int) -> Warm:
    out: dict[int, tuple[Occupied, ...]] = {}
    for s in targets(node, demand.wanted(now, 2, per_node), per_gpu, per_node):
        out[s.gpu_index] = (*out.get(s.gpu_index, ()), Occupied(s.start, s.size, s.profile))
    return out


def run_warm(trace: Trace, per_gpu: int = 1, per_node: int = 2) -> dict[str, Any]:
    """Accepted pods and the warm hit rate, with warm slices kept as the agents would."""
    cluster = Cluster(trace.nodes, Policy.INSTASLICE)
    demand: dict[str, Demand] = {}
    warm: dict[str, Warm] = {}
    accepted = hits = asked = 0
    for ev in trace.events:
        if isinstance(ev, AddEvent):
            result = cluster.decide(ev.request)
            if not isinstance(result, Placement):
                continue
            name = result.node
            held = warm.get(name, {})
            result = prefer_warm(cluster.node(name), result, held)
            for s in result.slices:
                asked += 1
                hits += Occupied(s.start, s.size, s.profile) in held.get(s.gpu_index, ())
            cluster.assume(ev.request, result)
            accepted += 1
            d = demand.setdefault(name, Demand())
            for s in result.slices:
                d.note(s.profile, ev.t)
        else:
            found = cluster.node_of(ev.pod)
            if found is None or not cluster.remove(ev.pod):
                continue
            name = found
        d = demand.setdefault(name, Demand())
        warm[name] = _warm_of(cluster.node(name), d, ev.t, per_gpu, per_node)
    return {
        "accepted_pods": accepted,
        "hit_rate": round(hits / asked, 3) if asked else None,
        "slices": asked,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.placement_warm", description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--per-gpu", type=int, default=1)
    ap.add_argument("--per-node", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    rows: dict[str, Any] = {}
    for name, doc in suite(args.quick).items():
        if not name.startswith(("churn-", "fill-")):
            continue
        trace = parse_trace(doc)
        cold = run_policy(trace, Policy.INSTASLICE).accepted_pods
        warm = run_warm(trace, args.per_gpu, args.per_node)
        ratio = warm["accepted_pods"] / cold if cold else 1.0
        rows[name] = {"without": cold, "with_warm": warm["accepted_pods"],
                      "ratio": round(ratio, 4), "hit_rate": warm["hit_rate"]}  # fmt: skip
        print(f"{name:24} without {cold:6}  with warm {warm['accepted_pods']:6}  "
              f"ratio {ratio:.4f}  hit rate {warm['hit_rate']}")  # fmt: skip
    doc = {"per_gpu": args.per_gpu, "per_node": args.per_node, "traces": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
