"""Time, injected (docs/style.md §8), and the two Kubernetes timestamp formats.

Two clocks matter: a monotonic one for every duration a component measures (lease expiry,
the pinned-unschedulable timeout, latency metrics) and the wall clock for what goes on the
wire (Lease `renewTime`, event timestamps). Tests pass a fake whose `sleep` only returns when
the test advances time, so timeouts are exercised without waiting for them.

On the wire Kubernetes has two formats, written only here: `Time` (RFC 3339 to the second:
`kube_time`) and `MicroTime` (with microseconds: `micro_time`), both UTC with a `Z`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Coroutine
from typing import Any, Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def wall(self) -> dt.datetime: ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The real clocks: `time.monotonic`, UTC wall time, `asyncio.sleep`."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> dt.datetime:
        return dt.datetime.now(dt.UTC)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


async def wait_or_sleep(clock: Clock, event: asyncio.Event, seconds: float | None) -> None:
    """Return when `event` is set or `seconds` of `clock` time have passed (None: no limit).

    The event is not cleared here: the caller decides what being woken means.
    """
    if seconds is None:
        await event.wait()
        return
    waiter = asyncio.ensure_future(event.wait())
    sleeper = asyncio.ensure_future(clock.sleep(seconds))
    try:
        await asyncio.wait((waiter, sleeper), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (waiter, sleeper):
            task.cancel()
        # asyncio.wait, not `await task` under suppress(CancelledError): that also swallowed
        # a cancellation of the caller landing here, and a cancelled worker ran on
        await asyncio.wait((waiter, sleeper))


async def cancel_until_done(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel `tasks` until every one has finished.

    Not a TaskGroup, on purpose: in Python 3.11 `asyncio.wait_for` (in libraries under
    ours) swallows a cancellation that arrives just as the awaited thing completes (CPython
    gh-86296, fixed in 3.12), and a TaskGroup would then wait forever for a task that
    keeps going. Cancelled again every second, such a task ends.
    """
    while pending := [t for t in tasks if not t.done()]:
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=1.0)


async def stoppable(coro: Coroutine[Any, Any, None], name: str) -> None:
    """Run `coro` as a task that surely ends when this one is cancelled (gh-86296, as in
    `cancel_until_done`): a TaskGroup's shutdown would otherwise wait for it forever."""
    task = asyncio.create_task(coro, name=name)
    try:
        await asyncio.wait({task})
        task.result()
    finally:
        await cancel_until_done([task])


def monotonic_at(clock: Clock, stamp: str | None) -> float:
    """A wall-clock Kubernetes time (a creation or renewal time) on `clock`'s monotonic
    scale: for objects found by an initial list, whose changes nobody saw happen. Now when
    the stamp is absent, unreadable or in the future."""
    now = clock.monotonic()
    when = parse_time(stamp)
    if when is None:
        return now
    return now - max(0.0, (clock.wall() - when).total_seconds())


def kube_time(moment: dt.datetime | None = None) -> str:
    """Kubernetes Time: RFC 3339 to the second, always UTC (`...Z`); now by default."""
    return (moment or dt.datetime.now(dt.UTC)).astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_time(moment: dt.datetime) -> str:
    """Kubernetes MicroTime: RFC 3339 with microseconds, always UTC (`...000000Z`)."""
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(stamp: str | None) -> dt.datetime | None:
    """A Kubernetes Time/MicroTime string as an aware datetime; None when absent or bad."""
    if not stamp:
        return None
    try:
        return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return None
