"""`kubectl instaslice` — who holds which MIG slice, drawn per node and GPU.

`kubectl instaslice nodes` draws each GPU's memory slots and which pod holds which;
`kubectl instaslice pods` lists allocations with node, GPU, profile, placement, MIG UUID and
phase. Reads only MigNodes and SliceAllocations, so it works against any cluster running
InstaSlice with read access to those. Rendering is pure (tested without a cluster); the
shell around it fetches two lists.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import string
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from common.allocation import SliceAllocation
from common.kubeapi import ApiError, Kube, Obj, instaslice_path

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


def render_nodes(mignodes: Sequence[Obj], allocations: Sequence[Obj]) -> str:
    """One line per GPU: its slots as letters (held by a live allocation), '#' (an instance no
    live allocation holds: not InstaSlice's, or orphaned until the agent's GC), '.' (free)."""
    holders = _holders_by_gpu(allocations)
    live = {a["metadata"].get("name") for a in allocations}
    legend: dict[str, str] = {}
    lines = [f"{'NODE':<20} {'GPU':>3}  {'MODEL':<13} {'MIG':<9} {'HEALTH':<9} SLOTS"]
    for mn in sorted(mignodes, key=lambda o: o["metadata"]["name"]):
        for gpu in mn.get("status", {}).get("gpus", []):
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
                    for i in range(inst["start"], min(slots, inst["start"] + inst["size"])):
                        cells[i] = "#"
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
            lines.append(
                f"{mn['metadata']['name']:<20} {gpu.get('index', '?'):>3}  "
                f"{gpu.get('model', '?'):<13} {mig:<9} {health:<9} |{''.join(cells)}|"
            )
    if legend:
        lines.append("")
        lines.extend(f"  {letter} = {label}" for label, letter in legend.items())
    lines.append("  . = free   # = instance held by no live allocation (foreign, or awaiting GC)")
    return "\n".join(lines)


def render_pods(allocations: Sequence[Obj]) -> str:
    rows = [("NAMESPACE", "POD", "NODE", "GPU", "PROFILE", "PLACEMENT", "MIG UUID", "PHASE")]
    parsed = sorted(
        map(SliceAllocation.parse, allocations), key=lambda a: (a.namespace, a.pod_name)
    )
    for a in parsed:
        done = a.status_slices
        for i, s in enumerate(a.slices):
            mig = str(done[i].get("migUUID", "-")) if i < len(done) else "-"
            gpu = s.gpu_index if s.gpu_index is not None else s.gpu_uuid or "?"
            rows.append(
                (
                    a.namespace,
                    f"{a.pod_name or '?'}/{s.container}",
                    a.node or "?",
                    str(gpu),
                    s.profile,
                    f"{s.start}:{s.size}",
                    mig,
                    a.phase,
                )
            )
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join(
        "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


async def _fetch(kubeconfig: str | None, namespace: str | None) -> tuple[list[Obj], list[Obj]]:
    async with await Kube.connect(kubeconfig) as kube:
        allocs = await kube.list(instaslice_path("sliceallocations", namespace))
        nodes = await kube.list(instaslice_path("mignodes"))
    return nodes.get("items", []), allocs.get("items", [])


def _default_kubeconfig() -> str | None:
    env = os.environ.get("KUBECONFIG")
    if env:
        return env.split(os.pathsep)[0]
    home = Path.home() / ".kube" / "config"
    return str(home) if home.exists() else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kubectl instaslice", description=__doc__)
    parser.add_argument("--kubeconfig", default=None)
    parser.add_argument("-n", "--namespace", default=None, help="pods: only this namespace")
    parser.add_argument("what", choices=["nodes", "pods"])
    args = parser.parse_args(argv)
    try:
        mignodes, allocs = asyncio.run(
            _fetch(args.kubeconfig or _default_kubeconfig(), args.namespace)
        )
    except ApiError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(render_nodes(mignodes, allocs) if args.what == "nodes" else render_pods(allocs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
