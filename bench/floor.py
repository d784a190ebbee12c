"""The floor of the sequential path: the least time the contract's chain can take here.

On-demand slicing adds, in series, to the path of a statically sliced pod (create → the
scheduler binds → Running): the admission webhook's call, and three writes each of which
waits for the previous one's watch event (docs/contract.md, the lifecycle):

    POST pod (webhook gates it) → allocator sees it → POST SliceAllocation → agent sees it
    → slices made → PATCH status Ready → allocator sees it → PUT pod (pin + ungate) →
    scheduler binds → Running

`Creating` is optional (written only when making the slices takes long): its link, the
status patch answered, is measured and reported beside the floor (`floor_with_creating_ms`,
the chain before it became optional), not counted in it.

Each link is measured here on its own, against the same control plane and fleet as
`bench.latency` (InstaSlice running, idle), one request at a time, the kinds interleaved so
the machine's drift touches all alike; the sum is the least time the chain can take with
NVML, the decision and the agent's local work all at zero. The static pod's create →
Running is measured in the same rounds, so the best InstaSlice / static ratio this machine
allows is the floor / static.

    python -m bench.latency --scenarios floor [--set floor_rounds=40]

What each link is (client-side times, ms, from sending to the watch event or answer):
- `static`: a pod asking pre-sliced `nvidia.com/mig-*` capacity, created → Running;
- `post_plain`, `post_noop`, `post_instaslice`: a dry-run create of the same pod in a
  namespace no webhook serves / one a no-op webhook (this process: answers with the same
  kind of patch, adds a gate) serves / an InstaSlice namespace (the real webhook): the
  webhook call's own cost, without the pipeline behind it; `noop_handler` the no-op
  webhook's time inside its handler;
- `gated_seen`: a pod the no-op webhook gates, created → its ADDED event seen;
- `cr_seen`: a small custom resource (this module's CRD: a status subresource, no schema
  beyond `x-kubernetes-preserve-unknown-fields`) created → seen; `alloc_seen`: a real
  SliceAllocation of a pod no agent serves (node label of no node) created → seen;
- `status_answer`, `status_seen`: a merge patch of that SliceAllocation's status, answered /
  seen (`Creating` needs the answer before `Ready` may be sent; `Ready` needs the event);
- `ungate_put`, `ungate_patch`: a gated pod pinned to a node and ungated in one PUT (the
  allocator's write) / in one merge patch → Running (scheduler, binding, KWOK included).

A scenario of `bench.latency` (`floor`, part of `make bench-latency`): its entry
`scenarios.floor` holds each link's p50/p90 and `chain`, the floor and its ratio to static.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import math
import ssl
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from bench import latency_fleet as bl
from bench.latency_track import latency_delta
from common.constants import CLAIM_ANNOTATION
from common.kubeapi import ApiError, Informer, Kube, core_path, group_path, instaslice_path
from hack.dev import MANIFESTS

Obj = dict[str, Any]
PLAIN_NS = "floor-plain"  # no webhook
NOOP_NS = "floor-noop"  # the no-op webhook of this module
NOOP_LABEL = "floor.instaslice.io/noop"
CRD_GROUP = "floor.instaslice.io"
CRD_PLURAL = "probes"
FLOOR_GATE = "floor.instaslice.io/gate"  # not InstaSlice's gate: its policy guards that one
HOLD = "floor.instaslice.io/hold"  # keeps a SliceAllocation the allocator deletes (no pod)
NO_NODE = "floor-no-such-node"  # SliceAllocations the agent never sees (no node has it)
LINKS = (
    "static", "post_plain", "post_noop", "post_instaslice", "noop_handler", "gated_seen",
    "cr_seen", "alloc_seen", "status_answer", "status_seen", "ungate_put", "ungate_patch",
)  # fmt: skip


# ---- a watch that says when it saw something ---------------------------------------------------


@dataclass
class Seen:
    """Futures completed at the moment a watch event satisfying a predicate arrives."""

    clock: Callable[[], float] = time.perf_counter
    waiting: list[tuple[str, Callable[[str, Obj], bool], asyncio.Future[float]]] = field(
        default_factory=list
    )

    def expect(self, name: str, pred: Callable[[str, Obj], bool]) -> asyncio.Future[float]:
        fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self.waiting.append((name, pred, fut))
        return fut

    async def on_event(self, etype: str, obj: Obj) -> None:
        now = self.clock()
        name = obj.get("metadata", {}).get("name", "")
        keep = []
        for want, pred, fut in self.waiting:
            if fut.done():
                continue
            if want == name and pred(etype, obj):
                fut.set_result(now)
            else:
                keep.append((want, pred, fut))
        self.waiting = keep


def added(etype: str, obj: Obj) -> bool:
    return etype == "ADDED"


def running(etype: str, obj: Obj) -> bool:
    return bool(obj.get("status", {}).get("phase") == "Running")


def gone(etype: str, obj: Obj) -> bool:
    return etype == "DELETED"


def phase_is(phase: str) -> Callable[[str, Obj], bool]:
    return lambda etype, obj: (obj.get("status") or {}).get("phase") == phase


# ---- the no-op webhook -------------------------------------------------------------------------

MIG_WEBHOOK = "mig.pods.instaslice.io"  # InstaSlice's entry the no-op one copies


@dataclass
class NoopWebhook:
    """Answers every review with a patch adding one scheduling gate (what InstaSlice's
    answer does, minus its decision); counts the connections the API server opened."""

    handler_s: list[float] = field(default_factory=list)
    peers: set[object] = field(default_factory=set)

    async def mutate(self, request: web.Request) -> web.Response:
        t0 = time.perf_counter()
        self.peers.add(request.transport.get_extra_info("peername") if request.transport else 0)
        review = json.loads(await request.read())
        pod = review["request"].get("object") or {}
        gates = pod.get("spec", {}).get("schedulingGates")
        op: Obj = (
            {"op": "add", "path": "/spec/schedulingGates/-", "value": {"name": FLOOR_GATE}}
            if gates
            else {"op": "add", "path": "/spec/schedulingGates", "value": [{"name": FLOOR_GATE}]}
        )
        patch = base64.b64encode(json.dumps([op]).encode()).decode()
        answer = {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "response": {
                "uid": review["request"]["uid"],
                "allowed": True,
                "patchType": "JSONPatch",
                "patch": patch,
            },
        }
        resp = web.json_response(answer)
        self.handler_s.append(time.perf_counter() - t0)
        return resp


def noop_configuration(url: str, ca_pem: bytes) -> Obj:
    """InstaSlice's own MutatingWebhookConfiguration entry for MIG asks (rules,
    matchConditions, timeout), pointed at the no-op webhook and the floor's namespace. Taken
    by name: the whole-GPU entry, first in the file, matches no MIG pod, and the floor's
    probe then waited for a gate that never came."""
    mwc = yaml.safe_load((MANIFESTS / "webhook" / "mutatingwebhookconfiguration.yaml").read_text())
    # the MIG pods' entry by name: the whole-GPU one comes first in the file
    hook = copy.deepcopy(next(h for h in mwc["webhooks"] if h["name"] == MIG_WEBHOOK))
    hook["name"] = "noop.floor.instaslice.io"
    hook["clientConfig"] = {"url": url, "caBundle": base64.b64encode(ca_pem).decode()}
    hook["namespaceSelector"] = {"matchLabels": {NOOP_LABEL: "true"}}
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": "floor-noop"},
        "webhooks": [hook],
    }


CRD: Obj = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"{CRD_PLURAL}.{CRD_GROUP}"},
    "spec": {
        "group": CRD_GROUP,
        "names": {"kind": "Probe", "plural": CRD_PLURAL, "singular": "probe"},
        "scope": "Namespaced",
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                    }
                },
            }
        ],
    },
}


# ---- the links ---------------------------------------------------------------------------------


def gated_pod(name: str, gate: bool = True) -> Obj:
    body = bl.pod(name)
    if gate:
        body["spec"]["schedulingGates"] = [{"name": FLOOR_GATE}]
    return body


def alloc_body(name: str) -> Obj:
    """A SliceAllocation as the allocator writes one, for a node no agent serves and a pod
    that does not exist (the allocator releases such a record later: after it was seen)."""
    return {
        "apiVersion": "instaslice.io/v1alpha1",
        "kind": "SliceAllocation",
        "metadata": {
            "name": name,
            "namespace": PLAIN_NS,
            "labels": {"instaslice.io/node": NO_NODE},
            "finalizers": [HOLD],
        },
        "spec": {
            "podName": name,
            "podUID": "00000000-0000-0000-0000-000000000000",
            "nodeName": NO_NODE,
            "slices": [
                {
                    "container": "main",
                    "profile": bl.PROFILE,
                    "gpuUUID": "GPU-00000000-0000-0000-0000-000000000000",
                    "start": 0,
                    "size": 1,
                }
            ],
        },
    }


def pin_patch(node: str) -> Obj:
    """The allocator's PUT as a merge patch: the required node term and no gate left."""
    term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
    return {
        "spec": {
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}
                }
            },
            "schedulingGates": None,
        }
    }


@dataclass
class Floor:
    kube: Kube
    nodes: list[str]
    pods: Seen
    crs: Seen
    noop: NoopWebhook
    times: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in LINKS})
    seq: int = 0

    def name(self, what: str) -> str:
        self.seq += 1
        return f"f{what}{self.seq:04d}"

    def note(self, link: str, seconds: float) -> None:
        self.times[link].append(seconds * 1e3)

    async def timed(self, coro: Any) -> tuple[float, Any]:
        t0 = time.perf_counter()
        out = await coro
        return time.perf_counter() - t0, out

    async def static(self) -> str:
        name = self.name("s")
        fut = self.pods.expect(name, running)
        t0 = time.perf_counter()
        await self.kube.create(core_path("pods", bl.STATIC_NS), bl.pod(name))
        self.note("static", await asyncio.wait_for(fut, 30) - t0)
        return name

    async def dry_runs(self) -> None:
        for link, ns in (
            ("post_plain", PLAIN_NS),
            ("post_noop", NOOP_NS),
            ("post_instaslice", bl.NS),
        ):
            s, out = await self.timed(
                self.kube.create(core_path("pods", ns), bl.pod(self.name("d")), dryRun="All")
            )
            if link == "post_instaslice":  # the real webhook answered: the pod came back gated
                assert CLAIM_ANNOTATION in out["metadata"].get("annotations", {}), out
            self.note(link, s)

    async def gated(self) -> str:
        """A pod the no-op webhook gates: create → seen."""
        name = self.name("g")
        fut = self.pods.expect(name, added)
        t0 = time.perf_counter()
        await self.kube.create(core_path("pods", NOOP_NS), gated_pod(name, gate=False))
        self.note("gated_seen", await asyncio.wait_for(fut, 30) - t0)
        return name

    async def custom(self) -> None:
        name = self.name("c")
        fut = self.crs.expect(name, added)
        body = {"apiVersion": f"{CRD_GROUP}/v1", "kind": "Probe", "metadata": {"name": name}}
        t0 = time.perf_counter()
        await self.kube.create(group_path(f"{CRD_GROUP}/v1", CRD_PLURAL, PLAIN_NS), body)
        self.note("cr_seen", await asyncio.wait_for(fut, 30) - t0)

    async def allocation(self) -> None:
        name = self.name("a")
        fut = self.crs.expect(name, added)
        t0 = time.perf_counter()
        await self.kube.create(instaslice_path("sliceallocations", PLAIN_NS), alloc_body(name))
        self.note("alloc_seen", await asyncio.wait_for(fut, 30) - t0)
        status = {"status": {"phase": "Creating"}}
        fut = self.crs.expect(name, phase_is("Creating"))
        t0 = time.perf_counter()
        await self.kube.patch(
            instaslice_path("sliceallocations", PLAIN_NS, name) + "/status", status
        )
        self.note("status_answer", time.perf_counter() - t0)
        self.note("status_seen", await asyncio.wait_for(fut, 30) - t0)
        path = instaslice_path("sliceallocations", PLAIN_NS, name)
        await self.kube.patch(path, {"metadata": {"finalizers": None}})
        await self.kube.delete_ignore_missing(path)

    async def ungate(self, name: str, ns: str, node: str, how: str) -> None:
        path = core_path("pods", ns, name)
        fut = self.pods.expect(name, running)
        pod = await self.kube.get(path)
        t0 = time.perf_counter()
        if how == "put":
            await self.kube.replace(path, _pinned(pod, node))
        else:
            await self.kube.patch(path, pin_patch(node))
        self.note(f"ungate_{how}", await asyncio.wait_for(fut, 30) - t0)

    async def round(self, i: int) -> None:
        node = self.nodes[i % len(self.nodes)]
        made = [(await self.static(), bl.STATIC_NS)]
        await self.dry_runs()
        g = await self.gated()
        made.append((g, NOOP_NS))
        await self.custom()
        await self.allocation()
        plain = self.name("p")
        seen = self.pods.expect(plain, added)
        await self.kube.create(core_path("pods", PLAIN_NS), gated_pod(plain))
        await asyncio.wait_for(seen, 30)
        made.append((plain, PLAIN_NS))
        # the two ways of ungating, in alternating order
        ways = [(g, NOOP_NS, "put"), (plain, PLAIN_NS, "patch")]
        if i % 2:
            ways = [(g, NOOP_NS, "patch"), (plain, PLAIN_NS, "put")]
        for pod_name, ns, how in ways:
            await self.ungate(pod_name, ns, node, how)
        await self.clean(made)

    async def clean(self, made: list[tuple[str, str]]) -> None:
        futs = [self.pods.expect(n, gone) for n, _ in made]
        for n, ns in made:
            await self.kube.delete_ignore_missing(core_path("pods", ns, n), gracePeriodSeconds=0)
        await asyncio.wait_for(asyncio.gather(*futs), 60)


def _pinned(pod: Obj, node: str) -> Obj:
    out = copy.deepcopy(pod)
    term = pin_patch(node)["spec"]["affinity"]
    out["spec"]["affinity"] = term
    out["spec"].pop("schedulingGates", None)
    return out


def p50(xs: list[float]) -> float:
    return round(statistics.median(xs), 2) if xs else float("nan")


def chain(p: dict[str, float]) -> dict[str, float]:
    """The contract's chain from the measured links (ms, p50 each), and its floor ratio.

    admit (webhook) → seen, SliceAllocation → seen, Ready → seen, pin + ungate → Running.
    The webhook's cost is the no-op webhook's (InstaSlice's own extra is reported beside
    it, not counted in the floor); so is the optional `Creating` answered."""
    admit = p["gated_seen"]
    total = admit + p["alloc_seen"] + p["status_seen"] + p["ungate_put"]
    return {
        "admit_seen_ms": admit,
        "allocation_seen_ms": p["alloc_seen"],
        "creating_answered_ms": p["status_answer"],
        "ready_seen_ms": p["status_seen"],
        "pin_to_running_ms": p["ungate_put"],
        "floor_ms": round(total, 2),
        "floor_with_creating_ms": round(total + p["status_answer"], 2),
        "static_ms": p["static"],
        "floor_ratio": round(total / p["static"], 2),
        "webhook_noop_extra_ms": round(p["post_noop"] - p["post_plain"], 2),
        "webhook_instaslice_extra_ms": round(p["post_instaslice"] - p["post_plain"], 2),
    }


# ---- setup and main ----------------------------------------------------------------------------


async def setup(fleet: bl.Fleet, url: str) -> None:
    kube = fleet.kube
    await kube.create(core_path("namespaces"), {"metadata": {"name": PLAIN_NS}})
    body = {"metadata": {"name": NOOP_NS, "labels": {NOOP_LABEL: "true"}}}
    await kube.create(core_path("namespaces"), body)
    mwc = noop_configuration(url, fleet.system.cp.ca_cert_pem)
    await kube.create(
        group_path("admissionregistration.k8s.io/v1", "mutatingwebhookconfigurations"), mwc
    )
    await kube.create(group_path("apiextensions.k8s.io/v1", "customresourcedefinitions"), CRD)
    for ns in (PLAIN_NS, NOOP_NS):
        await bl.service_account(kube, ns)
    for _ in range(300):  # the CRD established and the webhook registered
        try:
            await kube.list(group_path(f"{CRD_GROUP}/v1", CRD_PLURAL, PLAIN_NS))
            out = await kube.create(
                core_path("pods", NOOP_NS), gated_pod("probe", gate=False), dryRun="All"
            )
            if out["spec"].get("schedulingGates"):
                return
        except ApiError as exc:
            if not (exc.not_found or exc.retryable):  # 429: the new kind's storage starting
                raise
        await asyncio.sleep(0.1)
    raise TimeoutError("the floor's CRD or webhook never became ready")


async def run(fleet: bl.Fleet, out: Obj, rounds: int, warmup: int) -> None:
    noop = NoopWebhook()
    app = web.Application()
    app.router.add_post("/mutate", noop.mutate)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    issued = fleet.system.cp.issue_serving_cert(("127.0.0.1", "localhost"))
    with tempfile.TemporaryDirectory(prefix="floor-tls-") as tmp:
        issued.write(Path(tmp, "tls.crt"), Path(tmp, "tls.key"))
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.set_alpn_protocols(["http/1.1"])
        ctx.load_cert_chain(Path(tmp, "tls.crt"), Path(tmp, "tls.key"))
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
    await site.start()
    port = int(runner.addresses[0][1])
    pods, crs = Seen(), Seen()
    informers = [
        Informer(fleet.kube, core_path("pods", ns), pods.on_event, name=f"floor-{ns}")
        for ns in (PLAIN_NS, NOOP_NS, bl.STATIC_NS)
    ]
    try:
        await setup(fleet, f"https://127.0.0.1:{port}/mutate")
        informers += [
            Informer(fleet.kube, group_path(f"{CRD_GROUP}/v1", CRD_PLURAL, PLAIN_NS), crs.on_event),
            Informer(fleet.kube, instaslice_path("sliceallocations", PLAIN_NS), crs.on_event),
        ]
        tasks = [asyncio.create_task(i.run()) for i in informers]
        for inf in informers:
            await inf.synced.wait()
        f = Floor(fleet.kube, list(fleet.system.nodes), pods, crs, noop)
        for i in range(warmup):
            await f.round(i)
        f.times = {k: [] for k in LINKS}
        noop.handler_s.clear()
        res: Obj = {}
        hook_port = fleet.system.webhook_port
        peers_before = peers(hook_port)
        scraped = await fleet.scrape()
        await fleet.measured(res, rounds, _rounds(f, rounds))
        peers_after = peers(hook_port)
        res["apiserver_latency"] = latency_delta(scraped, await fleet.scrape())
        f.times["noop_handler"] = [s * 1e3 for s in noop.handler_s]
        p = {k: p50(v) for k, v in f.times.items()}
        out.update(
            rounds=rounds,
            p50_ms=p,
            p90_ms={k: round(_q(v, 0.9), 2) for k, v in f.times.items() if v},
            chain=chain(p),
            noop_connections=len(noop.peers),
            instaslice_webhook_connections={
                "before": len(peers_before),
                "after": len(peers_after),
                "kept": len(peers_before & peers_after),
            },
            apiserver_latency=res["apiserver_latency"],
            system_cpu_s=res["system_cpu_s"],
            load_start=res["load_start"],
            load_end=res["load_end"],
        )
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await runner.cleanup()


def peers(port: int) -> set[str]:
    """The remote ends of the TCP connections established to local `port` (`ss`): the API
    server's connections to a webhook, to tell whether it reuses them."""
    proc = subprocess.run(
        ["ss", "-Htn", "state", "established", f"( sport = :{port} )"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return {line.split()[-1] for line in proc.stdout.splitlines() if line.split()}


async def _rounds(f: Floor, rounds: int) -> None:
    for i in range(rounds):
        await f.round(i)


def _q(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def line(out: Obj) -> str:
    """One log line: the floor, static, and their ratio."""
    c = out.get("chain") or {}
    return (
        f"floor {c.get('floor_ms', math.nan):.1f} ms, static {c.get('static_ms', math.nan):.1f} "
        f"ms, ratio {c.get('floor_ratio', math.nan):.2f} ({out.get('rounds', 0)} rounds)"
    )
