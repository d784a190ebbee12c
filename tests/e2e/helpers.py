"""Builders, waits and the slice invariant for the end-to-end tests.

Builders (`make_deployment`, `make_job`, `make_real_pod`; plain pods: `testkit.builders.user_pod`)
return what a user writes: plain wire JSON asking for `nvidia.com/mig-<profile>` in limits
(docs/contract.md §1), never the rewritten form, so admission is exercised on every object.

Waits are list-then-watch (`wait_for`): the predicate sees the current objects after the
list and after every watch event, and a bounded deadline turns "never happened" into an
AssertionError that says what was awaited and what was last seen. Nothing here sleeps.

`assert_holds_slices` is the whole invariant of a Running pod, checked against every layer
that can disagree: the pod, its SliceAllocation, the emulated GPUs' real instances, the CDI
spec file on the node and the container env. `assert_node_matches` checks one node's GPUs
hold exactly what its allocations promise (no leaked and no duplicate instance).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from common.constants import (
    CDI_FILE_PREFIX,
    CDI_KIND,
    CLAIM_ANNOTATION,
    ENABLED_KEY,
    GATE_NAME,
    NODE_LABEL,
    VISIBLE_DEVICES_ENV,
    cdi_device_name,
    qualified_cdi_device,
)
from common.kubeapi import Kube, Obj, core_path, group_path, instaslice_path
from common.profiles import instaslice_resource
from hack.cluster.nodes import REAL_NODE_TAINT
from hack.cluster.ociimage import BUSYBOX_IMAGE
from hack.dev import DevSystem
from nodeagent.emulator import EmulatorControl
from testkit.builders import PAUSE_IMAGE, SliceAsks, pod_spec, user_pod
from tests.support import wait_admission_sees_opt_in, wait_for

T = TypeVar("T")
IMAGE = PAUSE_IMAGE
READY_TIMEOUT_S = 60.0  # pod creation to Running, with slices, on a busy 2-core machine
RELEASE_TIMEOUT_S = 60.0


# --- processes ----------------------------------------------------------------------------


# --- builders -----------------------------------------------------------------------------


def make_real_pod(name: str, node: str, slices: SliceAsks, command: str) -> Obj:
    """A bare Pod for the real node (hack/cluster/realnode.py): busybox running `command` in
    every container, hostNetwork (the node has no pod network), tolerating the node's taint
    and selecting it, never restarted, killed at once on delete."""
    pod = user_pod(name=name, slices=slices, node_selector={"kubernetes.io/hostname": node})
    key, value, effect = REAL_NODE_TAINT
    pod["spec"].update(
        hostNetwork=True,
        restartPolicy="Never",
        automountServiceAccountToken=False,
        tolerations=[{"key": key, "operator": "Equal", "value": value, "effect": effect}],
    )
    for c in pod["spec"]["containers"]:
        c.update(image=BUSYBOX_IMAGE, imagePullPolicy="Never", command=["sh", "-c", command])
    return pod


def make_deployment(
    name: str,
    *,
    replicas: int,
    slices: SliceAsks,
    cpu: str | None = None,
    node_selector: Mapping[str, str] | None = None,
) -> Obj:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": pod_spec(slices, cpu=cpu, node_selector=node_selector),
            },
        },
    }


def make_job(name: str, *, slices: SliceAsks, cpu: str | None = None) -> Obj:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "backoffLimit": 0,
            "template": {"spec": pod_spec(slices, cpu=cpu, restart_policy="Never")},
        },
    }


# --- API paths ----------------------------------------------------------------------------


def pods_path(ns: str, name: str | None = None) -> str:
    return core_path("pods", ns, name)


def allocs_path(ns: str | None, name: str | None = None) -> str:
    return instaslice_path("sliceallocations", ns, name)


def deployments_path(ns: str, name: str | None = None) -> str:
    return group_path("apps/v1", "deployments", ns, name)


def jobs_path(ns: str, name: str | None = None) -> str:
    return group_path("batch/v1", "jobs", ns, name)


# --- waits --------------------------------------------------------------------------------


async def wait_pod_running(
    kube: Kube, ns: str, name: str, timeout_s: float = READY_TIMEOUT_S
) -> Obj:
    def running(objs: dict[str, Obj]) -> Obj | None:
        pod = objs.get(name)
        return pod if pod and pod.get("status", {}).get("phase") == "Running" else None

    return await wait_for(
        kube,
        pods_path(ns),
        running,
        what=f"pod {ns}/{name} Running",
        within=timeout_s,
        fieldSelector=f"metadata.name={name}",
    )


async def wait_pods_running(
    kube: Kube, ns: str, count: int, *, selector: str, timeout_s: float = READY_TIMEOUT_S
) -> list[Obj]:
    """Exactly `count` live pods match `selector` and all are Running."""

    def done(objs: dict[str, Obj]) -> list[Obj] | None:
        live = [p for p in objs.values() if "deletionTimestamp" not in p["metadata"]]
        ok = len(live) == count and all(p.get("status", {}).get("phase") == "Running" for p in live)
        return sorted(live, key=lambda p: p["metadata"]["name"]) if ok else None

    return await wait_for(
        kube,
        pods_path(ns),
        done,
        what=f"{count} Running pods matching {selector} in {ns}",
        within=timeout_s,
        labelSelector=selector,
    )


async def wait_gone(
    kube: Kube, path: str, name: str, *, timeout_s: float = RELEASE_TIMEOUT_S
) -> None:
    await wait_for(
        kube,
        path,
        lambda objs: name not in objs,
        what=f"{path}/{name} deleted",
        within=timeout_s,
        fieldSelector=f"metadata.name={name}",
    )


async def wait_event(
    kube: Kube,
    ns: str,
    pod: str,
    reason: str,
    *,
    uid: str | None = None,
    timeout_s: float = READY_TIMEOUT_S,
) -> Obj:
    """The first event with `reason` about pod `ns/pod` (of that incarnation, given `uid`)."""
    selector = f"involvedObject.name={pod},reason={reason}"
    if uid is not None:
        selector += f",involvedObject.uid={uid}"

    def first(objs: dict[str, Obj]) -> Obj | None:
        return next(iter(objs.values()), None)

    return await wait_for(
        kube,
        core_path("events", ns),
        first,
        what=f"event {reason} on pod {ns}/{pod}",
        within=timeout_s,
        fieldSelector=selector,
    )


async def wait_opted_in(kube: Kube, ns: str) -> None:
    """Until InstaSlice has mirrored the namespace's opt-in annotation into its label."""

    def mirrored(nss: dict[str, Obj]) -> bool:
        labels = nss.get(ns, {}).get("metadata", {}).get("labels", {})
        return bool(labels.get(ENABLED_KEY) == "true")

    await wait_for(
        kube,
        core_path("namespaces"),
        mirrored,
        what=f"label {ENABLED_KEY}=true mirrored onto namespace {ns}",
        within=30,
        fieldSelector=f"metadata.name={ns}",
    )
    # the webhook's namespaceSelector is matched against the API server's namespace cache
    probe = user_pod(name="opt-in-probe", slices={"c": {"1g.10gb": 1}})
    await wait_admission_sees_opt_in(kube, ns, probe, admitted=_gated)


def _gated(pod: Obj) -> bool:
    return GATE_NAME in [g["name"] for g in pod["spec"].get("schedulingGates") or []]


# --- kubectl ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Result:
    rc: int
    out: str
    err: str


async def kubectl(system: DevSystem, *args: str, stdin: str | None = None) -> Result:
    """kubectl as cluster admin (no check: callers assert on rc, out and err)."""
    proc = await asyncio.create_subprocess_exec(
        str(system.cp.kubectl_path),
        f"--kubeconfig={system.kubeconfig}",
        f"--cache-dir={system.cp.kubectl_cache_dir}",
        *args,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate(stdin.encode() if stdin is not None else None)
    assert proc.returncode is not None
    return Result(proc.returncode, out.decode(), err.decode())


async def plugin_nodes(system: DevSystem) -> str:
    """What `kubectl instaslice nodes` prints (the plugin as installed beside this Python)."""
    plugin = Path(sys.executable).parent / "kubectl-instaslice"
    shown = await asyncio.to_thread(
        subprocess.run,
        [str(plugin), "nodes", f"--kubeconfig={system.kubeconfig}"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert shown.returncode == 0, shown.stderr
    return shown.stdout


# --- the invariant ------------------------------------------------------------------------


@dataclass(frozen=True)
class Held:
    """One slice as the allocation records it (spec placement + status MIG UUID)."""

    container: str
    profile: str
    gpu_index: int
    start: int
    size: int
    mig_uuid: str


def _gpu_indices(system: DevSystem, node: str) -> dict[str, int]:
    return {g.uuid: g.index for g in EmulatorControl(system.gpu_state, node).state().gpus}


def held_slices(system: DevSystem, alloc: Obj) -> list[Held]:
    spec, status = alloc["spec"], alloc.get("status", {})
    done = status.get("slices", [])
    where = f"SliceAllocation {alloc['metadata']['namespace']}/{alloc['metadata']['name']}"
    assert len(done) == len(spec["slices"]), (
        f"{where}: status.slices {done} vs spec {spec['slices']}"
    )
    index = _gpu_indices(system, spec["nodeName"])
    out = []
    for want, got in zip(spec["slices"], done, strict=True):
        assert got["container"] == want["container"], f"{where}: status.slices out of order"
        out.append(
            Held(
                want["container"],
                want["profile"],
                index[want["gpuUUID"]],
                int(want["start"]),
                int(want["size"]),
                got["migUUID"],
            )
        )
    return out


def _instances(system: DevSystem, node: str) -> list[Held]:
    return [
        Held("", r.profile_name, r.gpu_index, r.start, r.size, r.mig_uuid or "")
        for r in EmulatorControl(system.gpu_state, node).instances()
    ]


def cdi_files(system: DevSystem, node: str) -> dict[Path, Obj]:
    d = system.cdi_dir(node)
    if not d.is_dir():
        return {}
    return {p: json.loads(p.read_text()) for p in sorted(d.glob(f"{CDI_FILE_PREFIX}*"))}


def cdi_file_for(system: DevSystem, node: str, ns: str, claim: str) -> tuple[Path, Obj] | None:
    found = [
        (p, spec)
        for p, spec in cdi_files(system, node).items()
        if spec.get("annotations", {}).get(CLAIM_ANNOTATION) == f"{ns}/{claim}" or claim in p.name
    ]
    assert len(found) <= 1, f"several CDI files for {ns}/{claim} on {node}: {[p for p, _ in found]}"
    return found[0] if found else None


def slice_containers(pod: Obj) -> list[str]:
    """Containers (init and regular) whose limits ask for InstaSlice slices."""
    out = []
    for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]:
        limits = c.get("resources", {}).get("limits", {})
        if any(k.startswith("instaslice.io/mig-") for k in limits):
            out.append(c["name"])
    return out


async def assert_holds_slices(kube: Kube, system: DevSystem, ns: str, name: str) -> Obj:
    """The whole invariant of a Running pod with slices; returns its SliceAllocation."""
    pod = await kube.get(pods_path(ns, name))
    where = f"pod {ns}/{name}"
    assert pod["status"].get("phase") == "Running", f"{where} is {pod['status'].get('phase')}"
    claim = pod["metadata"].get("annotations", {}).get(CLAIM_ANNOTATION)
    assert claim, f"{where} has no {CLAIM_ANNOTATION} annotation"
    gates = [g["name"] for g in pod["spec"].get("schedulingGates", [])]
    assert GATE_NAME not in gates, f"{where} still gated: {gates}"
    node = pod["spec"]["nodeName"]

    alloc = await kube.get(allocs_path(ns, claim))
    aw = f"SliceAllocation {ns}/{claim} of {where}"
    assert alloc.get("status", {}).get("phase") == "Ready", f"{aw}: {alloc.get('status')}"
    assert alloc["spec"]["nodeName"] == node, (
        f"{aw} is for {alloc['spec']['nodeName']}, pod on {node}"
    )
    assert alloc["spec"]["podUID"] == pod["metadata"]["uid"], f"{aw} names another pod UID"
    assert alloc["metadata"]["labels"].get(NODE_LABEL) == node, f"{aw}: node label"
    owners = [(o["kind"], o["uid"]) for o in alloc["metadata"].get("ownerReferences", [])]
    assert ("Pod", pod["metadata"]["uid"]) in owners, f"{aw}: owner references {owners}"

    # Pinned by the allocator to exactly that node.
    terms = (
        pod["spec"].get("affinity", {}).get("nodeAffinity", {})
        .get("requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms", [])
    )  # fmt: skip
    pinned = [
        f["values"] for t in terms for f in t.get("matchFields", []) if f["key"] == "metadata.name"
    ]
    assert pinned and all(v == [node] for v in pinned), f"{where} not pinned to {node}: {terms}"

    # The GPUs really hold exactly these instances, with the UUIDs the status reports.
    held = held_slices(system, alloc)
    mine = {h.mig_uuid for h in held}
    assert len(mine) == len(held), f"{aw}: duplicate MIG UUIDs {held}"
    real = {(i.gpu_index, i.profile, i.start, i.size, i.mig_uuid) for i in _instances(system, node)}
    want = {(h.gpu_index, h.profile, h.start, h.size, h.mig_uuid) for h in held}
    missing = want - real
    assert not missing, f"{aw}: instances missing on {node}'s GPUs: {missing}; GPUs hold {real}"

    # The CDI spec names one device per slice-asking container with exactly its MIG UUIDs.
    found = cdi_file_for(system, node, ns, claim)
    assert found is not None, f"{aw}: no CDI file in {system.cdi_dir(node)}"
    path, cdi = found
    assert cdi.get("kind") == CDI_KIND, f"{path}: kind {cdi.get('kind')}"
    containers = slice_containers(pod)
    devices = {d["name"]: d for d in cdi.get("devices", [])}
    assert set(devices) == {cdi_device_name(ns, claim, c) for c in containers}, (
        f"{path}: devices {sorted(devices)} for containers {containers}"
    )
    env_of = {
        c["name"]: c.get("env", [])
        for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]
    }
    for c in containers:
        uuids = [h.mig_uuid for h in held if h.container == c]
        dev = devices[cdi_device_name(ns, claim, c)]
        env = dict(e.split("=", 1) for e in dev.get("containerEdits", {}).get("env", []))
        assert env.get(VISIBLE_DEVICES_ENV) == ",".join(uuids), (
            f"{path}: device of {c} has {VISIBLE_DEVICES_ENV}={env.get(VISIBLE_DEVICES_ENV)}, "
            f"allocation says {uuids}"
        )
        pod_env = {e["name"]: e.get("value") for e in env_of[c]}
        assert pod_env.get(VISIBLE_DEVICES_ENV) == qualified_cdi_device(ns, claim, c), (
            f"{where} container {c}: {VISIBLE_DEVICES_ENV}={pod_env.get(VISIBLE_DEVICES_ENV)}"
        )
    return alloc


async def assert_node_matches(kube: Kube, system: DevSystem, node: str) -> None:
    """The node's GPUs hold exactly the instances its allocations promise: none leaked, none
    duplicated, each at its recorded placement. Only call when nothing on `node` is moving."""
    allocs = (await kube.list(allocs_path(None), labelSelector=f"{NODE_LABEL}={node}"))["items"]
    want: list[tuple[int, str, int, int, str]] = []
    for a in allocs:
        assert a.get("status", {}).get("phase") == "Ready", (
            f"SliceAllocation {a['metadata']['namespace']}/{a['metadata']['name']} on {node} "
            f"is {a.get('status', {}).get('phase')}; settle the node before checking it"
        )
        want += [
            (h.gpu_index, h.profile, h.start, h.size, h.mig_uuid) for h in held_slices(system, a)
        ]
    real = [(i.gpu_index, i.profile, i.start, i.size, i.mig_uuid) for i in _instances(system, node)]
    assert sorted(real) == sorted(want), (
        f"{node}: GPUs hold {sorted(real)}\nallocations promise {sorted(want)}"
    )
    claims = {f"{a['metadata']['namespace']}/{a['metadata']['name']}" for a in allocs}
    files = {
        spec.get("annotations", {}).get(CLAIM_ANNOTATION, str(p))
        for p, spec in cdi_files(system, node).items()
    }
    assert files == claims, f"{node}: CDI files for {sorted(files)}, allocations {sorted(claims)}"


def assert_released(
    system: DevSystem, node: str, ns: str, claim: str, mig_uuids: Sequence[str]
) -> None:
    """After release: no instance with those MIG UUIDs on the node, no CDI file for the claim."""
    left = [i for i in _instances(system, node) if i.mig_uuid in set(mig_uuids)]
    assert not left, f"{ns}/{claim}: instances still on {node}: {left}"
    found = cdi_file_for(system, node, ns, claim)
    assert found is None, f"{ns}/{claim}: CDI file left on {node}: {found[0] if found else ''}"


def resource_of(profile: str) -> str:
    """What admission turns `nvidia.com/mig-<profile>` into."""
    return instaslice_resource(profile)
