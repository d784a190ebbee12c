"""bench.latency_probe's /metrics reading, bench.churn_sim's model of the NVML lanes, and the
pure parts of bench.agent_took and bench.status_write."""

from __future__ import annotations

import json

import pytest

from bench.agent_took import summary
from bench.churn_sim import simulate
from bench.latency_probe import latency_delta, request_seconds
from bench.status_write import _stats, bodies

_PUT = 'resource="pods",subresource="",verb="PUT"'
_MIG = 'resource="mignodes",subresource="status",verb="PATCH"'
_WATCH = 'resource="pods",subresource="",verb="WATCH"'
_NAME = "apiserver_request_duration_seconds"
METRICS = "\n".join(
    [
        f"# HELP {_NAME} x",
        f'{_NAME}_sum{{component="apiserver",{_PUT}}} 1.5',
        f'{_NAME}_count{{component="apiserver",{_PUT}}} 10',
        f'{_NAME}_sum{{component="apiserver",{_MIG}}} 4',
        f'{_NAME}_count{{component="apiserver",{_MIG}}} 20',
        f'{_NAME}_sum{{component="apiserver",{_WATCH}}} 900',
        f'{_NAME}_count{{component="apiserver",{_WATCH}}} 3',
        f'{_NAME}_bucket{{component="apiserver",le="0.1",{_PUT}}} 7',
    ]
)


def test_request_seconds_by_kind_without_watches() -> None:
    got = request_seconds(METRICS)
    assert got == {"PUT pods": (1.5, 10.0), "PATCH mignodes/status": (4.0, 20.0)}


def test_latency_delta_is_the_mean_of_the_requests_between_two_scrapes() -> None:
    before = {"PUT pods": (1.5, 10.0), "PATCH mignodes/status": (4.0, 20.0)}
    after = {"PUT pods": (2.0, 15.0), "PATCH mignodes/status": (4.0, 20.0), "POST pods": (0.3, 3.0)}
    assert latency_delta(before, after) == {
        "PUT pods": {"n": 5, "mean_ms": 100.0},
        "POST pods": {"n": 3, "mean_ms": 100.0},
    }


@pytest.mark.parametrize("order", ["fifo", "creates-first", "alloc", "alloc-creates-first"])
def test_a_create_never_takes_less_than_its_nvml_calls_and_every_pod_is_placed(
    order: str,
) -> None:
    res = simulate(order, nodes=3, rate=2.0, seconds=30.0, life_s=5.0, seed=3)
    assert res["unplaced"] == 0 and res["pods"] > 30
    assert res["create_p50_s"] >= 0.6  # GI 300 ms + CI 300 ms
    assert res["create_max_s"] >= res["create_p99_s"] >= res["create_p50_s"]


def test_packing_queues_creates_on_one_gpu_and_avoiding_busy_gpus_spreads_them() -> None:
    """At 4 arrivals/s packing sends consecutive pods to the same GPU, whose calls run one at
    a time: creates queue there. Placing away from a GPU with a create waiting does not."""
    packed = simulate("fifo", nodes=20, rate=4.0, seconds=40.0, life_s=10.0, seed=1)
    spread = simulate("fifo", nodes=20, rate=4.0, seconds=40.0, life_s=10.0, seed=1, avoid_busy=1)
    assert packed["queued_creates_ahead_max"] >= 2
    assert spread["queued_creates_ahead_max"] == 0
    assert spread["create_p99_s"] < packed["create_p99_s"]


def test_a_gpu_counts_as_busy_until_its_ready_is_seen() -> None:
    """`ready_lag_s`: the allocator counts a slice in flight until it sees `Ready`, after the
    create; the longer that, the more GPUs the first pass spreads over."""
    kw = {"nodes": 20, "rate": 4.0, "seconds": 40.0, "life_s": 10.0, "seed": 1, "avoid_busy": 1}
    prompt = simulate("fifo", **kw)  # type: ignore[arg-type]
    lagged = simulate("fifo", ready_lag_s=1.0, **kw)  # type: ignore[arg-type]
    assert lagged["gpus_used"] > prompt["gpus_used"]
    assert lagged["queued_creates_ahead_max"] == 0


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_creates_first_shortens_the_churn_tail_in_the_model(seed: int) -> None:
    """A create's calls before the queued releases' on its GPU (nodeagent/lane.py), with the
    allocator keeping creates from piling up on one GPU (`--avoid-creates-in-flight 2`): the
    slowest create, which waited behind releases, comes sooner; none is slower at p99."""
    kw = {"nodes": 20, "rate": 4.0, "seconds": 60.0, "life_s": 20.0, "seed": seed}
    fifo = simulate("fifo", avoid_busy=2, **kw)  # type: ignore[arg-type]
    first = simulate("creates-first", avoid_busy=2, **kw)  # type: ignore[arg-type]
    assert first["create_max_s"] < fifo["create_max_s"]
    assert first["create_p99_s"] <= fifo["create_p99_s"]
    assert first["create_p50_s"] >= 0.6


def test_agent_took_summarises_the_slices_ready_lines() -> None:
    lines = [
        json.dumps({"event": "slices ready", "ms": ms, "steps": {"ready": r}, "took": {"w": w}})
        for ms, r, w in ((50.0, 10.0, 9.0), (70.0, 30.0, 20.0), (60.0, 20.0, 15.0))
    ] + ['{"event": "slices released"}']
    got = summary(lines)
    assert got["creates"] == 3
    assert got["total"] == {"n": 3, "p50": 60.0, "p90": 70.0, "mean": 60.0}
    assert got["steps.ready"]["p50"] == 20.0
    assert got["took.w"]["mean"] == 14.7


def test_status_write_sends_the_agents_two_bodies_in_turn() -> None:
    assert bodies(0) == {"status": {"phase": "Creating", "message": ""}}
    ready = bodies(1)["status"]
    assert ready["phase"] == "Ready" and ready["slices"][0]["migUUID"] == "MIG-1"
    assert [c["type"] for c in ready["conditions"]] == ["Ready", "GPUHealthy"]
    assert _stats([4.0, 1.0, 3.0, 2.0]) == {"n": 4, "p50_ms": 2.5, "p90_ms": 3.0, "mean_ms": 2.5}
