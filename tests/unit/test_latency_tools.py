"""bench.latency_probe's /metrics reading and bench.churn_sim's model of the NVML lanes."""

from __future__ import annotations

import pytest

from bench.churn_sim import simulate
from bench.latency_probe import latency_delta, request_seconds

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


@pytest.mark.parametrize("order", ["fifo", "alloc", "creates-first"])
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
