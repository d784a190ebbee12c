"""Autoscaling with Karpenter: nodes created for a burst versus the fewest that serve it.

`python -m bench.autoscale [--pods 40] [--gpus 8] [--max 4] [--dir .dev/bench-autoscale]`
brings up the system (hack.dev) with one autoscaled H100-80GB group of no nodes, Karpenter's
KWOK provider and the emulated agents, then:

1. creates `--pods` pods asking `nvidia.com/mig-3g.40gb` at once (two fit a GPU, so a node
   of `--gpus` GPUs serves 2 x gpus of them: the minimum is ceil(pods / (2 x gpus)));
2. waits until every pod runs, recording every NodeClaim Karpenter made meanwhile;
3. deletes the pods and waits until Karpenter has removed every node, then checks that
   nothing of InstaSlice is left: no MigNode, agent Lease, SliceAllocation or placeholder pod.

Prints one JSON object: nodes created, the minimum, seconds to all Running and to all nodes
gone, and what was left behind (empty lists when clean). `run_burst` is also the e2e test's
(tests/e2e/test_autoscaling.py) with a small burst.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common.constants import SCALE_UP_LABEL
from common.kubeapi import Kube, core_path, group_path, instaslice_path
from hack.cluster.karpenter import GROUP_LABEL
from hack.cluster.nodes import parse_spec

NODECLAIMS = group_path("karpenter.sh/v1", "nodeclaims")
PROFILE = "3g.40gb"
PER_GPU = 2  # 3g.40gb instances an H100-80GB holds


def spec(gpus: int, max_nodes: int) -> dict[str, Any]:
    group = {"prefix": "auto-h100", "count": 0, "autoscaled": {"max": max_nodes}, "gpus": gpus,
             "model": "H100-80GB", "cpu": "64", "memory": "512Gi", "pods": 110}  # fmt: skip
    return {"nodes": [group]}


def pod(name: str) -> dict[str, Any]:
    resources = {"limits": {f"nvidia.com/mig-{PROFILE}": 1}, "requests": {"cpu": "100m"}}
    container = {"name": "main", "image": "busybox", "resources": resources}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [container], "terminationGracePeriodSeconds": 0}}  # fmt: skip


async def _names(kube: Kube, path: str, **query: Any) -> set[str]:
    listing = await kube.list(path, **query)
    return {i["metadata"]["name"] for i in listing.get("items", [])}


async def leftovers(kube: Kube, namespace: str, nodes: set[str]) -> dict[str, list[str]]:
    """InstaSlice's objects still there for nodes that are gone (or pods that finished)."""
    leases = await _names(kube, group_path("coordination.k8s.io/v1", "leases", "instaslice-system"))
    return {
        "mignodes": sorted(await _names(kube, instaslice_path("mignodes")) & nodes),
        "agent_leases": sorted(leases & nodes),
        "sliceallocations": sorted(
            await _names(kube, instaslice_path("sliceallocations", namespace))
        ),
        "placeholders": sorted(
            await _names(kube, core_path("pods", namespace), labelSelector=SCALE_UP_LABEL)
        ),
        "nodes": sorted(await _names(kube, core_path("nodes"), labelSelector=GROUP_LABEL)),
    }


async def run_burst(
    kube: Kube, namespace: str, pods: int, per_node: int, *, timeout_s: float = 300.0
) -> dict[str, Any]:
    """Steps 1-3 of the module docstring in `namespace` (opted in); the measurements."""
    claims: set[str] = set()
    nodes: set[str] = set()
    t0 = time.monotonic()
    for i in range(pods):
        await kube.create(core_path("pods", namespace), pod(f"burst-{i}"))
    running_s = None
    async with asyncio.timeout(timeout_s):
        while running_s is None:
            claims |= await _names(kube, NODECLAIMS)
            nodes |= await _names(kube, core_path("nodes"), labelSelector=GROUP_LABEL)
            listing = await kube.list(core_path("pods", namespace))
            phases = [
                p.get("status", {}).get("phase")
                for p in listing["items"]
                if SCALE_UP_LABEL not in (p["metadata"].get("labels") or {})
            ]
            if phases.count("Running") == pods:
                running_s = time.monotonic() - t0
            else:
                await asyncio.sleep(0.5)
    claims |= await _names(kube, NODECLAIMS)
    nodes |= await _names(kube, core_path("nodes"), labelSelector=GROUP_LABEL)
    t1 = time.monotonic()
    for i in range(pods):
        await kube.delete_ignore_missing(core_path("pods", namespace, f"burst-{i}"))
    async with asyncio.timeout(timeout_s):
        while True:  # polled: two collections, and a node may come and go between watches
            nodes_left = await _names(kube, core_path("nodes"), labelSelector=GROUP_LABEL)
            if not nodes_left and not await _names(kube, NODECLAIMS):
                break
            await asyncio.sleep(0.5)
    gone_s = time.monotonic() - t1
    deadline = time.monotonic() + 60  # the last node's cleanup may trail its deletion a little
    while any((left := await leftovers(kube, namespace, nodes)).values()):
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    return {
        "pods": pods,
        "per_node": per_node,
        "nodes_created": len(claims),
        "nodes_minimum": math.ceil(pods / per_node),
        "seconds_to_all_running": round(running_s, 1),
        "seconds_to_all_nodes_gone": round(gone_s, 1),
        "left_behind": left,
    }


async def _measure(kubeconfig: Path, pods: int, per_node: int) -> dict[str, Any]:
    async with await Kube.connect(str(kubeconfig)) as kube:
        ns = "bench-autoscale"
        meta = {"name": ns, "annotations": {"instaslice.io/enabled": "true"},
                "labels": {"instaslice.io/enabled": "true"}}  # fmt: skip
        await kube.create(core_path("namespaces"), {"metadata": meta})
        await asyncio.sleep(2)  # the allocator's namespace watch sees the opt-in
        return await run_burst(kube, ns, pods, per_node)


def main(argv: Sequence[str] | None = None) -> int:
    from hack.dev import DevSystem

    ap = argparse.ArgumentParser(prog="python -m bench.autoscale", description=__doc__)
    ap.add_argument("--pods", type=int, default=40)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--max", type=int, default=4)
    ap.add_argument("--dir", type=Path, default=Path(".dev/bench-autoscale"))
    a = ap.parse_args(argv)
    system = DevSystem.up(a.dir, parse_spec(spec(a.gpus, a.max)))
    try:
        cpu0 = time.process_time()
        result = asyncio.run(_measure(system.kubeconfig, a.pods, PER_GPU * a.gpus))
        result["bench_cpu_s"] = round(time.process_time() - cpu0, 2)
    finally:
        system.down()
    print(json.dumps(result, indent=1))
    return 0 if result["nodes_created"] == result["nodes_minimum"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
