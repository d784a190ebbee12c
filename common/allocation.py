"""The one SliceAllocation model: parse a watched object, build a new one, read its status.

Every component reads SliceAllocations through `SliceAllocation.parse` and the allocator
writes them through `build_allocation` (docs/style.md §12b: one model per wire object), so the
allocator, the node agent, the device plugin and `kubectl instaslice` cannot drift apart on
what a field means or what an absent status defaults to (`Pending`).

Parsing is lenient (a missing field reads as empty or 0): the CRD schema is the validating
source of truth, and a reader must never crash on an object the API server accepted.
What the wire looks like: `common.objects` (TypedDicts) and docs/protocol.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.constants import API_VERSION, NODE_LABEL, RELEASE_FINALIZER, SLICE_ALLOCATION_KIND
from common.objects import Phase, SliceSpec, node_label_value

Obj = dict[str, Any]


@dataclass(frozen=True, slots=True)
class AllocSlice:
    """One slice of `spec.slices`: a container's profile at a GPU's memory-slot range."""

    container: str
    profile: str
    gpu_uuid: str
    gpu_index: int | None
    start: int
    size: int
    kind: str = "mig"  # mig | gpu (a whole GPU: profile "gpu", its every memory slot)


@dataclass(frozen=True, slots=True)
class SliceAllocation:
    uid: str
    namespace: str
    name: str  # = the pod's claim id
    resource_version: str
    node: str
    pod_name: str
    pod_uid: str
    slices: tuple[AllocSlice, ...]
    deleting: bool
    finalizers: tuple[str, ...]
    phase: str  # Phase value; `Pending` when no status was written yet
    message: str
    boot_id: str
    status_slices: tuple[Obj, ...]
    obj: Obj
    generation: int = 0  # metadata.generation (the spec is immutable: 1 once created)

    @classmethod
    def parse(cls, obj: Obj) -> SliceAllocation:
        meta = obj.get("metadata") or {}
        spec = obj.get("spec") or {}
        status = obj.get("status") or {}
        return cls(
            uid=str(meta.get("uid") or ""),
            namespace=str(meta.get("namespace") or ""),
            name=str(meta.get("name") or ""),
            resource_version=str(meta.get("resourceVersion") or ""),
            node=str(spec.get("nodeName") or (meta.get("labels") or {}).get(NODE_LABEL) or ""),
            pod_name=str(spec.get("podName") or ""),
            pod_uid=str(spec.get("podUID") or ""),
            slices=tuple(_slice(s) for s in spec.get("slices") or ()),
            deleting=bool(meta.get("deletionTimestamp")),
            finalizers=tuple(str(f) for f in meta.get("finalizers") or ()),
            phase=str(status.get("phase") or Phase.PENDING.value),
            message=str(status.get("message") or ""),
            boot_id=str(status.get("bootID") or ""),
            status_slices=tuple(status.get("slices") or ()),
            obj=obj,
            generation=int(meta.get("generation") or 0),
        )

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def has_finalizer(self) -> bool:
        return RELEASE_FINALIZER in self.finalizers

    @property
    def ready(self) -> bool:
        return self.phase == Phase.READY and not self.deleting

    @property
    def failed(self) -> bool:
        return self.phase == Phase.FAILED

    def containers(self) -> list[str]:
        """Slice-asking containers, in spec order, each once."""
        return list(dict.fromkeys(s.container for s in self.slices))


def _slice(s: Obj) -> AllocSlice:
    index = s.get("gpuIndex")
    return AllocSlice(
        container=str(s.get("container") or ""),
        profile=str(s.get("profile") or ""),
        gpu_uuid=str(s.get("gpuUUID") or ""),
        gpu_index=int(index) if isinstance(index, int) else None,
        start=int(s.get("start") or 0),
        size=int(s.get("size") or 1),
        kind=str(s.get("kind") or "mig"),
    )


def drop_release_finalizer(finalizers: list[str], *, test_path: str, test_value: Any) -> list[Obj]:
    """A JSON patch removing the release finalizer from `finalizers`, guarded by a `test` op
    (`test_path` must still hold `test_value`, or the API server refuses the patch with 422):
    a writer that raced us is never overwritten."""
    rest = [f for f in finalizers if f != RELEASE_FINALIZER]
    return [
        {"op": "test", "path": test_path, "value": test_value},
        {"op": "replace", "path": "/metadata/finalizers", "value": rest},
    ]


def build_allocation(
    *, namespace: str, claim: str, pod: Obj, node: str, slices: list[SliceSpec]
) -> Obj:
    """A new SliceAllocation for `pod` (owner reference → GC deletes it with the pod)."""
    meta = pod["metadata"]
    return {
        "apiVersion": API_VERSION,
        "kind": SLICE_ALLOCATION_KIND,
        "metadata": {
            "name": claim,
            "namespace": namespace,
            # a label value has at most 63 characters, a node name up to 253: a longer one
            # is cut and hashed (common.objects.node_label_value), as on the Node itself
            "labels": {NODE_LABEL: node_label_value(node)},
            "finalizers": [RELEASE_FINALIZER],
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": meta["name"],
                    "uid": meta["uid"],
                    "blockOwnerDeletion": False,
                }
            ],
        },
        "spec": {
            "podName": meta["name"],
            "podUID": meta["uid"],
            "nodeName": node,
            "slices": slices,
        },
    }
