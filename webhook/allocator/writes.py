"""Every write the allocator makes, each preceded by the Lease check (but its own Lease's,
leader.py). The controller builds one `Writes` and hands it to every part that writes (steps,
the MigNode writes, the loops, the autoscaler signal); no other module calls a write of
`Kube` (tests/unit/test_allocator_one_writer.py).

The controller decides *what* to do; this module is *how*, against the API server: the
SliceAllocation create, the one PUT that pins and ungates a pod (re-read and retried on 409),
deletes with a UID precondition (so a newer object of the same name is never hit), the JSON
patch that drops the release finalizer (with a `test` of the current list), pod events, the
autoscaler signal's placeholders and ProvisioningRequests (webhook/allocator/scaleup.py). The
reads before destructive writes live here too: a cache that has not seen an object yet must
never be taken as proof that it is gone.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Literal

import structlog

from common.allocation import SliceAllocation, drop_release_finalizer
from common.clock import Clock
from common.constants import (
    API_VERSION,
    LEASE_API_VERSION,
    MIG_NODE_KIND,
    RELEASE_FINALIZER,
    SCALE_UP_LABEL,
    SLICE_ALLOCATION_PLURAL,
    EventReason,
)
from common.events import object_event, pod_event
from common.kubeapi import ApiError, Kube, Obj, core_path, group_path, instaslice_path
from webhook.allocator import pods as podlib
from webhook.allocator.autoscale import PROVREQ_API_VERSION
from webhook.allocator.leader import LeaderElector
from webhook.allocator.maintenance import spec_patch
from webhook.allocator.state import ClusterState

log = structlog.get_logger("allocator")

COMPONENT = "instaslice-allocator"

EventType_ = Literal["Normal", "Warning"]  # an Event's type (kubeapi.EventType: a watch event's)
Tell = Callable[[Obj, EventReason, str, EventType_], None]  # an event, written in the background
_PIN_ATTEMPTS = 5
_LEADER_WAIT_S = 0.2  # how often an event waiting out a late Lease renewal looks again


class Writes:
    def __init__(self, kube: Kube, elector: LeaderElector, clock: Clock, instance: str) -> None:
        self.kube = kube
        self.elector = elector
        self.clock = clock
        self.instance = instance  # the pod this replica runs in: its events' reportingInstance

    async def create_allocation(self, body: Obj) -> Obj:
        self.elector.check()
        namespace = body["metadata"]["namespace"]
        return await self.kube.create(instaslice_path(SLICE_ALLOCATION_PLURAL, namespace), body)

    async def pin(self, pod: Obj, node: str) -> Obj | None:
        """Pin `pod` to `node` and lift our gate in one PUT; the pod as written. None when
        there is nothing to do any more (the pod is gone, replaced, or already ungated)."""
        meta = pod["metadata"]
        path = core_path("pods", meta["namespace"], meta["name"])
        uid, current = podlib.uid(pod), pod
        for _ in range(_PIN_ATTEMPTS):
            if podlib.uid(current) != uid or not podlib.has_our_gate(current):
                return None
            self.elector.check()
            try:
                return await self.kube.replace(path, podlib.pin(current, node))
            except ApiError as exc:
                if exc.not_found:
                    return None
                if not exc.conflict:
                    raise
            current = await self.kube.get(path)
        raise ApiError(409, "Conflict", f"pod {meta['name']} kept changing while being pinned")

    async def delete_allocation(self, alloc: SliceAllocation) -> None:
        self.elector.check()
        uid = alloc.uid
        try:
            await self.kube.delete(
                instaslice_path(SLICE_ALLOCATION_PLURAL, alloc.namespace, alloc.name),
                {"preconditions": {"uid": uid}} if uid else None,
            )
        except ApiError as exc:
            if not (exc.not_found or exc.conflict):  # gone, or already another object
                raise

    async def set_desired_modes(self, node: str, body: Obj) -> None:
        """Merge-patch MigNode `node`'s spec.gpus (Ampere maintenance asks and withdrawals)."""
        self.elector.check()
        await self.kube.patch(instaslice_path("mignodes", name=node), body)

    async def forget_node(self, node: str, namespace: str) -> bool:
        """Delete the MigNode and the node agent's Lease (in `namespace`) of a node that no
        longer exists; False (nothing deleted) when a fresh read finds the Node after all."""
        try:
            await self.kube.get(core_path("nodes", name=node))
            return False
        except ApiError as exc:
            if not exc.not_found:
                raise
        self.elector.check()
        await self.kube.delete_ignore_missing(
            group_path(LEASE_API_VERSION, "leases", namespace, node)
        )
        await self.kube.delete_ignore_missing(instaslice_path("mignodes", name=node))  # last
        return True

    async def list_allocations(self) -> list[Obj]:
        """Every SliceAllocation, as a quorum list reads them (a new term's first look)."""
        listing = await self.kube.list(instaslice_path(SLICE_ALLOCATION_PLURAL))
        return list(listing.get("items") or [])

    async def pod_alive(self, alloc: SliceAllocation) -> bool:
        """Whether the allocation's pod exists (same UID) and has not finished."""
        try:
            pod = await self.kube.get(core_path("pods", alloc.namespace, alloc.pod_name))
        except ApiError as exc:
            if exc.not_found:
                return False
            raise
        return podlib.uid(pod) == alloc.pod_uid and not podlib.is_terminal(pod)

    async def read_pod(self, pod: Obj) -> Obj | None:
        """The pod as the API server has it now; None when it is gone."""
        meta = pod["metadata"]
        return await self._read(core_path("pods", meta["namespace"], meta["name"]))

    async def node_exists(self, node: str) -> bool:
        try:
            await self.kube.get(core_path("nodes", name=node))
        except ApiError as exc:
            if exc.not_found:
                return False
            raise
        return True

    async def _read(self, path: str) -> Obj | None:
        try:
            return await self.kube.get(path)
        except ApiError as exc:
            if exc.not_found:
                return None
            raise

    async def drop_finalizer(self, alloc: SliceAllocation) -> Obj | None:
        """Remove the release finalizer (nothing is left to destroy); returns the object as
        it was read, or None when it is already gone."""
        path = instaslice_path(SLICE_ALLOCATION_PLURAL, alloc.namespace, alloc.name)
        current = await self._read(path)
        if current is None:
            return None
        finalizers = current.get("metadata", {}).get("finalizers") or []
        if RELEASE_FINALIZER in finalizers:
            self.elector.check()
            patch = drop_release_finalizer(
                finalizers, test_path="/metadata/finalizers", test_value=finalizers
            )
            await self.kube.patch(path, patch, kind="json")
        return current

    async def drop_finalizer_if_untouched(self, alloc: SliceAllocation) -> bool:
        """Remove the release finalizer of an allocation its node agent never acted on: no
        status at all (the agent writes `Creating` before it makes anything). The patch
        `test`s the resourceVersion read, so a status written since makes it fail and the
        record stays. True when the finalizer is off and the object is still there to
        delete; False when gone already (an earlier pass did it) or kept."""
        path = instaslice_path(SLICE_ALLOCATION_PLURAL, alloc.namespace, alloc.name)
        current = await self._read(path)
        if current is None:
            return False
        meta = current.get("metadata", {})
        if current.get("status") or meta.get("uid") != alloc.uid:
            return False  # the agent got to it after all, or it is another object now
        finalizers = meta.get("finalizers") or []
        if RELEASE_FINALIZER not in finalizers:
            return True
        self.elector.check()
        patch = drop_release_finalizer(
            finalizers, test_path="/metadata/resourceVersion", test_value=meta["resourceVersion"]
        )
        try:
            await self.kube.patch(path, patch, kind="json")
        except ApiError as exc:
            if exc.not_found or exc.status in (409, 422):  # gone, or changed since the read
                return False
            raise
        return True

    async def delete_pod_as_read(self, pod: Obj) -> bool:
        """Delete `pod` only as it was read (UID and resourceVersion preconditions): True
        when deleted or already gone, False when it changed since the read (409), e.g. the
        scheduler bound it meanwhile."""
        meta = pod["metadata"]
        self.elector.check()
        try:
            await self.kube.delete(
                core_path("pods", meta["namespace"], meta["name"]),
                {"preconditions": {"uid": meta["uid"], "resourceVersion": meta["resourceVersion"]}},
            )
        except ApiError as exc:
            if exc.conflict:
                return False
            if not exc.not_found:
                raise
        return True

    async def delete_pod(self, namespace: str, name: str, uid: str) -> None:
        """Delete a pod with a UID precondition and its own grace period (a preemption
        victim past its PodDisruptionBudget, as kube-scheduler deletes its victims); gone,
        or another pod of that name now, is done."""
        self.elector.check()
        try:
            await self.kube.delete(
                core_path("pods", namespace, name), {"preconditions": {"uid": uid}}
            )
        except ApiError as exc:
            if not (exc.not_found or exc.conflict):
                raise

    async def evict(self, namespace: str, name: str, uid: str) -> bool:
        """Evict a pod (policy/v1 Eviction, UID precondition): True when evicted or gone,
        False when a PodDisruptionBudget refuses it now (429)."""
        self.elector.check()
        body = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": namespace},
            "deleteOptions": {"preconditions": {"uid": uid}},
        }
        try:
            await self.kube.create(core_path("pods", namespace, name) + "/eviction", body)
        except ApiError as exc:
            if exc.not_found or exc.conflict:  # gone, or another pod of that name now
                return True
            if exc.status == 429:
                return False
            raise
        return True

    async def event(self, pod: Obj, reason: EventReason, message: str, type_: EventType_) -> None:
        """Best effort (common.events), written only while this replica's leadership is
        confirmed. While a renewal is late it waits, for a decision made in that moment must
        still be told (CI: a pod parked just as the term began was never told why); the end
        of the term cancels the wait."""
        while not self.elector.is_leader:
            await self.clock.sleep(_LEADER_WAIT_S)
        await pod_event(
            self.kube, pod, reason, message,
            component=COMPONENT, instance=self.instance, type_=type_, now=self.clock.wall(),
        )  # fmt: skip

    async def mig_node_warning(self, node: str, reason: EventReason, message: str) -> None:
        """A Warning event on MigNode `node` (best effort, like `event`; recorded in `default`,
        as Kubernetes does for cluster-scoped objects). Only while leading: a standby's
        would repeat the leader's."""
        if not self.elector.is_leader:
            return
        involved = {"apiVersion": API_VERSION, "kind": MIG_NODE_KIND, "name": node}
        await object_event(
            self.kube,
            involved,
            reason,
            message,
            component=COMPONENT,
            instance=self.instance,
            type_="Warning",
            now=self.clock.wall(),
        )

    # --- the autoscaler signal (scaleup.py) -----------------------------------------------

    async def raise_placeholder(self, body: Obj) -> Obj:
        """Create a placeholder pod (Karpenter's signal); the pod as created."""
        self.elector.check()
        return await self.kube.create(core_path("pods", body["metadata"]["namespace"]), body)

    async def raise_provisioning_request(self, template: Obj, provreq: Obj) -> Obj:
        """Create a PodTemplate and the ProvisioningRequest naming it (cluster-autoscaler's
        signal); the ProvisioningRequest as created."""
        self.elector.check()
        namespace = provreq["metadata"]["namespace"]
        await self.kube.create(core_path("podtemplates", namespace), template)
        path = group_path(PROVREQ_API_VERSION, "provisioningrequests", namespace)
        return await self.kube.create(path, provreq)

    async def withdraw_placeholder(self, namespace: str, name: str) -> None:
        self.elector.check()
        path = core_path("pods", namespace, name)
        await self.kube.delete_ignore_missing(path, gracePeriodSeconds=0)

    async def withdraw_provisioning_request(self, namespace: str, name: str) -> None:
        self.elector.check()
        path = group_path(PROVREQ_API_VERSION, "provisioningrequests", namespace, name)
        await self.kube.delete_ignore_missing(path)
        await self.kube.delete_ignore_missing(core_path("podtemplates", namespace, name))

    async def placeholders_on(self, node: str) -> list[Obj]:
        """The placeholder pods the API server has bound to `node` now (a read)."""
        found = await self.kube.list(
            core_path("pods"), labelSelector=SCALE_UP_LABEL, fieldSelector=f"spec.nodeName={node}"
        )
        return list(found.get("items") or [])


@dataclass(eq=False)
class MigNodeWrites:
    """The MigNode writes made in the background, off any pod's path and only while leading
    (`spawn`): the Ampere maintenance's `desiredMigMode` asks and withdrawals (one merge
    patch of the whole `spec.gpus` list, maintenance.spec_patch) and Warning events."""

    writes: Writes
    state: ClusterState
    spawn: Callable[[Callable[[], Coroutine[Any, Any, None]]], None]

    def set(self, node: str, add: dict[str, str], drop: set[str]) -> None:
        """MigNode `node`'s desiredMigMode entries: `add` set, `drop` removed."""
        current = {g.uuid: g.desired for g in self.state.gpus.get(node, ()) if g.desired}
        body = spec_patch(current, add, drop)
        self.spawn(lambda: self._write_modes(node, body))

    async def _write_modes(self, node: str, body: Obj) -> None:
        try:
            await self.writes.set_desired_modes(node, body)
        except ApiError as exc:  # the next MigNode event or pending pod asks again
            log.warning("could not write desired MIG modes", node=node, error=str(exc))

    def warn(self, node: str, reason: EventReason, message: str) -> None:
        self.spawn(lambda: self.writes.mig_node_warning(node, reason, message))
