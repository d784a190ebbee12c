"""The node's pool as ResourceSlices (docs/dra.md "Device model"): pure, built from NVML's view.

Per healthy GPU, a counter set `gpu-<index>` with one counter per memory slot
(`memory-slice-<i>`) and the GPU's capacity dimensions (`memory`, `multiprocessors` and the
engines, named as NVIDIA's driver names them); one device per legal MIG placement,
`gpu-<index>-mig-<profileId>-<start>`, consuming the slots it covers and its share of each
dimension; and `gpu-<index>`, the whole GPU, consuming everything, where its MIG mode may serve
one. The counter sets go in slices of their own (at most 8 sets a slice), each GPU's devices in
slices of their own (at most 128 devices a slice): the layout of NVIDIA's driver, so users'
ResourceClaims and Kueue's counter quota read it unchanged.

Everything comes from NVML's profile table (`GpuInfo.profiles`), so a GPU model the catalog
does not know is published as NVML describes it. Device order inside a slice is InstaSlice's
static preference (`common.placement.tables.static_preference`): kube-scheduler takes the
first device that fits, so small profiles at high starts go first and the full GPU's profile
at 0 last. A GPU that is unhealthy publishes nothing.

Not here: writing the slices (nodeagent/dra/publish.py, the pool protocol).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from common.catalog.learned import learn_profiles
from common.constants import DRA_DRIVER, KIND_GPU, KIND_MIG
from common.placement.tables import TableTooLarge, model_tables, static_preference
from nodeagent.model import GpuInfo, Health, NodeInventory, ProfileInfo
from nodeagent.report import gpu_status

Obj = dict[str, Any]

MAX_COUNTER_SETS = 8  # a ResourceSlice's sharedCounters (KEP-4815)
MAX_DEVICES = 128  # a ResourceSlice's devices
MIB = 1024 * 1024
# NVML's engine tuple (ce, dec, enc, jpeg, ofa) under NVIDIA's driver's counter names
ENGINE_COUNTERS = ("copy-engines", "decoders", "encoders", "jpeg-engines", "ofa-engines")


def slot_counter(i: int) -> str:
    return f"memory-slice-{i}"


def counter_set(index: int) -> str:
    return f"gpu-{index}"


def mig_device(index: int, profile_id: int, start: int) -> str:
    return f"gpu-{index}-mig-{profile_id}-{start}"


def gpu_device(index: int) -> str:
    return f"gpu-{index}"


@dataclass(frozen=True, slots=True)
class Slice:
    """One ResourceSlice's content: its role (`counters-<k>` or `gpu-<index>-<k>`) and spec
    fields other than the pool; `publish` adds the pool and the name."""

    part: str
    counters: tuple[Obj, ...] = ()
    devices: tuple[Obj, ...] = ()

    def spec(self) -> Obj:
        out: Obj = {}
        if self.counters:
            out["sharedCounters"] = list(self.counters)
        if self.devices:
            out["devices"] = list(self.devices)
        return out


def _full(gpu: GpuInfo) -> ProfileInfo | None:
    """The profile that takes the whole GPU: its SMs and engines are the GPU's own pool."""
    return max(gpu.profiles, key=lambda p: (p.slice_count, p.memory_mib), default=None)


def _slots(gpu: GpuInfo) -> int:
    return max((s + n for p in gpu.profiles for s, n in p.placements), default=0)


def gpu_counters(gpu: GpuInfo) -> dict[str, int]:
    """The counter set's values: one per memory slot, memory in bytes, SMs and engines."""
    out = {slot_counter(i): 1 for i in range(_slots(gpu))}
    out["memory"] = gpu.memory_total_mib * MIB
    full = _full(gpu)
    if full is not None:
        out["multiprocessors"] = full.multiprocessors
        out.update(zip(ENGINE_COUNTERS, full.engines, strict=True))
    return out


def placement_consumes(p: ProfileInfo, start: int, size: int) -> dict[str, int]:
    """What one instance of `p` at `start` takes of its GPU's counter set (zeros left out)."""
    out = {slot_counter(i): 1 for i in range(start, start + size)}
    out["memory"] = p.memory_mib * MIB
    out["multiprocessors"] = p.multiprocessors
    out.update(zip(ENGINE_COUNTERS, p.engines, strict=True))
    return {k: v for k, v in out.items() if v}


def _quantities(values: Mapping[str, int]) -> Obj:
    return {k: {"value": str(v)} for k, v in values.items()}


def preference(gpu: GpuInfo) -> list[tuple[ProfileInfo, int, int]]:
    """The GPU's (profile, start, size) placements in InstaSlice's static preference; NVML's
    own order (by profile, then start) when the table cannot be built (no usable placement,
    or more memory slots than the placement engine models)."""
    by_name = {p.name: p for p in gpu.profiles}
    sizes = {(p.name, s): n for p in gpu.profiles for s, n in p.placements}
    model = learn_profiles(gpu.model, gpu_status(gpu, Health(), (), ())["profiles"])
    try:
        order = static_preference(model_tables(model)) if model is not None else None
    except TableTooLarge:
        order = None
    if order is None:
        order = tuple(sorted(sizes, key=lambda k: (-sizes[k], k[0], k[1])))
    return [(by_name[n], s, sizes[(n, s)]) for n, s in order if (n, s) in sizes]


def _attributes(gpu: GpuInfo, kind: str, profile: str, start: int, size: int) -> Obj:
    out: Obj = {
        "type": {"string": kind},
        "profile": {"string": profile},
        "start": {"int": start},
        "size": {"int": size},
        "model": {"string": gpu.model},
        "parentUUID": {"string": gpu.uuid},
        "index": {"int": gpu.index},
    }
    if gpu.architecture:
        out["architecture"] = {"string": gpu.architecture}
    return out


def gpu_devices(gpu: GpuInfo, *, mig: bool, whole: bool) -> list[Obj]:
    """One GPU's devices, best first: its MIG placements (`mig`), then the whole GPU."""
    out: list[Obj] = []
    cs = counter_set(gpu.index)
    if mig:
        for p, start, size in preference(gpu):
            attrs = _attributes(gpu, KIND_MIG, p.name, start, size)
            attrs["profileID"] = {"int": p.id}
            out.append(
                {
                    "name": mig_device(gpu.index, p.id, start),
                    "attributes": attrs,
                    "capacity": {"memory": {"value": f"{p.memory_mib}Mi"}},
                    "consumesCounters": [
                        {
                            "counterSet": cs,
                            "counters": _quantities(placement_consumes(p, start, size)),
                        }
                    ],
                }
            )
    if whole:
        out.append(
            {
                "name": gpu_device(gpu.index),
                "attributes": _attributes(gpu, KIND_GPU, KIND_GPU, 0, _slots(gpu)),
                "capacity": {"memory": {"value": f"{gpu.memory_total_mib}Mi"}},
                "consumesCounters": [
                    {"counterSet": cs, "counters": _quantities(gpu_counters(gpu))}
                ],
            }
        )
    return out


def pool_slices(
    inv: NodeInventory,
    health: Mapping[int, Health],
    can_enable: Callable[[GpuInfo], bool],
    can_be_whole: Callable[[GpuInfo], bool],
) -> list[Slice]:
    """The node's pool: counter slices (8 sets each) first, then each GPU's device slices
    (128 devices each), in GPU order. Unhealthy or lost GPUs, and GPUs that can serve
    neither a slice nor a whole GPU, are left out altogether."""
    sets: list[Obj] = []
    device_slices: list[Slice] = []
    for g in sorted(inv.gpus, key=lambda g: g.index):
        if g.index in inv.lost or not health.get(g.index, Health()).healthy:
            continue
        devices = gpu_devices(g, mig=can_enable(g), whole=can_be_whole(g))
        if not devices:
            continue
        sets.append({"name": counter_set(g.index), "counters": _quantities(gpu_counters(g))})
        for k in range(0, len(devices), MAX_DEVICES):
            part = f"gpu-{g.index}-{k // MAX_DEVICES}"
            device_slices.append(Slice(part, devices=tuple(devices[k : k + MAX_DEVICES])))
    counters = [
        Slice(f"counters-{k // MAX_COUNTER_SETS}", counters=tuple(sets[k : k + MAX_COUNTER_SETS]))
        for k in range(0, len(sets), MAX_COUNTER_SETS)
    ]
    return counters + device_slices


def slice_body(node: str, name: str, s: Slice, generation: int, count: int) -> Obj:
    """The ResourceSlice object of `s` in generation `generation` of a pool of `count`."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "instaslice"}},
        "spec": {
            "driver": DRA_DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": count},
            **s.spec(),
        },
    }


def devices_of(slices: Sequence[Slice]) -> list[str]:
    """Every device name of the pool, in order (tests and logs)."""
    return [d["name"] for s in slices for d in s.devices]
