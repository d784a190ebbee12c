"""The admission decision (docs/contract.md §1-2): AdmissionReview in, JSON Patch or denial out.

Pure: no I/O, no clock, no randomness of its own (the claim id generator is passed in), so
table-driven tests and hypothesis cover it completely and the HTTPS server stays a thin shell.

What it decides, for a Pod CREATE in an opted-in namespace (the webhook configuration's
namespaceSelector and matchConditions already filtered out everything else):
- a pod with no `nvidia.com/mig-*` (or `instaslice.io/mig-*`) request is allowed unchanged, and
  so is an autoscaler placeholder (`common.placeholders.is_placeholder`: everything InstaSlice
  gives one, not just its label `instaslice.io/scale-up-for`, which the pod policy lets only
  InstaSlice write); a pod that merely carries the label is rewritten (or refused) like any;
- otherwise every MIG request is validated and each problem is reported with the container,
  the field and the reason; with none, the patch renames the resources to
  `instaslice.io/mig-*`, adds the scheduling gate and a fresh claim annotation and, in the
  `env` binding mode, sets each slice-asking container's NVIDIA_VISIBLE_DEVICES to its CDI
  device `instaslice.io/mig=<namespace>_<claim>_<container>`;
- in a namespace that also opted in to whole GPUs (`whole_gpu`), `nvidia.com/gpu: N` is
  validated and rewritten the same way, to `instaslice.io/gpu: N` (the CDI device of such a
  container binds its whole GPUs); a pod asking whole GPUs and MIG slices together is
  refused (not supported).
- an init container that is not a sidecar (`restartPolicy: Always`) may not ask, by profile,
  whole GPU or size: it would hold its slices for the pod's whole life while ResourceQuota,
  the scheduler and Kueue charge the pod only its largest init container's ask
  (docs/contract.md §1). Sidecars ask like app containers (Kubernetes sums them with those).

Size-based asks (`instaslice.io/mig-size.<container>` annotations, common/sizing.py) are
validated here and left on the pod for the allocator, which resolves them per GPU model; the
container gets its CDI device like any other. With `slot_accounting`, every slice-asking
container is given `instaslice.io/memory-slots` (common/quota.py: its profiles' smallest slot
counts; a whole GPU and a size ask at the most slots they can hold on a GPU model the pod's
selectors admit).

Only CREATE is mutated: a pod's resources and env cannot change afterwards, and gate and
claim changes on UPDATE are the cluster-wide ValidatingAdmissionPolicy's business. A CREATE
that already carries InstaSlice's marks (a replayed `--dry-run=server` output, a copy of a
live pod) is normalised rather than stacked: one gate, a *fresh* claim, device names of the
fresh claim. Keeping the old claim would let two pods share one allocation record, and
let a copy name another pod's device.
"""

from __future__ import annotations

import base64
import difflib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, NotRequired, TypedDict, cast

from common.constants import (
    CDI_KIND,
    CLAIM_ANNOTATION,
    GATE_NAME,
    INSTASLICE_GPU,
    INSTASLICE_MIG_PREFIX,
    MEMORY_SLOTS_RESOURCE,
    NVIDIA_GPU,
    NVIDIA_MIG_PREFIX,
    SIZE_ANNOTATION_PREFIX,
    VISIBLE_DEVICES_ENV,
    WHOLE_GPU_PROFILE,
    BindingMode,
    qualified_cdi_device,
)
from common.placeholders import is_placeholder
from common.podspec import (
    SliceAsk,
    holds_uncharged,
    iter_containers,
    parse_count,
    slice_requests,
)
from common.profiles import ProfileNameError, profile_from_suffix
from common.quota import admitted_models, slot_charge
from common.sizing import Size, SizeError, parse_size, resolve, unsatisfiable
from webhook.settings import AdmissionSettings

ADMISSION_API_VERSION: Final = "admission.k8s.io/v1"
CDI_ANNOTATION_PREFIX: Final = "cdi.k8s.io/"
_DEVICE_MARK: Final = CDI_KIND + "="
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_MAX_PROBLEMS = 20

# --- the wire (admission.k8s.io/v1) ------------------------------------------------------

Obj = dict[str, Any]
Operation = Literal["CREATE", "UPDATE", "DELETE", "CONNECT"]

# Karpenter leaves alone the node of a running pod carrying it (--karpenter-do-not-disrupt).
DO_NOT_DISRUPT: Final = "karpenter.sh/do-not-disrupt"


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


# --- the decision ------------------------------------------------------------------------


def review(
    request: AdmissionRequest,
    settings: AdmissionSettings,
    *,
    new_claim: Callable[[], str],
    whole_gpu: bool = False,
) -> Verdict:
    """Decide one review (see the module docstring). `whole_gpu`: the pod's namespace also
    carries `instaslice.io/whole-gpu: "true"` (the webhook configuration sends such
    namespaces' pods to their own path), so `nvidia.com/gpu` asks are whole GPUs too."""
    kind = request["kind"]
    if (kind["group"], kind["version"], kind["kind"]) != ("", "v1", "Pod"):
        return Allowed("not a v1 Pod")
    if request.get("subResource"):
        return Allowed("a subresource")
    if request["operation"] != "CREATE":
        return Allowed("only CREATE is mutated")
    pod = request.get("object")
    if not isinstance(pod, dict):
        return malformed("request.object is missing")
    if not _asks_for_mig(pod, whole_gpu):
        return Allowed("no MIG request")
    meta = pod.get("metadata")
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        return malformed("object.metadata is not an object")
    if is_placeholder(pod):
        # Known by all InstaSlice gives one, not by its label, which the pod policy refuses
        # to anyone but InstaSlice; it gets no device (docs/autoscaling.md).
        return Allowed("an autoscaler placeholder (docs/autoscaling.md)")
    namespace = request.get("namespace") or meta.get("namespace")
    if not (isinstance(namespace, str) and _DNS_LABEL.match(namespace)):
        return malformed(f"namespace {_show(namespace)} is not a DNS-1123 label")
    return _Rewrite(pod, meta, namespace, settings, whole_gpu).run(new_claim)


def pod_slice_requests(pod: Mapping[str, Any]) -> list[tuple[str, str, int]]:
    """(container, profile, count) of a rewritten pod, containers then sidecars."""
    return [(a.container, a.profile, a.count) for a in slice_requests(pod)]


def _is_mig_key(key: object) -> bool:
    return isinstance(key, str) and key.startswith((NVIDIA_MIG_PREFIX, INSTASLICE_MIG_PREFIX))


def _is_gpu_key(key: object) -> bool:
    return key in (NVIDIA_GPU, INSTASLICE_GPU)


def _asks_for_mig(pod: Obj, whole_gpu: bool = False) -> bool:
    """Any MIG ask (a size annotation, or a key in limits or requests) or, with `whole_gpu`,
    any whole-GPU ask."""
    meta = pod.get("metadata")
    annotations = meta.get("annotations") if isinstance(meta, dict) else None
    if isinstance(annotations, dict) and any(
        isinstance(k, str) and k.startswith(SIZE_ANNOTATION_PREFIX) for k in annotations
    ):
        return True
    for _, _, c in iter_containers(pod):
        resources = c.get("resources") if isinstance(c, dict) else None
        if not isinstance(resources, dict):
            continue
        for section in ("limits", "requests"):
            entries = resources.get(section)
            if isinstance(entries, dict) and any(
                _is_mig_key(k) or (whole_gpu and _is_gpu_key(k)) for k in entries
            ):
                return True
    return False


_MAX_LISTED = 40


def _unknown(profile: str, settings: AdmissionSettings, *, listing: bool) -> str:
    """Why `profile` is refused, the closest offered names, and (`listing`: once per review,
    so many typos do not repeat it) every profile that may be asked for."""
    cluster = settings.cluster_profiles
    offered = sorted(cluster or settings.known_profiles)
    close = difflib.get_close_matches(profile, offered, n=3, cutoff=0.6)
    text = (
        f"unknown MIG profile {profile}: no GPU model in the catalog offers it and no node "
        "published it" + (f" (did you mean {' or '.join(close)}?)" if close else "")
    )
    if not listing:
        return text
    listed = ", ".join(offered[:_MAX_LISTED]) + (", …" if len(offered) > _MAX_LISTED else "")
    if cluster:
        return f"{text}. The cluster's GPUs offer: {listed}"
    return f"{text}. No node has published its GPUs yet, the catalog offers: {listed}"


def _show(value: object, limit: int = 64) -> str:
    """A value for a message: JSON, truncated (hostile input must not bloat the answer)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _uncharged(where: str, name: str, *, why: bool) -> str:
    """Why an init container that is not a sidecar may not ask (`why`: the reason and the
    remedy, once per review, so several asks do not repeat it)."""
    text = f"{where}: init container {_show(name)} is not a sidecar, so it may not ask for slices"
    if not why:
        return text
    return (
        f"{text}. InstaSlice gives every container its own slices for the pod's whole life, "
        "but ResourceQuota, the scheduler and Kueue charge a pod only its largest init "
        "container's ask (init containers run one after another), so these slices would be "
        "held uncharged. Move the ask to an app container (spec.containers), or make this "
        "init container a sidecar (restartPolicy: Always), which Kubernetes counts with the "
        "app containers"
    )


def _slot_ops(fld: str, i: int, c: Obj, slots: int) -> list[PatchOp]:
    """Set `instaslice.io/memory-slots` in one container's limits (requests default to them)."""
    base = f"/spec/{fld}/{i}/resources"
    value = str(slots)
    resources = c.get("resources")
    if not isinstance(resources, dict):
        return [{"op": "add", "path": base, "value": {"limits": {MEMORY_SLOTS_RESOURCE: value}}}]
    ops: list[PatchOp] = []
    if not isinstance(resources.get("limits"), dict):
        ops.append({"op": "add", "path": f"{base}/limits", "value": {}})
    ops.append(
        {"op": "add", "path": f"{base}/limits/{_esc(MEMORY_SLOTS_RESOURCE)}", "value": value}
    )
    if (
        isinstance(resources.get("requests"), dict)
        and MEMORY_SLOTS_RESOURCE in resources["requests"]
    ):
        path = f"{base}/requests/{_esc(MEMORY_SLOTS_RESOURCE)}"
        ops.append({"op": "add", "path": path, "value": value})
    return ops


def _without_field(message: str, path: str) -> str:
    """`message` less the field `path` names: a leading `<path or a parent of it>: `, or the
    container-relative `: resources.limits[k]: ` after the container's name."""
    head, sep, rest = message.partition(": ")
    if sep and path.startswith(head):
        return rest
    _, dot, relative = path.partition("].")
    if dot and f": {relative}: " in message:
        return message.replace(f": {relative}: ", ": ", 1)
    return message


def _esc(token: str) -> str:
    """One JSON Pointer reference token (RFC 6901): `~` → `~0`, `/` → `~1`."""
    return token.replace("~", "~0").replace("/", "~1")


@dataclass
class _Rewrite:
    """One pod's validation and patch, built in a single pass over its containers."""

    pod: Obj
    meta: Obj
    namespace: str
    settings: AdmissionSettings
    whole_gpu: bool = False
    causes: list[StatusCause] = field(default_factory=list)  # one per problem found
    ops: list[PatchOp] = field(default_factory=list)
    asks: list[SliceAsk] = field(default_factory=list)

    def _problem(self, path: str, message: str, reason: CauseReason = "FieldValueInvalid") -> None:
        """Report one problem: `message` for the denial's text, `path` (the API field path)
        and `reason` for its cause."""
        self.causes.append({"reason": reason, "message": message, "field": path})

    def denied(self) -> Denied:
        """The denial of every problem found (at most `_MAX_PROBLEMS` listed). Its causes'
        messages leave out the field the cause names already: `kubectl` prints each cause as
        `<field>: <message>`, and the denial's message keeps the full text."""
        listed = self.causes[:_MAX_PROBLEMS]
        shown = [c["message"] for c in listed]
        if len(self.causes) > _MAX_PROBLEMS:
            shown.append(f"and {len(self.causes) - _MAX_PROBLEMS} more problems")
        name = self.meta.get("name") or self.meta.get("generateName")
        return Denied(
            "; ".join(shown),
            causes=tuple(
                {**c, "message": _without_field(c["message"], c["field"])} for c in listed
            ),
            name=name if isinstance(name, str) else "",
        )

    def run(self, new_claim: Callable[[], str]) -> Verdict:
        spec = self.pod.get("spec")
        if not isinstance(spec, dict):  # a size annotation on a pod without a spec
            return malformed("object.spec is not an object")
        annotations = self.meta.get("annotations")
        if annotations is not None and not isinstance(annotations, dict):
            return malformed("object.metadata.annotations is not an object")
        annotations = annotations or {}
        old_claim = annotations.get(CLAIM_ANNOTATION)
        old_claim = old_claim if isinstance(old_claim, str) else None
        gates = spec.get("schedulingGates")
        if gates is not None and not isinstance(gates, list):
            return malformed("object.spec.schedulingGates is not a list")
        gated = any(isinstance(g, dict) and g.get("name") == GATE_NAME for g in gates or [])

        if spec.get("nodeName"):
            self._problem(
                "spec.nodeName",
                f"spec.nodeName: is set to {_show(spec['nodeName'])}, but a pod asking for MIG "
                "slices must let InstaSlice choose its node (use a nodeSelector or affinity)",
            )
        for key, value in annotations.items():
            if key.startswith(CDI_ANNOTATION_PREFIX) and _DEVICE_MARK in str(value):
                self._problem(
                    f"metadata.annotations[{key}]",
                    f"metadata.annotations[{key}]: names an {CDI_KIND} CDI device, but "
                    "InstaSlice assigns devices per container, never by pod annotation",
                    "FieldValueForbidden",
                )

        sizes = self._sizes(annotations)
        claim = new_claim()
        devices: list[str] = []
        names: set[str] = set()
        charges: list[tuple[str, int, Obj, int]] = []  # (field, index, container, slots)
        for fld, i, c in iter_containers(self.pod):
            where = f"spec.{fld}[{i}]"
            if not isinstance(c, dict):
                self._problem(where, f"{where}: is not a container object")
                continue
            name = c.get("name")
            if not isinstance(name, str) or not _DNS_LABEL.match(name):
                self._problem(
                    f"{where}.name", f"{where}: name {_show(name)} is not a DNS-1123 label"
                )
                continue
            if name in names:
                self._problem(
                    f"{where}.name",
                    f"{where}: container name {_show(name)} is used twice",
                    "FieldValueDuplicate",
                )
                continue
            names.add(name)
            before = len(self.asks)
            held = holds_uncharged(fld, c)
            asks = self._resources(c, fld, i, name, held) or name in sizes
            if held and name in sizes:
                key = f"{SIZE_ANNOTATION_PREFIX}{name}"
                self._refuse_uncharged(f"metadata.annotations[{key}]", name, f" ({where})")
            if asks and self.settings.slot_accounting:
                charges.append((fld, i, c, self._slots(self.asks[before:], sizes.get(name))))
            own = qualified_cdi_device(self.namespace, old_claim, name) if old_claim else None
            device = qualified_cdi_device(self.namespace, claim, name)
            bind = bool(asks) and self.settings.binding_mode is BindingMode.ENV
            if self._env(c, fld, i, name, own, device if bind else None) and bind:
                devices.append(device)

        for name in sorted(set(sizes) - names):
            self._problem(
                f"metadata.annotations[{SIZE_ANNOTATION_PREFIX}{name}]",
                f"metadata.annotations[{SIZE_ANNOTATION_PREFIX}{name}]: the pod has no "
                f"container or initContainer named {_show(name)}",
            )
        profiles = {a.profile for a in self.asks}
        if WHOLE_GPU_PROFILE in profiles and (len(profiles) > 1 or sizes):
            mig = sorted(profiles - {WHOLE_GPU_PROFILE}) + [
                f"by size for {n}" for n in sorted(sizes)
            ]
            self._problem(
                "spec.containers",
                f"resources: the pod asks for whole GPUs ({NVIDIA_GPU}) and MIG slices "
                f"({', '.join(mig)}) together; a pod gets either, not both (not supported)",
                "FieldValueForbidden",
            )
        if self.causes:
            return self.denied()

        # "add" on an existing member replaces it, so a JSON null in the way is fine too.
        head: list[PatchOp] = []
        ours = {CLAIM_ANNOTATION: claim}
        if self.settings.do_not_disrupt:
            ours[DO_NOT_DISRUPT] = "true"
        if isinstance(self.meta.get("annotations"), dict):
            for key, value in ours.items():
                path = f"/metadata/annotations/{_esc(key)}"
                head.append({"op": "add", "path": path, "value": value})
        else:
            if not isinstance(self.pod.get("metadata"), dict):
                head.append({"op": "add", "path": "/metadata", "value": {}})
            head.append({"op": "add", "path": "/metadata/annotations", "value": ours})
        if not gated:
            gate = {"name": GATE_NAME}
            if gates is None:
                head.append({"op": "add", "path": "/spec/schedulingGates", "value": [gate]})
            else:
                head.append({"op": "add", "path": "/spec/schedulingGates/-", "value": gate})
        warnings: list[str] = []
        if old_claim is not None or gated:
            warnings.append(
                f"the pod already carried InstaSlice's claim or gate, so it gets the fresh claim "
                f"{claim} (claims are never reused)"
            )
        slot_ops = [op for fld, i, c, n in charges for op in _slot_ops(fld, i, c, n)]
        return Patched(
            head + self.ops + slot_ops, claim, tuple(self.asks), tuple(devices), tuple(warnings)
        )

    def _sizes(self, annotations: Obj) -> dict[str, Size]:
        """The size asks by container name; each bad one is a problem naming its annotation."""
        sizes: dict[str, Size] = {}
        for key, value in annotations.items():
            if not (isinstance(key, str) and key.startswith(SIZE_ANNOTATION_PREFIX)):
                continue
            where = f"metadata.annotations[{key}]"
            try:
                size = parse_size(value, max_count=self.settings.max_count)
            except SizeError as exc:
                self._problem(where, f"{where}: {_show(value)} {exc}")
                continue
            models = self.settings.catalog.models
            if all(resolve(m, size) is None for m in models):
                self._problem(where, f"{where}: {unsatisfiable(size, models, 'the catalog')}")
                continue
            if self.settings.binding_mode is not BindingMode.ENV:
                self._problem(
                    where,
                    f"{where}: size-based requests need the env binding mode (this webhook runs "
                    f"with {self.settings.binding_mode}); ask for nvidia.com/mig-<profile> instead",
                )
                continue
            sizes[key[len(SIZE_ANNOTATION_PREFIX) :]] = size
        return sizes

    def _slots(self, asks: list[SliceAsk], size: Size | None) -> int:
        """The memory slots one container is charged (common/quota.py: a whole GPU or a size
        at the most it can hold on a model the pod's selectors admit)."""
        catalog = self.settings.catalog
        models = admitted_models(catalog, self.pod.get("spec") or {})
        return slot_charge(catalog, ((a.profile, a.count) for a in asks), size, models)

    def _refuse_uncharged(self, path: str, name: str, also: str = "") -> None:
        """Refuse a non-sidecar init container's ask at `path` (`also`: more of where)."""
        why = not any("held uncharged" in c["message"] for c in self.causes)
        self._problem(path, _uncharged(path + also, name, why=why), "FieldValueForbidden")

    def _resources(self, c: Obj, fld: str, i: int, name: str, held: bool) -> bool:
        """Validate one container's MIG resources and queue their renames; True if it asks.
        `held`: a non-sidecar init container, whose every ask is refused (`_uncharged`)."""
        resources = c.get("resources")
        if resources is None:
            return False
        where = f"container {_show(name)}"
        at = f"spec.{fld}[{i}].resources"  # the API field path
        if not isinstance(resources, dict):
            self._problem(at, f"{where}: resources is not an object")
            return False
        sections: dict[str, dict[str, Any]] = {}
        for section in ("limits", "requests"):
            entries = resources.get(section)
            if entries is None:
                entries = {}
            if not isinstance(entries, dict):
                self._problem(f"{at}.{section}", f"{where}: resources.{section} is not an object")
                return False
            sections[section] = entries
        limits, requests = sections["limits"], sections["requests"]
        if held:  # instaslice.io/gpu with or without the opt-in: the pod policy refuses it too
            keys = [
                (section, key)
                for section, entries in sections.items()
                for key in entries
                if _is_mig_key(key)
                or key == INSTASLICE_GPU
                or (self.whole_gpu and key == NVIDIA_GPU)
            ]
            for section, key in keys:
                if section == "limits" or key not in limits:
                    where = f"spec.{fld}[{i}].resources.{section}[{key}]"
                    self._refuse_uncharged(where, name)
            return bool(keys)
        base = f"/spec/{fld}/{i}/resources"
        seen: dict[str, str] = {}
        asked = False
        for key, value in limits.items():
            if not _is_mig_key(key):
                continue
            asked = True
            field_ = f"resources.limits[{key}]"
            nvidia = key.startswith(NVIDIA_MIG_PREFIX)
            prefix = NVIDIA_MIG_PREFIX if nvidia else INSTASLICE_MIG_PREFIX
            suffix = key[len(prefix) :]
            try:
                profile = profile_from_suffix(suffix)
            except ProfileNameError:
                self._problem(
                    f"{at}.limits[{key}]",
                    f"{where}: {field_}: {_show(suffix)} is not a MIG profile "
                    "(e.g. nvidia.com/mig-1g.18gb, nvidia.com/mig-1g.18gb.me for 1g.18gb+me)",
                )
                continue
            if profile not in self.settings.known_profiles:
                listing = not any("unknown MIG profile" in c["message"] for c in self.causes)
                text = _unknown(profile, self.settings, listing=listing)
                self._problem(f"{at}.limits[{key}]", f"{where}: {field_}: {text}")
                continue
            if profile in seen:
                self._problem(
                    f"{at}.limits[{key}]",
                    f"{where}: {field_}: profile {profile} is also asked as {seen[profile]}",
                    "FieldValueDuplicate",
                )
                continue
            seen[profile] = key
            count = self._count(where, field_, value, at)
            if key in requests and requests[key] != value:
                self._problem(
                    f"{at}.requests[{key}]",
                    f"{where}: resources.requests[{key}]: {_show(requests[key])} differs from "
                    f"the limit {_show(value)} (requests, if given, must equal limits)",
                )
                continue
            if count is None:
                continue
            self.asks.append(SliceAsk(name, profile, count))
            if nvidia:
                new_key = INSTASLICE_MIG_PREFIX + suffix
                for section, entries in (("limits", limits), ("requests", requests)):
                    if key in entries:
                        self.ops.append({"op": "remove", "path": f"{base}/{section}/{_esc(key)}"})
                        self.ops.append(
                            {"op": "add", "path": f"{base}/{section}/{_esc(new_key)}",
                             "value": entries[key]}
                        )  # fmt: skip
        if self.whole_gpu:
            asked = self._whole(where, name, (at, base), limits, requests) or asked
        for key in requests:
            if _is_mig_key(key) and key not in limits:
                asked = True
                self._problem(
                    f"{at}.requests[{key}]",
                    f"{where}: resources.requests[{key}]: a MIG resource in requests must "
                    "also be in limits, with the same count",
                )
        return asked

    def _whole(
        self, where: str, name: str, paths: tuple[str, str], limits: Obj, requests: Obj
    ) -> bool:
        """Whole-GPU asks (`nvidia.com/gpu`, or `instaslice.io/gpu` already): validate, queue
        the rename; True if the container asks. `paths`: the resources' API field path and
        JSON Pointer."""
        at, base = paths
        keys = [k for k in (NVIDIA_GPU, INSTASLICE_GPU) if k in limits or k in requests]
        if not keys:
            return False
        if len(keys) > 1:
            self._problem(f"{at}.limits", f"{where}: asks for whole GPUs as both {NVIDIA_GPU} "
                          f"and {INSTASLICE_GPU}", "FieldValueDuplicate")  # fmt: skip
            return True
        key = keys[0]
        if key not in limits:
            self._problem(
                f"{at}.requests[{key}]",
                f"{where}: resources.requests[{key}]: a GPU request must also be in limits, "
                "with the same count",
            )
            return True
        value = limits[key]
        count = self._count(where, f"resources.limits[{key}]", value, at)
        if key in requests and requests[key] != value:
            self._problem(
                f"{at}.requests[{key}]",
                f"{where}: resources.requests[{key}]: {_show(requests[key])} differs from the "
                f"limit {_show(value)} (requests, if given, must equal limits)",
            )
            return True
        if count is None:
            return True
        self.asks.append(SliceAsk(name, WHOLE_GPU_PROFILE, count))
        if key == NVIDIA_GPU:
            new_key = _esc(INSTASLICE_GPU)
            for section, entries in (("limits", limits), ("requests", requests)):
                if key in entries:
                    self.ops.append({"op": "remove", "path": f"{base}/{section}/{_esc(key)}"})
                    self.ops.append(
                        {"op": "add", "path": f"{base}/{section}/{new_key}", "value": entries[key]}
                    )
        return True

    def _count(self, where: str, field_: str, value: object, at: str) -> int | None:
        """The count of one ask (`field_` of `where`, under the API field path `at`)."""
        path = f"{at}{field_.removeprefix('resources')}"
        count = parse_count(value)
        if count is None:
            self._problem(
                path, f"{where}: {field_}: count {_show(value)} is not a positive integer"
            )
        elif count > self.settings.max_count:
            self._problem(
                path,
                f"{where}: {field_}: count {count} exceeds the limit of "
                f"{self.settings.max_count} slices of one profile per container",
            )
            return None
        return count

    def _env(
        self, c: Obj, fld: str, i: int, name: str, own: str | None, device: str | None
    ) -> bool:
        """Check one container's env and queue the NVIDIA_VISIBLE_DEVICES op.

        `own`: the device this container had under the pod's old claim (a replay); entries
        naming exactly it are InstaSlice's own and are dropped. `device`: the value to set
        (env mode, slice-asking container), else None. True if the op was queued.
        """
        env = c.get("env")
        where = f"container {_show(name)}"
        at = f"spec.{fld}[{i}].env"  # the API field path
        if env is not None and not isinstance(env, list):
            self._problem(at, f"{where}: env is not a list")
            return False
        kept: list[Any] = []
        dropped = False
        ok = True
        for j, e in enumerate(env or []):
            if not isinstance(e, dict):
                self._problem(f"{at}[{j}]", f"{where}: env[{j}] is not an object")
                ok = False
                continue
            var, value = e.get("name"), e.get("value")
            if own is not None and var == VISIBLE_DEVICES_ENV and value == own:
                dropped = True  # InstaSlice's own entry of a replayed pod
                continue
            kept.append(e)
            if var == VISIBLE_DEVICES_ENV:
                how = "valueFrom" if "valueFrom" in e else "value"
                self._problem(
                    f"{at}[{j}]",
                    f"{where}: env[{j}] {VISIBLE_DEVICES_ENV} ({how}): containers may not set "
                    "it in a pod asking for MIG slices, InstaSlice assigns each container its "
                    f"slice devices; remove this env entry (InstaSlice sets {VISIBLE_DEVICES_ENV} "
                    "itself)",
                    "FieldValueForbidden",
                )
                ok = False
            elif isinstance(value, str) and _DEVICE_MARK in value:
                self._problem(
                    f"{at}[{j}]",
                    f"{where}: env[{j}] {_show(var)}: names an {CDI_KIND} CDI device itself, but "
                    "only InstaSlice assigns those",
                    "FieldValueForbidden",
                )
                ok = False
        if not ok:
            return False
        path = f"/spec/{fld}/{i}/env"
        entry = {"name": VISIBLE_DEVICES_ENV, "value": device}
        if dropped:
            value = [*kept, entry] if device else kept
            self.ops.append({"op": "replace", "path": path, "value": value})
        elif device is None:
            return False
        elif env is None:
            self.ops.append({"op": "add", "path": path, "value": [entry]})
        else:
            self.ops.append({"op": "add", "path": f"{path}/-", "value": entry})
        return device is not None
