"""What watching the node agents' Leases costs the allocator, per node, in CPU.

`python -m bench.agent_leases [--nodes 2000] [--events 20000]`: feeds the allocator's Lease
handler (`Handlers.on_lease`) watch lines as the API server sends them (each decoded
from JSON, a new `renewTime` each, nodes in turn), then times the leader's sweep over every
Lease. Prints microseconds per event and the share of one core a fleet of `--nodes` agents
renewing every 10 s (the default 40 s Lease, renewed every quarter) costs. Leaves out the
socket read and TLS, which the API server's side dominates (docs/benchmarks.md measures the
whole system). No cluster needed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence
from typing import cast

from common.clock import SystemClock
from common.kubeapi import Kube
from webhook.allocator.controller import Controller
from webhook.allocator.leader import LeaderElector
from webhook.allocator.metrics import AllocatorMetrics
from webhook.allocator.settings import AllocatorSettings

RENEW_EVERY_S = 10.0  # the node agent's default: --lease-duration-s 40, renewed every 40/4


def watch_line(node: str, renew: str) -> bytes:
    """One Lease MODIFIED event, as the API server writes it (managedFields included)."""
    meta = {
        "name": node,
        "namespace": "instaslice-system",
        "uid": "6b1f0c1e-0000-4000-8000-000000000000",
        "resourceVersion": "123456",
        "creationTimestamp": "2026-11-30T08:00:00Z",
        "managedFields": [
            {
                "manager": "instaslice-nodeagent",
                "operation": "Update",
                "apiVersion": "coordination.k8s.io/v1",
                "time": renew[:19] + "Z",
                "fieldsType": "FieldsV1",
                "fieldsV1": {"f:spec": {"f:leaseDurationSeconds": {}, "f:renewTime": {}}},
            }
        ],
    }
    spec = {
        "holderIdentity": f"instaslice-nodeagent/{node}",
        "leaseDurationSeconds": 40,
        "acquireTime": "2026-11-30T08:00:00.000000Z",
        "renewTime": renew,
    }
    obj = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}
    return json.dumps({"type": "MODIFIED", "object": obj}).encode()


async def measure(nodes: int, events: int) -> dict[str, float]:
    controller = Controller(
        cast(Kube, None),  # never called: only the handler and the sweep run
        cast(LeaderElector, None),
        AllocatorMetrics(),
        AllocatorSettings(namespace="instaslice-system", clock=SystemClock()),
    )
    controller.lease_informer.synced.set()  # steady state: renewals count when seen
    lines = [  # nodes in turn, each event a new renewTime
        watch_line(f"node-{i % nodes:05d}", f"2026-11-30T09:00:00.{i:06d}Z") for i in range(events)
    ]
    t0 = time.process_time()
    for line in lines:
        event = json.loads(line)
        await controller.handlers.on_lease(event["type"], event["object"])
    per_event = (time.process_time() - t0) / events
    sweeps = 200
    t0 = time.process_time()
    for _ in range(sweeps):
        controller.agents.sweep()
    per_sweep = (time.process_time() - t0) / sweeps
    return {
        "nodes": nodes,
        "event_us": per_event * 1e6,
        "line_bytes": len(lines[-1]),
        "core_share_pct": nodes / RENEW_EVERY_S * per_event * 100,
        "sweep_ms": per_sweep * 1e3,
        "sweep_core_share_pct": per_sweep / controller.settings.agent_sweep_s * 100,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.agent_leases", description=__doc__)
    ap.add_argument("--nodes", type=int, default=2000)
    ap.add_argument("--events", type=int, default=20000)
    args = ap.parse_args(argv)
    r = asyncio.run(measure(args.nodes, args.events))
    print(f"lease event (JSON decode + handler): {r['event_us']:.1f} us ({r['line_bytes']} bytes)")
    print(
        f"{r['nodes']} agents renewing every {RENEW_EVERY_S:g} s: "
        f"{r['core_share_pct']:.2f} % of one core"
    )
    print(
        f"leader's sweep over {r['nodes']} Leases: {r['sweep_ms']:.2f} ms every "
        f"5 s ({r['sweep_core_share_pct']:.3f} % of one core)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
