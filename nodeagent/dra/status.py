"""A prepared claim's `status.devices` (DRA mode, docs/dra.md "On the node").

Once a claim's slices are made, the node agent writes one entry per device of its pool into
the claim's `status.devices`: driver, pool, device, a `Ready` condition and `data` with what
NVML named the slice (the MIG UUID, which `nvidia-smi -L` shows in the container), so
`kubectl get resourceclaim -o yaml` says which MIG device backs the claim. Entries of other
drivers and pools are kept as they are; a release takes ours out while the claim is still
allocated (a deallocation clears the field with the allocation).

The write is an update of the `status` subresource guarded by the resourceVersion read (a
conflict is read again), so another writer's entries are never lost. Its authorization
(Kubernetes 1.36+): `update` on `resourceclaims/status` and `associated-node:update` on
`resourceclaims/driver` named `instaslice.io`, which the API server grants a ServiceAccount
only for claims allocated on the node its token is bound to; the ValidatingAdmissionPolicy
instaslice-nodeagent-dra lets an agent change only its own pool's entries (docs/security.md).

`entries`, `merged` and `reported` are pure; `write` is the one API call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from common.constants import DRA_DRIVER
from common.kubeapi import ApiError, Kube, group_path
from nodeagent.checkpoint import ClaimRecord

Obj = dict[str, Any]
READY = "Ready"
REASON = "SliceMade"
TRIES = 5


def entries(node: str, rec: ClaimRecord, now: str) -> list[Obj]:
    """One `status.devices` entry per made slice of the claim (named after its device)."""
    out = []
    for s in rec.slices:
        data = {"migUUID": s.mig_uuid, "gpuUUID": s.gpu_uuid, "profile": s.profile}
        if s.whole:  # a whole GPU: its UUID, no MIG instance
            data = {"gpuUUID": s.mig_uuid or s.gpu_uuid, "profile": s.profile}
        out.append(
            {
                "driver": DRA_DRIVER,
                "pool": node,
                "device": s.container,
                "conditions": [
                    {
                        "type": READY,
                        "status": "True",
                        "reason": REASON,
                        "message": f"{s.profile} on GPU {s.gpu_index}: {s.mig_uuid}",
                        "lastTransitionTime": now,
                    }
                ],
                "data": data,
            }
        )
    return out


def _ours(entry: Mapping[str, Any], node: str) -> bool:
    return entry.get("driver") == DRA_DRIVER and entry.get("pool") == node


def merged(current: Sequence[Obj] | None, node: str, ours: Sequence[Obj]) -> list[Obj]:
    """`current` with this pool's entries replaced by `ours`; an entry already there with
    the same condition keeps its lastTransitionTime (the condition did not change)."""
    old = {e.get("device"): e for e in current or () if _ours(e, node)}
    kept = []
    for e in ours:
        before = old.get(e["device"])
        if before is not None and _same(before, e):
            e = before
        kept.append(e)
    return [e for e in current or () if not _ours(e, node)] + kept


def _same(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    def key(e: Mapping[str, Any]) -> tuple[Any, ...]:
        conds = [
            (c.get("type"), c.get("status"), c.get("reason"), c.get("message"))
            for c in e.get("conditions") or []
        ]
        return (e.get("data"), conds)

    return key(a) == key(b)


def reported(obj: Mapping[str, Any], node: str) -> frozenset[str]:
    """The devices of this pool the claim's status shows Ready."""
    devices = (obj.get("status") or {}).get("devices") or []
    return frozenset(
        str(e.get("device"))
        for e in devices
        if _ours(e, node)
        and any(
            c.get("type") == READY and c.get("status") == "True" for c in e.get("conditions") or []
        )
    )


def status_path(namespace: str, name: str) -> str:
    return group_path("resource.k8s.io/v1", "resourceclaims", namespace, name) + "/status"


async def _the_claim(kube: Kube, path: str, uid: str) -> Obj | None:
    """The claim at `path` if it is still the one of `uid`."""
    try:
        claim = await kube.get(path)
    except ApiError as exc:
        if not exc.not_found:
            raise
        return None
    return claim if (claim.get("metadata") or {}).get("uid") == uid else None


async def write(
    kube: Kube, node: str, namespace: str, name: str, uid: str, ours: Sequence[Obj]
) -> bool:
    """Make the claim's entries of this pool `ours` (none: taken out). False when the claim
    is gone or is another one by now; an ApiError other than a conflict is the caller's."""
    path = status_path(namespace, name)
    for _ in range(TRIES):
        claim = await _the_claim(kube, path, uid)
        if claim is None:
            return False
        status = claim.setdefault("status", {})
        generation = (claim.get("metadata") or {}).get("generation", 0)
        for e in ours:
            for c in e["conditions"]:
                c["observedGeneration"] = generation
        devices = merged(status.get("devices"), node, ours)
        if devices == (status.get("devices") or []):
            return True
        status["devices"] = devices
        if not devices:
            del status["devices"]
        try:
            await kube.replace(path, claim)
            return True
        except ApiError as exc:
            if exc.not_found:
                return False
            if not exc.conflict:
                raise
    raise ApiError(
        409, "Conflict", f"claim {namespace}/{name}: status not written in {TRIES} tries"
    )
