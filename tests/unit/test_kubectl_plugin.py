"""kubectl-instaslice rendering: slot maps and pod listing from MigNode/SliceAllocation JSON.

Covers the pure renderers, the `-o json|yaml` rows, the flags and gather's filters; fetching
from a live cluster, --context, a tenant's view and gather's archive are in
tests/integration/test_kubectl_plugin.py.
"""

import json
from typing import Any

import pytest
import yaml

from common.gather import gated_pods, instaslice_events
from common.kubectl_plugin import build_parser, dump, gpu_rows, pod_rows, render_nodes, render_pods


def _mignode(name: str, slices: list[dict[str, object]], healthy: bool = True) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "status": {
            "gpus": [
                {
                    "index": 0,
                    "uuid": f"GPU-{name}-0",
                    "model": "H100-80GB",
                    "migMode": {"current": "enabled", "pending": "enabled"},
                    "healthy": healthy,
                    "profiles": [
                        {"name": "7g.80gb", "id": 0, "placements": [{"start": 0, "size": 8}]}
                    ],
                    "slices": slices,
                }
            ]
        },
    }


def _alloc(
    ns: str, pod: str, gpu: str, start: int, size: int, phase: str = "Ready"
) -> dict[str, Any]:
    return {
        "metadata": {"namespace": ns, "name": f"claim-{pod}"},
        "spec": {
            "podName": pod,
            "nodeName": "n0",
            "slices": [
                {
                    "container": "c",
                    "profile": "3g.40gb",
                    "gpuUUID": gpu,
                    "gpuIndex": 0,
                    "start": start,
                    "size": size,
                }
            ],
        },
        "status": {"phase": phase, "slices": [{"container": "c", "migUUID": "MIG-abc"}]},
    }


def test_nodes_draw_holders_foreign_and_free_slots() -> None:
    node = _mignode("n0", [{"profile": "1g.10gb", "start": 6, "size": 1, "migUUID": "MIG-x"}])
    out = render_nodes([node], [_alloc("team", "train", "GPU-n0-0", 0, 4)])
    line = next(ln for ln in out.splitlines() if ln.startswith("n0"))
    assert line.endswith("|AAAA..#.|")
    assert "A = team/train 3g.40gb [0:4] Ready" in out


def test_nodes_draw_orphaned_instance_as_occupied() -> None:
    # the claim's allocation is gone (finalizer force-removed) but the instance still exists
    node = _mignode("n0", [{"profile": "1g.10gb", "start": 2, "size": 1, "claim": "gone"}])
    line = next(ln for ln in render_nodes([node], []).splitlines() if ln.startswith("n0"))
    assert line.endswith("|..#.....|")


def test_nodes_show_a_gpu_beyond_the_bounds_as_refused_without_drawing_it() -> None:
    """Finding 3 (docs/security.md): a placement at start 10^18 was drawn as a list of
    10^18 cells. Such a GPU is shown REFUSED, with the reason, as the allocator treats it."""
    node = _mignode("n0", [])
    node["status"]["gpus"][0]["profiles"][0]["placements"].append({"start": 10**18, "size": 1})
    out = render_nodes([node], [])
    line = next(ln for ln in out.splitlines() if ln.startswith("n0"))
    assert "REFUSED" in line and line.endswith("|?|")
    assert "n0 GPU 0: beyond InstaSlice's bounds" in out and "16 memory slots" in out
    (row,) = gpu_rows([node], [])
    assert "16 memory slots" in row["refused"]
    assert gpu_rows([_mignode("n0", [])], [])[0]["refused"] is None


def test_nodes_flag_unhealthy_gpu() -> None:
    out = render_nodes([_mignode("n1", [], healthy=False)], [])
    assert "UNHEALTHY" in out
    assert "|........|" in out


def test_pods_list_has_every_column() -> None:
    out = render_pods([_alloc("team", "train", "GPU-n0-0", 4, 4, phase="Creating")])
    header, row = out.splitlines()
    assert header.split() == [
        "NAMESPACE",
        "POD",
        "NODE",
        "GPU",
        "PROFILE",
        "PLACEMENT",
        "MIG",
        "UUID",
        "PHASE",
    ]
    assert row.split() == ["team", "train/c", "n0", "0", "3g.40gb", "4:4", "MIG-abc", "Creating"]


# --- -o json|yaml rows, flags, gather's pure parts ------------------------------------------


def test_pod_rows_are_the_text_columns_as_data() -> None:
    (row,) = pod_rows([_alloc("team", "train", "GPU-n0-0", 4, 4, phase="Creating")])
    assert row == {
        "namespace": "team",
        "pod": "train",
        "container": "c",
        "node": "n0",
        "gpu": "0",
        "profile": "3g.40gb",
        "placement": "4:4",
        "migUUID": "MIG-abc",
        "phase": "Creating",
        "claim": "claim-train",
    }
    assert json.loads(dump([row], "json")) == [row]
    assert yaml.safe_load(dump([row], "yaml")) == [row]


def test_gpu_rows_separate_held_and_unclaimed_instances() -> None:
    node = _mignode("n0", [{"profile": "1g.10gb", "start": 6, "size": 1, "migUUID": "MIG-x"}])
    (gpu,) = gpu_rows([node], [_alloc("team", "train", "GPU-n0-0", 0, 4)])
    assert gpu["node"] == "n0" and gpu["healthy"] is True
    assert gpu["slices"] == [
        {"pod": "team/train", "profile": "3g.40gb", "start": 0, "size": 4, "phase": "Ready"}
    ]
    assert gpu["unclaimed"] == [{"profile": "1g.10gb", "start": 6, "size": 1}]


def test_namespace_and_all_namespaces_exclude_each_other() -> None:
    p = build_parser()
    assert p.parse_args(["pods", "-A", "-o", "json"]).all_namespaces
    assert p.parse_args(["pods", "--context", "c", "-n", "x"]).namespace == "x"
    with pytest.raises(SystemExit):
        p.parse_args(["pods", "-A", "-n", "x"])


def test_gather_keeps_only_instaslice_events_and_gated_pods() -> None:
    events = {
        "items": [
            {"reason": "Scheduled", "involvedObject": {"namespace": "a"}},
            {"reason": "SliceReady", "lastTimestamp": "2026-01-01T00:00:02Z"},
            {"reason": "Pulled", "involvedObject": {"namespace": "instaslice-system"}},
            {"reason": "Other", "source": {"component": "instaslice-nodeagent"},
             "lastTimestamp": "2026-01-01T00:00:01Z"},
        ]
    }  # fmt: skip
    assert [e["reason"] for e in instaslice_events(json.dumps(events))] == [
        "Pulled",
        "Other",
        "SliceReady",
    ]
    pods = {
        "items": [
            {"metadata": {"namespace": "a", "name": "p"},
             "spec": {"schedulingGates": [{"name": "instaslice.io/allocation"}]}},
            {"metadata": {"namespace": "a", "name": "q"}, "spec": {}},
        ]
    }  # fmt: skip
    assert gated_pods(json.dumps(pods)) == ["a/p"]


@pytest.mark.parametrize("slots", [False, True])
def test_kueue_config_prints_the_generated_transformations_and_flavors(
    slots: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    from common.catalog import load_catalog
    from common.kubectl_plugin import main
    from common.quota import kueue_resources

    assert main(["kueue-config", *(["--slot-accounting"] if slots else [])]) == 0
    config, *flavors = yaml.safe_load_all(capsys.readouterr().out)
    catalog = load_catalog()
    assert config == {"resources": kueue_resources(catalog, slot_accounting=slots)}
    assert {f["spec"]["nodeLabels"]["instaslice.io/gpu-model"] for f in flavors} == {
        m.name for m in catalog.models
    }
    assert all(f["kind"] == "ResourceFlavor" for f in flavors)


def test_nodes_show_mode_and_mode_changes() -> None:
    on = _mignode("n0", [])
    off = _mignode("n1", [])
    off["status"]["gpus"][0].update(
        migMode={"current": "disabled", "pending": "disabled"}, modeToggle="resetless"
    )
    failed = _mignode("n2", [])
    failed["status"]["gpus"][0].update(
        migMode={"current": "disabled", "pending": "disabled"},
        modeToggle="resetless",
        modeChange={"phase": "Failed", "message": "1 compute process(es) run on it"},
    )
    draining = _mignode("n3", [])
    draining["status"]["gpus"][0].update(modeToggle="reset", modeChange={"phase": "Draining"})
    out = render_nodes([on, off, failed, draining], [])
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines() if ln.startswith("n")}
    assert rows["n3"][3:5] == ["enabled", "draining"]  # Ampere maintenance under way
    assert rows["n0"][3:5] == ["enabled", "-"]  # an older agent: no modeToggle
    assert rows["n1"][3:5] == ["disabled", "resetless"]
    assert rows["n2"][3:5] == ["disabled", "FAILED"]
    assert "n2 GPU 0: MIG mode change failed, avoided for a back-off: 1 compute process" in out
