"""The central allocator: places gated pods' MIG slices and pins them (docs/allocator.md).

`run_allocator(kube, settings, metrics)` runs forever in the webhook process: its informers
keep a warm cache on every replica; only the holder of the `instaslice-allocator` Lease acts.
Layers, outermost first: this entry point (leadership terms) → `controller` (informers,
reconciler, placer, timer) → `writes` (every API write, Lease-checked) and `leader` →
`state`, `queue`, `pods` (pure) and the placement engine (`common.placement`, pure).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from common.kubeapi import Kube
from webhook.allocator.controller import Controller
from webhook.allocator.leader import LeaderElector, LeadershipLost
from webhook.allocator.metrics import AllocatorMetrics
from webhook.allocator.settings import AllocatorSettings, default_identity

__all__ = [
    "AllocatorMetrics",
    "AllocatorSettings",
    "Controller",
    "build_controller",
    "default_identity",
    "run_allocator",
    "run_controller",
]

log = structlog.get_logger("allocator")


def build_controller(
    kube: Kube,
    settings: AllocatorSettings,
    metrics: AllocatorMetrics | None = None,
    *,
    lease_kube: Kube | None = None,
) -> Controller:
    elector = LeaderElector(lease_kube or kube, settings.lease(), settings.clock)
    return Controller(kube, elector, metrics or AllocatorMetrics(), settings)


async def run_allocator(
    kube: Kube,
    settings: AllocatorSettings,
    metrics: AllocatorMetrics | None = None,
    on_synced: Callable[[], None] = lambda: None,
) -> None:
    """Watch, and act while holding the Lease; runs until cancelled.

    The Lease is renewed over its own connection pool: in a burst hundreds of creates,
    pins and events queue on the main pool, and a renewal waiting behind them missed its
    deadline (measured: leadership lost 6 times during a 1000-pod burst,
    docs/benchmarks-history.md).
    """
    async with kube.sibling() as lease_kube:
        controller = build_controller(kube, settings, metrics, lease_kube=lease_kube)
        await run_controller(controller, settings, on_synced)


async def run_controller(
    controller: Controller,
    settings: AllocatorSettings,
    on_synced: Callable[[], None] = lambda: None,
) -> None:
    """`run_allocator` for a controller built by the caller (tests inspect its state).

    A term that fails (a bug, an API error while starting to lead) is logged, the Lease is
    handed back so another replica can lead, and this replica stands again after a pause:
    the allocator shares its process with admission, which must not go down with it.
    """
    elector = controller.elector
    async with asyncio.TaskGroup() as tg:
        tg.create_task(controller.watch(), name="informers")
        await controller.synced()  # rebuild from the cluster before ever acting
        on_synced()
        try:
            while True:
                await elector.acquire()
                try:
                    async with asyncio.TaskGroup() as term:
                        term.create_task(elector.hold(), name="lease")
                        term.create_task(controller.lead(), name="lead")
                except* LeadershipLost:
                    log.warning("stepped down", identity=settings.identity)
                except* Exception as failed:
                    log.error(
                        "allocator term failed; handing the Lease back",
                        identity=settings.identity,
                        exc_info=failed,
                    )
                    await elector.release()
                    await settings.clock.sleep(settings.lease_duration_s)
        finally:
            controller.close()
            if settings.release_on_exit:
                await elector.release()
