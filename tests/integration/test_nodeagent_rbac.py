"""Least privilege of the node agent, on the real apiserver with the shipped manifests
(manifests/base/nodeagent: ClusterRole + per-node ValidatingAdmissionPolicies).

Covers: an agent authenticated as `system:instaslice:node:<A>` (group instaslice:nodeagents)
runs its whole job on node A — MigNode, Node capacity, Lease, allocation status, finalizer
removal, events — with exactly those grants; the same identity is refused every write to
node B's objects (MigNode, SliceAllocation status and finalizers, Node status, Lease) and
the writes outside its job on its own objects (other Node capacity, adding finalizers,
relabelling, deleting). The production identity — the ServiceAccount's token bound to a pod
scheduled on node A, which carries `authentication.kubernetes.io/node-name` — gets the same
verdicts; a token of that ServiceAccount not bound to a pod may write nothing.
Leaves out: the kubelet's own token projection (no kubelet here; the test asks the
TokenRequest API for the same kind of bound token).
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from common.constants import RELEASE_FINALIZER
from common.kubeapi import ApiError, Kube, core_path, group_path, instaslice_path
from common.objects import mig_node
from hack.cluster import ControlPlane
from tests.integration.agent_fixtures import (
    NAMESPACE,
    agent_pod_token,
    agent_settings,
    create_allocation,
    eventually,
    gpu_node,
    install_instaslice,
    running_agent,
    slice_allocation,
    wait_gone,
    wait_phase,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]
Obj = dict[str, Any]
H200 = "H200-141GB"
LEASES = "coordination.k8s.io/v1"


@pytest.fixture(scope="module")
async def admin(control_plane: ControlPlane) -> AsyncIterator[Kube]:
    async with await Kube.connect(str(control_plane.kubeconfig)) as k:
        await install_instaslice(k)
        yield k


def _alloc_path(a: Obj) -> str:
    return instaslice_path("sliceallocations", a["metadata"]["namespace"], a["metadata"]["name"])


async def _status(call: Any) -> int:
    """The HTTP status of an API call: 200 when it succeeds."""
    try:
        await call
    except ApiError as exc:
        return exc.status
    return 200


async def _verdicts(
    me: Kube, mine: str, other: str, ns: str, a_mine: Obj, a_other: Obj
) -> dict[str, int]:
    cap = {"status": {"capacity": {"instaslice.io/mig-1g.18gb": "7"}}}
    lease_body = {
        "apiVersion": LEASES,
        "kind": "Lease",
        "metadata": {"name": other, "namespace": NAMESPACE},
        "spec": {"holderIdentity": "x"},
    }
    return {
        # the other node's objects
        "mignode-other-create": await _status(
            me.create(instaslice_path("mignodes"), mig_node(other))
        ),
        "mignode-other-status": await _status(
            me.patch(
                instaslice_path("mignodes", name=other) + "/status", {"status": {"gpuCount": 0}}
            )
        ),
        "alloc-other-status": await _status(
            me.patch(_alloc_path(a_other) + "/status", {"status": {"phase": "Ready"}})
        ),
        "alloc-other-finalizer": await _status(
            me.patch(_alloc_path(a_other), {"metadata": {"finalizers": None}})
        ),
        "node-other-status": await _status(
            me.patch(core_path("nodes", name=other) + "/status", cap)
        ),
        "lease-other": await _status(
            me.create(group_path(LEASES, "leases", NAMESPACE), lease_body)
        ),
        # its own objects, beyond its job
        "node-mine-cpu": await _status(
            me.patch(
                core_path("nodes", name=mine) + "/status", {"status": {"capacity": {"cpu": "1"}}}
            )
        ),
        "node-mine-labels": await _status(
            me.patch(core_path("nodes", name=mine), {"metadata": {"labels": {"x": "y"}}})
        ),
        "alloc-mine-add-finalizer": await _status(
            me.patch(
                _alloc_path(a_mine),
                {"metadata": {"finalizers": [RELEASE_FINALIZER, "example.com/extra"]}},
            )
        ),
        "alloc-mine-relabel": await _status(
            me.patch(_alloc_path(a_mine), {"metadata": {"labels": {"instaslice.io/node": other}}})
        ),
        "alloc-mine-delete": await _status(me.delete(_alloc_path(a_mine))),
        # its own job
        "mignode-mine-status": await _status(
            me.patch(
                instaslice_path("mignodes", name=mine) + "/status", {"status": {"gpuCount": 1}}
            )
        ),
        "node-mine-capacity": await _status(
            me.patch(core_path("nodes", name=mine) + "/status", cap)
        ),
        "node-mine-gpu-labels": await _status(
            me.patch(
                core_path("nodes", name=mine),
                {"metadata": {"labels": {"instaslice.io/gpu-model": "H200-141GB"}}},
            )
        ),
        "alloc-mine-status": await _status(
            me.patch(_alloc_path(a_mine) + "/status", {"status": {"message": "checked"}})
        ),
    }


DENIED = {
    "mignode-other-create",
    "mignode-other-status",
    "alloc-other-status",
    "alloc-other-finalizer",
    "node-other-status",
    "lease-other",
    "node-mine-cpu",
    "node-mine-labels",
    "alloc-mine-add-finalizer",
    "alloc-mine-relabel",
    "alloc-mine-delete",
}


async def _setup(admin: Kube, tmp_path: Path, ns: str) -> tuple[Any, Any, Obj, Obj]:
    a = await gpu_node(admin, tmp_path, [H200], prefix="ra")
    b = await gpu_node(admin, tmp_path, [H200], prefix="rb")
    for n in (a, b):
        try:
            await admin.create(instaslice_path("mignodes"), mig_node(n.name))
        except ApiError as exc:
            assert exc.status == 409
    a_mine = slice_allocation(ns, a, [("c", "1g.18gb", 0, 0, 1)])
    a_other = slice_allocation(ns, b, [("c", "1g.18gb", 0, 0, 1)])
    for x in (a_mine, a_other):
        await create_allocation(admin, x)
    return a, b, a_mine, a_other


async def _cleanup(admin: Kube, *allocs: Obj) -> None:
    for x in allocs:
        try:
            await admin.patch(_alloc_path(x), {"metadata": {"finalizers": None}})
            await admin.delete(_alloc_path(x))
        except ApiError as exc:
            if not exc.not_found:
                raise


async def _wait_policies_active(me: Kube, other: str) -> None:
    """The apiserver loads new policies asynchronously; wait until they bite."""

    async def denied() -> bool:
        got = await _status(
            me.patch(
                instaslice_path("mignodes", name=other) + "/status", {"status": {"gpuCount": 0}}
            )
        )
        return got == 403

    await eventually(denied, within=30, interval=0.2, what="the node agent policies to apply")


async def test_cert_identity_can_only_write_its_own_node(
    admin: Kube, namespace: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    a, b, a_mine, a_other = await _setup(admin, tmp_path, namespace)
    kc = control_plane.user_kubeconfig(
        f"system:instaslice:node:{a.name}", ["instaslice:nodeagents"], tmp_path / "a.kubeconfig"
    )
    try:
        async with await Kube.connect(str(kc)) as me:
            await _wait_policies_active(me, b.name)
            got = await _verdicts(me, a.name, b.name, namespace, a_mine, a_other)
        assert {k for k, v in got.items() if v != 200} == DENIED, got
        assert all(got[k] == 403 for k in DENIED), got
    finally:
        await _cleanup(admin, a_mine, a_other)


async def test_agent_runs_its_whole_job_under_the_node_identity(
    admin: Kube, namespace: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    node = await gpu_node(admin, tmp_path, [H200], prefix="rj")
    kc = control_plane.user_kubeconfig(
        f"system:instaslice:node:{node.name}", ["instaslice:nodeagents"], tmp_path / "j.kubeconfig"
    )
    async with running_agent(agent_settings([node], kc)):
        alloc = slice_allocation(namespace, node, [("c", "2g.35gb", 0, 2, 2)])
        await create_allocation(admin, alloc)
        await wait_phase(admin, alloc, "Ready")

        async def published() -> bool:
            cap = (await admin.get(core_path("nodes", name=node.name)))["status"]["capacity"]
            mn = await admin.get(instaslice_path("mignodes", name=node.name))
            lease = await admin.get(group_path(LEASES, "leases", NAMESPACE, node.name))
            return bool(cap.get("instaslice.io/mig-2g.35gb") == "3" and mn.get("status") and lease)

        await eventually(published, what="capacity, MigNode and Lease written by the agent")
        await admin.delete(_alloc_path(alloc))
        await wait_gone(admin, alloc)  # the finalizer removal was allowed
        assert node.instances() == []


async def test_service_account_token_bound_to_a_pod_on_the_node(
    admin: Kube, namespace: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    a, b, a_mine, a_other = await _setup(admin, tmp_path, namespace)
    created, token = await agent_pod_token(admin, a.name)
    sa = core_path("serviceaccounts", NAMESPACE, "instaslice-nodeagent") + "/token"
    unbound = await admin.create(
        sa, {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {}}
    )
    try:
        kc = _token_kubeconfig(control_plane, token, tmp_path / "sa.kubeconfig")
        async with await Kube.connect(str(kc)) as me:
            review = await me.create(
                "/apis/authentication.k8s.io/v1/selfsubjectreviews",
                {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
            )
            info = review["status"]["userInfo"]
            assert info["username"] == f"system:serviceaccount:{NAMESPACE}:instaslice-nodeagent"
            assert info["extra"]["authentication.kubernetes.io/node-name"] == [a.name]
            await _wait_policies_active(me, b.name)
            got = await _verdicts(me, a.name, b.name, namespace, a_mine, a_other)
        assert {k for k, v in got.items() if v != 200} == DENIED, got

        kc2 = _token_kubeconfig(
            control_plane, unbound["status"]["token"], tmp_path / "u.kubeconfig"
        )
        async with await Kube.connect(str(kc2)) as anyone:
            code = await _status(
                anyone.patch(
                    instaslice_path("mignodes", name=a.name) + "/status",
                    {"status": {"gpuCount": 1}},
                )
            )
            assert code == 403  # no node identity: fails closed
    finally:
        await admin.delete(core_path("pods", NAMESPACE, created["metadata"]["name"]))
        await _cleanup(admin, a_mine, a_other)


def _token_kubeconfig(cp: ControlPlane, token: str, path: Path) -> Path:
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "c",
                "cluster": {
                    "server": cp.server,
                    "certificate-authority-data": base64.b64encode(cp.ca_cert_pem).decode(),
                },
            }
        ],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    path.write_text(yaml.safe_dump(doc))
    path.chmod(0o600)
    return path
