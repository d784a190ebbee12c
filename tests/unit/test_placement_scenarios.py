"""bench.placement_scenarios, small: each scenario's JSON as `bench.placement` writes it, the
churn's model of the NVML lanes, and the Karpenter placeholders' keep-off list.

Covers: the registry (every scenario runs `--quick` and reports what docs/benchmarks.md and
bench/expected.yaml read), the lane model's invariants (a create never beats its NVML calls;
packing queues creates on one GPU, avoiding busy GPUs and creates-first shorten the tail),
and the keep-off list on a small fleet (every full node listed and found misplaced, the
placeholder grows with the list; in the mixed fleet only the nodes that look free).
Leaves out: the full-size numbers and their CPU times (`make bench-placement`, then
`make bench-check`).
"""

from __future__ import annotations

from typing import Any

import pytest

from bench import placement
from bench.placement_scenarios import SCENARIOS, keepoff, run, simulate, table


def test_every_scenario_runs_quick_and_reports_its_figures() -> None:
    out = run(list(SCENARIOS), quick=True)
    assert set(out) == {"quick", "took_cpu_s", *SCENARIOS}
    for limit in (0, 1, 2):
        r = out["inflight"][f"limit-{limit}"]
        assert r["avoid_creates_in_flight"] == limit and r["unplaced"] == 0
        assert 0 < r["decision_cpu_p50_ms"] <= r["decision_cpu_p99_ms"]
    assert out["keepoff"]["mixed"]["room_listed"] < out["keepoff"]["mixed"]["all_listed"]
    orders = ("fifo", "creates-first")
    assert set(out["lanes"]) == {f"{o}-avoid-{k}" for o in orders for k in (0, 2)}
    assert "lanes creates-first-avoid-2" in table(out)
    kinds = out["kinds"]["by_kind"]
    for kind, k in kinds.items():
        assert 0 < k["p50"] <= k["p99"] <= k["max"], kind
        assert (k["placed"] == 0) == kind.startswith("pending"), (kind, k)
    assert "whole GPU" in table(out) and "size ask" in table(out)


def test_placement_refuses_an_unknown_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        placement.main(["--quick", "--scenarios", "inflight,nope"])
    assert "unknown ['nope']" in capsys.readouterr().err


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


def test_the_keepoff_list_on_a_small_fleet() -> None:
    small, large = keepoff(nodes=10, gpus=2), keepoff(nodes=100, gpus=2)
    assert small["nodes"] == 10 and large["nodes"] == 100
    grown = int(str(large["placeholder_json_bytes"])) - int(str(small["placeholder_json_bytes"]))
    assert 90 * 20 < grown < 90 * 60  # some 20-60 bytes per node kept off
    mixed: Any = large["mixed"]
    # of 100: the 10 A100-40GB nodes with cpu to spare and the 12 or 13 H100-80GB nodes
    # full of 7g.80gb look free; the rest offer no 1g.10gb, have it used up or lack cpu
    assert mixed["all_listed"] == 100 and mixed["room_listed"] in (22, 23)
    assert mixed["room_placeholder_json_bytes"] < mixed["all_placeholder_json_bytes"] / 2
