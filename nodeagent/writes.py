"""Every API write the node agent makes, and nothing else (docs/protocol.md ownership table).

The agent writes only: the status and the finalizer of SliceAllocations bound to its node,
its own MigNode, the `instaslice.io/mig-*` capacity in its own Node's status, its Lease, and
pod events. The least-privilege policy (manifests/base/nodeagent) enforces the same list on
the API server side. Conflicts are resolved here: finalizer removal is a JSON patch with a
`test` on the current list, re-read and retried when another writer got there first.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from common.allocation import SliceAllocation, drop_release_finalizer
from common.clock import micro_time
from common.conditions import observed
from common.constants import (
    API_VERSION,
    LEASE_API_VERSION,
    MIG_NODE_KIND,
    NODEAGENT_COMPONENT,
    RELEASE_FINALIZER,
    EventReason,
)
from common.events import object_event, pod_event
from common.kubeapi import ApiError, Kube, core_path, group_path, instaslice_path
from common.objects import mig_node

Obj = dict[str, Any]


def alloc_path(namespace: str, name: str) -> str:
    return instaslice_path("sliceallocations", namespace, name)


async def patch_alloc_status(kube: Kube, namespace: str, name: str, body: Obj) -> Obj | None:
    """Merge-patch the status subresource; None if the allocation is gone."""
    try:
        return await kube.patch(alloc_path(namespace, name) + "/status", body)
    except ApiError as exc:
        if exc.not_found:
            return None
        raise


async def drop_finalizer(kube: Kube, namespace: str, name: str, finalizers: list[str]) -> bool:
    """Remove our finalizer, conflict-safe: `test` the list we saw, re-read on mismatch.

    True only if this call removed it; False if it was gone already (a second release pass
    working from a stale watch view finds the object deleted, or the list without it)."""
    path = alloc_path(namespace, name)
    current = list(finalizers)
    for _ in range(10):
        if RELEASE_FINALIZER not in current:
            return False
        body = drop_release_finalizer(current, test_path="/metadata/finalizers", test_value=current)
        try:
            await kube.patch(path, body, kind="json")
            return True
        except ApiError as exc:
            if exc.not_found:
                return False
            if exc.status not in (409, 422):  # 422: the test failed, someone changed the list
                raise
        try:
            fresh = await kube.get(path)
        except ApiError as exc:
            if exc.not_found:
                return False
            raise
        current = list(fresh.get("metadata", {}).get("finalizers") or [])
    raise ApiError(409, "Conflict", f"finalizers of {namespace}/{name} keep changing")


async def ensure_mig_node(kube: Kube, node: str) -> int:
    """Create MigNode `node`: the generation of the one made, 0 when it existed already."""
    try:
        made = await kube.create(instaslice_path("mignodes"), mig_node(node))
    except ApiError as exc:
        if exc.status != 409:
            raise
        return 0
    return int(made.get("metadata", {}).get("generation") or 0)


async def patch_mig_node_status(kube: Kube, node: str, status: Obj) -> int:
    """Publish MigNode status (creating the object on first use). The generation of a MigNode
    made here (its spec empty, so observed as written: `observedGeneration`); 0 otherwise."""
    path = instaslice_path("mignodes", name=node) + "/status"
    try:
        await kube.patch(path, {"status": status})
        return 0
    except ApiError as exc:
        if not exc.not_found:
            raise
    made = await ensure_mig_node(kube, node)
    if made:
        status = {**status, "observedGeneration": made}
        status["conditions"] = observed(status.get("conditions") or [], made, "")
    await kube.patch(path, {"status": status})
    return made


async def get_node(kube: Kube, node: str) -> Obj | None:
    """The Node object; None if it does not exist (yet)."""
    try:
        return await kube.get(core_path("nodes", name=node))
    except ApiError as exc:
        if exc.not_found:
            return None
        raise


async def node_labels(kube: Kube, node: str) -> dict[str, str] | None:
    """The Node's labels; None if the Node does not exist (yet)."""
    obj = await get_node(kube, node)
    return None if obj is None else dict(obj.get("metadata", {}).get("labels") or {})


async def patch_node(kube: Kube, node: str, body: Obj) -> None:
    """Its own Node's instaslice.io/gpu-* labels only (the policy refuses anything else)."""
    await kube.patch(core_path("nodes", name=node), body)


async def patch_node_status(kube: Kube, node: str, body: Obj) -> None:
    await kube.patch(core_path("nodes", name=node) + "/status", body)


async def renew_lease(kube: Kube, namespace: str, node: str, duration_s: int) -> None:
    """Heartbeat: bump the Lease `<node>` in InstaSlice's namespace (create it if missing)."""
    now = micro_time(dt.datetime.now(dt.UTC))
    path = group_path(LEASE_API_VERSION, "leases", namespace, node)
    try:
        await kube.patch(path, {"spec": {"renewTime": now, "leaseDurationSeconds": duration_s}})
        return
    except ApiError as exc:
        if not exc.not_found:
            raise
    body: Obj = {
        "apiVersion": LEASE_API_VERSION,
        "kind": "Lease",
        "metadata": {"name": node, "namespace": namespace},
        "spec": {
            "holderIdentity": f"{NODEAGENT_COMPONENT}/{node}",
            "leaseDurationSeconds": duration_s,
            "acquireTime": now,
            "renewTime": now,
        },
    }
    try:
        await kube.create(group_path(LEASE_API_VERSION, "leases", namespace), body)
    except ApiError as exc:
        if exc.status != 409:
            raise


async def event(
    kube: Kube, alloc: SliceAllocation, reason: EventReason, message: str, warning: bool = False
) -> None:
    """An event on `alloc`'s pod, reported by its node (best effort: never fails the caller)."""
    if not alloc.pod_name:
        return
    pod = {"metadata": {"name": alloc.pod_name, "namespace": alloc.namespace, "uid": alloc.pod_uid}}
    await pod_event(
        kube,
        pod,
        reason,
        message,
        component=NODEAGENT_COMPONENT,
        instance=alloc.node,
        host=alloc.node,
        type_="Warning" if warning else "Normal",
    )


async def mig_node_warning(kube: Kube, node: str, reason: EventReason, message: str) -> None:
    """A Warning event on the node's MigNode (best effort)."""
    involved = {"apiVersion": API_VERSION, "kind": MIG_NODE_KIND, "name": node}
    await object_event(
        kube, involved, reason, message,
        component=NODEAGENT_COMPONENT, instance=node, host=node, type_="Warning",
    )  # fmt: skip


async def mig_node_event(kube: Kube, node: str, condition: Obj) -> None:
    """A Warning event on the node's MigNode for a condition that is False (best effort);
    the event's reason is the condition's (an `EventReason`: common.conditions)."""
    message = f"{condition['type']}={condition['status']}: {condition['message']}"
    await mig_node_warning(kube, node, EventReason(condition["reason"]), message)
