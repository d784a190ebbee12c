"""DRA mode's pool on the real API server (v1.37.2): the node agent's ResourceSlices.

- Pool protocol: the agent (--allocation-mode dra) publishes a counter slice and one device
  slice per GPU, all of one generation with `resourceSliceCount`; the API server keeps the
  shared counters and each device's consumption (no feature gate needed). An unhealthy GPU
  (an XID) leaves the pool: a new generation without its counter set, its slice deleted. A
  restarted agent goes on from the generation the API server holds, and one whose pool did not
  change writes nothing.
- A user's own ResourceClaim with `deviceClassName: mig.instaslice.io` and CEL on `profile`
  is allocated by kube-scheduler from the published slices, to the first device in
  InstaSlice's order (3g.40gb at start 4, not 0).
Leaves out: the kubelet plugin (a KWOK node has no kubelet), the allocator's side.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from common.constants import AllocationMode
from common.kubeapi import ApiError, Kube, core_path, group_path
from hack.cluster import ControlPlane
from nodeagent.dra.publish import PoolPublisher, slices_path
from tests.integration.agent_fixtures import (
    agent_settings,
    eventually,
    gpu_node,
    running_agent,
)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
H100 = "H100-80GB"
Obj = dict[str, Any]


async def device_classes(kube: Kube) -> None:
    path = group_path("resource.k8s.io/v1", "deviceclasses")
    for doc in yaml.safe_load_all(
        (ROOT / "manifests/components/dra/deviceclasses.yaml").read_text()
    ):
        try:
            await kube.create(path, doc)
        except ApiError as exc:
            if exc.status != 409:
                raise


async def pool(kube: Kube, node: str) -> list[Obj]:
    got = await kube.list(slices_path(), fieldSelector=f"spec.nodeName={node}")
    return sorted(got.get("items") or [], key=lambda o: o["metadata"]["name"])


def generations(slices: list[Obj]) -> set[tuple[int, int]]:
    return {
        (o["spec"]["pool"]["generation"], o["spec"]["pool"]["resourceSliceCount"]) for o in slices
    }


@pytest.fixture
def slow_creates(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each slice the agent creates lands half a second late (a loaded API server), so a
    check that takes part of a generation for the whole of it stops the agent mid-write."""
    write = PoolPublisher._write

    async def slow(self: PoolPublisher, body: Obj, current: Obj | None) -> None:
        if current is None:
            await asyncio.sleep(0.5)
        await write(self, body, current)

    monkeypatch.setattr(PoolPublisher, "_write", slow)


@pytest.mark.usefixtures("slow_creates")
async def test_pool_protocol(kube: Kube, tmp_path: Path, control_plane: ControlPlane) -> None:
    node = await gpu_node(kube, tmp_path, [H100, H100], prefix="dra")
    settings = agent_settings([node], control_plane.kubeconfig, allocation=AllocationMode.DRA)
    async with running_agent(settings):

        async def three() -> bool:
            return len(await pool(kube, node.name)) == 3

        await eventually(three, what="the pool's three slices")
        slices = await pool(kube, node.name)
        ((gen, count),) = generations(slices)
        assert count == 3
        counters = next(o for o in slices if o["spec"].get("sharedCounters"))
        assert [c["name"] for c in counters["spec"]["sharedCounters"]] == ["gpu-0", "gpu-1"]
        devices = next(o for o in slices if o["metadata"]["name"].endswith("gpu-0-0"))
        first = devices["spec"]["devices"][0]
        assert first["name"] == "gpu-0-mig-19-5"
        assert first["consumesCounters"][0]["counters"]["memory-slice-5"] == {"value": "1"}
        assert first["attributes"]["profile"] == {"string": "1g.10gb"}

        node.emu.emit_xid(1, 79)  # GPU 1 falls off the bus: it leaves the pool

        async def without_gpu1() -> bool:
            s = await pool(kube, node.name)
            return len(s) == 2 and generations(s) == {(gen + 1, 2)}

        await eventually(without_gpu1, what="a new generation without GPU 1")
        slices = await pool(kube, node.name)
        counters = next(o for o in slices if o["spec"].get("sharedCounters"))
        assert [c["name"] for c in counters["spec"]["sharedCounters"]] == ["gpu-0"]
        assert not any(o["metadata"]["name"].endswith("gpu-1-0") for o in slices)

    # restarted: NVML says GPU 1 is fine again, so it is back, one generation on
    async with running_agent(settings):

        async def back() -> bool:  # all three: two of them alone read as gen + 2 too
            s = await pool(kube, node.name)
            return len(s) == 3 and generations(s) == {(gen + 2, 3)}

        await eventually(back, what="GPU 1 back, generation counted on")

    # restarted with nothing changed: nothing written
    async with running_agent(settings) as agents:
        agent = agents[node.name]

        async def published() -> bool:
            return agent.pool is not None and agent.pool.generation == gen + 2

        await eventually(published, what="the pool checked")
        assert agent.pool is not None and agent.pool.writes == 0
        assert generations(await pool(kube, node.name)) == {(gen + 2, 3)}


async def test_a_generation_cut_short_is_completed_at_start(
    kube: Kube, tmp_path: Path, control_plane: ControlPlane
) -> None:
    """An agent stopped between two slices of a generation leaves it incomplete (the
    scheduler reads none of it): the next start writes only the missing slice, in that
    generation, and no new generation of the whole pool."""
    node = await gpu_node(kube, tmp_path, [H100, H100], prefix="drc")
    settings = agent_settings([node], control_plane.kubeconfig, allocation=AllocationMode.DRA)
    async with running_agent(settings):

        async def three() -> bool:
            return len(await pool(kube, node.name)) == 3

        await eventually(three, what="the pool's three slices")
    slices = await pool(kube, node.name)
    ((gen, _),) = generations(slices)
    last = next(o for o in slices if o["metadata"]["name"].endswith("gpu-1-0"))
    await kube.delete(slices_path(last["metadata"]["name"]))  # the write that never came
    async with running_agent(settings) as agents:
        await eventually(three, what="the pool completed")
        assert generations(await pool(kube, node.name)) == {(gen, 3)}
        publisher = agents[node.name].pool
        assert publisher is not None and publisher.writes == 1


async def test_users_claim_is_allocated_by_kube_scheduler(
    kube: Kube, alloc_ns: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    await device_classes(kube)
    node = await gpu_node(kube, tmp_path, [H100], prefix="drs")
    settings = dataclasses.replace(
        agent_settings([node], control_plane.kubeconfig), allocation=AllocationMode.DRA
    )
    claims = group_path("resource.k8s.io/v1", "resourceclaims", alloc_ns)
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "mine", "namespace": alloc_ns},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "slice",
                        "exactly": {
                            "deviceClassName": "mig.instaslice.io",
                            "selectors": [
                                {
                                    "cel": {
                                        "expression": 'device.attributes["instaslice.io"]'
                                        '.profile == "3g.40gb"'
                                    }
                                }
                            ],
                        },
                    }
                ]
            }
        },
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "user", "namespace": alloc_ns},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node.name},
            "resourceClaims": [{"name": "gpu", "resourceClaimName": "mine"}],
            "containers": [
                {
                    "name": "main",
                    "image": "registry.k8s.io/pause:3.10",
                    "resources": {"claims": [{"name": "gpu"}]},
                }
            ],
        },
    }
    async with running_agent(settings):

        async def published() -> bool:
            return len(await pool(kube, node.name)) == 2

        await eventually(published, what="the pool")
        await kube.create(claims, claim)
        await kube.create(core_path("pods", alloc_ns), pod)

        async def allocated() -> Obj | None:
            got = await kube.get(f"{claims}/mine")
            return (got.get("status") or {}).get("allocation")

        allocation = await eventually(allocated, within=60, what="the claim allocated")
        (result,) = allocation["devices"]["results"]
        assert (result["driver"], result["pool"]) == ("instaslice.io", node.name)
        assert result["device"] == "gpu-0-mig-9-4"  # InstaSlice's order: 3g at 4 before 0

        # by memory (docs/dra.md): the first device in InstaSlice's order with >= 15 GiB
        # whose slots the 3g at 4 leaves free
        cel = 'device.capacity["instaslice.io"].memory.compareTo(quantity("15Gi")) >= 0'
        by_memory = json.loads(json.dumps(claim))
        by_memory["metadata"]["name"] = "by-memory"
        by_memory["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = [
            {"cel": {"expression": cel}}
        ]
        second = json.loads(json.dumps(pod))
        second["metadata"]["name"] = "user2"
        second["spec"]["resourceClaims"][0]["resourceClaimName"] = "by-memory"
        await kube.create(claims, by_memory)
        await kube.create(core_path("pods", alloc_ns), second)

        async def allocated2() -> Obj | None:
            got = await kube.get(f"{claims}/by-memory")
            return (got.get("status") or {}).get("allocation")

        (result,) = (await eventually(allocated2, within=60, what="by memory"))["devices"][
            "results"
        ]
        devices = [d for o in await pool(kube, node.name) for d in o["spec"].get("devices", [])]
        want = next(
            d["name"]
            for d in devices
            if d["attributes"]["type"]["string"] == "mig"
            and int(d["capacity"]["memory"]["value"].removesuffix("Mi")) >= 15 * 1024
            and d["attributes"]["start"]["int"] + d["attributes"]["size"]["int"] <= 4
        )
        assert result["device"] == want
        await kube.delete(core_path("pods", alloc_ns, "user2"), {"gracePeriodSeconds": 0})
        await kube.delete(core_path("pods", alloc_ns, "user"), {"gracePeriodSeconds": 0})


async def test_extended_resource_classes_serve_plain_pods(
    kube: Kube, alloc_ns: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    """The off-by-default component dra-extended-resources: a plain pod asking
    `nvidia.com/mig-1g.10gb` (no webhook, no claim of its own) gets the first 1g.10gb device
    in InstaSlice's order from kube-scheduler."""
    path = group_path("resource.k8s.io/v1", "deviceclasses")
    text = (ROOT / "manifests/components/dra-extended-resources/deviceclasses.yaml").read_text()
    for doc in yaml.safe_load_all(text):
        try:
            await kube.create(path, doc)
        except ApiError as exc:
            if exc.status != 409:
                raise
    node = await gpu_node(kube, tmp_path, [H100], prefix="dre")
    settings = agent_settings([node], control_plane.kubeconfig, allocation=AllocationMode.DRA)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "plain", "namespace": alloc_ns},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node.name},
            "containers": [
                {
                    "name": "main",
                    "image": "registry.k8s.io/pause:3.10",
                    "resources": {"limits": {"nvidia.com/mig-1g.10gb": "1"}},
                }
            ],
        },
    }
    async with running_agent(settings):

        async def published() -> bool:
            return len(await pool(kube, node.name)) == 2

        await eventually(published, what="the pool")
        await kube.create(core_path("pods", alloc_ns), pod)
        claims = group_path("resource.k8s.io/v1", "resourceclaims", alloc_ns)

        async def allocated() -> Obj | None:
            items = (await kube.list(claims)).get("items") or []
            mine = [c for c in items if c["metadata"]["name"].startswith("plain-extended")]
            return ((mine[0].get("status") or {}).get("allocation")) if mine else None

        allocation = await eventually(allocated, within=60, what="the extended-resource claim")
        (result,) = allocation["devices"]["results"]
        assert (result["pool"], result["device"]) == (node.name, "gpu-0-mig-19-5")
        await kube.delete(core_path("pods", alloc_ns, "plain"), {"gracePeriodSeconds": 0})


async def test_slices_deleted_underneath_are_written_again(
    kube: Kube, tmp_path: Path, control_plane: ControlPlane
) -> None:
    """The kubelet deletes a driver's slices when its plugin unregisters (an agent or kubelet
    restart); the agent sees it in its watch and writes the pool again, a generation on."""
    node = await gpu_node(kube, tmp_path, [H100], prefix="drw")
    settings = agent_settings([node], control_plane.kubeconfig, allocation=AllocationMode.DRA)
    async with running_agent(settings):

        async def two() -> bool:
            return len(await pool(kube, node.name)) == 2

        await eventually(two, what="the pool")
        ((gen, _),) = generations(await pool(kube, node.name))
        for o in await pool(kube, node.name):
            await kube.delete(slices_path(o["metadata"]["name"]))

        async def again() -> bool:
            s = await pool(kube, node.name)
            return len(s) == 2 and generations(s) == {(gen + 1, 2)}

        await eventually(again, what="the pool written again")
