"""The placement benchmark's quick variant, the exact optimum, and `instaslice-place`.

Covers: the quick benchmark run in-process — instaslice places every request of each
trap-* trace and, per trap and over the quick suite in total, accepts at least as many pods
and serves at least as much slot-time as every baseline; the optimum is never beaten by a
policy that places whenever it can; the JSON has the documented shape and the PNG is
written. The CLI on a tiny trace (every policy, the exact output lines, a dropped pod and
its removal) and its error exits.
Leaves out: the full benchmark (make bench-placement) and decision-speed thresholds (this
machine is shared; docs/placement.md reports the measured numbers).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import placement as bench
from common.placement.cli import main as cli_main
from common.placement.optimum import Objective, optimum
from common.placement.replay import parse_trace

BASELINES = ("first-fit", "spread", "static-balanced")


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("bench")
    # decision speed at 1000 nodes only: nothing here reads the 5000-node figure (thresholds
    # are not tested, module docstring), and measuring it took 60 % of this fixture
    return bench.run(quick=True, out_dir=out, timing_samples=50, timing_nodes=(1000,)), out


def test_quick_benchmark_writes_the_documented_json(quick: tuple[dict[str, Any], Path]) -> None:
    results, out = quick
    doc = json.loads((out / "placement.json").read_text())
    assert doc["traces"] == results["traces"]
    assert (out / "placement.png").stat().st_size > 10_000
    assert (out / "traces" / "trap-a100-1g-4g.json").exists()
    for trace in doc["traces"].values():
        for name in ("instaslice", *BASELINES):
            run = trace["policies"][name]
            assert set(run) >= {"accepted_pods", "slot_utilization", "pending_fragmented"}
            assert 0.0 <= run["slot_utilization"] <= 1.0
    d = doc["decision_ms"]
    assert (d["nodes"], d["gpus_per_node"]) == (1000, 8)
    assert 0 < d["p50"] <= d["p99"]
    collector = d["collector"]  # the garbage collector's share, told apart
    assert 0 <= collector["decisions"] <= d["samples"]
    assert collector["p50_without"] <= d["p50"] and collector["p99_without"] <= d["p99"]


def test_instaslice_places_every_trap(quick: tuple[dict[str, Any], Path]) -> None:
    results, _ = quick
    traps = {k: v for k, v in results["traces"].items() if k.startswith("trap-")}
    assert len(traps) >= 5
    for name, trace in traps.items():
        ours = trace["policies"]["instaslice"]
        assert ours["accepted_pods"] == trace["pods"], name
        for b in BASELINES:
            other = trace["policies"][b]
            assert ours["accepted_pods"] >= other["accepted_pods"], (name, b)
            assert ours["slot_time"] >= other["slot_time"] - 1e-9, (name, b)


def test_instaslice_wins_the_quick_suite_in_total(quick: tuple[dict[str, Any], Path]) -> None:
    totals = quick[0]["totals"]
    ours = totals["instaslice"]
    for b in BASELINES:
        assert ours["accepted_pods"] >= totals[b]["accepted_pods"], b
        assert ours["slot_time"] >= totals[b]["slot_time"], b


def test_every_baseline_win_is_explained(quick: tuple[dict[str, Any], Path]) -> None:
    for win in quick[0]["baseline_wins"]:
        assert win["why"], win
        assert not win["trace"].startswith("trap-"), win


def test_the_optimum_bounds_the_placing_policies(quick: tuple[dict[str, Any], Path]) -> None:
    computed = 0
    for name, trace in quick[0]["traces"].items():
        best = trace["policies"].get("optimum")
        if best is None:
            continue
        computed += 1
        for p in ("instaslice", "first-fit", "spread"):
            run = trace["policies"][p]
            assert best["accepted_pods"] >= run["accepted_pods"], (name, p)
            assert best["slot_time"] >= run["slot_time"] - 1e-6, (name, p)
    assert computed >= 6


def test_optimum_places_the_one_pod_trap_and_gives_up_past_its_budget() -> None:
    doc = bench.traps()["trap-a100-one-pod-1g-1g-2g-3g"]
    run = optimum(parse_trace(doc), Objective.PODS)
    assert run is not None
    assert run.accepted_pods == 1
    fleet = bench.Fleet("x", (("n", 2, "H100-80GB", 4),))
    big = parse_trace(bench.churn_trace(5, fleet, 60))
    assert optimum(big, Objective.SLOT_TIME, budget=50) is None


# --- instaslice-place -------------------------------------------------------------------------
TRACE = {
    "nodes": [
        {
            "name": "n0",
            "cpu": "64",
            "memory": "512Gi",
            "pods": 110,
            "gpus": [{"model": "H100-80GB"}, {"model": "H100-80GB"}],
        }
    ],
    "events": [
        {
            "op": "add",
            "pod": "p1",
            "cpu": "1",
            "memory": "1Gi",
            "containers": [{"name": "c", "slices": {"1g.10gb": 1}}],
        },
        {
            "op": "add",
            "pod": "p2",
            "cpu": "1",
            "memory": "1Gi",
            "containers": [{"name": "c", "slices": {"4g.40gb": 1}}],
        },
        {
            "op": "add",
            "pod": "p3",
            "cpu": "1",
            "memory": "1Gi",
            "containers": [{"name": "c", "slices": {"7g.80gb": 2}}],
        },
        {"op": "remove", "pod": "p1"},
        {"op": "remove", "pod": "p3"},
    ],
}


def _run_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], policy: str, doc: Any = TRACE
) -> tuple[int, list[dict[str, Any]], str]:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(doc))
    code = cli_main(["--policy", policy, str(path)])
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in captured.out.splitlines()]
    return code, lines, captured.err


def test_cli_prints_one_line_per_event(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, lines, _ = _run_cli(tmp_path, capsys, "instaslice")
    assert code == 0
    assert lines[0] == {
        "op": "add",
        "pod": "p1",
        "placed": True,
        "node": "n0",
        "slices": [{"container": "c", "profile": "1g.10gb", "gpu": 0, "start": 5, "size": 1}],
    }
    assert lines[1]["placed"] and lines[1]["slices"][0]["start"] == 0
    assert lines[2]["placed"] is False
    assert lines[2]["code"] == "Full"
    assert lines[2]["reason"].startswith("no node has room for 2x 7g.80gb")
    assert lines[3] == {"op": "remove", "pod": "p1", "removed": True}
    assert lines[4] == {"op": "remove", "pod": "p3", "removed": False}  # dropped: no-op


@pytest.mark.parametrize("policy", ["first-fit", "spread", "static-balanced"])
def test_cli_every_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str], policy: str) -> None:
    code, lines, _ = _run_cli(tmp_path, capsys, policy)
    assert code == 0
    assert [line["op"] for line in lines] == ["add", "add", "add", "remove", "remove"]
    if policy == "first-fit":
        assert lines[0]["slices"][0]["start"] == 0
        assert lines[1]["slices"][0]["gpu"] == 1  # the 1g at slot 0 blocks GPU 0's 4g
    if policy == "static-balanced":
        assert lines[1]["code"] == "NoProfile"


def test_cli_rejects_a_malformed_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = {"nodes": [{"name": "n0", "cpu": "lots"}], "events": []}
    code, lines, err = _run_cli(tmp_path, capsys, "instaslice", bad)
    assert code == 2
    assert lines == []
    assert "nodes[0].cpu" in err and "'lots'" in err
    code = cli_main(["--policy", "instaslice", str(tmp_path / "missing.json")])
    assert code == 2
