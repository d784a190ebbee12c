"""The webhook/allocator process's memory per node and GPU, without a control plane.

The scale scenario of `bench.latency` measures the allocator's RSS on a real fleet, but a
5000-node fleet takes 11 minutes to start on this machine. This benchmark runs, in a fresh
process, what that process runs per node — the allocator's informers, handlers and
`ClusterState` (`Controller`), and admission's MigNode informer (`webhook.offered`) —
against a stand-in for the API server that serves a fleet of N KWOK nodes x 8 H100-80GB
as JSON, objects as the node agent and KWOK write them: Nodes, MigNodes (the agent's own
`mig_node_status` of 8 catalog GPUs: 17 KB of JSON each) and agent Leases. Every list page
and watch event is JSON decoded, as `Kube` decodes it. Two orders:

- `startup`: the scale run's. The Nodes exist (KWOK made them Ready); then every agent
  creates its MigNode, publishes its status, writes its Node's capacity and labels and
  takes its Lease, all by watch event; then one round of KWOK heartbeats and Lease renewals;
- `restart`: the allocator starts on a fleet already published; its informers list it in
  pages of 500.

Then the leader's first decisions (one pod per profile and two multi-slice pods: the fleet
index's orders) and a metrics scrape (`node_states`). It records the RSS after the imports,
after the fleet (after a GC), the peak (`VmHWM`), and the CPU seconds of the feeding. The
stand-in generates each object when it is served and keeps none, so the RSS is the
process's own. Left out: pods (`bench.pod_cache` measures them), SliceAllocations, the TLS
and HTTP buffers of real connections, the admission server.

    python -m bench.fleet_memory                          # 1000, 2000, 5000 nodes, both orders
    python -m bench.fleet_memory --nodes 500 --orders startup
    python -m bench.fleet_memory --nodes 2000 --trace     # tracemalloc: top lines by size
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import subprocess
import sys
import time
import tracemalloc
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from bench.pod_cache import status_kib, write_entry

Obj = dict[str, Any]
OUT = Path(".dev/bench/latency.json")
GPUS = 8
MODEL = "H100-80GB"
NS = "instaslice-system"
NODES = "/api/v1/nodes"
MIG_NODES = "/apis/instaslice.io/v1alpha1/mignodes"
LEASES = f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases"
ORDERS = ("startup", "restart")


def _uuid(node: int, gpu: int) -> str:
    return f"GPU-{node:08x}-{gpu:04x}-4000-8000-{node * GPUS + gpu:012x}"


class _Objects:
    """The fleet's objects as the node agent and KWOK write them, built on demand."""

    def __init__(self) -> None:
        from nodeagent.checkpoint import Checkpoint
        from nodeagent.model import NodeInventory
        from nodeagent.report import capacity, gpu_labels, mig_node_status
        from testkit.builders import gpu

        inv = NodeInventory(gpus=tuple(gpu(k, _uuid(0, k), model=MODEL) for k in range(GPUS)))
        status = mig_node_status(inv, {}, Checkpoint("n", "b", {}), [], version="v", boot_id="b")
        from hack.cluster.nodes import parse_spec

        self._status = json.dumps(status)
        self._capacity = capacity(inv, {})
        self._labels = {k: v for k, v in gpu_labels(inv).items() if v is not None}
        self._group = parse_spec(
            {
                "nodes": [
                    {
                        "prefix": "gpu",
                        "count": 1,
                        "gpus": GPUS,
                        "model": MODEL,
                        "cpu": "128",
                        "memory": "1Ti",
                        "pods": 250,
                    }
                ]
            }
        ).groups[0]

    def node(self, i: int, *, published: bool, beat: int) -> Obj:
        from hack.cluster.nodes import node_manifest

        node = node_manifest(self._group, i)
        at = f"2026-12-01T10:{beat // 60 % 60:02d}:{beat % 60:02d}Z"
        node["status"].update(
            conditions=[
                {
                    "type": t,
                    "status": "True" if t == "Ready" else "False",
                    "lastHeartbeatTime": at,
                    "lastTransitionTime": "2026-12-01T10:00:00Z",
                    "reason": "KubeletReady" if t == "Ready" else "KubeletHasSufficient",
                    "message": "kubelet is posting ready status",
                }
                for t in ("MemoryPressure", "DiskPressure", "PIDPressure", "Ready")
            ],
            addresses=[{"type": "InternalIP", "address": f"10.1.{i // 256 % 256}.{i % 256}"}],
            daemonEndpoints={"kubeletEndpoint": {"Port": 10250}},
            nodeInfo={
                k: "fake"
                for k in (
                    "architecture",
                    "kubeletVersion",
                    "kubeProxyVersion",
                    "operatingSystem",
                    "osImage",
                    "kernelVersion",
                )
            },
        )
        if published:
            node["metadata"]["labels"].update(self._labels)
            node["status"]["capacity"].update(self._capacity)
            node["status"]["allocatable"].update(self._capacity)
        node["metadata"]["managedFields"] = [
            {
                "manager": m,
                "operation": "Update",
                "apiVersion": "v1",
                "fieldsType": "FieldsV1",
                "fieldsV1": {"f:status": {"f:capacity": {}, "f:conditions": {}}},
            }
            for m in ("kwok", "instaslice-nodeagent")
        ]
        return node

    def mig_node(self, i: int, *, published: bool) -> Obj:
        obj: Obj = {
            "apiVersion": "instaslice.io/v1alpha1",
            "kind": "MigNode",
            "metadata": {"name": f"gpu-{i}"},
        }
        if published:
            raw = self._status
            for k in range(GPUS):
                raw = raw.replace(_uuid(0, k), _uuid(i, k))
            obj["status"] = json.loads(raw)
        return obj

    @staticmethod
    def lease(i: int, *, renewed: int) -> Obj:
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": f"gpu-{i}", "namespace": NS},
            "spec": {
                "holderIdentity": f"instaslice-nodeagent/gpu-{i}",
                "leaseDurationSeconds": 1200,
                "renewTime": f"2026-12-01T10:00:{renewed % 60:02d}.000000Z",
            },
        }


class _StandIn:
    """Serves lists (JSON pages) and watches (JSON lines) of the fleet. It keeps, per object,
    only how to build it (a factory and a resourceVersion), never the object."""

    def __init__(self) -> None:
        self.rv = 1000
        self.cpu_s = 0.0  # spent building and encoding objects: the API server's, not ours
        self._items: dict[str, dict[str, tuple[Callable[[], Obj], int]]] = defaultdict(dict)
        self._watchers: dict[str, list[asyncio.Queue[bytes]]] = defaultdict(list)
        self.idle = asyncio.Event()  # set when every watcher has handled every event

    def _serialize(self, build: Callable[[], Obj], rv: int, name: str) -> str:
        t0 = time.process_time()
        obj = build()
        obj["metadata"].update(resourceVersion=str(rv), uid=f"uid-{name}")
        raw = json.dumps(obj)
        self.cpu_s += time.process_time() - t0
        return raw

    def put(self, path: str, name: str, build: Callable[[], Obj], etype: str) -> None:
        self.rv += 1
        self._items[path][name] = (build, self.rv)
        if self._watchers[path]:
            line = f'{{"type":"{etype}","object":{self._serialize(build, self.rv, name)}}}'
            for q in self._watchers[path]:
                q.put_nowait(line.encode())

    def backlog(self) -> int:
        return sum(q.qsize() for qs in self._watchers.values() for q in qs)

    async def list_pages(self, path: str, limit: int, **query: Any) -> AsyncIterator[Obj]:
        items = list(self._items[path].items())
        for start in range(0, max(1, len(items)), limit):
            page = items[start : start + limit]
            more = start + limit < len(items)
            meta = {"resourceVersion": str(self.rv), **({"continue": "c"} if more else {})}
            body = ",".join(self._serialize(b, rv, name) for name, (b, rv) in page)
            head = json.dumps({"kind": "List", "apiVersion": "v1", "metadata": meta})
            yield json.loads(f'{head[:-1]},"items":[{body}]}}'.encode())

    async def list(self, path: str, **query: Any) -> Obj:
        return {"items": []}

    async def watch(self, path: str, rv: str, **query: Any) -> AsyncIterator[tuple[str, Obj]]:
        q: asyncio.Queue[bytes] = asyncio.Queue()
        self._watchers[path].append(q)
        try:
            while True:
                event = json.loads(await q.get())  # as Kube.watch decodes a line
                yield event["type"], event["object"]
                if not self.backlog():  # the handler is done with it
                    self.idle.set()
        finally:
            self._watchers[path].remove(q)


async def _drain(api: _StandIn) -> None:
    """Until the informers have handled every event sent."""
    while api.backlog():
        api.idle.clear()
        await api.idle.wait()


def _publish(api: _StandIn, objs: _Objects, i: int, etype: str) -> None:
    """One node agent's start: MigNode created, then published; Node capacity; Lease."""
    name = f"gpu-{i}"
    if etype == "ADDED":
        api.put(MIG_NODES, name, lambda: objs.mig_node(i, published=False), "ADDED")
    api.put(MIG_NODES, name, lambda: objs.mig_node(i, published=True), etype)
    api.put(NODES, name, lambda: objs.node(i, published=True, beat=1), "MODIFIED")
    api.put(LEASES, name, lambda: objs.lease(i, renewed=0), etype)


async def _decide(state: Any, catalog: Any) -> int:
    """The leader's first decisions: one pod per profile and two multi-slice pods."""
    from common.placement import Placement, PodRequest, Policy, SliceRequest

    model = catalog.model(MODEL)
    asks: list[tuple[SliceRequest, ...]] = [(SliceRequest("c", p.name),) for p in model.profiles]
    asks += [
        (SliceRequest("c", "1g.10gb", 2),),
        (SliceRequest("a", "2g.20gb"), SliceRequest("b", "3g.40gb")),
    ]
    placed = 0
    for n, slices in enumerate(asks):
        got = state.decide(PodRequest(f"p{n}", 100, 1 << 20, slices), Policy.INSTASLICE, catalog)
        placed += isinstance(got, Placement)
    return placed


async def _child(order: str, nodes: int, trace: bool) -> Obj:
    from common.catalog import load_catalog
    from webhook.allocator.controller import Controller
    from webhook.allocator.leader import LeaderElector
    from webhook.allocator.metrics import AllocatorMetrics
    from webhook.allocator.settings import AllocatorSettings
    from webhook.offered import OfferedProfiles, watch_mig_nodes

    api, objs, catalog = _StandIn(), _Objects(), load_catalog()
    for i in range(nodes):
        api.put(NODES, f"gpu-{i}", partial(objs.node, i, published=False, beat=0), "ADDED")
    if order == "restart":
        for i in range(nodes):
            _publish(api, objs, i, "ADDED")
    settings = AllocatorSettings(namespace=NS, catalog=catalog)
    elector = LeaderElector(api, settings.lease(), settings.clock)  # type: ignore[arg-type]
    ctl = Controller(api, elector, AllocatorMetrics(), settings)  # type: ignore[arg-type]
    offered = OfferedProfiles(catalog.profile_names())
    gc.collect()
    if trace:
        tracemalloc.start()
    base = status_kib("VmRSS")
    cpu0, wall0 = time.process_time(), time.perf_counter()
    tasks = [
        asyncio.create_task(ctl.watch()),
        asyncio.create_task(watch_mig_nodes(api, offered)),  # type: ignore[arg-type]
    ]
    await ctl.synced()
    if order == "startup":
        for i in range(nodes):
            _publish(api, objs, i, "ADDED")
            if i % 20 == 19:  # the agents publish while the allocator consumes
                await _drain(api)
        await _drain(api)
        for i in range(nodes):  # KWOK's heartbeats, the agents' renewals
            api.put(NODES, f"gpu-{i}", partial(objs.node, i, published=True, beat=2), "MODIFIED")
            api.put(LEASES, f"gpu-{i}", partial(objs.lease, i, renewed=1), "MODIFIED")
            if i % 20 == 19:
                await _drain(api)
    await _drain(api)
    placed = await _decide(ctl.state, catalog)
    states = len(ctl.state.node_states())
    cpu1, wall1 = time.process_time(), time.perf_counter()
    gc.collect()
    after = status_kib("VmRSS")
    out: Obj = {
        "order": order,
        "nodes": nodes,
        "gpus": nodes * GPUS,
        "rss_before_mib": round(base / 1024, 1),
        "rss_after_mib": round(after / 1024, 1),
        "peak_rss_mib": round(status_kib("VmHWM") / 1024, 1),
        "kib_per_gpu": round((after - base) / (nodes * GPUS), 2),
        "cpu_s": round(cpu1 - cpu0 - api.cpu_s, 2),  # less the stand-in's own
        "wall_s": round(wall1 - wall0, 2),
        "node_states": states,
        "decisions_placed": placed,
        "profiles_offered": len(offered.cluster),
    }
    if trace:
        top = tracemalloc.take_snapshot().statistics("lineno")[:15]
        out["top_lines"] = [f"{s.traceback[0]}: {s.size / 2**20:.1f} MiB in {s.count}" for s in top]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return out


def measure(order: str, nodes: int, trace: bool = False) -> Obj:
    """One order and fleet size in a fresh interpreter (RSS never shrinks back)."""
    cmd = [sys.executable, "-m", "bench.fleet_memory", "--child", order, "--nodes", str(nodes)]
    cmd += ["--trace"] if trace else []
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=os.environ.copy())
    result: Obj = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet_memory", description=__doc__)
    parser.add_argument("--nodes", default="1000,2000,5000", help="fleet sizes (x 8 GPUs)")
    parser.add_argument("--orders", default=",".join(ORDERS), help="startup and/or restart")
    parser.add_argument("--trace", action="store_true", help="tracemalloc's top lines too")
    parser.add_argument("--out", type=Path, default=OUT, help="JSON to merge `fleet_memory` into")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        sizes = [int(n) for n in args.nodes.split(",") if n]
    except ValueError:
        parser.error(f"--nodes: expected sizes like 1000,2000, got {args.nodes!r}")
    if not sizes or min(sizes) < 1:
        parser.error(f"--nodes: expected sizes of at least 1, got {args.nodes!r}")
    orders = [o for o in args.orders.split(",") if o]
    if not orders or any(o not in ORDERS for o in orders):
        parser.error(f"--orders: expected startup and/or restart, got {args.orders!r}")
    if args.child:
        print(json.dumps(asyncio.run(_child(args.child, sizes[0], args.trace))))
        return 0
    entry: Obj = {
        "method": "bench.fleet_memory: the allocator's Controller and admission's MigNode "
        "informer in a fresh process, fed a KWOK fleet by a stand-in API server",
        "load_start": round(os.getloadavg()[0], 2),
        "runs": [],
    }
    for order in orders:
        for nodes in sizes:
            result = measure(order, nodes, args.trace)
            entry["runs"].append(result)
            print(json.dumps(result))
    entry["load_end"] = round(os.getloadavg()[0], 2)
    write_entry(args.out, "fleet_memory", entry)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
