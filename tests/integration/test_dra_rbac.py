"""Least privilege of the node agent in DRA mode, on the real API server with the shipped
component (manifests/components/dra: ClusterRole + ValidatingAdmissionPolicy).

Covers: an agent authenticated as `system:instaslice:node:<A>` may create, update and delete
ResourceSlices of driver instaslice.io in pool A, remove the finalizer `instaslice.io/release`
of a ResourceClaim allocated in pool A (or deallocated), and write pool A's entries of such a
claim's `status.devices`; it is refused slices of node B (creating, replacing, deleting, or
moving one of its own there), slices of another driver, the finalizer of a claim allocated in
pool B, adding a finalizer or a label, the device status of a claim allocated in pool B, and
any other change of a claim's status (reservedFor, by patch or update). The DaemonSet's
identity, a ServiceAccount token bound to a pod on node A, writes the device status of a claim
allocated on A, and is refused one allocated on B by the API server itself
(`associated-node:update` on `resourceclaims/driver`, Kubernetes 1.36+). A ServiceAccount
token bound to no pod (no node) may write nothing. The agent runs its DRA job (publishing its
pool, carving a claim and writing its device status with the MIG UUID, releasing it, dropping
the finalizer) under the node identity with exactly those grants.
Leaves out: the kubelet's token projection (tests/integration/test_nodeagent_rbac.py covers
the node identity of bound tokens for the same matchConditions).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from common.constants import RELEASE_FINALIZER, AllocationMode
from common.kubeapi import ApiError, Kube, core_path
from hack.cluster import ControlPlane
from nodeagent.dra.carve import claim_path
from nodeagent.dra.publish import slices_path
from tests.integration.agent_fixtures import (
    NAMESPACE,
    agent_pod_token,
    agent_settings,
    apply,
    eventually,
    gpu_node,
    install_instaslice,
    running_agent,
)
from tests.integration.test_dra_plugin import allocated_claim
from tests.integration.test_nodeagent_rbac import _token_kubeconfig as token_kubeconfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
ROOT = Path(__file__).resolve().parents[2]
Obj = dict[str, Any]
H100 = "H100-80GB"


@pytest.fixture(scope="module")
async def admin(control_plane: ControlPlane) -> AsyncIterator[Kube]:
    async with await Kube.connect(str(control_plane.kubeconfig)) as k:
        await install_instaslice(k)
        for f in ("rbac.yaml", "policy.yaml"):
            for doc in yaml.safe_load_all((ROOT / "manifests/components/dra" / f).read_text()):
                await apply(k, doc)
        yield k


def a_slice(node: str, name: str, driver: str = "instaslice.io") -> Obj:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0"}],
        },
    }


async def _status(call: Any) -> int:
    try:
        await call
    except ApiError as exc:
        return exc.status
    return 200


async def _replace(me: Kube, admin: Kube, name: str, change: dict[str, Any]) -> int:
    cur = await admin.get(slices_path(name))
    body = json.loads(json.dumps(cur))
    body["spec"].update(change)
    return await _status(me.replace(slices_path(name), body))


DENIED = {
    "slice-other-create",
    "slice-other-driver",
    "slice-other-replace",
    "slice-other-delete",
    "claim-other-finalizer",
    "claim-mine-add-finalizer",
    "claim-mine-label",
    "claim-mine-status",
    "claim-mine-status-reserved",
    "claim-other-device-status",
}


def device_entry(node: str, device: str) -> Obj:
    ready = {"type": "Ready", "status": "True", "reason": "SliceMade", "message": "",
             "lastTransitionTime": "2026-12-08T00:00:00Z"}  # fmt: skip
    return {"driver": "instaslice.io", "pool": node, "device": device, "conditions": [ready],
            "data": {"migUUID": "MIG-x"}}  # fmt: skip


async def _status_update(me: Kube, admin: Kube, ns: str, name: str, change: Obj) -> int:
    """An update of the claim's status subresource with `change` merged into its status."""
    cur = await admin.get(claim_path(ns, name))
    cur["status"].update(change)
    return await _status(me.replace(claim_path(ns, name) + "/status", cur))


async def _verdicts(me: Kube, admin: Kube, a: str, b: str, ns: str, tag: str) -> dict[str, int]:
    await admin.create(slices_path(), a_slice(b, f"{tag}-b"))
    await admin.create(slices_path(), a_slice(a, f"{tag}-a2"))
    await allocated_claim(admin, ns, f"{tag}-ca", a, "gpu-0-mig-19-0", finalizer=True)
    await allocated_claim(admin, ns, f"{tag}-cb", b, "gpu-0-mig-19-0", finalizer=True)
    await allocated_claim(admin, ns, f"{tag}-cc", a, "gpu-0-mig-19-1", finalizer=True)
    drop = {"metadata": {"finalizers": None}}
    return {
        "slice-mine-create": await _status(me.create(slices_path(), a_slice(a, f"{tag}-a"))),
        "slice-mine-replace": await _replace(me, admin, f"{tag}-a2", {"devices": [{"name": "g"}]}),
        "slice-mine-delete": await _status(me.delete(slices_path(f"{tag}-a"))),
        "slice-other-create": await _status(me.create(slices_path(), a_slice(b, f"{tag}-x"))),
        "slice-other-driver": await _status(
            me.create(slices_path(), a_slice(a, f"{tag}-y", driver="gpu.nvidia.com"))
        ),
        "slice-other-replace": await _replace(me, admin, f"{tag}-b", {"devices": []}),
        "slice-other-delete": await _status(me.delete(slices_path(f"{tag}-b"))),
        "slice-mine-move": await _replace(
            me,
            admin,
            f"{tag}-a2",
            {"nodeName": b, "pool": {"name": b, "generation": 2, "resourceSliceCount": 1}},
        ),
        "claim-mine-finalizer": await _status(me.patch(claim_path(ns, f"{tag}-ca"), drop)),
        "claim-other-finalizer": await _status(me.patch(claim_path(ns, f"{tag}-cb"), drop)),
        "claim-mine-add-finalizer": await _status(
            me.patch(
                claim_path(ns, f"{tag}-cc"),
                {"metadata": {"finalizers": [RELEASE_FINALIZER, "example.com/x"]}},
            )
        ),
        "claim-mine-label": await _status(
            me.patch(claim_path(ns, f"{tag}-cc"), {"metadata": {"labels": {"x": "y"}}})
        ),
        "claim-mine-status": await _status(
            me.patch(claim_path(ns, f"{tag}-cc") + "/status", {"status": {"reservedFor": None}})
        ),
        "claim-mine-device-status": await _status_update(
            me, admin, ns, f"{tag}-cc", {"devices": [device_entry(a, "gpu-0-mig-19-1")]}
        ),
        "claim-mine-status-reserved": await _status_update(
            me, admin, ns, f"{tag}-cc", {"reservedFor": []}
        ),
        "claim-other-device-status": await _status_update(
            me, admin, ns, f"{tag}-cb", {"devices": [device_entry(b, "gpu-0-mig-19-0")]}
        ),
    }


async def _wait_active(me: Kube, other: str) -> None:
    async def denied() -> bool:
        return await _status(me.create(slices_path(), a_slice(other, "probe"))) == 403

    await eventually(denied, within=30, interval=0.2, what="the DRA agent policy to apply")


async def test_cert_identity_writes_only_its_own_pool(
    admin: Kube, namespace: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    a = await gpu_node(admin, tmp_path, [H100], prefix="dra")
    b = await gpu_node(admin, tmp_path, [H100], prefix="drb")
    kc = control_plane.user_kubeconfig(
        f"system:instaslice:node:{a.name}", ["instaslice:nodeagents"], tmp_path / "a.kubeconfig"
    )
    async with await Kube.connect(str(kc)) as me:
        await _wait_active(me, b.name)
        got = await _verdicts(me, admin, a.name, b.name, namespace, "t")
    moved = got.pop("slice-mine-move")  # nodeName and pool are immutable: the API refuses
    assert moved == 422, moved
    assert {k for k, v in got.items() if v != 200} == DENIED, got
    # 403 from RBAC or the policy; a reservedFor change the API server itself refuses (422:
    # it takes `resourceclaims/binding`, which the agent does not have)
    want = {k: 422 if k == "claim-mine-status-reserved" else 403 for k in DENIED}
    assert {k: got[k] for k in DENIED} == want, json.dumps(got)


async def test_no_node_identity_writes_nothing(
    admin: Kube, namespace: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    a = await gpu_node(admin, tmp_path, [H100], prefix="drn")
    kc = control_plane.user_kubeconfig(
        "someone", ["instaslice:nodeagents"], tmp_path / "n.kubeconfig"
    )
    async with await Kube.connect(str(kc)) as me:
        await _wait_active(me, "elsewhere")
        assert await _status(me.create(slices_path(), a_slice(a.name, "n-a"))) == 403


async def test_agent_runs_its_dra_job_under_the_node_identity(
    admin: Kube, namespace: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    node = await gpu_node(admin, tmp_path, [H100], prefix="drj")
    kc = control_plane.user_kubeconfig(
        f"system:instaslice:node:{node.name}", ["instaslice:nodeagents"], tmp_path / "j.kubeconfig"
    )
    settings = dataclasses.replace(agent_settings([node], kc), allocation=AllocationMode.DRA)
    async with running_agent(settings):

        async def published() -> bool:
            got = await admin.list(slices_path(), fieldSelector=f"spec.nodeName={node.name}")
            return len(got.get("items") or []) == 2

        await eventually(published, what="the pool written by the agent")
        await allocated_claim(admin, namespace, "job", node.name, "gpu-0-mig-19-6", finalizer=True)

        async def carved() -> bool:
            return node.instances() == [(0, "1g.10gb", 6, 1, 0)]

        await eventually(carved, what="the claim's slice")

        async def reported() -> Obj | None:
            got = await admin.get(claim_path(namespace, "job"))
            (entry,) = (got.get("status") or {}).get("devices") or [None]
            return dict(entry) if entry is not None else None

        entry = await eventually(reported, what="the claim's device status written by the agent")
        assert (entry["driver"], entry["pool"], entry["device"]) == (
            "instaslice.io", node.name, "gpu-0-mig-19-6"
        ), entry  # fmt: skip
        (ready,) = entry["conditions"]
        assert (ready["type"], ready["status"]) == ("Ready", "True"), ready
        assert entry["data"]["migUUID"].startswith("MIG-"), entry
        assert entry["data"]["migUUID"] in ready["message"], ready
        await admin.delete(claim_path(namespace, "job"))

        async def gone() -> bool:
            try:
                await admin.get(claim_path(namespace, "job"))
            except ApiError as exc:
                return exc.not_found and node.instances() == []
            return False

        await eventually(gone, what="released and the finalizer dropped under the node identity")


async def test_the_daemonsets_identity_writes_device_status_only_on_its_node(
    admin: Kube, namespace: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    """The production identity: the agent's ServiceAccount token bound to its pod on node A.
    RBAC grants `associated-node:update` only, which the API server honours for a claim
    allocated on A alone."""
    a = await gpu_node(admin, tmp_path, [H100], prefix="dsa")
    b = await gpu_node(admin, tmp_path, [H100], prefix="dsb")
    created, token = await agent_pod_token(admin, a.name)
    try:
        await allocated_claim(admin, namespace, "sa-a", a.name, "gpu-0-mig-19-0")
        await allocated_claim(admin, namespace, "sa-b", b.name, "gpu-0-mig-19-0")
        kc = token_kubeconfig(control_plane, token, tmp_path / "sa.kubeconfig")
        async with await Kube.connect(str(kc)) as me:
            await _wait_active(me, b.name)
            mine = await _status_update(
                me, admin, namespace, "sa-a", {"devices": [device_entry(a.name, "gpu-0-mig-19-0")]}
            )
            other = await _status_update(
                me, admin, namespace, "sa-b", {"devices": [device_entry(b.name, "gpu-0-mig-19-0")]}
            )
        assert mine == 200, mine
        assert other == 422, other  # the API server: associated-node, not the token's node
        got = await admin.get(claim_path(namespace, "sa-b"))
        assert not (got.get("status") or {}).get("devices"), got["status"]
    finally:
        await admin.delete(core_path("pods", NAMESPACE, created["metadata"]["name"]))
