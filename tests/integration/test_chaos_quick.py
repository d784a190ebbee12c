"""The chaos soak, short and seeded, as part of `make test` (bench/chaos.py --quick).

Churn on 4 KWOK GPU nodes (8 emulated GPUs, 2 starting with MIG off) for at least 30 s and
until every fault kind of bench/chaos_faults.py has been injected at least once (seed 7: all
13 within 46 s at load 10; the quick mode goes on for at most 10 x 30 s) — kill -9 of the
webhook/allocator and of the node agents, a kube-apiserver restart, NVML create/destroy
failures and slow calls, a GPU falling off the bus, a node NotReady, a node deleted, pods
deleted mid-allocation, a namespace deleted, a create whose rollback NVML refuses twice, a
pod replaced by a same-name one during a watch gap, an admin flipping an idle GPU's MIG mode
— then the system must settle with every invariant of bench/invariants.py holding against
ground truth (the emulated GPUs' real instances, the API objects, the CDI files): no leaked
instance, no orphan allocation, no double booking at any sampled moment, no unsettled pod,
no Ready slice on a GPU with MIG off.

A pure test checks the checker: each kind of violation, planted in synthetic ground truth,
is reported (so a clean soak is not a blind one). Leaves out: the 10-minute soak with the
bigger fleet (`make chaos`; its numbers are in docs/security.md), and real GPUs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.chaos import COUNTS, run_chaos
from bench.chaos_faults import WEIGHTS
from bench.invariants import Instance, Slot, Truth, check_settled, double_bookings
from common.constants import CLAIM_ANNOTATION
from hack.cluster import BinariesMissing

# at most 5 minutes of faults (quick mode), then settling
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
SEED = 7


def test_quick_chaos_keeps_every_invariant(tmp_path: Path) -> None:
    try:
        result = run_chaos(tmp_path / "chaos", minutes=0.5, seed=SEED, quick=True)
    except BinariesMissing as e:
        pytest.fail(str(e), pytrace=False)
    (tmp_path / "chaos.json").write_text(json.dumps(result, indent=1))
    shown = json.dumps({k: v for k, v in result.items() if k != "faults"}, indent=1)
    assert result["faults_injected"] >= 10, shown
    assert set(result["faults_by_kind"]) == set(WEIGHTS), f"not every fault kind came up:\n{shown}"
    assert result["pods_created"] >= 10, shown
    assert result["double_booking_samples"] >= 20, shown
    assert not result["fault_errors"], shown
    assert {k: result[k] for k in COUNTS} == dict.fromkeys(COUNTS, 0), shown


# --- the checker itself is not vacuous (pure, no cluster) ---------------------------------------


def _alloc(name: str, uid: str, gpu: str, start: int, size: int, mig: str = "") -> dict[str, Any]:
    status: dict[str, Any] = {"phase": "Ready" if mig else "Creating"}
    if mig:
        status["slices"] = [{"container": "main", "migUUID": mig}]
    return {
        "metadata": {"namespace": "ns", "name": name},
        "spec": {"podUID": uid, "nodeName": "n", "slices": [
            {"container": "main", "profile": "1g.10gb", "gpuUUID": gpu, "start": start,
             "size": size}]},
        "status": status,
    }  # fmt: skip


def _running(name: str, uid: str, claim: str) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "ns", "name": name, "uid": uid,
                     "annotations": {CLAIM_ANNOTATION: claim}},
        "spec": {"nodeName": "n", "containers": [{"name": "main"}]},
        "status": {"phase": "Running"},
    }  # fmt: skip


def test_checker_sees_each_kind_of_violation() -> None:
    a = _alloc("ca", "ua", "GPU-0", 0, 2, "MIG-a")
    b = _alloc("cb", "ub", "GPU-0", 1, 1, "MIG-b")  # overlaps a
    c = _alloc("cc", "uc", "GPU-1", 0, 1, "MIG-a")  # names a's device
    assert {v.detail for v in double_bookings([a, b, c])} == {
        "overlapping memory slots",
        "both name MIG device MIG-a",
    }
    held = {"ugone": [Slot("ns/old", "ugone", "GPU-1", 0, 1, "MIG-x")]}
    assert len(double_bookings([c], held)) == 1  # a pod still runs on c's slots

    inst = [Instance("n", "GPU-0", 0, "1g.10gb", 0, 2, "MIG-a"),
            Instance("n", "GPU-0", 0, "1g.10gb", 5, 1, "MIG-leak")]  # fmt: skip
    pods = [_running("pa", "ua", "ca"), _running("pz", "uz", "cz")]
    pending = _alloc("cp", "ua-gone", "GPU-1", 3, 1)
    truth = Truth(pods, [a, pending], inst, {"n": {("ns", "ca")}})
    report = check_settled(truth)
    assert [v.key for v in report.leaked_instances] == ["n/gpu0[5:1]"]
    assert [v.key for v in report.orphan_allocations] == ["ns/cp"]
    assert [(v.key, v.detail) for v in report.unsettled_pods] == [
        ("ns/pz", "Running without an allocation of its own")
    ]
    truth.cdi_claims = {"n": set()}
    assert "no CDI spec file" in check_settled(truth).unsettled_pods[0].detail
    assert check_settled(truth).mode_mismatch == []
    truth.mig_off = {"GPU-0"}  # a's Ready slice sits on a GPU whose MIG mode is off
    assert [v.key for v in check_settled(truth).mode_mismatch] == ["ns/ca@GPU-0"]

    whole = _alloc("cw", "uw", "GPU-0", 0, 8, "GPU-0")
    whole["spec"]["slices"][0].update(profile="gpu", kind="gpu")
    truth = Truth([_running("pw", "uw", "cw")], [whole], inst, {"n": {("ns", "cw")}}, {}, {"GPU-0"})
    report = check_settled(truth)
    assert report.orphan_allocations == [] and report.unsettled_pods == []  # no instance needed
    assert [v.key for v in report.whole_gpu_shared] == ["ns/cw@GPU-0"]  # but the GPU holds two
    truth.instances, truth.mig_off = [], set()
    assert [v.detail for v in check_settled(truth).mode_mismatch] == [
        "Ready whole GPU on a GPU whose MIG mode is on"
    ]
