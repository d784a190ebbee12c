"""Least privilege of the node agent in DRA mode, on the real API server with the shipped
component (manifests/components/dra: ClusterRole + ValidatingAdmissionPolicy).

Covers: an agent authenticated as `system:instaslice:node:<A>` may create, update and delete
ResourceSlices of driver instaslice.io in pool A, and remove the finalizer
`instaslice.io/release` of a ResourceClaim allocated in pool A (or deallocated); it is refused
slices of node B (creating, replacing, deleting, or moving one of its own there), slices of
another driver, the finalizer of a claim allocated in pool B, adding a finalizer or a label,
and claims' status. A ServiceAccount token bound to no pod (no node) may write nothing. The
agent runs its DRA job (publishing its pool, carving and releasing a claim, dropping the
finalizer) under the node identity with exactly those grants.
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
from common.kubeapi import ApiError, Kube
from hack.cluster import ControlPlane
from nodeagent.dra.carve import claim_path
from nodeagent.dra.publish import slices_path
from tests.integration.agent_fixtures import (
    agent_settings,
    apply,
    eventually,
    gpu_node,
    install_instaslice,
    running_agent,
)
from tests.integration.test_dra_plugin import allocated_claim

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
}


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
    assert all(got[k] == 403 for k in DENIED), json.dumps(got)


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
        await admin.delete(claim_path(namespace, "job"))

        async def gone() -> bool:
            try:
                await admin.get(claim_path(namespace, "job"))
            except ApiError as exc:
                return exc.not_found and node.instances() == []
            return False

        await eventually(gone, what="released and the finalizer dropped under the node identity")
