"""Pod events (CONTRACT.md §4), visible in `kubectl describe pod`.

Callers decide *when* to emit (on a change of reason, never per retry); this module only
writes one core/v1 Event. An event is best effort: failing to record one is logged and never
fails the operation that caused it.
"""

from __future__ import annotations

import datetime as dt
import secrets
from typing import Literal

import structlog

from common.clock import kube_time
from common.kubeapi import ApiError, Kube, Obj, core_path

log = structlog.get_logger("events")


async def pod_event(
    kube: Kube,
    pod: Obj,
    reason: str,
    message: str,
    *,
    component: str,
    type_: Literal["Normal", "Warning"] = "Normal",
    now: dt.datetime | None = None,
) -> None:
    meta = pod["metadata"]
    ns = meta["namespace"]
    stamp = kube_time(now)
    body: Obj = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{meta['name']}.{secrets.token_hex(8)}", "namespace": ns},
        "involvedObject": {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": meta["name"],
            "namespace": ns,
            "uid": meta.get("uid", ""),
        },
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
        log.warning("event not recorded", reason=reason, pod=meta["name"], error=str(exc))
