"""Preemption end to end: the webhook/allocator process (its default `--preemption=gpu`) and
the emulated node agents on KWOK GPU nodes, users' pods asking `nvidia.com/mig-*`.

Covers the issue's Done-when: every H100 GPU (the only model offering 1g.10gb and 7g.80gb)
full of low-priority 1g pods, then a high-priority 7g pod → it runs, and exactly the seven
pods of one GPU are evicted (Preempting/Preempted events), their instances destroyed and the
7g's made; with a PodDisruptionBudget guarding the pods of every other GPU, the unguarded
GPU is chosen; a size-based ask (`instaslice.io/mig-size.<container>`) preempts as the profile
it resolves to; a `preemptionPolicy: Never` pod preempts nothing and says so; the node agent
killed (-9) while it destroys the victims' instances and restarted: the 7g still runs, no
instance leaks and no slot is promised twice.
Leaves out the other fault cases (tests/integration/test_allocator_preemption.py) and real
containers (KWOK runs none).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from common.constants import (
    GPU_MODEL_LABEL,
    REASON_PENDING,
    REASON_PREEMPTED,
    REASON_PREEMPTING,
)
from common.kubeapi import Kube, Obj, core_path, group_path
from hack.cluster.priority import ensure_priority_classes
from hack.dev import DevSystem
from nodeagent.emulator import EmulatorControl
from testkit.builders import user_pod
from tests.e2e.helpers import (
    allocs_path,
    assert_holds_slices,
    assert_node_matches,
    pods_path,
    wait_event,
    wait_pod_running,
)
from tests.support import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

H100_GPUS = 4  # SPEC: 2 nodes x 2 H100-80GB
H100_NODES = ("h100-0", "h100-1")
LOW, HIGH, NEVER = "e2e-low", "e2e-high", "e2e-high-never"


@pytest.fixture(scope="module")
async def priority_classes(kube: Kube) -> AsyncIterator[None]:
    await ensure_priority_classes(kube, {LOW: 100, HIGH: 1000, NEVER: 1000}, never={NEVER})
    yield


async def create(
    kube: Kube, ns: str, name: str, klass: str, profile: str, on: dict[str, str] | None = None
) -> Obj:
    body = user_pod(name=name, slices={"main": {profile: 1}}, node_selector=on)
    body["spec"]["priorityClassName"] = klass
    return await kube.create(pods_path(ns), body)


async def fill_h100s(kube: Kube, ns: str) -> dict[str, str]:
    """7 low-priority 1g.10gb pods per H100 GPU, all Running; their GPU uuid by pod name.
    They are held to the H100s: the A100-40GB offers 1g.10gb too, and the allocator's
    `--avoid-creates-in-flight` (INSTASLICE_TEST_AVOID_CREATES_IN_FLIGHT, tests/support.py)
    rightly sends part of such a burst there while the H100s are busy making slices."""
    names = [f"low{i:02d}" for i in range(7 * H100_GPUS)]
    for name in names:
        await create(kube, ns, name, LOW, "1g.10gb", on={GPU_MODEL_LABEL: "H100-80GB"})
    for name in names:
        await wait_pod_running(kube, ns, name)
    allocs = (await kube.list(allocs_path(ns)))["items"]
    where = {a["spec"]["podName"]: a["spec"]["slices"][0]["gpuUUID"] for a in allocs}
    assert sorted(where) == names
    assert sorted(list(where.values()).count(g) for g in set(where.values())) == [7] * H100_GPUS
    return where


async def live(kube: Kube, ns: str) -> set[str]:
    pods = (await kube.list(pods_path(ns)))["items"]
    return {p["metadata"]["name"] for p in pods if not p["metadata"].get("deletionTimestamp")}


async def big_gpu(kube: Kube, ns: str) -> str:
    allocs = (await kube.list(allocs_path(ns)))["items"]
    big = next(a for a in allocs if a["spec"]["podName"] == "big")
    return str(big["spec"]["slices"][0]["gpuUUID"])


@pytest.mark.usefixtures("priority_classes")
async def test_a_7g_evicts_exactly_the_pods_of_one_gpu(
    kube: Kube, system: DevSystem, namespace: str
) -> None:
    where = await fill_h100s(kube, namespace)
    await create(kube, namespace, "big", HIGH, "7g.80gb")
    await wait_pod_running(kube, namespace, "big")
    await assert_holds_slices(kube, system, namespace, "big")
    gpu = await big_gpu(kube, namespace)
    evicted = {n for n, g in where.items() if g == gpu}
    assert len(evicted) == 7
    assert await live(kube, namespace) == {"big"} | (set(where) - evicted)
    preempting = await wait_event(kube, namespace, "big", REASON_PREEMPTING)
    assert all(f"{namespace}/{n}" in preempting["message"] for n in evicted)
    for name in sorted(evicted):
        event = await wait_event(kube, namespace, name, REASON_PREEMPTED)
        assert f"{namespace}/big" in event["message"]


@pytest.mark.usefixtures("priority_classes")
async def test_a_pdb_guarding_the_other_gpus_pods_sends_the_7g_to_the_unguarded_one(
    kube: Kube, namespace: str
) -> None:
    where = await fill_h100s(kube, namespace)
    # The oldest pods' GPU is unguarded: without the PDB the newest pods would go first.
    free = where["low00"]
    for name, gpu in where.items():
        if gpu != free:
            await kube.patch(pods_path(namespace, name), {"metadata": {"labels": {"guard": "y"}}})
    guarded = 7 * (H100_GPUS - 1)  # bare pods: minAvailable (maxUnavailable needs a controller)
    pdbs = group_path("policy/v1", "poddisruptionbudgets", namespace)
    selector = {"matchLabels": {"guard": "y"}}
    body = {"metadata": {"name": "guard"}, "spec": {"minAvailable": guarded, "selector": selector}}
    await kube.create(pdbs, body)

    def computed(objs: dict[str, Obj]) -> Obj | None:
        pdb = objs.get("guard")
        status = (pdb or {}).get("status") or {}
        ready = status.get("expectedPods") == guarded and status.get("currentHealthy") == guarded
        return pdb if ready else None

    await wait_for(kube, pdbs, computed, what="the PDB's status")
    await create(kube, namespace, "big", HIGH, "7g.80gb")
    await wait_pod_running(kube, namespace, "big")
    assert await big_gpu(kube, namespace) == free
    evicted = {n for n, g in where.items() if g == free}
    assert await live(kube, namespace) == {"big"} | (set(where) - evicted)


@pytest.mark.usefixtures("priority_classes")
async def test_a_size_based_pod_preempts_like_one_naming_its_profile(
    kube: Kube, namespace: str
) -> None:
    """`memory>=70Gi` held to the full H100s resolves to 7g.80gb there (the free H200 would
    give 4g.71gb: the selector keeps it off): the pods of one GPU go and it gets that slice."""
    where = await fill_h100s(kube, namespace)
    body = user_pod(name="big", slices={}, node_selector={GPU_MODEL_LABEL: "H100-80GB"})
    body["spec"]["containers"] = [{"name": "main", "image": "registry.k8s.io/pause:3.10"}]
    body["spec"]["priorityClassName"] = HIGH
    body["metadata"]["annotations"] = {"instaslice.io/mig-size.main": "memory>=70Gi"}
    await kube.create(pods_path(namespace), body)
    await wait_pod_running(kube, namespace, "big")
    allocs = (await kube.list(allocs_path(namespace)))["items"]
    (big,) = [a for a in allocs if a["spec"]["podName"] == "big"]
    assert [(s["container"], s["profile"]) for s in big["spec"]["slices"]] == [("main", "7g.80gb")]
    evicted = {n for n, g in where.items() if g == big["spec"]["slices"][0]["gpuUUID"]}
    assert len(evicted) == 7
    assert await live(kube, namespace) == {"big"} | (set(where) - evicted)
    preempting = await wait_event(kube, namespace, "big", REASON_PREEMPTING)
    assert all(f"{namespace}/{n}" in preempting["message"] for n in evicted)


@pytest.mark.usefixtures("priority_classes")
async def test_preemption_policy_never_preempts_nothing(kube: Kube, namespace: str) -> None:
    where = await fill_h100s(kube, namespace)
    await create(kube, namespace, "polite", NEVER, "7g.80gb")
    event = await wait_event(kube, namespace, "polite", REASON_PENDING)
    assert "preemptionPolicy is Never" in event["message"]
    await asyncio.sleep(2.0)  # nothing follows
    assert await live(kube, namespace) == {"polite"} | set(where)
    events = await kube.list(
        core_path("events", namespace), fieldSelector="involvedObject.name=polite"
    )
    assert REASON_PREEMPTING not in {e["reason"] for e in events["items"]}


@pytest.mark.usefixtures("priority_classes")
async def test_agent_restarted_while_the_victims_slices_are_released(
    kube: Kube, system: DevSystem, namespace: str
) -> None:
    where = await fill_h100s(kube, namespace)
    controls = [EmulatorControl(system.gpu_state, n) for n in H100_NODES]
    for c in controls:
        c.set_latency(destroy_ms=1500)
    try:
        await create(kube, namespace, "big", HIGH, "7g.80gb")
        await wait_event(kube, namespace, "big", REASON_PREEMPTING)

        def releasing(allocs: dict[str, Obj]) -> bool:
            return any(a.get("status", {}).get("phase") == "Releasing" for a in allocs.values())

        await wait_for(kube, allocs_path(namespace), releasing, what="a victim's release")
        system.kill("nodeagent")
    finally:
        for c in controls:
            c.set_latency(destroy_ms=0)
    system.start_agent(die_with_parent=True)
    await wait_pod_running(kube, namespace, "big")
    await assert_holds_slices(kube, system, namespace, "big")
    gpu = await big_gpu(kube, namespace)
    evicted = {n for n, g in where.items() if g == gpu}
    assert await live(kube, namespace) == {"big"} | (set(where) - evicted)
    allocs = (await kube.list(allocs_path(namespace)))["items"]
    held: dict[str, int] = {}
    for a in allocs:
        for sl in a["spec"]["slices"]:
            mask = ((1 << sl["size"]) - 1) << sl["start"]
            assert not held.get(sl["gpuUUID"], 0) & mask, f"slots promised twice: {sl}"
            held[sl["gpuUUID"]] = held.get(sl["gpuUUID"], 0) | mask
    for node in H100_NODES:
        await assert_node_matches(kube, system, node)
