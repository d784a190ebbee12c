"""The metrics of docs/metrics.md, scraped from a running system: every documented series
exists, and the counters and histograms move when a pod is sliced and released.

Covers the webhook process (admission + allocator, one registry) and the node agent, through
their real `/metrics` endpoints. Leaves out values that need faults to move (NVML errors,
unhealthy GPUs, `in_use` releases: the chaos soak and the agent's integration tests drive
those) and the Grafana dashboard's PromQL (checked against the table in tests/unit).
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from common.kubeapi import Kube
from hack.dev import DevSystem
from testkit.builders import user_pod
from tests.e2e.helpers import allocs_path, pods_path, wait_gone, wait_pod_running

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def documented() -> dict[str, str]:
    """metric name → type, from the table in docs/metrics.md."""
    rows = re.findall(
        r"^\| `(instaslice_[a-z_]+)` \| (counter|gauge|histogram) \|", DOC.read_text(), re.M
    )
    assert len(rows) >= 15, "the metrics table went missing"
    return dict(rows)


def _text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return str(r.read().decode())


def families(port: int) -> set[str]:
    """Metric families declared (a labelled gauge with no child yet has no sample)."""
    return {f.name for f in text_string_to_metric_families(_text(port))}


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(_text(port)):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    want = set(labels.items())
    return sum(v for (n, lb), v in samples.items() if n == name and want <= set(lb))


async def test_documented_series_exist_and_move(
    kube: Kube, system: DevSystem, namespace: str
) -> None:
    before_hook, before_agent = scrape(system.metrics_port), scrape(system.agent_metrics_port)
    exported = families(system.metrics_port) | families(system.agent_metrics_port)
    for metric, kind in documented().items():
        family = metric.removesuffix("_total") if kind == "counter" else metric
        assert family in exported, f"{metric} is documented in docs/metrics.md but not exported"

    await kube.create(
        pods_path(namespace), user_pod(name="m", slices={"main": {"1g.18gb": 1}}, cpu="100m")
    )
    pod = await wait_pod_running(kube, namespace, "m")
    claim = pod["metadata"]["annotations"]["instaslice.io/claim"]
    # the per-slice info series names the pod holding the slice, for DCGM joins
    (info,) = [
        dict(lb)
        for (n, lb) in scrape(system.agent_metrics_port)
        if n == "instaslice_slice_info" and dict(lb).get("pod") == "m"
    ]
    assert info["namespace"] == namespace and info["container"] == "main"
    assert info["profile"] == "1g.18gb" and info["mig_uuid"].startswith("MIG-")
    assert info["gpu_uuid"].startswith("GPU-") and info["gi_id"] and info["node"]
    await kube.delete(pods_path(namespace, "m"))
    await wait_gone(kube, allocs_path(namespace), claim)

    hook, agent = scrape(system.metrics_port), scrape(system.agent_metrics_port)
    H, A = (before_hook, hook), (before_agent, agent)
    moved = [
        (H, "instaslice_webhook_reviews_total", {"outcome": "patched"}),
        (H, "instaslice_webhook_review_seconds_count", {}),
        (H, "instaslice_allocator_time_to_ungate_seconds_count", {}),
        (H, "instaslice_allocations_total", {"outcome": "allocated"}),
        (A, "instaslice_nodeagent_creates_total", {"result": "ready"}),
        (A, "instaslice_nodeagent_create_seconds_count", {}),
        (A, "instaslice_nodeagent_releases_total", {"result": "released"}),
    ]
    for (old, new), metric, labels in moved:
        assert total(new, metric, **labels) > total(old, metric, **labels), (
            f"{metric}{labels or ''} did not move: {total(old, metric, **labels)} -> "
            f"{total(new, metric, **labels)}"
        )
    assert total(hook, "instaslice_allocator_leader") == 1, "exactly one leader in the system"
    assert total(hook, "instaslice_gpu_slots") > 0, "GPU slot capacity exported per GPU"
