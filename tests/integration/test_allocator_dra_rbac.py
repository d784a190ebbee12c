"""The allocator's DRA-mode RBAC (manifests/components/dra/rbac.yaml, `instaslice-allocator-dra`,
on top of manifests/base/allocator/rbac.yaml) is enough for what it does, and each rule on
claims' status is needed, proven on the real API server (v1.37.2).

Runs a DRA-mode allocator whose only permissions are those rules, bound to a fresh user:
placing a pod (claim create, allocation + reservation in one status update, the ungate),
releasing its claim on completion (delete), finishing the claim of a deleted node (patch of
the finalizer, delete). Without `resourceclaims/binding` the same status update is refused
(granular claim-status authorization, on by default since 1.36). Leaves out the node agent's
DRA rights (test_dra_rbac.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml

from common.clock import cancel_until_done
from common.constants import AllocationMode
from common.kubeapi import ApiError, Kube, Obj, core_path
from hack.cluster import ControlPlane
from tests.integration.allocator_fixtures import AllocatorEnv, allocator_env, kube
from tests.integration.test_allocator_dra import (
    claims_path,
    create_dra_pod,
    device_classes,
    dra_node,
)
from tests.integration.test_allocator_rbac import _path
from tests.support import listed, wait_for
from webhook.allocator import build_controller, run_controller
from webhook.allocator import pods as podlib
from webhook.allocator.metrics import AllocatorMetrics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
__all__ = ["kube"]

ROOT = Path(__file__).resolve().parents[2]
FILES = (
    ROOT / "manifests/base/allocator/rbac.yaml",
    ROOT / "manifests/components/dra/rbac.yaml",
)


def rbac_for(user: str, namespace: str, suffix: str, *, binding: bool = True) -> list[Obj]:
    """The allocator's objects of both manifests, renamed per test and bound to `user`
    (`binding`: keep `resourceclaims/binding`)."""
    out = []
    for f in FILES:
        for doc in yaml.safe_load_all(f.read_text()):
            if doc["metadata"]["name"].startswith("instaslice-nodeagent"):
                continue
            obj = copy.deepcopy(doc)
            obj["metadata"]["name"] = f"{obj['metadata']['name']}-{suffix}"
            if "namespace" in obj["metadata"]:
                obj["metadata"]["namespace"] = namespace
            if "roleRef" in obj:
                obj["roleRef"]["name"] = f"{obj['roleRef']['name']}-{suffix}"
                obj["subjects"] = [
                    {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}
                ]
            for rule in obj.get("rules", []):
                if not binding:
                    rule["resources"] = [
                        r for r in rule["resources"] if r != "resourceclaims/binding"
                    ]
            out.append(obj)
    return out


@contextlib.asynccontextmanager
async def restricted_allocator(
    env: AllocatorEnv, control_plane: ControlPlane, *, binding: bool = True
) -> AsyncIterator[AllocatorMetrics]:
    suffix = f"{env.namespace}-{'b' if binding else 'nb'}"
    user = f"allocator-dra-{suffix}"
    objects = rbac_for(user, env.namespace, suffix, binding=binding)
    for obj in objects:
        await env.kube.create(_path(obj), obj)
    kubeconfig = await asyncio.to_thread(control_plane.user_kubeconfig, user)
    restricted = await Kube.connect(str(kubeconfig))
    settings = env.settings("restricted", allocation_mode=AllocationMode.DRA)
    metrics = AllocatorMetrics()
    task = asyncio.create_task(
        run_controller(build_controller(restricted, settings, metrics), settings)
    )
    try:
        yield metrics
    finally:
        await cancel_until_done([task])
        await restricted.close()
        for obj in objects:
            with contextlib.suppress(ApiError):
                await env.kube.delete(_path(obj) + f"/{obj['metadata']['name']}")


@pytest.fixture
async def env(kube: Kube, namespace: str) -> AsyncIterator[AllocatorEnv]:
    await device_classes(kube)
    async with allocator_env(kube, namespace) as world:
        yield world
    for c in (await kube.list(claims_path(namespace))).get("items", []):
        with contextlib.suppress(ApiError):
            await kube.patch(
                claims_path(namespace, c["metadata"]["name"]), {"metadata": {"finalizers": None}}
            )


async def test_allocator_works_with_exactly_its_dra_rbac(
    env: AllocatorEnv, control_plane: ControlPlane
) -> None:
    node = await dra_node(env, "n1")
    async with restricted_allocator(env, control_plane) as metrics:
        await create_dra_pod(env, "p", {"main": {"1g.10gb": 1}})
        assert podlib.bound_node(await env.wait_bound("p")) == node
        # release on completion: the claim deleted (held by the agent's finalizer here)
        await env.kube.patch(
            core_path("pods", env.namespace, "p") + "/status", {"status": {"phase": "Succeeded"}}
        )
        await wait_for(
            env.kube, claims_path(env.namespace),
            listed(lambda items: all(c["metadata"].get("deletionTimestamp") for c in items)),
            what="the claim released",
        )  # fmt: skip
        # a deleted node's claim is finished by the allocator (finalizer patched off, gone)
        await create_dra_pod(env, "q", {"main": {"1g.10gb": 1}})
        await env.wait_bound("q")
        await env.kube.delete(core_path("nodes", name=node))
        await wait_for(
            env.kube,
            claims_path(env.namespace),
            listed(lambda items: not items),
            what="the claims of the deleted node finished and gone",
        )
        assert metrics.count("error") == 0


async def test_without_binding_the_allocation_is_refused(
    env: AllocatorEnv, control_plane: ControlPlane
) -> None:
    await dra_node(env, "n1")
    async with restricted_allocator(env, control_plane, binding=False):
        await create_dra_pod(env, "p", {"main": {"1g.10gb": 1}})
        await env.wait_event("p", "AllocationPending", saying="refused")
        items = (await env.kube.list(claims_path(env.namespace))).get("items", [])
        assert not [c for c in items if (c.get("status") or {}).get("allocation")]
        assert podlib.has_our_gate(await env.pod("p"))
