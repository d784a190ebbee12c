"""Finding the node's NVIDIA CDI spec (nodeagent.main.find_base_spec) and the MigNode condition
that reports it (nodeagent.report); the per-slice info series (nodeagent.report.slice_info,
nodeagent.metrics.SliceInfo). Files in a tmp dir; the integration test (test_nodeagent.py)
checks the condition and event reach the API server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from nodeagent import cdi
from nodeagent.main import find_base_spec
from nodeagent.metrics import AgentMetrics
from nodeagent.report import (
    SLICE_INFO_LABELS,
    conflict_condition,
    conflicts,
    mig_node_status,
    slice_info,
)
from nodeagent.settings import DEFAULT_NVIDIA_CDI_SPECS, Settings


def test_default_search_includes_the_gpu_operators_spec_after_nvidia_ctks() -> None:
    assert (
        Path("/var/run/cdi/nvidia.yaml"),
        Path("/etc/cdi/nvidia.yaml"),
        Path("/var/run/cdi/management.nvidia.com-gpu.yaml"),
    ) == DEFAULT_NVIDIA_CDI_SPECS
    assert Settings(nodes=("n",)).cdi_specs == DEFAULT_NVIDIA_CDI_SPECS


def test_first_existing_spec_wins(tmp_path: Path) -> None:
    a, b, c = (tmp_path / n for n in ("nvidia.yaml", "etc.yaml", "management.nvidia.com-gpu.yaml"))
    operator = {**cdi.fake_nvidia_spec(), "kind": "management.nvidia.com/gpu"}
    c.write_text(yaml.safe_dump(operator))
    spec, cond = find_base_spec((a, b, c))
    assert spec is not None and spec["kind"] == "management.nvidia.com/gpu"
    assert (cond["type"], cond["status"], cond["reason"]) == ("BaseCdiSpecFound", "True", "Found")
    assert str(c) in cond["message"]
    a.write_text(yaml.safe_dump(cdi.fake_nvidia_spec()))
    spec, cond = find_base_spec((a, b, c))
    assert spec is not None and spec["kind"] == "nvidia.com/gpu" and str(a) in cond["message"]


def test_none_found_is_a_false_condition_naming_every_path(tmp_path: Path) -> None:
    tried = (tmp_path / "x.yaml", tmp_path / "y.yaml")
    spec, cond = find_base_spec(tried)
    assert spec is None
    assert (cond["status"], cond["reason"]) == ("False", "BaseCdiSpecNotFound")
    assert all(str(t) in cond["message"] for t in tried)
    assert "nvidia-ctk cdi generate" in cond["message"]


def test_mig_node_status_carries_its_findings_and_the_ready_summary() -> None:
    from nodeagent.checkpoint import Checkpoint
    from nodeagent.model import NodeInventory

    inv = NodeInventory(gpus=(), instances=(), lost=())
    cp = Checkpoint(node="n", boot_id="b", claims={})
    plain = mig_node_status(inv, {}, cp, [], version="v", boot_id="b", now="T")
    assert [(c["type"], c["status"], c["reason"]) for c in plain["conditions"]] == [
        ("Ready", "False", "NoGpus")
    ]
    _, cond = find_base_spec(())
    with_cond = mig_node_status(
        inv, {}, cp, [], version="v", boot_id="b", conditions=[cond], now="T"
    )
    found, ready = with_cond["conditions"]
    assert found == {**cond, "lastTransitionTime": "T"}
    assert (ready["type"], ready["status"], ready["reason"]) == (
        "Ready", "False", "BaseCdiSpecNotFound",
    )  # fmt: skip


# --- instaslice_slice_info ------------------------------------------------------------------


def _alloc(node: str, phase: str, mig: str = "MIG-1", gi: int | None = 3) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase, "slices": [{"container": "c", "migUUID": mig}]}
    if gi is not None:
        status["slices"][0]["giID"] = gi
    return {
        "metadata": {"namespace": "team", "name": "claim-1"},
        "spec": {"podName": "p", "nodeName": node,
                 "slices": [{"container": "c", "profile": "1g.18gb+me", "gpuUUID": "GPU-0",
                             "start": 0, "size": 1}]},
        "status": status,
    }  # fmt: skip


def test_slice_info_names_the_pod_of_each_ready_slice_on_the_node() -> None:
    allocs = [_alloc("n1", "Ready"), _alloc("n1", "Creating"), _alloc("n2", "Ready")]
    assert slice_info("n1", allocs) == [
        ("team", "p", "c", "n1", "GPU-0", "MIG-1", "3", "1g.18gb+me")
    ]
    assert dict(zip(SLICE_INFO_LABELS, slice_info("n1", allocs)[0], strict=True))["gi_id"] == "3"


def test_slice_info_is_exported_when_scraped_and_declared_when_empty() -> None:
    m = AgentMetrics()
    families = {
        f.name: f for f in text_string_to_metric_families(generate_latest(m.registry).decode())
    }
    assert "instaslice_slice_info" in families and not families["instaslice_slice_info"].samples
    allocs = {"u": _alloc("n1", "Ready")}
    m.slice_info.sources.append(lambda: slice_info("n1", allocs.values()))
    text = generate_latest(m.registry).decode()
    (sample,) = next(
        f for f in text_string_to_metric_families(text) if f.name == "instaslice_slice_info"
    ).samples
    assert (
        sample.value == 1 and sample.labels["pod"] == "p" and sample.labels["mig_uuid"] == "MIG-1"
    )
    allocs.clear()  # the slice is released: the series goes with it
    assert "instaslice_slice_info{" not in generate_latest(m.registry).decode()


# --- conflicting managers on the node ---------------------------------------------------------


def test_conflicts_from_gpu_operator_labels_and_foreign_instances() -> None:
    assert conflicts({}, 0) == {}
    assert conflicts({"nvidia.com/gpu.deploy.device-plugin": "false"}, 0) == {}
    ok_mig = {"nvidia.com/mig.config": "all-enabled", "nvidia.com/gpu.deploy.mig-manager": "true"}
    assert conflicts(ok_mig, 0) == {}
    off = {"nvidia.com/mig.config": "all-1g.10gb", "nvidia.com/gpu.deploy.mig-manager": "false"}
    assert conflicts(off, 0) == {}
    found = conflicts(
        {"nvidia.com/gpu.deploy.device-plugin": "true", "nvidia.com/mig.config": "all-balanced"},
        2,
    )
    assert list(found) == ["device_plugin", "mig_manager", "foreign_instances"]
    assert "nvidia.com/gpu.deploy.device-plugin=false" in found["device_plugin"]
    cond = conflict_condition(found, "2026-01-01T00:00:00Z")
    assert (cond["type"], cond["status"], cond["reason"]) == (
        "ConflictFree",
        "False",
        "DevicePluginActive",
    )
    assert "2 GPU instance(s)" in cond["message"]
    assert conflict_condition({}, "t")["status"] == "True"
