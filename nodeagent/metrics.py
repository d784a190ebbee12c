"""Prometheus metrics and the health endpoints of the node agent.

No global registry (the webhook does the same): `serve()` creates one `AgentMetrics` and,
with `--metrics-port`, an aiohttp server on `:PORT` with `/metrics`, `/healthz` (the
process's loop answers) and `/readyz` (every node agent finished startup and the
SliceAllocation informer listed once). Tests build their own `AgentMetrics`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from common.metricsauth import OK, MetricsAuth, refusal
from common.metricstls import self_signed_context
from nodeagent.report import SLICE_INFO_LABELS

SliceSource = Callable[[], Iterable[Sequence[str]]]

# GI+CI creation: milliseconds in the emulator, around a second on hardware (docs/mig-facts.md §5).
CREATE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class SliceInfo(Collector):
    """`instaslice_slice_info`, computed when scraped from each node's live view (so it never
    outlives a slice): one series per slice of a Ready allocation, value 1."""

    def __init__(self) -> None:
        self.sources: list[SliceSource] = []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "instaslice_slice_info",
            "One series per MIG slice of a Ready allocation (value 1): which pod and container "
            "hold which MIG device; join DCGM exporter's series on gpu_uuid and gi_id.",
            labels=SLICE_INFO_LABELS,
        )
        for source in self.sources:
            for labels in source():
                family.add_metric(list(labels), 1.0)
        yield family


@dataclass
class AgentMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self.slice_info = SliceInfo()
        self.registry.register(self.slice_info)
        self.creates = Counter(
            "instaslice_nodeagent_creates",
            "Allocations whose slices were created, by result (ready, failed).",
            ["node", "result"],
            registry=self.registry,
        )
        self.create_seconds = Histogram(
            "instaslice_nodeagent_create_seconds",
            "From picking up an allocation to its Ready status write.",
            ["node"],
            buckets=CREATE_BUCKETS,
            registry=self.registry,
        )
        self.releases = Counter(
            "instaslice_nodeagent_releases",
            "Release attempts, by result (released, in_use).",
            ["node", "result"],
            registry=self.registry,
        )
        self.mode_changes = Counter(
            "instaslice_nodeagent_mode_changes",
            "MIG mode changes the agent attempted, by target mode and result (done, failed).",
            ["node", "target", "result"],
            registry=self.registry,
        )
        self.nvml_errors = Counter(
            "instaslice_nodeagent_nvml_errors",
            "NVML calls that failed, by function and nvml.h error name.",
            ["node", "op", "code"],
            registry=self.registry,
        )
        self.gpu_healthy = Gauge(
            "instaslice_nodeagent_gpu_healthy",
            "1 while the GPU is healthy, 0 after an XID or GPU-lost event.",
            ["node", "gpu"],
            registry=self.registry,
        )
        self.conflicts = Gauge(
            "instaslice_nodeagent_conflicts",
            "1 while something else manages this node's GPUs too, by kind (device_plugin, "
            "mig_manager, foreign_instances); the MigNode's ConflictFree condition says why.",
            ["node", "kind"],
            registry=self.registry,
        )
        self.warm = Counter(
            "instaslice_nodeagent_warm_slices",
            "Warm slices (docs/warm-slices.md), by event: hit (a slice handed over without "
            "NVML), miss (a slice made for its pod), made, destroyed.",
            ["node", "event"],
            registry=self.registry,
        )
        self.slices = Gauge(
            "instaslice_nodeagent_slices",
            "Slices held by InstaSlice records, and foreign instances, on the node.",
            ["node", "owner"],
            registry=self.registry,
        )


@asynccontextmanager
async def health_server(
    port: int,
    metrics: AgentMetrics,
    ready: Callable[[], bool],
    host: str = "0.0.0.0",
    auth: MetricsAuth | None = None,
) -> AsyncIterator[web.AppRunner]:
    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        ok = ready()
        return web.Response(text="ok\n" if ok else "starting\n", status=200 if ok else 503)

    async def prom(request: web.Request) -> web.Response:
        if auth is not None:
            code = await auth.check(request.headers.get("Authorization"), request.path)
            if code != OK:
                return web.Response(status=code, text=refusal(code))
        body = generate_latest(metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", prom)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        # a token must not cross the network in clear text: TLS wherever auth is on
        tls = self_signed_context(f"instaslice-nodeagent-{host}") if auth is not None else None
        await web.TCPSite(runner, host, port, ssl_context=tls).start()
        yield runner
    finally:
        await runner.cleanup()
