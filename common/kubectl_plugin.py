"""`kubectl instaslice` — who holds which MIG slice, drawn per node and GPU.

`kubectl instaslice nodes` draws each GPU's memory slots and which pod holds which;
`kubectl instaslice pods` lists allocations with node, GPU, profile, placement, MIG UUID and
phase (`-n NS` one namespace, which is all a tenant may read; `-A` or nothing: all);
`-o json|yaml` prints the same rows as data; `--context` picks the kubeconfig context;
`kubectl instaslice gather` packs what a bug report needs (common/gather.py);
`kubectl instaslice kueue-config` prints Kueue's resource transformations and one
ResourceFlavor per GPU model, from the catalog (common/quota.py, docs/kueue.md). `nodes` and
`pods` read only MigNodes and SliceAllocations. Rendering is pure (tested without a cluster);
the shell around it fetches two lists.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import string
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from common.allocation import SliceAllocation
from common.catalog import load_catalog
from common.gather import gather, kubectl_runner
from common.kubeapi import ApiError, Kube, Obj, instaslice_path
from common.objects import gpu_out_of_bounds, short_value
from common.quota import kueue_resources, resource_flavors

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
    lines = [
        f"{'NODE':<20} {'GPU':>3}  {'MODEL':<13} {'MIG':<9} {'MODE CHANGE':<11} {'HEALTH':<9} SLOTS"
    ]
    notes: list[str] = []
    for mn in sorted(mignodes, key=lambda o: o["metadata"]["name"]):
        for gpu in mn.get("status", {}).get("gpus", []):
            refused = gpu_out_of_bounds(gpu)
            if refused is not None:  # not drawn: its slots may be 2^60 (docs/security.md)
                lines.append(
                    f"{mn['metadata']['name']:<20} {short_value(gpu.get('index', '?')):>3}  "
                    f"{'?':<13} {'?':<9} {'-':<11} {'REFUSED':<9} |?|"
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
            change = _mode_change(gpu)
            lines.append(
                f"{mn['metadata']['name']:<20} {gpu.get('index', '?'):>3}  "
                f"{gpu.get('model', '?'):<13} {mig:<9} {change:<11} {health:<9} "
                f"|{''.join(cells)}|"
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
        "  . = free   # = instance held by no live allocation (foreign, or awaiting GC)"
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


def render_pods(allocations: Sequence[Obj]) -> str:
    rows = [("NAMESPACE", "POD", "NODE", "GPU", "PROFILE", "PLACEMENT", "MIG UUID", "PHASE")]
    for r in pod_rows(allocations):
        rows.append(
            (
                r["namespace"],
                f"{r['pod']}/{r['container']}",
                r["node"],
                r["gpu"],
                r["profile"],
                r["placement"],
                r["migUUID"],
                r["phase"],
            )
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
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
                        if i.get("claim") not in live
                    ],
                }
            )
    return rows


def dump(rows: Sequence[Any], output: str) -> str:
    if output == "json":
        return json.dumps(list(rows), indent=2)
    return yaml.safe_dump(list(rows), sort_keys=False).rstrip()


async def _fetch(
    kubeconfig: str | None, context: str | None, namespace: str | None
) -> tuple[list[Obj], list[Obj]]:
    async with await Kube.connect(kubeconfig, context=context) as kube:
        allocs = await kube.list(instaslice_path("sliceallocations", namespace))
        nodes = await kube.list(instaslice_path("mignodes")) if namespace is None else {}
    return nodes.get("items", []), allocs.get("items", [])


def _default_kubeconfig() -> str | None:
    env = os.environ.get("KUBECONFIG")
    if env:
        return env.split(os.pathsep)[0]
    home = Path.home() / ".kube" / "config"
    return str(home) if home.exists() else None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kubectl instaslice", description=__doc__)
    parser.add_argument("what", choices=["nodes", "pods", "gather", "kueue-config"])
    parser.add_argument("--kubeconfig", default=None)
    parser.add_argument("--context", default=None, help="kubeconfig context (default: current)")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", default=None, help="pods: only this namespace")
    scope.add_argument(
        "-A", "--all-namespaces", action="store_true", help="pods: every namespace (default)"
    )
    parser.add_argument("-o", "--output", choices=["text", "json", "yaml"], default="text")
    parser.add_argument("--dest", type=Path, default=None, help="gather: the archive to write")
    parser.add_argument("--tail", type=int, default=2000, help="gather: log lines per pod")
    parser.add_argument(
        "--kubectl", default=None, help="gather: the kubectl to run (default: on PATH)"
    )
    parser.add_argument(
        "--slot-accounting",
        action="store_true",
        help="kueue-config: the webhook runs with --slot-accounting (docs/kueue.md)",
    )
    return parser


def kueue_config(slot_accounting: bool) -> str:
    """Kueue's `resources` configuration and one ResourceFlavor per catalog model (YAML)."""
    catalog = load_catalog()
    docs = [
        {"resources": kueue_resources(catalog, slot_accounting=slot_accounting)},
        *resource_flavors(m.name for m in catalog.models),
    ]
    head = (
        "# The first document goes into Kueue's Configuration (config.kueue.x-k8s.io/v1beta2);\n"
        "# the others are ResourceFlavors, one per GPU model (docs/kueue.md).\n"
    )
    return head + yaml.safe_dump_all(docs, sort_keys=False)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.what == "kueue-config":
        print(kueue_config(args.slot_accounting), end="")
        return 0
    kubeconfig = args.kubeconfig or _default_kubeconfig()
    if args.what == "gather":
        kubectl = args.kubectl or shutil.which("kubectl") or shutil.which("oc")
        if kubectl is None:
            print("error: gather needs kubectl (or oc) on PATH, or --kubectl", file=sys.stderr)
            return 1
        run = kubectl_runner(kubectl, args.kubeconfig, args.context)
        print(gather(run, args.dest, tail=args.tail))
        return 0
    namespace = None if args.all_namespaces else args.namespace
    if args.what == "nodes" and namespace is not None:
        print("error: nodes are cluster-wide; -n applies to pods", file=sys.stderr)
        return 2
    try:
        mignodes, allocs = asyncio.run(_fetch(kubeconfig, args.context, namespace))
    except ApiError as exc:
        hint = "" if namespace or exc.status != 403 else " (a tenant: try -n <namespace>)"
        print(f"error: {exc}{hint}", file=sys.stderr)
        return 1
    if args.output != "text":
        rows = gpu_rows(mignodes, allocs) if args.what == "nodes" else pod_rows(allocs)
        print(dump(rows, args.output))
    else:
        print(render_nodes(mignodes, allocs) if args.what == "nodes" else render_pods(allocs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
