"""ResourceClaims as the node agent sees them in DRA mode: pure (docs/dra.md "On the node").

`parse` reads what a claim's allocation asks of this node (the results of driver
`instaslice.io` in this node's pool), `slices_for` turns the devices into the agent's intent
records (`SliceRecord`, the same as gate mode's, so the same create/destroy steps, checkpoint
and garbage collection serve both), and `decide` is what the claim's worker does next, a pure
function of the claim, its record and whether the kubelet unprepared it:

- carve as soon as the claim is allocated here and reserved for a pod (eagerly: NVML's time
  overlaps binding and image pulls; NodePrepareResources waits for it);
- release when the claim is deallocated, deleted or no longer reserved, or the kubelet
  unprepared it; then, if the claim is being deleted, drop the finalizer `instaslice.io/release`.

`unreported` says whether the claim's `status.devices` still lacks (or, released, still
shows) this node's entries (nodeagent/dra/status.py), which the worker then writes.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from common.constants import DRA_DRIVER, RELEASE_FINALIZER, qualified_cdi_device
from nodeagent.checkpoint import ClaimRecord, SliceRecord
from nodeagent.dra.status import reported
from nodeagent.model import NodeInventory

Obj = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Result:
    request: str
    device: str


@dataclass(frozen=True, slots=True)
class ClaimView:
    uid: str
    namespace: str
    name: str
    ours: tuple[Result, ...]  # the allocation's results of this driver in this node's pool
    reserved: bool  # status.reservedFor names a consumer
    deleting: bool
    has_finalizer: bool
    problem: str = ""  # the allocation names this driver but not (only) this node
    reported: frozenset[str] = frozenset()  # our devices its status.devices shows Ready

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


def _node_selector_names(selector: Mapping[str, Any] | None, node: str) -> bool:
    """Whether an allocation's nodeSelector (if any) admits this node: a term naming nodes
    (`matchFields metadata.name In`) must name it; a term on labels is taken as given (the
    scheduler checked it)."""
    if not selector:
        return True
    for term in selector.get("nodeSelectorTerms") or []:
        for f in term.get("matchFields") or []:
            if f.get("key") == "metadata.name" and f.get("operator") == "In":
                if node in (f.get("values") or []):
                    return True
                break
        else:
            return True
    return False


def parse(obj: Mapping[str, Any], node: str) -> ClaimView:
    meta = obj.get("metadata") or {}
    status = obj.get("status") or {}
    alloc = status.get("allocation") or {}
    results = (alloc.get("devices") or {}).get("results") or []
    ours, problem = [], ""
    for r in results:
        if r.get("driver") != DRA_DRIVER:
            continue
        if r.get("pool") != node:
            problem = f"device {r.get('device')} is in pool {r.get('pool')}, not {node}"
            continue
        ours.append(Result(str(r.get("request") or ""), str(r.get("device") or "")))
    if ours and not _node_selector_names(alloc.get("nodeSelector"), node):
        problem, ours = f"the allocation's nodeSelector does not name node {node}", []
    return ClaimView(
        uid=str(meta.get("uid") or ""),
        namespace=str(meta.get("namespace") or ""),
        name=str(meta.get("name") or ""),
        ours=tuple(ours),
        reserved=bool(status.get("reservedFor")),
        deleting=bool(meta.get("deletionTimestamp")),
        has_finalizer=RELEASE_FINALIZER in (meta.get("finalizers") or []),
        problem=problem,
        reported=reported(obj, node),
    )


def parse_device(name: str) -> tuple[int, int | None, int] | None:
    """(GPU index, profile id or None for the whole GPU, start) of a device name."""
    parts = name.split("-")
    try:
        if len(parts) == 2 and parts[0] == "gpu":
            return int(parts[1]), None, 0
        if len(parts) == 5 and parts[0] == "gpu" and parts[2] == "mig":
            return int(parts[1]), int(parts[3]), int(parts[4])
    except ValueError:
        return None
    return None


def slices_for(view: ClaimView, inv: NodeInventory) -> list[SliceRecord] | str:
    """The intent records of the claim's devices (one slice each, named after its device),
    or why they cannot be made here."""
    out: list[SliceRecord] = []
    for r in view.ours:
        parsed = parse_device(r.device)
        gpu = inv.gpu_by_index(parsed[0]) if parsed else None
        if parsed is None or gpu is None:
            return f"device {r.device}: no such device on this node"
        _, profile_id, start = parsed
        if profile_id is None:
            slots = max((s + n for p in gpu.profiles for s, n in p.placements), default=0)
            out.append(SliceRecord(r.device, "gpu", -1, gpu.uuid, gpu.index, 0, slots, kind="gpu"))
            continue
        p = gpu.profile_by_id(profile_id)
        size = dict(p.placements).get(start) if p is not None else None
        if p is None or size is None:
            return f"device {r.device}: GPU {gpu.index} has no such placement"
        out.append(SliceRecord(r.device, p.name, p.id, gpu.uuid, gpu.index, start, size))
    return out


def cdi_ids(view: ClaimView) -> dict[str, str]:
    """device -> its slice's qualified CDI device, `instaslice.io/mig=<ns>_<claim>_<device>`."""
    return {r.device: qualified_cdi_device(view.namespace, view.name, r.device) for r in view.ours}


class Step(enum.Enum):
    NOTHING = "nothing"
    CARVE = "carve"
    RELEASE = "release"
    DROP_FINALIZER = "drop-finalizer"  # nothing held: only the finalizer of a deleted claim


def made(record: ClaimRecord | None, boot_id: str) -> bool:
    return (
        record is not None
        and record.state == "ready"
        and record.boot_id == boot_id
        and all(s.done for s in record.slices)
    )


def decide(
    view: ClaimView | None, record: ClaimRecord | None, boot_id: str, unprepared: bool
) -> Step:
    wanted = (
        view is not None
        and bool(view.ours)
        and view.reserved
        and not view.deleting
        and not unprepared
    )
    if wanted:
        return Step.NOTHING if made(record, boot_id) else Step.CARVE
    if record is not None:
        return Step.RELEASE
    if view is not None and view.deleting and view.has_finalizer:
        return Step.DROP_FINALIZER
    return Step.NOTHING


def unreported(view: ClaimView | None, record: ClaimRecord | None, boot_id: str) -> bool:
    """Whether the claim's status.devices is not what this node's records say: made slices
    not shown Ready, or entries left of slices no longer held (while it is still allocated
    here; a deallocation clears them itself)."""
    if view is None or not view.ours or view.deleting:
        return False
    if made(record, boot_id):
        return view.reported != {r.device for r in view.ours}
    return record is None and bool(view.reported)
