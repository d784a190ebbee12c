"""A GPU's NVML lane in the running agent (issue 25): a create's calls go ahead of the
releases queued on the same GPU, and a create whose slots a release still holds waits for
that release instead of failing (and, past the wait's cap, goes on and fails as before).
Against a real API server and the emulator (its GI/CI
latency makes the order visible: each call sleeps before it changes anything).

The order is read from the agent's own NVML session: its create and destroy calls are
wrapped to log what they did, in the order they ran. The lane itself, and which records a
create waits for, are unit-tested (tests/unit/test_nodeagent_lane.py,
test_nodeagent_reconcile.py::test_held_by_release).
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from common.kubeapi import Kube
from hack.cluster import ControlPlane
from nodeagent import checkpoint, create
from tests.integration.agent_fixtures import (
    GpuNode,
    agent_settings,
    create_allocation,
    delete_allocation,
    eventually,
    gpu_node,
    running_agent,
    slice_allocation,
    wait_gone,
    wait_phase,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]
H200 = "H200-141GB"
Obj = dict[str, Any]


class NvmlLog:
    """Wraps a session's create_gi / destroy_ci / destroy_gi: (call, GPU, GI id or start) in
    the order they ran; `destroying` is set when the first destroy starts."""

    def __init__(self, session: Any) -> None:
        self.calls: list[tuple[str, int]] = []
        self.destroying = threading.Event()
        self._lock = threading.Lock()
        for name in ("create_gi", "destroy_ci", "destroy_gi"):
            setattr(session, name, self._wrap(name, getattr(session, name)))

    def _wrap(self, name: str, real: Any) -> Any:
        def call(gpu: int, first: int, *rest: Any) -> Any:
            if name.startswith("destroy"):
                self.destroying.set()
            out = real(gpu, first, *rest)
            with self._lock:  # GI id for a destroy; the created GI's id for a create
                self.calls.append((name, out if name == "create_gi" else first))
            return out

        return call


async def _ready_gi(kube: Kube, alloc: Obj) -> int:
    got = await wait_phase(kube, alloc, "Ready")
    return int(got["status"]["slices"][0]["giID"])


async def test_a_create_goes_before_releases_queued_on_its_gpu(
    agent_kube: Kube, alloc_ns: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    """Four releases on one GPU each keep a call queued on its lane; a create asked for
    meanwhile waits for the call running when it asks, not for the queue: in FIFO order
    (before) its scan and then its create each waited behind the other releases' calls."""
    node: GpuNode = await gpu_node(agent_kube, tmp_path, [H200])
    settings = agent_settings([node], control_plane.kubeconfig)
    olds = [slice_allocation(alloc_ns, node, [("c", "1g.18gb", 0, s, 1)]) for s in (0, 1, 3, 4)]
    new = slice_allocation(alloc_ns, node, [("c", "1g.18gb", 0, 2, 1)])
    async with running_agent(settings) as agents:
        for x in olds:
            await create_allocation(agent_kube, x)
        gis = [await _ready_gi(agent_kube, x) for x in olds]
        log = NvmlLog(agents[node.name].life.gpus.s)
        # each call long next to the agent's API round trips between two calls of a create
        node.emu.set_latency(create_ms=100, destroy_ms=400)
        await asyncio.gather(*(delete_allocation(agent_kube, x) for x in olds))
        assert await asyncio.to_thread(log.destroying.wait, 20), "no release began"
        gpus = agents[node.name].life.gpus

        async def all_asked() -> bool:  # one destroy runs, each other release's waits its turn
            return gpus.waiting(0) >= len(olds) - 1

        await eventually(all_asked, interval=0.01, what="every release's destroy asked for")
        await create_allocation(agent_kube, new)
        asked = len(log.calls)
        gi = await _ready_gi(agent_kube, new)
        for x in olds:
            await wait_gone(agent_kube, x)
    calls = log.calls
    made = calls.index(("create_gi", gi))
    # the destroys that ended between the create's arrival and its GI: the one running when
    # it arrived, one more at most in each of its two gaps (its scan asked for, its intent
    # record before the create call). FIFO: the scan and the create each waited
    # for every release's queued call as well (6-8 here).
    assert made - asked <= 3, (asked, calls)
    destroys = sorted(c for c in calls if c[0] != "create_gi")
    assert destroys == sorted([("destroy_ci", g) for g in gis] + [("destroy_gi", g) for g in gis])
    assert node.instances() == [(0, "1g.18gb", 2, 1, 0)]


async def _release_begun(
    kube: Kube, agent: Any, node: GpuNode, old: Obj, destroy_ms: int
) -> NvmlLog:
    """`old` made Ready, then deleted with each destroy taking `destroy_ms`: returns once its
    release has begun, with the NVML calls logged from before it."""
    await create_allocation(kube, old)
    await wait_phase(kube, old, "Ready")
    log = NvmlLog(agent.life.gpus.s)
    node.emu.set_latency(destroy_ms=destroy_ms)
    await delete_allocation(kube, old)
    assert await asyncio.to_thread(log.destroying.wait, 20), "the release never began"
    return log


async def test_a_create_on_slots_still_being_released_waits_for_the_release(
    agent_kube: Kube, alloc_ns: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    """The allocator never places on slots before their release is done; the agent does not
    count on it: a create on slots a `releasing` record holds waits for that release (with
    creates first on the lane, its placement check would otherwise see the old instance and
    fail the create)."""
    node = await gpu_node(agent_kube, tmp_path, [H200])
    settings = agent_settings([node], control_plane.kubeconfig)
    old = slice_allocation(alloc_ns, node, [("c", "2g.35gb", 0, 0, 2)])
    new = slice_allocation(alloc_ns, node, [("c", "1g.18gb", 0, 1, 1)])
    async with running_agent(settings) as agents:
        log = await _release_begun(agent_kube, agents[node.name], node, old, destroy_ms=400)

        def releasing() -> bool:
            claims = checkpoint.load(node.checkpoint, node.name).claims
            return any(r.state == "releasing" for r in claims.values())

        await eventually(lambda: asyncio.to_thread(releasing), what="the record releasing")
        await create_allocation(agent_kube, new)
        got = await wait_phase(agent_kube, new, "Ready")
        await wait_gone(agent_kube, old)
    assert got["status"]["slices"][0]["migUUID"]
    assert node.instances() == [(0, "1g.18gb", 1, 1, 0)]
    assert log.calls[-1][0] == "create_gi", log.calls  # after the release's destroys


async def test_a_create_whose_slots_stay_held_past_the_cap_goes_on_and_fails(
    agent_kube: Kube,
    alloc_ns: str,
    tmp_path: Path,
    control_plane: ControlPlane,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A release that outlasts the create's wait (cap patched small): the create is decided
    afresh, goes on, and its placement check fails it naming the release's instance, which
    the release then destroys as before."""
    monkeypatch.setattr(create, "RELEASE_WAIT_S", 0.3)  # the in-process agent reads it per wait
    node = await gpu_node(agent_kube, tmp_path, [H200])
    settings = agent_settings([node], control_plane.kubeconfig)
    old = slice_allocation(alloc_ns, node, [("c", "2g.35gb", 0, 0, 2)])
    new = slice_allocation(alloc_ns, node, [("c", "1g.18gb", 0, 1, 1)])
    async with running_agent(settings) as agents:
        # the release holds the slots for seconds
        log = await _release_begun(agent_kube, agents[node.name], node, old, destroy_ms=4000)
        await create_allocation(agent_kube, new)
        got = await wait_phase(agent_kube, new, "Failed")
        assert log.destroying.is_set() and not any(c[0] == "create_gi" for c in log.calls)
        await wait_gone(agent_kube, old, within=30)
    message = got["status"]["message"]
    assert "overlaps an instance of another allocation" in message, message
    assert node.instances() == []
