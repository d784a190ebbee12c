"""Kueue and InstaSlice together, on one Kueue-enabled dev system (`kueue: true`, hack/kueue.py)
shared by this module: the real Kueue v0.17 manager (built from its Go module), its CRDs and
webhooks, InstaSlice's webhook, allocator and emulated agents. It runs as `kueue: true` alone
sets it up (no slot accounting) for the tests that take `plain`, and with the webhook's
`--slot-accounting` and the Kueue configuration to match for those that take `slotted`
(`DevSystem.set_slot_accounting` restarts the webhook and Kueue; the tests are ordered so it
switches once).

Covers (docs/kueue.md): exactly what a new user writes — a ClusterQueue covering only cpu,
memory and `nvidia.com/mig-1g.10gb` — admits a suspended Job, whose pod gets its slice, and
holds a second one beyond the quota (issue 36); a ClusterQueue quota written as
`nvidia.com/mig-1g.10gb` admits 2 of 3 Jobs and the third once one finishes; the same for plain
pods (Kueue's pod integration), with Kueue's webhook called before and after InstaSlice's — the
gate order proves which ran first — while InstaSlice never touches a pod Kueue still holds; one
ResourceFlavor per GPU model sends a Job to that model's nodes; a workload Kueue admitted but
InstaSlice cannot place is explained (`AllocationPending`) and requeued by Kueue's
waitForPodsReady; with slot accounting, `instaslice.io/memory-slots` limits a namespace across
profiles, as a ResourceQuota and as a Kueue quota, and a pod asking by size lands on the
smallest fitting profile of the model it is sent to, charged the most that size takes on the
models its selector admits.

Leaves out: Kueue's preemption, cohorts and fair sharing (Kueue's own business), and other
integrations than batch/v1 Job and Pod.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from common.constants import (
    CLAIM_ANNOTATION,
    ENABLED_KEY,
    GATE_NAME,
    GPU_MODEL_LABEL,
    MEMORY_SLOTS_RESOURCE,
    REASON_PENDING,
)
from common.kubeapi import ApiError, Kube, Obj, core_path, group_path
from common.quota import flavor_name, resource_flavors
from hack import kueue
from hack.dev import DevSystem
from testkit.builders import user_pod
from tests.e2e.helpers import (
    allocs_path,
    assert_holds_slices,
    jobs_path,
    make_job,
    pods_path,
    wait_event,
    wait_opted_in,
)
from tests.support import wait_for

KUEUE = "kueue.x-k8s.io/v1beta2"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_GATE = "kueue.x-k8s.io/admission"
STAY = {"pod-complete.stage.kwok.x-k8s.io/delay": "3600s"}  # KWOK: a Job pod keeps running
MODELS = ("H100-80GB", "A100-80GB", "H200-141GB")
OWN_SPEC: dict[str, Any] = {  # own_system
    "kueue": True,
    "nodes": [
        {"prefix": "h100", "count": 1, "gpus": 1, "model": "H100-80GB", "cpu": "8"},
        {"prefix": "a100", "count": 1, "gpus": 1, "model": "A100-80GB", "cpu": "8"},
        {"prefix": "h200", "count": 1, "gpus": 1, "model": "H200-141GB", "cpu": "8"},
    ],
}
_names = itertools.count()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def kk(own_kube: Kube) -> Kube:
    """The module's Kueue system, with a ResourceFlavor per model of MODELS and "any"."""
    for flavor in [*resource_flavors(MODELS), _flavor("any", {})]:
        await own_kube.create(group_path(KUEUE, "resourceflavors"), flavor)
    return own_kube


def _flavor(name: str, labels: dict[str, str]) -> Obj:
    return {"apiVersion": KUEUE, "kind": "ResourceFlavor", "metadata": {"name": name},
            "spec": {"nodeLabels": labels}}  # fmt: skip


def cluster_queue(name: str, flavors: dict[str, dict[str, int]]) -> Obj:
    """A ClusterQueue for every namespace; `flavors`: flavor → resource → nominal quota, in
    Kueue's order of preference. Every resource it names is covered by every flavor."""
    covered = sorted({r for quotas in flavors.values() for r in quotas})
    return {
        "apiVersion": KUEUE,
        "kind": "ClusterQueue",
        "metadata": {"name": name},
        "spec": {
            "namespaceSelector": {},
            "resourceGroups": [
                {
                    "coveredResources": covered,
                    "flavors": [
                        {
                            "name": f,
                            "resources": [
                                {"name": r, "nominalQuota": str(quotas.get(r, 0))} for r in covered
                            ],
                        }
                        for f, quotas in flavors.items()
                    ],
                }
            ],
        },
    }


@pytest_asyncio.fixture(loop_scope="session")
async def plain(own_system: DevSystem) -> None:
    """The system as `kueue: true` alone sets it up: the webhook adds no memory slots and
    Kueue's configuration names none (issue 36)."""
    await asyncio.to_thread(own_system.set_slot_accounting, False, die_with_parent=True)


@pytest_asyncio.fixture(loop_scope="session")
async def slotted(own_system: DevSystem) -> None:
    """The webhook with `--slot-accounting`, and Kueue charging Jobs their memory slots."""
    await asyncio.to_thread(own_system.set_slot_accounting, True, die_with_parent=True)


@pytest_asyncio.fixture(loop_scope="session")
async def team(kk: Kube) -> AsyncIterator[str]:
    """An opted-in namespace; deleted afterwards, with every ClusterQueue a test made."""
    ns = (
        await kk.create(
            core_path("namespaces"),
            {"metadata": {"generateName": "kq-", "annotations": {ENABLED_KEY: "true"}}},
        )
    )["metadata"]["name"]
    await wait_for(kk, core_path("serviceaccounts", ns), lambda s: "default" in s,
                   what=f"ServiceAccount {ns}/default", within=30)  # fmt: skip
    await wait_opted_in(kk, ns)  # it creates a pod (dry run): after the ServiceAccount
    yield ns
    await kk.delete_ignore_missing(core_path("namespaces", name=ns))
    await wait_for(kk, allocs_path(ns), lambda a: not a, what=f"{ns}'s allocations released")
    for cq in (await kk.list(group_path(KUEUE, "clusterqueues")))["items"]:
        await kk.delete_ignore_missing(
            group_path(KUEUE, "clusterqueues", name=cq["metadata"]["name"])
        )


async def local_queue(kube: Kube, ns: str, flavors: dict[str, dict[str, int]]) -> str:
    """A ClusterQueue of `flavors` and a LocalQueue `q` for it in `ns`; returns `q`."""
    cq = f"cq-{next(_names)}"
    await kube.create(group_path(KUEUE, "clusterqueues"), cluster_queue(cq, flavors))
    body = {"apiVersion": KUEUE, "kind": "LocalQueue", "metadata": {"name": "q"},
            "spec": {"clusterQueue": cq}}  # fmt: skip
    await kube.create(group_path(KUEUE, "localqueues", ns), body)
    return "q"


def queued(obj: Obj, queue: str, *, template_annotations: dict[str, str] | None = None) -> Obj:
    obj["metadata"].setdefault("labels", {})[QUEUE_LABEL] = queue
    if template_annotations:
        obj["spec"]["template"].setdefault("metadata", {})["annotations"] = template_annotations
    return obj


def workloads_path(ns: str) -> str:
    return group_path(KUEUE, "workloads", ns)


def admitted(wl: Obj) -> bool:
    return any(
        c["type"] == "Admitted" and c["status"] == "True"
        for c in wl.get("status", {}).get("conditions", [])
    )


def owner(wl: Obj) -> str:
    return str(wl["metadata"]["ownerReferences"][0]["name"])


async def running_pods(kube: Kube, ns: str, n: int, **query: Any) -> list[Obj]:
    def done(pods: dict[str, Obj]) -> list[Obj] | None:
        up = [p for p in pods.values() if p.get("status", {}).get("phase") == "Running"]
        return sorted(up, key=lambda p: p["metadata"]["name"]) if len(up) >= n else None

    return await wait_for(kube, pods_path(ns), done, what=f"{n} Running pods in {ns}", **query)


async def finish(kube: Kube, pod: Obj) -> None:
    """The pod's container exits 0 (what KWOK would do after the pod's delay)."""
    statuses = [
        {"name": c["name"], "image": c["image"], "ready": False, "restartCount": 0,
         "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}
        for c in pod["spec"]["containers"]
    ]  # fmt: skip
    path = pods_path(pod["metadata"]["namespace"], pod["metadata"]["name"]) + "/status"
    await kube.patch(path, {"status": {"phase": "Succeeded", "containerStatuses": statuses}})


# --- quota in the user's names ------------------------------------------------------------------


async def test_a_quota_in_nvidias_names_alone_admits_a_job_and_holds_the_next(
    kk: Kube, own_system: DevSystem, plain: None, team: str
) -> None:
    """Issue 36, as a new user writes it on `kueue: true`: a ResourceFlavor, a ClusterQueue
    covering only cpu, memory and nvidia.com/mig-1g.10gb, a LocalQueue, a suspended Job."""
    flavor, queue = f"nv-{next(_names)}", f"cq-{next(_names)}"
    await kk.create(group_path(KUEUE, "resourceflavors"), _flavor(flavor, {}))
    cq: Obj = {
        "apiVersion": KUEUE,
        "kind": "ClusterQueue",
        "metadata": {"name": queue},
        "spec": {
            "namespaceSelector": {},
            "resourceGroups": [
                {
                    "coveredResources": ["cpu", "memory", "nvidia.com/mig-1g.10gb"],
                    "flavors": [
                        {
                            "name": flavor,
                            "resources": [
                                {"name": "cpu", "nominalQuota": "8"},
                                {"name": "memory", "nominalQuota": "16Gi"},
                                {"name": "nvidia.com/mig-1g.10gb", "nominalQuota": "2"},
                            ],
                        }
                    ],
                }
            ],
        },
    }
    await kk.create(group_path(KUEUE, "clusterqueues"), cq)
    lq = {"apiVersion": KUEUE, "kind": "LocalQueue", "metadata": {"name": "user"},
          "spec": {"clusterQueue": queue}}  # fmt: skip
    await kk.create(group_path(KUEUE, "localqueues", team), lq)

    def job(name: str, count: int) -> Obj:
        body = queued(
            make_job(name, slices={"main": {"1g.10gb": count}}, cpu="100m"),
            "user",
            template_annotations=STAY,
        )
        body["spec"]["suspend"] = True
        return body

    await kk.create(jobs_path(team), job("first", 1))
    # (a failure shows the Workload's conditions: why Kueue did not admit it)
    wl = await wait_for(
        kk, workloads_path(team),
        lambda ws: next((w for w in ws.values() if owner(w) == "first" and admitted(w)), None),
        what="the first Job's Workload admitted",
    )  # fmt: skip
    (pod,) = await running_pods(kk, team, 1, labelSelector="job-name=first")
    alloc = await assert_holds_slices(kk, own_system, team, pod["metadata"]["name"])
    assert [s["profile"] for s in alloc["spec"]["slices"]] == ["1g.10gb"]
    usage = wl["status"]["admission"]["podSetAssignments"][0]["resourceUsage"]
    assert usage == {"cpu": "100m", "nvidia.com/mig-1g.10gb": "1"}, usage

    # 1 + 2 > 2: the second waits on the quota in NVIDIA's name, not on a resource never written
    await kk.create(jobs_path(team), job("second", 2))
    held = await wait_for(
        kk, workloads_path(team),
        lambda ws: next((w for w in ws.values() if owner(w) == "second" and not admitted(w)
                         and "nvidia.com/mig-1g.10gb" in str(w.get("status", {}))), None),
        what="the second Job's Workload pending on nvidia.com/mig-1g.10gb",
    )  # fmt: skip
    assert MEMORY_SLOTS_RESOURCE not in str(held.get("status", {})), held["status"]
    assert (await kk.get(jobs_path(team, "second")))["spec"]["suspend"] is True
    assert len((await kk.list(pods_path(team), labelSelector="job-name=second"))["items"]) == 0
    # and once the first is done, the quota is the second's
    await finish(kk, pod)
    (second,) = await running_pods(kk, team, 1, labelSelector="job-name=second")
    alloc = await assert_holds_slices(kk, own_system, team, second["metadata"]["name"])
    assert [s["profile"] for s in alloc["spec"]["slices"]] == ["1g.10gb", "1g.10gb"]


async def test_job_quota_runs_two_of_three_then_the_third(kk: Kube, plain: None, team: str) -> None:
    q = await local_queue(kk, team, {"any": {"nvidia.com/mig-1g.10gb": 2}})
    for i in range(3):
        job = make_job(f"j{i}", slices={"work": {"1g.10gb": 1}})
        await kk.create(jobs_path(team), queued(job, q, template_annotations=STAY))
    two = await running_pods(kk, team, 2)
    wls = (await kk.list(workloads_path(team)))["items"]
    waiting = [w for w in wls if not admitted(w)]
    assert len(wls) == 3 and len(waiting) == 1, [(owner(w), admitted(w)) for w in wls]
    third = owner(waiting[0])
    assert (await kk.get(jobs_path(team, third)))["spec"]["suspend"] is True
    # the admitted Workloads are charged in the user's names (transformations, common/quota.py)
    usage = next(w for w in wls if admitted(w))["status"]["admission"]["podSetAssignments"][0]
    assert usage["resourceUsage"] == {"nvidia.com/mig-1g.10gb": "1"}

    await finish(kk, two[0])
    pod = await running_pods(kk, team, 1, labelSelector=f"job-name={third}")
    assert pod[0]["metadata"]["annotations"][CLAIM_ANNOTATION]


@pytest.mark.parametrize("kueue_first", [False, True], ids=["instaslice-first", "kueue-first"])
async def test_plain_pods_quota_in_either_webhook_order(
    kk: Kube, own_system: DevSystem, plain: None, team: str, kueue_first: bool
) -> None:
    kueue.register_webhooks(
        own_system.cp, kueue.find_kueue_dir(), own_system.kueue_port, first=kueue_first
    )
    try:
        q = await local_queue(kk, team, {"any": {"nvidia.com/mig-1g.10gb": 2}})
        for i in range(3):
            pod = user_pod(name=f"p{i}", slices={"main": {"1g.10gb": 1}}, labels={QUEUE_LABEL: q})
            created = await kk.create(pods_path(team), pod)
            # (Kueue also adds its topology gate, lifted at admission when TAS is not used)
            gates = [
                g["name"] for g in created["spec"]["schedulingGates"]
                if g["name"] in (GATE_NAME, KUEUE_GATE)
            ]  # fmt: skip
            assert gates == ([KUEUE_GATE, GATE_NAME] if kueue_first else [GATE_NAME, KUEUE_GATE])
        up = await running_pods(kk, team, 2)
        pods = {p["metadata"]["name"]: p for p in (await kk.list(pods_path(team)))["items"]}
        (held,) = [p for p in pods.values() if p["status"].get("phase") != "Running"]
        assert {g["name"] for g in held["spec"]["schedulingGates"]} >= {GATE_NAME, KUEUE_GATE}
        # Kueue reads the rewritten pod and charges it in the user's name
        wls = (await kk.list(workloads_path(team)))["items"]
        res = wls[0]["spec"]["podSets"][0]["template"]["spec"]["containers"][0]["resources"]
        assert res["limits"]["instaslice.io/mig-1g.10gb"] == "1"
        usage = [w["status"]["admission"]["podSetAssignments"][0]["resourceUsage"]
                 for w in wls if admitted(w)]  # fmt: skip
        assert usage == [{"nvidia.com/mig-1g.10gb": "1"}] * 2
        # InstaSlice leaves a pod Kueue holds alone: no allocation, no AllocationPending
        name = held["metadata"]["name"]
        events = await kk.list(
            core_path("events", team), fieldSelector=f"involvedObject.name={name}"
        )
        assert REASON_PENDING not in [e["reason"] for e in events["items"]]
        assert len((await kk.list(allocs_path(team)))["items"]) == 2

        await kk.delete(pods_path(team, up[0]["metadata"]["name"]))
        await running_pods(kk, team, 1, fieldSelector=f"metadata.name={name}")
    finally:
        kueue.register_webhooks(own_system.cp, kueue.find_kueue_dir(), own_system.kueue_port)


async def test_a_flavor_per_gpu_model_sends_jobs_to_that_model(
    kk: Kube, plain: None, team: str
) -> None:
    quota = {"nvidia.com/mig-1g.10gb": 1}
    q = await local_queue(
        kk, team, {flavor_name("A100-80GB"): quota, flavor_name("H100-80GB"): quota}
    )
    for i in range(2):
        job = make_job(f"m{i}", slices={"work": {"1g.10gb": 1}})
        await kk.create(jobs_path(team), queued(job, q, template_annotations=STAY))
        (pod,) = await running_pods(kk, team, 1, labelSelector=f"job-name=m{i}")
        model = ("A100-80GB", "H100-80GB")[i]  # the first flavor with quota left
        assert pod["spec"]["nodeSelector"] == {GPU_MODEL_LABEL: model}
        assert pod["spec"]["nodeName"] == ("a100-0", "h100-0")[i]


# --- Kueue admits, InstaSlice cannot place ------------------------------------------------------


async def test_admitted_but_unplaceable_is_explained_and_requeued(
    kk: Kube, plain: None, team: str
) -> None:
    # both 7g.80gb GPUs hold a 4g.40gb slice of a pod Kueue does not manage
    for model in ("H100-80GB", "A100-80GB"):
        pod = user_pod(name=f"hold-{model.lower()}", slices={"main": {"4g.40gb": 1}},
                       node_selector={GPU_MODEL_LABEL: model})  # fmt: skip
        await kk.create(pods_path(team), pod)
    await running_pods(kk, team, 2)
    q = await local_queue(kk, team, {"any": {"nvidia.com/mig-7g.80gb": 4}})
    await kk.create(jobs_path(team), queued(make_job("big", slices={"work": {"7g.80gb": 1}}), q))
    pod = await wait_for(
        kk, pods_path(team), lambda ps: next(iter(ps.values()), None),
        what="the Job's pod", labelSelector="job-name=big",
    )  # fmt: skip
    name = pod["metadata"]["name"]
    told = await wait_event(kk, team, name, REASON_PENDING)
    assert "7g.80gb" in told["message"], told["message"]
    # waitForPodsReady (30 s in the dev system) evicts it, and Kueue requeues it
    wl = await wait_for(
        kk, workloads_path(team),
        lambda ws: next((w for w in ws.values() if owner(w) == "big"
                         and w.get("status", {}).get("requeueState", {}).get("count")), None),
        what="the Workload evicted by waitForPodsReady and requeued", within=120,
    )  # fmt: skip
    reasons = {c["type"]: c.get("reason") for c in wl["status"]["conditions"]}
    assert reasons.get("Evicted") == "PodsReadyTimeout" or "PodsReadyTimeout" in str(wl), wl


# --- with slot accounting (the webhook's --slot-accounting) ------------------------------------


async def test_memory_slots_limit_a_namespace_across_profiles(
    kk: Kube, slotted: None, team: str
) -> None:
    # as a ResourceQuota: 1 + 2 slots fit in 3, one more slot is refused at admission
    rq = {"metadata": {"name": "slots"},
          "spec": {"hard": {f"requests.{MEMORY_SLOTS_RESOURCE}": "3"}}}  # fmt: skip
    await kk.create(core_path("resourcequotas", team), rq)
    await wait_for(kk, core_path("resourcequotas", team),
                   lambda r: r.get("slots", {}).get("status", {}).get("hard"),
                   what="the quota's status")  # fmt: skip
    await kk.create(pods_path(team), user_pod(name="s1", slices={"main": {"1g.10gb": 1}}))
    await kk.create(pods_path(team), user_pod(name="s2", slices={"main": {"2g.20gb": 1}}))
    with pytest.raises(ApiError) as refused:
        await kk.create(pods_path(team), user_pod(name="s3", slices={"main": {"1g.10gb": 1}}))
    assert refused.value.status == 403 and MEMORY_SLOTS_RESOURCE in str(refused.value)
    await running_pods(kk, team, 2)
    for name in ("s1", "s2"):
        await kk.delete(pods_path(team, name))
    await kk.delete(core_path("resourcequotas", team, "slots"))

    # as a Kueue quota: 3 slots over two profiles admit 1g.10gb + 2g.20gb, not one more
    big = {"nvidia.com/mig-1g.10gb": 8, "nvidia.com/mig-2g.20gb": 8, MEMORY_SLOTS_RESOURCE: 3}
    q = await local_queue(kk, team, {"any": big})
    for name, profile in (("k1", "1g.10gb"), ("k2", "2g.20gb"), ("k3", "1g.10gb")):
        job = make_job(name, slices={"work": {profile: 1}})
        await kk.create(jobs_path(team), queued(job, q, template_annotations=STAY))
    await running_pods(kk, team, 2, labelSelector="job-name in (k1,k2)")
    wl = await wait_for(
        kk, workloads_path(team),
        lambda ws: next((w for w in ws.values() if owner(w) == "k3" and not admitted(w)
                         and MEMORY_SLOTS_RESOURCE in str(w.get("status", {}))), None),
        what="k3's Workload pending on memory slots",
    )  # fmt: skip
    assert not admitted(wl)


# --- size-based requests ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("selector", "node", "profile", "slots"),
    [
        ({GPU_MODEL_LABEL: "H100-80GB"}, "h100-0", "3g.40gb", 4),  # 1g.20gb is 19.6 GiB
        ({GPU_MODEL_LABEL: "A100-80GB"}, "a100-0", "3g.40gb", 4),  # 2g.20gb is 19.5 GiB
        # the least memory of every model's smallest fit; charged the most any catalog model's
        # fit takes (A100-40GB 7g.40gb: 8), as the selector leaves the model open
        (None, "h200-0", "1g.35gb", 8),
    ],
)
async def test_size_based_pod_gets_the_smallest_fitting_profile(
    kk: Kube,
    slotted: None,
    team: str,
    selector: dict[str, str] | None,
    node: str,
    profile: str,
    slots: int,
) -> None:
    pod = user_pod(name="sized", slices={}, node_selector=selector)
    pod["spec"]["containers"] = [{"name": "main", "image": "registry.k8s.io/pause:3.10"}]
    pod["metadata"]["annotations"] = {"instaslice.io/mig-size.main": "memory>=20Gi"}
    await kk.create(pods_path(team), pod)
    (up,) = await running_pods(kk, team, 1)
    assert up["spec"]["nodeName"] == node
    limits = up["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {MEMORY_SLOTS_RESOURCE: str(slots)}
    (alloc,) = (await kk.list(allocs_path(team)))["items"]
    assert [(s["container"], s["profile"]) for s in alloc["spec"]["slices"]] == [("main", profile)]
