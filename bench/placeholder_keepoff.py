"""The cost of keeping Karpenter placeholders off nodes that cannot serve their pod.

`python -m bench.placeholder_keepoff [--nodes 5000] [--gpus 8]` measures, in CPU time (no
cluster), for a pod asking 1g.10gb (with 4 cpu and 32 GiB in the mixed fleet):

- **full fleet** (the worst case): H100-80GB nodes whose GPUs are all full of 7g.80gb, each
  labelled `instaslice.io/node` by its agent, with cpu and memory to spare: every one still
  advertises 1g.10gb, so every one is listed;
  - `kept_off`: the placeholder's `NotIn` list over the whole fleet (once per raise);
  - the placeholder pod's size as JSON (the list is most of it; etcd's default limit on a
    request is 1.5 MiB);
  - `misplaced`: the check the scale-up loop runs each round for every placeholder bound
    to a node while its pod still needs one (one node each);
- **mixed fleet** (`ClusterState` fed Nodes, MigNodes and bound pods, as the allocator's
  watches do): 30 % H200-141GB nodes (no 1g.10gb advertised), 20 % A100-40GB nodes full
  of 7g.40gb pods (half of them with their cpu taken), 50 % H100-80GB nodes (half full of
  1g.10gb pods: the advertised count used up; a quarter full of 7g.80gb with cpu to spare;
  a quarter full of 3g.40gb pods that took the cpu). Each node has 24 cpu and 256 GiB a GPU
  (8 GPUs: 192 cpu, 2 TiB).
  `all` is the list without the advertised room (every admitted node with GPUs, the rule
  before), `room` with it (`kept_off(..., state.room)`): its length, the time to build it
  (first with every node's room computed, `room_again` with them kept, as in a round where
  few nodes changed) and the placeholder's size.

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
from testkit.builders import make_mig_node, make_node, make_pod
from webhook.allocator import pods as podlib
from webhook.allocator.autoscale import kept_off, misplaced, placeholder_pod
from webhook.allocator.state import ClusterState

# (share of the fleet, model, what fills each GPU: (profile, count, cpu, memory) per pod)
MIXED = (
    (30, "H200-141GB", ("7g.141gb", 1, "16", "128Gi")),
    (10, "A100-40GB", ("7g.40gb", 1, "8", "64Gi")),  # cpu to spare: looks free, is not
    (10, "A100-40GB", ("7g.40gb", 1, "24", "64Gi")),  # all the cpu taken
    (25, "H100-80GB", ("1g.10gb", 7, "7", "56Gi")),  # 1g.10gb used up as advertised
    (12.5, "H100-80GB", ("7g.80gb", 1, "16", "128Gi")),  # cpu to spare: looks free, is not
    (12.5, "H100-80GB", ("3g.40gb", 1, "12", "64Gi")),  # 2 a GPU: all the cpu taken
)


def _name(i: int) -> str:
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
        for name in (_name(i) for i in range(nodes))
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
        name = _name(i)
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


def _timed(fn: object) -> tuple[list[str], float]:
    assert callable(fn)
    t0 = time.process_time()
    out = fn()
    return out, time.process_time() - t0


def measure(nodes: int, gpus: int) -> dict[str, object]:
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


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.placeholder_keepoff", description=__doc__)
    ap.add_argument("--nodes", type=int, default=5000)
    ap.add_argument("--gpus", type=int, default=8)
    args = ap.parse_args(argv)
    print(json.dumps(measure(args.nodes, args.gpus)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
