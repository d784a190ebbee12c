"""Whole-GPU preemption end to end: `make dev-up` (webhook, allocator with its default
`--preemption=gpu`, the emulated node agent) on one KWOK node with two H100s in MIG mode.

Covers: in a namespace opted in to whole GPUs, both GPUs hold low-priority MIG pods (one of
them also a pod of the preemptor's own priority); a high-priority `nvidia.com/gpu: 1` pod is
admitted (rewritten to `instaslice.io/gpu`), evicts exactly the low pods of the other GPU
(Preempting / Preempted events), the agent turns that GPU's MIG mode off once their
instances are gone, and the pod runs with the GPU bound by CDI; the pods of the first GPU run
on. Leaves out: Ampere GPUs and the planner's choices (tests/integration,
tests/unit/test_preempt_whole.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from common.constants import (
    CLAIM_ANNOTATION,
    INSTASLICE_GPU,
    NVIDIA_GPU,
    REASON_PREEMPTED,
    REASON_PREEMPTING,
)
from common.kubeapi import Kube, Obj
from hack.cluster.priority import ensure_priority_classes
from hack.dev import DevSystem
from nodeagent.emulator import EmulatorControl
from testkit.builders import user_pod
from tests.e2e.conftest import _NODE, whole_gpu_namespace
from tests.e2e.helpers import allocs_path, cdi_file_for, pods_path, wait_event, wait_pod_running

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
OWN_SPEC: dict[str, Any] = {  # own_system
    "nodes": [{"prefix": "hop", "count": 1, "gpus": 2, "model": "H100-80GB", **_NODE}]
}
NODE = "hop-0"
LOW, HIGH = "e2e-whole-low", "e2e-whole-high"


async def pod(kube: Kube, ns: str, name: str, klass: str, asks: dict[str, str]) -> Obj:
    body = user_pod(name=name, slices={}, node_selector={"kubernetes.io/hostname": NODE})
    body["spec"]["containers"] = [{"name": "main", "image": "cuda", "resources": {"limits": asks}}]
    body["spec"]["priorityClassName"] = klass
    body["spec"]["terminationGracePeriodSeconds"] = 0
    return await kube.create(pods_path(ns), body)


async def gpu_of(kube: Kube, ns: str, name: str) -> str:
    allocs = (await kube.list(allocs_path(ns)))["items"]
    return str(
        next(a for a in allocs if a["spec"]["podName"] == name)["spec"]["slices"][0]["gpuUUID"]
    )


async def test_a_whole_gpu_pod_evicts_the_low_priority_mig_pods_of_one_gpu(
    own_kube: Kube, own_system: DevSystem
) -> None:
    kube = own_kube
    await ensure_priority_classes(kube, {LOW: 100, HIGH: 1000})
    async with whole_gpu_namespace(kube, "whole-preempt-") as ns:
        # a 4g starts only at slot 0: one on each GPU; then a 3g beside each
        for name, klass, profile in (
            ("lo-a", LOW, "4g.40gb"),
            ("lo-b", LOW, "4g.40gb"),
            ("lo-c", LOW, "3g.40gb"),
            ("peer", HIGH, "3g.40gb"),
        ):
            await pod(kube, ns, name, klass, {f"nvidia.com/mig-{profile}": "1"})
            await wait_pod_running(kube, ns, name)
        target = await gpu_of(kube, ns, "lo-c")
        assert await gpu_of(kube, ns, "peer") != target
        victims = {n for n in ("lo-a", "lo-b") if await gpu_of(kube, ns, n) == target} | {"lo-c"}

        await pod(kube, ns, "train", HIGH, {NVIDIA_GPU: "1"})
        running = await wait_pod_running(kube, ns, "train")
        assert running["spec"]["containers"][0]["resources"]["limits"] == {INSTASLICE_GPU: "1"}
        pods = (await kube.list(pods_path(ns)))["items"]
        alive = {p["metadata"]["name"] for p in pods if not p["metadata"].get("deletionTimestamp")}
        assert alive == {"train", "peer", *({"lo-a", "lo-b"} - victims)}
        claim = running["metadata"]["annotations"][CLAIM_ANNOTATION]
        alloc = await kube.get(allocs_path(ns, claim))
        (spec,) = alloc["spec"]["slices"]
        assert (spec["kind"], spec["gpuUUID"], alloc["status"]["phase"]) == ("gpu", target, "Ready")
        gpu = next(g for g in EmulatorControl(own_system.gpu_state, NODE).state().gpus
                   if g.uuid == target)  # fmt: skip
        assert (gpu.mig_current, gpu.mig_pending) == (0, 0)  # turned off, no reset
        assert cdi_file_for(own_system, NODE, ns, claim) is not None
        preempting = await wait_event(kube, ns, "train", REASON_PREEMPTING)
        assert all(f"{ns}/{n}" in preempting["message"] for n in victims)
        for name in sorted(victims):
            event = await wait_event(kube, ns, name, REASON_PREEMPTED)
            assert f"{ns}/train" in event["message"]
