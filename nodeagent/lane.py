"""One GPU's NVML lane: a lock whose waiters go by rank, then in the order they came.

A create's calls rank before everything else queued on the GPU (a release's destroys, scans
for garbage collection or verification): a pod waits for its create, nobody waits for a
release but the allocator's next placement on those slots, and it cannot place there until
the release is done and its allocation gone (docs/allocator.md). A call that runs is never
cut short; a create waits at most for the call running when it asks. Within a rank the order
is first come, first served, so a release still goes in the order it was asked for.

What it does not do: know what a call touches. A create whose slots a release still holds
must wait for that release itself, before it asks the lane (`create.wait_for_releases`);
ranked ahead of the release here it would find the slots taken. Releases are not starved by
creates: a GPU takes only as many creates as it has free slots, and slots are freed only by
the releases behind them.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import AsyncIterator

FIRST = 0  # a create's calls
NEXT = 1  # every other call


class Lane:
    """`async with lane.hold(FIRST): ...`: one holder at a time; on release the lane goes
    to the waiter of lowest rank that came first."""

    def __init__(self) -> None:
        self._held = False
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []  # a heap
        self._seq = itertools.count()

    @property
    def waiting(self) -> int:
        return sum(1 for _, _, f in self._waiters if not f.done())

    @contextlib.asynccontextmanager
    async def hold(self, rank: int = NEXT) -> AsyncIterator[None]:
        await self._acquire(rank)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, rank: int) -> None:
        if not self._held:  # nobody waits on a lane nobody holds
            self._held = True
            return
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (rank, next(self._seq), fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # handed the lane, then cancelled
                self._release()
            raise

    def _release(self) -> None:
        """Hand the lane to the next waiter still waiting (it stays held), or free it."""
        while self._waiters:
            _, _, fut = heapq.heappop(self._waiters)
            if not fut.done():  # a cancelled waiter's future is done
                fut.set_result(None)
                return
        self._held = False
