"""The local control plane itself (hack/cluster): real etcd, kube-apiserver, kube-scheduler,
kube-controller-manager and KWOK on loopback.

Covers: the apiserver reports the pinned version; KWOK GPU nodes from a cluster spec (the
repo's dev spec plus a tainted group) come up Ready with their labels, taints and capacity;
kube-scheduler binds a pod that fits and KWOK runs it; a pod no node fits stays Pending with
the scheduler's Unschedulable reason; deleting a namespace removes it and its pods (KCM's
namespace controller plus KWOK's pod-delete stage); RBAC is enforced for a user without
roles, and a RoleBinding grants exactly what it names; a user kubeconfig made for a
ServiceAccount identity is recognised as one; a component that exits is launched again
(`restart_exited`, the kubelet's part).
Leaves out: InstaSlice components, node failure (chaos tests), scale (docs/control-plane.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import secrets
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.exceptions import ApiException

from common.constants import GPU_COUNT_LABEL, GPU_MODEL_LABEL
from common.kubeapi import harden
from hack.cluster import ControlPlane
from hack.cluster.bins import REPO_ROOT
from hack.cluster.nodes import (
    MIG_MODE_LABEL,
    ClusterSpec,
    NodeGroup,
    Taint,
    create_nodes,
    load_spec,
    wait_nodes_ready,
)

pytestmark = pytest.mark.timeout(60)

_RBAC = "rbac.authorization.k8s.io"
Pod = Any  # kubernetes_asyncio V1Pod (the generated client is untyped enough)


@pytest.fixture(scope="module")
async def gpu_nodes(kube_api: client.ApiClient) -> AsyncIterator[ClusterSpec]:
    """The repo's dev spec (prefixes made unique) plus one tainted group, all Ready."""
    tag = secrets.token_hex(2)
    dev = load_spec(REPO_ROOT / "hack" / "specs" / "dev.yaml")
    groups = [dataclasses.replace(g, prefix=f"it{tag}-{g.prefix}") for g in dev.groups]
    groups.append(
        NodeGroup(
            prefix=f"it{tag}-tainted",
            count=1,
            gpus=4,
            model="A30-24GB",
            mig_mode="disabled",
            cpu="8",
            memory="64Gi",
            pods=10,
            taints=(Taint(key="instaslice.io/test", value="x", effect="NoSchedule"),),
        )
    )
    spec = ClusterSpec(tuple(groups))
    names = await create_nodes(kube_api, spec)
    await wait_nodes_ready(kube_api, names, timeout_s=30)
    yield spec
    core = client.CoreV1Api(kube_api)
    for name in names:
        await core.delete_node(name)


def _pod(name: str, cpu: str, memory: str = "1Gi") -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1PodSpec(
            termination_grace_period_seconds=0,
            containers=[
                client.V1Container(
                    name="main",
                    image="registry.example/none:1",
                    resources=client.V1ResourceRequirements(
                        requests={"cpu": cpu, "memory": memory}
                    ),
                )
            ],
        ),
    )


async def _wait_pod(
    core: client.CoreV1Api, namespace: str, name: str, done: Callable[[Pod], bool]
) -> Pod:
    """Watch one pod until `done(pod)`; returns that pod (the test timeout bounds it)."""
    pods = await core.list_namespaced_pod(namespace, field_selector=f"metadata.name={name}")
    for p in pods.items:
        if done(p):
            return p
    rv = pods.metadata.resource_version
    while True:
        async with watch.Watch() as w:
            async for ev in w.stream(
                core.list_namespaced_pod,
                namespace,
                field_selector=f"metadata.name={name}",
                resource_version=rv,
                timeout_seconds=50,
            ):
                pod = ev["object"]
                rv = pod.metadata.resource_version
                if done(pod):
                    return pod


def _condition(pod: Pod, type_: str) -> Any:
    return next((c for c in pod.status.conditions or [] if c.type == type_), None)


async def test_apiserver_reports_pinned_version(kube_api: client.ApiClient) -> None:
    info = await client.VersionApi(kube_api).get_code()
    go_mod = (REPO_ROOT / "hack" / "kube" / "go.mod").read_text()
    assert f"k8s.io/kubernetes {info.git_version}" in go_mod


async def test_kwok_gpu_nodes_from_spec(kube_api: client.ApiClient, gpu_nodes: ClusterSpec) -> None:
    core = client.CoreV1Api(kube_api)
    for group in gpu_nodes.groups:
        for name in group.names():
            node = await core.read_node(name)
            labels = node.metadata.labels
            assert labels[GPU_MODEL_LABEL] == group.model
            assert labels[GPU_COUNT_LABEL] == str(group.gpus)
            assert labels[MIG_MODE_LABEL] == group.mig_mode
            assert labels["type"] == "kwok"
            assert node.metadata.annotations["kwok.x-k8s.io/node"] == "fake"
            assert node.status.allocatable["cpu"] == group.cpu
            assert node.status.capacity["memory"] == group.memory
            assert node.status.allocatable["pods"] == str(group.pods)
            ours = [(t.key, t.value, t.effect) for t in node.spec.taints or []]
            assert ours == [(t.key, t.value, t.effect) for t in group.taints]


async def test_pod_is_scheduled_and_runs(
    kube_api: client.ApiClient, gpu_nodes: ClusterSpec, namespace: str
) -> None:
    core = client.CoreV1Api(kube_api)
    await core.create_namespaced_pod(namespace, _pod("fits", cpu="2", memory="4Gi"))
    pod = await _wait_pod(core, namespace, "fits", lambda p: p.status.phase == "Running")
    node = await core.read_node(pod.spec.node_name)
    assert node.metadata.annotations.get("kwok.x-k8s.io/node") == "fake"
    assert not node.spec.taints  # the tainted group is not tolerated
    assert pod.status.pod_ip
    assert _condition(pod, "Ready").status == "True"


async def test_a_component_that_exits_is_launched_again(
    control_plane: ControlPlane, kube_api: client.ApiClient, gpu_nodes: ClusterSpec, namespace: str
) -> None:
    """kube-scheduler exits by design on a corrupted cache (the chaos soak's same-name-gap
    fault triggers it); `restart_exited` does what the kubelet does for a static pod, and
    the restarted scheduler binds pods again."""
    sched = next(p for p in control_plane.processes if p.name == "kube-scheduler")
    os.kill(sched.pid, signal.SIGKILL)
    for _ in range(100):
        if not sched.alive():
            break
        await asyncio.sleep(0.05)
    assert control_plane.restart_exited() == ["kube-scheduler"]
    again = next(p for p in control_plane.processes if p.name == "kube-scheduler")
    assert again.pid != sched.pid and again.alive()
    assert control_plane.restart_exited() == []
    core = client.CoreV1Api(kube_api)
    await core.create_namespaced_pod(namespace, _pod("after-restart", cpu="1", memory="1Gi"))
    pod = await _wait_pod(core, namespace, "after-restart", lambda p: p.status.phase == "Running")
    assert pod.spec.node_name


async def test_pod_too_big_stays_pending_with_reason(
    kube_api: client.ApiClient, gpu_nodes: ClusterSpec, namespace: str
) -> None:
    core = client.CoreV1Api(kube_api)
    await core.create_namespaced_pod(namespace, _pod("huge", cpu="100000"))
    pod = await _wait_pod(core, namespace, "huge", lambda p: _condition(p, "PodScheduled"))
    cond = _condition(pod, "PodScheduled")
    assert (cond.status, cond.reason) == ("False", "Unschedulable")
    assert "Insufficient cpu" in cond.message
    assert pod.status.phase == "Pending"
    assert not pod.spec.node_name


async def test_namespace_deletion_removes_everything(
    kube_api: client.ApiClient, gpu_nodes: ClusterSpec, namespace: str
) -> None:
    core = client.CoreV1Api(kube_api)
    await core.create_namespaced_config_map(
        namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="c"), data={"a": "b"})
    )
    await core.create_namespaced_pod(namespace, _pod("p", cpu="100m"))
    await _wait_pod(core, namespace, "p", lambda p: p.status.phase == "Running")
    rv = (await core.list_namespace()).metadata.resource_version
    await core.delete_namespace(namespace)
    async with watch.Watch() as w:
        async for ev in w.stream(
            core.list_namespace,
            field_selector=f"metadata.name={namespace}",
            resource_version=rv,
            timeout_seconds=50,
        ):
            if ev["type"] == "DELETED":
                break
    with pytest.raises(ApiException) as err:
        await core.read_namespace(namespace)
    assert err.value.status == 404


async def _client_for(kubeconfig: Path) -> client.ApiClient:
    return harden(await config.new_client_from_config(config_file=str(kubeconfig)))


async def test_rbac_is_enforced(
    control_plane: ControlPlane, kube_api: client.ApiClient, namespace: str
) -> None:
    user = f"nobody-{secrets.token_hex(3)}"
    async with await _client_for(control_plane.user_kubeconfig(user, ["it-testers"])) as api:
        with pytest.raises(ApiException) as err:
            await client.CoreV1Api(api).list_namespaced_pod(namespace)
        assert err.value.status == 403
        message = json.loads(err.value.body or "{}").get("message", "")
        assert f'User "{user}" cannot list resource "pods"' in message

        await client.RbacAuthorizationV1Api(kube_api).create_namespaced_role_binding(
            namespace,
            client.V1RoleBinding(
                metadata=client.V1ObjectMeta(name="nobody-view"),
                role_ref=client.V1RoleRef(api_group=_RBAC, kind="ClusterRole", name="view"),
                subjects=[client.RbacV1Subject(api_group=_RBAC, kind="User", name=user)],
            ),
        )
        # The authorizer learns of the binding through its own watch: a moment later (CI
        # once got the 403 still). Allowed within 10 s, or the binding did not take.
        deadline = asyncio.get_running_loop().time() + 10
        while True:
            try:
                pods = await client.CoreV1Api(api).list_namespaced_pod(namespace)
                break
            except ApiException as exc:
                if exc.status != 403 or asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.1)
        assert pods.items == []
        with pytest.raises(ApiException) as err:
            await client.CoreV1Api(api).list_pod_for_all_namespaces()
        assert err.value.status == 403


async def test_service_account_identity(
    control_plane: ControlPlane, kube_api: client.ApiClient, namespace: str
) -> None:
    kubeconfig = control_plane.service_account_kubeconfig(namespace, "agent")
    async with await _client_for(kubeconfig) as api:
        review = await client.AuthenticationV1Api(api).create_self_subject_review(
            client.V1SelfSubjectReview()
        )
    info = review.status.user_info
    assert info.username == f"system:serviceaccount:{namespace}:agent"
    assert f"system:serviceaccounts:{namespace}" in info.groups


def test_kubectl_keeps_its_own_discovery_cache(
    control_plane: ControlPlane, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ControlPlane.kubectl` reads only this cluster's discovery cache. kubectl keys the cache
    by host:port alone (6 h TTL); here the shared one (KUBECACHEDIR) holds what an earlier
    cluster on the same loopback port served, a kind this cluster lacks. Read, it would map
    the kind and `delete --ignore-not-found` would swallow the server's 404 (rc 0, nothing
    said) instead of "no matches for kind"."""
    shared = tmp_path / "shared-cache"
    host = control_plane.server.removeprefix("https://").replace(":", "_")
    gv = {"groupVersion": "flakes.example.com/v1", "version": "v1"}
    files = {
        "servergroups.json": {
            "kind": "APIGroupList", "apiVersion": "v1",
            "groups": [{"name": "flakes.example.com", "versions": [gv], "preferredVersion": gv}],
        },
        "flakes.example.com/v1/serverresources.json": {
            "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv["groupVersion"],
            "resources": [{"name": "widgets", "singularName": "widget", "namespaced": True,
                           "kind": "Widget", "verbs": ["get", "list", "delete"]}],
        },
    }  # fmt: skip
    for rel, doc in files.items():
        path = shared / "discovery" / host / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc))
    monkeypatch.setenv("KUBECACHEDIR", str(shared))
    widget = {"apiVersion": "flakes.example.com/v1", "kind": "Widget",
              "metadata": {"name": "w", "namespace": "default"}}  # fmt: skip
    proc = control_plane.kubectl(
        "delete", "-f", "-", "--ignore-not-found", check=False, stdin=json.dumps(widget)
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert 'no matches for kind "Widget"' in proc.stderr
    assert not (shared / "discovery" / host / "v1").exists()  # the shared cache untouched
