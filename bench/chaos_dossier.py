"""What the chaos soak records so that a double booking found once can be explained.

The soak samples SliceAllocations every second (bench/chaos.py `Sampler`). A violation seen
once in an hour (issue 17: a Running pod's allocation gone and another one on its slots)
cannot be explained from its one line; the components' logs alone do not say which API
object changed when, nor who deleted it. So the soak keeps, for a while:

- `Timelines`: each chaos pod's transitions as its informer saw them (phase, node, gates,
  deletion), and each allocation's as the sampler saw them (phase, deletion, finalizers,
  slots, and when it was gone), pruned some minutes after the object went;
- an API server audit log (`AUDIT_POLICY`, `audit_args`): who deleted, evicted, bound,
  pinned or patched which pod, node or SliceAllocation, and when, at `Metadata` level;

and on a violation `dossier()` gathers, at that moment: fresh reads of the pods and
allocations involved, their timelines, the events about them, the faults of the last
minutes, the audit lines and the component log lines that name them. The soak writes each
dossier next to the kept logs and into its result. It explains; it judges nothing.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.constants import CLAIM_ANNOTATION
from common.kubeapi import ApiError, Kube, core_path
from common.kubeapi import instaslice_path as isl_path

Obj = dict[str, Any]

KEEP_GONE_S = 300.0  # how long the timeline of an object that went is kept
MARKS_PER_OBJECT = 40  # the oldest marks of a busy object are dropped past this
LINES_PER_SOURCE = 60  # audit and log lines kept per dossier, the latest

# Metadata level (who, what, when, the answer) for the writes that can end a pod's slices;
# the allocation patches at Request level (a finalizer dropped shows in the body)
AUDIT_POLICY = """\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
  - level: Request
    verbs: ["patch", "update"]
    resources:
      - group: "instaslice.io"
        resources: ["sliceallocations"]
  - level: Metadata
    verbs: ["create", "delete", "deletecollection", "patch", "update"]
    resources:
      - group: ""
        resources: ["pods", "pods/binding", "pods/eviction", "pods/status", "nodes"]
      - group: "instaslice.io"
        resources: ["sliceallocations", "sliceallocations/status"]
  - level: None
"""


def audit_args(dir: Path, log: Path) -> tuple[str, ...]:
    """kube-apiserver flags for the audit log at `log`, the policy written into `dir`."""
    policy = dir / "audit-policy.yaml"
    policy.write_text(AUDIT_POLICY)
    return (
        f"--audit-policy-file={policy}",
        f"--audit-log-path={log}",
        "--audit-log-format=json",
        "--audit-log-maxsize=500",
        "--audit-log-maxbackup=1",
    )


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")


# --- timelines ------------------------------------------------------------------------------


def pod_mark(etype: str, pod: Obj) -> Obj:
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
    return {
        "t": _now(),
        "event": etype,
        "rv": meta.get("resourceVersion"),
        "phase": status.get("phase"),
        "node": spec.get("nodeName"),
        "gates": [g.get("name") for g in spec.get("schedulingGates") or []],
        "deleting": meta.get("deletionTimestamp"),
        "scheduled": next(
            (
                f"{c.get('status')} {c.get('reason') or ''}".strip()
                for c in status.get("conditions") or []
                if c.get("type") == "PodScheduled"
            ),
            None,
        ),
    }


def alloc_mark(alloc: Obj) -> Obj:
    meta, spec, status = alloc["metadata"], alloc.get("spec", {}), alloc.get("status") or {}
    return {
        "t": _now(),
        "uid": meta.get("uid"),
        "rv": meta.get("resourceVersion"),
        "pod": f"{spec.get('podName')} ({spec.get('podUID')})",
        "node": spec.get("nodeName"),
        "slices": [
            f"{s.get('gpuUUID')}[{s.get('start')}:{s.get('size')}]"
            for s in spec.get("slices") or []
        ],
        "phase": status.get("phase"),
        "message": str(status.get("message") or "")[:200],
        "deleting": meta.get("deletionTimestamp"),
        "finalizers": meta.get("finalizers") or [],
    }


@dataclass
class Timelines:
    """Recent transitions of the chaos pods (by UID) and of every allocation (by key)."""

    pods: dict[str, list[Obj]] = field(default_factory=dict)
    allocs: dict[str, list[Obj]] = field(default_factory=dict)
    _alloc_rv: dict[str, str] = field(default_factory=dict)  # key -> uid/rv last marked
    _gone: dict[str, float] = field(default_factory=dict)  # "pod:uid" / "alloc:key" -> when

    def on_pod(self, etype: str, pod: Obj, now: float) -> None:
        uid = str(pod.get("metadata", {}).get("uid", ""))
        _append(self.pods.setdefault(uid, []), pod_mark(etype, pod))
        if etype == "DELETED":
            self._gone[f"pod:{uid}"] = now
        else:
            self._gone.pop(f"pod:{uid}", None)

    def on_allocations(self, items: Sequence[Obj], now: float) -> None:
        """One sampled list: a mark per allocation that changed, one when one is gone."""
        seen = set()
        for a in items:
            meta = a["metadata"]
            key = f"{meta.get('namespace')}/{meta.get('name')}"
            seen.add(key)
            version = f"{meta.get('uid')}/{meta.get('resourceVersion')}"
            if self._alloc_rv.get(key) != version:
                self._alloc_rv[key] = version
                _append(self.allocs.setdefault(key, []), alloc_mark(a))
            self._gone.pop(f"alloc:{key}", None)
        for key in [k for k in self._alloc_rv if k not in seen]:
            del self._alloc_rv[key]
            _append(self.allocs.setdefault(key, []), {"t": _now(), "gone": True})
            self._gone[f"alloc:{key}"] = now
        self._prune(now)

    def _prune(self, now: float) -> None:
        for mark in [m for m, t in self._gone.items() if now - t > KEEP_GONE_S]:
            del self._gone[mark]
            kind, _, ref = mark.partition(":")
            (self.pods if kind == "pod" else self.allocs).pop(ref, None)


def _append(marks: list[Obj], mark: Obj) -> None:
    marks.append(mark)
    if len(marks) > MARKS_PER_OBJECT:
        del marks[0]


# --- the dossier ----------------------------------------------------------------------------


def _trim_pod(pod: Obj) -> Obj:
    meta, spec = pod.get("metadata", {}), pod.get("spec", {})
    return {
        "name": f"{meta.get('namespace')}/{meta.get('name')}",
        "uid": meta.get("uid"),
        "rv": meta.get("resourceVersion"),
        "claim": (meta.get("annotations") or {}).get(CLAIM_ANNOTATION),
        "labels": meta.get("labels"),
        "owner": [f"{r.get('kind')}/{r.get('name')}" for r in meta.get("ownerReferences") or []],
        "created": meta.get("creationTimestamp"),
        "deleting": meta.get("deletionTimestamp"),
        "node": spec.get("nodeName"),
        "gates": [g.get("name") for g in spec.get("schedulingGates") or []],
        "status": {k: pod.get("status", {}).get(k) for k in ("phase", "conditions", "startTime")},
    }


async def _read(kube: Kube, path: str) -> Obj | str:
    try:
        return await kube.get(path)
    except ApiError as exc:
        return "gone (404)" if exc.not_found else f"read failed: {exc}"


def matching_lines(path: Path, needles: Iterable[str], limit: int = LINES_PER_SOURCE) -> list[str]:
    """The last `limit` lines of a log file that name any of `needles` (shortened)."""
    words = [n for n in needles if n]
    if not words or not path.is_file():
        return []
    out: list[str] = []
    with path.open(errors="replace") as f:
        for line in f:
            if any(w in line for w in words):
                out.append(line.rstrip()[:600])
                if len(out) > 4 * limit:
                    del out[: len(out) - limit]
    return out[-limit:]


def audit_lines(path: Path, needles: Iterable[str], limit: int = LINES_PER_SOURCE) -> list[str]:
    """The audit entries naming any of `needles`, one short line each: time, user, verb,
    object, answer (and a patch body's finalizers when it has them)."""
    out = []
    for line in matching_lines(path, needles, 4 * limit):
        try:
            e = json.loads(line)
        except ValueError:
            continue
        ref = e.get("objectRef") or {}
        what = "/".join(
            x
            for x in (
                ref.get("resource"),
                ref.get("namespace"),
                ref.get("name"),
                ref.get("subresource"),
            )
            if x
        )
        body = e.get("requestObject")
        extra = f" body={json.dumps(body)[:200]}" if body is not None else ""
        out.append(
            f"{e.get('requestReceivedTimestamp')} {(e.get('user') or {}).get('username')} "
            f"{e.get('verb')} {what} -> {(e.get('responseStatus') or {}).get('code')}{extra}"
        )
    return out[-limit:]


async def dossier(
    kube: Kube,
    *,
    violation: str,
    pod_uids: Sequence[str],  # the pods involved
    known_pods: Mapping[str, Obj],  # uid -> the latest pod seen (the soak's informer)
    allocs: Sequence[str],  # namespace/name of the allocations involved
    timelines: Timelines,
    faults: Sequence[Obj] = (),
    logs: Path | None = None,
) -> Obj:
    """Everything known, at the moment of `violation`, about the objects it involves."""
    out: Obj = {"violation": violation, "at": _now(), "pods": {}, "allocations": {}}
    namespaces = {a.split("/", 1)[0] for a in allocs}
    needles = {a.split("/", 1)[1] for a in allocs} | set(pod_uids)
    for uid in pod_uids:
        pod = known_pods.get(uid)
        if pod is None:  # gone already (or never a chaos pod): its timeline says more
            out["pods"][uid] = {
                "fresh": "not in the soak's pod cache",
                "timeline": timelines.pods.get(uid, []),
            }
            continue
        meta = pod.get("metadata", {})
        namespaces.add(str(meta.get("namespace")))
        needles.add(str(meta.get("name")))
        fresh = await _read(kube, core_path("pods", meta.get("namespace"), meta.get("name")))
        out["pods"][uid] = {
            "last_seen": _trim_pod(pod),
            "fresh": _trim_pod(fresh) if isinstance(fresh, dict) else fresh,
            "timeline": timelines.pods.get(uid, []),
        }
    for key in allocs:
        ns, name = key.split("/", 1)
        fresh = await _read(kube, isl_path("sliceallocations", ns, name))
        out["allocations"][key] = {
            "fresh": alloc_mark(fresh) if isinstance(fresh, dict) else fresh,
            "timeline": timelines.allocs.get(key, []),
        }
    events = []
    for ns in sorted(namespaces):
        try:
            items = (await kube.list(core_path("events", ns)))["items"]
        except ApiError as exc:
            events.append(f"events of {ns}: {exc}")
            continue
        for e in items:
            obj = e.get("involvedObject") or {}
            if obj.get("uid") in pod_uids or obj.get("name") in needles:
                when = e.get("lastTimestamp") or e.get("eventTime") or e.get("firstTimestamp")
                events.append(
                    f"{when} {obj.get('kind')}/{obj.get('name')} {e.get('reason')}: "
                    f"{str(e.get('message') or '')[:200]}"
                )
    out["events"] = sorted(events)
    out["faults"] = list(faults)
    if logs is not None:
        words = sorted(needles)
        out["audit"] = await asyncio.to_thread(audit_lines, logs / AUDIT_LOG, words)
        out["logs"] = {
            name: await asyncio.to_thread(matching_lines, logs / f"{name}.log", words)
            for name in ("webhook", "nodeagent")
        }
    return out


AUDIT_LOG = "kube-apiserver-audit.log"
