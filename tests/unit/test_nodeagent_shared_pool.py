"""NodeGpus lanes: calls on one GPU never overlap and keep their order, even when a caller
is cancelled mid-call; calls on different GPUs, and different nodes sharing a pool, run in
parallel; a whole-node call runs alone. On a shared pool and on the node's own executor.

Covers `nodeagent.device.NodeGpus.call`/`call_gpu` only (no NVML: the calls are plain
functions).
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any, cast

import pytest

from common.catalog import load_catalog
from nodeagent.device import NodeGpus


class Probe:
    def __init__(self, meet: int = 0) -> None:
        """`meet`: calls wait (10 s at most) until that many are running at once, so a test
        proves parallelism without timing it: serialized calls break the barrier."""
        self.meet = threading.Barrier(meet, timeout=10) if meet else None
        self.lock = threading.Lock()
        self.running: dict[str, int] = {}
        self.overlap = False
        self.order: list[tuple[str, int]] = []

    def work(self, node: str, i: int, seconds: float) -> int:
        """One call in lane `node` (a node or a GPU); a whole-node call uses lane "*" and
        must not overlap any call."""
        with self.lock:
            self.running[node] = self.running.get(node, 0) + 1
            self.overlap |= self.running[node] > 1
            busy = sum(self.running.values())
            self.overlap |= busy > 1 and (node == "*" or self.running.get("*", 0) > 0)
            self.peak = max(getattr(self, "peak", 0), busy)
            self.order.append((node, i))
        if self.meet is not None:
            self.meet.wait()
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
    probe = Probe(meet=4)  # all four calls running at once, or BrokenBarrierError
    with ThreadPoolExecutor(max_workers=8) as pool:
        nodes = [gpus(f"n{i}", pool) for i in range(4)]
        await asyncio.gather(*(g.call(probe.work, g.node, 0, 0.05) for g in nodes))
    assert probe.peak == 4
    assert not probe.overlap


@pytest.mark.parametrize("shared", [True, False], ids=["shared-pool", "own-executor"])
async def test_gpus_of_one_node_run_in_parallel_each_in_order(shared: bool) -> None:
    # each round's four calls, one per GPU, must run at once (a lane adds one call at a time)
    probe = Probe(meet=4)
    nv = SimpleNamespace(nvmlInit=lambda: None, nvmlShutdown=lambda: None)
    with ThreadPoolExecutor(max_workers=8) as pool:
        node = NodeGpus(cast(Any, nv), load_catalog(), "a", pool=pool if shared else None)
        async with node as g:  # exit shuts the node's own executor down
            calls = [
                g.call_gpu(gpu, probe.work, f"gpu{gpu}", i, 0.02)
                for i in range(3)
                for gpu in range(4)
            ]
            got = await asyncio.gather(*calls)
    assert got == [i for i in range(3) for _ in range(4)]
    assert not probe.overlap, "two calls on one GPU overlapped"
    assert probe.peak == 4  # GPUs did not wait for each other
    for gpu in range(4):
        assert [i for lane, i in probe.order if lane == f"gpu{gpu}"] == [0, 1, 2]


async def test_a_whole_node_call_runs_alone() -> None:
    probe = Probe()
    with ThreadPoolExecutor(max_workers=8) as pool:
        g = gpus("a", pool)
        before = [
            asyncio.create_task(g.call_gpu(i, probe.work, f"gpu{i}", 0, 0.1)) for i in range(3)
        ]
        await asyncio.sleep(0.02)
        node = asyncio.create_task(g.call(probe.work, "*", 0, 0.1))
        await asyncio.sleep(0.02)
        after = [
            asyncio.create_task(g.call_gpu(i, probe.work, f"gpu{i}", 1, 0.05)) for i in range(3)
        ]
        await asyncio.gather(*before, node, *after)
    assert not probe.overlap, "a whole-node call overlapped a GPU call"
    star = probe.order.index(("*", 0))
    assert {lane for lane, i in probe.order[:star]} == {"gpu0", "gpu1", "gpu2"}
    assert all(i == 1 for _, i in probe.order[star + 1 :])


async def test_a_cancelled_gpu_caller_does_not_let_the_next_call_on_that_gpu_overlap() -> None:
    probe = Probe()
    with ThreadPoolExecutor(max_workers=8) as pool:
        g = gpus("a", pool)
        first = asyncio.create_task(g.call_gpu(0, probe.work, "gpu0", 0, 0.2))
        await asyncio.sleep(0.05)
        first.cancel()  # the call keeps running in its thread
        second = await g.call_gpu(0, probe.work, "gpu0", 1, 0.0)
        node = await g.call(probe.work, "*", 2, 0.0)
    assert (second, node) == (1, 2)
    assert first.cancelled()
    assert not probe.overlap
    assert probe.order == [("gpu0", 0), ("gpu0", 1), ("*", 2)]
