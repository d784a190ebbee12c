"""What the agent publishes, built as data: MigNode status, Node capacity, allocation status.

Pure functions of the inventory, health, records and foreign instances. The agent compares
the result with what it last wrote and writes only on change (docs/contract.md §3).

Node capacity is the fixed upper bound of docs/contract.md §3: for each profile, the sum of its
maximum instance count over the node's healthy GPUs in MIG mode, never "currently free".
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from common.allocation import SliceAllocation
from common.catalog import Catalog
from common.conditions import (
    BASE_CDI_SPEC,
    CONFLICT_FREE,
    GPU_HEALTHY,
    condition,
    node_ready,
    observed,
    with_condition,
)
from common.constants import (
    GPU_COUNT_LABEL,
    GPU_MODEL_LABEL,
    INSTASLICE_GPU,
    INSTASLICE_MIG_PREFIX,
    MEMORY_SLOTS_RESOURCE,
    NODE_LABEL,
    EventReason,
)
from common.objects import (
    GpuStatus,
    MigProfileStatus,
    MigSliceStatus,
    Phase,
    SliceStatus,
    node_label_value,
)
from common.profiles import ProfileNameError, instaslice_resource
from common.quota import slot_bound
from nodeagent.checkpoint import Checkpoint
from nodeagent.model import GpuInfo, Health, Instance, NodeInventory

Obj = dict[str, Any]


def gpu_status(
    gpu: GpuInfo, health: Health, claimed: Sequence[MigSliceStatus], foreign: Sequence[Instance]
) -> GpuStatus:
    profiles: list[MigProfileStatus] = [
        {
            "name": p.name,
            "id": p.id,
            "memoryMiB": p.memory_mib,
            "multiprocessors": p.multiprocessors,
            "maxCount": p.instance_count,
            "placements": [{"start": s, "size": z} for s, z in p.placements],
            "computeSlices": p.slice_count,
            "engines": {
                "ce": p.engines[0],
                "dec": p.engines[1],
                "enc": p.engines[2],
                "jpeg": p.engines[3],
                "ofa": p.engines[4],
            },
        }
        for p in gpu.profiles
    ]
    slices: list[MigSliceStatus] = list(claimed)
    for inst in foreign:
        prof = gpu.profile_by_id(inst.profile_id)
        entry: MigSliceStatus = {
            "profile": prof.name if prof else f"id{inst.profile_id}",
            "start": inst.start,
            "size": inst.size,
            "migUUID": inst.mig_uuid or "",
        }
        slices.append(entry)
    slices.sort(key=lambda s: (s["start"], s["size"]))
    out: GpuStatus = {
        "index": gpu.index,
        "uuid": gpu.uuid,
        "model": gpu.model,
        "migMode": {"current": gpu.mig_current, "pending": gpu.mig_pending},
        "healthy": health.healthy,
        "profiles": profiles,
        "slices": slices,
        "computeProcesses": gpu.compute_processes,
    }
    if gpu.architecture:
        out["architecture"] = gpu.architecture
    if health.message:
        out["message"] = health.message[:1000]  # the CRD's bound is 4096
    elif gpu.warnings:
        out["message"] = "; ".join(gpu.warnings)[:1000]
    return out


def claimed_slices(cp: Checkpoint) -> dict[str, list[MigSliceStatus]]:
    """Slices our records hold, per GPU UUID (instances being created count: they occupy)."""
    out: dict[str, list[MigSliceStatus]] = {}
    for rec in cp.claims.values():
        for s in rec.slices:
            if s.gi_id is None and rec.state == "ready" and not s.whole:
                continue  # cleared by a reboot and not yet re-created
            if rec.state == "warm":  # no pod's: free capacity to the allocator, once made
                if s.done:
                    out.setdefault(s.gpu_uuid, []).append(
                        {"profile": s.profile, "start": s.start, "size": s.size,
                         "migUUID": str(s.mig_uuid), "warm": True}
                    )  # fmt: skip
                continue
            out.setdefault(s.gpu_uuid, []).append(
                {
                    "profile": s.profile,
                    "start": s.start,
                    "size": s.size,
                    "migUUID": s.mig_uuid or "",
                    "claim": rec.name,
                }
            )
    return out


def mig_node_status(
    inv: NodeInventory,
    health: Mapping[int, Health],
    cp: Checkpoint,
    foreign: Sequence[Instance],
    *,
    version: str,
    boot_id: str,
    conditions: Sequence[Obj] = (),
    modes: Mapping[str, Obj] | None = None,
    generation: int = 0,
    now: str = "",
) -> Obj:
    """`modes`: GPU UUID → its MIG mode-change fields (`nodeagent.modes.mode_status`).
    `conditions` are the node's findings (and the Ready last written, whose transition time
    is kept while its status holds); the status carries them with the `Ready` summary
    (`common.conditions.node_ready`), each stamped with `generation`, the MigNode spec's
    generation the agent has acted on (also `observedGeneration`; 0: none seen yet)."""
    claimed = claimed_slices(cp)
    gpus = [
        gpu_status(
            g,
            health.get(g.index, Health()),
            claimed.get(g.uuid, []),
            [f for f in foreign if f.gpu_uuid == g.uuid],
        )
        for g in inv.gpus
    ]
    for entry, g in zip(gpus, inv.gpus, strict=True):
        entry.update((modes or {}).get(g.uuid, {}))  # type: ignore[typeddict-item]
    out: Obj = {
        "gpuCount": len(gpus),
        "agent": {"version": version, "bootID": boot_id},
        "gpus": gpus,
    }
    ready = node_ready(gpus, conditions, now)
    out["conditions"] = observed(with_condition(conditions, ready), generation, now)
    if generation:
        out["observedGeneration"] = generation
    return out


# --- MigNode conditions: node-level findings an administrator must act on --------------------


def base_spec_condition(found: Path | None, tried: Sequence[Path]) -> Obj:
    """Where the node's NVIDIA CDI spec came from, or that none of `tried` exists. Without it
    every slice's CDI spec lacks the driver's libraries and hooks: containers start but CUDA
    finds no driver. No timestamp here: the agent stamps it once (`stamped`)."""
    if found is not None:
        return {
            "type": BASE_CDI_SPEC,
            "status": "True",
            "reason": "Found",
            "message": f"driver mounts and hooks copied from {found}",
        }
    return {
        "type": BASE_CDI_SPEC,
        "status": "False",
        "reason": EventReason.BASE_CDI_SPEC_NOT_FOUND,  # told as an event on the MigNode
        "message": "no NVIDIA CDI spec at "
        + ", ".join(str(t) for t in tried)
        + ": containers get their slices' device nodes but no driver libraries or hooks."
        " Generate one (nvidia-ctk cdi generate --output=/var/run/cdi/nvidia.yaml), enable"
        " CDI in the GPU Operator (cdi.enabled=true), or pass --nvidia-cdi-spec",
    }


def stamped(conditions: Sequence[Obj], now: str) -> list[Obj]:
    return [{**c, "lastTransitionTime": c.get("lastTransitionTime", now)} for c in conditions]


def capacity(
    inv: NodeInventory,
    health: Mapping[int, Health],
    can_enable: Callable[[GpuInfo], bool] | None = None,
    can_be_whole: Callable[[GpuInfo], bool] | None = None,
) -> dict[str, str]:
    """`instaslice.io/mig-<profile>` → the node's fixed upper bound, as quantity strings.
    A GPU with MIG off counts when `can_enable` says the agent may turn MIG on for a slice
    (MIG mode on demand: Hopper and newer). With `can_be_whole`, `instaslice.io/gpu` counts
    the healthy GPUs that can serve as whole GPUs (MIG off, or turned off on demand)."""
    total: dict[str, int] = {}
    if can_be_whole is not None:
        total[INSTASLICE_GPU] = sum(
            1 for g in inv.gpus if health.get(g.index, Health()).healthy and can_be_whole(g)
        )
    for g in inv.gpus:
        mig = g.mig_enabled or (can_enable is not None and can_enable(g))
        counted = mig and health.get(g.index, Health()).healthy
        for p in g.profiles:
            try:
                res = instaslice_resource(p.name)
            except ProfileNameError:
                continue  # a name NVML reports that the resource grammar cannot spell
            total[res] = total.get(res, 0) + (p.instance_count if counted else 0)
    return {k: str(v) for k, v in sorted(total.items())}


def slot_capacity(
    inv: NodeInventory,
    health: Mapping[int, Health],
    catalog: Catalog,
    can_enable: Callable[[GpuInfo], bool] | None = None,
    can_be_whole: Callable[[GpuInfo], bool] | None = None,
) -> dict[str, str]:
    """`instaslice.io/memory-slots`: over the node's healthy GPUs that can serve MIG slices
    (those the agent may turn MIG on for included) or whole GPUs, the most the pods they hold
    can be charged (`common.quota.slot_bound`: a whole GPU or a size ask is charged the most
    it could take on any model its selectors admit, docs/kueue.md) — a fixed upper bound, like
    `capacity`, so pods charged in slots (--slot-accounting) are never turned away by the
    kube-scheduler where their slices are."""
    total = 0
    for g in inv.gpus:
        mig = g.mig_enabled or (can_enable is not None and can_enable(g))
        whole = can_be_whole is not None and can_be_whole(g)
        if (mig or whole) and health.get(g.index, Health()).healthy:
            slots = max((s + n for p in g.profiles for s, n in p.placements), default=0)
            total += slot_bound(catalog, slots)
    return {MEMORY_SLOTS_RESOURCE: str(total)}


def gpu_labels(inv: NodeInventory) -> dict[str, str | None]:
    """The Node labels the agent keeps: `instaslice.io/gpu-model` (the model when all GPUs
    share one, as a label value; else removed: a flavor selects one model) and
    `instaslice.io/gpu-count`."""
    models = {g.model for g in inv.gpus}
    model = label_value(next(iter(models))) if len(models) == 1 else None
    return {GPU_MODEL_LABEL: model, GPU_COUNT_LABEL: str(len(inv.gpus))}


def node_labels(node: str, inv: NodeInventory) -> dict[str, str | None]:
    """`gpu_labels` and `instaslice.io/node` (`node_label_value`: the name, or a long one
    cut and hashed): Karpenter refuses a pod naming `kubernetes.io/hostname`, so the
    allocator keeps its placeholders off the nodes that cannot serve their pod by `NotIn` on
    this label (docs/autoscaling.md). Karpenter sets it to a random number on a node it made
    for such a placeholder; the agent writes it back (`NodeAgent.on_node`)."""
    return {**gpu_labels(inv), NODE_LABEL: node_label_value(node)}


_NOT_IN_LABEL_VALUES = re.compile(r"[^A-Za-z0-9_.-]+")


def label_value(text: str) -> str:
    """`text` as a Kubernetes label value: runs of other characters become `-`, at most 63,
    alphanumeric at both ends. A catalog model is one already; a model in no catalog is named
    by NVML ("NVIDIA X10" → "NVIDIA-X10"), and the API server refused the whole Node patch."""
    return _NOT_IN_LABEL_VALUES.sub("-", text)[:63].strip("-_.")


def label_patch(desired: Mapping[str, str | None], current: Mapping[str, str]) -> Obj | None:
    """A merge patch setting (or, for None, removing) the labels that differ; None if none."""
    changes = {k: v for k, v in desired.items() if current.get(k) != v}
    return {"metadata": {"labels": changes}} if changes else None


def capacity_patch(
    desired: Mapping[str, str], current: Mapping[str, Any], *, prune: bool = True
) -> Obj | None:
    """A merge patch for Node status that sets our resources and (`prune`) removes stale
    `instaslice.io/mig-*` ones (null); None when nothing changes. Other resources are never
    touched. `prune=False` in the device-plugin binding: the kubelet owns those entries."""
    changes: dict[str, str | None] = {}
    for res, val in desired.items():
        if str(current.get(res)) != val:
            changes[res] = val
    for res in current:
        if prune and res.startswith(INSTASLICE_MIG_PREFIX) and res not in desired:
            changes[res] = None
    if not changes:
        return None
    return {"status": {"capacity": dict(changes), "allocatable": dict(changes)}}


# --- SliceAllocation status ----------------------------------------------------------------------


def status_creating(message: str = "") -> Obj:
    return {"status": {"phase": Phase.CREATING.value, "message": message}}


def status_ready(
    slices: Sequence[SliceStatus], boot_id: str, conditions: Sequence[Obj], message: str = ""
) -> Obj:
    return {
        "status": {
            "phase": Phase.READY.value,
            "message": message,
            "bootID": boot_id,
            "slices": list(slices),
            "conditions": list(conditions),
        }
    }


def status_failed(message: str, conditions: Sequence[Obj]) -> Obj:
    return {
        "status": {
            "phase": Phase.FAILED.value,
            "message": message[:4000],
            "conditions": list(conditions),
        }
    }


def status_releasing(message: str = "") -> Obj:
    return {"status": {"phase": Phase.RELEASING.value, "message": message}}


def gpu_condition(health: Mapping[int, Health], gpu_indexes: Sequence[int], now: str) -> Obj:
    """The `GPUHealthy` condition of an allocation whose slices sit on `gpu_indexes`."""
    bad = [
        (i, health[i]) for i in sorted(set(gpu_indexes)) if i in health and not health[i].healthy
    ]
    if not bad:
        return condition(GPU_HEALTHY, True, "Healthy", "", now)
    msg = "; ".join(f"GPU {i}: {h.message}" for i, h in bad)
    return condition(GPU_HEALTHY, False, "GPUUnhealthy", msg, now)


# --- the per-slice info series ---------------------------------------------------------------

SLICE_INFO_LABELS = (
    "namespace", "pod", "container", "node", "gpu_uuid", "mig_uuid", "gi_id", "profile",
)  # fmt: skip


def slice_info(node: str, allocations: Iterable[Obj]) -> list[tuple[str, ...]]:
    """Label values of `instaslice_slice_info` (value 1), one per slice of a Ready allocation
    on `node`, in SLICE_INFO_LABELS order: what lets DCGM exporter's per-GPU-instance series
    (which cannot name a pod for instaslice.io devices) be joined to the pod holding it."""
    out = []
    for a in map(SliceAllocation.parse, allocations):
        if a.node != node or a.phase != Phase.READY:
            continue
        done = a.status_slices
        for i, s in enumerate(a.slices):
            st = done[i] if i < len(done) else {}
            gi = st.get("giID")
            mig = str(st.get("migUUID", ""))
            gi_id = "" if gi is None else str(gi)
            out.append(
                (a.namespace, a.pod_name, s.container, node, s.gpu_uuid, mig, gi_id, s.profile)
            )
    return sorted(out)


# --- conflicts: another MIG manager on a node InstaSlice manages -------------------------------

DEPLOY_DEVICE_PLUGIN = "nvidia.com/gpu.deploy.device-plugin"
DEPLOY_MIG_MANAGER = "nvidia.com/gpu.deploy.mig-manager"
MIG_CONFIG = "nvidia.com/mig.config"
# MIG Manager configs that only switch MIG mode (with MIG_PARTED_MODE_CHANGE_ONLY=true, or
# because they define no instances): compatible with InstaSlice (docs/install.md)
MODE_ONLY_MIG_CONFIGS = frozenset({"all-enabled", "all-disabled"})
CONFLICT_KINDS = ("device_plugin", "mig_manager", "foreign_instances")


def conflicts(labels: Mapping[str, str], foreign: int) -> dict[str, str]:
    """`kind -> why` for each thing on this node that competes with InstaSlice for its GPUs:
    the GPU Operator deploying NVIDIA's device plugin (it would hand the same GPUs out as
    nvidia.com/* resources), its MIG Manager with a config that creates instances (it would
    repartition underneath us), and instances InstaSlice did not create."""
    out = {}
    if DEPLOY_DEVICE_PLUGIN in labels and labels[DEPLOY_DEVICE_PLUGIN] != "false":
        out["device_plugin"] = (
            f"the GPU Operator deploys NVIDIA's device plugin here ({DEPLOY_DEVICE_PLUGIN}="
            f"{labels[DEPLOY_DEVICE_PLUGIN]}); label the node {DEPLOY_DEVICE_PLUGIN}=false"
        )
    config = labels.get(MIG_CONFIG)
    if (
        config is not None
        and config not in MODE_ONLY_MIG_CONFIGS
        and labels.get(DEPLOY_MIG_MANAGER, "true") != "false"
    ):
        out["mig_manager"] = (
            f"MIG Manager is asked to apply {MIG_CONFIG}={config}, which creates instances; "
            "use all-enabled with MIG_PARTED_MODE_CHANGE_ONLY=true, or "
            f"{DEPLOY_MIG_MANAGER}=false"
        )
    if foreign:
        out["foreign_instances"] = (
            f"{foreign} GPU instance(s) InstaSlice did not create hold memory slots here"
        )
    return out


def conflict_condition(found: Mapping[str, str], now: str) -> Obj:
    if not found:
        return condition(CONFLICT_FREE, True, "NoConflict", "", now)
    reason = {  # told as an event on the MigNode: EventReason members
        "device_plugin": EventReason.DEVICE_PLUGIN_ACTIVE,
        "mig_manager": EventReason.MIG_MANAGER_ACTIVE,
        "foreign_instances": EventReason.FOREIGN_INSTANCES,
    }[next(iter(found))]
    return condition(CONFLICT_FREE, False, reason, "; ".join(found.values()), now)
