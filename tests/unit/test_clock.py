"""common.clock's waiting helpers: a cancellation of the caller always ends the wait."""

from __future__ import annotations

import asyncio

import pytest

from common.clock import SystemClock, wait_or_sleep


@pytest.mark.parametrize("steps", range(6))
async def test_a_cancellation_that_lands_as_the_event_fires_is_not_swallowed(steps: int) -> None:
    """The event fires, then the caller is cancelled `steps` loop turns later: while the
    wait tidies up its helper tasks too. A swallowed cancellation left a KeyedQueue worker
    running after its TaskGroup was cancelled, and the allocator's shutdown hung (CI)."""
    event = asyncio.Event()
    task = asyncio.create_task(wait_or_sleep(SystemClock(), event, 60.0))
    await asyncio.sleep(0)  # the wait has begun
    event.set()
    for _ in range(steps):
        await asyncio.sleep(0)
    if task.done():  # returned before the cancellation: nothing to check at this step
        assert task.result() is None
        return
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_the_event_or_the_time_ends_the_wait() -> None:
    event = asyncio.Event()
    await wait_or_sleep(SystemClock(), event, 0.01)  # the time
    assert not event.is_set()
    event.set()
    async with asyncio.timeout(5):
        await wait_or_sleep(SystemClock(), event, 60.0)  # the event
