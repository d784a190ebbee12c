"""kubectl-instaslice rendering: slot maps and pod listing from MigNode/SliceAllocation JSON.

Covers the pure renderers only; fetching from a live cluster is exercised by the e2e tests.
"""

from typing import Any

from common.kubectl_plugin import render_nodes, render_pods


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
