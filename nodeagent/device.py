"""One node's GPUs for asyncio code: NVML off the event loop, health events pushed in.

`NodeGpus` owns the node's `NvmlSession` and runs every NVML call off the loop. Calls on one
GPU (`call_gpu`) run one at a time and in order, a create's (`call_gpu_first`) ahead of the
rest (nodeagent/lane.py); calls on different GPUs run in parallel, as
NVML allows (it is thread-safe): with a node's calls in series, a 1000-pod burst at 600 ms
per slice (56 pods per packed node) spent 38 s at p50 in the agent, 12.5 s with the GPUs in
parallel (docs/benchmarks-history.md). A whole-node call (`call`: inventory, open, close)
runs alone. The
order holds even when a caller is cancelled: its call may still be running in its thread,
and the next call on that GPU waits for it. A real node has its own executor (a thread per
GPU at most). A process serving many emulated nodes passes one shared, bounded pool
instead: a thread per node (1000 of them) spent their time fighting over the GIL (load
average in the hundreds, no node started in minutes; docs/benchmarks-history.md). `HealthHub`
waits in nvmlEventSetWait on its own thread and hands each event to the loop with
`call_soon_threadsafe`; health is event-driven, the timeout only bounds how long shutdown
waits. `HealthHub` is that thread, shared by every node of the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import structlog

from common.catalog import Catalog
from nodeagent.lane import FIRST, NEXT, Lane
from nodeagent.model import HealthEvent, NvmlFailure
from nodeagent.nvml import EventWatcher, NvmlModule, NvmlSession

P = ParamSpec("P")
T = TypeVar("T")
log = structlog.get_logger("device")
OWN_POOL_THREADS = 8  # a node's own executor: one thread per GPU of an 8-GPU node


class NodeGpus:
    """`async with NodeGpus(nv, catalog, node) as gpus: await gpus.call(gpus.s.inventory)`;
    `await gpus.call_gpu(index, gpus.s.create_gi, index, ...)` for one GPU's work."""

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
        self._pool = pool or ThreadPoolExecutor(
            max_workers=OWN_POOL_THREADS, thread_name_prefix=f"nvml-{node}"
        )
        self._node = asyncio.Lock()  # held by a whole-node call, briefly by a GPU call's start
        self._gpu: defaultdict[int, Lane] = defaultdict(Lane)  # creates first, then FIFO
        self._last: dict[int | None, asyncio.Future[Any]] = {}  # latest call per GPU / node
        self._running: set[asyncio.Future[Any]] = set()

    async def call(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """A whole-node call: starts once every call in flight has ended, runs alone."""
        async with self._node:
            await _finished(self._running)
            fut = self._start(None, functools.partial(fn, *args, **kwargs))
            return await asyncio.shield(fut)

    async def call_gpu(
        self, index: int, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """A call on GPU `index`: after that GPU's previous call, beside other GPUs' calls."""
        return await self._on_gpu(index, NEXT, functools.partial(fn, *args, **kwargs))

    async def call_gpu_first(
        self, index: int, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """A create's call on GPU `index`: as `call_gpu`, but ahead of the calls that are not
        a create's and wait on that GPU (nodeagent/lane.py)."""
        return await self._on_gpu(index, FIRST, functools.partial(fn, *args, **kwargs))

    def waiting(self, index: int) -> int:
        """Calls waiting for GPU `index`'s lane (not the one running): for tests and logs."""
        lane = self._gpu.get(index)
        return lane.waiting if lane is not None else 0

    async def _on_gpu(self, index: int, rank: int, fn: Callable[[], T]) -> T:
        async with self._gpu[index].hold(rank):
            await _finished([self._last.get(index)])
            async with self._node:  # not while a whole-node call runs
                await _finished([self._last.get(None)])
                fut = self._start(index, fn)
            return await asyncio.shield(fut)

    def _start(self, lane: int | None, fn: Callable[[], T]) -> asyncio.Future[T]:
        fut = asyncio.get_running_loop().run_in_executor(self._pool, fn)
        self._last[lane] = fut
        self._running.add(fut)
        fut.add_done_callback(self._running.discard)
        fut.add_done_callback(_consume)
        return fut

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
            await _finished(self._running)
            if self._own_pool:
                await asyncio.to_thread(self._pool.shutdown, wait=True)

    def event_session(self) -> NvmlSession:
        """A second session for the health thread (NVML init is reference-counted)."""
        return NvmlSession(self.nv, self._catalog)


async def _finished(futures: Iterable[asyncio.Future[Any] | None]) -> None:
    """Wait until these executor calls have ended (a cancelled caller's may still run)."""
    running = {f for f in futures if f is not None and not f.done()}
    if running:
        await asyncio.wait(running)


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
