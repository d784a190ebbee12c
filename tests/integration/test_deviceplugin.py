"""The node agent's `device-plugin` binding against a fake kubelet over real unix-socket gRPC.

The test plays the kubelet: a Registration server on `kubelet.sock` and a PodResources
server on its own socket, in a temp dir; it calls the plugin's ListAndWatch, Allocate and
PreStartContainer like the kubelet's device manager does. The agent runs in process on the
NVML emulator against the local control plane.
Covers: registration per profile with the §3 upper bound; two same-profile pods allocated
concurrently get distinct slices; the PodResources mapping (deliberately the opposite of the
provisional binding) moves each pod onto its own allocation's slice before it starts and is
recorded as the DeviceBound condition; release destroys exactly that slice; a kubelet
restart (kubelet.sock recreated, plugin sockets deleted) is followed by re-registration.
Leaves out: a real kubelet and container runtime (the CDI alias files are checked as files).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from common.kubeapi import Kube, instaslice_path
from hack.cluster import ControlPlane
from nodeagent.deviceplugin._gen.deviceplugin.v1beta1 import api_pb2 as dp
from nodeagent.deviceplugin._gen.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from nodeagent.deviceplugin._gen.podresources.v1 import api_pb2 as pr
from nodeagent.deviceplugin._gen.podresources.v1 import api_pb2_grpc as pr_grpc
from nodeagent.deviceplugin.plugin import DevicePluginBinding
from nodeagent.state import AgentNode
from tests.integration.agent_fixtures import (
    agent_settings,
    create_allocation,
    eventually,
    get_allocation,
    gpu_node,
    install_instaslice,
    running_agent,
    slice_allocation,
    wait_gone,
    wait_phase,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]
H200 = "H200-141GB"
RES = "instaslice.io/mig-1g.18gb"
GPU_RES = "instaslice.io/gpu"


class FakeKubelet(dp_grpc.RegistrationServicer, pr_grpc.PodResourcesListerServicer):  # type: ignore[misc]
    def __init__(self, root: Path) -> None:
        self.root = root
        self.registered: list[Any] = []
        self.pods: list[Any] = []
        self.server: grpc.aio.Server | None = None
        self.pr_server: grpc.aio.Server | None = None

    async def Register(self, request: Any, context: Any) -> Any:
        self.registered.append(request)
        return dp.Empty()

    async def List(self, request: Any, context: Any) -> Any:
        return pr.ListPodResourcesResponse(pod_resources=self.pods)

    async def start(self) -> None:
        self.server = grpc.aio.server()
        dp_grpc.add_RegistrationServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix://{self.root / 'kubelet.sock'}")
        await self.server.start()
        if self.pr_server is None:
            self.pr_server = grpc.aio.server()
            pr_grpc.add_PodResourcesListerServicer_to_server(self, self.pr_server)
            self.pr_server.add_insecure_port(f"unix://{self.root / 'pr.sock'}")
            await self.pr_server.start()

    async def restart(self) -> None:
        """What a kubelet restart does to the dir: its socket anew, plugin sockets gone."""
        assert self.server is not None
        await self.server.stop(0)
        for p in self.root.glob("*.sock"):
            if p.name != "pr.sock":
                p.unlink()
        self.registered.clear()
        await self.start()

    async def stop(self) -> None:
        for s in (self.server, self.pr_server):
            if s is not None:
                await s.stop(0)

    def plugin(self, resource: str) -> Any:
        reg = next(r for r in self.registered if r.resource_name == resource)
        ch = grpc.aio.insecure_channel(f"unix://{self.root / reg.endpoint}")
        return ch, dp_grpc.DevicePluginStub(ch)


def registered(kubelet: FakeKubelet) -> Any:
    async def check() -> bool:
        return any(r.resource_name == RES for r in kubelet.registered)

    return check


def pod(ns: str, name: str, container: str, ids: list[str], resource: str = RES) -> Any:
    dev = pr.ContainerDevices(resource_name=resource, device_ids=ids)
    return pr.PodResources(
        name=name,
        namespace=ns,
        containers=[pr.ContainerResources(name=container, devices=[dev])],
    )


@pytest.fixture(scope="session")
async def kube(control_plane: ControlPlane) -> AsyncIterator[Kube]:
    async with await Kube.connect(str(control_plane.kubeconfig)) as k:
        await install_instaslice(k)
        yield k


@pytest.fixture
async def kubelet() -> AsyncIterator[FakeKubelet]:
    root = Path(tempfile.mkdtemp(prefix="kl", dir="/tmp"))  # unix socket paths are short
    k = FakeKubelet(root)
    await k.start()
    try:
        yield k
    finally:
        await k.stop()
        shutil.rmtree(root, ignore_errors=True)


def alias_uuids(cdi_dir: Path, name: str) -> str:
    dev = name.split("=", 1)[1]
    path = cdi_dir / f"instaslice.io-plugin-{dev.removeprefix('dp-')}.json"
    doc = json.loads(path.read_text())
    (env,) = doc["devices"][0]["containerEdits"]["env"]
    return str(env.split("=", 1)[1])


def dp_settings(node: Any, control_plane: ControlPlane, kubelet: FakeKubelet) -> Any:
    return agent_settings(
        [node],
        control_plane.kubeconfig,
        binding="device-plugin",
        kubelet_dir=kubelet.root,
        pod_resources_socket=kubelet.root / "pr.sock",
        plugin_refresh_s=0.1,
    )


async def test_two_pods_same_profile(
    kube: Kube, namespace: str, tmp_path: Path, control_plane: ControlPlane, kubelet: FakeKubelet
) -> None:
    node = await gpu_node(kube, tmp_path, [H200])
    ns = namespace
    async with running_agent(dp_settings(node, control_plane, kubelet)):
        await eventually(registered(kubelet), what="registration")
        reg = next(r for r in kubelet.registered if r.resource_name == RES)
        assert reg.version == "v1beta1" and reg.options.pre_start_required
        ch, stub = kubelet.plugin(RES)
        async with ch:
            stream = stub.ListAndWatch(dp.Empty())
            first = await stream.read()
            assert len(first.devices) == 7  # 1g.18gb maxCount on one H200
            assert {d.health for d in first.devices} == {"Healthy"}
            stream.cancel()

            a = slice_allocation(ns, node, [("main", "1g.18gb", 0, 0, 1)], claim="ca")
            b = slice_allocation(ns, node, [("main", "1g.18gb", 0, 1, 1)], claim="cb")
            for x in (a, b):
                await create_allocation(kube, x)
            a_ready, b_ready = [await wait_phase(kube, x, "Ready") for x in (a, b)]
            uuid = {
                "ca": a_ready["status"]["slices"][0]["migUUID"],
                "cb": b_ready["status"]["slices"][0]["migUUID"],
            }

            def req(i: str) -> Any:
                return dp.AllocateRequest(
                    container_requests=[dp.ContainerAllocateRequest(devices_ids=[i])]
                )

            r0, r1 = await asyncio.gather(
                stub.Allocate(req("1g.18gb-0")), stub.Allocate(req("1g.18gb-1"))
            )
            n0 = r0.container_responses[0].cdi_devices[0].name
            n1 = r1.container_responses[0].cdi_devices[0].name
            got0, got1 = alias_uuids(node.cdi_dir, n0), alias_uuids(node.cdi_dir, n1)
            assert {got0, got1} == set(uuid.values())  # distinct prepared slices
            # the kubelet gave id 0 to the pod whose slice went to id 1: the opposite mapping
            holder0 = "cb" if got0 == uuid["ca"] else "ca"
            holder1 = "ca" if holder0 == "cb" else "cb"
            kubelet.pods = [
                pod(ns, f"pod-{holder0}", "main", ["1g.18gb-0"]),
                pod(ns, f"pod-{holder1}", "main", ["1g.18gb-1"]),
            ]
            for i in ("1g.18gb-0", "1g.18gb-1"):
                await stub.PreStartContainer(dp.PreStartContainerRequest(devices_ids=[i]))
            assert alias_uuids(node.cdi_dir, n0) == uuid[holder0]
            assert alias_uuids(node.cdi_dir, n1) == uuid[holder1]

            async def recorded() -> bool:
                for claim, dev in ((holder0, "1g.18gb-0"), (holder1, "1g.18gb-1")):
                    obj = await get_allocation(kube, ns, claim)
                    conds = (obj or {}).get("status", {}).get("conditions") or []
                    c = next((c for c in conds if c["type"] == "DeviceBound"), None)
                    if c is None or dev not in c["message"] or f"pod-{claim}" not in c["message"]:
                        return False
                return True

            await eventually(recorded, what="DeviceBound conditions")

            # release the pod holding id 0: its own slice goes, the other stays
            gone = a if holder0 == "ca" else b
            m = gone["metadata"]
            await kube.delete(instaslice_path("sliceallocations", ns, m["name"]))
            await wait_gone(kube, gone)
            kept_start = 0 if holder1 == "ca" else 1
            assert node.instances() == [(0, "1g.18gb", kept_start, 1, 0)]
            assert alias_uuids(node.cdi_dir, n1) == uuid[holder1]
            with contextlib.suppress(FileNotFoundError):
                alias_uuids(node.cdi_dir, n0)
                raise AssertionError("alias of the released slice still there")

        # kubelet restart: re-registration on the new kubelet.sock
        await kubelet.restart()
        await eventually(registered(kubelet), what="registration")
        ch, stub = kubelet.plugin(RES)
        async with ch:
            opts = await stub.GetDevicePluginOptions(dp.Empty())
            assert opts.pre_start_required


def one_id(i: str) -> Any:
    return dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(devices_ids=[i])])


async def bind(stub: Any, kubelet: FakeKubelet, pod_resources: Any, device_id: str) -> str:
    """What the kubelet does to start a container given `device_id`: Allocate, then
    (PodResources showing `pod_resources`) PreStartContainer; the CDI device name Allocate
    answered."""
    r = await stub.Allocate(one_id(device_id))
    kubelet.pods.append(pod_resources)
    await stub.PreStartContainer(dp.PreStartContainerRequest(devices_ids=[device_id]))
    return str(r.container_responses[0].cdi_devices[0].name)


async def thief_refused_then_owner_bound(
    stub: Any, kubelet: FakeKubelet, node: Any, owner: Any, ids: tuple[str, str]
) -> str:
    """The kubelet gives a thief (a pod with no allocation) `ids[0]`, which Allocate binds to
    the only Ready unit, the owner's: its container is refused before it starts
    (FAILED_PRECONDITION) and no alias is written. The owner (`owner`: its PodResources,
    holding `ids[1]`) is bound after; the CDI device name it got."""
    thief_id, owner_id = ids
    resource = owner.containers[0].devices[0].resource_name
    await stub.Allocate(one_id(thief_id))
    kubelet.pods = [pod(owner.namespace, "thief", "main", [thief_id], resource)]
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.PreStartContainer(dp.PreStartContainerRequest(devices_ids=[thief_id]))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert not (node.cdi_dir / f"instaslice.io-plugin-{thief_id}.json").exists()
    return await bind(stub, kubelet, owner, owner_id)


async def test_a_pod_without_allocation_never_gets_a_slice(
    kube: Kube, namespace: str, tmp_path: Path, control_plane: ControlPlane, kubelet: FakeKubelet
) -> None:
    """Security issue, item 1: a pod still asking for `instaslice.io/mig-*` whose slices were
    released (or that never had any) is scheduled; the kubelet's Allocate binds its ids to
    the only Ready unit of the profile, a waiting pod's. Its container must not start, and
    the owner must still get its own slice."""
    node = await gpu_node(kube, tmp_path, [H200])
    ns = namespace
    async with running_agent(dp_settings(node, control_plane, kubelet)):
        await eventually(registered(kubelet), what="registration")
        ch, stub = kubelet.plugin(RES)
        async with ch:
            owned = slice_allocation(ns, node, [("main", "1g.18gb", 0, 0, 1)], claim="cown")
            await create_allocation(kube, owned)
            await wait_phase(kube, owned, "Ready")
            # the thief's ids take the owner's unit; the owner, admitted later, gets its own
            owner = pod(ns, "pod-cown", "main", ["1g.18gb-1"])
            ids = ("1g.18gb-0", "1g.18gb-1")
            name = await thief_refused_then_owner_bound(stub, kubelet, node, owner, ids)
            got = await get_allocation(kube, ns, "cown")
            assert got is not None
            assert alias_uuids(node.cdi_dir, name) == got["status"]["slices"][0]["migUUID"]


async def test_an_agent_restart_keeps_device_plugin_binding(
    kube: Kube, namespace: str, tmp_path: Path, control_plane: ControlPlane, kubelet: FakeKubelet
) -> None:
    """Security issue, item 2: after a node-agent restart, a pod whose allocation was Ready
    before it (not admitted yet) still gets its slice, and a container that was running
    keeps resolving to its own slice: bindings are rebuilt from PodResources and the alias
    files rewritten (a reboot empties /var/run/cdi)."""
    node = await gpu_node(kube, tmp_path, [H200])
    ns = namespace
    running = slice_allocation(ns, node, [("main", "1g.18gb", 0, 0, 1)], claim="crun")
    waiting = slice_allocation(ns, node, [("main", "1g.18gb", 0, 1, 1)], claim="cwait")
    settings = dp_settings(node, control_plane, kubelet)
    async with running_agent(settings):
        await eventually(registered(kubelet), what="registration")
        ch, stub = kubelet.plugin(RES)
        async with ch:
            for x in (running, waiting):
                await create_allocation(kube, x)
            ready = {
                x["metadata"]["name"]: await wait_phase(kube, x, "Ready")
                for x in (running, waiting)
            }
            alias = await bind(
                stub, kubelet, pod(ns, "pod-crun", "main", ["1g.18gb-0"]), "1g.18gb-0"
            )
    uuid = {k: v["status"]["slices"][0]["migUUID"] for k, v in ready.items()}
    for f in node.cdi_dir.glob("instaslice.io-plugin-*.json"):
        f.unlink()  # a reboot: /var/run/cdi is a tmpfs
    kubelet.registered.clear()
    async with running_agent(settings):
        await eventually(registered(kubelet), what="registration after the restart")

        async def rebound() -> bool:
            try:
                return bool(alias_uuids(node.cdi_dir, alias) == uuid["crun"])
            except FileNotFoundError:
                return False

        await eventually(rebound, what="the running container's alias rewritten")
        ch, stub = kubelet.plugin(RES)
        async with ch:
            waiting_pod = pod(ns, "pod-cwait", "main", ["1g.18gb-1"])
            name = await bind(stub, kubelet, waiting_pod, "1g.18gb-1")  # refused before the fix
            assert alias_uuids(node.cdi_dir, name) == uuid["cwait"]


def whole(alloc: Any) -> Any:
    for s in alloc["spec"]["slices"]:
        s["kind"] = "gpu"
    return alloc


async def test_whole_gpus_are_bound_with_the_same_rules(
    kube: Kube, namespace: str, tmp_path: Path, control_plane: ControlPlane, kubelet: FakeKubelet
) -> None:
    """Whole GPUs in the device-plugin mode (issue 24): a plugin for `instaslice.io/gpu`
    lists one device per GPU that can serve whole; Allocate binds the ids to a Ready
    whole-GPU allocation's unit and answers its CDI alias (`NVIDIA_VISIBLE_DEVICES=GPU-…`);
    PreStartContainer refuses a pod that has no allocation (a thief whose ids took the
    owner's unit) and moves the owner's ids onto its own GPU."""
    node = await gpu_node(kube, tmp_path, [H200, H200])
    ns = namespace
    async with running_agent(dp_settings(node, control_plane, kubelet)):

        async def gpu_registered() -> bool:
            return any(r.resource_name == GPU_RES for r in kubelet.registered)

        await eventually(gpu_registered, what="registration of instaslice.io/gpu")
        reg = next(r for r in kubelet.registered if r.resource_name == GPU_RES)
        assert reg.options.pre_start_required and reg.endpoint == "instaslice-gpu.sock"
        ch, stub = kubelet.plugin(GPU_RES)
        async with ch:
            stream = stub.ListAndWatch(dp.Empty())
            listed = await stream.read()
            while not listed.devices:  # registered before the agent had read its GPUs
                listed = await stream.read()
            assert sorted(d.ID for d in listed.devices) == ["gpu-0", "gpu-1"]
            assert {d.health for d in listed.devices} == {"Healthy"}
            stream.cancel()

            owned = whole(slice_allocation(ns, node, [("train", "gpu", 1, 0, 8)], claim="cw"))
            await create_allocation(kube, owned)
            ready = await wait_phase(kube, owned, "Ready")
            gpu = ready["status"]["slices"][0]["migUUID"]
            assert gpu == node.gpu_uuid(1)
            assert node.emu.state().gpus[1].mig_current == 0  # MIG turned off for it

            owner = pod(ns, "pod-cw", "train", ["gpu-1"], GPU_RES)
            name = await thief_refused_then_owner_bound(
                stub, kubelet, node, owner, ("gpu-0", "gpu-1")
            )
            assert name == "instaslice.io/mig=dp-gpu-1"
            assert alias_uuids(node.cdi_dir, name) == gpu

            async def recorded() -> bool:
                obj = await get_allocation(kube, ns, "cw")
                conds = (obj or {}).get("status", {}).get("conditions") or []
                c = next((c for c in conds if c["type"] == "DeviceBound"), None)
                return (
                    c is not None
                    and "train/gpu: kubelet devices gpu-1 of pod pod-cw" in (c["message"])
                )

            await eventually(recorded, what="DeviceBound condition")
            await kube.delete(instaslice_path("sliceallocations", ns, "cw"))
            await wait_gone(kube, owned)
            assert not (node.cdi_dir / "instaslice.io-plugin-gpu-1.json").exists()


async def test_a_slice_is_allocatable_as_soon_as_its_allocation_says_ready(
    kube: Kube,
    namespace: str,
    tmp_path: Path,
    control_plane: ControlPlane,
    kubelet: FakeKubelet,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ready lets the allocator ungate the pod, and a real kubelet may call Allocate a few
    milliseconds later: the binding must know the slice by then. The agent told it only after
    the Ready write and the record's write, and a loaded machine (the e2e real-node test under
    three CPU hogs) saw Allocate refused 3 ms before the agent's "slices ready": the pod failed
    with UnexpectedAdmissionError. Here the record's write is held until Allocate answered."""
    persist = AgentNode.persist
    let_go = asyncio.Event()

    async def held_persist(self: AgentNode, durable: bool = False) -> None:
        if any(c.state == "ready" for c in self.cp.claims.values()):
            await let_go.wait()  # the record's `ready`, written after the Ready write
        await persist(self, durable)

    node = await gpu_node(kube, tmp_path, [H200])
    async with running_agent(dp_settings(node, control_plane, kubelet)):
        await eventually(registered(kubelet), what="registration")
        monkeypatch.setattr(AgentNode, "persist", held_persist)
        ch, stub = kubelet.plugin(RES)
        async with ch:
            a = slice_allocation(namespace, node, [("main", "1g.18gb", 0, 0, 1)], claim="cnow")
            await create_allocation(kube, a)
            await wait_phase(kube, a, "Ready")
            try:
                got = await stub.Allocate(one_id("1g.18gb-0"))  # refused before the fix
            finally:
                let_go.set()
            assert got.container_responses[0].cdi_devices[0].name


async def test_a_profile_that_appears_later_is_registered_without_the_others_again(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    """The agent's capacity grows after it registered (found by the chart install, where the
    agent's pod starts before its MIG capacity is known): the new profile is registered, the
    one already served is not registered again (a real kubelet refuses that with "device
    plugin already connected", and the new profile never came)."""
    capacity = {GPU_RES: "1"}
    binding = DevicePluginBinding(
        kube=None,
        cdi_dir=tmp_path,
        kubelet_dir=kubelet.root,
        pod_resources_socket=kubelet.root / "pr.sock",
        refresh_s=0.05,
    )
    binding.attach(lambda: capacity, list)

    def names() -> list[str]:
        return sorted(r.resource_name for r in kubelet.registered)

    async def has(want: list[str]) -> bool:
        return names() == want

    task = asyncio.create_task(binding.run())
    try:
        await eventually(lambda: has([GPU_RES]), what="instaslice.io/gpu registered")
        capacity[RES] = "7"
        await eventually(lambda: has([GPU_RES, RES]), what=f"{RES} registered, gpu once")
        kubelet.registered.clear()
        await kubelet.restart()  # a new kubelet: every resource again, once
        await eventually(lambda: has([GPU_RES, RES]), what="both registered with the new kubelet")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
