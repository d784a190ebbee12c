"""DRA mode end to end on KWOK GPU nodes (`dra: true`): the real webhook, allocator and node
agents (emulated NVML), every component with `--allocation-mode dra` (docs/dra.md).

Covers: an unmodified pod asking `nvidia.com/mig-*` in an opted-in namespace is rewritten to
name a ResourceClaim; the allocator creates it, allocates it where its engine placed the pod
(devices of the node's pool) and reserves it, the gate comes off, the pod Runs on that node;
the node agent carves the claim's slices (MigNode instances at the devices' starts, CDI file);
`kubectl describe pod` shows SliceAllocated as in gate mode; a pod asking in two containers gets
one request each; deleting the pods leaves no claim, no finalizer, no instance; preemption:
the victims' claims are released and the preemptor's allocated on the freed GPU.
Leaves out: the kubelet's prepare (tests/e2e/test_realnode_dra.py, on the real node), races
with kube-scheduler (tests/integration/test_allocator_dra.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from common.constants import (
    CLAIM_ANNOTATION,
    DRA_DRIVER,
    NVIDIA_GPU,
    REASON_ALLOCATED,
    REASON_PREEMPTING,
    RELEASE_FINALIZER,
)
from common.draclaim import parse_device
from common.kubeapi import Kube, Obj, core_path, group_path, instaslice_path
from hack.cluster.priority import ensure_priority_classes
from testkit.builders import user_pod
from tests.e2e.conftest import _NODE, whole_gpu_namespace
from tests.e2e.helpers import pods_path, wait_event, wait_pod_running
from tests.support import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

OWN_SPEC: dict[str, Any] = {
    "dra": True,
    "nodes": [
        {"prefix": "dra", "count": 1, "gpus": 2, "model": "H100-80GB", **_NODE},
        {
            "prefix": "off",
            "count": 1,
            "gpus": 2,
            "model": "H100-80GB",
            "migMode": "disabled",
            **_NODE,
        },
    ],
}


LOW, HIGH = "e2e-dra-low", "e2e-dra-high"
ON_DRA = {"kubernetes.io/hostname": "dra-0"}  # the node in MIG mode
ON_OFF = {"kubernetes.io/hostname": "off-0"}  # the node whose GPUs start with MIG off


def claims_path(ns: str, name: str | None = None) -> str:
    return group_path("resource.k8s.io/v1", "resourceclaims", ns, name)


def instances(mig_node: Obj) -> set[tuple[int, int, str]]:
    """(GPU index, start, claim) of every instance the node agent reports."""
    out = set()
    for g in (mig_node.get("status") or {}).get("gpus") or []:
        for i in g.get("slices") or []:
            out.add((int(g["index"]), int(i["start"]), str(i.get("claim") or "")))
    return out


async def test_pods_get_their_slices_through_claims(own_kube: Kube, own_ns: str) -> None:
    kube, ns = own_kube, own_ns
    await kube.create(
        pods_path(ns), user_pod(name="one", slices={"main": {"1g.10gb": 1}}, node_selector=ON_DRA)
    )
    await kube.create(
        pods_path(ns),
        user_pod(
            name="two", slices={"a": {"3g.40gb": 1}, "b": {"1g.10gb": 2}}, node_selector=ON_DRA
        ),
    )
    carved: dict[str, list[tuple[int, int]]] = {}
    for name in ("one", "two"):
        pod = await wait_pod_running(kube, ns, name)
        node = pod["spec"]["nodeName"]
        claim_name = pod["metadata"]["annotations"][CLAIM_ANNOTATION]
        assert pod["spec"]["resourceClaims"] == [
            {"name": "instaslice", "resourceClaimName": claim_name}
        ]
        claim = await kube.get(claims_path(ns, claim_name))
        assert claim["metadata"]["finalizers"] == [RELEASE_FINALIZER]
        assert claim["status"]["reservedFor"][0]["uid"] == pod["metadata"]["uid"]
        results = claim["status"]["allocation"]["devices"]["results"]
        assert {(r["driver"], r["pool"]) for r in results} == {(DRA_DRIVER, node)}
        devices = [parse_device(r["device"]) for r in results]
        assert all(d is not None for d in devices)
        carved[claim_name] = [(d[0], d[2]) for d in devices if d is not None]
        await wait_event(kube, ns, name, REASON_ALLOCATED)
        for c in pod["spec"]["containers"]:
            assert [r["name"] for r in c["resources"].get("claims", [])] == ["instaslice"]
    assert len(carved[next(iter(carved))]) == 1 and sum(len(v) for v in carved.values()) == 4

    def made(objs: dict[str, Obj]) -> bool:
        held = set().union(*(instances(m) for m in objs.values()))
        want = {(g, s, c) for c, where in carved.items() for g, s in where}
        return want <= held

    await wait_for(kube, instaslice_path("mignodes"), made, what="the claims' instances made")

    for name in ("one", "two"):
        await kube.delete(core_path("pods", ns, name), {"gracePeriodSeconds": 0})
    await wait_for(
        kube, claims_path(ns), lambda objs: not objs, what="no claim left (finalizer dropped)"
    )

    def none_left(objs: dict[str, Obj]) -> bool:
        held = set().union(*(instances(m) for m in objs.values()))
        return not {h for h in held if h[2] in carved}

    await wait_for(kube, instaslice_path("mignodes"), none_left, what="the instances destroyed")


async def test_preemption_releases_the_victims_claims(own_kube: Kube, own_ns: str) -> None:
    """§6 in DRA mode: the node's two H100s full of low-priority 3g.40gb + 4g.40gb pods, then
    a high-priority 7g.80gb pod: the pods of one GPU are evicted, their claims released (gone:
    the agent destroyed their slices and dropped the finalizer), and the preemptor Runs on a
    claim of that GPU's whole 7g device."""
    kube, ns = own_kube, own_ns
    await ensure_priority_classes(kube, {LOW: 100, HIGH: 1000})
    lows = {f"low{i}": ("3g.40gb" if i % 2 else "4g.40gb") for i in range(4)}
    for name, profile in lows.items():
        body = user_pod(name=name, slices={"main": {profile: 1}}, node_selector=ON_DRA)
        body["spec"]["priorityClassName"] = LOW
        await kube.create(pods_path(ns), body)
    for name in lows:
        await wait_pod_running(kube, ns, name)
    body = user_pod(name="big", slices={"main": {"7g.80gb": 1}}, node_selector=ON_DRA)
    body["spec"]["priorityClassName"] = HIGH
    await kube.create(pods_path(ns), body)
    await wait_event(kube, ns, "big", REASON_PREEMPTING)
    pod = await wait_pod_running(kube, ns, "big")
    claim = await kube.get(claims_path(ns, pod["metadata"]["annotations"][CLAIM_ANNOTATION]))
    results = claim["status"]["allocation"]["devices"]["results"]
    assert [parse_device(r["device"])[1:] for r in results] == [(0, 0)]  # type: ignore[index]
    pods = (await kube.list(pods_path(ns)))["items"]
    left = {p["metadata"]["name"] for p in pods if not p["metadata"].get("deletionTimestamp")}
    assert len(left & set(lows)) == 2, left  # one GPU's two pods were the victims
    await wait_for(
        kube, claims_path(ns), lambda objs: len(objs) == 3, what="the victims' claims gone"
    )


async def test_whole_gpus_and_mig_mode_on_demand(own_kube: Kube) -> None:
    """§6 in DRA mode, on a node whose GPUs start with MIG off: a whole-GPU pod gets a claim
    of device `gpu-<i>` (whole, MIG left off), and a 1g.10gb pod a claim of the other GPU,
    whose MIG mode the node agent turns on to carve it."""
    kube = own_kube
    async with whole_gpu_namespace(kube, "dra-whole-") as ns:
        whole = user_pod(name="w", slices={}, node_selector=ON_OFF)
        whole["spec"]["containers"] = [
            {"name": "main", "image": "cuda", "resources": {"limits": {NVIDIA_GPU: "1"}}}
        ]
        await kube.create(pods_path(ns), whole)
        await kube.create(
            pods_path(ns), user_pod(name="m", slices={"main": {"1g.10gb": 1}}, node_selector=ON_OFF)
        )
        devices = {}
        for name in ("w", "m"):
            pod = await wait_pod_running(kube, ns, name)
            assert pod["spec"]["nodeName"] == "off-0"
            claim = await kube.get(
                claims_path(ns, pod["metadata"]["annotations"][CLAIM_ANNOTATION])
            )
            (result,) = claim["status"]["allocation"]["devices"]["results"]
            devices[name] = parse_device(result["device"])
        assert devices["w"] is not None and devices["w"][1] is None  # `gpu-<i>`: whole
        assert devices["m"] is not None and devices["m"][1] is not None
        assert devices["w"][0] != devices["m"][0]

        def mig_on_for_m(objs: dict[str, Obj]) -> bool:
            gpus = (objs.get("off-0", {}).get("status") or {}).get("gpus") or []
            m = devices["m"]
            assert m is not None
            g: Obj = next((g for g in gpus if g.get("index") == m[0]), {})
            return (g.get("migMode") or {}).get("current") == "enabled" and bool(g.get("slices"))

        await wait_for(kube, instaslice_path("mignodes"), mig_on_for_m, what="MIG on, 1g made")
