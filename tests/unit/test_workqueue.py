"""KeyedQueue (common.workqueue): one worker per key, coalesced kicks, retries with a
delay that a kick cuts short, crash isolation, kicks before start and after shutdown."""

from __future__ import annotations

import asyncio

import pytest

from common import workqueue
from common.workqueue import KeyedQueue


async def test_serializes_per_key_and_coalesces_kicks() -> None:
    running: dict[str, int] = {}
    calls: list[str] = []
    gate = asyncio.Event()

    async def worker(key: str) -> float | None:
        running[key] = running.get(key, 0) + 1
        assert running[key] == 1  # never two passes of one key at once
        calls.append(key)
        if key == "a" and calls.count("a") == 1:
            await gate.wait()
        running[key] -= 1
        return None

    q = KeyedQueue(worker)
    q.kick("a")  # before start: kept
    async with asyncio.TaskGroup() as tg:
        q.start(tg)
        await asyncio.sleep(0)
        q.kick("a")
        q.kick("a")  # both coalesce into one more pass
        q.kick("b")
        await asyncio.sleep(0.01)
        assert calls == ["a", "b"]
        gate.set()
    assert calls == ["a", "b", "a"] and q.active == 0


async def test_retry_after_delay_and_kick_cuts_it_short() -> None:
    calls: list[float] = []
    loop = asyncio.get_running_loop()

    async def worker(key: str) -> float | None:
        calls.append(loop.time())
        return 0.05 if len(calls) < 3 else None

    q = KeyedQueue(worker)
    async with asyncio.TaskGroup() as tg:
        q.start(tg)
        q.kick("k")
        await asyncio.sleep(0.01)
        q.kick("k")  # wakes the first retry early
    assert len(calls) == 3
    assert calls[1] - calls[0] < 0.04 and calls[2] - calls[1] >= 0.045


async def test_a_crashing_worker_is_retried_not_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workqueue, "CRASH_RETRY_S", 0.01)
    calls = 0

    async def worker(key: str) -> float | None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise KeyError("bug")
        return None

    q = KeyedQueue(worker)
    async with asyncio.TaskGroup() as tg:
        q.start(tg)
        q.kick("k")
    assert calls == 2


async def test_kick_during_shutdown_is_dropped_cleanly() -> None:
    async def worker(key: str) -> float | None:
        return None

    q = KeyedQueue(worker)
    with pytest.raises(ExceptionGroup):
        async with asyncio.TaskGroup() as tg:
            q.start(tg)

            async def boom() -> None:
                raise ValueError("stop")

            tg.create_task(boom())
            await asyncio.sleep(0)
            q.kick("late")  # the group is aborting: no task, no "never awaited" warning
    assert q.active == 0
