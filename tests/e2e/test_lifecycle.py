"""The whole system, end to end: user objects in, MIG slices on (emulated) GPUs out.

Covers, on KWOK GPU nodes with the real webhook/allocator and node-agent processes:
- one pod's whole lifecycle: rewritten and gated at admission, allocated, Ready, pinned and
  ungated, Running; SliceAllocated/SliceReady in `kubectl describe pod`, reported by the
  node and the allocator's instance; `kubectl wait --for=condition=Ready` on both kinds; on delete
  SliceReleased, the GPU instance destroyed, the CDI file removed, the allocation gone;
- a pod in a namespace that never opted in is not touched (no gate, no claim, no allocation);
- admission refusals (unknown profile, count 0, requests ≠ limits) with the webhook's message;
- exhaustion: AllocationPending with its reason, then placed once capacity is freed;
- a Job's completion (KWOK's pod-complete stage finishes Running Job pods) releases its slice;
- a pod whose containers ask for several slices (count 2, a `+me` profile) gets distinct ones;
- a sidecar's ask gets its own slice and device; a plain init container's ask is refused;
- a Deployment scaled up and down: allocations and instances follow the replicas;
- the node agent killed (-9) while it creates instances, then restarted: no leaked or
  duplicated instance, running pods keep their slices, pending ones complete;
- a node deleted: the allocator drops its allocations' finalizers and the controller's pod
  is re-placed on another node with new slices.

Leaves out: real containers and CDI injection by a container runtime (KWOK runs no
containers; the CDI files are checked against the allocation instead), the device-plugin
binding mode (needs a kubelet), PinnedUnschedulable (its timeout belongs to the allocator's
integration tests), GPU faults (the chaos soak), the scale of a real cluster (benchmarks).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest

from common.constants import (
    CLAIM_ANNOTATION,
    ENABLED_KEY,
    GATE_NAME,
    GPU_MODEL_LABEL,
    NODE_LABEL,
    REASON_ALLOCATED,
    REASON_PENDING,
    REASON_READY,
    REASON_RELEASED,
    VISIBLE_DEVICES_ENV,
    qualified_cdi_device,
)
from common.kubeapi import ApiError, Kube, Obj, core_path
from common.profiles import nvidia_resource
from hack.dev import DevSystem
from nodeagent.emulator import EmulatorControl
from testkit.builders import user_pod
from tests.e2e.helpers import (
    IMAGE,
    Held,
    allocs_path,
    assert_holds_slices,
    assert_node_matches,
    assert_released,
    deployments_path,
    held_slices,
    jobs_path,
    kubectl,
    make_deployment,
    make_job,
    pods_path,
    resource_of,
    wait_event,
    wait_gone,
    wait_pod_running,
    wait_pods_running,
)
from tests.support import wait_for

# Nodes no test deletes; the A30 nodes are for the tests that delete one.
SHARED_NODES = ("h100-0", "h100-1", "h200-0", "a100-0")


async def _create_pod(kube: Kube, ns: str, pod: Obj) -> Obj:
    return await kube.create(pods_path(ns), pod)


async def _release(kube: Kube, system: DevSystem, ns: str, name: str) -> None:
    """Delete a Running pod; wait for SliceReleased, the allocation gone, the GPU and the
    CDI directory clean."""
    pod = await kube.get(pods_path(ns, name))
    claim = pod["metadata"]["annotations"][CLAIM_ANNOTATION]
    alloc = await kube.get(allocs_path(ns, claim))
    held = held_slices(system, alloc)
    await kube.delete(pods_path(ns, name))
    await wait_event(kube, ns, name, REASON_RELEASED, uid=pod["metadata"]["uid"])
    await wait_gone(kube, allocs_path(ns), claim)
    assert_released(system, alloc["spec"]["nodeName"], ns, claim, [h.mig_uuid for h in held])


async def test_pod_lifecycle(kube: Kube, system: DevSystem, namespace: str) -> None:
    created = await _create_pod(
        kube, namespace, user_pod(name="train", slices={"main": {"3g.71gb": 1}}, cpu="500m")
    )
    # Admission: rewritten resources, the gate, a claim, the CDI device in the env.
    main = created["spec"]["containers"][0]
    assert main["resources"]["limits"] == {resource_of("3g.71gb"): "1"}, main["resources"]
    assert main["resources"]["requests"][resource_of("3g.71gb")] == "1", main["resources"]
    assert {"name": GATE_NAME} in created["spec"]["schedulingGates"]
    claim = created["metadata"]["annotations"][CLAIM_ANNOTATION]
    env = {e["name"]: e["value"] for e in main["env"]}
    assert env[VISIBLE_DEVICES_ENV] == qualified_cdi_device(namespace, claim, "main")

    pod = await wait_pod_running(kube, namespace, "train")
    assert pod["spec"]["nodeName"] == "h200-0", "only the H200 offers 3g.71gb"
    alloc = await assert_holds_slices(kube, system, namespace, "train")
    assert alloc["metadata"]["name"] == claim
    assert alloc["metadata"]["labels"][NODE_LABEL] == "h200-0"
    uid = pod["metadata"]["uid"]
    allocated = await wait_event(kube, namespace, "train", REASON_ALLOCATED, uid=uid)
    ready = await wait_event(kube, namespace, "train", REASON_READY, uid=uid)
    (held,) = held_slices(system, alloc)
    assert held.mig_uuid in ready["message"], ready["message"]
    # who reported: the agent's node, the allocator's own pod (its host here), never a
    # component name shared by every agent (docs/contract.md §4)
    assert (ready["reportingComponent"], ready["reportingInstance"]) == (
        "instaslice-nodeagent", "h200-0",
    )  # fmt: skip
    assert allocated["reportingComponent"] == "instaslice-allocator"
    assert allocated["reportingInstance"] not in ("", "instaslice-allocator"), allocated

    described = await kubectl(system, "-n", namespace, "describe", "pod", "train")
    assert described.rc == 0, described.err
    for reason in (REASON_ALLOCATED, REASON_READY):
        assert reason in described.out, f"{reason} not in kubectl describe pod:\n{described.out}"
    # the Ready conditions, as generic tooling waits for them (docs/contract.md §3)
    for args in (("-n", namespace, f"sliceallocation/{claim}"), ("mignode/h200-0",)):
        waited = await kubectl(system, "wait", "--for=condition=Ready", "--timeout=30s", *args)
        assert waited.rc == 0, waited.err

    await _release(kube, system, namespace, "train")
    await assert_node_matches(kube, system, "h200-0")


async def test_pod_in_plain_namespace_untouched(
    kube: Kube, system: DevSystem, plain_namespace: str
) -> None:
    ns = plain_namespace
    created = await _create_pod(kube, ns, user_pod(name="outside", slices={"c": {"1g.10gb": 1}}))
    spec, meta = created["spec"], created["metadata"]
    assert not spec.get("schedulingGates"), spec
    assert CLAIM_ANNOTATION not in meta.get("annotations", {}), meta
    c = spec["containers"][0]
    assert c["resources"]["limits"] == {"nvidia.com/mig-1g.10gb": "1"}
    assert "env" not in c, c
    ns_obj = await kube.get(core_path("namespaces", name=ns))
    assert ENABLED_KEY not in ns_obj["metadata"].get("labels", {})

    # The scheduler, not InstaSlice, answers it: no node offers nvidia.com/mig-* here.
    def unschedulable(objs: dict[str, Obj]) -> bool:
        conds = objs.get("outside", {}).get("status", {}).get("conditions", [])
        return any(
            x["type"] == "PodScheduled" and x.get("reason") == "Unschedulable" for x in conds
        )

    await wait_for(
        kube, pods_path(ns), unschedulable, what="the scheduler's Unschedulable verdict",
        fieldSelector="metadata.name=outside",
    )  # fmt: skip
    assert (await kube.list(allocs_path(ns)))["items"] == []


@pytest.mark.parametrize(
    ("slices", "slice_requests", "expected"),
    [
        pytest.param(
            {"c": {"9g.99gb": 1}},
            None,
            ('container "c"', "resources.limits[nvidia.com/mig-9g.99gb]", "unknown MIG profile"),
            id="unknown-profile",
        ),
        pytest.param(
            {"c": {"1g.10gb": 0}},
            None,
            ('container "c"', "resources.limits[nvidia.com/mig-1g.10gb]", "not a positive integer"),
            id="count-zero",
        ),
        pytest.param(
            {"c": {"1g.10gb": 1}},
            {"c": {"1g.10gb": 2}},
            ('container "c"', "resources.requests[nvidia.com/mig-1g.10gb]", "must equal limits"),
            id="requests-differ",
        ),
    ],
)
async def test_invalid_request_refused(
    kube: Kube,
    system: DevSystem,
    namespace: str,
    slices: dict[str, dict[str, int]],
    slice_requests: dict[str, dict[str, int]] | None,
    expected: tuple[str, ...],
) -> None:
    pod = user_pod(name="bad", slices=slices, slice_requests=slice_requests)
    with pytest.raises(ApiError) as refused:
        await _create_pod(kube, namespace, pod)
    msg = refused.value.message
    assert refused.value.status == 422, refused.value
    assert 'admission webhook "mig.pods.instaslice.io" denied the request' in msg, msg
    for part in expected:
        assert part in msg, f"{part!r} not in the refusal: {msg}"
    assert (await kube.list(pods_path(namespace)))["items"] == []


async def test_exhaustion_pending_then_placed(
    kube: Kube, system: DevSystem, namespace: str
) -> None:
    # The H200 node has two GPUs, each holding one 7g.141gb.
    for name in ("big-0", "big-1"):
        await _create_pod(kube, namespace, user_pod(name=name, slices={"c": {"7g.141gb": 1}}))
    for name in ("big-0", "big-1"):
        await wait_pod_running(kube, namespace, name)
    waiting = await _create_pod(
        kube, namespace, user_pod(name="big-2", slices={"c": {"7g.141gb": 1}})
    )
    pending = await wait_event(kube, namespace, "big-2", REASON_PENDING)
    assert pending["type"] == "Warning", pending
    assert "7g.141gb" in pending["message"] and "full" in pending["message"], pending["message"]
    pod = await kube.get(pods_path(namespace, "big-2"))
    assert pod["spec"]["schedulingGates"] == [{"name": GATE_NAME}], "held by InstaSlice only"
    claim = waiting["metadata"]["annotations"][CLAIM_ANNOTATION]
    with pytest.raises(ApiError) as none:
        await kube.get(allocs_path(namespace, claim))
    assert none.value.not_found, "no allocation while nothing fits"

    await _release(kube, system, namespace, "big-0")
    await wait_pod_running(kube, namespace, "big-2")
    for name in ("big-1", "big-2"):
        await assert_holds_slices(kube, system, namespace, name)
    await assert_node_matches(kube, system, "h200-0")


async def test_job_completion_releases(kube: Kube, system: DevSystem, namespace: str) -> None:
    await kube.create(jobs_path(namespace), make_job("once", slices={"work": {"1g.5gb": 1}}))

    def complete(jobs: dict[str, Obj]) -> bool:
        conds = jobs.get("once", {}).get("status", {}).get("conditions", [])
        return any(c["type"] == "Complete" and c["status"] == "True" for c in conds)

    await wait_for(kube, jobs_path(namespace), complete, what="Job once Complete")
    (pod,) = (await kube.list(pods_path(namespace), labelSelector="job-name=once"))["items"]
    name, uid = pod["metadata"]["name"], pod["metadata"]["uid"]
    assert pod["status"]["phase"] == "Succeeded"
    assert pod["spec"]["nodeName"] == "a100-0", "only the A100 offers 1g.5gb"
    ready = await wait_event(kube, namespace, name, REASON_READY, uid=uid)
    await wait_event(kube, namespace, name, REASON_RELEASED, uid=uid)
    claim = pod["metadata"]["annotations"][CLAIM_ANNOTATION]
    await wait_gone(kube, allocs_path(namespace), claim)
    mig = ready["message"].rsplit(": ", 1)[-1]
    assert mig.startswith("MIG-"), ready["message"]
    assert_released(system, "a100-0", namespace, claim, [mig])
    await assert_node_matches(kube, system, "a100-0")


async def test_multi_container_slices_distinct(
    kube: Kube, system: DevSystem, namespace: str
) -> None:
    slices = {"a": {"1g.10gb": 2}, "b": {"1g.10gb+me": 1, "1g.20gb": 1}}
    created = await _create_pod(kube, namespace, user_pod(name="multi", slices=slices))
    b = created["spec"]["containers"][1]
    assert b["resources"]["limits"] == {
        resource_of("1g.10gb+me"): "1",
        resource_of("1g.20gb"): "1",
    }, "a +me profile is spelled with a dot in resource names"
    assert resource_of("1g.10gb+me") == "instaslice.io/mig-1g.10gb.me"
    await wait_pod_running(kube, namespace, "multi")
    alloc = await assert_holds_slices(kube, system, namespace, "multi")
    held = held_slices(system, alloc)
    assert sorted((h.container, h.profile) for h in held) == [
        ("a", "1g.10gb"), ("a", "1g.10gb"), ("b", "1g.10gb+me"), ("b", "1g.20gb"),
    ]  # fmt: skip
    places = {(h.gpu_index, h.start) for h in held}
    assert len(places) == 4 and len({h.mig_uuid for h in held}) == 4, held
    await _release(kube, system, namespace, "multi")


async def test_a_sidecar_gets_its_own_slice_and_a_plain_init_container_none(
    kube: Kube, system: DevSystem, namespace: str
) -> None:
    """docs/contract.md §1: a sidecar (an init container with restartPolicy: Always) asks like
    an app container and gets its own slice, device and CDI entry; an init container that is
    not a sidecar may not ask (no quota would count its slices) and the pod is refused."""
    pod = user_pod(name="side", slices={"main": {"1g.10gb": 1}})
    proxy = {"name": "proxy", "image": IMAGE, "restartPolicy": "Always",
             "resources": {"limits": {nvidia_resource("1g.20gb"): "1"}}}  # fmt: skip
    pod["spec"]["initContainers"] = [proxy]
    created = await _create_pod(kube, namespace, pod)
    side = created["spec"]["initContainers"][0]
    assert side["resources"]["limits"] == {resource_of("1g.20gb"): "1"}, side["resources"]
    await wait_pod_running(kube, namespace, "side")
    alloc = await assert_holds_slices(kube, system, namespace, "side")  # CDI devices included
    held = sorted((h.container, h.profile) for h in held_slices(system, alloc))
    assert held == [("main", "1g.10gb"), ("proxy", "1g.20gb")], held

    plain = user_pod(name="plain", slices={"main": {"1g.10gb": 1}})
    plain["spec"]["initContainers"] = [{k: v for k, v in proxy.items() if k != "restartPolicy"}]
    with pytest.raises(ApiError) as refused:
        await _create_pod(kube, namespace, plain)
    msg = refused.value.message
    assert refused.value.status == 422, refused.value
    for part in (f"spec.initContainers[0].resources.limits[{nvidia_resource('1g.20gb')}]",
                 'init container "proxy" is not a sidecar', "restartPolicy: Always"):  # fmt: skip
        assert part in msg, f"{part!r} not in the refusal: {msg}"
    await _release(kube, system, namespace, "side")


async def _alloc_count(kube: Kube, ns: str, n: int) -> list[Obj]:
    def settled(allocs: dict[str, Obj]) -> list[Obj] | None:
        ready = [a for a in allocs.values() if a.get("status", {}).get("phase") == "Ready"]
        return ready if len(allocs) == n and len(ready) == n else None

    return await wait_for(
        kube, allocs_path(ns), settled, what=f"exactly {n} Ready allocations in {ns}"
    )


async def test_deployment_scaled_up_and_down(kube: Kube, system: DevSystem, namespace: str) -> None:
    await kube.create(
        deployments_path(namespace),
        make_deployment("serve", replicas=2, slices={"srv": {"2g.20gb": 1}}, cpu="100m"),
    )
    for replicas in (5, 1):
        if replicas != 2:
            await kube.patch(deployments_path(namespace, "serve"), {"spec": {"replicas": replicas}})
        pods = await wait_pods_running(kube, namespace, replicas, selector="app=serve")
        await _alloc_count(kube, namespace, replicas)
        held: list[Held] = []
        for p in pods:
            alloc = await assert_holds_slices(kube, system, namespace, p["metadata"]["name"])
            held += held_slices(system, alloc)
        assert len({h.mig_uuid for h in held}) == replicas
        for node in ("h100-0", "h100-1"):
            await assert_node_matches(kube, system, node)
    await kube.patch(deployments_path(namespace, "serve"), {"spec": {"replicas": 0}})
    await _alloc_count(kube, namespace, 0)
    for node in ("h100-0", "h100-1"):
        await assert_node_matches(kube, system, node)


@pytest.fixture
def slow_creates(system: DevSystem) -> Iterator[None]:
    """Every shared node's emulated GPUs take 1.5 s per instance creation, so a test can
    catch the agent in the middle of creating; undone afterwards."""
    controls = [EmulatorControl(system.gpu_state, n) for n in SHARED_NODES]
    for c in controls:
        c.set_latency(create_ms=1500)
    try:
        yield
    finally:
        for c in controls:
            c.set_latency(create_ms=0)


async def test_agent_killed_and_restarted(
    kube: Kube, system: DevSystem, namespace: str, slow_creates: None
) -> None:
    await _create_pod(kube, namespace, user_pod(name="before", slices={"c": {"1g.18gb": 1}}))
    await wait_pod_running(kube, namespace, "before")
    before = await assert_holds_slices(kube, system, namespace, "before")
    kept = held_slices(system, before)

    names = {
        "during-0": "2g.20gb",
        "during-1": "3g.40gb",
        "during-2": "1g.5gb",
        "during-3": "2g.35gb",
    }
    for name, profile in names.items():
        await _create_pod(kube, namespace, user_pod(name=name, slices={"c": {profile: 1}}))

    def creating(allocs: dict[str, Obj]) -> bool:
        return any(a.get("status", {}).get("phase") == "Creating" for a in allocs.values())

    await wait_for(kube, allocs_path(namespace), creating, what="an allocation being created")
    system.kill("nodeagent")
    for node in SHARED_NODES:
        EmulatorControl(system.gpu_state, node).set_latency(create_ms=0)
    system.start_agent(die_with_parent=True)

    for name in ("before", *names):
        await wait_pod_running(kube, namespace, name)
    await _alloc_count(kube, namespace, 1 + len(names))
    for name in ("before", *names):
        await assert_holds_slices(kube, system, namespace, name)
    after = held_slices(system, await kube.get(allocs_path(namespace, before["metadata"]["name"])))
    assert after == kept, f"the running pod's slices changed across the restart: {kept} -> {after}"
    for node in SHARED_NODES:
        await assert_node_matches(kube, system, node)

    # Released once each, by the restarted agent (events go out on change, not per retry).
    pods = {p["metadata"]["name"]: p for p in (await kube.list(pods_path(namespace)))["items"]}
    for name in pods:
        await kube.delete(pods_path(namespace, name))
    await _alloc_count(kube, namespace, 0)
    for name, pod in pods.items():
        await wait_event(kube, namespace, name, REASON_RELEASED, uid=pod["metadata"]["uid"])
    released = await kube.list(
        core_path("events", namespace), fieldSelector=f"reason={REASON_RELEASED}"
    )
    per_pod = Counter(e["involvedObject"]["name"] for e in released["items"])
    twice = {n: c for n, c in per_pod.items() if c != 1}
    assert not twice, f"SliceReleased events per pod after the agent restart: {dict(per_pod)}"


async def test_node_deleted(kube: Kube, system: DevSystem, namespace: str) -> None:
    # Only the A30 nodes offer 4g.24gb, one per node: the replica must move to another A30.
    await kube.create(
        deployments_path(namespace),
        make_deployment("solo", replicas=1, slices={"c": {"4g.24gb": 1}}),
    )
    (pod,) = await wait_pods_running(kube, namespace, 1, selector="app=solo")
    first = await assert_holds_slices(kube, system, namespace, pod["metadata"]["name"])
    lost = pod["spec"]["nodeName"]
    nodes = await kube.list(core_path("nodes"), labelSelector=f"{GPU_MODEL_LABEL}=A30-24GB")
    others = {n["metadata"]["name"] for n in nodes["items"]} - {lost}
    assert others, "this test needs a second A30 node"

    await kube.delete(core_path("nodes", name=lost))
    # The allocator drops the finalizer: nothing is left on a missing node to destroy.
    await wait_gone(kube, allocs_path(namespace), first["metadata"]["name"])

    # KCM's pod GC deletes the orphaned pod (after its 40 s quarantine); the Deployment
    # makes a new one, which gets a new slice on another A30.
    def replaced(pods: dict[str, Obj]) -> Obj | None:
        for p in pods.values():
            if (
                p["metadata"]["uid"] != pod["metadata"]["uid"]
                and p.get("status", {}).get("phase") == "Running"
            ):
                return p
        return None

    new = await wait_for(
        kube,
        pods_path(namespace),
        replaced,
        what=f"the replica re-placed after {lost} was deleted",
        within=150,
        labelSelector="app=solo",
    )
    assert new["spec"]["nodeName"] in others
    second = await assert_holds_slices(kube, system, namespace, new["metadata"]["name"])
    assert second["metadata"]["name"] != first["metadata"]["name"]
    assert system.processes["nodeagent"].alive(), "the node agent survived its node's deletion"
    assert system.processes["webhook"].alive()
