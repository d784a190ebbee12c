"""The AdmissionReview wire (admission.k8s.io/v1) and the three verdicts of admission.

Typed, so the decision (webhook/admission.py) and the HTTPS shell (webhook/server.py) agree
on one shape: `parse_review` checks the envelope of a decoded body, `response_for` answers a
request with a verdict (a JSON Patch, or a refusal shaped like the API server's own
validation). Nothing here decides anything about a pod.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any, Final, Literal, NotRequired, TypedDict, cast

from common.podspec import SliceAsk

ADMISSION_API_VERSION: Final = "admission.k8s.io/v1"

# --- the wire (admission.k8s.io/v1) ------------------------------------------------------

Obj = dict[str, Any]
Operation = Literal["CREATE", "UPDATE", "DELETE", "CONNECT"]


class GroupVersionKind(TypedDict):
    group: str
    version: str
    kind: str


class UserInfo(TypedDict, total=False):
    username: str
    uid: str
    groups: list[str]
    extra: dict[str, list[str]]


class AdmissionRequest(TypedDict):
    uid: str
    kind: GroupVersionKind
    operation: Operation
    resource: NotRequired[Obj]
    subResource: NotRequired[str]
    name: NotRequired[str]
    namespace: NotRequired[str]
    userInfo: NotRequired[UserInfo]
    object: NotRequired[Obj | None]
    oldObject: NotRequired[Obj | None]
    dryRun: NotRequired[bool]
    options: NotRequired[Obj | None]


class StatusCause(TypedDict):
    """One problem, as the API server's own validation reports it (metav1.StatusCause)."""

    reason: CauseReason
    message: str
    field: str  # the API field path, e.g. spec.containers[0].resources.limits[nvidia.com/gpu]


CauseReason = Literal["FieldValueInvalid", "FieldValueForbidden", "FieldValueDuplicate"]


class StatusDetails(TypedDict, total=False):
    name: str
    kind: str
    causes: list[StatusCause]


class Status(TypedDict, total=False):
    code: int
    reason: str
    message: str
    details: StatusDetails


class AdmissionResponse(TypedDict):
    uid: str
    allowed: bool
    patchType: NotRequired[Literal["JSONPatch"]]
    patch: NotRequired[str]  # base64 of the JSON Patch
    status: NotRequired[Status]
    warnings: NotRequired[list[str]]


class AdmissionReview(TypedDict):
    apiVersion: Literal["admission.k8s.io/v1"]
    kind: Literal["AdmissionReview"]
    request: NotRequired[AdmissionRequest]
    response: NotRequired[AdmissionResponse]


class PatchOp(TypedDict):
    op: Literal["add", "remove", "replace"]
    path: str
    value: NotRequired[Any]


# --- decisions ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Allowed:
    """Admit unchanged; `reason` is for logs and metrics only."""

    reason: str


@dataclass(frozen=True, slots=True)
class Patched:
    """Admit with `patch` applied: the pod now waits for InstaSlice under `claim`."""

    patch: list[PatchOp]
    claim: str
    asks: tuple[SliceAsk, ...]
    devices: tuple[str, ...] = ()  # qualified CDI device names set (env mode)
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Denied:
    """Refuse; `message` names the container, the field and the reason of every problem.

    A refusal of the pod's content is answered like the API server's own validation:
    422 `Invalid`, one `causes` entry (field path, reason, message) per problem, so clients
    and users tell it from an RBAC refusal (403 `Forbidden`, which nothing here means)."""

    message: str
    code: int = 422
    reason: str = "Invalid"
    causes: tuple[StatusCause, ...] = ()
    name: str = ""  # the pod's name (or generateName), for details.name


Verdict = Allowed | Patched | Denied


class MalformedReview(ValueError):
    """A body that is not an AdmissionReview v1 request; `uid` when one could be read."""

    def __init__(self, message: str, uid: str | None = None) -> None:
        super().__init__(message)
        self.uid = uid


def malformed(message: str) -> Denied:
    return Denied(f"malformed AdmissionReview: {message}", code=400, reason="BadRequest")


# --- parsing and answering ---------------------------------------------------------------


def parse_review(doc: object) -> AdmissionRequest:
    """Check the envelope of a decoded AdmissionReview and return its request.

    Only what the decision relies on is checked (uid, kind, operation, namespace, object);
    the pod itself is checked by `review`, field by field.
    """
    if not isinstance(doc, dict):
        raise MalformedReview("the body is not a JSON object")
    request = doc.get("request")
    uid = request.get("uid") if isinstance(request, dict) else None
    uid = uid if isinstance(uid, str) and uid else None
    if doc.get("apiVersion") != ADMISSION_API_VERSION or doc.get("kind") != "AdmissionReview":
        raise MalformedReview(f"expected kind AdmissionReview, {ADMISSION_API_VERSION}", uid)
    if not isinstance(request, dict):
        raise MalformedReview("no request", uid)
    if uid is None:
        raise MalformedReview("request.uid is missing or not a string")
    kind = request.get("kind")
    if not (isinstance(kind, dict) and all(isinstance(kind.get(k), str) for k in GVK_KEYS)):
        raise MalformedReview("request.kind is not a group/version/kind", uid)
    if request.get("operation") not in ("CREATE", "UPDATE", "DELETE", "CONNECT"):
        raise MalformedReview("request.operation is not CREATE, UPDATE, DELETE or CONNECT", uid)
    if not isinstance(request.get("namespace", ""), str):
        raise MalformedReview("request.namespace is not a string", uid)
    if not isinstance(request.get("object"), dict | None):
        raise MalformedReview("request.object is not an object", uid)
    return cast(AdmissionRequest, request)


GVK_KEYS: Final = ("group", "version", "kind")


def response_for(uid: str, decision: Verdict) -> AdmissionReview:
    """The AdmissionReview answering request `uid` with `decision`."""
    resp: AdmissionResponse = {"uid": uid, "allowed": not isinstance(decision, Denied)}
    if isinstance(decision, Patched):
        raw = json.dumps(decision.patch, separators=(",", ":")).encode()
        resp["patchType"] = "JSONPatch"
        resp["patch"] = base64.b64encode(raw).decode("ascii")
        if decision.warnings:
            resp["warnings"] = list(decision.warnings)
    elif isinstance(decision, Denied):
        status: Status = {
            "code": decision.code,
            "reason": decision.reason,
            "message": decision.message,
        }
        if decision.causes:
            status["details"] = {"kind": "Pod", "causes": list(decision.causes)}
            if decision.name:
                status["details"]["name"] = decision.name
        resp["status"] = status
    return {"apiVersion": ADMISSION_API_VERSION, "kind": "AdmissionReview", "response": resp}
