"""One node's GPUs for asyncio code: NVML off the event loop, health events pushed in.

`NodeGpus` owns the node's `NvmlSession`; every NVML call of the node runs off the loop, one
at a time and in order (calls on one device stay serialized; different nodes of one process
run in parallel). A real node has its own single-thread executor. A process serving many
emulated nodes passes one shared, bounded pool instead: a thread per node (1000 of them)
spent their time fighting over the GIL (load average in the hundreds, no node started in
minutes; docs/benchmarks.md), so there the order per node is kept by chaining each call
after the node's previous one, which a cancelled caller cannot break. `HealthHub` waits in
nvmlEventSetWait on its own thread and hands each event to the loop with
`call_soon_threadsafe`; health is event-driven, the timeout only bounds how long shutdown
waits. `HealthHub` is that thread, shared by every node of the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import structlog

from common.catalog import Catalog
from nodeagent.model import HealthEvent, NvmlFailure
from nodeagent.nvml import EventWatcher, NvmlModule, NvmlSession

P = ParamSpec("P")
T = TypeVar("T")
log = structlog.get_logger("device")


class NodeGpus:
    """`async with NodeGpus(nv, catalog, node) as gpus: await gpus.call(gpus.s.inventory)`."""

    def __init__(
        self,
        nv: NvmlModule,
        catalog: Catalog,
        node: str,
        *,
        pool: ThreadPoolExecutor | None = None,
    ) -> None:
        self.nv = nv
        self.node = node
        self.s = NvmlSession(nv, catalog)
        self._catalog = catalog
        self._own_pool = pool is None
        self._pool = pool or ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"nvml-{node}")
        self._serial = asyncio.Lock()  # shared pool: one call of this node at a time, FIFO
        self._last: asyncio.Future[Any] | None = None  # the node's latest call

    async def call(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        loop = asyncio.get_running_loop()
        if self._own_pool:  # one thread: the executor itself keeps the order
            return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))
        async with self._serial:
            last = self._last
            if last is not None and not last.done():
                await asyncio.wait({last})  # a cancelled caller's call may still be running
            fut = loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))
            self._last = fut
            fut.add_done_callback(_consume)
            return await asyncio.shield(fut)

    async def __aenter__(self) -> NodeGpus:
        await self.call(self.s.open)
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await asyncio.shield(self.call(self.s.close))
        except NvmlFailure as e:
            log.warning("nvml shutdown failed", node=self.node, error=str(e))
        finally:
            # waits for a call still running (a create must not be cut in half by exit)
            if self._own_pool:
                await asyncio.to_thread(self._pool.shutdown, wait=True)
            elif self._last is not None and not self._last.done():
                await asyncio.wait({self._last})

    def event_session(self) -> NvmlSession:
        """A second session for the health thread (NVML init is reference-counted)."""
        return NvmlSession(self.nv, self._catalog)


def _consume(fut: asyncio.Future[Any]) -> None:
    """Retrieve the outcome of a call whose caller was cancelled (no 'never retrieved')."""
    if not fut.cancelled():
        fut.exception()


@dataclass
class _Watch:
    name: str
    session: NvmlSession
    indexes: list[int]
    sink: Callable[[HealthEvent], None]
    loop: asyncio.AbstractEventLoop
    watcher: EventWatcher | None = None


class HealthHub:
    """One thread waiting for the NVML events of every node in the process.

    With one node it blocks in nvmlEventSetWait (`timeout_ms` only bounds shutdown); with
    many emulated nodes it asks each node's event set without blocking, once per
    `round_s`, so hundreds of nodes cost one thread. Sinks run on their loop's thread.
    """

    def __init__(self, timeout_ms: int = 500, round_s: float = 0.25) -> None:
        self._timeout_ms = timeout_ms
        self._round_s = round_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._new: list[_Watch] = []
        self._gone: set[str] = set()
        self._thread: threading.Thread | None = None

    def add(
        self,
        name: str,
        session: NvmlSession,
        indexes: list[int],
        sink: Callable[[HealthEvent], None],
    ) -> None:
        with self._lock:
            self._gone.discard(name)
            self._new.append(_Watch(name, session, indexes, sink, asyncio.get_running_loop()))
        if self._thread is None:
            self._thread = threading.Thread(target=self._main, name="nvml-health", daemon=True)
            self._thread.start()

    def remove(self, name: str) -> None:
        with self._lock:
            self._gone.add(name)

    @staticmethod
    def _push(w: _Watch, ev: HealthEvent) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed during shutdown
            w.loop.call_soon_threadsafe(w.sink, ev)

    def _open(self, w: _Watch) -> bool:
        try:
            w.session.open()
            w.watcher = EventWatcher(w.session, w.indexes)
            for ev in w.watcher.open():
                self._push(w, ev)
        except NvmlFailure as e:
            log.error("health events unavailable", node=w.name, error=str(e))
            return False
        return True

    @staticmethod
    def _close(w: _Watch) -> None:
        try:
            if w.watcher is not None:
                w.watcher.close()
            w.session.close()
        except NvmlFailure:
            pass

    def _poll(self, w: _Watch, timeout_ms: int) -> None:
        assert w.watcher is not None
        while True:
            ev = w.watcher.wait(timeout_ms)
            if ev is None:
                return
            if ev.gpu_index < 0:  # GPU_IS_LOST without a device: find which
                for i in w.watcher.probe_lost():
                    self._push(w, HealthEvent(gpu_index=i, kind="lost"))
            else:
                self._push(w, ev)
            timeout_ms = 0  # drain what is queued, then move on

    def _main(self) -> None:
        watches: list[_Watch] = []
        try:
            while not self._stop.is_set():
                with self._lock:
                    new, self._new = self._new, []
                    gone, self._gone = self._gone, set()
                for w in [w for w in watches if w.name in gone]:
                    self._close(w)
                watches = [w for w in watches if w.name not in gone]
                watches += [w for w in new if w.name not in gone and self._open(w)]
                if not watches:
                    self._stop.wait(0.05)
                    continue
                single = len(watches) == 1
                for w in watches:
                    try:
                        self._poll(w, self._timeout_ms if single else 0)
                    except NvmlFailure as e:
                        log.error("health event wait failed", node=w.name, error=str(e))
                if not single:
                    self._stop.wait(self._round_s)
        finally:
            for w in watches:
                self._close(w)

    async def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)
