"""What the node agent publishes (nodeagent.report) and its checkpoint file format
(nodeagent.checkpoint): MigNode status, the fixed capacity bound, merge patches, conditions,
and atomic, versioned intent records."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.catalog import load_catalog
from common.conditions import condition, with_condition
from common.objects import node_label_value
from nodeagent import checkpoint
from nodeagent.checkpoint import Checkpoint, ClaimRecord, SliceRecord
from nodeagent.model import Health, Instance, NodeInventory
from nodeagent.report import (
    capacity,
    capacity_patch,
    gpu_condition,
    gpu_labels,
    label_patch,
    label_value,
    mig_node_status,
    node_labels,
    slot_capacity,
)
from testkit.builders import G0, G1, gpu

INV = NodeInventory(gpus=(gpu(0, G0), gpu(1, G1, model="A30-24GB")))


def _rec(uid: str, gi: int | None, state: str = "ready") -> ClaimRecord:
    s = SliceRecord("main", "1g.18gb", 19, G0, 0, 3, 1, gi, 0, "MIG-a" if gi else None)
    return ClaimRecord(uid, "ns", f"claim-{uid}", state, (s,), "b1")  # type: ignore[arg-type]


def test_capacity_is_the_sum_of_max_counts_over_healthy_mig_gpus() -> None:
    cap = capacity(INV, {})
    assert cap["instaslice.io/mig-1g.18gb"] == "7"
    assert cap["instaslice.io/mig-1g.18gb.me"] == "1"
    assert cap["instaslice.io/mig-1g.35gb"] == "4"
    assert cap["instaslice.io/mig-1g.6gb"] == "4"
    assert cap["instaslice.io/mig-2g.12gb.me"] == "1"
    two = NodeInventory(gpus=(gpu(0, G0), gpu(1, G1)))
    assert capacity(two, {})["instaslice.io/mig-3g.71gb"] == "4"
    sick = capacity(two, {1: Health(False, "XID 48")})
    assert sick["instaslice.io/mig-3g.71gb"] == "2"  # the unhealthy GPU counts 0
    off = NodeInventory(gpus=(gpu(0, G0, mig="disabled"),))
    assert set(capacity(off, {}).values()) == {"0"}


def test_memory_slots_are_written_like_the_profiles_bounds() -> None:
    # the number itself: tests/unit/test_slot_charges.py
    two = NodeInventory(gpus=(gpu(0, G0), gpu(1, G1)))  # two H200s: 8 slots each
    slots = slot_capacity(two, {}, load_catalog())
    n = slots["instaslice.io/memory-slots"]
    body = capacity_patch(slots, {"cpu": "64"})
    assert body is not None and body["status"]["capacity"] == {"instaslice.io/memory-slots": n}
    # in device-plugin mode the kubelet's instaslice.io/mig-* entries are left alone
    kubelet = {"instaslice.io/mig-1g.18gb": "14"}
    body = capacity_patch(slots, kubelet, prune=False)
    assert body is not None and body["status"]["capacity"] == {"instaslice.io/memory-slots": n}
    assert capacity_patch(slots, {**kubelet, **slots}, prune=False) is None


def test_gpu_model_label_only_when_every_gpu_is_one_model() -> None:
    one = NodeInventory(gpus=(gpu(0, G0), gpu(1, G1)))
    assert gpu_labels(one) == {
        "instaslice.io/gpu-model": "H200-141GB",
        "instaslice.io/gpu-count": "2",
    }
    assert gpu_labels(INV)["instaslice.io/gpu-model"] is None  # H200 + A30: no single flavor
    current = {"instaslice.io/gpu-model": "A30-24GB", "kubernetes.io/hostname": "n"}
    assert label_patch(gpu_labels(one), current) == {
        "metadata": {
            "labels": {"instaslice.io/gpu-model": "H200-141GB", "instaslice.io/gpu-count": "2"}
        }
    }
    assert label_patch(gpu_labels(INV), current) == {
        "metadata": {"labels": {"instaslice.io/gpu-model": None, "instaslice.io/gpu-count": "2"}}
    }
    assert label_patch(gpu_labels(one), {"instaslice.io/gpu-model": "H200-141GB",
                                         "instaslice.io/gpu-count": "2"}) is None  # fmt: skip


def test_node_labels_add_the_nodes_own_name() -> None:
    """`instaslice.io/node`, which Karpenter placeholders are kept off by; Karpenter's
    random value on a node it made is patched back."""
    one = NodeInventory(gpus=(gpu(0, G0), gpu(1, G1)))
    assert node_labels("gpu-7", one) == {**gpu_labels(one), "instaslice.io/node": "gpu-7"}
    long = "n" * 70
    assert node_labels(long, one)["instaslice.io/node"] == node_label_value(long)
    current = {"instaslice.io/gpu-model": "H200-141GB", "instaslice.io/gpu-count": "2",
               "instaslice.io/node": "5577006791947779410"}  # fmt: skip
    assert label_patch(node_labels("gpu-7", one), current) == {
        "metadata": {"labels": {"instaslice.io/node": "gpu-7"}}
    }


LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")  # the API server's


@pytest.mark.parametrize(
    ("model", "value"),
    [
        ("H200-141GB", "H200-141GB"),  # a catalog model: as it is
        ("NVIDIA X10", "NVIDIA-X10"),  # NVML's name of a model in no catalog (seen in CI)
        ("NVIDIA RTX PRO 6000 Blackwell (MIG)", "NVIDIA-RTX-PRO-6000-Blackwell-MIG"),
        ("  --GB300--  ", "GB300"),
    ],
)
def test_gpu_model_label_is_a_valid_label_value(model: str, value: str) -> None:
    assert label_value(model) == value


@given(st.text(max_size=200))
def test_every_model_name_becomes_a_valid_label_value(model: str) -> None:
    value = label_value(model)
    assert len(value) <= 63 and LABEL_VALUE.match(value), value


def test_capacity_patch_touches_only_our_resources_and_only_on_change() -> None:
    current = {"cpu": "64", "instaslice.io/mig-1g.18gb": "7", "instaslice.io/mig-old.gone": "1"}
    body = capacity_patch(
        {"instaslice.io/mig-1g.18gb": "7", "instaslice.io/mig-3g.71gb": "2"}, current
    )
    assert body == {
        "status": {
            "capacity": {"instaslice.io/mig-3g.71gb": "2", "instaslice.io/mig-old.gone": None},
            "allocatable": {"instaslice.io/mig-3g.71gb": "2", "instaslice.io/mig-old.gone": None},
        }
    }
    assert (
        capacity_patch({"instaslice.io/mig-1g.18gb": "7"}, {"instaslice.io/mig-1g.18gb": "7"})
        is None
    )


def test_mig_node_status_lists_profiles_claimed_and_foreign_slices() -> None:
    cp = Checkpoint("n1", "b1", {"u1": _rec("u1", 10), "u2": _rec("u2", None)})
    foreign = (Instance(0, G0, 13, 19, 6, 1, (0,), ("MIG-f",)),)
    status = mig_node_status(
        INV, {1: Health(False, "XID 79")}, cp, foreign, version="v", boot_id="b1"
    )
    assert status["gpuCount"] == 2 and status["agent"] == {"version": "v", "bootID": "b1"}
    g0, g1 = status["gpus"]
    assert g0["healthy"] and not g1["healthy"] and g1["message"] == "XID 79"
    assert g0["migMode"] == {"current": "enabled", "pending": "enabled"}
    names = [p["name"] for p in g0["profiles"]]
    assert "1g.18gb" in names and "7g.141gb" in names
    p3 = next(p for p in g0["profiles"] if p["name"] == "3g.71gb")
    assert p3["placements"] == [{"start": 0, "size": 4}, {"start": 4, "size": 4}]
    assert p3["maxCount"] == 2 and p3["id"] == 9
    # a ready record's slice carries its claim; an unrecorded instance has none
    assert g0["slices"] == [
        {"profile": "1g.18gb", "start": 3, "size": 1, "migUUID": "MIG-a", "claim": "claim-u1"},
        {"profile": "1g.18gb", "start": 6, "size": 1, "migUUID": "MIG-f"},
    ]
    assert g1["slices"] == []


def test_conditions_keep_transition_time_when_status_is_unchanged() -> None:
    first = with_condition([], condition("Ready", True, "SlicesCreated", "a", "t1"))
    again = with_condition(first, condition("Ready", True, "SlicesCreated", "b", "t2"))
    assert again[0]["lastTransitionTime"] == "t1" and again[0]["message"] == "b"
    flipped = with_condition(again, condition("Ready", False, "CreateFailed", "x", "t3"))
    assert flipped[0]["lastTransitionTime"] == "t3"
    both = with_condition(flipped, gpu_condition({0: Health(False, "XID 48")}, [0, 0, 1], "t4"))
    assert [c["type"] for c in both] == ["GPUHealthy", "Ready"]
    assert both[0]["status"] == "False" and both[0]["message"] == "GPU 0: XID 48"
    assert gpu_condition({}, [0], "t")["status"] == "True"


def test_checkpoint_round_trip_atomic_and_corrupt_file_is_set_aside(tmp_path: Path) -> None:
    path = tmp_path / "state" / "n1.agent.json"
    assert checkpoint.load(path, "n1") == Checkpoint("n1")
    cp = Checkpoint("n1", "b1", {"u1": _rec("u1", 10), "u2": _rec("u2", None, "creating")})
    checkpoint.save(path, cp)
    assert checkpoint.load(path, "n1") == cp
    doc = json.loads(path.read_text())
    assert doc["version"] == 1 and [c["uid"] for c in doc["claims"]] == ["u1", "u2"]
    assert not list(path.parent.glob(".*tmp"))
    path.write_text("{not json")
    assert checkpoint.load(path, "n1") == Checkpoint("n1")
    assert len(list(path.parent.glob("n1.agent.json.corrupt-*"))) == 1
    assert cp.without("u1").claims.keys() == {"u2"}
    assert cp.with_claim(_rec("u3", 1)).claims.keys() == {"u1", "u2", "u3"}
