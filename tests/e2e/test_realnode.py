"""Binding proven in real containers: a real kubelet + containerd + runc node (the spec's
`runtime: containerd` group, hack/cluster/realnode.py) next to a KWOK node, its emulated GPU
backed by real device files; every test runs twice, once per binding mode of the real node:
`device-plugin` (the agent serves the kubelet, containerd applies the CDI device, runc runs
it) and `env` (the webhook's NVIDIA_VISIBLE_DEVICES, resolved by NVIDIA's
nvidia-container-runtime in CDI mode, the node's default runtime).

Covers: the node registers and is Ready beside KWOK; a pod asking `nvidia.com/mig-<p>` runs
busybox `env; ls -l /dev /dev/nvidia-caps`, and its log (`kubectl logs`, through the real
kubelet) shows NVIDIA_VISIBLE_DEVICES naming exactly its own MIG device and exactly its
slice's GPU-instance and compute-instance capability nodes, injected by the mode under test;
a second pod on the same GPU sees only its own; each container of a multi-container pod sees
only its own; on release the CDI files go and containerd keeps no task (container records
are the kubelet's GC's, within a minute, not waited for); a pod-level `cdi.k8s.io/*`
annotation injects nothing; a kubelet restart; a node-agent restart between "Ready" and the
kubelet's admission (issue 17 #2); a bare pod whose slice was released never gets another
pod's prepared slice (issue 17 #1).

Leaves out: NVML (emulated; the device files have no driver behind them), pod networking
(hostNetwork only), the kubelet's own rejection of a pod admitted before a restarted kubelet
saw the plugin again (upstream behaviour; docs/binding.md). Its own control plane per mode
(module fixture), so the shared e2e system's agent tests keep their node count.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio

from common.constants import (
    CDI_FILE_PREFIX,
    CDI_KIND,
    CLAIM_ANNOTATION,
    REASON_PINNED_UNSCHEDULABLE,
    VISIBLE_DEVICES_ENV,
)
from common.kubeapi import Kube, Obj, core_path, instaslice_path
from hack.dev import DevSystem
from nodeagent.cdi import formula_minor
from tests.e2e.conftest import opted_in_namespace, running_system
from tests.e2e.helpers import (
    allocs_path,
    make_real_pod,
    pods_path,
    wait_event,
    wait_pod_running,
)
from tests.support import wait_for

REAL = "real-0"
SPEC: dict[str, Any] = {
    "nodes": [
        {"prefix": "kwok", "count": 1, "gpus": 1, "model": "H100-80GB"},
        {"prefix": "real", "count": 1, "gpus": 1, "model": "H100-80GB", "runtime": "containerd"},
    ]
}
SHOW = "env; ls -l /dev /dev/nvidia-caps; echo END-OF-LISTING; exec sleep 3600"


@pytest.fixture(scope="module", params=["device-plugin", "env"])
def real(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DevSystem]:
    """The system with its real node in one binding mode: `device-plugin` (the kubelet asks
    the agent, containerd applies the CDI device, runc runs it) or `env` (the webhook's
    NVIDIA_VISIBLE_DEVICES, resolved by NVIDIA's runtime, the node's default runtime)."""
    where = tmp_path_factory.mktemp("realnode")
    with running_system(request.config, where, SPEC, real_binding=request.param) as started:
        yield started


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def rkube(real: DevSystem) -> AsyncIterator[Kube]:
    async with await Kube.connect(str(real.kubeconfig)) as k:
        yield k


@pytest_asyncio.fixture(loop_scope="session")
async def ns(rkube: Kube, real: DevSystem) -> AsyncIterator[str]:
    async with opted_in_namespace(rkube, "real-") as name:
        yield name


# --- what a container saw ------------------------------------------------------------------


async def listing(real: DevSystem, ns: str, pod: str, container: str) -> dict[str, Any]:
    """The container's `env; ls -l /dev /dev/nvidia-caps`, through the real kubelet."""
    deadline = time.monotonic() + 30
    while True:
        out = await asyncio.to_thread(
            real.cp.kubectl, "logs", "-n", ns, pod, "-c", container, check=False
        )
        if "END-OF-LISTING" in out.stdout:
            break
        assert time.monotonic() < deadline, f"{pod}/{container}: no listing: {out}"
        await asyncio.sleep(0.5)
    env = [line for line in out.stdout.splitlines() if line.startswith(VISIBLE_DEVICES_ENV + "=")]
    section = out.stdout.split("/dev/nvidia-caps:", 1)
    caps = set(re.findall(r"\bnvidia-cap(\d+)$", section[1], re.M)) if len(section) == 2 else set()
    dev = re.findall(r"^c\S+\s.*\s(\S+)$", section[0], re.M)
    return {"env": env, "caps": {int(c) for c in caps}, "dev": set(dev), "raw": out.stdout}


def expected(alloc: Obj, mig: Obj, container: str) -> tuple[set[str], set[int]]:
    """MIG UUIDs and capability minors of `container`'s slices in the allocation."""
    index = {g["uuid"]: g["index"] for g in mig["status"]["gpus"]}
    uuids, caps = set(), set()
    for want, got in zip(alloc["spec"]["slices"], alloc["status"]["slices"], strict=True):
        if want["container"] != container:
            continue
        g = index[want["gpuUUID"]]
        uuids.add(got["migUUID"])
        caps |= {formula_minor(g, got["giID"]), formula_minor(g, got["giID"], got["ciID"])}
    return uuids, caps


async def alloc_of(kube: Kube, ns: str, pod: str) -> Obj:
    p = await kube.get(pods_path(ns, pod))
    alloc: Obj = await kube.get(allocs_path(ns, p["metadata"]["annotations"][CLAIM_ANNOTATION]))
    return alloc


async def assert_sees_only_its_own(
    kube: Kube, real: DevSystem, ns: str, pod: str, containers: list[str]
) -> set[str]:
    alloc = await alloc_of(kube, ns, pod)
    assert alloc["status"]["phase"] == "Ready", alloc["status"]
    mig = await kube.get(instaslice_path("mignodes", name=REAL))
    seen = set()
    for c in containers:
        uuids, caps = expected(alloc, mig, c)
        got = await listing(real, ns, pod, c)
        where = f"{pod}/{c}:\n{got['raw']}"
        assert got["env"] == [f"{VISIBLE_DEVICES_ENV}={','.join(sorted(uuids))}"], where
        assert got["caps"] == caps, f"caps {got['caps']}, slice's {caps}; {where}"
        assert {"nvidia0", "nvidiactl", "nvidia-uvm"} <= got["dev"], where
        seen |= uuids
    await assert_bound_by_the_mode(real, alloc, containers)
    return seen


async def assert_bound_by_the_mode(real: DevSystem, alloc: Obj, containers: list[str]) -> None:
    """The devices came through the mode under test, not the other: in device-plugin mode
    the agent recorded the kubelet's device ids (DeviceBound) and no NVIDIA runtime is on
    the node; in env mode NVIDIA's runtime injected the container's own CDI device."""
    assert real.real is not None
    conditions = {c["type"]: c for c in alloc["status"].get("conditions", [])}
    ns, claim = alloc["metadata"]["namespace"], alloc["metadata"]["name"]
    log = real.real.logs / "nvidia-container-runtime.log"
    if real.real_binding == "device-plugin":
        assert real.real.runtime == "runc"
        bound = conditions.get("DeviceBound", {})
        assert bound.get("status") == "True", alloc["status"]
        assert all(f"{c}/" in bound["message"] for c in containers), bound
        text = await asyncio.to_thread(log.read_text) if log.exists() else ""
        assert "Injecting devices" not in text, "NVIDIA's runtime injected in device-plugin mode"
    else:
        assert "DeviceBound" not in conditions, alloc["status"]
        text = await asyncio.to_thread(log.read_text)
        for c in containers:
            device = f"{CDI_KIND}={ns}_{claim}_{c}"
            assert f"Injecting devices using CDI: [{device}]" in text, f"{device} not in {log}"


# --- tests ---------------------------------------------------------------------------------


async def test_the_real_node_is_ready_next_to_kwok(rkube: Kube, real: DevSystem) -> None:
    node = await rkube.get(core_path("nodes", name=REAL))
    assert "kwok.x-k8s.io/node" not in node["metadata"].get("annotations", {}), node["metadata"]
    info = node["status"]["nodeInfo"]
    assert info["containerRuntimeVersion"] == "containerd://2.4.2", info
    assert info["kubeletVersion"] == "v1.37.2", info
    taints = {(t["key"], t.get("value"), t["effect"]) for t in node["spec"].get("taints", [])}
    assert ("instaslice.io/real-node", "true", "NoSchedule") in taints, taints
    # the node agent's device plugin registered with the real kubelet
    await wait_for(
        rkube,
        core_path("nodes"),
        lambda n: (
            REAL in n
            and n[REAL]["status"].get("allocatable", {}).get("instaslice.io/mig-1g.10gb") == "7"
        ),
        what="instaslice.io/mig-1g.10gb: 7 allocatable on the real node",
        within=60,
    )
    kwok = await rkube.get(core_path("nodes", name="kwok-0"))
    assert kwok["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"


async def test_two_pods_on_one_gpu_each_see_only_their_own_slice(
    rkube: Kube, real: DevSystem, ns: str
) -> None:
    for name in ("a", "b"):
        await rkube.create(pods_path(ns), make_real_pod(name, REAL, {"main": {"1g.10gb": 1}}, SHOW))
    for name in ("a", "b"):
        await wait_pod_running(rkube, ns, name)
    a = await assert_sees_only_its_own(rkube, real, ns, "a", ["main"])
    b = await assert_sees_only_its_own(rkube, real, ns, "b", ["main"])
    assert len(a) == len(b) == 1 and not a & b, (a, b)


async def test_each_container_of_a_pod_sees_only_its_own_slice(
    rkube: Kube, real: DevSystem, ns: str
) -> None:
    pod = make_real_pod("multi", REAL, {"small": {"1g.10gb": 1}, "big": {"2g.20gb": 1}}, SHOW)
    await rkube.create(pods_path(ns), pod)
    await wait_pod_running(rkube, ns, "multi")
    await assert_sees_only_its_own(rkube, real, ns, "multi", ["small", "big"])


async def test_release_leaves_no_cdi_file_and_no_container(
    rkube: Kube, real: DevSystem, ns: str
) -> None:
    await rkube.create(pods_path(ns), make_real_pod("r", REAL, {"main": {"1g.10gb": 1}}, SHOW))
    await wait_pod_running(rkube, ns, "r")
    files, tasks = await asyncio.to_thread(leftovers, real)
    assert files, "no CDI file while the pod runs"
    assert len(tasks) >= 2, tasks  # the sandbox and the container run
    await rkube.delete(pods_path(ns, "r"))
    await wait_for(rkube, allocs_path(ns), lambda a: not a, what="the allocation released")
    deadline = time.monotonic() + 60
    while any(left := await asyncio.to_thread(leftovers, real)):
        assert time.monotonic() < deadline, f"left over (CDI files, runtime tasks): {left}"
        await asyncio.sleep(0.5)


def leftovers(real: DevSystem) -> tuple[list[str], list[str]]:
    """The real node's InstaSlice CDI files and the container runtime's live tasks."""
    assert real.real is not None
    files = sorted(p.name for p in real.real.cdi_dir.glob(CDI_FILE_PREFIX + "*"))
    return files, real.real.ctr("tasks", "ls", "-q").stdout.split()


async def test_a_pod_level_cdi_annotation_reaches_no_container(
    rkube: Kube, real: DevSystem, ns: str
) -> None:
    """docs/webhook.md: kubelet hands pod annotations only to the sandbox and containerd
    resolves CDI only from the container's config, so `cdi.k8s.io/*` on a pod injects
    nothing. A probe device of another kind (admission refuses ours there) would add an env
    variable and a device node if it did."""
    assert real.real is not None
    probe = {
        "cdiVersion": "0.6.0",
        "kind": "probe.instaslice.io/dev",
        "devices": [
            {
                "name": "p",
                "containerEdits": {
                    "env": ["CDI_PROBE=injected"],
                    "deviceNodes": [
                        {
                            "path": "/dev/probe-null",
                            "hostPath": "/dev/null",
                            "type": "c",
                            "major": 1,
                            "minor": 3,
                        }
                    ],
                },
            }
        ],
    }
    path = real.real.cdi_dir / "probe.instaslice.io.json"
    await asyncio.to_thread(path.write_text, json.dumps(probe))
    try:
        pod = make_real_pod("annotated", REAL, {"main": {"1g.10gb": 1}}, SHOW)
        pod["metadata"]["annotations"] = {"cdi.k8s.io/probe": "probe.instaslice.io/dev=p"}
        await rkube.create(pods_path(ns), pod)
        await wait_pod_running(rkube, ns, "annotated")
        got = await listing(real, ns, "annotated", "main")
        assert "CDI_PROBE" not in got["raw"] and "probe-null" not in got["dev"], got["raw"]
        await assert_sees_only_its_own(rkube, real, ns, "annotated", ["main"])
    finally:
        await asyncio.to_thread(path.unlink, missing_ok=True)


REGISTERED = 'Got registration request from device plugin with resource" resourceName="'
HOLD = "example.com/hold"  # a resource the scheduler waits for and InstaSlice ignores


def registrations(real: DevSystem, profile: str = "1g.10gb") -> int:
    """How often the real kubelet has accepted the agent's plugin for `profile`."""
    assert real.real is not None
    log = (real.real.logs / "kubelet.log").read_text(errors="replace")
    return log.count(f"{REGISTERED}instaslice.io/mig-{profile}")


async def wait_registered_again(real: DevSystem, before: int) -> None:
    """In device-plugin mode, until the kubelet accepted the plugin once more (env: none)."""
    deadline = time.monotonic() + 30
    while real.real_binding == "device-plugin" and (
        await asyncio.to_thread(registrations, real) <= before
    ):
        assert time.monotonic() < deadline, "the device plugin did not register again"
        await asyncio.sleep(0.5)


async def test_a_kubelet_restart_keeps_running_pods_and_serves_new_ones(
    rkube: Kube, real: DevSystem, ns: str
) -> None:
    """The kubelet deletes plugin sockets on restart; the agent serves and registers again.
    A pod running across the restart keeps its container and its slice; a pod created after
    the plugin registered again gets its own slice. (A pod the restarted kubelet admits
    before that is rejected by the kubelet itself: docs/binding.md, "Limitations".)"""
    assert real.real is not None
    await rkube.create(pods_path(ns), make_real_pod("before", REAL, {"main": {"1g.10gb": 1}}, SHOW))
    await wait_pod_running(rkube, ns, "before")
    count = await asyncio.to_thread(registrations, real)
    await asyncio.to_thread(real.real.stop_kubelet)
    await asyncio.to_thread(real.real.start_kubelet, die_with_parent=True)
    await wait_registered_again(real, count)
    await rkube.create(pods_path(ns), make_real_pod("after", REAL, {"main": {"1g.10gb": 1}}, SHOW))
    await wait_pod_running(rkube, ns, "after")
    mine = await assert_sees_only_its_own(rkube, real, ns, "after", ["main"])
    pod = await rkube.get(pods_path(ns, "before"))
    assert pod["status"]["phase"] == "Running", pod["status"]
    assert all(c.get("restartCount", 0) == 0 for c in pod["status"]["containerStatuses"]), pod
    theirs = await assert_sees_only_its_own(rkube, real, ns, "before", ["main"])
    assert not mine & theirs, (mine, theirs)


async def test_a_pod_admitted_after_its_node_agent_restarted_gets_its_own_slice(
    rkube: Kube, real: DevSystem, ns: str
) -> None:
    """Issue 17 #2: the slice is Ready and the pod ungated, but the kubelet has not admitted
    it yet (it waits for HOLD, which the scheduler needs and InstaSlice ignores) when the
    node agent restarts. The restarted agent must still answer the kubelet's Allocate with
    that pod's own slice."""
    assert real.real is not None
    pod = make_real_pod("held", REAL, {"main": {"1g.10gb": 1}}, SHOW)
    pod["spec"]["containers"][0]["resources"]["limits"][HOLD] = "1"
    await rkube.create(pods_path(ns), pod)

    def ungated_unbound(pods: dict[str, Obj]) -> bool:
        p = pods.get("held", {})
        return bool(p) and not p["spec"].get("schedulingGates") and not p["spec"].get("nodeName")

    await wait_for(rkube, pods_path(ns), ungated_unbound, what="held ungated, not bound")
    alloc = await alloc_of(rkube, ns, "held")
    assert alloc["status"]["phase"] == "Ready", alloc["status"]
    count = await asyncio.to_thread(registrations, real)
    await asyncio.to_thread(real.kill, real.real_agent)
    await asyncio.to_thread(real.start_real_agent, die_with_parent=True)
    await wait_registered_again(real, count)
    status = core_path("nodes", name=REAL) + "/status"
    await rkube.patch(status, {"status": {"capacity": {HOLD: "1"}}})
    try:
        await wait_pod_running(rkube, ns, "held")
        await assert_sees_only_its_own(rkube, real, ns, "held", ["main"])
    finally:
        await rkube.patch(status, {"status": {"capacity": {HOLD: None}}})


def restart_webhook(real: DevSystem, *args: str) -> None:
    real.stop("webhook")
    real.webhook_args = tuple(args)
    real.start_webhook(die_with_parent=True)
    real.wait_ready()


async def test_a_pod_whose_slices_were_released_never_gets_another_pods_slice(
    rkube: Kube, real: DevSystem, ns: str
) -> None:
    """Issue 17 #1 on a real kubelet: a bare pod stays unschedulable past the allocator's
    pinned timeout, so its slice is released while it stays ungated and still asks for
    `instaslice.io/mig-*`. When it becomes schedulable later, another pod's prepared slice
    (Ready, ungated, not yet admitted) must not reach its containers; the other pod must
    still get its own."""
    assert real.real is not None
    hold2 = HOLD + "2"
    status = core_path("nodes", name=REAL) + "/status"
    await asyncio.to_thread(restart_webhook, real, "--pinned-unschedulable-timeout=3")
    try:
        thief = make_real_pod("late", REAL, {"main": {"1g.10gb": 1}}, SHOW)
        thief["spec"]["containers"][0]["resources"]["limits"][HOLD] = "1"
        await rkube.create(pods_path(ns), thief)
        await wait_event(rkube, ns, "late", REASON_PINNED_UNSCHEDULABLE)
        await wait_for(rkube, allocs_path(ns), lambda a: not a, what="late's slice released")
    finally:
        await asyncio.to_thread(restart_webhook, real)
    owner = make_real_pod("owner", REAL, {"main": {"1g.10gb": 1}}, SHOW)
    owner["spec"]["containers"][0]["resources"]["limits"][hold2] = "1"
    await rkube.create(pods_path(ns), owner)

    def waiting(pods: dict[str, Obj]) -> bool:
        p = pods.get("owner", {})
        return bool(p) and not p["spec"].get("schedulingGates") and not p["spec"].get("nodeName")

    await wait_for(rkube, pods_path(ns), waiting, what="owner ungated, not bound")
    owners = await alloc_of(rkube, ns, "owner")
    assert owners["status"]["phase"] == "Ready", owners["status"]
    theirs = {s["migUUID"] for s in owners["status"]["slices"]}
    await rkube.patch(status, {"status": {"capacity": {HOLD: "1"}}})  # late first
    try:

        def settled(pods: dict[str, Obj]) -> Obj | None:
            """late: deleted (the allocator's answer to a stuck bare pod), refused, or
            running; whichever, its containers must not hold owner's slice."""
            if "late" not in pods:
                return {"status": {"phase": "Deleted"}}
            late: Obj = pods["late"]
            return late if late.get("status", {}).get("phase") in ("Running", "Failed") else None

        late = await wait_for(rkube, pods_path(ns), settled, what="late settled")
        if late["status"]["phase"] == "Running":
            got = await listing(real, ns, "late", "main")
            assert not any(u in got["raw"] for u in theirs), f"late got owner's slice:\n{got}"
        await rkube.patch(status, {"status": {"capacity": {hold2: "1"}}})
        await wait_pod_running(rkube, ns, "owner")
        await assert_sees_only_its_own(rkube, real, ns, "owner", ["main"])
    finally:
        await rkube.patch(status, {"status": {"capacity": {HOLD: None, hold2: None}}})
