"""What `kubectl instaslice nodes` and `pods` print: pure functions of the listed objects.

`render_nodes` draws each GPU's memory slots and which pod holds which; `render_pods` lists one
line per slice; `gpu_rows`/`pod_rows` are the same as data for `-o json|yaml`. `-o wide` adds
columns and `--no-headers` drops the header line, as kubectl's own printers do. No I/O: the
shell (common/kubectl_plugin.py) fetches the two lists, and the demo draws with these too.
"""

from __future__ import annotations

import json
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from common.allocation import SliceAllocation
from common.objects import gpu_out_of_bounds, short_value

Obj = dict[str, Any]
_LETTERS = string.ascii_uppercase + string.ascii_lowercase + string.digits


@dataclass(frozen=True)
class Holder:
    key: str  # namespace/pod
    profile: str
    start: int
    size: int
    phase: str


def _holders_by_gpu(allocations: Sequence[Obj]) -> dict[str, list[Holder]]:
    out: dict[str, list[Holder]] = {}
    for a in map(SliceAllocation.parse, allocations):
        key = f"{a.namespace}/{a.pod_name or '?'}"
        for s in a.slices:
            out.setdefault(s.gpu_uuid, []).append(Holder(key, s.profile, s.start, s.size, a.phase))
    return out


def _gpu_line(node: str, gpu: Obj, cols: tuple[str, str, str, str, str], wide: bool) -> str:
    """NODE GPU [UUID] MODEL MIG MODE-CHANGE HEALTH SLOTS; UUID only with -o wide."""
    model, mig, change, health, slots = cols
    uuid = f"{str(gpu.get('uuid', '?'))[:64]:<40} " if wide else ""
    return (
        f"{node:<20} {short_value(gpu.get('index', '?')):>3}  {uuid}"
        f"{model:<13} {mig:<9} {change:<11} {health:<9} {slots}"
    )


def render_nodes(
    mignodes: Sequence[Obj], allocations: Sequence[Obj], *, wide: bool = False, headers: bool = True
) -> str:
    """One line per GPU: its slots as letters (held by a live allocation), '#' (an instance no
    live allocation holds: not InstaSlice's, or orphaned until the agent's GC), '.' (free).
    `wide` adds each GPU's UUID; `headers=False` drops the header line (the legend stays: the
    letters mean nothing without it)."""
    holders = _holders_by_gpu(allocations)
    live = {a["metadata"].get("name") for a in allocations}
    legend: dict[str, str] = {}
    head = {"index": "GPU", "uuid": "UUID"}
    cols = ("MODEL", "MIG", "MODE CHANGE", "HEALTH", "SLOTS")
    lines = [_gpu_line("NODE", head, cols, wide).rstrip()] if headers else []
    notes: list[str] = []
    for mn in sorted(mignodes, key=lambda o: o["metadata"]["name"]):
        for gpu in mn.get("status", {}).get("gpus", []):
            refused = gpu_out_of_bounds(gpu)
            if refused is not None:  # not drawn: its slots may be 2^60 (docs/security.md)
                lines.append(
                    _gpu_line(mn["metadata"]["name"], gpu, ("?", "?", "-", "REFUSED", "|?|"), wide)
                )
                notes.append(
                    f"  {mn['metadata']['name']} GPU {short_value(gpu.get('index', '?'))}: beyond "
                    f"InstaSlice's bounds, nothing is placed on it: {refused}"
                )
                continue
            slots = max(
                [8]
                + [
                    p["start"] + p["size"]
                    for prof in gpu.get("profiles", [])
                    for p in prof.get("placements", [])
                ]
            )
            cells = ["."] * slots
            for inst in gpu.get("slices", []):
                if inst.get("claim") not in live:
                    mark = "w" if inst.get("warm") else "#"
                    for i in range(inst["start"], min(slots, inst["start"] + inst["size"])):
                        cells[i] = mark
            for h in holders.get(gpu.get("uuid", ""), []):
                label = f"{h.key} {h.profile} [{h.start}:{h.size}] {h.phase}"
                letter = legend.setdefault(label, _LETTERS[len(legend) % len(_LETTERS)])
                for i in range(h.start, min(slots, h.start + h.size)):
                    cells[i] = letter
            mode = gpu.get("migMode", {})
            mig = mode.get("current", "?")
            if mode.get("pending") and mode.get("pending") != mode.get("current"):
                mig += "*"
            health = "ok" if gpu.get("healthy", False) else "UNHEALTHY"
            change = _mode_change(gpu)
            model = str(gpu.get("model", "?"))
            slot_map = f"|{''.join(cells)}|"
            lines.append(
                _gpu_line(mn["metadata"]["name"], gpu, (model, mig, change, health, slot_map), wide)
            )
            failed = gpu.get("modeChange") or {}
            if failed.get("phase") == "Failed":
                notes.append(
                    f"  {mn['metadata']['name']} GPU {gpu.get('index', '?')}: MIG mode change "
                    f"failed, avoided for a back-off: {failed.get('message', '')}"
                )
    if legend:
        lines.append("")
        lines.extend(f"  {letter} = {label}" for label, letter in legend.items())
    lines.append(
        "  . = free   w = warm (made ahead of demand, free to place on)"
        "   # = instance held by no live allocation (foreign, or awaiting GC)"
        "   REFUSED = its MigNode entry lies beyond InstaSlice's bounds (event GpuOutOfBounds)"
    )
    lines.append(
        "  MODE CHANGE: resetless = the agent changes MIG mode on demand; reset = only a GPU "
        "reset does (Ampere: pods wait with NeedsMigModeChange); none = cannot (VM guest)"
    )
    lines.extend(notes)
    return "\n".join(lines)


def _mode_change(gpu: Obj) -> str:
    """The MODE CHANGE column: how the GPU's MIG mode can change, or what a change is doing."""
    phase = (gpu.get("modeChange") or {}).get("phase")
    if phase == "Failed":
        return "FAILED"
    if phase in ("Changing", "Draining", "Resetting"):
        return str(phase).lower()
    return str(gpu.get("modeToggle") or "-")


def pod_rows(allocations: Sequence[Obj]) -> list[dict[str, str]]:
    """One row per slice: what `pods` prints, as data."""
    rows = []
    parsed = sorted(
        map(SliceAllocation.parse, allocations), key=lambda a: (a.namespace, a.pod_name)
    )
    for a in parsed:
        done = a.status_slices
        for i, s in enumerate(a.slices):
            rows.append(
                {
                    "namespace": a.namespace,
                    "pod": a.pod_name or "?",
                    "container": s.container,
                    "node": a.node or "?",
                    "gpu": str(s.gpu_index if s.gpu_index is not None else s.gpu_uuid or "?"),
                    "profile": s.profile,
                    "placement": f"{s.start}:{s.size}",
                    "migUUID": str(done[i].get("migUUID", "-")) if i < len(done) else "-",
                    "phase": a.phase,
                    "claim": a.name,
                }
            )
    return rows


_POD_COLUMNS = (
    ("NAMESPACE", "namespace"),
    ("POD", "pod/container"),
    ("NODE", "node"),
    ("GPU", "gpu"),
    ("PROFILE", "profile"),
    ("PLACEMENT", "placement"),
    ("MIG UUID", "migUUID"),
    ("PHASE", "phase"),
)
_POD_WIDE_COLUMNS = (("CLAIM", "claim"),)


def render_pods(
    allocations: Sequence[Obj],
    *,
    namespace_column: bool = True,
    wide: bool = False,
    headers: bool = True,
) -> str:
    """One line per slice. As `kubectl get` does, the NAMESPACE column shows when more than
    one namespace was asked for (`namespace_column`); `wide` adds the allocation's name."""
    columns = [
        c
        for c in _POD_COLUMNS + (_POD_WIDE_COLUMNS if wide else ())
        if namespace_column or c[1] != "namespace"
    ]
    rows = [tuple(title for title, _ in columns)] if headers else []
    for r in pod_rows(allocations):
        r["pod/container"] = f"{r['pod']}/{r['container']}"
        rows.append(tuple(r[key] for _, key in columns))
    if not rows:
        return ""
    widths = [max(len(r[c]) for r in rows) for c in range(len(columns))]
    return "\n".join(
        "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def gpu_rows(mignodes: Sequence[Obj], allocations: Sequence[Obj]) -> list[dict[str, Any]]:
    """One row per GPU: what `nodes` draws, as data (slices held by live allocations, and
    instances no live allocation holds under `unclaimed`)."""
    holders = _holders_by_gpu(allocations)
    live = {a["metadata"].get("name") for a in allocations}
    rows = []
    for mn in sorted(mignodes, key=lambda o: o["metadata"]["name"]):
        for gpu in mn.get("status", {}).get("gpus", []):
            rows.append(
                {
                    "node": mn["metadata"]["name"],
                    "gpu": gpu.get("index"),
                    "uuid": gpu.get("uuid", ""),
                    "model": gpu.get("model", ""),
                    "migMode": gpu.get("migMode", {}),
                    "healthy": bool(gpu.get("healthy", False)),
                    "refused": gpu_out_of_bounds(gpu),
                    "slices": [
                        {
                            "pod": h.key,
                            "profile": h.profile,
                            "start": h.start,
                            "size": h.size,
                            "phase": h.phase,
                        }
                        for h in holders.get(gpu.get("uuid", ""), [])
                    ],
                    "unclaimed": [
                        {"profile": i.get("profile", ""), "start": i["start"], "size": i["size"]}
                        for i in gpu.get("slices", [])
                        if i.get("claim") not in live and not i.get("warm")
                    ],
                    "warm": [
                        {"profile": i.get("profile", ""), "start": i["start"], "size": i["size"]}
                        for i in gpu.get("slices", [])
                        if i.get("warm")
                    ],
                }
            )
    return rows


def dump(rows: Sequence[Any], output: str) -> str:
    if output == "json":
        return json.dumps(list(rows), indent=2)
    return yaml.safe_dump(list(rows), sort_keys=False).rstrip()
