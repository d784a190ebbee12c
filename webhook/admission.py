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
- in DRA mode (`allocation_mode`, docs/dra.md) the asks are not renamed but removed, kept in
  the annotation `instaslice.io/asks`, and the pod names its ResourceClaim instead
  (`spec.resourceClaims[{name: instaslice, resourceClaimName: <claim>}]`, each asking
  container's `resources.claims` naming its asks' requests; docs/contract.md §8); no
  NVIDIA_VISIBLE_DEVICES is set (the kubelet hands the devices over, from the claim);
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

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from common.constants import (
    ASKS_ANNOTATION,
    CDI_KIND,
    CLAIM_ANNOTATION,
    GATE_NAME,
    MEMORY_SLOTS_RESOURCE,
    NVIDIA_GPU,
    POD_CLAIM_ENTRY,
    SIZE_ANNOTATION_PREFIX,
    WHOLE_GPU_PROFILE,
    AllocationMode,
    BindingMode,
    qualified_cdi_device,
)
from common.draclaim import request_name
from common.placeholders import is_placeholder
from common.podspec import (
    SliceAsk,
    encode_asks,
    holds_uncharged,
    iter_containers,
    slice_requests,
)
from common.quota import admitted_models, slot_charge
from common.sizing import Size, SizeError, parse_size, resolve, unsatisfiable
from webhook.container_checks import DEVICE_MARK, ContainerChecks, esc, is_gpu_key, is_mig_key, show
from webhook.reviews import (
    AdmissionRequest,
    Allowed,
    Denied,
    Obj,
    Patched,
    PatchOp,
    Verdict,
    malformed,
)
from webhook.settings import AdmissionSettings

CDI_ANNOTATION_PREFIX: Final = "cdi.k8s.io/"
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_MAX_PROBLEMS = 20


# Karpenter leaves alone the node of a running pod carrying it (--karpenter-do-not-disrupt).
DO_NOT_DISRUPT: Final = "karpenter.sh/do-not-disrupt"


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
        return malformed(f"namespace {show(namespace)} is not a DNS-1123 label")
    rewrite = _Rewrite(
        pod=pod, meta=meta, namespace=namespace, settings=settings, whole_gpu=whole_gpu
    )
    return rewrite.run(new_claim)


def pod_slice_requests(pod: Mapping[str, Any]) -> list[tuple[str, str, int]]:
    """(container, profile, count) of a rewritten pod, containers then sidecars."""
    return [(a.container, a.profile, a.count) for a in slice_requests(pod)]


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
                is_mig_key(k) or (whole_gpu and is_gpu_key(k)) for k in entries
            ):
                return True
    return False


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
    ops.append({"op": "add", "path": f"{base}/limits/{esc(MEMORY_SLOTS_RESOURCE)}", "value": value})
    if (
        isinstance(resources.get("requests"), dict)
        and MEMORY_SLOTS_RESOURCE in resources["requests"]
    ):
        path = f"{base}/requests/{esc(MEMORY_SLOTS_RESOURCE)}"
        ops.append({"op": "add", "path": path, "value": value})
    return ops


def _claim_ops(spec: Obj, asks: list[SliceAsk], claim: str) -> list[PatchOp]:
    """DRA mode (docs/contract.md §8): the pod names its ResourceClaim (`claim`, made by the
    allocator when it places the pod) in `spec.resourceClaims`, and each asking container
    names the claim's requests of its asks (`common.draclaim.request_name`), so it gets
    exactly its own devices."""
    entry = {"name": POD_CLAIM_ENTRY, "resourceClaimName": claim}
    ops: list[PatchOp] = []
    if isinstance(spec.get("resourceClaims"), list):
        ops.append({"op": "add", "path": "/spec/resourceClaims/-", "value": entry})
    else:
        ops.append({"op": "add", "path": "/spec/resourceClaims", "value": [entry]})
    index = {name: (fld, i, c) for fld, i, c in iter_containers({"spec": spec})
             if isinstance(c, dict) and isinstance(name := c.get("name"), str)}  # fmt: skip
    by_container: dict[str, list[Obj]] = {}
    for n, ask in enumerate(asks):
        refs = by_container.setdefault(ask.container, [])
        refs.append({"name": POD_CLAIM_ENTRY, "request": request_name(n)})
    for name, refs in by_container.items():
        fld, i, c = index[name]
        base = f"/spec/{fld}/{i}/resources"
        resources = c.get("resources")
        if not isinstance(resources, dict):
            ops.append({"op": "add", "path": base, "value": {"claims": refs}})
        elif isinstance(resources.get("claims"), list):
            ops.extend({"op": "add", "path": f"{base}/claims/-", "value": r} for r in refs)
        else:
            ops.append({"op": "add", "path": f"{base}/claims", "value": refs})
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


@dataclass(kw_only=True)
class _Rewrite(ContainerChecks):
    """One pod's validation and patch, built in a single pass over its containers."""

    pod: Obj
    meta: Obj
    namespace: str

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
                f"spec.nodeName: is set to {show(spec['nodeName'])}, but a pod asking for MIG "
                "slices must let InstaSlice choose its node (use a nodeSelector or affinity)",
            )
        for key, value in annotations.items():
            if key.startswith(CDI_ANNOTATION_PREFIX) and DEVICE_MARK in str(value):
                self._problem(
                    f"metadata.annotations[{key}]",
                    f"metadata.annotations[{key}]: names an {CDI_KIND} CDI device, but "
                    "InstaSlice assigns devices per container, never by pod annotation",
                    "FieldValueForbidden",
                )

        sizes = self._sizes(annotations)
        dra = self.settings.allocation_mode is AllocationMode.DRA
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
                    f"{where}.name", f"{where}: name {show(name)} is not a DNS-1123 label"
                )
                continue
            if name in names:
                self._problem(
                    f"{where}.name",
                    f"{where}: container name {show(name)} is used twice",
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
            bind = bool(asks) and self.settings.binding_mode is BindingMode.ENV and not dra
            if self._env(c, fld, i, name, own, device if bind else None) and bind:
                devices.append(device)

        for name in sorted(set(sizes) - names):
            self._problem(
                f"metadata.annotations[{SIZE_ANNOTATION_PREFIX}{name}]",
                f"metadata.annotations[{SIZE_ANNOTATION_PREFIX}{name}]: the pod has no "
                f"container or initContainer named {show(name)}",
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
        claims = spec.get("resourceClaims")
        if (
            dra
            and isinstance(claims, list)
            and any(isinstance(e, dict) and e.get("name") == POD_CLAIM_ENTRY for e in claims)
        ):
            self._problem(
                "spec.resourceClaims",
                f"spec.resourceClaims: the entry name {POD_CLAIM_ENTRY} is InstaSlice's (DRA "
                "mode: it names the pod's slices); rename yours",
                "FieldValueDuplicate",
            )
        if self.causes:
            return self.denied()

        # "add" on an existing member replaces it, so a JSON null in the way is fine too.
        head: list[PatchOp] = []
        ours = {CLAIM_ANNOTATION: claim}
        if dra:
            ours[ASKS_ANNOTATION] = encode_asks(self.asks)
        if self.settings.do_not_disrupt:
            ours[DO_NOT_DISRUPT] = "true"
        if isinstance(self.meta.get("annotations"), dict):
            for key, value in ours.items():
                path = f"/metadata/annotations/{esc(key)}"
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
        claim_ops = _claim_ops(spec, self.asks, claim) if dra else []
        return Patched(
            head + self.ops + slot_ops + claim_ops,
            claim,
            tuple(self.asks),
            tuple(devices),
            tuple(warnings),
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
                self._problem(where, f"{where}: {show(value)} {exc}")
                continue
            models = self.settings.catalog.models
            if all(resolve(m, size) is None for m in models):
                self._problem(where, f"{where}: {unsatisfiable(size, models, 'the catalog')}")
                continue
            if self.settings.allocation_mode is AllocationMode.DRA:
                self._problem(
                    where,
                    f"{where}: size-based requests are not served in DRA mode yet "
                    "(docs/dra.md); ask for nvidia.com/mig-<profile> instead",
                )
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
