"""Warm slices in the running agent (docs/warm-slices.md), against a real API server and the
emulator: a slice asked for is made ahead of the next ask and listed on the MigNode as warm;
an allocation placed on it gets it with no NVML create call; one overlapping it has it
destroyed first; a stop between the handover and the Ready write neither leaks the instance
nor makes it twice.

The agent's NVML session is wrapped to log the create calls, in the order they ran. What to
warm and the handover's bookkeeping are unit-tested (tests/unit/test_nodeagent_warm.py).
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from common.kubeapi import Kube
from hack.cluster import ControlPlane
from nodeagent.lifebase import LifeBase
from tests.integration.agent_fixtures import (
    GpuNode,
    agent_settings,
    create_allocation,
    eventually,
    gpu_node,
    mig_node,
    running_agent,
    slice_allocation,
    wait_phase,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]
H100 = "H100-80GB"
Obj = dict[str, Any]


class Creates:
    """Wraps a session's create_gi / create_ci: (call, GPU, start or GI id) in order."""

    def __init__(self, session: Any) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self._lock = threading.Lock()
        for name in ("create_gi", "create_ci"):
            setattr(session, name, self._wrap(name, getattr(session, name)))

    def _wrap(self, name: str, real: Any) -> Any:
        def call(gpu: int, *rest: Any) -> Any:
            out = real(gpu, *rest)
            with self._lock:  # create_gi(gpu, profile, start, size); create_ci(gpu, gi, ...)
                self.calls.append((name, gpu, rest[1] if name == "create_gi" else rest[0]))
            return out

        return call


async def _warm(kube: Kube, node: str, profile: str) -> Obj:
    """The first warm slice of `profile` the MigNode lists on GPU 0."""

    async def listed() -> Obj | None:
        mn = await mig_node(kube, node)
        gpus = (mn or {}).get("status", {}).get("gpus") or []
        found = [s for s in gpus[0].get("slices") or [] if s.get("warm")] if gpus else []
        return next((s for s in found if s["profile"] == profile), None)

    return await eventually(listed, what=f"a warm {profile} slice on the MigNode", within=30)


def _settings(node: GpuNode, cp: ControlPlane, **kw: Any) -> Any:
    return agent_settings([node], cp.kubeconfig, warm_slices=True, warm_per_node=1, **kw)


async def test_a_warm_slice_is_handed_over_without_an_nvml_create(
    agent_kube: Kube, alloc_ns: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    node = await gpu_node(agent_kube, tmp_path, [H100])
    async with running_agent(_settings(node, control_plane)) as agents:
        first = slice_allocation(alloc_ns, node, [("c", "1g.10gb", 0, 6, 1)])
        await create_allocation(agent_kube, first)
        await wait_phase(agent_kube, first, "Ready")
        warm = await _warm(agent_kube, node.name, "1g.10gb")  # the demand seen: one kept
        assert warm["start"] != 6 and "claim" not in warm
        log = Creates(agents[node.name].life.gpus.s)
        placed = slice_allocation(alloc_ns, node, [("c", "1g.10gb", 0, warm["start"], 1)])
        await create_allocation(agent_kube, placed)
        got = await wait_phase(agent_kube, placed, "Ready")
        assert got["status"]["slices"][0]["migUUID"] == warm["migUUID"]
        gi = got["status"]["slices"][0]["giID"]
        assert ("create_gi", 0, warm["start"]) not in log.calls, log.calls
        assert ("create_ci", 0, gi) not in log.calls, log.calls
        text = agents[node.name].metrics.registry.get_sample_value(
            "instaslice_nodeagent_warm_slices_total", {"node": node.name, "event": "hit"}
        )
        assert text == 1.0
    assert sorted(i[2] for i in node.instances() if i[1] == "1g.10gb").count(warm["start"]) == 1


async def test_a_warm_slice_in_the_way_is_destroyed_first(
    agent_kube: Kube, alloc_ns: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    node = await gpu_node(agent_kube, tmp_path, [H100])
    async with running_agent(_settings(node, control_plane)):
        first = slice_allocation(alloc_ns, node, [("c", "1g.10gb", 0, 6, 1)])
        await create_allocation(agent_kube, first)
        await wait_phase(agent_kube, first, "Ready")
        warm = await _warm(agent_kube, node.name, "1g.10gb")
        start = warm["start"] - warm["start"] % 2  # the 2g.20gb window holding it
        assert start in (0, 2, 4)
        big = slice_allocation(alloc_ns, node, [("c", "2g.20gb", 0, start, 2)])
        await create_allocation(agent_kube, big)
        got = await wait_phase(agent_kube, big, "Ready")
        assert got["status"]["slices"][0]["migUUID"] != warm["migUUID"]
        assert (0, "2g.20gb", start, 2) in [i[:4] for i in node.instances()]


async def test_a_stop_between_handover_and_ready_neither_leaks_nor_makes_twice(
    agent_kube: Kube,
    alloc_ns: str,
    tmp_path: Path,
    control_plane: ControlPlane,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The handover is one checkpoint write (the warm record out, the claim's record naming
    the instance in): the agent stopped right after it, the next one finishes the create on
    that instance, with no NVML create and no instance left over."""
    node = await gpu_node(agent_kube, tmp_path, [H100])
    settings = _settings(node, control_plane)
    async with running_agent(settings):
        first = slice_allocation(alloc_ns, node, [("c", "1g.10gb", 0, 6, 1)])
        await create_allocation(agent_kube, first)
        await wait_phase(agent_kube, first, "Ready")
        warm = await _warm(agent_kube, node.name, "1g.10gb")
    stuck = asyncio.Event()
    real_write_cdi = LifeBase.write_cdi

    async def never(self: LifeBase, rec: Any) -> None:
        stuck.set()
        await asyncio.Event().wait()  # the stop comes here: after the intent, before Ready

    monkeypatch.setattr(LifeBase, "write_cdi", never)
    placed = slice_allocation(alloc_ns, node, [("c", "1g.10gb", 0, warm["start"], 1)])
    async with running_agent(settings) as agents:
        await create_allocation(agent_kube, placed)
        await asyncio.wait_for(stuck.wait(), 30)
        log = Creates(agents[node.name].life.gpus.s)
    doc = json.loads(node.checkpoint.read_text())
    owners = [c for c in doc["claims"] if c["name"] == placed["metadata"]["name"]]
    assert owners and owners[0]["slices"][0]["mig_uuid"] == warm["migUUID"], doc
    assert not [c for c in doc["claims"] if c["state"] == "warm" and
                c["slices"][0]["start"] == warm["start"]], doc  # fmt: skip
    monkeypatch.setattr(LifeBase, "write_cdi", real_write_cdi)
    async with running_agent(settings) as agents:
        log = Creates(agents[node.name].life.gpus.s)
        got = await wait_phase(agent_kube, placed, "Ready")
        assert got["status"]["slices"][0]["migUUID"] == warm["migUUID"]
    assert ("create_gi", 0, warm["start"]) not in log.calls, log.calls
    at = [i for i in node.instances() if i[2] == warm["start"]]
    assert len(at) == 1, node.instances()
