"""The warning-only ValidatingAdmissionPolicy manifests/base/policy/unserved-asks.yaml, on the
real API server (docs/troubleshooting.md, "Pod Pending on Insufficient nvidia.com/...").

Covers: a client creating a MIG pod (`nvidia.com/mig-*`, or a size annotation) in a namespace
that has not opted in, or `nvidia.com/gpu` in one opted in to MIG slices but not to whole
GPUs, gets a `Warning` response header naming the annotation to add, and the pod is created
all the same; the same pods where they will be served, and pods without such asks, get no
warning from it. The policy's expressions type-check without warnings.
Leaves out: the webhook (no webhook is registered here, so opted-in namespaces' pods are not
rewritten), system namespaces (the namespaceSelector, as in the deny policy's tests).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from common.constants import ENABLED_KEY, NVIDIA_GPU, WHOLE_GPU_KEY
from common.kubeapi import Kube, Obj, core_path, group_path
from testkit.builders import container, user_pod
from tests.integration.webhook_fixtures import ADMISSIONREG, MIG, kube, load_manifest
from tests.support import eventually

__all__ = ["kube"]  # fixture, imported for pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

POLICY = "instaslice-unserved-asks"
NOT_SERVED = "InstaSlice will not serve this pod"


async def _create(kube: Kube, namespace: str, pod: Obj, *, dry_run: bool = False) -> list[str]:
    """Create `pod` and return the API server's `Warning` headers (RFC 7234 warn-text)."""
    query = {"dryRun": "All"} if dry_run else None
    resp = await kube._call("POST", core_path("pods", namespace), query=query, body=pod)
    try:
        assert resp.status == 201 or (dry_run and resp.status == 200), await resp.text()
        return [w for w in resp.headers.getall("Warning", []) if POLICY in w]
    finally:
        resp.release()


@pytest.fixture(scope="module")
async def policy(kube: Kube) -> AsyncIterator[None]:
    """The shipped policy and binding, installed, type-checked and observed warning."""
    created: list[str] = []
    for doc in load_manifest("policy/unserved-asks.yaml"):
        kind = doc["kind"].lower()
        path = group_path(ADMISSIONREG, kind[:-1] + "ies" if kind.endswith("y") else kind + "s")
        await kube.create(path, doc)
        created.append(f"{path}/{doc['metadata']['name']}")
    try:
        vap_path = group_path(ADMISSIONREG, "validatingadmissionpolicies", name=POLICY)

        async def checked() -> bool:
            return "typeChecking" in (await kube.get(vap_path)).get("status", {})

        await eventually(checked, within=30)
        status = (await kube.get(vap_path))["status"]
        assert not status["typeChecking"].get("expressionWarnings"), status
        probe = user_pod(container("main", limits={MIG: "1"}))

        async def warning() -> bool:
            return bool(await _create(kube, "default", probe, dry_run=True))

        await eventually(warning, within=30)
        yield
    finally:
        for path in reversed(created):
            await kube.delete_ignore_missing(path)


async def _label(kube: Kube, namespace: str, labels: dict[str, str]) -> None:
    """Label `namespace` as the namespace mirror would, and wait until the policy sees it."""
    await kube.patch(core_path("namespaces", name=namespace), {"metadata": {"labels": labels}})
    probe = user_pod(container("main", limits={MIG: "1"}))

    async def seen() -> bool:
        return not await _create(kube, namespace, probe, dry_run=True)

    await eventually(seen, within=30)


async def test_a_mig_ask_where_instaslice_is_not_enabled_is_warned_about_and_created(
    kube: Kube, policy: None, namespace: str
) -> None:
    for i, pod in enumerate([
        user_pod(container("main", limits={MIG: "1"})),
        user_pod(container("main"), init=[container("prep", limits={MIG: "1"})]),
        user_pod(container("main"), annotations={"instaslice.io/mig-size.main": "20Gi"}),
    ]):  # fmt: skip
        pod["metadata"]["name"] = f"mig-{i}"
        warnings = await _create(kube, namespace, pod)
        assert len(warnings) == 1, warnings
        assert NOT_SERVED in warnings[0] and "MIG slice ask" in warnings[0], warnings
        assert f"{namespace} opts in" in warnings[0] and ENABLED_KEY in warnings[0], warnings
        await kube.get(core_path("pods", namespace, name=pod["metadata"]["name"]))  # created
    plain = user_pod(container("main"))
    assert await _create(kube, namespace, plain, dry_run=True) == []
    # a whole GPU outside InstaSlice's namespaces is NVIDIA's device plugin's business
    gpu = user_pod(container("main", limits={NVIDIA_GPU: "1"}))
    assert await _create(kube, namespace, gpu, dry_run=True) == []


async def test_a_whole_gpu_ask_without_the_whole_gpu_opt_in_is_warned_about_and_created(
    kube: Kube, policy: None, namespace: str
) -> None:
    await _label(kube, namespace, {ENABLED_KEY: "true"})
    gpu = user_pod(container("main", limits={NVIDIA_GPU: "1"}))
    gpu["metadata"]["name"] = "gpu"
    warnings = await _create(kube, namespace, gpu)
    assert len(warnings) == 1 and "whole-GPU ask" in warnings[0], warnings
    assert f"{namespace} opts in to whole GPUs" in warnings[0] and WHOLE_GPU_KEY in warnings[0]
    await kube.get(core_path("pods", namespace, name="gpu"))  # created all the same
    await kube.patch(
        core_path("namespaces", name=namespace), {"metadata": {"labels": {WHOLE_GPU_KEY: "true"}}}
    )

    async def served() -> bool:
        probe = user_pod(container("main", limits={NVIDIA_GPU: "1"}))
        return not await _create(kube, namespace, probe, dry_run=True)

    await eventually(served, within=30)
