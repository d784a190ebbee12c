"""DRA mode's persistence adapter (docs/dra.md "The allocator in DRA mode"): the writes.

In DRA mode the record of a pod's slices is a ResourceClaim, not a SliceAllocation, and the
pod needs no pin (the claim's node selector binds it). Everything else — the model, the pod
records and `next_step`, the placer, preemption — is the same whichever mode runs: only the
writes (here, a `Writes` whose record writes go to ResourceClaims) and the informer that
feeds records back (`handlers.Handlers.on_claim`, which reads them with
`common.draclaim.as_allocation`) differ by mode.

The create is two requests: the claim (owner = the pod, finalizer `instaslice.io/release`),
then its status, the allocation and `reservedFor` in ONE update — kube-scheduler's PreBind
fails for ever on an allocation written without the reservation (docs/dra.md). A status
write that fails takes the claim back (delete, UID precondition), so the pod is placed again;
a create that finds the claim there (a retry, another term) completes an unwritten status
from the claim's own record before it says so.
"""

from __future__ import annotations

import contextlib
from typing import Any

from common.constants import DRA_API_VERSION
from common.draclaim import as_allocation, claim_for, reserve
from common.kubeapi import ApiError, Kube, Obj, group_path
from common.podspec import SliceAsk, SliceRequestError, slice_requests
from webhook.allocator import pods as podlib
from webhook.allocator.state import ClusterState
from webhook.allocator.writes import Writes


def claim_path(namespace: str, name: str | None = None) -> str:
    return group_path(DRA_API_VERSION, "resourceclaims", namespace, name)


class ClaimWrites(Writes):
    """`Writes` with ResourceClaims as the record (DRA mode)."""

    record_kind = "ResourceClaim"

    def __init__(self, kube: Kube, *args: Any, state: ClusterState) -> None:
        super().__init__(kube, *args)
        self.state = state  # the pods' asks, the GPUs' profile ids

    def record_path(self, namespace: str, name: str | None = None) -> str:
        return claim_path(namespace, name)

    def pinned(self, pod: Obj, node: str) -> Obj:
        return podlib.ungate(pod)  # the claim's node selector binds the pod

    def _asks(self, pod_uid: str) -> list[SliceAsk]:
        pod = self.state.pods.get(pod_uid)
        if pod is None:
            raise ApiError(404, "NotFound", f"pod {pod_uid} is gone")
        try:
            return slice_requests(pod.obj)
        except SliceRequestError as exc:
            raise ApiError(422, "Invalid", str(exc)) from None

    def _profile_id(self, node: str) -> Any:
        def profile_id(index: int, profile: str) -> int | None:
            gpu = self.state.gpu(node, index)
            model = (
                None
                if gpu is None
                else gpu.geometry or self.state.geometries.catalog.model(gpu.model)
            )
            p = model.profile(profile) if model is not None else None
            if p is None:
                raise ApiError(422, "Invalid", f"GPU {index} of {node} has no profile {profile}")
            return p.id

        return profile_id

    async def create_allocation(self, body: Obj) -> Obj:
        """Create the claim standing for the SliceAllocation `body` and write its allocation
        and reservation; the claim as written, read as that SliceAllocation."""
        self.elector.check()
        meta, spec = body["metadata"], body["spec"]
        asks = self._asks(spec["podUID"])
        path = claim_path(meta["namespace"])
        try:
            created = await self.kube.create(path, claim_for(body, asks))
        except ApiError as exc:
            if exc.conflict:
                await self._complete(meta["namespace"], meta["name"])
            raise
        try:
            written = await self._reserve(created, asks)
        except ApiError:
            # left without status if this fails too: the next create of the pod completes it
            with contextlib.suppress(ApiError):
                await self.kube.delete(
                    claim_path(meta["namespace"], meta["name"]),
                    {"preconditions": {"uid": created["metadata"]["uid"]}},
                )
            raise
        shaped = as_allocation(written)
        assert shaped is not None
        return shaped

    async def _reserve(self, claim: Obj, asks: list[SliceAsk]) -> Obj:
        node = str((as_allocation(claim) or {}).get("spec", {}).get("nodeName") or "")
        status = reserve(claim, asks, self._profile_id(node))
        meta = claim["metadata"]
        self.elector.check()
        path = claim_path(meta["namespace"], meta["name"]) + "/status"
        return await self.kube.replace(path, status)

    async def _complete(self, namespace: str, name: str) -> None:
        """A claim of ours found in place without its status (a status write that failed,
        then its delete too): write it now, from the claim's own record."""
        current = await self._read(claim_path(namespace, name))
        shaped = as_allocation(current) if current is not None else None
        if current is None or shaped is None or (current.get("status") or {}).get("allocation"):
            return
        try:
            await self._reserve(current, self._asks(str(shaped["spec"].get("podUID") or "")))
        except ApiError:
            return  # the next try (or the watch) settles it
