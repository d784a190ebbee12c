"""Builders and an emulated node agent for the allocator's tests.

Builders (`make_pod`, `make_node`, `make_mig_node`, `make_allocation`) live in
testkit/builders.py, shared with bench/, and are re-exported here for the allocator's test
modules; the unit tests use them without a cluster.

`FakeAgent` plays the node agents' part against the real API server, which is all the
allocator sees of them: it marks each new SliceAllocation Ready with fake MIG UUIDs (or
Failed, or holds it Pending, as a test asks) and drops the release finalizer of allocations
being deleted. The real node agent and its emulator are exercised by the e2e tests.

`kube` (session scope, imported by the allocator's test modules): a cluster-admin client
of the test control plane, InstaSlice's CRDs created and established.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from common.clock import cancel_until_done
from common.constants import (
    ENABLED_KEY,
    MIG_NODE_PLURAL,
    RELEASE_FINALIZER,
    SLICE_ALLOCATION_PLURAL,
    WHOLE_GPU_KEY,
)
from common.kubeapi import ApiError, Informer, Kube, Obj, core_path, instaslice_path
from common.objects import Phase
from hack.cluster import ControlPlane
from testkit.builders import GpuSpec as GpuSpec
from testkit.builders import gpu_uuid as gpu_uuid
from testkit.builders import make_allocation as make_allocation
from testkit.builders import make_mig_node as make_mig_node
from testkit.builders import make_node as make_node
from testkit.builders import make_pod as make_pod
from testkit.builders import mig_capacity as mig_capacity
from testkit.clock import FakeClock as FakeClock
from testkit.clock import settle as settle
from tests.support import avoid_creates_in_flight, listed, wait_for
from webhook.allocator import AllocatorSettings, build_controller, run_controller
from webhook.allocator import pods as podlib
from webhook.allocator.controller import Controller
from webhook.allocator.metrics import AllocatorMetrics

# --- time that only moves when a test says so ------------------------------------------------


# --- waiting on the API server (watches, not polling) --------------------------------------

T = TypeVar("T")


# --- the emulated node agents -------------------------------------------------------------


@dataclass
class FakeAgent:
    """Plays every node agent: Pending → Ready (fake MIG UUIDs), finalizer off on delete.

    `hold`: leave new allocations Pending until `release()`; `ignore_nodes`: agents that are
    down (their allocations get no answer at all, not even on deletion); `fail`: claim ids
    to mark Failed instead of Ready (once each).
    """

    kube: Kube
    hold: bool = False
    ignore_nodes: set[str] = field(default_factory=set)
    fail: set[str] = field(default_factory=set)
    readied: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    finalized: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.informer = Informer(
            self.kube, instaslice_path(SLICE_ALLOCATION_PLURAL), self._on_event, name="fake-agent"
        )
        self._busy: set[str] = set()

    async def run(self) -> None:
        await self.informer.run()

    async def release(self) -> None:
        """Stop holding; answer every allocation that waited."""
        self.hold = False
        for obj in list(self.informer.cache.values()):
            await self._on_event("MODIFIED", obj)

    async def _on_event(self, etype: str, obj: Obj) -> None:
        if etype == "DELETED":
            return
        meta, spec = obj["metadata"], obj.get("spec", {})
        if spec.get("nodeName") in self.ignore_nodes:
            return
        path = instaslice_path(SLICE_ALLOCATION_PLURAL, meta["namespace"], meta["name"])
        if meta.get("deletionTimestamp"):
            finalizers = meta.get("finalizers") or []
            if RELEASE_FINALIZER in finalizers:
                patch = [
                    {"op": "test", "path": "/metadata/finalizers", "value": finalizers},
                    {
                        "op": "replace",
                        "path": "/metadata/finalizers",
                        "value": [f for f in finalizers if f != RELEASE_FINALIZER],
                    },
                ]
                for attempt in range(5):
                    try:
                        await self.kube.patch(path, patch, kind="json")
                        self.finalized.append(meta["name"])
                        return
                    except ApiError as exc:
                        if exc.not_found or exc.status in (409, 422):  # gone, or changed:
                            return  # a newer version of it is on its way to us
                        self.errors.append(f"{meta['name']}: {exc}")
                        await asyncio.sleep(0.1 * 2**attempt)
            return
        phase = (obj.get("status") or {}).get("phase") or Phase.PENDING.value
        if phase != Phase.PENDING.value or self.hold or meta["uid"] in self._busy:
            return
        self._busy.add(meta["uid"])  # answered once per object (a name can come back)
        if meta["name"] in self.fail:
            self.fail.discard(meta["name"])
            status: Obj = {"phase": Phase.FAILED.value, "message": "emulated NVML failure"}
            self.failed.append(meta["name"])
        else:
            status = {
                "phase": Phase.READY.value,
                "slices": [
                    {"container": s["container"], "migUUID": f"MIG-{meta['name']}-{i}"}
                    for i, s in enumerate(spec.get("slices") or [])
                ],
            }
            self.readied.append(meta["name"])
        for attempt in range(5):  # a loaded API server may shed a request: try again
            try:
                await self.kube.patch(path + "/status", {"status": status})
                return
            except ApiError as exc:
                if exc.not_found:
                    return
                self.errors.append(f"{meta['name']}: {exc}")
                await asyncio.sleep(0.1 * 2**attempt)
        self._busy.discard(meta["uid"])  # the next event about it tries again


# --- objects on the API server ------------------------------------------------------------


CRDS = Path(__file__).resolve().parents[2] / "manifests" / "base" / "crds"


@pytest.fixture(scope="session")
async def kube(control_plane: ControlPlane) -> AsyncIterator[Kube]:
    k = await Kube.connect(str(control_plane.kubeconfig))
    async with k:
        await ensure_crds(k, load_crds(CRDS))
        yield k


def load_crds(crd_dir: Path) -> list[Obj]:
    docs = [yaml.safe_load(f.read_text()) for f in sorted(crd_dir.glob("*.yaml"))]
    return [d for d in docs if d and d.get("kind") == "CustomResourceDefinition"]


async def ensure_crds(kube: Kube, crds: list[Obj]) -> None:
    """Create InstaSlice's CRDs (once per control plane) and wait until they are served."""
    path = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    names = []
    for body in crds:
        names.append(body["metadata"]["name"])
        try:
            await kube.create(path, body)
        except ApiError as exc:
            if not exc.conflict:
                raise

    def established(items: list[Obj]) -> bool:
        ok = {
            o["metadata"]["name"]
            for o in items
            if any(
                c.get("type") == "Established" and c.get("status") == "True"
                for c in o.get("status", {}).get("conditions") or []
            )
        }
        return set(names) <= ok

    await wait_for(kube, path, listed(established), what="CRDs established")


async def create_mig_node(kube: Kube, body: Obj) -> None:
    """Create (or replace) a MigNode and set its status, as the node agent would."""
    name = body["metadata"]["name"]
    path = instaslice_path(MIG_NODE_PLURAL, name=name)
    try:
        await kube.create(instaslice_path(MIG_NODE_PLURAL), {**body, "status": {}})
    except ApiError as exc:
        if not exc.conflict:
            raise
    await kube.patch(path + "/status", {"status": body["status"]})


async def set_gpus(kube: Kube, node: str, gpus: Iterable[GpuSpec | str]) -> None:
    """Replace what a node's MigNode reports (a GPU healed, an instance gone, ...)."""
    body = make_mig_node(node, gpus)
    await kube.patch(
        instaslice_path(MIG_NODE_PLURAL, name=node) + "/status",
        [{"op": "replace", "path": "/status/gpus", "value": body["status"]["gpus"]}],
        kind="json",
    )


NOT_READY_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")


def node_ready(node: Obj) -> bool:
    """KWOK marked it Ready and the node lifecycle controller lifted the not-ready taint
    that admission puts on every new node."""
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in node.get("status", {}).get("conditions") or []
    )
    tainted = any(
        t.get("key") in NOT_READY_TAINTS for t in node.get("spec", {}).get("taints") or []
    )
    return ready and not tainted


async def wait_node_ready(kube: Kube, name: str, *, within: float = 60.0) -> None:
    await wait_for(
        kube,
        core_path("nodes"),
        listed(lambda items: any(node_ready(n) for n in items)),
        within=within,
        what=f"node {name} ready",
        fieldSelector=f"metadata.name={name}",
    )


async def remove_finalizers(kube: Kube, namespace: str) -> None:
    listing = await kube.list(instaslice_path(SLICE_ALLOCATION_PLURAL, namespace))
    for obj in listing.get("items", []):
        path = instaslice_path(SLICE_ALLOCATION_PLURAL, namespace, obj["metadata"]["name"])
        with contextlib.suppress(ApiError):
            await kube.patch(path, {"metadata": {"finalizers": None}})


async def delete_node(kube: Kube, name: str) -> None:
    await kube.delete_ignore_missing(core_path("nodes", name=name))
    await kube.delete_ignore_missing(instaslice_path(MIG_NODE_PLURAL, name=name))


# --- one test's world: its nodes, the fake agent, allocator replicas -------------------------

TEST_NODE_LABEL = "allocator-test.instaslice.io/namespace"


@dataclass
class AllocatorEnv:
    """A test's namespace, its own KWOK nodes (labelled so only its allocators see them),
    the fake agent, and allocator replicas started and stopped by identity."""

    kube: Kube
    namespace: str
    agent: FakeAgent
    nodes: list[str] = field(default_factory=list)
    replicas: dict[str, tuple[Controller, asyncio.Task[None]]] = field(default_factory=dict)
    _lease_kubes: dict[str, Kube] = field(default_factory=dict)

    def node_name(self, short: str) -> str:
        return f"{self.namespace}-{short}"

    async def opt_in(self) -> None:
        """Label the namespace opted in (to whole GPUs too), as the namespace mirror does
        for users: the allocator places pods only there."""
        patch = {"metadata": {"labels": {ENABLED_KEY: "true", WHOLE_GPU_KEY: "true"}}}
        await self.kube.patch(core_path("namespaces", name=self.namespace), patch)

    async def add_node(
        self,
        short: str,
        *,
        model: str | None = "H100-80GB",
        gpus: Sequence[GpuSpec | str] | None = None,
        cpu: str = "8",
        memory: str = "32Gi",
        pods: int = 110,
        labels: Mapping[str, str] | None = None,
        taints: list[Obj] | None = None,
        mig_node: bool = True,
    ) -> str:
        name = self.node_name(short)
        specs = list(gpus) if gpus is not None else [GpuSpec(model=model or "H100-80GB")]
        body = make_node(
            name,
            cpu=cpu,
            memory=memory,
            pods=pods,
            labels={TEST_NODE_LABEL: self.namespace, **(labels or {})},
            taints=taints,
            model=model,
            gpus=len(specs),
        )
        await self.kube.create(core_path("nodes"), body)
        self.nodes.append(name)
        await wait_node_ready(self.kube, name)
        if mig_node:  # like a node agent: only once the node is up
            await create_mig_node(self.kube, make_mig_node(name, specs))
        return name

    def settings(self, identity: str = "a", **overrides: Any) -> AllocatorSettings:
        values: dict[str, Any] = {
            "namespace": self.namespace,
            "identity": identity,
            "node_selector": f"{TEST_NODE_LABEL}={self.namespace}",
            "lease_duration_s": 4.0,
            "renew_interval_s": 0.5,
            "renew_deadline_s": 2.5,
            "retry_interval_s": 0.2,
            "max_backoff_s": 1.0,
            "pinned_unschedulable_timeout_s": 30.0,
            # INSTASLICE_TEST_AVOID_CREATES_IN_FLIGHT (tests/support.py); a test's own wins
            "avoid_creates_in_flight": avoid_creates_in_flight(),
        }
        values.update(overrides)
        return AllocatorSettings(**values)

    def start(self, identity: str = "a", **overrides: Any) -> Controller:
        """An allocator replica, built like `run_allocator` builds it (the Lease renewed
        over its own connection pool) but with its controller in the test's hands."""
        settings = self.settings(identity, **overrides)
        lease_kube = self.kube.sibling()
        controller = build_controller(
            self.kube, settings, AllocatorMetrics(), lease_kube=lease_kube
        )
        task = asyncio.create_task(run_controller(controller, settings), name=f"alloc-{identity}")
        self.replicas[identity] = (controller, task)
        self._lease_kubes[identity] = lease_kube
        return controller

    async def stop(self, identity: str = "a") -> None:
        _, task = self.replicas.pop(identity)
        await cancel_until_done([task])
        await self._lease_kubes.pop(identity).close()

    async def close(self) -> None:
        for identity in list(self.replicas):
            await self.stop(identity)
        pods = await self.kube.list(core_path("pods", self.namespace))
        for pod in pods.get("items", []):
            await self.kube.delete_ignore_missing(
                core_path("pods", self.namespace, pod["metadata"]["name"]),
                gracePeriodSeconds=0,
            )
        await remove_finalizers(self.kube, self.namespace)
        for name in self.nodes:
            await delete_node(self.kube, name)

    # --- pods ----------------------------------------------------------------------------

    async def create_pod(self, name: str, **kwargs: Any) -> Obj:
        body = make_pod(name, namespace=self.namespace, **kwargs)
        return await self.kube.create(core_path("pods", self.namespace), body)

    async def delete_pod(self, name: str) -> None:
        await self.kube.delete_ignore_missing(core_path("pods", self.namespace, name))

    async def pod(self, name: str) -> Obj:
        return await self.kube.get(core_path("pods", self.namespace, name))

    async def wait_pod(
        self, name: str, predicate: Callable[[Obj], bool], *, within: float = 30.0, what: str = ""
    ) -> Obj:
        def check(items: list[Obj]) -> Obj | None:
            return next((p for p in items if predicate(p)), None)

        return await wait_for(
            self.kube,
            core_path("pods", self.namespace),
            listed(check),
            within=within,
            what=f"pod {name}: {what}",
            fieldSelector=f"metadata.name={name}",
        )

    async def wait_ungated(self, name: str, *, within: float = 30.0) -> Obj:
        try:
            return await self.wait_pod(
                name, lambda p: not podlib.has_our_gate(p), within=within, what="gate lifted"
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{await self.diagnosis()}") from None

    async def diagnosis(self) -> str:
        """What the allocations and the fake agent looked like (for failure messages)."""
        allocs = [
            (a["spec"]["podName"], (a.get("status") or {}).get("phase"), a["metadata"]["name"])
            for a in await self.allocations()
        ]
        replicas = {
            k: (c.elector.is_leader, len(c.placer.queue), sorted(c.parked), c.work.active)
            for k, (c, _) in self.replicas.items()
        }
        return f"allocations={allocs} agent_errors={self.agent.errors} replicas={replicas}"

    async def wait_bound(self, name: str, *, within: float = 30.0) -> Obj:
        try:
            return await self.wait_pod(
                name, lambda p: bool(podlib.bound_node(p)), within=within, what="bound"
            )
        except AssertionError as exc:
            pod = await self.pod(name)
            conditions = pod.get("status", {}).get("conditions")
            raise AssertionError(
                f"{exc}\ngates={podlib.gates(pod)} conditions={conditions}\n"
                f"{await self.diagnosis()}"
            ) from None

    async def wait_gone(self, name: str, *, within: float = 30.0) -> None:
        await wait_for(
            self.kube,
            core_path("pods", self.namespace),
            listed(lambda items: not items),
            within=within,
            what=f"pod {name} gone",
            fieldSelector=f"metadata.name={name}",
        )

    async def events(self, pod: str, reason: str) -> list[Obj]:
        listing = await self.kube.list(
            core_path("events", self.namespace),
            fieldSelector=f"involvedObject.name={pod},reason={reason}",
        )
        return list(listing.get("items", []))

    async def wait_event(
        self, pod: str, reason: str, *, within: float = 30.0, saying: str = ""
    ) -> Obj:
        """The first `reason` event on `pod` (whose message contains `saying`)."""

        def found(items: list[Obj]) -> Obj | None:
            return next((e for e in items if saying in e.get("message", "")), None)

        return await wait_for(
            self.kube,
            core_path("events", self.namespace),
            listed(found),
            within=within,
            what=f"{reason} event on {pod}",
            fieldSelector=f"involvedObject.name={pod},reason={reason}",
        )

    # --- allocations ---------------------------------------------------------------------

    async def allocations(self) -> list[Obj]:
        listing = await self.kube.list(instaslice_path(SLICE_ALLOCATION_PLURAL, self.namespace))
        return list(listing.get("items", []))

    async def wait_allocations(
        self, predicate: Callable[[list[Obj]], bool], *, within: float = 30.0, what: str = ""
    ) -> list[Obj]:
        def check(items: list[Obj]) -> list[Obj] | None:
            return items if predicate(items) else None

        result: list[Obj] = await wait_for(
            self.kube,
            instaslice_path(SLICE_ALLOCATION_PLURAL, self.namespace),
            listed(check),
            within=within,
            what=f"allocations: {what}",
        )
        return result


def assert_no_double_booking(allocations: Iterable[Obj]) -> None:
    """Every memory slot of every GPU is held by at most one allocation; one per pod."""
    held: dict[str, int] = {}
    pods: set[str] = set()
    for alloc in allocations:
        uid = alloc["spec"]["podUID"]
        assert uid not in pods, f"pod {alloc['spec']['podName']} holds two allocations"
        pods.add(uid)
        for s in alloc["spec"]["slices"]:
            mask = ((1 << s["size"]) - 1) << s["start"]
            gpu = s["gpuUUID"]
            assert not held.get(gpu, 0) & mask, f"{gpu} slots {s} booked twice"
            held[gpu] = held.get(gpu, 0) | mask


@contextlib.asynccontextmanager
async def allocator_env(kube: Kube, namespace: str) -> AsyncIterator[AllocatorEnv]:
    """An `AllocatorEnv` of the test's namespace, opted in, with the fake agent running (its
    informer synced); at the end every allocator replica it started and the agent stop."""
    agent = FakeAgent(kube)
    agent_task = asyncio.create_task(agent.run(), name="fake-agent")
    try:
        await agent.informer.synced.wait()
        world = AllocatorEnv(kube, namespace, agent)
        await world.opt_in()
        try:
            yield world
        finally:
            await world.close()
    finally:
        await cancel_until_done([agent_task])
