"""NodeGpus on a pool shared by many nodes: calls of one node never overlap and keep their
order, even when a caller is cancelled mid-call; different nodes do run in parallel.

Covers `nodeagent.device.NodeGpus.call` only (no NVML: the calls are plain functions).
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from common.catalog import load_catalog
from nodeagent.device import NodeGpus


class Probe:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running: dict[str, int] = {}
        self.overlap = False
        self.order: list[tuple[str, int]] = []

    def work(self, node: str, i: int, seconds: float) -> int:
        with self.lock:
            self.running[node] = self.running.get(node, 0) + 1
            self.overlap |= self.running[node] > 1
            self.order.append((node, i))
        time.sleep(seconds)
        with self.lock:
            self.running[node] -= 1
        return i


def gpus(node: str, pool: ThreadPoolExecutor) -> NodeGpus:
    nv: Any = object()
    return NodeGpus(nv, load_catalog(), node, pool=pool)


async def test_calls_of_one_node_are_serialized_in_order() -> None:
    probe = Probe()
    with ThreadPoolExecutor(max_workers=8) as pool:
        g = gpus("a", pool)
        got = await asyncio.gather(*(g.call(probe.work, "a", i, 0.005) for i in range(10)))
    assert got == list(range(10))
    assert [i for _, i in probe.order] == list(range(10))
    assert not probe.overlap


async def test_a_cancelled_caller_does_not_let_the_next_call_overlap() -> None:
    probe = Probe()
    with ThreadPoolExecutor(max_workers=8) as pool:
        g = gpus("a", pool)
        first = asyncio.create_task(g.call(probe.work, "a", 0, 0.2))
        await asyncio.sleep(0.05)
        first.cancel()  # the call keeps running in its thread
        second = await g.call(probe.work, "a", 1, 0.0)
    assert second == 1
    assert first.cancelled()
    assert not probe.overlap
    assert probe.order == [("a", 0), ("a", 1)]


async def test_nodes_sharing_a_pool_run_in_parallel() -> None:
    probe = Probe()
    with ThreadPoolExecutor(max_workers=8) as pool:
        nodes = [gpus(f"n{i}", pool) for i in range(4)]
        t0 = time.monotonic()
        await asyncio.gather(*(g.call(probe.work, g.node, 0, 0.2) for g in nodes))
        elapsed = time.monotonic() - t0
    assert elapsed < 0.2 * 4  # not one after another
    assert not probe.overlap
