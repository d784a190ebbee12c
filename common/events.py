"""Events (docs/contract.md §4): on pods, visible in `kubectl describe pod`, and on cluster-scoped
objects such as a MigNode (recorded in the `default` namespace, as Kubernetes does for Nodes).

Callers decide *when* to emit (on a change of reason, never per retry); this module only
writes one core/v1 Event, named after what it says, so a repeat (the same object, reason,
type, message and reporter) is counted on that one Event — `count` and `lastTimestamp`, what
`kubectl describe` shows as `(x3 over 5m)` — rather than written as a new object, across
restarts too, with no memory kept here. `reportingInstance` names who reported: the node for
a node agent, the pod for the allocator. Reasons are `EventReason` members only (the one list
that `kubectl instaslice gather` filters by). An event is best effort: failing to record one
is logged and never fails the operation that caused it.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from typing import Literal, NotRequired, TypedDict, Unpack

import structlog

from common.clock import kube_time
from common.constants import EventReason
from common.kubeapi import ApiError, Kube, Obj, core_path

log = structlog.get_logger("events")

NAME_MAX = 253  # an Event's name is a DNS subdomain
INSTANCE_MAX = 128  # the API server's bound on reportingInstance
_DIGEST_LEN = 16
_COUNT_ATTEMPTS = 3  # a repeat's count update, raced by another writer, is tried again


class EventOptions(TypedDict):
    component: str
    instance: str
    type_: NotRequired[Literal["Normal", "Warning"]]
    now: NotRequired[dt.datetime | None]
    host: NotRequired[str]


async def pod_event(
    kube: Kube, pod: Obj, reason: EventReason, message: str, **options: Unpack[EventOptions]
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


def event_name(involved: Obj, key: tuple[str, ...]) -> str:
    """`<object name>.<digest of what the event says and who says it>`: one name per repeat."""
    ident = (involved.get("kind", ""), involved.get("namespace", ""), involved["name"])
    digest = hashlib.sha256("\0".join((*ident, involved.get("uid", ""), *key)).encode())
    prefix = str(involved["name"])[: NAME_MAX - _DIGEST_LEN - 1].rstrip(".-")
    return f"{prefix}.{digest.hexdigest()[:_DIGEST_LEN]}"


def new_event(
    involved: Obj,
    reason: EventReason,
    message: str,
    *,
    component: str,
    instance: str,
    type_: Literal["Normal", "Warning"],
    stamp: str,
    host: str = "",
) -> Obj:
    """The Event object of a first occurrence (count 1)."""
    ns = involved.get("namespace") or "default"
    message = message[:1024]
    instance = instance[:INSTANCE_MAX]
    source: Obj = {"component": component} | ({"host": host} if host else {})
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": event_name(involved, (reason, type_, message, component, instance)),
            "namespace": ns,
        },
        "involvedObject": involved,
        "reason": str(reason),
        "message": message,
        "type": type_,
        "source": source,
        "reportingComponent": component,
        "reportingInstance": instance,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


def count_patch(count: object, stamp: str) -> list[Obj]:
    """A JSON patch counting one more occurrence of an Event whose count was read as `count`,
    refused (422) if another writer counted since."""
    if not isinstance(count, int) or isinstance(count, bool):  # written without one: the 2nd
        return [
            {"op": "add", "path": "/count", "value": 2},
            {"op": "replace", "path": "/lastTimestamp", "value": stamp},
        ]
    return [
        {"op": "test", "path": "/count", "value": count},
        {"op": "replace", "path": "/count", "value": count + 1},
        {"op": "replace", "path": "/lastTimestamp", "value": stamp},
    ]


async def object_event(
    kube: Kube,
    involved: Obj,
    reason: EventReason,
    message: str,
    *,
    component: str,
    instance: str,
    type_: Literal["Normal", "Warning"] = "Normal",
    now: dt.datetime | None = None,
    host: str = "",
) -> None:
    """One occurrence of an event about `involved` (`apiVersion, kind, name[, namespace,
    uid]`); a cluster-scoped object's event lives in `default`."""
    stamp = kube_time(now)
    body = new_event(
        involved, reason, message,
        component=component, instance=instance, type_=type_, stamp=stamp, host=host,
    )  # fmt: skip
    meta = body["metadata"]
    try:
        await _record(kube, body, stamp)
    except ApiError as exc:
        log.warning("event not recorded", reason=reason, name=meta["name"], error=str(exc))


async def _record(kube: Kube, body: Obj, stamp: str) -> None:
    meta = body["metadata"]
    path = core_path("events", meta["namespace"], meta["name"])
    for _ in range(_COUNT_ATTEMPTS):
        try:
            await kube.create(core_path("events", meta["namespace"]), body)
            return
        except ApiError as exc:
            if exc.status != 409:
                raise
        try:  # a repeat: read its count (the patch answers with the object), count one more
            current = await kube.patch(path, {"lastTimestamp": stamp})
            await kube.patch(path, count_patch(current.get("count"), stamp), kind="json")
            return
        except ApiError as exc:
            if not (exc.not_found or exc.status in (409, 422)):  # expired meanwhile: create
                raise
    raise ApiError(409, "Conflict", f"event {meta['name']} kept changing")
