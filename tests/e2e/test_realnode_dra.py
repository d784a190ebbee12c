"""DRA mode on the real node: a real kubelet (v1.37.2) + containerd + runc calls the node
agent's DRA plugin (`dra: true`, `runtime: containerd`; hack/cluster/realnode.py).

Covers: the kubelet registers the plugin (plugin watcher) and kube-scheduler allocates a pod's
own ResourceClaim (`deviceClassName: mig.instaslice.io`, CEL on `profile`) from the agent's
ResourceSlices; the kubelet's NodePrepareResources gets the claim's CDI device id and
containerd injects it: the container sees exactly its MIG device (NVIDIA_VISIBLE_DEVICES = its
MIG UUID, exactly its GPU-instance and compute-instance capability nodes); a second pod's
claim on the same GPU sees only its own; an agent restart and then a kubelet restart keep the
running pod (its claim re-prepared from the records, nothing made twice) and a new pod is
served; deleting the pods and claims leaves no CDI file and no instance.
An unmodified `nvidia.com/mig-*` pod in an opted-in namespace gets its slice through the
allocator's claim (admission rewrites it, the allocator allocates and reserves the claim) and
sees exactly its device; deleting it leaves no claim, CDI file or instance.
Leaves out: NVML (emulated; the device files have no driver behind them).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio

from common.constants import CDI_FILE_PREFIX, CLAIM_ANNOTATION, VISIBLE_DEVICES_ENV
from common.kubeapi import ApiError, Kube, Obj, core_path, group_path
from hack.dev import DevSystem
from nodeagent.cdi import formula_minor
from nodeagent.emulator import EmulatorControl
from tests.e2e.conftest import opted_in_namespace, running_system
from tests.e2e.helpers import make_real_pod, pods_path, wait_pod_running
from tests.e2e.test_realnode import SHOW, listing
from tests.e2e.test_realnode import rkube as rkube  # its Kube for this module's `real`
from tests.support import wait_for

REAL = "real-0"
SPEC: dict[str, Any] = {
    "dra": True,
    "nodes": [
        {"prefix": "real", "count": 1, "gpus": 1, "model": "H100-80GB", "runtime": "containerd"}
    ],
}


@pytest.fixture(scope="module")
def real(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DevSystem]:
    # short: the kubelet's plugin sockets live under its root dir, within 107 bytes
    where = tmp_path_factory.mktemp("rd")
    with running_system(request.config, where, SPEC) as started:
        yield started


@pytest_asyncio.fixture(loop_scope="session")
async def ns(rkube: Kube) -> AsyncIterator[str]:
    created = await rkube.create(core_path("namespaces"), {"metadata": {"generateName": "dra-"}})
    name: str = created["metadata"]["name"]
    await wait_for(rkube, core_path("serviceaccounts", name), lambda s: "default" in s, what="SA")
    try:
        yield name
    finally:
        await rkube.delete(core_path("namespaces", name=name))


def claims_path(ns: str, name: str | None = None) -> str:
    return group_path("resource.k8s.io/v1", "resourceclaims", ns, name)


def a_claim(name: str, profile: str) -> Obj:
    cel = f'device.attributes["instaslice.io"].profile == "{profile}"'
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "slice",
                        "exactly": {
                            "deviceClassName": "mig.instaslice.io",
                            "selectors": [{"cel": {"expression": cel}}],
                        },
                    }
                ]
            }
        },
    }


def dra_pod(name: str, claim: str) -> Obj:
    pod = make_real_pod(name, REAL, {"main": {}}, SHOW)
    pod["metadata"].pop("annotations", None)
    pod["spec"].pop("schedulingGates", None)
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim}]
    for c in pod["spec"]["containers"]:
        c["resources"] = {"claims": [{"name": "gpu"}]}
    return pod


def instances(real: DevSystem) -> list[Any]:
    return sorted(EmulatorControl(real.gpu_state, REAL).instances())


async def device_of(kube: Kube, ns: str, claim: str) -> str:
    got = await kube.get(claims_path(ns, claim))
    (result,) = got["status"]["allocation"]["devices"]["results"]
    assert (result["driver"], result["pool"]) == ("instaslice.io", REAL), result
    return str(result["device"])


async def assert_sees_only_its_own(
    real: DevSystem, kube: Kube, ns: str, pod: str, claim: str
) -> str:
    device = await device_of(kube, ns, claim)
    _, _, pid, start = device.split("-")[1:]
    (row,) = [r for r in instances(real) if (r.profile_id, r.start) == (int(pid), int(start))]
    got = await listing(real, ns, pod, "main")
    where = f"{pod}:\n{got['raw']}"
    assert got["env"] == [f"{VISIBLE_DEVICES_ENV}={row.mig_uuid}"], where
    want = {formula_minor(0, row.gi_id), formula_minor(0, row.gi_id, row.ci_id)}
    assert got["caps"] == want, f"caps {got['caps']}, the slice's {want}; {where}"
    return str(row.mig_uuid)


async def test_a_pods_own_claim_is_prepared_by_the_kubelet_and_released(
    rkube: Kube, real: DevSystem, ns: str
) -> None:
    assert real.real is not None
    await wait_registered(real, 0)
    for i, profile in enumerate(("1g.10gb", "2g.20gb")):
        await rkube.create(claims_path(ns), a_claim(f"c{i}", profile))
        await rkube.create(pods_path(ns), dra_pod(f"p{i}", f"c{i}"))
    for i in range(2):
        await running(rkube, real, ns, f"p{i}")
    first = await assert_sees_only_its_own(real, rkube, ns, "p0", "c0")
    second = await assert_sees_only_its_own(real, rkube, ns, "p1", "c1")
    assert first != second
    assert len(instances(real)) == 2

    # the agent restarts, then the kubelet: running pods keep their slices, nothing is made
    # twice, and a pod created afterwards is served
    before = instances(real)
    mark = await asyncio.to_thread(agent_log_size, real)
    await asyncio.to_thread(real.kill, real.real_agent)
    await asyncio.to_thread(real.start_real_agent, die_with_parent=True)
    mark = await wait_registered(real, mark)
    await asyncio.to_thread(real.real.stop_kubelet)
    await asyncio.to_thread(real.real.start_kubelet, die_with_parent=True)
    await wait_registered(real, mark)
    await wait_node_ready(rkube)
    await rkube.create(claims_path(ns), a_claim("c2", "1g.10gb"))
    await rkube.create(pods_path(ns), dra_pod("p2", "c2"))
    # a kubelet that just restarted may be refused the claim once by the node authorizer (the
    # pod's binding not yet in its graph) and retries with its pod backoff
    await running(rkube, real, ns, "p2", timeout_s=180)
    third = await assert_sees_only_its_own(real, rkube, ns, "p2", "c2")
    assert third not in (first, second)
    assert [r for r in instances(real) if r in before] == before  # the old two untouched
    for i in range(2):
        pod = await rkube.get(pods_path(ns, f"p{i}"))
        assert pod["status"]["phase"] == "Running", pod["status"]
    assert await assert_sees_only_its_own(real, rkube, ns, "p0", "c0") == first

    # release: pods and claims deleted -> no CDI file, no instance, no claim
    for i in range(3):
        await rkube.delete(pods_path(ns, f"p{i}"), {"gracePeriodSeconds": 0})
    for i in range(3):
        await wait_gone(rkube, pods_path(ns, f"p{i}"))
        await rkube.delete(claims_path(ns, f"c{i}"))
        await wait_gone(rkube, claims_path(ns, f"c{i}"))
    deadline = time.monotonic() + 60
    while (left := (cdi_files(real), instances(real))) != ([], []):
        assert time.monotonic() < deadline, f"left over (CDI files, instances): {left}"
        await asyncio.sleep(0.5)


async def running(kube: Kube, real: DevSystem, ns: str, pod: str, timeout_s: float = 120) -> None:
    """`wait_pod_running`, with the kubelet's lines about the pod and DRA on a timeout."""
    assert real.real is not None
    try:
        await wait_pod_running(kube, ns, pod, timeout_s=timeout_s)
    except AssertionError as exc:
        log = (real.real.logs / "kubelet.log").read_text(errors="replace")
        keys = (pod, "DRA", "dynamic resources", "instaslice.io")
        lines = [x for x in log.splitlines() if any(k in x for k in keys)]
        raise AssertionError(f"{exc}\nkubelet:\n" + "\n".join(lines[-40:])) from None


async def wait_node_ready(kube: Kube, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        node = await kube.get(core_path("nodes", name=REAL))
        conds = {c["type"]: c["status"] for c in node["status"].get("conditions", [])}
        if conds.get("Ready") == "True":
            return
        assert time.monotonic() < deadline, f"{REAL} not Ready: {conds}"
        await asyncio.sleep(0.5)


REGISTERED = "registered with the kubelet"  # nodeagent/dra/plugin.py's log line


def agent_log_size(real: DevSystem) -> int:
    log = real.logs / f"{real.real_agent}.log"
    return log.stat().st_size if log.exists() else 0


async def wait_registered(real: DevSystem, since: int) -> int:
    """Until the agent's log, past byte `since`, says the kubelet registered its DRA plugin
    (NotifyRegistrationStatus); the log's size then. A log started anew is read whole."""
    log = real.logs / f"{real.real_agent}.log"
    deadline = time.monotonic() + 60
    while True:
        data = await asyncio.to_thread(log.read_bytes) if log.exists() else b""
        if REGISTERED.encode() in data[since if len(data) >= since else 0 :]:
            return len(data)
        assert time.monotonic() < deadline, "the kubelet did not register the DRA plugin again"
        await asyncio.sleep(0.5)


def cdi_files(real: DevSystem) -> list[str]:
    assert real.real is not None
    return sorted(p.name for p in real.real.cdi_dir.glob(CDI_FILE_PREFIX + "*"))


async def wait_gone(kube: Kube, path: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await kube.get(path)
        except ApiError as exc:
            if exc.not_found:
                return
            raise
        assert time.monotonic() < deadline, f"{path} still there"
        await asyncio.sleep(0.5)


async def test_an_unmodified_mig_pod_gets_its_slice_through_the_allocators_claim(
    rkube: Kube, real: DevSystem
) -> None:
    """DRA mode's allocator side on the real kubelet: a pod asking `nvidia.com/mig-*` in an
    opted-in namespace is rewritten to name a claim, the allocator allocates and reserves it
    where it placed the pod, the kubelet prepares it and the container sees exactly its MIG
    device; deleting the pod releases the claim (gone, finalizer dropped), its CDI file and
    its instance."""
    assert real.real is not None
    await wait_registered(real, 0)
    async with opted_in_namespace(rkube) as ns:
        names = {"u0": "1g.10gb", "u1": "2g.20gb"}
        for name, profile in names.items():
            await rkube.create(
                pods_path(ns), make_real_pod(name, REAL, {"main": {profile: 1}}, SHOW)
            )
        seen = []
        for name in names:
            await running(rkube, real, ns, name)
            pod = await rkube.get(pods_path(ns, name))
            claim = pod["metadata"]["annotations"][CLAIM_ANNOTATION]
            assert pod["spec"]["resourceClaims"] == [
                {"name": "instaslice", "resourceClaimName": claim}
            ]
            seen.append(await assert_sees_only_its_own(real, rkube, ns, name, claim))
        assert len(set(seen)) == 2
        for name in names:
            await rkube.delete(pods_path(ns, name), {"gracePeriodSeconds": 0})
        await wait_for(rkube, claims_path(ns), lambda objs: not objs, what="claims released")
        deadline = time.monotonic() + 60
        while (left := (cdi_files(real), instances(real))) != ([], []):
            assert time.monotonic() < deadline, f"left over (CDI files, instances): {left}"
            await asyncio.sleep(0.5)
