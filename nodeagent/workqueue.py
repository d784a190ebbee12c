"""Per-object serialized work (STYLE.md §4): one worker per key, different keys in parallel.

`kick(key)` makes sure `worker(key)` runs again after the latest kick; kicks that arrive
while the worker runs coalesce into one more pass. The worker returns None when done or a
delay in seconds to be retried after (a kick wakes it earlier). Worker tasks live in the
TaskGroup given to `start`, so they end with the agent; kicks before `start` are kept.
A worker that raises is logged and retried after CRASH_RETRY_S; it never kills the group.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import structlog

Worker = Callable[[str], Awaitable[float | None]]
log = structlog.get_logger("workqueue")
CRASH_RETRY_S = 5.0


class KeyedQueue:
    def __init__(self, worker: Worker, name: str = "queue") -> None:
        self._worker = worker
        self._name = name
        self._tg: asyncio.TaskGroup | None = None
        self._wake: dict[str, asyncio.Event] = {}
        self._pending: list[str] = []

    def start(self, tg: asyncio.TaskGroup) -> None:
        self._tg = tg
        pending, self._pending = self._pending, []
        for key in dict.fromkeys(pending):
            self.kick(key)

    @property
    def active(self) -> int:
        return len(self._wake)

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
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(delay):  # not wait_for: gh-86296
                            await wake.wait()
                    wake.set()  # retry (timed out) or re-run (kicked)
        finally:
            self._forget(key, wake)  # at once, so a kick right after starts a new task
