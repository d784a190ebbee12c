"""Builders shared by the tests and the benchmarks: wire objects and NVML's view of a GPU.

`make_pod`, `make_node`, `make_mig_node`, `make_allocation` return plain wire JSON, as the
webhook and the node agent would have written it: a pod already rewritten by admission
(`instaslice.io/mig-*` limits and requests, the gate, a claim), a KWOK node with the agent's
fixed `instaslice.io/mig-*` capacity, a MigNode describing catalog GPUs, a SliceAllocation.
`gpu` is a GPU as the node agent's NVML layer reports it, taken from the catalog;
`quiet_placer` the allocator's placer on a `ClusterState`, deciding and telling nobody.

A package of its own so that bench/ never imports tests/ and the product never imports
either: the import contracts in pyproject.toml forbid `common`, `webhook` and `nodeagent`
to import `testkit`, and the wheel does not ship it (only `common*`, `webhook*`,
`nodeagent*` are packaged). No fixtures, no I/O: builders only.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from common.allocation import build_allocation
from common.catalog import GpuModel, load_catalog
from common.constants import (
    API_VERSION,
    CLAIM_ANNOTATION,
    GATE_NAME,
    INSTASLICE_GPU,
    MIG_NODE_KIND,
    WHOLE_GPU_PROFILE,
)
from common.kubeapi import Obj
from common.objects import Phase, SliceSpec, new_claim_id
from common.placement import NodeSelectorRequirement, PodRequest, Policy, SliceRequest, Toleration
from common.profiles import instaslice_resource, nvidia_resource
from nodeagent.model import GpuInfo, ProfileInfo
from webhook.allocator.metrics import AllocatorMetrics
from webhook.allocator.placer import Placer
from webhook.allocator.state import ClusterState
from webhook.allocator.track import Tracks

PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
KWOK_ANNOTATION = {"kwok.x-k8s.io/node": "fake"}
_uids = itertools.count(1)

SliceAsks = Mapping[str, Mapping[str, int]]  # container -> profile -> count


def _admitted_name(profile: str) -> str:
    """A profile's resource name once admission rewrote it."""
    return INSTASLICE_GPU if profile == WHOLE_GPU_PROFILE else instaslice_resource(profile)


def _container(
    name: str,
    asks: Mapping[str, int],
    cpu: str | None,
    memory: str | None,
    *,
    resource: Callable[[str], str] = _admitted_name,
    requests: Mapping[str, int | str] | None = None,
) -> Obj:
    """A container asking `asks` (profile -> count) in its limits, named by `resource`; the
    slices in `requests` (None: the same as the limits, as admission leaves them), then
    `cpu` and `memory`, in its requests."""
    limits = {resource(p): str(n) for p, n in asks.items()}
    reqs = {resource(p): str(n) for p, n in (asks if requests is None else requests).items()}
    if cpu is not None:
        reqs["cpu"] = cpu
    if memory is not None:
        reqs["memory"] = memory
    resources: Obj = {}
    if limits:
        resources["limits"] = limits
    if reqs:
        resources["requests"] = reqs
    return {"name": name, "image": PAUSE_IMAGE, "resources": resources}


def make_pod(
    name: str,
    *,
    namespace: str = "ns",
    slices: SliceAsks | None = None,
    cpu: str | None = "100m",
    memory: str | None = "64Mi",
    init: Sequence[tuple[str, Mapping[str, int], str | None, str | None]] = (),
    sidecars: Sequence[tuple[str, Mapping[str, int], str | None, str | None]] = (),
    gates: Sequence[str] = (GATE_NAME,),
    claim: str | None = "auto",
    priority: int | None = None,
    created: str | None = None,
    uid: str | None = None,
    node_name: str | None = None,
    node_selector: Mapping[str, str] | None = None,
    required_terms: list[Obj] | None = None,
    tolerations: list[Obj] | None = None,
    overhead: Mapping[str, str] | None = None,
    phase: str | None = None,
    owner: Obj | None = None,
    labels: Mapping[str, str] | None = None,
) -> Obj:
    """A pod as admission leaves it. `slices` defaults to one 1g.10gb for container `main`;
    `init` lists (name, slices, cpu, memory) init containers, `sidecars` the same for init
    containers with `restartPolicy: Always` (after `init`; only those may ask for slices,
    docs/contract.md §1); `uid`, `created` and `phase` are for unit tests (the API server
    sets them)."""
    asks = {"main": {"1g.10gb": 1}} if slices is None else slices
    containers = [_container(c, a, cpu, memory) for c, a in asks.items()] or [
        _container("main", {}, cpu, memory)
    ]
    meta: Obj = {"name": name, "namespace": namespace, "labels": dict(labels or {})}
    if claim is not None:
        meta["annotations"] = {CLAIM_ANNOTATION: new_claim_id() if claim == "auto" else claim}
    if uid is not None or created is not None:
        meta["uid"] = uid or f"uid-{next(_uids)}"
        meta["creationTimestamp"] = created or "2026-01-01T00:00:00Z"
    if owner is not None:
        meta["ownerReferences"] = [owner]
    spec: Obj = {"containers": containers, "terminationGracePeriodSeconds": 0}
    if init or sidecars:
        spec["initContainers"] = [_container(n, a, c, m) for n, a, c, m in init] + [
            {**_container(n, a, c, m), "restartPolicy": "Always"} for n, a, c, m in sidecars
        ]
    if gates:
        spec["schedulingGates"] = [{"name": g} for g in gates]
    if priority is not None:
        spec["priority"] = priority
    if node_name:
        spec["nodeName"] = node_name
    if node_selector:
        spec["nodeSelector"] = dict(node_selector)
    if required_terms is not None:
        spec["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": required_terms
                }
            }
        }
    if tolerations:
        spec["tolerations"] = tolerations
    if overhead:
        spec["overhead"] = dict(overhead)
    pod: Obj = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}
    if phase is not None:
        pod["status"] = {"phase": phase}
    return pod


# --- pods as a user writes them (before admission) ----------------------------------------

USER_IMAGE = "registry.invalid/cuda:12"
USER_MIG = "nvidia.com/mig-1g.18gb"  # a user pod's default ask


def container(
    name: str = "main",
    limits: Mapping[str, Any] | None = None,
    requests: Mapping[str, Any] | None = None,
    env: list[Obj] | None = None,
) -> Obj:
    """A container as a user writes it: `limits`, `requests` and `env` as given (an empty
    one is kept: admission must judge it), none of them when None."""
    c: Obj = {"name": name, "image": USER_IMAGE}
    resources: Obj = {}
    if limits is not None:
        resources["limits"] = dict(limits)
    if requests is not None:
        resources["requests"] = dict(requests)
    if resources:
        c["resources"] = resources
    if env is not None:
        c["env"] = env
    return c


def sidecar(c: Obj) -> Obj:
    """`c` as a sidecar: an init container with `restartPolicy: Always` (the only init
    containers that may ask for slices, docs/contract.md §1)."""
    return {**c, "restartPolicy": "Always"}


def pod_spec(
    slices: SliceAsks,
    *,
    cpu: str | None = None,
    memory: str | None = None,
    slice_requests: SliceAsks | None = None,
    restart_policy: str | None = None,
    node_selector: Mapping[str, str] | None = None,
) -> Obj:
    """A pod spec whose containers ask for `slices` in NVIDIA's names (one container per
    key), as a user writes it; for pods, Deployments and Jobs."""
    spec: Obj = {
        "containers": [
            _container(
                c,
                asks,
                cpu,
                memory,
                resource=nvidia_resource,
                requests=(slice_requests or {}).get(c, {}),
            )
            for c, asks in slices.items()
        ],
        "terminationGracePeriodSeconds": 0,
    }
    if restart_policy is not None:
        spec["restartPolicy"] = restart_policy
    if node_selector:
        spec["nodeSelector"] = dict(node_selector)
    return spec


def user_pod(
    *containers: Obj,
    name: str | None = None,
    namespace: str | None = None,
    slices: SliceAsks | None = None,
    cpu: str | None = None,
    memory: str | None = None,
    slice_requests: SliceAsks | None = None,
    labels: Mapping[str, str] | None = None,
    node_selector: Mapping[str, str] | None = None,
    init: list[Obj] | None = None,
    annotations: Mapping[str, str] | None = None,
    gates: Sequence[str] | None = None,
    node_name: str | None = None,
) -> Obj:
    """A pod as a user writes it, before admission (`make_pod` is one after it).

    Its containers: `containers` as given; or, with `slices`, one per key asking those
    slices in NVIDIA's names (`pod_spec`: `cpu`, `memory`, `slice_requests` for requests that
    may differ from the limits, `node_selector`), e.g.
    `user_pod(name="p", slices={"main": {"3g.71gb": 1}})`; else one container asking one
    `USER_MIG`. `name`: a fresh random one when None. Every other field is set when given,
    as given (an empty one too: admission must judge it)."""
    meta: Obj = {"name": name or f"p-{secrets.token_hex(3)}"}
    if namespace is not None:
        meta["namespace"] = namespace
    if labels is not None:
        meta["labels"] = dict(labels)
    if annotations is not None:
        meta["annotations"] = dict(annotations)
    if slices is not None:
        spec = pod_spec(
            slices,
            cpu=cpu,
            memory=memory,
            slice_requests=slice_requests,
            node_selector=node_selector,
        )
    else:
        spec = {"containers": list(containers) or [container(limits={USER_MIG: "1"})]}
    if init is not None:
        spec["initContainers"] = init
    if gates is not None:
        spec["schedulingGates"] = [{"name": g} for g in gates]
    if node_name is not None:
        spec["nodeName"] = node_name
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def pod_request(
    *slices: tuple[str, str, int] | tuple[str, str],
    cpu: int = 1000,
    memory: int = 1 << 30,
    name: str = "pod",
    selector: Mapping[str, str] | None = None,
    affinity: tuple[tuple[NodeSelectorRequirement, ...], ...] = (),
    tolerations: tuple[Toleration, ...] = (),
) -> PodRequest:
    """What the placement engine is asked for one pod (common/placement/model.py).
    `slices`: (container, profile[, count])."""
    reqs = tuple(SliceRequest(s[0], s[1], s[2] if len(s) > 2 else 1) for s in slices)
    return PodRequest(name, cpu, memory, reqs, dict(selector or {}), affinity, tolerations)


# --- nodes ---------------------------------------------------------------------------------


def mig_capacity(model: str, gpus: int) -> dict[str, str]:
    """The agent's fixed upper bound: each profile's maxCount times the GPU count."""
    m = load_catalog().model(model)
    assert m is not None, model
    return {instaslice_resource(p.name): str(p.max_count * gpus) for p in m.profiles}


def make_node(
    name: str,
    *,
    cpu: str = "8",
    memory: str = "32Gi",
    pods: int = 110,
    labels: Mapping[str, str] | None = None,
    taints: list[Obj] | None = None,
    unschedulable: bool = False,
    model: str | None = "H100-80GB",
    gpus: int = 1,
) -> Obj:
    """A KWOK node; with `model`, advertising that model's MIG capacity for `gpus` GPUs."""
    resources = {"cpu": cpu, "memory": memory, "pods": str(pods)}
    if model is not None:
        resources.update(mig_capacity(model, gpus))
    spec: Obj = {}
    if taints:
        spec["taints"] = taints
    if unschedulable:
        spec["unschedulable"] = True
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            # a label value has at most 63 characters, a node name up to 253
            "labels": {
                "type": "kwok",
                "kubernetes.io/hostname": name[:63].rstrip("-."),
                **(labels or {}),
            },
            "annotations": dict(KWOK_ANNOTATION),
        },
        "spec": spec,
        "status": {"capacity": dict(resources), "allocatable": dict(resources)},
    }


@dataclass
class GpuSpec:
    model: str = "H100-80GB"
    healthy: bool = True
    mig: bool = True
    slices: list[Obj] = field(default_factory=list)  # {profile, start, size, migUUID, claim?}


def gpu_uuid(node: str, index: int) -> str:
    return f"GPU-{node}-{index}"


def profile_entries(model: GpuModel) -> list[Obj]:
    """A model's profiles as a MigNode GPU entry lists them (what the agent reads off NVML)."""
    return [
        {
            "name": p.name,
            "id": p.id,
            "memoryMiB": p.memory_mib,
            "multiprocessors": p.multiprocessors,
            "maxCount": p.max_count,
            "placements": [{"start": s, "size": p.memory_slots} for s in p.starts],
        }
        for p in model.profiles
    ]


def make_mig_node(node: str, gpus: Iterable[GpuSpec | str] = ("H100-80GB",)) -> Obj:
    out = []
    for i, g in enumerate(gpus):
        spec = GpuSpec(model=g) if isinstance(g, str) else g
        model = load_catalog().model(spec.model)
        assert model is not None, spec.model
        mode = "enabled" if spec.mig else "disabled"
        out.append(
            {
                "index": i,
                "uuid": gpu_uuid(node, i),
                "model": spec.model,
                "migMode": {"current": mode, "pending": mode},
                "healthy": spec.healthy,
                "profiles": profile_entries(model),
                "slices": list(spec.slices),
            }
        )
    return {
        "apiVersion": API_VERSION,
        "kind": MIG_NODE_KIND,
        "metadata": {"name": node},
        "status": {"gpuCount": len(out), "gpus": out},
    }


def make_allocation(
    pod: Obj,
    node: str,
    slices: Sequence[tuple[str, str, int, int, int]],
    *,
    phase: Phase = Phase.PENDING,
    deleting: bool = False,
    uid: str | None = None,
) -> Obj:
    """`slices`: (container, profile, gpu index, start, size) on `node`'s GPUs."""
    specs: list[SliceSpec] = [
        {
            "container": c,
            "profile": p,
            "gpuUUID": gpu_uuid(node, g),
            "gpuIndex": g,
            "start": s,
            "size": n,
        }
        for c, p, g, s, n in slices
    ]
    claim = pod["metadata"]["annotations"][CLAIM_ANNOTATION]
    obj = build_allocation(
        namespace=pod["metadata"]["namespace"], claim=claim, pod=pod, node=node, slices=specs
    )
    obj["metadata"]["uid"] = uid or f"alloc-{next(_uids)}"
    obj["status"] = {"phase": phase.value}
    if deleting:
        obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return obj


# --- a GPU as the node agent's NVML layer reports it ---------------------------------------

G0, G1 = "GPU-0000", "GPU-1111"


def gpu(
    index: int, uuid: str, model: str | GpuModel = "H200-141GB", mig: str = "enabled"
) -> GpuInfo:
    """`model`: a catalog name, or a model of its own (a table file's)."""
    m = load_catalog().model(model) if isinstance(model, str) else model
    assert m is not None
    return GpuInfo(
        index=index,
        uuid=uuid,
        name=m.product_names[0],
        pci_device_id=m.pci_device_ids[0],
        minor=index,
        mig_current=mig,
        mig_pending=mig,
        memory_total_mib=m.memory_total_mib,
        model=m.name,
        profiles=tuple(
            ProfileInfo(
                p.name,
                p.id,
                p.enum,
                p.compute_slices,
                p.max_count,
                p.memory_mib,
                p.multiprocessors,
                tuple((s, p.size) for s in p.starts),
                p.engines.as_tuple(),
            )
            for p in m.profiles
        ),
    )


# --- the allocator's placer, deciding only ---------------------------------------------------


def quiet_placer(state: ClusterState) -> Placer:
    """The allocator's placer on `state`, telling and kicking nobody (decisions only)."""
    return Placer(
        state,
        Tracks(),
        AllocatorMetrics(),
        Policy.INSTASLICE,
        state.geometries.catalog,
        kick=lambda uid: None,
        tell=lambda pod, reason, message: None,
    )
