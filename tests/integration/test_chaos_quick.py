"""The chaos soak, short and seeded, as part of `make test` (bench/chaos.py --quick).

One minute of churn on 3 KWOK GPU nodes (6 emulated GPUs) while every fault kind of
bench/chaos_faults.py is injected at least once — kill -9 of the webhook/allocator and of
the node agents, a kube-apiserver restart, NVML create/destroy failures and slow calls, a GPU
falling off the bus, a node NotReady, a node deleted, pods deleted mid-allocation, a
namespace deleted — then the system must settle with every invariant of
bench/invariants.py holding against ground truth (the emulated GPUs' real instances, the
API objects, the CDI files): no leaked instance, no orphan allocation, no double booking at
any sampled moment, no unsettled pod.

Leaves out: the 10-minute soak with the bigger fleet (`make chaos`; its numbers are in
docs/security.md), and real GPUs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.chaos import COUNTS, run_chaos
from hack.cluster import BinariesMissing

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
SEED = 7


def test_quick_chaos_keeps_every_invariant(tmp_path: Path) -> None:
    try:
        result = run_chaos(tmp_path / "chaos", minutes=1.0, seed=SEED, quick=True)
    except BinariesMissing as e:
        pytest.fail(str(e), pytrace=False)
    (tmp_path / "chaos.json").write_text(json.dumps(result, indent=1))
    shown = json.dumps({k: v for k, v in result.items() if k != "faults"}, indent=1)
    assert result["faults_injected"] >= 10, shown
    assert len(result["faults_by_kind"]) == 10, f"not every fault kind came up:\n{shown}"
    assert result["pods_created"] >= 10, shown
    assert result["double_booking_samples"] >= 20, shown
    assert not result["fault_errors"], shown
    assert {k: result[k] for k in COUNTS} == dict.fromkeys(COUNTS, 0), shown
