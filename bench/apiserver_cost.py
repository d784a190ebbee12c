"""The API server's own CPU per request, for each request InstaSlice makes per pod (issue 25).

In a 1000-pod burst the kube-apiserver takes about half of all CPU, and its profile put
custom-resource status writes first (docs/benchmarks-history.md, "CPU per pod in our
processes"). This measures, per request kind, the CPU seconds the kube-apiserver process spent
(`utime + stime` in /proc/<pid>/stat, before and after a block of requests, less its idle
rate over the block's wall time), on a bare control plane (hack/cluster: etcd, API server,
scheduler, controller manager; no KWOK nodes, no InstaSlice processes) with InstaSlice's
manifests installed as `make dev-up` installs them (CRDs, RBAC, every admission policy).

Kinds, each as InstaSlice or the cluster sends it (identities: `admin` is system:masters,
as the bench fleet's node agent; `controller` the webhook/allocator ServiceAccount; `node`
a node agent's certificate `system:instaslice:node:<n>`, as in a real cluster, where the
node agent policies apply):

- `pod_create`: a pod as the webhook leaves it (gate, claim, `instaslice.io/mig-*`, env);
  no webhook call (the webhook is not running); `pod_create_plain`: a pod InstaSlice has
  nothing to do with (most of a cluster's creates: the pod policy's cost on every pod);
- `pod_status`: a status merge patch of a Running pod (what KWOK or a kubelet writes) of a
  gated InstaSlice pod; `pod_status_plain`: the same of a pod InstaSlice never touched;
- `pin_put`: the allocator's PUT (`webhook.allocator.pods.pin`), as `controller`;
  `pin_patch`: the same change as one merge patch;
- `event_post`: a pod event as `common.events.pod_event` writes it;
- `alloc_create`: the allocator's SliceAllocation (`common.allocation.build_allocation`);
- `alloc_status`: the agent's `Creating` then `Ready` status merge patches
  (`nodeagent.report`); per request, the mean of the two; `alloc_status_{json,apply,put}`:
  the same statuses as JSON patches, server-side apply, or PUTs of the object;
- `mignode_status`: the agent's MigNode status merge patch, 8 H100 GPUs with slices
  (~24 KB), two bodies alternating so each write changes something.

`--variants` names SliceAllocation CRD variants (each its own API group
`<variant>.cost.instaslice.io`, all served at once, so rounds alternate without rebuilding
anything): `shipped` (manifests/base/crds/sliceallocations.yaml), `norule` (without the
`x-kubernetes-validations` rule), `fields` (the rule on each spec field instead),
`schemaless` (no schema at all: the floor of what schema work costs). `alloc_*` kinds run
per variant. `--policies shipped unbound NAME=FILE` alternates versions of the pod policy
`instaslice-pods` (`unbound`: its binding deleted) for the pod kinds; `--start-policy`
sets one for the whole run; `--apiserver-arg=--profiling=true` allows a pprof meanwhile.
`--pprof DIR` then profiles the API server (`--pprof-s` seconds) while each of
`--pprof-cases` is sent without pause, once per policy variant and round, keeps the profiles
in DIR and reports the admission policies' share of the kind's handler path and their CPU
ms per request (profile samples over requests sent; bench/apiserver_pprof.py). Samples count
CPU spent in those frames only, so other work on the machine shifts them far less than the
per-block numbers above.

    python -m bench.apiserver_cost --requests 200 --rounds 4 --out FILE

Rounds rotate the order of the kinds so the machine's drift touches all alike; the result
is the median over rounds of CPU ms per request (and min/max). `make bench-apiserver` runs
it with `--policies shipped unbound` into `.dev/bench/apiserver.json` (`make bench-check`
reads it); `--pprof` needs Go's `go tool pprof`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from bench.apiserver_pprof import HANDLER, go_traces, share
from bench.latency_track import cpu_s, load
from common.allocation import build_allocation
from common.conditions import condition
from common.constants import (
    CLAIM_ANNOTATION,
    ENABLED_KEY,
    GATE_NAME,
    INSTASLICE_MIG_PREFIX,
    VISIBLE_DEVICES_ENV,
)
from common.kubeapi import ApiError, Kube, core_path, group_path, instaslice_path
from hack.cluster.controlplane import ClusterSettings, ControlPlane
from hack.dev import CONTROLLER_SA, INSTALL, MANIFESTS, NAMESPACE
from nodeagent.report import status_creating, status_ready

Obj = dict[str, Any]
NS = "cost"
PROFILE = "1g.10gb"
HOLD_GATE = "cost.instaslice.io/hold"  # keeps pinned pods gated: no scheduler work in a window
NODE = "cost-node"
NODE_USER = f"system:instaslice:node:{NODE}"
COST_GROUP = "cost.instaslice.io"
CRD_GROUP = "apiextensions.k8s.io/v1"


# ---- SliceAllocation CRD variants ----------------------------------------------------------------


def shipped_crd() -> Obj:
    doc: Obj = yaml.safe_load((MANIFESTS / "crds" / "sliceallocations.yaml").read_text())
    return doc


def _schema(crd: Obj) -> Obj:
    schema: Obj = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def _norule(crd: Obj) -> None:
    _schema(crd)["properties"]["spec"].pop("x-kubernetes-validations", None)


def _schemaless(crd: Obj) -> None:
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"] = {
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": True,
    }


def _fields(crd: Obj) -> None:
    """Immutability on each of spec's (all required) fields instead of on spec."""
    spec = _schema(crd)["properties"]["spec"]
    spec.pop("x-kubernetes-validations", None)
    for prop in spec["properties"].values():
        prop["x-kubernetes-validations"] = [{"rule": "self == oldSelf", "message": "immutable"}]


VARIANTS: dict[str, Callable[[Obj], None]] = {
    "shipped": lambda crd: None,
    "norule": _norule,
    "fields": _fields,
    "schemaless": _schemaless,
}


def variant_crd(name: str) -> Obj:
    """The SliceAllocation CRD as variant `name`, in its own group (`shipped`: the real one)."""
    crd = shipped_crd()
    if name == "shipped":
        return crd
    group = f"{name}.{COST_GROUP}"
    crd["metadata"]["name"] = f"sliceallocations.{group}"
    crd["spec"]["group"] = group
    VARIANTS[name](crd)
    return crd


def alloc_api(variant: str) -> str:
    return "instaslice.io/v1alpha1" if variant == "shipped" else f"{variant}.{COST_GROUP}/v1alpha1"


def alloc_collection(variant: str) -> str:
    if variant == "shipped":
        return instaslice_path("sliceallocations", NS)
    return group_path(alloc_api(variant), "sliceallocations", NS)


# ---- bodies, as InstaSlice writes them ---------------------------------------------------------


def gated_pod(name: str, claim: str) -> Obj:
    """A pod as the webhook leaves it (env binding mode), plus a gate of ours that keeps it
    gated after the pin (so no scheduler work falls into a measured window)."""
    device = f"instaslice.io/mig={NS}_{claim}_main"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {"app": "bench"},
            "annotations": {CLAIM_ANNOTATION: claim},
        },
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "schedulingGates": [{"name": GATE_NAME}, {"name": HOLD_GATE}],
            "containers": [
                {
                    "name": "main",
                    "image": "bench",
                    "env": [{"name": VISIBLE_DEVICES_ENV, "value": device}],
                    "resources": {
                        "limits": {f"{INSTASLICE_MIG_PREFIX}{PROFILE}": "1", "cpu": "100m"},
                        "requests": {f"{INSTASLICE_MIG_PREFIX}{PROFILE}": "1", "cpu": "100m"},
                    },
                }
            ],
        },
    }


def plain_pod(name: str) -> Obj:
    """A pod InstaSlice has nothing to do with (most of a cluster's), held by a gate of ours."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {"app": "plain"}},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "schedulingGates": [{"name": HOLD_GATE}],
            "containers": [
                {
                    "name": "main",
                    "image": "bench",
                    "env": [{"name": "MODE", "value": "serve"}],
                    "resources": {"limits": {"cpu": "100m"}, "requests": {"cpu": "100m"}},
                }
            ],
        },
    }


def pod_status(i: int) -> Obj:
    """A Running pod's status as a kubelet (KWOK) reports it; `i` flips Ready."""
    now = "2026-12-02T00:00:00Z"
    ready = "True" if i % 2 else "False"
    conds = [
        {"type": t, "status": s, "lastTransitionTime": now}
        for t, s in (
            ("PodReadyToStartContainers", "True"),
            ("Initialized", "True"),
            ("Ready", ready),
            ("ContainersReady", ready),
            ("PodScheduled", "True"),
        )
    ]
    return {
        "status": {
            "phase": "Running",
            "conditions": conds,
            "hostIP": "10.0.0.1",
            "podIP": f"10.0.{i % 250}.{i % 200 + 2}",
            "startTime": now,
            "containerStatuses": [
                {
                    "name": "main",
                    "image": "bench",
                    "imageID": "",
                    "ready": ready == "True",
                    "restartCount": 0,
                    "started": True,
                    "state": {"running": {"startedAt": now}},
                }
            ],
        }
    }


def allocation(variant: str, pod: Obj, claim: str) -> Obj:
    slices: Any = [
        {
            "container": "main",
            "profile": PROFILE,
            "gpuUUID": "GPU-00000000-0000-0000-0000-000000000001",
            "gpuIndex": 1,
            "start": 3,
            "size": 1,
        }
    ]
    body = build_allocation(namespace=NS, claim=claim, pod=pod, node=NODE, slices=slices)
    body["apiVersion"] = alloc_api(variant)
    body["metadata"]["annotations"] = {"instaslice.io/summary": f"main {PROFILE} gpu1@3"}
    return body


def creating() -> Obj:
    return status_creating("")


def ready(i: int) -> Obj:
    """`Ready` as `nodeagent.lifecycle` sends it."""
    now = "2026-12-02T00:00:00Z"
    conds = [
        condition("Ready", True, "SlicesCreated", f"main: MIG-{i}", now),
        condition("GPUHealthy", True, "Healthy", "", now),
    ]
    slices: Any = [{"container": "main", "migUUID": f"MIG-{i}", "giID": 7, "ciID": 0}]
    return status_ready(slices, "boot-id", conds)


def mig_node_statuses() -> tuple[Obj, Obj]:
    """Two statuses of one 8-GPU H100 node as the agent publishes them: all slots of GPU 0
    taken by 1g slices in one, GPU 0 empty in the other."""
    from nodeagent.checkpoint import Checkpoint
    from nodeagent.model import NodeInventory
    from nodeagent.report import mig_node_status
    from testkit.builders import gpu

    inv = NodeInventory(
        gpus=tuple(
            gpu(k, f"GPU-{k:08d}-0000-4000-8000-000000000000", "H100-80GB") for k in range(8)
        )
    )
    empty = mig_node_status(inv, {}, Checkpoint("n", "b", {}), [], version="v", boot_id="b")
    full = copy.deepcopy(empty)
    for g in full["gpus"]:
        g["slices"] = [
            {"profile": PROFILE, "start": s, "size": 1, "migUUID": f"MIG-{g['index']}-{s}",
             "claim": f"claim-{g['index']}-{s}"}
            for s in range(7)
        ]  # fmt: skip
    return empty, full


# ---- the measurement ---------------------------------------------------------------------------


@dataclass
class Case:
    """One request kind: `setup(n)` makes what `n` ops need (outside the window); `op(i)`
    sends op `i`, `per_op` requests."""

    name: str
    setup: Callable[[int], Awaitable[None]]
    op: Callable[[int], Awaitable[None]]
    per_op: int = 1


@dataclass
class Meter:
    """The API server's CPU over a block of requests, less its idle rate (the median of the
    idle windows so far: each block's own is measured after its setup has settled)."""

    pid: int
    idle_s: float = 1.5
    settle_s: float = 1.5
    idle_rate: list[float] = field(default_factory=list)

    async def idle(self) -> None:
        c0, t0 = cpu_s(self.pid), time.monotonic()
        await asyncio.sleep(self.idle_s)
        self.idle_rate.append((cpu_s(self.pid) - c0) / (time.monotonic() - t0))

    async def block(self, case: Case, n: int, concurrency: int) -> float:
        """API server CPU ms per request for `n` ops of `case`, net of its idle rate."""
        await case.setup(n)
        await asyncio.sleep(self.settle_s)  # the setup's watch fan-out settles
        await self.idle()
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with sem:
                await case.op(i)

        c0, t0 = cpu_s(self.pid), time.monotonic()
        await asyncio.gather(*(one(i) for i in range(n)))
        await asyncio.sleep(0.2)  # the requests' watch events are sent
        cpu, wall = cpu_s(self.pid) - c0, time.monotonic() - t0
        idle = statistics.median(self.idle_rate)
        return (cpu - idle * wall) * 1000 / (n * case.per_op)


@dataclass
class Bench:
    admin: Kube
    controller: Kube
    node: Kube
    seq: int = 0
    pods: list[Obj] = field(default_factory=list)
    allocs: dict[str, list[Obj]] = field(default_factory=dict)
    mig: tuple[Obj, Obj] = field(default_factory=mig_node_statuses)
    mignodes: int = 20

    def name(self, what: str) -> str:
        self.seq += 1
        return f"{what}-{self.seq:06d}"

    async def make_pods(self, n: int, plain: bool = False) -> None:
        sem = asyncio.Semaphore(8)

        async def one() -> Obj:
            async with sem:
                claim = uuid.uuid4().hex[:20]
                name = self.name("p")
                body = plain_pod(name) if plain else gated_pod(name, claim)
                return await self.admin.create(core_path("pods", NS), body)

        self.pods = list(await asyncio.gather(*(one() for _ in range(n))))

    # -- pods
    async def pod_create(self, i: int) -> None:
        await self.admin.create(
            core_path("pods", NS), gated_pod(self.name("c"), uuid.uuid4().hex[:20])
        )

    async def pod_create_plain(self, i: int) -> None:
        await self.admin.create(core_path("pods", NS), plain_pod(self.name("q")))

    async def pod_status(self, i: int) -> None:
        pod = self.pods[i]
        path = core_path("pods", NS, pod["metadata"]["name"]) + "/status"
        await self.admin.patch(path, pod_status(i))

    async def pin(self, i: int) -> None:
        from webhook.allocator.pods import pin

        pod = self.pods[i]
        path = core_path("pods", NS, pod["metadata"]["name"])
        await self.controller.replace(path, pin(pod, NODE))

    async def pin_patch(self, i: int) -> None:
        """The pin as one merge patch (the required term, the gates left), not a PUT."""
        from webhook.allocator.pods import pin

        pod = self.pods[i]
        pinned = pin(pod, NODE)["spec"]
        body = {"spec": {"affinity": pinned["affinity"],
                         "schedulingGates": pinned.get("schedulingGates")}}  # fmt: skip
        await self.controller.patch(core_path("pods", NS, pod["metadata"]["name"]), body)

    async def event(self, i: int) -> None:
        """`SliceReady` as the agent records it (`common.events.pod_event`)."""
        from common.constants import EventReason
        from common.events import pod_event

        pod = self.pods[i % len(self.pods)] if self.pods else {}
        meta = pod.get("metadata") or {"name": "p", "namespace": NS, "uid": "u"}
        await pod_event(self.admin, {"metadata": meta}, EventReason.SLICE_READY, f"main: MIG-{i}",
                        component="instaslice-nodeagent", instance="node-0")  # fmt: skip

    # -- SliceAllocations
    async def alloc_create(self, variant: str, i: int) -> None:
        pod = self.pods[i]
        claim = pod["metadata"]["annotations"][CLAIM_ANNOTATION]
        made = await self.controller.create(
            alloc_collection(variant), allocation(variant, pod, claim)
        )
        self.allocs.setdefault(variant, []).append(made)

    async def make_allocs(self, variant: str, n: int) -> None:
        await self.make_pods(n)
        self.allocs[variant] = []
        sem = asyncio.Semaphore(8)

        async def one(i: int) -> None:
            async with sem:
                await self.alloc_create(variant, i)

        await asyncio.gather(*(one(i) for i in range(n)))

    async def alloc_status(self, variant: str, kube: Kube, i: int, how: str = "merge") -> None:
        """`Creating` then `Ready`, sent as the agent does (`merge`), or as the same change
        in a JSON patch (`json`), a server-side apply (`apply`), or a PUT of the whole object
        with the new status (`put`)."""
        obj = self.allocs[variant][i]
        path = f"{alloc_collection(variant)}/{obj['metadata']['name']}/status"
        for body in (creating(), ready(i)):
            if how == "merge":
                await kube.patch(path, body)
            elif how == "json":
                ops = [{"op": "add", "path": f"/status/{k}", "value": v}
                       for k, v in body["status"].items()]  # fmt: skip
                if "status" not in obj:
                    ops = [{"op": "add", "path": "/status", "value": body["status"]}]
                obj = await kube.patch(path, ops, kind="json")
            elif how == "apply":
                applied = {"apiVersion": obj["apiVersion"], "kind": obj["kind"],
                           "metadata": {"name": obj["metadata"]["name"],
                                        "namespace": NS}, **body}  # fmt: skip
                await kube.request(
                    "PATCH", path, body=applied, content_type="application/apply-patch+yaml",
                    query={"fieldManager": "instaslice-nodeagent", "force": "true"},
                )  # fmt: skip
            else:
                obj = await kube.replace(path, {**obj, "status": body["status"]})

    # -- MigNodes
    async def make_mignodes(self) -> None:
        for k in range(self.mignodes):
            body = {"apiVersion": "instaslice.io/v1alpha1", "kind": "MigNode",
                    "metadata": {"name": f"{NODE}-{k}"}}  # fmt: skip
            try:
                await self.admin.create(instaslice_path("mignodes"), body)
            except ApiError as exc:
                if exc.status != 409:
                    raise

    async def mignode_status(self, i: int) -> None:
        k = i % self.mignodes
        body = {"status": self.mig[(i // self.mignodes) % 2]}
        await self.admin.patch(instaslice_path("mignodes", name=f"{NODE}-{k}") + "/status", body)


def cases(b: Bench, variants: Sequence[str]) -> list[Case]:
    async def nothing(n: int) -> None:
        return None

    async def mignodes(n: int) -> None:
        await b.make_mignodes()

    out = [
        Case("pod_create", nothing, b.pod_create),
        Case("pod_create_plain", nothing, b.pod_create_plain),
        Case("pod_status", b.make_pods, b.pod_status),
        Case("pod_status_plain", partial(b.make_pods, plain=True), b.pod_status),
        Case("pin_put", b.make_pods, b.pin),
        Case("pin_patch", b.make_pods, b.pin_patch),
        Case("event_post", b.make_pods, b.event),
        Case("mignode_status", mignodes, b.mignode_status),
    ]
    for v in variants:
        out.append(Case(f"alloc_create[{v}]", b.make_pods, partial(b.alloc_create, v)))
        out.append(
            Case(
                f"alloc_status[{v}]",
                partial(b.make_allocs, v),
                partial(b.alloc_status, v, b.admin),
                per_op=2,
            )
        )
    for how in ("json", "apply", "put"):
        out.append(
            Case(
                f"alloc_status_{how}[shipped]",
                partial(b.make_allocs, "shipped"),
                partial(b.alloc_status, "shipped", b.admin, how=how),
                per_op=2,
            )
        )
    out.append(
        Case(
            "alloc_status[shipped,node]",
            partial(b.make_allocs, "shipped"),
            partial(b.alloc_status, "shipped", b.node),
            per_op=2,
        )
    )
    return out


# ---- the control plane -------------------------------------------------------------------------


def install(cp: ControlPlane, variants: Sequence[str]) -> None:
    """InstaSlice's manifests as `make dev-up` applies them, the variant CRDs, the node
    agent policies widened to the variants' groups, and the bench's namespace and RBAC."""
    docs: list[Obj] = []
    for f in INSTALL:
        docs += [d for d in yaml.safe_load_all((MANIFESTS / f).read_text()) if d]
    docs += [variant_crd(v) for v in variants if v != "shipped"]
    groups = sorted({f"{v}.{COST_GROUP}" for v in variants if v != "shipped"})
    for d in docs:
        if d["kind"] == "ValidatingAdmissionPolicy" and d["metadata"]["name"].startswith(
            "instaslice-nodeagent-sliceallocations"
        ):
            d["spec"]["matchConstraints"]["resourceRules"][0]["apiGroups"] += groups
    docs.append({"apiVersion": "v1", "kind": "Namespace",
                 "metadata": {"name": NS, "labels": {ENABLED_KEY: "true"},
                              "annotations": {ENABLED_KEY: "true"}}})  # fmt: skip
    # `pin_patch` only: the allocator's RBAC has `update` on pods, not `patch`
    docs.append({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": {"name": "cost-pod-patch"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]}],
    })  # fmt: skip
    docs.append({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": "cost-pod-patch"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": "cost-pod-patch"},
        "subjects": [{"kind": "ServiceAccount", "name": CONTROLLER_SA, "namespace": NAMESPACE}],
    })  # fmt: skip
    if groups:
        docs.append({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": {"name": "cost-variants"},
            "rules": [{"apiGroups": groups, "resources": ["sliceallocations",
                       "sliceallocations/status"], "verbs": ["*"]}],
        })  # fmt: skip
        for subject in (
            {
                "kind": "Group",
                "apiGroup": "rbac.authorization.k8s.io",
                "name": "instaslice:nodeagents",
            },
            {"kind": "ServiceAccount", "name": CONTROLLER_SA, "namespace": NAMESPACE},
        ):
            docs.append({
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                "metadata": {"name": f"cost-variants-{subject['kind'].lower()}"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                            "name": "cost-variants"},
                "subjects": [subject],
            })  # fmt: skip
    cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
               stdin=yaml.safe_dump_all(docs))  # fmt: skip
    for d in docs:
        if d["kind"] == "CustomResourceDefinition":
            cp.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                       f"crd/{d['metadata']['name']}")  # fmt: skip


async def ready_to_serve(b: Bench, variants: Sequence[str]) -> None:
    """Every CR's storage answers and the policies admit the bench's pods (the policy
    informers have synced): a few of each write, discarded."""
    for _ in range(300):
        try:
            await b.make_pods(2)
            for v in variants:
                await b.make_allocs(v, 2)
                await b.alloc_status(v, b.admin, 0)
            await b.alloc_status("shipped", b.node, 1)
            return
        except ApiError as exc:
            # the pod policy refuses content (422) until it has seen the opt-in label
            if exc.status not in (403, 404, 422, 429, 500, 503):
                raise
            await asyncio.sleep(0.2)
    raise TimeoutError("the bench's writes never went through")


# ---- pod policy variants -----------------------------------------------------------------------

POD_CASES = ("pod_create", "pod_create_plain", "pod_status", "pod_status_plain", "pin_put")
# the handler path (bench.apiserver_pprof.HANDLER) each kind's requests take
KIND_PATH = {"pod_create": "create", "pod_create_plain": "create", "pod_status": "patch",
             "pod_status_plain": "patch", "pin_put": "update", "pin_patch": "patch"}  # fmt: skip
POD_POLICY = MANIFESTS / "policy" / "validatingadmissionpolicy.yaml"


def policy_variant(cp: ControlPlane, spec: str) -> None:
    """Make the `instaslice-pods` policy what `spec` says: `shipped` (the manifest),
    `unbound` (its binding deleted: the policy's cost, by difference) or `NAME=PATH`
    (the policy in the YAML file PATH), and wait for the API server to pick it up."""
    binding = yaml.safe_load((MANIFESTS / "policy" / "binding.yaml").read_text())
    if spec == "unbound":
        cp.kubectl("delete", "validatingadmissionpolicybinding", binding["metadata"]["name"],
                   "--ignore-not-found")  # fmt: skip
    else:
        path = POD_POLICY if spec == "shipped" else Path(spec.split("=", 1)[1])
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d] + [binding]
        cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                   stdin=yaml.safe_dump_all(docs))  # fmt: skip
    time.sleep(3.0)  # the API server's policy informer (no way to ask it)


async def profiled(
    cp: ControlPlane, case: Case, seconds: int, n: int, concurrency: int
) -> tuple[bytes, int]:
    """A CPU profile of the API server over `seconds` while `case` is sent without pause
    (blocks of `n`, each after its setup), and how many requests were sent meanwhile."""
    prof = await asyncio.create_subprocess_exec(
        str(cp.kubectl_path), f"--kubeconfig={cp.kubeconfig}", "get", "--raw",
        f"/debug/pprof/profile?seconds={seconds}", stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    done = asyncio.ensure_future(prof.communicate())
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            await case.op(i)

    sent = 0
    while not done.done():
        await case.setup(n)
        await asyncio.gather(*(one(i) for i in range(n)))
        sent += n * case.per_op
    data, _ = await done
    if prof.returncode:
        raise RuntimeError(f"pprof: kubectl exited {prof.returncode}")
    return data, sent


async def pprof_rounds(cp: ControlPlane, b: Bench, args: argparse.Namespace, out: Obj) -> None:
    """`--pprof DIR`: per round, policy variant and kind, a profile and its policy share."""
    args.pprof.mkdir(parents=True, exist_ok=True)
    specs = args.policies or [args.start_policy]
    todo = [c for c in cases(b, []) if c.name in args.pprof_cases]
    shares: dict[str, list[Obj]] = {}
    for r in range(args.rounds):
        k = r % len(specs)
        for spec in specs[k:] + specs[:k]:
            await asyncio.to_thread(policy_variant, cp, spec)
            name = spec.split("=")[0]
            for c in todo:
                data, sent = await profiled(cp, c, args.pprof_s, args.requests, args.concurrency)
                path = args.pprof / f"{c.name}-{name}-{r + 1}.pprof"
                path.write_bytes(data)
                got = share(await asyncio.to_thread(go_traces, path), KIND_PATH[c.name])
                shares.setdefault(f"{c.name}[policy={name}]", []).append(
                    {"path_s": got.path_s, "policies_s": got.policies_s,
                     "fraction": round(got.fraction, 3), "requests": sent,
                     "path_ms_per_request": round(got.path_s * 1000 / sent, 3),
                     "policies_ms_per_request": round(got.policies_s * 1000 / sent, 3),
                     "profile": path.name}
                )  # fmt: skip
                print(f"pprof round {r + 1} {c.name}[policy={name}]: {got.policies_s:.2f} of "
                      f"{got.path_s:.2f} s ({got.fraction:.1%}), {sent} requests",
                      flush=True)  # fmt: skip
    if args.policies:
        await asyncio.to_thread(policy_variant, cp, args.start_policy)
    out["pprof"] = {
        k: {"median_fraction": round(statistics.median(x["fraction"] for x in v), 3),
            "median_policies_ms_per_request": round(
                statistics.median(x["policies_ms_per_request"] for x in v), 3),
            "median_path_ms_per_request": round(
                statistics.median(x["path_ms_per_request"] for x in v), 3),
            "handler": HANDLER[KIND_PATH[k.split("[")[0]]], "rounds": v}
        for k, v in shares.items()
    }  # fmt: skip


async def run(cp: ControlPlane, args: argparse.Namespace, out: Obj) -> None:
    pid = next(p.pid for p in cp.processes if p.name == "kube-apiserver")
    node_kc = cp.user_kubeconfig(NODE_USER, ("instaslice:nodeagents",))
    ctl_kc = cp.service_account_kubeconfig(NAMESPACE, CONTROLLER_SA)
    async with (
        await Kube.connect(str(cp.kubeconfig)) as admin,
        await Kube.connect(str(ctl_kc)) as controller,
        await Kube.connect(str(node_kc)) as node,
    ):
        b = Bench(admin, controller, node)
        await ready_to_serve(b, args.variants)
        await b.make_mignodes()
        meter = Meter(pid, args.idle_s)
        todo = [c for c in cases(b, args.variants) if not args.only or c.name in args.only]
        per: dict[str, list[float]] = {c.name: [] for c in todo}
        for r in range(args.rounds if todo else 0):
            order = todo[r % len(todo) :] + todo[: r % len(todo)]
            for c in order:
                per[c.name].append(await meter.block(c, args.requests, args.concurrency))
            done = ", ".join(f"{k} {v[-1]:.3f}" for k, v in per.items())
            print(f"round {r + 1} (idle {meter.idle_rate[-1]:.3f}): {done}", flush=True)
        if args.policies:
            pod_cases = [c for c in cases(b, []) if c.name in POD_CASES]
            for r in range(args.rounds):
                k = r % len(args.policies)
                for spec in args.policies[k:] + args.policies[:k]:
                    await asyncio.to_thread(policy_variant, cp, spec)
                    for c in pod_cases:
                        key = f"{c.name}[policy={spec.split('=')[0]}]"
                        cost = await meter.block(c, args.requests, args.concurrency)
                        per.setdefault(key, []).append(cost)
                done = ", ".join(f"{k} {v[-1]:.3f}" for k, v in per.items() if "policy=" in k)
                print(f"policy round {r + 1}: {done}", flush=True)
            await asyncio.to_thread(policy_variant, cp, "shipped")
        if args.pprof is not None:
            await pprof_rounds(cp, b, args, out)
        with contextlib.suppress(statistics.StatisticsError):
            out["idle_cores"] = round(statistics.median(meter.idle_rate), 4)
        out["cpu_ms_per_request"] = {
            k: {"median": round(statistics.median(v), 3), "min": round(min(v), 3),
                "max": round(max(v), 3), "rounds": [round(x, 3) for x in v]}
            for k, v in per.items()
        }  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.apiserver_cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--requests", type=int, default=200, help="ops per block")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--idle-s", type=float, default=1.5, help="idle window before each block")
    ap.add_argument("--variants", nargs="*", default=["shipped", "norule", "schemaless"],
                    choices=sorted(VARIANTS))  # fmt: skip
    ap.add_argument(
        "--only",
        nargs="*",
        default=[],
        help="case names to run (default: all; `none`: only --policies and --pprof)",
    )
    ap.add_argument(
        "--policies", nargs="*", default=[], help="pod policy variants: shipped, unbound, NAME=PATH"
    )
    ap.add_argument("--start-policy", default="shipped", help="the pod policy for all cases")
    ap.add_argument(
        "--apiserver-arg", action="append", default=[], help="e.g. --profiling=true (pprof)"
    )
    ap.add_argument("--pprof", type=Path, default=None, help="profiles into DIR (see above)")
    ap.add_argument("--pprof-s", type=int, default=30, help="seconds per profile")
    ap.add_argument("--pprof-cases", nargs="*", default=["pod_create", "pod_create_plain"],
                    choices=sorted(KIND_PATH))  # fmt: skip
    ap.add_argument("--dir", type=Path, default=Path(".dev/bench/apiserver-cost"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    out: Obj = {"load_start": load(), "requests": args.requests, "rounds": args.rounds,
                "concurrency": args.concurrency, "variants": args.variants}  # fmt: skip
    t0 = time.monotonic()
    extra = [*args.apiserver_arg, *(["--profiling=true"] if args.pprof is not None else [])]
    settings = ClusterSettings(kwok=False, extra_apiserver_args=tuple(extra))
    with ControlPlane.start(args.dir, settings=settings) as cp:
        install(cp, args.variants)
        if args.start_policy != "shipped":
            policy_variant(cp, args.start_policy)
        asyncio.run(run(cp, args, out))
    out.update(load_end=load(), wall_s=round(time.monotonic() - t0, 1))
    text = json.dumps(out, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
