"""The central allocator: places gated pods' MIG slices and pins them (docs/allocator.md).

`run_allocator(kube, settings, metrics)` runs forever in the webhook process: its informers
keep a warm cache on every replica; only the holder of the `instaslice-allocator` Lease acts.
Layers, outermost first: this entry point (leadership terms) → `controller` (informers,
reconciler, placer, timer) → `writes` (every API write, Lease-checked) and `leader` →
`state`, `queue`, `pods` (pure) and the placement engine (`common.placement`, pure).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
from dataclasses import dataclass, field

import structlog

from common.catalog import Catalog
from common.kubeapi import Kube
from common.placement import Policy
from webhook.allocator.clock import Clock, SystemClock
from webhook.allocator.controller import Controller
from webhook.allocator.leader import LEASE_NAME, LeaderElector, LeadershipLost, LeaseSettings
from webhook.allocator.metrics import AllocatorMetrics

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


def default_identity() -> str:
    """`<hostname>_<random>`: unique per process, readable in `kubectl get lease`."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}_{secrets.token_hex(4)}"


@dataclass(frozen=True)
class AllocatorSettings:
    """What the allocator runs with (STYLE.md §8: passed in, nothing read at import).

    namespace: where the leader-election Lease lives (InstaSlice's namespace).
    identity: this replica's name in the Lease; unique per process.
    pinned_unschedulable_timeout_s: how long a pinned pod may stay unschedulable before its
      slices are released (CONTRACT.md §4 step 4).
    lease_*: leader election (client-go's defaults: 15 s lease, renew every 5 s, give up
      after 10 s without a renewal); release_on_exit hands the Lease back on shutdown.
    node_selector: a label selector; when set, only matching nodes are offered to placement
      (a cluster partition, or a test's own nodes). Pods are watched cluster-wide regardless.
    agent_sweep_s: how often the leader checks the node agents' Leases (in `namespace`); a
      node whose agent has not renewed for the Lease's duration is left out of placement.
    clock: injectable for tests.
    """

    namespace: str
    identity: str = field(default_factory=default_identity)
    pinned_unschedulable_timeout_s: float = 60.0
    policy: Policy = Policy.INSTASLICE
    catalog: Catalog | None = None
    lease_name: str = LEASE_NAME
    lease_duration_s: float = 15.0
    renew_interval_s: float = 5.0
    renew_deadline_s: float = 10.0
    retry_interval_s: float = 2.0
    release_on_exit: bool = True
    max_backoff_s: float = 30.0
    node_selector: str | None = None
    agent_sweep_s: float = 5.0
    clock: Clock = field(default_factory=SystemClock, compare=False)

    def lease(self) -> LeaseSettings:
        return LeaseSettings(
            namespace=self.namespace,
            identity=self.identity,
            name=self.lease_name,
            lease_duration_s=self.lease_duration_s,
            renew_interval_s=self.renew_interval_s,
            renew_deadline_s=self.renew_deadline_s,
            retry_interval_s=self.retry_interval_s,
            release_on_exit=self.release_on_exit,
        )


def build_controller(
    kube: Kube,
    settings: AllocatorSettings,
    metrics: AllocatorMetrics | None = None,
    *,
    lease_kube: Kube | None = None,
) -> Controller:
    elector = LeaderElector(lease_kube or kube, settings.lease(), settings.clock)
    return Controller(
        kube,
        elector,
        settings.clock,
        metrics or AllocatorMetrics(),
        policy=settings.policy,
        catalog=settings.catalog,
        pinned_unschedulable_timeout_s=settings.pinned_unschedulable_timeout_s,
        max_backoff_s=settings.max_backoff_s,
        node_selector=settings.node_selector,
        agent_namespace=settings.namespace,
        agent_sweep_s=settings.agent_sweep_s,
    )


async def run_allocator(
    kube: Kube, settings: AllocatorSettings, metrics: AllocatorMetrics | None = None
) -> None:
    """Watch, and act while holding the Lease; runs until cancelled.

    The Lease is renewed over its own connection pool: in a burst hundreds of creates,
    pins and events queue on the main pool, and a renewal waiting behind them missed its
    deadline (measured: leadership lost 6 times during a 1000-pod burst, docs/benchmarks.md).
    """
    async with kube.sibling() as lease_kube:
        controller = build_controller(kube, settings, metrics, lease_kube=lease_kube)
        await run_controller(controller, settings)


async def run_controller(controller: Controller, settings: AllocatorSettings) -> None:
    """`run_allocator` for a controller built by the caller (tests inspect its state).

    A term that fails (a bug, an API error while starting to lead) is logged, the Lease is
    handed back so another replica can lead, and this replica stands again after a pause:
    the allocator shares its process with admission, which must not go down with it.
    """
    elector = controller.elector
    async with asyncio.TaskGroup() as tg:
        tg.create_task(controller.watch(), name="informers")
        await controller.synced()  # rebuild from the cluster before ever acting
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
