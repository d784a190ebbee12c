"""The cost of keeping Karpenter placeholders off nodes that cannot serve their pod.

`python -m bench.placeholder_keepoff [--nodes 5000] [--gpus 8]` builds a fleet of H100-80GB
nodes whose GPUs are full of 7g.80gb (each labelled `instaslice.io/node` by its agent) and a
pod asking 1g.10gb, then measures, in CPU time (no cluster):

- `kept_off`: the placeholder's `NotIn` list over the whole fleet (once per raise);
- the placeholder pod's size as JSON (the list is most of it; etcd's default limit on a
  request is 1.5 MiB);
- `misplaced`: the check the scale-up loop runs each round for every placeholder bound to a
  node while its pod still needs one (one node each).

Prints one JSON object (docs/benchmarks.md, docs/autoscaling.md).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence

from common.catalog import load_catalog
from common.constants import NODE_LABEL
from common.placement import Gpu, NodeState, Occupied, Policy
from common.placement.modes import ModeView
from common.placement.whole import WholeView
from tests.integration.allocator_fixtures import make_pod
from webhook.allocator import pods as podlib
from webhook.allocator.autoscale import kept_off, misplaced, placeholder_pod


def measure(nodes: int, gpus: int) -> dict[str, object]:
    catalog = load_catalog()
    full = (Occupied(0, 8, "7g.80gb"),)
    fleet = [
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
        for name in (f"ip-10-{i // 250}-{i % 250}-7.ec2.internal" for i in range(nodes))
    ]
    pod = make_pod("p", slices={"main": {"1g.10gb": 1}}, uid="u1")
    request = podlib.pod_request(pod)
    t0 = time.process_time()
    avoid = kept_off(fleet, request)
    kept_s = time.process_time() - t0
    body = placeholder_pod(pod, request, avoid)
    checks = fleet[: min(1000, nodes)]
    t0 = time.process_time()
    bad = sum(
        misplaced(n, request, (), Policy.INSTASLICE, catalog, ModeView(), WholeView())
        for n in checks
    )
    per_check_s = (time.process_time() - t0) / len(checks)
    assert bad == len(checks) and len(avoid) == nodes  # every node full: every one kept off
    return {
        "nodes": nodes,
        "gpus_per_node": gpus,
        "kept_off_ms_cpu": round(kept_s * 1000, 2),
        "placeholder_json_bytes": len(json.dumps(body)),
        "misplaced_us_cpu_per_node": round(per_check_s * 1e6, 1),
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.placeholder_keepoff", description=__doc__)
    ap.add_argument("--nodes", type=int, default=5000)
    ap.add_argument("--gpus", type=int, default=8)
    args = ap.parse_args(argv)
    print(json.dumps(measure(args.nodes, args.gpus)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
