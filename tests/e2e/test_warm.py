"""Warm slices end to end (docs/warm-slices.md): `--warm-slices=on` agents on KWOK GPU nodes.

Covers: a first pod's ask teaches the node agent its demand; the agent makes a warm slice
where the allocator places next; the MigNode lists it `warm: true` with no claim, and
`kubectl instaslice nodes` draws it `w`; a second pod asking the same profile is placed on
it and runs with that very instance (its MIG UUID), with no instance made for it.
Leaves out: the handover's crash safety and NVML call counts
(tests/integration/test_nodeagent_warm.py), the tie-break's arithmetic
(tests/unit/test_placement_warm.py), hit rates under load (bench.latency).
"""

from __future__ import annotations

from typing import Any

import pytest

from common.kubeapi import Kube, Obj, instaslice_path
from hack.dev import DevSystem
from testkit.builders import user_pod
from tests.e2e.conftest import _NODE
from tests.e2e.helpers import assert_holds_slices, plugin_nodes, pods_path, wait_pod_running
from tests.support import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]
OWN_SPEC: dict[str, Any] = {  # own_system
    "nodes": [{"prefix": "warm", "count": 1, "gpus": 2, "model": "H100-80GB", **_NODE}]
}
OWN_AGENT_ARGS = ("--warm-slices=on",)


async def _warm_slices(kube: Kube) -> list[tuple[int, Obj]]:
    def warm(objs: dict[str, Obj]) -> list[tuple[int, Obj]] | None:
        gpus = ((objs.get("warm-0") or {}).get("status") or {}).get("gpus") or []
        found = [(g["index"], s) for g in gpus for s in g.get("slices") or [] if s.get("warm")]
        return found or None

    got: list[tuple[int, Obj]] = await wait_for(
        kube, instaslice_path("mignodes"), warm, what="a warm slice on warm-0", within=60
    )
    return got


async def test_a_pod_runs_on_a_warm_slice_and_the_slot_map_shows_warm(
    own_kube: Kube, own_system: DevSystem, own_ns: str
) -> None:
    await own_kube.create(
        pods_path(own_ns), user_pod(name="first", slices={"main": {"1g.10gb": 1}})
    )
    await wait_pod_running(own_kube, own_ns, "first")
    ((gpu, warm),) = await _warm_slices(own_kube)  # one per node by default on one GPU
    assert warm["profile"] == "1g.10gb" and "claim" not in warm, warm

    shown = await plugin_nodes(own_system)
    row = next(ln for ln in shown.splitlines() if ln.split()[:2] == ["warm-0", str(gpu)])
    slots = row.split()[-1].strip("|")
    assert slots[warm["start"]] == "w", shown
    assert "w = warm" in shown

    await own_kube.create(
        pods_path(own_ns), user_pod(name="second", slices={"main": {"1g.10gb": 1}})
    )
    await wait_pod_running(own_kube, own_ns, "second")
    alloc = await assert_holds_slices(own_kube, own_system, own_ns, "second")
    placed = alloc["spec"]["slices"][0]
    assert (placed["gpuIndex"], placed["start"]) == (gpu, warm["start"]), (placed, warm)
    assert alloc["status"]["slices"][0]["migUUID"] == warm["migUUID"]
