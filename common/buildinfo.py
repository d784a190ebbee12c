"""What every InstaSlice /metrics carries besides its own metrics: `instaslice_build_info`
and the standard process and platform collectors (`process_*`, `python_info`).

prometheus_client registers these on its global registry only; the components use registries
of their own (no global state, docs/style.md), so each entry point starts from
`registry(component)`. docs/metrics.md lists the series.
"""

from __future__ import annotations

import platform
from importlib import metadata

from prometheus_client import CollectorRegistry, Gauge, PlatformCollector, ProcessCollector

__all__ = ["register", "registry", "version"]


def version() -> str:
    try:
        return metadata.version("instaslice")
    except metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


def register(registry: CollectorRegistry, component: str) -> None:
    """Add build info (`component`: webhook or nodeagent) and the process/platform
    collectors to `registry`."""
    info = Gauge(
        "instaslice_build_info",
        "Always 1: the running InstaSlice version, component and Python version.",
        ["version", "component", "python_version"],
        registry=registry,
    )
    info.labels(version(), component, platform.python_version()).set(1)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)


def registry(component: str) -> CollectorRegistry:
    """A new registry with `register` done: what each entry point starts from."""
    out = CollectorRegistry()
    register(out, component)
    return out
