"""DRA mode's kubelet plugin against the real API server, with a fake kubelet (the gRPC
client side of the registration and `v1.DRAPlugin` over the agent's unix sockets).

- Registration: GetInfo names driver instaslice.io, type DRAPlugin, `v1.DRAPlugin` and the
  plugin socket; the agent takes NotifyRegistrationStatus.
- Eager carving: once a claim is allocated to the node (and reserved, as an allocator or the
  scheduler writes it) its MIG instance exists before any prepare call; NodePrepareResources
  answers with the CDI device id, whose spec file the CDI reference library injects; a second
  prepare and a prepare after an agent restart answer the same, with nothing made twice.
- Checks: a claim allocated to another node, or to a placement a foreign instance holds,
  gets the claim's own error, never a slice.
- NodeUnprepareResources destroys the instance and removes the CDI file; a deleted claim
  holding the finalizer `instaslice.io/release` loses it once its slices are gone.
- Resource health (`v1.DRAResourceHealth`, advertised at registration): the stream lists the
  prepared claims' devices HEALTHY; a GPU that goes unhealthy (an NVML XID event) reports its
  devices UNHEALTHY with the reason at once, the other GPU's stay HEALTHY; an unprepared
  claim's device leaves the list.
Leaves out: a real kubelet and container (tests/e2e/test_realnode.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from common.constants import RELEASE_FINALIZER, AllocationMode
from common.kubeapi import ApiError, Kube, core_path
from hack.cluster import ControlPlane
from nodeagent.deviceplugin._gen.dra.v1 import api_pb2 as dra
from nodeagent.deviceplugin._gen.dra.v1 import api_pb2_grpc as dra_grpc
from nodeagent.deviceplugin._gen.drahealth.v1 import api_pb2 as health
from nodeagent.deviceplugin._gen.drahealth.v1 import api_pb2_grpc as health_grpc
from nodeagent.deviceplugin._gen.pluginregistration.v1 import api_pb2 as reg
from nodeagent.deviceplugin._gen.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from nodeagent.dra.carve import claim_path
from nodeagent.dra.plugin import Sockets
from tests.integration.agent_fixtures import (
    GpuNode,
    agent_settings,
    cdi_inject,
    eventually,
    gpu_node,
    running_agent,
)

pytestmark = pytest.mark.integration

H100 = "H100-80GB"
Obj = dict[str, Any]


@pytest.fixture
async def ns(agent_kube: Kube, namespace: str) -> AsyncIterator[str]:
    """The test namespace; its leftover claims lose their finalizer so it can go."""
    yield namespace
    got = await agent_kube.list(claim_path(namespace))
    for c in got.get("items") or []:
        if c["metadata"].get("finalizers"):
            path = claim_path(namespace, c["metadata"]["name"])
            await agent_kube.patch(path, {"metadata": {"finalizers": None}})


async def allocated_claim(
    kube: Kube, ns: str, name: str, node: str, device: str, *, finalizer: bool = False
) -> Obj:
    """A claim allocated to `device` of `node`'s pool and reserved for a pod, written as
    InstaSlice's allocator writes it (allocation and reservedFor in one status update)."""
    meta: Obj = {"name": name, "namespace": ns}
    if finalizer:
        meta["finalizers"] = [RELEASE_FINALIZER]
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": meta,
        "spec": {
            "devices": {
                "requests": [{"name": "slice", "exactly": {"deviceClassName": "mig.instaslice.io"}}]
            }
        },
    }
    made = await kube.create(claim_path(ns), body)
    # the consumer: a gated pod naming the claim (the resourceclaim controller drops a
    # reservation for a pod that does not exist)
    pod = await kube.create(
        core_path("pods", ns),
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"{name}-pod", "namespace": ns},
            "spec": {
                "schedulingGates": [{"name": "test.instaslice.io/hold"}],
                "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
                "containers": [
                    {
                        "name": "main",
                        "image": "registry.k8s.io/pause:3.10",
                        "resources": {"claims": [{"name": "gpu"}]},
                    }
                ],
            },
        },
    )
    made["status"] = {
        "allocation": {
            "devices": {
                "results": [
                    {"request": "slice", "driver": "instaslice.io", "pool": node, "device": device}
                ]
            },
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                ]
            },
        },
        "reservedFor": [
            {"resource": "pods", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}
        ],
    }
    return await kube.replace(claim_path(ns, name) + "/status", made)


def claim_msg(c: Obj) -> Any:
    m = c["metadata"]
    return dra.Claim(namespace=m["namespace"], uid=m["uid"], name=m["name"])


async def prepare(sock: Path, *claims: Obj) -> Any:
    async with grpc.aio.insecure_channel(f"unix://{sock}") as ch:
        req = dra.NodePrepareResourcesRequest(claims=[claim_msg(c) for c in claims])
        return await dra_grpc.DRAPluginStub(ch).NodePrepareResources(req, timeout=60)


async def unprepare(sock: Path, *claims: Obj) -> Any:
    async with grpc.aio.insecure_channel(f"unix://{sock}") as ch:
        req = dra.NodeUnprepareResourcesRequest(claims=[claim_msg(c) for c in claims])
        return await dra_grpc.DRAPluginStub(ch).NodeUnprepareResources(req, timeout=60)


def settings_for(node: GpuNode, cp: ControlPlane, tmp: Path) -> Any:
    return dataclasses.replace(
        agent_settings([node], cp.kubeconfig),
        allocation=AllocationMode.DRA,
        dra_registry_dir=tmp / "plugins_registry",
        dra_plugins_dir=tmp / "plugins",
    )


async def test_register_carve_prepare_unprepare(
    kube: Kube, ns: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    node = await gpu_node(kube, tmp_path, [H100], prefix="drp")
    settings = settings_for(node, control_plane, tmp_path)
    sockets = Sockets(settings.dra_registry_dir, settings.dra_plugins_dir)
    async with running_agent(settings) as agents:
        async with grpc.aio.insecure_channel(f"unix://{sockets.registration}") as ch:
            stub = reg_grpc.RegistrationStub(ch)
            info = await stub.GetInfo(reg.InfoRequest(), timeout=10)
            assert (info.type, info.name, list(info.supported_versions)) == (
                "DRAPlugin", "instaslice.io", ["v1.DRAPlugin", "v1.DRAResourceHealth"],
            )  # fmt: skip
            assert Path(info.endpoint) == sockets.plugin
            await stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=True))
        assert agents[node.name].claims is not None

        c = await allocated_claim(kube, ns, "c1", node.name, "gpu-0-mig-9-4", finalizer=True)

        async def carved() -> bool:  # before any prepare call: eager
            return node.instances() == [(0, "3g.40gb", 4, 4, 0)]

        await eventually(carved, what="the claim's slice made eagerly")
        uid = c["metadata"]["uid"]
        cdi_id = f"instaslice.io/mig={ns}_c1_gpu-0-mig-9-4"
        for _ in range(2):  # idempotent by UID
            got = (await prepare(sockets.plugin, c)).claims[uid]
            assert got.error == ""
            (d,) = got.devices
            assert (list(d.request_names), d.pool_name, d.device_name) == (
                ["slice"], node.name, "gpu-0-mig-9-4",
            )  # fmt: skip
            assert list(d.cdi_device_ids) == [cdi_id]
        assert node.instances() == [(0, "3g.40gb", 4, 4, 0)]
        injected = cdi_inject([node.cdi_dir], [cdi_id])  # the CDI reference library
        assert injected["rc"] == 0 and not injected["unresolved"], injected
        assert not any(injected["errors"].values()), injected["errors"]

        # another node's claim, and a placement that overlaps the one made: refused
        other = await allocated_claim(kube, ns, "c2", "elsewhere", "gpu-0-mig-19-0")
        clash = await allocated_claim(kube, ns, "c3", node.name, "gpu-0-mig-19-5")
        answers = (await prepare(sockets.plugin, other, clash)).claims
        assert "not" in answers[other["metadata"]["uid"]].error
        assert "overlaps" in answers[clash["metadata"]["uid"]].error, node.instances()
        assert not answers[clash["metadata"]["uid"]].devices
        await kube.delete(claim_path(ns, "c3"))

    # the agent restarted: the kubelet re-prepares; same answer, nothing made twice
    async with running_agent(settings):
        got = (await prepare(sockets.plugin, c)).claims[uid]
        assert [list(d.cdi_device_ids) for d in got.devices] == [[cdi_id]]
        assert node.instances() == [(0, "3g.40gb", 4, 4, 0)]

        assert (await unprepare(sockets.plugin, c)).claims[uid].error == ""
        assert node.instances() == []
        assert node.cdi_files() == []
        assert (await unprepare(sockets.plugin, c)).claims[uid].error == ""  # again: done

        # deleted: its finalizer comes off (nothing is held any more)
        await kube.delete(claim_path(ns, "c1"))

        async def gone() -> bool:
            try:
                await kube.get(claim_path(ns, "c1"))
            except ApiError as exc:
                return exc.not_found
            return False

        await eventually(gone, what="the claim's finalizer dropped")


async def test_deleted_claim_releases_and_drops_finalizer(
    kube: Kube, ns: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    """Deallocation without the kubelet (a pod deleted before it started): the slices go,
    then the finalizer."""
    node = await gpu_node(kube, tmp_path, [H100], prefix="drd")
    settings = settings_for(node, control_plane, tmp_path)
    async with running_agent(settings):
        await allocated_claim(kube, ns, "c1", node.name, "gpu-0-mig-19-6", finalizer=True)

        async def carved() -> bool:
            return node.instances() == [(0, "1g.10gb", 6, 1, 0)] and bool(node.cdi_files())

        await eventually(carved, what="the slice made")
        await kube.delete(claim_path(ns, "c1"))

        async def released() -> bool:
            try:
                await kube.get(claim_path(ns, "c1"))
                return False
            except ApiError as exc:
                return exc.not_found and node.instances() == [] and node.cdi_files() == []

        await eventually(released, what="slices released, then the finalizer dropped")


async def test_a_claim_deleted_while_the_agent_was_down_is_released_on_restart(
    kube: Kube, ns: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    """Nothing leaked across a restart: the records say what was made; the claim, deleted
    meanwhile (held by its finalizer), is released and let go by the next agent."""
    node = await gpu_node(kube, tmp_path, [H100], prefix="drk")
    settings = settings_for(node, control_plane, tmp_path)
    async with running_agent(settings):
        await allocated_claim(kube, ns, "c1", node.name, "gpu-0-mig-14-0", finalizer=True)

        async def carved() -> bool:
            return node.instances() == [(0, "2g.20gb", 0, 2, 0)]

        await eventually(carved, what="the slice made")
    await kube.delete(claim_path(ns, "c1"))  # the agent is down
    assert node.instances() == [(0, "2g.20gb", 0, 2, 0)]
    async with running_agent(settings):

        async def released() -> bool:
            try:
                await kube.get(claim_path(ns, "c1"))
                return False
            except ApiError as exc:
                return exc.not_found and node.instances() == [] and node.cdi_files() == []

        await eventually(released, what="released and let go after the restart")


Healths = dict[str, tuple[str, str]]  # device -> (HEALTHY | UNHEALTHY, message)


async def next_health(
    stream: Any, want: Callable[[Healths], bool], what: str, within: float = 30.0
) -> Healths:
    """The stream's messages until one whose devices satisfy `want`."""
    got: Healths = {}
    try:
        async with asyncio.timeout(within):
            async for resp in stream:
                got = {
                    d.device.device_name: (health.HealthStatus.Name(d.health), d.message)
                    for d in resp.devices
                }
                if want(got):
                    return got
    except TimeoutError:
        pass
    raise AssertionError(f"{what}: last message {got}")


async def test_health_stream_reports_an_unhealthy_gpus_devices(
    kube: Kube, ns: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    node = await gpu_node(kube, tmp_path, [H100, H100], prefix="drh")
    settings = settings_for(node, control_plane, tmp_path)
    sockets = Sockets(settings.dra_registry_dir, settings.dra_plugins_dir)
    d0, d1 = "gpu-0-mig-19-0", "gpu-1-mig-19-0"
    async with running_agent(settings):
        c0 = await allocated_claim(kube, ns, "h0", node.name, d0, finalizer=True)
        c1 = await allocated_claim(kube, ns, "h1", node.name, d1, finalizer=True)
        async with grpc.aio.insecure_channel(f"unix://{sockets.plugin}") as ch:
            stream = health_grpc.DRAResourceHealthStub(ch).NodeWatchResources(
                health.NodeWatchResourcesRequest()
            )
            answers = (await prepare(sockets.plugin, c0, c1)).claims
            assert all(a.error == "" for a in answers.values()), answers
            both = {d0: ("HEALTHY", ""), d1: ("HEALTHY", "")}
            await next_health(stream, lambda h: h == both, "both prepared devices healthy")

            node.emu.emit_xid(1, 48)  # double-bit ECC error on GPU 1
            got = await next_health(
                stream, lambda h: h.get(d1, ("",))[0] == "UNHEALTHY", "GPU 1's device unhealthy"
            )
            assert got[d0] == ("HEALTHY", ""), got
            assert "48" in got[d1][1], got  # NVML's reason: the XID

            assert (await unprepare(sockets.plugin, c0)).claims[c0["metadata"]["uid"]].error == ""
            got = await next_health(stream, lambda h: d0 not in h, "the unprepared device gone")
            assert set(got) == {d1}, got
            stream.cancel()
