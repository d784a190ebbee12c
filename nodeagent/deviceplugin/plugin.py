"""The device-plugin binding's I/O shell: one gRPC device-plugin server per
`instaslice.io/mig-<profile>`, and one for whole GPUs (`instaslice.io/gpu`, "profile" `gpu`),
on a unix socket in the kubelet's device-plugins dir, the registration with the kubelet, and
the PodResources client. A whole GPU is a unit like a slice: same Allocate, same
PreStartContainer refusal unless its ids are settled on the pod's own allocation.

- Devices: `<profile>-<n>` (`gpu-<n>` for whole GPUs) for n below the fixed upper bound of
  docs/contract.md §3 (the same number the agent writes into Node capacity); ids above a
  shrunken bound stay listed as Unhealthy, so the kubelet never loses track of an id it handed out.
- `Allocate` binds the ids to a prepared slice (core.Bindings) and answers with a CDI alias
  device `instaslice.io/mig=dp-<first id>` (no `_`: never collides with a claim's devices),
  written as its own spec file carrying the unit's container edits from the allocation's
  CDI file. `PreStartContainer` (required) settles the ids against the PodResources API and
  rewrites the alias before the runtime resolves it. The mapping is recorded in the
  SliceAllocation as the `DeviceBound` condition.
- The kubelet deletes plugin sockets when it restarts; the watch loop sees `kubelet.sock`
  replaced (or ours gone) and serves and registers again.
Polls (socket inode, capacity) run every `refresh_s`: the kubelet offers no event for either.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc
import structlog

from common.allocation import SliceAllocation
from common.clock import kube_time
from common.conditions import condition, observed, with_condition
from common.constants import CDI_KIND, INSTASLICE_GPU, INSTASLICE_MIG_PREFIX, WHOLE_GPU_PROFILE
from common.kubeapi import ApiError, Kube
from common.profiles import profile_from_suffix
from nodeagent import cdi, writes
from nodeagent.deviceplugin._gen.deviceplugin.v1beta1 import api_pb2 as dp
from nodeagent.deviceplugin._gen.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from nodeagent.deviceplugin._gen.podresources.v1 import api_pb2 as pr
from nodeagent.deviceplugin._gen.podresources.v1 import api_pb2_grpc as pr_grpc
from nodeagent.deviceplugin.core import Bindings, IdKey, NoSlice, Unit, key_of

log = structlog.get_logger("deviceplugin")
Obj = dict[str, Any]
API_VERSION = "v1beta1"
ALIAS_PREFIX = "dp-"


def suffix(resource: str) -> str:
    """`1g.18gb` of `instaslice.io/mig-1g.18gb`; `gpu` of `instaslice.io/gpu`."""
    if resource == INSTASLICE_GPU:
        return WHOLE_GPU_PROFILE
    return resource.removeprefix(INSTASLICE_MIG_PREFIX)


def profile_of(resource: str) -> str:
    """The profile a resource's units carry (whole GPUs: `gpu`, as in their allocation)."""
    if resource == INSTASLICE_GPU:
        return WHOLE_GPU_PROFILE
    return profile_from_suffix(suffix(resource))


def device_id(resource: str, n: int) -> str:
    return f"{suffix(resource)}-{n}"


def alias_name(key: IdKey) -> str:
    return f"{ALIAS_PREFIX}{key[0]}"


def alias_file(cdi_dir: Path, key: IdKey) -> Path:
    return cdi_dir / f"instaslice.io-plugin-{key[0]}.json"  # no `_`: not a claim file


def units_of(obj: Obj) -> list[Unit]:
    alloc = SliceAllocation.parse(obj)
    counts: dict[tuple[str, str], int] = {}
    for s in alloc.slices:
        k = (s.container, s.profile)
        counts[k] = counts.get(k, 0) + 1
    return [
        Unit(alloc.namespace, alloc.name, c, p, n, alloc.uid)
        for (c, p), n in sorted(counts.items())
    ]


class ProfileServer(dp_grpc.DevicePluginServicer):  # type: ignore[misc]
    def __init__(self, owner: DevicePluginBinding, resource: str, profile: str) -> None:
        self.owner, self.resource, self.profile = owner, resource, profile
        self.total = 0
        self.healthy = 0
        self.changed = asyncio.Condition()
        self.server: grpc.aio.Server | None = None
        kind = "gpu" if resource == INSTASLICE_GPU else f"mig-{suffix(resource)}"
        self.socket = owner.kubelet_dir / f"instaslice-{kind}.sock"

    def devices(self) -> list[Any]:
        return [
            dp.Device(
                ID=device_id(self.resource, n),
                health="Healthy" if n < self.healthy else "Unhealthy",
            )
            for n in range(self.total)
        ]

    async def set_bound(self, n: int) -> None:
        if (n, max(self.total, n)) == (self.healthy, self.total):
            return
        self.healthy, self.total = n, max(self.total, n)
        async with self.changed:
            self.changed.notify_all()

    # --- the DevicePlugin service ---------------------------------------------------------

    async def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
        return dp.DevicePluginOptions(pre_start_required=True)

    async def ListAndWatch(self, request: Any, context: Any) -> AsyncIterator[Any]:
        while True:
            async with self.changed:
                sent = (self.total, self.healthy)
                yield dp.ListAndWatchResponse(devices=self.devices())
                await self.changed.wait_for(lambda s=sent: (self.total, self.healthy) != s)  # type: ignore[misc]

    async def GetPreferredAllocation(self, request: Any, context: Any) -> Any:
        return dp.PreferredAllocationResponse()

    async def Allocate(self, request: Any, context: Any) -> Any:
        answers = []
        for creq in request.container_requests:
            try:
                name = await self.owner.allocate(self.profile, list(creq.devices_ids))
            except NoSlice as exc:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            answers.append(dp.ContainerAllocateResponse(cdi_devices=[dp.CDIDevice(name=name)]))
        return dp.AllocateResponse(container_responses=answers)

    async def PreStartContainer(self, request: Any, context: Any) -> Any:
        """The container starts only on its own pod's slice: its ids must be settled on a
        unit of its pod's SliceAllocation (a pod without one gets none, whatever the
        kubelet's Allocate handed it)."""
        await self.owner.settle_now()
        why = self.owner.b.refusal(key_of(list(request.devices_ids)))
        if why is not None:
            log.warning("container start refused", ids=list(request.devices_ids), why=why)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
        return dp.PreStartContainerResponse()

    # --- serving and registration ---------------------------------------------------------

    async def start(self) -> None:
        await self.stop()
        self.socket.unlink(missing_ok=True)
        self.server = grpc.aio.server()
        dp_grpc.add_DevicePluginServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix://{self.socket}")
        await self.server.start()
        async with grpc.aio.insecure_channel(f"unix://{self.owner.kubelet_sock}") as ch:
            await dp_grpc.RegistrationStub(ch).Register(
                dp.RegisterRequest(
                    version=API_VERSION,
                    endpoint=self.socket.name,
                    resource_name=self.resource,
                    options=dp.DevicePluginOptions(pre_start_required=True),
                ),
                timeout=10,
            )
        log.info("registered with the kubelet", resource=self.resource, socket=str(self.socket))

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=0.5)
            self.server = None


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


class DevicePluginBinding:
    """The `device-plugin` Binding (nodeagent.binding) of one node."""

    def __init__(
        self,
        *,
        kube: Kube | None,
        cdi_dir: Path,
        kubelet_dir: Path,
        pod_resources_socket: Path,
        refresh_s: float = 1.0,
    ) -> None:
        self.kube = kube
        self.cdi_dir = cdi_dir
        self.kubelet_dir = kubelet_dir
        self.kubelet_sock = kubelet_dir / "kubelet.sock"
        self.pod_resources_socket = pod_resources_socket
        self.refresh_s = refresh_s
        self.b = Bindings()
        self.servers: dict[str, ProfileServer] = {}
        self.lock = asyncio.Lock()
        self.capacity: Callable[[], Mapping[str, str]] = dict
        self.allocs: Callable[[], Iterable[Obj]] = list
        self._recorded: dict[tuple[str, str], str] = {}

    def attach(
        self, capacity: Callable[[], Mapping[str, str]], allocs: Callable[[], Iterable[Obj]]
    ) -> None:
        """The node agent's capacity (docs/contract.md §3 upper bound) and SliceAllocations."""
        self.capacity, self.allocs = capacity, allocs

    # --- Binding protocol -------------------------------------------------------------------

    async def run(self) -> None:
        registered: int | None = None
        try:
            while True:
                await self.refresh_servers()
                sock = _inode(self.kubelet_sock)
                lost = any(s.server is None or not s.socket.exists() for s in self.servers.values())
                if sock is not None and (sock != registered or lost):
                    try:
                        for s in self.servers.values():
                            await s.start()
                        registered = sock
                    except grpc.aio.AioRpcError as exc:
                        log.warning("kubelet registration failed; retrying", error=str(exc))
                with contextlib.suppress(grpc.aio.AioRpcError, OSError):
                    # also with nothing bound yet: after a restart the kubelet's running
                    # containers are bound again from PodResources (and their aliases rewritten)
                    if self.b.ready and self.pod_resources_socket.exists():
                        await self.settle_now()
                await asyncio.sleep(self.refresh_s)
        finally:
            for s in self.servers.values():
                await s.stop()

    async def slices_ready(self, namespace: str, claim: str, devices: Mapping[str, str]) -> None:
        alloc = next(
            (
                a
                for a in self.allocs()
                if (a["metadata"].get("namespace"), a["metadata"].get("name")) == (namespace, claim)
            ),
            None,
        )
        if alloc is not None:
            async with self.lock:
                self.b.add_ready(units_of(alloc))

    async def slices_released(self, namespace: str, claim: str, uid: str) -> None:
        async with self.lock:
            for key in self.b.release(namespace, claim, uid):
                await asyncio.to_thread(alias_file(self.cdi_dir, key).unlink, missing_ok=True)
        self._recorded = {k: v for k, v in self._recorded.items() if k != (namespace, claim)}

    # --- devices ----------------------------------------------------------------------------

    async def refresh_servers(self) -> None:
        for resource, qty in self.capacity().items():
            server = self.servers.get(resource)
            if server is None:
                server = self.servers[resource] = ProfileServer(
                    self, resource, profile_of(resource)
                )
            await server.set_bound(int(qty))

    async def allocate(self, profile: str, ids: list[str]) -> str:
        async with self.lock:
            unit = self.b.allocate(profile, ids)
            key = key_of(ids)
            await self.write_alias(key, unit)
        log.info("allocated", ids=list(key), claim=f"{unit.namespace}/{unit.claim}")
        return f"{CDI_KIND}={alias_name(key)}"

    async def write_alias(self, key: IdKey, unit: Unit) -> None:
        def write() -> None:
            path = self.cdi_dir / cdi.spec_file_name(unit.namespace, unit.claim)
            spec = json.loads(path.read_text())
            dev = next(
                d
                for d in spec["devices"]
                if d["name"] == f"{unit.namespace}_{unit.claim}_{unit.container}"
            )
            alias = {
                "cdiVersion": spec["cdiVersion"],
                "kind": CDI_KIND,
                "annotations": {
                    "instaslice.io/claim": f"{unit.namespace}/{unit.claim}",
                    "instaslice.io/container": unit.container,
                },
                "devices": [{"name": alias_name(key), "containerEdits": dev["containerEdits"]}],
                "containerEdits": spec.get("containerEdits", {}),
            }
            cdi.write_json_atomic(alias_file(self.cdi_dir, key), alias)

        await asyncio.to_thread(write)

    # --- the real mapping (PodResources) ----------------------------------------------------

    async def list_pod_resources(self) -> list[Any]:
        async with grpc.aio.insecure_channel(f"unix://{self.pod_resources_socket}") as ch:
            resp = await pr_grpc.PodResourcesListerStub(ch).List(
                pr.ListPodResourcesRequest(), timeout=10
            )
        return list(resp.pod_resources)

    async def settle_now(self) -> None:
        """Bind every id key the kubelet reports to its holder's own unit; record it."""
        pods = await self.list_pod_resources()
        own: dict[tuple[str, str], tuple[str, str]] = {}  # (namespace, pod) → claim, uid
        for a in map(SliceAllocation.parse, self.allocs()):
            own[(a.namespace, a.pod_name)] = (a.name, a.uid)
        records: list[tuple[Unit, IdKey, str]] = []
        async with self.lock:
            for pod, container, profile, key in self._held(pods):
                held = own.get((pod.namespace, pod.name))
                if held is None:  # no allocation: its ids resolve to nothing
                    if self.b.unbind(key):
                        await asyncio.to_thread(
                            alias_file(self.cdi_dir, key).unlink, missing_ok=True
                        )
                        who = f"{pod.namespace}/{pod.name}"
                        log.warning("ids of a pod without allocation unbound", pod=who, ids=key)
                    continue
                claim, uid = held
                mine = Unit(pod.namespace, claim, container, profile, len(key), uid)
                for changed in self.b.settle(key, mine):
                    await self.write_alias(changed, self.b.bound[changed])
                if self.b.bound.get(key) == mine:
                    records.append((mine, key, pod.name))
        for unit, key, pod_name in records:
            await self.record(unit, key, pod_name)

    def _held(self, pods: list[Any]) -> Iterator[tuple[Any, str, str, IdKey]]:
        """(pod, container, profile, ids) for every id set of ours the kubelet reports."""
        for pod in pods:
            for c in pod.containers:
                for d in c.devices:
                    server = self.servers.get(d.resource_name)
                    if server is not None and d.device_ids:
                        yield pod, c.name, server.profile, key_of(list(d.device_ids))

    async def record(self, unit: Unit, key: IdKey, pod_name: str) -> None:
        msg = f"{unit.container}/{unit.profile}: kubelet devices {','.join(key)} of pod {pod_name}"
        rid = (unit.namespace, unit.claim)
        if self.kube is None or msg in self._recorded.get(rid, ""):
            return
        text = "; ".join(x for x in (self._recorded.get(rid, ""), msg) if x)
        alloc = next(
            (
                a
                for a in self.allocs()
                if (a["metadata"]["namespace"], a["metadata"]["name"]) == rid
            ),
            None,
        )
        if alloc is None:
            return
        now = kube_time()
        conds = with_condition(
            (alloc.get("status") or {}).get("conditions") or [],
            condition("DeviceBound", True, "KubeletDevicePlugin", text, now),
        )
        conds = observed(conds, int(alloc["metadata"].get("generation") or 0), now)
        try:
            await writes.patch_alloc_status(
                self.kube, unit.namespace, unit.claim, {"status": {"conditions": conds}}
            )
        except ApiError as exc:
            log.warning("could not record the device mapping", claim=rid, error=str(exc))
            return
        self._recorded[rid] = text
