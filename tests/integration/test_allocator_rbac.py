"""The allocator's RBAC (manifests/base/allocator/rbac.yaml) is enough for what it does.

Runs an allocator whose only permissions are those rules, bound to a fresh user instead of
the ServiceAccount (names suffixed per test so nothing cluster-wide collides): leader
election in its namespace, placing and pinning a pod, a pending event, release on
completion, finalizing the record of a deleted node. Leaves out the ValidatingAdmissionPolicy
(test_manifests.py and the policy's own tests).
"""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from common.clock import cancel_until_done
from common.constants import REASON_PENDING
from common.kubeapi import ApiError, Kube, Obj, core_path, group_path
from hack.cluster import ControlPlane
from tests.integration.allocator_fixtures import (
    AllocatorEnv,
    FakeAgent,
    kube,
)
from webhook.allocator import build_controller, run_controller
from webhook.allocator import pods as podlib
from webhook.allocator.metrics import AllocatorMetrics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]
__all__ = ["kube"]  # a fixture, imported for pytest

ROOT = Path(__file__).resolve().parents[2]
RBAC = ROOT / "manifests" / "base" / "allocator" / "rbac.yaml"
RBAC_API = "rbac.authorization.k8s.io/v1"


def rbac_for(user: str, namespace: str, suffix: str) -> list[Obj]:
    """The manifest's objects, renamed per test and bound to `user` in `namespace`."""
    out = []
    for doc in yaml.safe_load_all(RBAC.read_text()):
        obj = copy.deepcopy(doc)
        obj["metadata"]["name"] = f"{obj['metadata']['name']}-{suffix}"
        if "namespace" in obj["metadata"]:
            obj["metadata"]["namespace"] = namespace
        if "roleRef" in obj:
            obj["roleRef"]["name"] = f"{obj['roleRef']['name']}-{suffix}"
            obj["subjects"] = [
                {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}
            ]
        out.append(obj)
    return out


def _path(obj: Obj) -> str:
    plural = obj["kind"].lower() + "s"
    return group_path(RBAC_API, plural, obj["metadata"].get("namespace"))


async def test_allocator_works_with_exactly_its_rbac(
    kube: Kube, namespace: str, control_plane: ControlPlane
) -> None:
    user = f"allocator-{namespace}"
    objects = rbac_for(user, namespace, namespace)
    assert [o["kind"] for o in objects] == [
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
    ]
    for obj in objects:
        await kube.create(_path(obj), obj)
    kubeconfig = await asyncio.to_thread(control_plane.user_kubeconfig, user)
    restricted = await Kube.connect(str(kubeconfig))
    agent = FakeAgent(kube)
    agent_task = asyncio.create_task(agent.run())
    env = AllocatorEnv(kube, namespace, agent)
    await env.opt_in()
    allocator: asyncio.Task[None] | None = None
    try:
        await agent.informer.synced.wait()
        node = await env.add_node("n1")
        settings = env.settings("restricted")
        controller = build_controller(restricted, settings, AllocatorMetrics())
        allocator = asyncio.create_task(run_controller(controller, settings))
        # place, pin (pods update), event (events create), lease (create/get/update)
        await env.create_pod("p")
        assert podlib.bound_node(await env.wait_bound("p")) == node
        # pending event
        await env.create_pod("too-big", slices={"main": {"7g.80gb": 1}})
        await env.wait_event("too-big", REASON_PENDING)
        # release on completion (sliceallocations delete)
        await kube.patch(
            core_path("pods", namespace, "p") + "/status", {"status": {"phase": "Succeeded"}}
        )
        await env.delete_pod("too-big")
        await env.wait_allocations(lambda items: not items, what="released")
        # a deleted node's record is finalized (nodes get, sliceallocations patch + delete)
        env.agent.ignore_nodes.add(node)
        await env.create_pod("q")
        await env.wait_allocations(lambda items: len(items) == 1, what="allocated")
        await kube.delete(core_path("nodes", name=node))
        await env.wait_allocations(lambda items: not items, what="finalized")
        assert controller.metrics.count("error") == 0
    finally:
        if allocator is not None:
            await cancel_until_done([allocator])
        await restricted.close()
        await env.close()
        await cancel_until_done([agent_task])
        for obj in objects:
            name = obj["metadata"]["name"]
            path = _path(obj) + f"/{name}"
            try:
                await kube.delete(path)
            except ApiError as exc:
                if not exc.not_found:
                    raise


def test_rbac_manifest_grants_no_more_than_documented() -> None:
    rules: dict[str, Any] = {}
    for doc in yaml.safe_load_all(RBAC.read_text()):
        for rule in doc.get("rules", []):
            for resource in rule["resources"]:
                rules.setdefault(resource, set()).update(rule["verbs"])
    assert rules == {
        # create: autoscaler placeholders (docs/autoscaling.md)
        "pods": {"get", "list", "watch", "update", "delete", "create"},
        "pods/eviction": {"create"},  # preemption (the Eviction API keeps PDBs)
        "poddisruptionbudgets": {"list", "watch"},  # which victims a PDB guards
        "nodes": {"get", "list", "watch"},
        "namespaces": {"get", "list", "watch"},  # only opted-in namespaces are served
        # patch: a repeat counted on its event; list/watch: Karpenter's answers
        "events": {"create", "patch", "list", "watch"},
        "podtemplates": {"create", "delete"},  # --autoscaler-signal=provisioning-request
        "provisioningrequests": {"get", "list", "watch", "create", "delete"},
        # delete: a gone node's (--node-gone-grace); patch: desiredMigMode (Ampere maintenance)
        "mignodes": {"get", "list", "watch", "patch", "delete"},
        # no update: the spec is immutable, status is the agent's, the finalizer goes by patch
        "sliceallocations": {"get", "list", "watch", "create", "patch", "delete"},
        "leases": {"create", "get", "update", "list", "watch", "delete"},
    }
