"""MIG mode on demand, end to end: `make dev-up` with GPUs that start with MIG off.

Covers: on an H100 node whose two GPUs start `migMode: disabled`, a MIG pod is admitted,
placed, its GPU's MIG mode enabled by the node agent on demand, and it runs with its CDI
binding (the full invariant of `assert_holds_slices`); MigNode shows each GPU's current mode
(one enabled, one still disabled: no needless toggle) with architecture and modeToggle; a
second MIG pod goes to the GPU already in MIG mode; a pod whose profile only an Ampere GPU
with MIG off offers stays Pending with an AllocationPending event naming the GPU
(NeedsMigModeChange), and so does a pod asking by size that only that GPU's model serves;
`kubectl instaslice nodes` shows the modes.
In a namespace that also carries `instaslice.io/whole-gpu: "true"`, two `nvidia.com/gpu: 1`
pods each run on a GPU of their own with MIG off (left off, or turned off on demand), the
CDI device naming exactly that GPU (its UUID and device node, no capability nodes); in a
namespace without it, an `nvidia.com/gpu` pod is left alone.
Leaves out: the agent's failure paths
(tests/integration/test_nodeagent_modes.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from common.constants import (
    CLAIM_ANNOTATION,
    GPU_MODEL_LABEL,
    INSTASLICE_GPU,
    NVIDIA_GPU,
    REASON_PENDING,
    SIZE_ANNOTATION_PREFIX,
    VISIBLE_DEVICES_ENV,
    qualified_cdi_device,
)
from common.kubeapi import Kube, Obj, instaslice_path
from hack.dev import DevSystem
from testkit.builders import user_pod
from tests.e2e.conftest import _NODE, whole_gpu_namespace
from tests.e2e.helpers import (
    allocs_path,
    assert_holds_slices,
    cdi_file_for,
    plugin_nodes,
    pods_path,
    wait_event,
    wait_pod_running,
)
from tests.support import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]
OWN_SPEC: dict[str, Any] = {  # own_system
    "nodes": [
        {
            "prefix": "off",
            "count": 1,
            "gpus": 2,
            "model": "H100-80GB",
            "migMode": "disabled",
            **_NODE,
        },
        {
            "prefix": "amp",
            "count": 1,
            "gpus": 1,
            "model": "A100-40GB",
            "migMode": "disabled",
            **_NODE,
        },
    ]
}


async def _gpus(
    kube: Kube, node: str, until: Callable[[list[dict[str, Any]]], bool] | None = None
) -> list[dict[str, Any]]:
    """The node's MigNode GPUs; with `until`, once they pass it (the agent publishes MigNode
    status on its own beat, a moment after a pod runs)."""

    def check(objs: dict[str, Obj]) -> list[dict[str, Any]] | None:
        gpus: list[dict[str, Any]] = (objs.get(node) or {}).get("status", {}).get("gpus") or []
        return gpus if gpus and (until is None or until(gpus)) else None

    return await wait_for(
        kube,
        instaslice_path("mignodes"),
        check,
        what=f"{node}'s MigNode GPUs",
        fieldSelector=f"metadata.name={node}",
    )


async def test_mig_pods_on_gpus_that_start_with_mig_off(
    own_kube: Kube, own_ns: str, own_system: DevSystem
) -> None:
    before = await _gpus(own_kube, "off-0")
    assert [g["migMode"]["current"] for g in before] == ["disabled", "disabled"]
    assert {(g["architecture"], g["modeToggle"]) for g in before} == {("hopper", "resetless")}

    await own_kube.create(
        pods_path(own_ns), user_pod(name="first", slices={"main": {"3g.40gb": 1}})
    )
    await wait_pod_running(own_kube, own_ns, "first")
    alloc = await assert_holds_slices(own_kube, own_system, own_ns, "first")
    gpu = alloc["spec"]["slices"][0]["gpuIndex"]
    after = await _gpus(own_kube, "off-0", lambda g: "lastModeChange" in g[gpu])
    assert after[gpu]["migMode"] == {"current": "enabled", "pending": "enabled"}
    assert after[gpu]["lastModeChange"]["to"] == "enabled"
    assert after[1 - gpu]["migMode"]["current"] == "disabled"  # no needless toggle

    await own_kube.create(
        pods_path(own_ns), user_pod(name="second", slices={"main": {"2g.20gb": 1}})
    )
    await wait_pod_running(own_kube, own_ns, "second")
    second = await assert_holds_slices(own_kube, own_system, own_ns, "second")
    assert second["spec"]["slices"][0]["gpuIndex"] == gpu  # the GPU already in MIG mode
    assert (await _gpus(own_kube, "off-0"))[1 - gpu]["migMode"]["current"] == "disabled"

    shown = await plugin_nodes(own_system)
    rows = [ln.split() for ln in shown.splitlines() if ln.startswith("off-0")]
    assert sorted(r[3:5] for r in rows) == [
        ["disabled", "resetless"],
        ["enabled", "resetless"],
    ], shown


async def test_ampere_gpu_with_mig_off_is_named_in_the_pending_reason(
    own_kube: Kube, own_ns: str
) -> None:
    await own_kube.create(pods_path(own_ns), user_pod(name="amp", slices={"main": {"1g.5gb": 1}}))
    event = await wait_event(own_kube, own_ns, "amp", REASON_PENDING)
    assert "amp-0/GPU 0" in event["message"] and "needs a GPU reset" in event["message"], event
    pod = await own_kube.get(pods_path(own_ns, "amp"))
    assert pod["status"].get("phase") == "Pending" and not pod["spec"].get("nodeName")


async def test_a_sized_pod_only_an_ampere_gpu_with_mig_off_serves_is_named_too(
    own_kube: Kube, own_ns: str
) -> None:
    """As the pod above, asking by size (`memory>=4Gi`, resolved on the A100-40GB: 1g.5gb)."""
    pod = user_pod(name="amp-sized", slices={}, node_selector={GPU_MODEL_LABEL: "A100-40GB"})
    pod["spec"]["containers"] = [{"name": "main", "image": "registry.k8s.io/pause:3.10"}]
    pod["metadata"]["annotations"] = {SIZE_ANNOTATION_PREFIX + "main": "memory>=4Gi"}
    await own_kube.create(pods_path(own_ns), pod)
    event = await wait_event(own_kube, own_ns, "amp-sized", REASON_PENDING)
    assert "amp-0/GPU 0" in event["message"] and "needs a GPU reset" in event["message"], event


async def test_whole_gpu_pods_in_a_namespace_opted_in_to_whole_gpus(
    own_kube: Kube, own_system: DevSystem
) -> None:
    """Two `nvidia.com/gpu: 1` pods on the H100 node: each gets a GPU of its own with MIG
    off (one left off, or set off on demand), bound by CDI to exactly that GPU."""
    async with whole_gpu_namespace(own_kube, "whole-") as ns:
        seen: set[str] = set()
        for name in ("w1", "w2"):
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name},
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": "off-0"},
                    "containers": [
                        {
                            "name": "main",
                            "image": "cuda",
                            "resources": {"limits": {NVIDIA_GPU: "1"}},
                        }
                    ],
                    "terminationGracePeriodSeconds": 0,
                },
            }
            await own_kube.create(pods_path(ns), pod)
            running = await wait_pod_running(own_kube, ns, name)
            limits = running["spec"]["containers"][0]["resources"]["limits"]
            assert limits == {INSTASLICE_GPU: "1"}, limits
            claim = running["metadata"]["annotations"][CLAIM_ANNOTATION]
            alloc = await own_kube.get(allocs_path(ns, claim))
            assert alloc["status"]["phase"] == "Ready"
            (spec,) = alloc["spec"]["slices"]
            assert (spec["kind"], spec["profile"], spec["start"], spec["size"]) == (
                "gpu",
                "gpu",
                0,
                8,
            )
            gpu_uuid = spec["gpuUUID"]
            seen.add(gpu_uuid)
            found = cdi_file_for(own_system, "off-0", ns, claim)
            assert found is not None
            (device,) = found[1]["devices"]
            edits = device["containerEdits"]
            assert edits["env"] == [f"{VISIBLE_DEVICES_ENV}={gpu_uuid}"]
            index = spec["gpuIndex"]
            assert [n["path"] for n in edits["deviceNodes"]] == [f"/dev/nvidia{index}"]
            env = {e["name"]: e.get("value") for e in running["spec"]["containers"][0]["env"]}
            assert env[VISIBLE_DEVICES_ENV] == qualified_cdi_device(ns, claim, "main")

            def whole_shown(gpus: list[dict[str, Any]], i: int = index) -> bool:
                return [s["profile"] for s in gpus[i].get("slices") or []] == ["gpu"]

            gpus = await _gpus(own_kube, "off-0", whole_shown)
            assert gpus[index]["migMode"] == {"current": "disabled", "pending": "disabled"}
        assert len(seen) == 2  # a GPU each


async def test_nvidia_gpu_pods_elsewhere_are_left_alone(own_kube: Kube, own_ns: str) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "plain-gpu"},
        "spec": {"containers": [{"name": "main", "image": "cuda",
                                 "resources": {"limits": {NVIDIA_GPU: "1"}}}]},
    }  # fmt: skip
    created = await own_kube.create(pods_path(own_ns), pod)
    assert created["spec"]["containers"][0]["resources"]["limits"] == {NVIDIA_GPU: "1"}
    assert not created["spec"].get("schedulingGates")
    assert CLAIM_ANNOTATION not in (created["metadata"].get("annotations") or {})
