"""The allocator's clock for tests and benchmarks: time moves only when told (docs/style.md §8)."""

from __future__ import annotations

import asyncio
import datetime as dt
import heapq
import itertools


class FakeClock:
    """The allocator's `Clock` for tests: monotonic time moves only in `advance`, which
    wakes every `sleep` that falls due, in order."""

    def __init__(self) -> None:
        self.t = 1000.0
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def monotonic(self) -> float:
        return self.t

    def step(self, seconds: float) -> None:
        """A blocking sleep on this clock (the NVML emulator's `sleep`): time moves at once,
        and no `sleep` is woken (nothing async waits beside a blocking caller)."""
        self.t += seconds

    def wall(self) -> dt.datetime:
        return dt.datetime(2026, 1, 1, tzinfo=dt.UTC) + dt.timedelta(seconds=self.t)

    async def sleep(self, seconds: float) -> None:
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.t + seconds, next(self._seq), fut))
        await fut

    async def advance(self, seconds: float) -> None:
        target = self.t + seconds
        while True:
            await settle()
            if not self._sleepers or self._sleepers[0][0] > target:
                break
            deadline, _, fut = heapq.heappop(self._sleepers)
            self.t = max(self.t, deadline)
            if not fut.done():
                fut.set_result(None)
        self.t = target
        await settle()


async def settle() -> None:
    """Let every ready task run until it waits on something (a few loop turns)."""
    for _ in range(20):
        await asyncio.sleep(0)
