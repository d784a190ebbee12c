"""DRA mode's watches, one per process whatever the number of nodes it serves: every
ResourceClaim (each agent keeps those allocated in its own pool: the allocation is in the
status, which no selector reaches) and the served nodes' ResourceSlices (so one deleted or
changed underneath is written again, nodeagent/dra/publish.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from common.constants import DRA_DRIVER
from common.kubeapi import EventType, Informer, Kube, group_path

if TYPE_CHECKING:
    from nodeagent.agent import NodeAgent

Obj = dict[str, Any]


def dra_claims(kube: Kube, agents: Mapping[str, NodeAgent]) -> Informer:
    """Every claim's events to every agent; each agent's `claims.synced` is the informer's
    (garbage collection spares every record until the first list is in)."""

    async def on_event(etype: EventType, obj: Obj) -> None:
        for a in agents.values():
            if a.claims is not None:
                a.claims.on_event(etype, obj)

    informer = Informer(
        kube, group_path("resource.k8s.io/v1", "resourceclaims"), on_event, name="resourceclaims"
    )
    for a in agents.values():
        if a.claims is not None:
            a.claims.synced = informer.synced
    return informer


def dra_slices(kube: Kube, nodes: Sequence[str], agents: Mapping[str, NodeAgent]) -> Informer:
    """The served nodes' slices of this driver, each event to its node's pool publisher."""

    async def on_event(etype: EventType, obj: Obj) -> None:
        spec = obj.get("spec") or {}
        agent = agents.get(str(spec.get("nodeName") or ""))
        if agent is not None and agent.pool is not None and spec.get("driver") == DRA_DRIVER:
            agent.pool.on_event(etype, obj)

    one = f"spec.nodeName={nodes[0]}" if len(nodes) == 1 else f"spec.driver={DRA_DRIVER}"
    return Informer(
        kube,
        group_path("resource.k8s.io/v1", "resourceslices"),
        on_event,
        field_selector=one,
        name="resourceslices",
    )
