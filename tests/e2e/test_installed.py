"""InstaSlice as shipped: `install: chart` (docs/contract.md §5, hack/cluster/chartinstall.py).

The two images are built here from the Containerfiles (make images), imported into the real
node's containerd, and docs/install.md's `helm install instaslice charts/instaslice
--namespace instaslice-system --create-namespace` (the webhook's own certificate, no
cert-manager) runs the webhook/allocator Deployment and the node-agent DaemonSet as pods on the
real node (pod network on a bridge, the API server reaching the webhook's Service through its
endpoints; the agent on the NVML emulator via the chart's `testing.emulator` value); the KWOK
node keeps its emulated agent outside the cluster. No InstaSlice process runs outside the
cluster but that agent.

Covers: the release is deployed from the images built here; InstaSlice's pods are Running and
Ready on the real node with pod-network IPs; a MIG pod on the real node gets its slice through
the installed components and its container sees exactly its device; a pod on the KWOK node is
served by the in-cluster allocator; a `helm upgrade` (docs/upgrade.md's block) that changes a
setting of both workloads restarts every InstaSlice pod, keeps running pods' slices Ready and
serves new pods; after the pods are gone no MIG instance, CDI file or finalizer is left;
`helm uninstall` while a slice is in use is refused (the chart's pre-delete hook, its Job on
the real node, docs/upgrade.md); once the pod is gone it goes through and leaves no MIG
instance, CDI file, admission hook, Node capacity or Secret (the webhook's own certificate)
behind, and keeps the CRDs. Then DRA mode
by chart on the same cluster (`dra: true` with `install: chart`, installed again): the
DaemonSet's agent registers its DRA plugin with the real kubelet, whose root dir is not
/var/lib/kubelet (the chart's `nodeagent.kubeletDir`), and prepares a user's own
ResourceClaim that kube-scheduler allocated, writing the prepared device (its MIG UUID) into
the claim's status.devices; releasing it leaves no CDI file or instance.

Leaves out: cert-manager (the chart's `certificates.mode=cert-manager`),
NetworkPolicy enforcement (the bridge CNI has none), real GPUs (emulated; device files without
a driver). Its own control plane (module fixture), as tests/e2e/test_realnode.py has.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio

from common.constants import ENABLED_KEY
from common.kubeapi import Kube, Obj, core_path, group_path
from hack.cluster import podnet
from hack.cluster.chartinstall import NAMESPACE, RELEASE, ChartInstallError, helm
from hack.dev import DRA_MODE, DevSystem
from nodeagent.emulator import EmulatorControl
from testkit.builders import user_pod
from tests.e2e.conftest import opted_in_namespace, running_system
from tests.e2e.helpers import (
    RELEASE_TIMEOUT_S,
    allocs_path,
    cdi_file_for,
    cdi_files,
    make_real_pod,
    pods_path,
    wait_opted_in,
    wait_pod_running,
)
from tests.e2e.test_realnode import REAL, SHOW, alloc_of, assert_sees_only_its_own
from tests.e2e.test_realnode_dra import REGISTERED, a_claim, claims_path, dra_pod, running
from tests.e2e.test_realnode_dra import assert_sees_only_its_own as assert_claim_sees_its_own
from tests.support import wait_for
from webhook.allocator.leader import LEASE_NAME

pytestmark = pytest.mark.timeout(900)  # the first test builds both images
KWOK = "kwok-0"
ON_KWOK = {"kubernetes.io/hostname": KWOK}
SPEC: dict[str, Any] = {
    "install": "chart",
    "nodes": [
        {"prefix": "kwok", "count": 1, "gpus": 1, "model": "H100-80GB",
         "labels": {"nvidia.com/mig.capable": "true"}},
        {"prefix": "real", "count": 1, "gpus": 1, "model": "H100-80GB", "runtime": "containerd"},
    ],
}  # fmt: skip
ONE = {"main": {"1g.10gb": 1}}


@pytest.fixture(scope="module")
def installed(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DevSystem]:
    with running_system(request.config, tmp_path_factory.mktemp("installed"), SPEC) as started:
        yield started


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def ikube(installed: DevSystem) -> AsyncIterator[Kube]:
    async with await Kube.connect(str(installed.kubeconfig)) as k:
        yield k


@pytest_asyncio.fixture(loop_scope="session")
async def ns(ikube: Kube) -> AsyncIterator[str]:
    async with opted_in_namespace(ikube, "inst-") as name:
        yield name


async def instaslice_pods(kube: Kube) -> dict[str, Obj]:
    """InstaSlice's pods, without those being deleted (a rollout's old ones terminating)."""
    listing = await kube.get(core_path("pods", NAMESPACE))
    return {
        p["metadata"]["name"]: p
        for p in listing["items"]
        if not p["metadata"].get("deletionTimestamp")
    }


async def assert_served_on_kwok(kube: Kube, system: DevSystem, ns: str, name: str) -> None:
    """The pod's allocation is Ready on the KWOK node, whose emulated GPUs hold exactly its
    instances, with their CDI file (the KWOK node's agent runs outside the cluster; in the
    chart's device-plugin mode no kubelet binds, so the pod carries no device env)."""
    pod = await kube.get(pods_path(ns, name))
    assert pod["spec"]["nodeName"] == KWOK and pod["status"]["phase"] == "Running", pod["status"]
    alloc = await alloc_of(kube, ns, name)
    assert alloc["status"]["phase"] == "Ready", alloc["status"]
    assert alloc["spec"]["nodeName"] == KWOK and alloc["spec"]["podUID"] == pod["metadata"]["uid"]
    uuids = {s["migUUID"] for s in alloc["status"]["slices"]}
    instances = {i.mig_uuid for i in EmulatorControl(system.gpu_state, KWOK).instances()}
    assert uuids <= instances, (uuids, instances)
    assert cdi_file_for(system, KWOK, ns, alloc["metadata"]["name"]) is not None, alloc


async def assert_nothing_left(kube: Kube, system: DevSystem) -> None:
    """No SliceAllocation (waited for), and no MIG instance or CDI file on either node."""
    await wait_for(
        kube,
        allocs_path(None),
        lambda a: not a,
        what="no SliceAllocation anywhere",
        within=RELEASE_TIMEOUT_S,
    )
    for node in (REAL, KWOK):
        assert not cdi_files(system, node), f"CDI files left on {node}"
        instances = EmulatorControl(system.gpu_state, node).instances()
        assert not instances, f"MIG instances left on {node}: {instances}"


def ready(pod: Obj) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def release_values(system: DevSystem) -> dict[str, Any]:
    out = helm(system.cp, "get", "values", RELEASE, "-n", NAMESPACE, "--all", "-o", "json")
    values: dict[str, Any] = json.loads(out)
    return values


# --- tests ---------------------------------------------------------------------------------


async def test_the_release_is_deployed_from_the_images_built_here(installed: DevSystem) -> None:
    status = json.loads(helm(installed.cp, "status", RELEASE, "-n", NAMESPACE, "-o", "json"))
    assert status["info"]["status"] == "deployed", status["info"]
    assert installed.real is not None
    imported = installed.real.ctr("images", "ls", "-q").stdout.split()
    for part, image in release_values(installed)["images"].items():
        ref = f"{image['repository']}:{image['tag']}"
        assert ref.startswith(f"localhost/instaslice/instaslice-{part}:dev-"), ref
        assert ref in imported, f"{ref} not in the real node's containerd: {imported}"
    # nothing of InstaSlice runs outside the cluster but the KWOK node's emulated agent
    assert set(installed.processes) == {"nodeagent"}, installed.processes


async def test_instaslices_pods_run_on_the_real_node(ikube: Kube, installed: DevSystem) -> None:
    pods = await instaslice_pods(ikube)
    kinds = {p["metadata"]["labels"]["app.kubernetes.io/name"] for p in pods.values()}
    assert kinds == {"instaslice-webhook", "instaslice-nodeagent"}, sorted(pods)
    for name, pod in pods.items():
        assert pod["spec"]["nodeName"] == REAL, f"{name} on {pod['spec'].get('nodeName')}"
        assert pod["status"]["phase"] == "Running" and ready(pod), (name, pod["status"])
        assert not pod["spec"].get("hostNetwork"), name
        assert pod["status"]["podIP"].startswith(podnet.SUBNET.rsplit(".", 2)[0]), pod["status"]
    webhooks = [p for p in pods.values() if p["metadata"]["name"].startswith("instaslice-webhook")]
    assert len(webhooks) == 2, sorted(pods)
    # the API server calls the webhook through its Service (no URL, no local process)
    mwc = await ikube.get(
        "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/instaslice"
    )
    for hook in mwc["webhooks"]:
        assert hook["clientConfig"]["service"]["name"] == "instaslice-webhook", hook
        assert "url" not in hook["clientConfig"], hook


async def test_a_mig_pod_on_the_real_node_sees_exactly_its_device(
    ikube: Kube, installed: DevSystem, ns: str
) -> None:
    await ikube.create(pods_path(ns), make_real_pod("a", REAL, ONE, SHOW))
    await wait_pod_running(ikube, ns, "a")
    mine = await assert_sees_only_its_own(ikube, installed, ns, "a", ["main"])
    assert len(mine) == 1, mine
    alloc = await alloc_of(ikube, ns, "a")
    assert alloc["status"]["phase"] == "Ready", alloc["status"]
    # the emulated GPU holds exactly that instance, made by the agent's pod
    held = {i.mig_uuid for i in EmulatorControl(installed.gpu_state, REAL).instances()}
    assert held == mine, (held, mine)


async def test_a_pod_on_the_kwok_node_is_served_by_the_in_cluster_allocator(
    ikube: Kube, installed: DevSystem, ns: str
) -> None:
    pods = await instaslice_pods(ikube)
    lease = await ikube.get(
        f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases/{LEASE_NAME}"
    )
    holder = lease["spec"]["holderIdentity"]  # <pod name>_<random>
    assert holder.rsplit("_", 1)[0] in pods, f"allocator Lease held by {holder}: {sorted(pods)}"
    await ikube.create(pods_path(ns), user_pod(name="k", slices=ONE, node_selector=ON_KWOK))
    await wait_pod_running(ikube, ns, "k")
    await assert_served_on_kwok(ikube, installed, ns, "k")


async def test_helm_upgrade_restarts_every_component_and_keeps_running_slices(
    ikube: Kube, installed: DevSystem, ns: str
) -> None:
    await ikube.create(pods_path(ns), make_real_pod("before", REAL, ONE, SHOW))
    await ikube.create(pods_path(ns), user_pod(name="kb", slices=ONE, node_selector=ON_KWOK))
    for name in ("before", "kb"):
        await wait_pod_running(ikube, ns, name)
    old = {p["metadata"]["uid"] for p in (await instaslice_pods(ikube)).values()}
    theirs = await assert_sees_only_its_own(ikube, installed, ns, "before", ["main"])
    # a setting of both workloads: their memory limits (every InstaSlice pod is replaced)
    changed = {
        part: {"resources": {**release_values(installed)[part]["resources"],
                             "limits": {"memory": "600Mi"}}}
        for part in ("webhook", "nodeagent")
    }  # fmt: skip
    await asyncio.to_thread(installed.install_chart, changed)
    now = await instaslice_pods(ikube)
    assert not old & {p["metadata"]["uid"] for p in now.values()}, "a pod was not replaced"
    for name, pod in now.items():
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        assert limits["memory"] == "600Mi" and ready(pod), (name, limits, pod["status"])
    # the running pods kept their slices and containers
    for name in ("before", "kb"):
        pod = await ikube.get(pods_path(ns, name))
        assert pod["status"]["phase"] == "Running", pod["status"]
        assert all(c.get("restartCount", 0) == 0 for c in pod["status"]["containerStatuses"])
    await assert_served_on_kwok(ikube, installed, ns, "kb")
    assert await assert_sees_only_its_own(ikube, installed, ns, "before", ["main"]) == theirs
    # and new pods are served by the new pods
    await ikube.create(pods_path(ns), make_real_pod("after", REAL, ONE, SHOW))
    await ikube.create(pods_path(ns), user_pod(name="ka", slices=ONE, node_selector=ON_KWOK))
    for name in ("after", "ka"):
        await wait_pod_running(ikube, ns, name)
    await assert_served_on_kwok(ikube, installed, ns, "ka")
    mine = await assert_sees_only_its_own(ikube, installed, ns, "after", ["main"])
    assert not mine & theirs, (mine, theirs)


async def test_nothing_is_left_behind_after_the_pods_are_gone(
    ikube: Kube, installed: DevSystem, ns: str
) -> None:
    """No MIG instance, no CDI file, and no finalizer holding a SliceAllocation or a pod."""
    await ikube.create(pods_path(ns), make_real_pod("r", REAL, ONE, SHOW))
    await ikube.create(pods_path(ns), user_pod(name="k", slices=ONE, node_selector=ON_KWOK))
    for name in ("r", "k"):
        await wait_pod_running(ikube, ns, name)
        await ikube.delete(pods_path(ns, name))
    await wait_for(ikube, pods_path(ns), lambda p: not p, what="the pods gone")
    await assert_nothing_left(ikube, installed)


async def test_helm_uninstall_with_a_slice_in_use_is_refused(
    ikube: Kube, installed: DevSystem
) -> None:
    """docs/upgrade.md: the chart's pre-delete hook refuses while any slice is in use. Last,
    in a namespace of its own left for the module's teardown: if the uninstall went through,
    InstaSlice (and its CRDs) would be gone for whatever came after it."""
    ns = (
        await ikube.create(
            core_path("namespaces"),
            {"metadata": {"generateName": "busy-", "annotations": {ENABLED_KEY: "true"}}},
        )
    )["metadata"]["name"]
    await wait_for(ikube, core_path("serviceaccounts", ns), lambda sas: "default" in sas, what="SA")
    await wait_opted_in(ikube, ns)
    await ikube.create(pods_path(ns), make_real_pod("busy", REAL, ONE, SHOW))
    await wait_pod_running(ikube, ns, "busy")
    try:
        helm(installed.cp, "uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout=60s")
    except ChartInstallError as e:
        refusal = str(e)
    else:
        refusal = "it went through"
    assert "pre-delete" in refusal, f"helm uninstall not refused by the pre-delete hook: {refusal}"
    # Helm records the attempt (`uninstalling`) but deleted nothing: everything still runs
    status = json.loads(helm(installed.cp, "status", RELEASE, "-n", NAMESPACE, "-o", "json"))
    assert status["info"]["status"] == "uninstalling", status["info"]
    mwc = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/instaslice"
    assert (await ikube.get(mwc))["webhooks"], "the admission hooks were deleted"
    pods = await instaslice_pods(ikube)
    # the hook's Job ran on the real node (the webhook's placement and image) and failed
    (hook,) = [p for n, p in pods.items() if n.startswith("instaslice-uninstall-pre-delete")]
    assert (hook["spec"]["nodeName"], hook["status"]["phase"]) == (REAL, "Failed"), hook["status"]
    running = {n: p for n, p in pods.items() if p is not hook}
    assert running and all(ready(p) for p in running.values()), sorted(running)
    await assert_sees_only_its_own(ikube, installed, ns, "busy", ["main"])


async def test_helm_uninstall_after_the_slice_is_released_leaves_nothing_behind(
    ikube: Kube, installed: DevSystem
) -> None:
    """After the refusal above: once the pod holding the slice is gone, `helm uninstall` (its
    pre- and post-delete Jobs on the real node) goes through; no InstaSlice pod, admission
    hook, MIG instance, CDI file or `instaslice.io/*` Node capacity is left (the real node's
    kubelet keeps its device plugins' names at 0 until its own grace period ends), the CRDs
    are kept. The KWOK node's agent, outside the cluster, stops first, as the DaemonSet's
    pods do on a real cluster (it would advertise its capacity again)."""
    listing = await ikube.get(core_path("namespaces"))
    for ns in [n["metadata"]["name"] for n in listing["items"]]:
        if ns.startswith("busy-"):
            await ikube.delete(core_path("namespaces", name=ns))
    await assert_nothing_left(ikube, installed)  # the busy pod's slice released
    installed.stop("nodeagent")
    # --timeout: at least uninstallHook.timeoutSeconds (docs/upgrade.md)
    helm(installed.cp, "uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout=600s",
         timeout_s=660)  # fmt: skip
    with pytest.raises(ChartInstallError, match="not found"):
        helm(installed.cp, "status", RELEASE, "-n", NAMESPACE)
    await wait_for(ikube, core_path("pods", NAMESPACE), lambda p: not p, what="no pod left")
    hooks = await ikube.get("/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations")
    assert not [h for h in hooks["items"] if h["metadata"]["name"] == "instaslice"], hooks
    # nothing of the release's in its namespace: the webhook's own certificate Secret too
    secrets = (await ikube.get(core_path("secrets", NAMESPACE)))["items"]
    assert not [s["metadata"]["name"] for s in secrets], secrets
    for crd in ("sliceallocations", "mignodes"):  # kept: helm.sh/resource-policy
        await ikube.get(
            f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd}.instaslice.io"
        )
    for node in (await ikube.get(core_path("nodes")))["items"]:
        name, status = node["metadata"]["name"], node["status"]
        left = {r: q for r, q in status.get("allocatable", {}).items() if "instaslice.io/" in r}
        if name == REAL:  # the kubelet's: none allocatable
            assert set(left.values()) <= {"0"}, left
        else:
            assert not left and "instaslice.io/gpu" not in status["capacity"], (name, left)
    await assert_nothing_left(ikube, installed)  # and nothing made again


async def test_dra_mode_by_chart_the_in_cluster_agent_prepares_a_users_claim(
    ikube: Kube, installed: DevSystem
) -> None:
    """`dra: true` with `install: chart` (docs/dra.md): what the spec key sets (hack/dev.py),
    installed again after the uninstall above (a `-k` run upgrades the release instead). The
    agent's pod hands the kubelet its plugin socket by the host path under the real node's
    kubelet root (not /var/lib/kubelet, nor a path inside its container), so the kubelet
    prepares a user's own claim through it."""
    assert installed.real is not None
    installed.agent_args += (DRA_MODE,)
    values = await asyncio.to_thread(installed.install_chart)
    assert values["allocationMode"] == "dra", values
    assert not [p for p in installed.processes if REAL in p], installed.processes  # a pod only
    kubelet = installed.real.root / "kubelet"
    socket = kubelet / "plugins" / "instaslice.io" / "dra.sock"
    assert values["nodeagent"]["kubeletDir"] == str(kubelet) != "/var/lib/kubelet", values
    await wait_for(
        ikube,
        group_path("resource.k8s.io/v1", "resourceslices"),
        lambda s: [x for x in s.values() if x["spec"].get("nodeName") == REAL],
        what=f"the in-cluster agent's ResourceSlices of {REAL}",
    )
    ns = (await ikube.create(core_path("namespaces"), {"metadata": {"generateName": "drac-"}}))[
        "metadata"
    ]["name"]
    await wait_for(ikube, core_path("serviceaccounts", ns), lambda sas: "default" in sas, what="SA")
    try:
        await ikube.create(claims_path(ns), a_claim("c", "1g.10gb"))
        await ikube.create(pods_path(ns), dra_pod("p", "c"))
        await running(ikube, installed, ns, "p", timeout_s=180)
        mine = await assert_claim_sees_its_own(installed, ikube, ns, "p", "c")
        held = {i.mig_uuid for i in EmulatorControl(installed.gpu_state, REAL).instances()}
        assert held == {mine}, (held, mine)
        assert socket.is_socket(), f"{socket}: the plugin's socket is not on the host"
        # the agent's pod (its ServiceAccount token bound to it: associated-node) wrote the
        # prepared device into the claim's status
        await wait_for(
            ikube,
            claims_path(ns),
            lambda c: "c" in c and ready_device(c["c"], mine),
            what="the claim's status.devices naming its MIG UUID",
        )
        logs = await asyncio.to_thread(
            installed.cp.kubectl, "logs", "-n", NAMESPACE, "daemonset/instaslice-nodeagent"
        )
        assert REGISTERED in logs.stdout and str(socket) in logs.stdout, logs.stdout[-2000:]
        await ikube.delete(pods_path(ns, "p"), {"gracePeriodSeconds": 0})
        await wait_for(ikube, pods_path(ns), lambda p: not p, what="the pod gone")
        await ikube.delete(claims_path(ns, "c"))
        await wait_for(ikube, claims_path(ns), lambda c: not c, what="the claim released")
        await wait_for_nothing_on(installed, REAL)
    finally:
        await ikube.delete(core_path("namespaces", name=ns))


def ready_device(claim: Obj, mig_uuid: str) -> bool:
    """Whether the claim's status.devices has this node's entry Ready with `mig_uuid`."""
    return any(
        (d["driver"], d["pool"], d.get("data", {}).get("migUUID"))
        == ("instaslice.io", REAL, mig_uuid)
        and any(c["type"] == "Ready" and c["status"] == "True" for c in d["conditions"])
        for d in (claim.get("status") or {}).get("devices") or []
    )


async def wait_for_nothing_on(system: DevSystem, node: str, within: float = 60.0) -> None:
    """Until the node has no MIG instance and no CDI file of InstaSlice (the agent destroys
    them after the claim's deallocation, off any watch this test can join)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        left = (
            sorted(cdi_files(system, node)),
            EmulatorControl(system.gpu_state, node).instances(),
        )
        if not any(left):
            return
        assert loop.time() < deadline, f"left on {node}: {left}"
        await asyncio.sleep(0.5)
