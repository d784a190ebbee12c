"""The allocator's ResourceClaims in DRA mode (docs/dra.md, docs/contract.md §8): built here,
read back here.

In DRA mode the durable record of a pod's slices is a `resource.k8s.io/v1` ResourceClaim
instead of a SliceAllocation, but the allocator's model stays the SliceAllocation's
(`common.allocation`): one record type, one lifecycle. So this module translates both ways:

- `claim_for` turns the SliceAllocation the placer decided into the ResourceClaim to create
  (owner = the pod, finalizer `instaslice.io/release`, one request per ask, named as the pod's
  containers name them: `request_name`), and `reserve` into its status: the allocation
  (a result per slice, naming the device of our pool, and the node selector) together with
  `reservedFor` = the pod, the one status update kube-scheduler honours;
- `as_allocation` reads a claim the allocator wrote (it carries the decided SliceAllocation's
  spec in `SLICES_ANNOTATION`) back as that SliceAllocation, `Ready` once allocated and
  reserved: what the lifecycle waits for before it takes the gate off;
- `foreign_devices` reads every other allocated claim of driver `instaslice.io` (users' own,
  allocated by kube-scheduler) as the devices it holds, which the allocator counts as occupied.

Pure: no I/O. The asks of a rewritten pod travel in the pod's `instaslice.io/asks` annotation
(`common.podspec.encode_asks`), since admission took the extended resource away.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from common.constants import (
    DEVICE_CLASS_GPU,
    DEVICE_CLASS_MIG,
    DRA_API_VERSION,
    DRA_DRIVER,
    NODE_LABEL,
    WHOLE_GPU_PROFILE,
)
from common.podspec import SliceAsk

Obj = dict[str, Any]
# On a claim the allocator made: the spec of the SliceAllocation it stands for (JSON).
SLICES_ANNOTATION: Final = "instaslice.io/slices"
READY, PENDING = "Ready", "Pending"


def request_name(index: int) -> str:
    """The claim request of the pod's `index`-th ask (containers' `resources.claims` name it)."""
    return f"slice-{index}"


def device_name(gpu_index: int, profile_id: int | None) -> Callable[[int], str]:
    """start -> the device of our pool: `gpu-<i>-mig-<profileId>-<start>`, `gpu-<i>` whole."""
    if profile_id is None:
        return lambda _start: f"gpu-{gpu_index}"
    return lambda start: f"gpu-{gpu_index}-mig-{profile_id}-{start}"


def parse_device(name: str) -> tuple[int, int | None, int] | None:
    """(GPU index, profile id or None for the whole GPU, start) of one of our devices."""
    parts = name.split("-")
    try:
        if len(parts) == 2 and parts[0] == "gpu":
            return int(parts[1]), None, 0
        if len(parts) == 5 and parts[0] == "gpu" and parts[2] == "mig":
            return int(parts[1]), int(parts[3]), int(parts[4])
    except ValueError:
        return None
    return None


def _request(index: int, ask: SliceAsk) -> Obj:
    whole = ask.profile == WHOLE_GPU_PROFILE
    exactly: Obj = {
        "deviceClassName": DEVICE_CLASS_GPU if whole else DEVICE_CLASS_MIG,
        "allocationMode": "ExactCount",
        "count": ask.count,
    }
    if not whole:
        cel = f'device.attributes["{DRA_DRIVER}"].profile == {json.dumps(ask.profile)}'
        exactly["selectors"] = [{"cel": {"expression": cel}}]
    return {"name": request_name(index), "exactly": exactly}


def claim_for(alloc: Obj, asks: Sequence[SliceAsk]) -> Obj:
    """The ResourceClaim standing for the SliceAllocation `alloc` (common.allocation's body):
    the same name, owner, finalizer and annotations, its spec kept in `SLICES_ANNOTATION`."""
    meta = alloc["metadata"]
    annotations = dict(meta.get("annotations") or {})
    annotations[SLICES_ANNOTATION] = json.dumps(alloc["spec"], separators=(",", ":"))
    return {
        "apiVersion": DRA_API_VERSION,
        "kind": "ResourceClaim",
        "metadata": {
            "name": meta["name"],
            "namespace": meta["namespace"],
            "labels": dict(meta.get("labels") or {}),
            "annotations": annotations,
            "finalizers": list(meta.get("finalizers") or []),
            "ownerReferences": list(meta.get("ownerReferences") or []),
        },
        "spec": {"devices": {"requests": [_request(i, a) for i, a in enumerate(asks)]}},
    }


def reserve(
    claim: Obj, asks: Sequence[SliceAsk], profile_id: Callable[[int, str], int | None]
) -> Obj:
    """`claim` (as created) with its status: the allocation of the slices it stands for and
    `reservedFor` = its pod, written in one update (docs/dra.md). `profile_id(gpu index,
    profile)`: the profile's id on that GPU (None for a whole GPU)."""
    spec = json.loads(claim["metadata"]["annotations"][SLICES_ANNOTATION])
    requests = {(a.container, a.profile): request_name(i) for i, a in enumerate(asks)}
    results = []
    for s in spec["slices"]:
        index, profile = int(s["gpuIndex"]), str(s["profile"])
        pid = None if profile == WHOLE_GPU_PROFILE else profile_id(index, profile)
        results.append(
            {
                "request": requests[(s["container"], profile)],
                "driver": DRA_DRIVER,
                "pool": spec["nodeName"],
                "device": device_name(index, pid)(int(s["start"])),
            }
        )
    node = {"key": "metadata.name", "operator": "In", "values": [spec["nodeName"]]}
    selector = {"nodeSelectorTerms": [{"matchFields": [node]}]}
    out = dict(claim)
    out["status"] = {
        "allocation": {"devices": {"results": results}, "nodeSelector": selector},
        "reservedFor": [{"resource": "pods", "name": spec["podName"], "uid": spec["podUID"]}],
    }
    return out


def _spec(claim: Mapping[str, Any]) -> Obj | None:
    text = ((claim.get("metadata") or {}).get("annotations") or {}).get(SLICES_ANNOTATION)
    try:
        spec = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        return None
    return spec if isinstance(spec, dict) and isinstance(spec.get("slices"), list) else None


def as_allocation(claim: Mapping[str, Any]) -> Obj | None:
    """A claim the allocator made, as the SliceAllocation it stands for (None: not one of
    ours): `Ready` once allocated and reserved for its pod, `Pending` before."""
    spec = _spec(claim)
    if spec is None:
        return None
    meta = dict(claim.get("metadata") or {})
    status = claim.get("status") or {}
    reserved = any(r.get("uid") == spec.get("podUID") for r in status.get("reservedFor") or ())
    allocated = bool((status.get("allocation") or {}).get("devices"))
    labels = dict(meta.get("labels") or {})
    labels.setdefault(NODE_LABEL, str(spec.get("nodeName") or ""))
    meta["labels"] = labels
    return {
        "metadata": meta,
        "spec": spec,
        "status": {"phase": READY if allocated and reserved else PENDING},
    }


def foreign_devices(claim: Mapping[str, Any]) -> tuple[str, tuple[str, ...]]:
    """(pool, devices) an allocated claim not made by the allocator holds of driver
    `instaslice.io`; ("", ()) when none. A pool is named after its node (docs/dra.md)."""
    if _spec(claim) is not None:
        return "", ()
    alloc = (claim.get("status") or {}).get("allocation") or {}
    results = (alloc.get("devices") or {}).get("results") or ()
    ours = [r for r in results if r.get("driver") == DRA_DRIVER]
    if not ours:
        return "", ()
    pool = str(ours[0].get("pool") or "")
    return pool, tuple(str(r.get("device") or "") for r in ours if r.get("pool") == pool)
