"""Finding the node's NVIDIA CDI spec (nodeagent.main.find_base_spec) and the MigNode condition
that reports it (nodeagent.report). Files in a tmp dir; the integration test
(test_nodeagent.py) checks the condition and event reach the API server."""

from __future__ import annotations

from pathlib import Path

import yaml

from nodeagent import cdi
from nodeagent.main import find_base_spec
from nodeagent.report import mig_node_status
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


def test_mig_node_status_carries_conditions_only_when_given() -> None:
    from nodeagent.checkpoint import Checkpoint
    from nodeagent.model import NodeInventory

    inv = NodeInventory(gpus=(), instances=(), lost=())
    cp = Checkpoint(node="n", boot_id="b", claims={})
    plain = mig_node_status(inv, {}, cp, [], version="v", boot_id="b")
    assert "conditions" not in plain
    _, cond = find_base_spec(())
    with_cond = mig_node_status(inv, {}, cp, [], version="v", boot_id="b", conditions=[cond])
    assert with_cond["conditions"] == [cond]
