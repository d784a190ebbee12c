"""Status conditions of InstaSlice's objects, shaped like `metav1.Condition`, and the `Ready`
summary each kind carries (docs/contract.md §3).

Every condition has `type`, `status`, `reason`, `message`, `lastTransitionTime` and
`observedGeneration` (the object's `metadata.generation` the writer acted on), so generic
tooling reads them as it reads a Deployment's: `kubectl wait --for=condition=Ready`, printer
columns, GitOps health checks. `Ready` is a summary of the rest and of the phase; it is never
written on its own: the builders here derive it, so it cannot disagree with what it sums up.

Pure functions of plain data: no clock (callers pass `now`), no I/O. A condition whose status
did not change keeps its `lastTransitionTime`, so rebuilding one from the same facts writes
nothing new (the node agent writes MigNode status on change only).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

Obj = dict[str, Any]
Status = Literal["True", "False", "Unknown"]

READY = "Ready"
# SliceAllocation conditions the node agent writes besides Ready
GPU_HEALTHY = "GPUHealthy"
SLICES_PRESENT = "SlicesPresent"
# MigNode conditions
BASE_CDI_SPEC = "BaseCdiSpecFound"
CONFLICT_FREE = "ConflictFree"
MESSAGE_MAX = 4000  # the SliceAllocation CRD's bound is 4096; MigNode's 32768


def condition(
    type_: str, ok: bool | None, reason: str, message: str, now: str, generation: int = 0
) -> Obj:
    """One condition; `ok` None is `Unknown`. `generation` 0: none observed (left out)."""
    status: Status = "Unknown" if ok is None else "True" if ok else "False"
    out: Obj = {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message[:MESSAGE_MAX],
        "lastTransitionTime": now,
    }
    if generation:
        out["observedGeneration"] = generation
    return out


def with_condition(existing: Sequence[Obj], new: Obj) -> list[Obj]:
    """Upsert `new` by type (sorted by type); an unchanged status keeps its
    lastTransitionTime."""
    out: list[Obj] = []
    for c in existing:
        if c.get("type") == new["type"]:
            if c.get("status") == new["status"] and c.get("lastTransitionTime"):
                new = {**new, "lastTransitionTime": c["lastTransitionTime"]}
            continue
        out.append(c)
    out.append(new)
    return sorted(out, key=lambda c: str(c.get("type")))


def observed(conditions: Sequence[Obj], generation: int, now: str) -> list[Obj]:
    """`conditions` completed to metav1.Condition's shape: each one's `observedGeneration` set
    to `generation` (when known) and a missing reason, message or transition time filled in
    (an older agent's conditions, written before they were required)."""
    out = []
    for c in conditions:
        full = {"reason": "Unknown", "message": "", "lastTransitionTime": now, **c}
        if not full["reason"]:
            full["reason"] = "Unknown"
        if generation:
            full["observedGeneration"] = generation
        out.append(full)
    return out


def _status_of(conditions: Sequence[Obj], type_: str) -> Obj | None:
    return next((c for c in conditions if c.get("type") == type_), None)


# Phase → (Ready, reason) of a SliceAllocation; the phase's message goes with it
_PHASE_READY: Mapping[str, tuple[bool, str]] = {
    "Pending": (False, "Pending"),
    "Creating": (False, "Creating"),
    "Ready": (True, "SlicesCreated"),
    "Releasing": (False, "Releasing"),
    "Failed": (False, "CreateFailed"),
}
# Conditions of a SliceAllocation that, False, make its slices unusable by the pod
_ALLOCATION_BLOCKERS = (SLICES_PRESENT, GPU_HEALTHY)


def allocation_ready(phase: str, message: str, conditions: Sequence[Obj], now: str) -> Obj:
    """The `Ready` summary of a SliceAllocation in `phase`: True only in phase Ready while no
    condition says its slices vanished or its GPU is unhealthy; the reason is the phase's, or
    the blocking condition's."""
    ok, reason = _PHASE_READY.get(phase, (False, phase or "Pending"))
    if ok:
        for type_ in _ALLOCATION_BLOCKERS:
            c = _status_of(conditions, type_)
            if c is not None and c.get("status") == "False":
                why, text = str(c.get("reason") or type_), str(c.get("message") or "")
                return condition(READY, False, why, text, now)
    return condition(READY, ok, reason, message, now)


def allocation_status(
    status: Mapping[str, Any], existing: Sequence[Obj], phase: str, generation: int, now: str
) -> Obj:
    """A SliceAllocation status patch (`status`, the node agent's) with its conditions
    completed: those it carries, or else `existing` (a merge patch replaces the list whole),
    `Ready` derived from the phase it writes (or `phase`, the current one) and the other
    conditions, every one stamped with `generation`."""
    given = status.get("conditions") or existing
    conditions = [c for c in given if c.get("type") != READY]
    old_ready = _status_of(existing, READY)
    write_phase = str(status.get("phase") or phase)
    # the message of a Ready the writer gave (the agent's: which slices, by MIG UUID) is kept,
    # and a write of conditions alone (no phase) keeps the one Ready has
    kept = _status_of(given, READY) or (old_ready if "phase" not in status else None) or {}
    message = str(status.get("message") or kept.get("message") or "")
    ready = allocation_ready(write_phase, message, conditions, now)
    merged = with_condition([*conditions, *([old_ready] if old_ready else [])], ready)
    return {**status, "conditions": observed(merged, generation, now)}


def node_ready(gpus: Sequence[Mapping[str, Any]], conditions: Sequence[Obj], now: str) -> Obj:
    """The `Ready` summary of a MigNode: its agent runs (it wrote this), at least one GPU is
    healthy, and none of the node's findings (ConflictFree, BaseCdiSpecFound) is False; the
    reason of a False is the first finding's, or NoGpus / NoHealthyGpu."""
    for c in sorted(conditions, key=lambda c: str(c.get("type"))):
        if c.get("type") != READY and c.get("status") == "False":
            reason = str(c.get("reason") or c.get("type"))
            return condition(READY, False, reason, str(c.get("message") or ""), now)
    if not gpus:
        return condition(READY, False, "NoGpus", "the node agent found no GPU on this node", now)
    healthy = sum(1 for g in gpus if g.get("healthy"))
    if not healthy:
        return condition(READY, False, "NoHealthyGpu", "every GPU of this node is unhealthy", now)
    return condition(READY, True, "AgentReady", f"{healthy} of {len(gpus)} GPUs healthy", now)
