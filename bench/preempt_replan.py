"""What a parked preemptor costs the allocator each time capacity may have grown.

The pathological case of preemption planning (docs/security.md, finding 7): a pod asking
many slices of one node (`--slices`, 49 x 1g.10gb: seven of a node's eight H100s) on a
fleet of `--nodes` nodes x 8 H100-80GB, every GPU holding seven 1g.10gb pods, one of them
of the preemptor's priority or higher. No node can free 49 slots, so no plan exists and the
search runs to its budget (`SEARCH_BUDGET`) before saying so; the pod is parked. Then
`--deletions` pods that hold no slices (a CPU pod bound on one of the nodes) are deleted one
after another: each moves the model's capacity epoch, which retries every parked pod.

It drives the allocator's own loop (`Controller`: the pod handler, the per-pod worker, the
placer and its preemption planning) with events fed by hand, as the unit tests do, against
a stand-in API that only takes the `AllocationPending` event. Printed: the CPU of the first
pass (placement and the plan that finds nothing), the CPU per unrelated deletion (the
handler, the retry, placement, and whatever planning runs again) and how many plans ran.

    python -m bench.preempt_replan [--nodes 100] [--slices 49] [--deletions 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, cast
from unittest import mock

from common.clock import cancel_until_done
from common.kubeapi import Kube
from common.objects import Phase
from common.placement import preempt
from testkit.builders import make_allocation, make_mig_node, make_node, make_pod
from testkit.clock import FakeClock
from webhook.allocator.controller import Controller
from webhook.allocator.leader import LeaderElector
from webhook.allocator.metrics import AllocatorMetrics
from webhook.allocator.settings import AllocatorSettings

Obj = dict[str, Any]
MODEL = "H100-80GB"
GPUS = 8
PREEMPTOR_PRIORITY = 50


class _EventSink:
    """The API as the allocator meets it here: it only writes the pod's events."""

    def __init__(self) -> None:
        self.events = 0

    async def create(self, path: str, body: Obj, **query: Any) -> Obj:
        assert path.endswith("/events"), f"unexpected create: {path}"
        self.events += 1
        return body


class _Leader:
    is_leader = True

    def check(self) -> None:
        pass


def _fleet(c: Controller, nodes: int) -> list[Obj]:
    """The fleet, full: per GPU seven 1g.10gb holders, the one at slot 0 of the preemptor's
    priority (never a victim). Returns one CPU-only pod per node, bound there."""
    unrelated = []
    for i in range(nodes):
        node = f"n{i:03d}"
        c.state.upsert_node(make_node(node, cpu="256", memory="2Ti", pods=250, gpus=GPUS))
        c.state.upsert_mig_node(make_mig_node(node, [MODEL] * GPUS))
        for g in range(GPUS):
            for s in range(7):
                name = f"{node}-g{g}-s{s}"
                prio = PREEMPTOR_PRIORITY if s == 0 else 0
                pod = make_pod(name, uid=name, priority=prio, gates=(), node_name=node,
                               phase="Running", cpu="1", memory="1Gi")  # fmt: skip
                c.state.upsert_pod(pod)
                alloc = make_allocation(
                    pod, node, [("main", "1g.10gb", g, s, 1)], phase=Phase.READY
                )
                c.state.upsert_allocation(alloc)
        web = make_pod(f"web-{node}", uid=f"web-{node}", slices={}, claim=None, gates=(),
                       node_name=node, phase="Running", cpu="2", memory="4Gi")  # fmt: skip
        c.state.upsert_pod(web)
        unrelated.append(web)
    return unrelated


def _counting(plans: list[int]) -> Callable[..., Any]:
    """The planner, counting its calls."""
    real = preempt.plan_preemption

    def plan(*args: Any, **kwargs: Any) -> Any:
        plans[0] += 1
        return real(*args, **kwargs)

    return plan


async def measure(nodes: int = 100, slices: int = 49, deletions: int = 20) -> dict[str, Any]:
    plans = [0]
    with mock.patch("webhook.allocator.planning.plan_preemption", _counting(plans)):
        out = await _measure(nodes, slices, deletions)
    return {**out, "plans": plans[0]}


async def _pass(event: Coroutine[Any, Any, None], parked: asyncio.Event) -> float:
    """CPU seconds from feeding `event` until the pod is parked again."""
    parked.clear()
    t0 = time.process_time()
    await event
    await parked.wait()
    return time.process_time() - t0


async def _measure(nodes: int, slices: int, deletions: int) -> dict[str, Any]:
    clock = FakeClock()
    settings = AllocatorSettings(
        namespace="instaslice-system", identity="bench", clock=clock, preemption=True
    )
    sink = _EventSink()
    c = Controller(cast(Kube, sink), cast(LeaderElector, _Leader()), AllocatorMetrics(), settings)
    c.opted_in.add("ns")
    unrelated = _fleet(c, nodes)[:deletions]
    big = make_pod("big", uid="big", priority=PREEMPTOR_PRIORITY,
                   slices={"main": {"1g.10gb": slices}}, cpu="1", memory="1Gi")  # fmt: skip
    parked = asyncio.Event()  # the placer looked at the pod and parked it (again)
    park = c.placer.park

    def parking(pod: Any, reason: str, message: str) -> None:
        park(pod, reason, message)
        parked.set()

    term = asyncio.create_task(c.term(revisit=False))
    try:
        await asyncio.sleep(0)
        with mock.patch.object(c.placer, "park", parking):
            first = await _pass(c.handlers.on_pod("ADDED", big), parked)
            per = [await _pass(c.handlers.on_pod("DELETED", pod), parked) for pod in unrelated]
        track = c.tracks.get("big")
        assert track is not None and track.preempt is None, "the pod found a plan"
    finally:
        await cancel_until_done([term])
    return {
        "fleet": f"{nodes} nodes x {GPUS} {MODEL}, every GPU 7 x 1g.10gb (one never a victim)",
        "ask": f"{slices} x 1g.10gb",
        "deletions": len(per),
        "first_pass_cpu_ms": round(first * 1e3, 1),
        "per_deletion_cpu_ms_mean": round(sum(per) / len(per) * 1e3, 2) if per else None,
        "per_deletion_cpu_ms_max": round(max(per) * 1e3, 2) if per else None,
        "decisions": c.metrics.count("pending"),
        "events": sink.events,
    }


def main(argv: Sequence[str] | None = None) -> int:
    raw = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser(
        "python -m bench.preempt_replan", None, __doc__, formatter_class=raw
    )
    ap.add_argument("--nodes", type=int, default=100, help="fleet size (8 H100 each)")
    ap.add_argument("--slices", type=int, default=49, help="the parked pod's 1g.10gb count")
    ap.add_argument("--deletions", type=int, default=20, help="unrelated pods deleted")
    args = ap.parse_args(argv)
    print(json.dumps(asyncio.run(measure(args.nodes, args.slices, args.deletions))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
