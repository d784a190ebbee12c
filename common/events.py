"""Events (docs/contract.md §4): on pods, visible in `kubectl describe pod`, and on cluster-scoped
objects such as a MigNode (recorded in the `default` namespace, as Kubernetes does for Nodes).

Callers decide *when* to emit (on a change of reason, never per retry); this module only
writes one core/v1 Event. An event is best effort: failing to record one is logged and never
fails the operation that caused it.
"""

from __future__ import annotations

import datetime as dt
import secrets
from typing import Literal, NotRequired, TypedDict, Unpack

import structlog

from common.clock import kube_time
from common.kubeapi import ApiError, Kube, Obj, core_path

log = structlog.get_logger("events")


class EventOptions(TypedDict):
    component: str
    type_: NotRequired[Literal["Normal", "Warning"]]
    now: NotRequired[dt.datetime | None]


async def pod_event(
    kube: Kube, pod: Obj, reason: str, message: str, **options: Unpack[EventOptions]
) -> None:
    meta = pod["metadata"]
    involved = {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": meta["name"],
        "namespace": meta["namespace"],
        "uid": meta.get("uid", ""),
    }
    await object_event(kube, involved, reason, message, **options)


async def object_event(
    kube: Kube,
    involved: Obj,
    reason: str,
    message: str,
    *,
    component: str,
    type_: Literal["Normal", "Warning"] = "Normal",
    now: dt.datetime | None = None,
) -> None:
    """One Event about `involved` (`apiVersion, kind, name[, namespace, uid]`); a cluster-scoped
    object's event lives in `default`."""
    ns = involved.get("namespace") or "default"
    stamp = kube_time(now)
    body: Obj = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{involved['name']}.{secrets.token_hex(8)}", "namespace": ns},
        "involvedObject": involved,
        "reason": reason,
        "message": message[:1024],
        "type": type_,
        "source": {"component": component},
        "reportingComponent": component,
        "reportingInstance": component,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }
    try:
        await kube.create(core_path("events", ns), body)
    except ApiError as exc:
        log.warning("event not recorded", reason=reason, name=involved["name"], error=str(exc))
