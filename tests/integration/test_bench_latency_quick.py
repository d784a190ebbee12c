"""`python -m bench.latency --quick` runs end to end and writes a well-formed JSON.

Covers: a real system comes up (control plane, KWOK GPU nodes, InstaSlice), the sequential
and burst scenarios run with emulated NVML latency 0, with the realistic setting and as the
static baseline (pre-sliced capacity, no InstaSlice: its pods run, and each InstaSlice
variant carries its `ratio_to_static`), every InstaSlice pod is ungated, percentiles are
finite and ordered, process stats are recorded, the plots
render, and the system is torn down. Leaves out: timing thresholds (the machine is shared;
a flaky test is a bug) and the churn and scale scenarios (minutes each; `make bench-latency`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import latency
from hack.dev import DevSystem

pytestmark = pytest.mark.integration


# The benchmark attaches to the control plane it started (a fresh ControlPlane object), so
# the first object's Popen handles of still-running, intentionally kept processes are
# collected early; they are stopped by process group at teardown, not leaked.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_quick_run_writes_json_with_every_pod_ungated(tmp_path: Path) -> None:
    out = tmp_path / "latency.json"
    run_dir = tmp_path / "run"
    plots = tmp_path / "plots"
    rc = latency.main(["--quick", "--out", str(out), "--dir", str(run_dir), "--report", str(plots)])
    assert rc == 0
    doc = json.loads(out.read_text())

    assert doc["machine"]["cpus"] >= 1
    assert len(doc["machine"]["load_at_start"]) == 3
    scenarios = doc["scenarios"]
    assert set(scenarios) == {
        *("sequential", "sequential-realistic", "sequential-static"),
        *("burst", "burst-realistic", "burst-static"),
    }
    plan = latency.QUICK
    for key in ("sequential-static", "burst-static"):  # pre-sliced capacity, no InstaSlice
        sc = scenarios.pop(key)
        want = plan.seq_pods if key.startswith("sequential") else plan.burst_pods
        assert sc["pods"] == want and sc["ungated"] == 0, key
        assert 0 < sc["running_p50_s"] <= sc["running_p99_s"], key
        assert sc["system_cpu_s_per_pod"] > 0, key
        if key == "burst-static":
            assert math.isfinite(sc["all_running_s"]) and sc["all_running_s"] > 0
        for name in (key.removesuffix("-static"), key.replace("static", "realistic")):
            ratio = scenarios[name]["ratio_to_static"]
            fields = {"running_p50_s", "running_p99_s", "system_cpu_s_per_pod"}
            assert set(ratio) == fields | ({"all_running_s"} if "burst" in key else set())
            assert all(math.isfinite(v) and v > 0 for v in ratio.values()), (name, ratio)
    for key, sc in scenarios.items():
        want = plan.seq_pods if key.startswith("sequential") else plan.burst_pods
        assert sc["pods"] == want, key
        assert sc["ungated"] == want, f"{key}: not every pod was ungated"
        assert sc["nodes"] == max(plan.seq_nodes, plan.burst_nodes)
        assert sc["emulated_create_ms"] == (plan.create_ms if "realistic" in key else 0)
        for q in ("ungate_p50_s", "ungate_p99_s", "running_p50_s", "running_p99_s"):
            assert math.isfinite(sc[q]) and sc[q] > 0, (key, q)
        assert sc["ungate_p50_s"] <= sc["ungate_p99_s"] <= sc["ungate_max_s"]
        assert sc["ungate_p50_s"] <= sc["running_p50_s"]
        assert len(sc["samples"]["ungate_s"]) == want
        for proc in ("allocator", "agent", "kube-apiserver"):
            stats = sc["processes"][proc]
            assert stats["cpu_s"] >= 0 and stats["peak_rss_mb"] > 0, (key, proc)
        assert len(sc["load_start"]) == 3 and len(sc["load_end"]) == 3
    for key in ("burst", "burst-realistic"):
        b = scenarios[key]
        assert math.isfinite(b["all_ungated_s"]) and b["all_ungated_s"] > 0
        assert b["pods_per_s"] > 0
    fleets = doc["fleets"]
    assert list(fleets) == [str(max(plan.seq_nodes, plan.burst_nodes))]
    assert "idle" in next(iter(fleets.values()))
    assert "InstaSlice / static baseline" in (plots / "latency-table.md").read_text()
    assert {p.name for p in plots.iterdir()} == {
        "latency-cdf.png",
        "fleet-cost.png",
        "latency-table.md",
    }
    # torn down: nothing of the system is left running
    assert DevSystem.attach(run_dir) is None
