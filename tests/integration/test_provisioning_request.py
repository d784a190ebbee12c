"""`--autoscaler-signal=provisioning-request` against the real local control plane.

cluster-autoscaler cannot run here (its Go modules are not served), so the test plays it: it
reads the ProvisioningRequests the allocator writes, sets their conditions through the status
subresource as CA would, and "provisions" by adding a node (with its MigNode, as a node agent
would). The ProvisioningRequest CRD is tests/data/crds/provisioningrequests.yaml.

Covers: one ProvisioningRequest + PodTemplate per pod no node can serve, in the pod's
namespace, owned by it, kept off the nodes that cannot serve it; the `ScaleUpRequested`,
`ScaleUpFailed` (Failed condition) and `ScaleUpProvisioned` events; both objects deleted when
the pod is placed on the new node, and when the pod is deleted while pending; no signal for a
pod that fits; no signal for a pod a preemption serves, one for a pod it cannot (the
preemption/autoscaling interaction, docs/autoscaling.md). Leaves out: Karpenter
(tests/e2e/test_autoscaling.py), the classification table (tests/unit/test_autoscale.py).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from common.constants import REASON_PREEMPTING
from common.kubeapi import ApiError, Kube, core_path, group_path
from common.placeholders import signal_name
from hack.cluster import ControlPlane
from tests.integration.allocator_fixtures import (
    AllocatorEnv,
    GpuSpec,
    allocator_env,
    ensure_crds,
    load_crds,
)
from tests.integration.test_allocator_preemption import (
    HIGH,
    LOW,
    create,
    priority_classes,  # noqa: F401  (fixture)
    release_holds,
)
from tests.support import listed, passes, wait_for
from webhook.allocator import pods as podlib
from webhook.allocator.autoscale import (
    DEFAULT_PROVREQ_CLASS,
    REASON_FAILED,
    REASON_PROVISIONED,
    REASON_REQUESTED,
    ScaleUpSettings,
    SignalMode,
)
from webhook.allocator.controller import Controller

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
PROVREQS = "provisioningrequests"
API = "autoscaling.x-k8s.io/v1"
FULL = GpuSpec(slices=[{"profile": "7g.80gb", "start": 0, "size": 8, "migUUID": "MIG-f"}])


@pytest.fixture(scope="session")
async def kube(control_plane: ControlPlane) -> AsyncIterator[Kube]:
    k = await Kube.connect(str(control_plane.kubeconfig))
    async with k:
        crds = load_crds(REPO / "manifests" / "base" / "crds")
        await ensure_crds(k, crds + load_crds(REPO / "tests" / "data" / "crds"))
        # a CRD just made answers 429 "storage is (re)initializing" for a moment
        async with asyncio.timeout(30):
            while True:
                try:
                    await k.list(group_path(API, PROVREQS))
                    break
                except ApiError as exc:
                    if exc.status != 429:
                        raise
                    await asyncio.sleep(0.2)
        yield k


@pytest.fixture
async def env(kube: Kube, namespace: str) -> AsyncIterator[AllocatorEnv]:
    async with allocator_env(kube, namespace) as world:
        yield world


def start(env: AllocatorEnv) -> Controller:
    return env.start(
        scale_up=ScaleUpSettings(mode=SignalMode.PROVISIONING_REQUEST, delay_s=0.5, interval_s=0.2)
    )


async def rounds_past_the_delay(alloc: Controller) -> None:
    """Three scale-up reconcile rounds that began past the signal's delay (0.5 s, read off
    the real clock): a signal due by then would have been raised."""
    await passes(
        lambda: alloc.scale_up.rounds,
        more=3,
        not_before=time.monotonic() + 0.5,
        what="scale-up rounds past the delay",
    )


async def provreqs(env: AllocatorEnv) -> list[dict[str, Any]]:
    listing = await env.kube.list(group_path(API, PROVREQS, env.namespace))
    return list(listing.get("items", []))


async def wait_provreqs(env: AllocatorEnv, count: int, what: str) -> list[dict[str, Any]]:
    return await wait_for(
        env.kube,
        group_path(API, PROVREQS, env.namespace),
        listed(lambda items: items if len(items) == count else None),
        within=30,
        what=what,
    )


async def templates(env: AllocatorEnv) -> list[str]:
    listing = await env.kube.list(core_path("podtemplates", env.namespace))
    return [t["metadata"]["name"] for t in listing.get("items", [])]


async def set_condition(env: AllocatorEnv, name: str, type_: str, reason: str, msg: str) -> None:
    """What cluster-autoscaler writes (its status subresource)."""
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    cond = {"type": type_, "status": "True", "reason": reason, "message": msg,
            "lastTransitionTime": now}  # fmt: skip
    path = group_path(API, PROVREQS, env.namespace, name) + "/status"
    await env.kube.patch(path, {"status": {"conditions": [cond]}})


async def test_provisioning_request_lifecycle(env: AllocatorEnv) -> None:
    full = await env.add_node("full", gpus=[FULL])
    start(env)
    pod = await env.create_pod("p", slices={"main": {"3g.40gb": 1}}, cpu="1", memory="1Gi")
    uid = pod["metadata"]["uid"]

    (provreq,) = await wait_provreqs(env, 1, "a ProvisioningRequest for the pending pod")
    name = signal_name(uid)
    assert provreq["metadata"]["name"] == name
    assert provreq["metadata"]["ownerReferences"][0]["uid"] == uid
    assert provreq["spec"]["provisioningClassName"] == DEFAULT_PROVREQ_CLASS
    assert provreq["spec"]["podSets"] == [{"podTemplateRef": {"name": name}, "count": 1}]
    template = await env.kube.get(core_path("podtemplates", env.namespace, name))
    spec = template["template"]["spec"]
    requests = spec["containers"][0]["resources"]["requests"]
    assert requests == {"instaslice.io/mig-3g.40gb": "1", "cpu": "1", "memory": str(1 << 30)}
    (term,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert term["matchExpressions"] == [
        {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": [full]}
    ]
    requested = await env.wait_event("p", REASON_REQUESTED)
    assert requested["type"] == "Normal"
    assert "no existing node can serve it now (Full)" in requested["message"]

    await set_condition(env, name, "Failed", "NoScaleUp", "no node group fits")
    failed = await env.wait_event("p", REASON_FAILED)
    assert failed["type"] == "Warning" and "no node group fits" in failed["message"]
    await set_condition(env, name, "Provisioned", "Provisioned", "capacity is ready")
    provisioned = await env.wait_event("p", REASON_PROVISIONED)
    assert "capacity is ready" in provisioned["message"]

    new = await env.add_node("new")  # what cluster-autoscaler's scale-up brings
    ungated = await env.wait_ungated("p")
    assert podlib.pinned_node(ungated) == new
    await wait_provreqs(env, 0, "the ProvisioningRequest deleted once the pod is placed")
    assert name not in await templates(env)
    assert len(await env.events("p", REASON_REQUESTED)) == 1


async def test_signal_withdrawn_when_the_pending_pod_is_deleted(env: AllocatorEnv) -> None:
    await env.add_node("full", gpus=[FULL])
    start(env)
    await env.create_pod("p", slices={"main": {"3g.40gb": 1}})
    await wait_provreqs(env, 1, "a ProvisioningRequest for the pending pod")
    await env.delete_pod("p")
    await wait_provreqs(env, 0, "the ProvisioningRequest gone with its pod")
    await wait_for(
        env.kube,
        core_path("podtemplates", env.namespace),
        listed(lambda items: True if not items else None),
        within=30,
        what="the PodTemplate gone with its pod",
    )


async def test_no_signal_for_a_pod_that_fits(env: AllocatorEnv) -> None:
    await env.add_node("n1")
    alloc = start(env)
    await env.create_pod("p", slices={"main": {"3g.40gb": 1}})
    await env.wait_ungated("p")
    await rounds_past_the_delay(alloc)
    assert await provreqs(env) == []
    assert await env.events("p", REASON_REQUESTED) == []


@pytest.mark.usefixtures("priority_classes")
async def test_no_signal_for_a_pod_a_preemption_serves(env: AllocatorEnv) -> None:
    await env.add_node("n1")  # one H100: one 7g
    alloc = env.start(
        scale_up=ScaleUpSettings(mode=SignalMode.PROVISIONING_REQUEST, delay_s=0.5, interval_s=0.2),
        preemption=True,
    )
    try:
        await create(env, "low", LOW, "7g.80gb", hold=True)  # held: stays terminating
        await env.wait_bound("low")
        await create(env, "high", HIGH, "7g.80gb")
        await env.wait_event("high", REASON_PREEMPTING)
        await rounds_past_the_delay(alloc)  # "low" still going
        assert await provreqs(env) == []
        assert await env.events("high", REASON_REQUESTED) == []
        # the same ask at the lowest priority: nobody to evict, so it asks for a node
        other = await create(env, "other", LOW, "7g.80gb")
        (provreq,) = await wait_provreqs(env, 1, "a ProvisioningRequest for the pod")
        assert provreq["metadata"]["ownerReferences"][0]["uid"] == other["metadata"]["uid"]
        await release_holds(env)
        await env.wait_bound("high")
    finally:
        await release_holds(env)
