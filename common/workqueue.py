"""Per-object serialized work (docs/style.md §4): one worker per key, different keys in parallel.

`kick(key)` makes sure `worker(key)` runs again after the latest kick; kicks that arrive
while the worker runs coalesce into one more pass. The worker returns None when done or a
delay in seconds to be retried after (a kick wakes it earlier). Worker tasks live in the
TaskGroup given to `start`, so they end with it; kicks before `start` are kept, and
`stop` forgets the group (the allocator's term ended: its workers were cancelled with it).
A worker that raises is logged and retried after CRASH_RETRY_S; it never kills the group.
Retry delays run on the injected clock (common.clock), so tests advance them by hand.

Used by the node agent (per allocation), the allocator (per pod) and the namespace mirror.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from common.clock import Clock, SystemClock, wait_or_sleep

Worker = Callable[[str], Awaitable[float | None]]
log = structlog.get_logger("workqueue")
CRASH_RETRY_S = 5.0


class KeyedQueue:
    def __init__(self, worker: Worker, name: str = "queue", clock: Clock | None = None) -> None:
        self._worker = worker
        self._name = name
        self._clock = clock or SystemClock()
        self._tg: asyncio.TaskGroup | None = None
        self._wake: dict[str, asyncio.Event] = {}
        self._pending: list[str] = []

    def start(self, tg: asyncio.TaskGroup) -> None:
        self._tg = tg
        pending, self._pending = self._pending, []
        for key in dict.fromkeys(pending):
            self.kick(key)

    def stop(self) -> None:
        """Forget the task group (its tasks end with it); later kicks wait for `start`."""
        self._tg = None

    @property
    def active(self) -> int:
        return len(self._wake)

    @property
    def pending(self) -> list[str]:
        """Keys kicked before `start`, in order (each once)."""
        return list(dict.fromkeys(self._pending))

    def kick(self, key: str) -> None:
        wake = self._wake.get(key)
        if wake is not None:
            wake.set()
            return
        if self._tg is None:
            self._pending.append(key)
            return
        wake = self._wake[key] = asyncio.Event()
        wake.set()
        run = self._run(key, wake)
        try:
            task = self._tg.create_task(run, name=f"{self._name}:{key}")
        except RuntimeError:  # the group is shutting down: the work waits for the next start
            run.close()
            self._wake.pop(key, None)
            return
        # also here: a task cancelled before its first step never runs _run's finally
        task.add_done_callback(lambda _: self._forget(key, wake))

    def _forget(self, key: str, wake: asyncio.Event) -> None:
        if self._wake.get(key) is wake:
            del self._wake[key]

    async def _run(self, key: str, wake: asyncio.Event) -> None:
        try:
            while wake.is_set():
                wake.clear()
                try:
                    delay = await self._worker(key)
                except Exception:  # a bug in one object's handling must not stop the others
                    log.exception("worker failed", queue=self._name, key=key)
                    delay = CRASH_RETRY_S
                if delay is not None and not wake.is_set():
                    await wait_or_sleep(self._clock, wake, delay)
                    wake.set()  # retry (timed out) or re-run (kicked)
        finally:
            self._forget(key, wake)  # at once, so a kick right after starts a new task
