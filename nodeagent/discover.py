"""`instaslice-nodeagent --discover-only`: print what the agent finds, change nothing.

The NVML module is wrapped in `nvml.ReadOnly`, which refuses every function outside
`READ_ONLY_CALLS`, so this path cannot create, destroy or reconfigure anything even by a
bug; it talks to no API server and writes no file. Output: a report per GPU (model and its
catalog match, MIG mode, architecture and how its MIG mode can change — `modeToggle`, from
the architecture: a VM guest that refuses a reset-less change is only found out by trying,
which this path never does — compute processes, profiles with ids, counts and placements,
existing instances), as text or JSON.
"""

from __future__ import annotations

import json
from typing import Any

from common.catalog import Catalog
from nodeagent.model import GpuInfo, Instance, NodeInventory
from nodeagent.modes import toggle
from nodeagent.nvml import NvmlModule, NvmlSession, ReadOnly

Obj = dict[str, Any]
_TOGGLE_TEXT = {
    "resetless": "on demand, without a reset, while the GPU is idle",
    "reset": "only with a GPU reset; never for a pod",
    "none": "not by InstaSlice",
}


def discover(nv: NvmlModule, catalog: Catalog) -> NodeInventory:
    session = NvmlSession(ReadOnly(nv), catalog)
    session.open()
    try:
        return session.inventory()
    finally:
        session.close()


def _instance(inst: Instance, gpu: GpuInfo) -> Obj:
    prof = gpu.profile_by_id(inst.profile_id)
    return {
        "giID": inst.gi_id,
        "profile": prof.name if prof else f"id{inst.profile_id}",
        "profileID": inst.profile_id,
        "placement": f"{inst.start}:{inst.size}",
        "ciIDs": list(inst.ci_ids),
        "migUUIDs": list(inst.mig_uuids),
    }


def report(node: str, inv: NodeInventory, catalog: Catalog) -> Obj:
    gpus = []
    for g in inv.gpus:
        known = catalog.model(g.model)
        gpus.append(
            {
                "index": g.index,
                "uuid": g.uuid,
                "name": g.name,
                "pciDeviceId": f"{g.pci_device_id:#010X}".replace("0X", "0x"),
                "minor": g.minor,
                "memoryMiB": g.memory_total_mib,
                "lost": g.index in inv.lost,
                "migMode": {"current": g.mig_current, "pending": g.mig_pending},
                "architecture": g.architecture or None,
                "modeToggle": toggle(g),
                "computeProcesses": g.compute_processes,
                "catalog": {
                    "model": known.name if known else None,
                    "matches": known is not None and not g.warnings,
                    "differences": list(g.warnings),
                },
                "profiles": [
                    {
                        "name": p.name,
                        "id": p.id,
                        "enum": p.enum,
                        "maxCount": p.instance_count,
                        "computeSlices": p.slice_count,
                        "memoryMiB": p.memory_mib,
                        "multiprocessors": p.multiprocessors,
                        "placements": [f"{s}:{z}" for s, z in p.placements],
                    }
                    for p in g.profiles
                ],
                "instances": [_instance(i, g) for i in inv.instances if i.gpu_uuid == g.uuid],
            }
        )
    return {"node": node, "driver": inv.driver_version, "gpuCount": len(gpus), "gpus": gpus}


def render_text(doc: Obj) -> str:
    lines = [f"node {doc['node']}: driver {doc['driver']}, {doc['gpuCount']} GPU(s)"]
    for g in doc["gpus"]:
        mig = g["migMode"]
        lines.append(
            f"GPU {g['index']}  {g['name']}  {g['uuid']}  PCI {g['pciDeviceId']}  "
            f"minor {g['minor']}  {g['memoryMiB']} MiB  "
            f"MIG {mig['current']} (pending {mig['pending']})" + ("  LOST" if g["lost"] else "")
        )
        lines.append(
            f"  architecture {g['architecture'] or 'unknown'}; MIG mode change: "
            f"{g['modeToggle']} ({_TOGGLE_TEXT[g['modeToggle']]}); "
            f"compute processes: {g['computeProcesses']}"
        )
        cat = g["catalog"]
        if cat["model"] is None:
            lines.append("  catalog: no matching model")
        elif cat["matches"]:
            lines.append(f"  catalog: {cat['model']} (profiles and placements match)")
        else:
            lines.append(f"  catalog: {cat['model']}, NVML differs (NVML wins):")
            lines += [f"    - {d}" for d in cat["differences"]]
        if g["profiles"]:
            lines.append(
                f"  {'profile':<16}{'id':>4}{'enum':>6}{'max':>5}{'SMs':>6}{'MiB':>8}  placements"
            )
        for p in g["profiles"]:
            lines.append(
                f"  {p['name']:<16}{p['id']:>4}{p['enum']:>6}{p['maxCount']:>5}"
                f"{p['multiprocessors']:>6}{p['memoryMiB']:>8}  {' '.join(p['placements'])}"
            )
        if not g["instances"]:
            lines.append("  instances: none")
        for i in g["instances"]:
            cis = (
                ", ".join(f"CI {c} {u}" for c, u in zip(i["ciIDs"], i["migUUIDs"], strict=True))
                or "no compute instance"
            )
            lines.append(f"  instance: GI {i['giID']} {i['profile']} at {i['placement']}: {cis}")
    return "\n".join(lines)


def render(doc: Obj, fmt: str) -> str:
    return json.dumps(doc, indent=1) if fmt == "json" else render_text(doc)
