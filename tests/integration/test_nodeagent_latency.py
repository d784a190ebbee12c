"""The node agent's share of a pod's time to slice (issue 25), against a real API server.

- `Creating` is optional (docs/protocol.md): a fresh allocation made fast goes from no status
  to `Ready`; one whose making takes `creating_after_s` is written `Creating` then, while NVML
  works; one deleted while its slices were made has them destroyed at once, not after the
  garbage collector's grace.
- For an allocation found by the agent's first list, the `Creating` write (the check that it
  still exists) and its intent record (placement check, record on disk) run side by side,
  and NVML makes nothing before both are done; the `Ready` write goes first and its
  record's `ready` after it is answered, not beside it.
- A slice made is listed on the MigNode within `SLICES_LISTED_WITHIN_S`, coalesced with the
  slices made meanwhile (one status write for several pods, not one each); slots freed are
  listed at once, as before.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from threading import Event
from typing import Any

import pytest

from common.allocation import SliceAllocation
from common.conditions import CONFLICT_FREE
from common.kubeapi import ApiError, Kube, instaslice_path
from hack.cluster import ControlPlane
from nodeagent import checkpoint, create
from nodeagent.agent import NodeAgent
from nodeagent.lifebase import LifeBase
from nodeagent.lifecycle import Lifecycle
from nodeagent.settings import Settings
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
H200 = "H200-141GB"
NodeAndAgent = tuple[GpuNode, Settings]


@pytest.fixture
async def h200(agent_kube: Kube, tmp_path: Path, control_plane: ControlPlane) -> NodeAndAgent:
    """One emulated H200 node and the settings of an agent serving it (every test here)."""
    node = await gpu_node(agent_kube, tmp_path, [H200])
    return node, agent_settings([node], control_plane.kubeconfig)


async def _one_slice_with_held_writes(
    kube: Kube,
    namespace: str,
    h200: NodeAndAgent,
    before_write: Callable[[SliceAllocation, dict[str, Any]], Awaitable[None]],
    then: Callable[[], Awaitable[Any]] | None = None,
) -> None:
    """One 1g.18gb allocation made by a running agent whose status writes each await
    `before_write(alloc, body)` first; `then` runs once it is Ready, the agent still up."""
    node, settings = h200
    async with running_agent(settings) as agents:
        life = agents[node.name].life
        real_status = life.status

        async def held_status(alloc: SliceAllocation, body: dict[str, Any]) -> bool:
            await before_write(alloc, body)
            return await real_status(alloc, body)

        life.status = held_status  # type: ignore[method-assign]
        alloc = slice_allocation(namespace, node, [("c", "1g.18gb", 0, 0, 1)])
        await create_allocation(kube, alloc)
        await wait_phase(kube, alloc, "Ready")
        if then is not None:
            await then()


async def test_the_creating_write_overlaps_the_intent_record_and_both_precede_nvml(
    agent_kube: Kube, alloc_ns: str, h200: NodeAndAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An allocation found by the agent's first list (created while it was down)."""
    node, settings = h200
    seen: dict[str, Any] = {}

    async def hold(alloc: SliceAllocation, body: dict[str, Any]) -> None:
        if body["status"].get("phase") == "Creating" and "record" not in seen:
            # held until the intent record is on disk: it must get there meanwhile
            for _ in range(200):
                if alloc.uid in checkpoint.load(node.checkpoint, node.name).claims:
                    seen["record"] = True
                    break
                await asyncio.sleep(0.05)
            else:
                seen["record"] = False
            await asyncio.sleep(0.3)  # time enough for an NVML create that did not wait
            seen["instances"] = node.instances()

    real_status = LifeBase.status

    async def held_status(self: LifeBase, alloc: SliceAllocation, body: dict[str, Any]) -> bool:
        await hold(alloc, body)
        return await real_status(self, alloc, body)

    monkeypatch.setattr(LifeBase, "status", held_status)
    alloc = slice_allocation(alloc_ns, node, [("c", "1g.18gb", 0, 0, 1)])
    await create_allocation(agent_kube, alloc)  # before the agent starts: its first list has it
    async with running_agent(settings):
        await wait_phase(agent_kube, alloc, "Ready")
    assert seen["record"], "the intent record waited for the Creating write"
    assert seen["instances"] == [], "NVML made a slice before Creating was written"
    assert node.instances() == [(0, "1g.18gb", 0, 1, 0)]


async def test_the_ready_record_is_written_after_the_ready_write_not_beside_it(
    agent_kube: Kube, alloc_ns: str, h200: NodeAndAgent
) -> None:
    """The record's `ready` waits for the `Ready` write's answer: beside it, the record's
    JSON on a worker thread held the interpreter while the answer waited (issue 25)."""
    node, _ = h200
    seen: dict[str, Any] = {}

    async def hold(alloc: SliceAllocation, body: dict[str, Any]) -> None:
        if body["status"].get("phase") == "Ready" and "state" not in seen:
            await asyncio.sleep(0.3)  # time enough for a record written beside it
            seen["state"] = checkpoint.load(node.checkpoint, node.name).claims[alloc.uid].state

    async def record_ready() -> bool:
        claims = checkpoint.load(node.checkpoint, node.name).claims
        return any(r.state == "ready" for r in claims.values())

    async def then() -> None:
        await eventually(record_ready, what="the record ready after the write")

    await _one_slice_with_held_writes(agent_kube, alloc_ns, h200, hold, then)
    assert seen["state"] == "creating", "the record was written beside the Ready write"


async def test_slices_made_are_listed_together_and_slots_freed_at_once(
    agent_kube: Kube,
    alloc_ns: str,
    h200: NodeAndAgent,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(create, "SLICES_LISTED_WITHIN_S", 6.0)
    node, settings = h200

    async def listed() -> list[str]:
        mn = await mig_node(agent_kube, node.name)
        gpus = ((mn or {}).get("status") or {}).get("gpus") or [{}]
        return sorted(str(s.get("claim")) for s in gpus[0].get("slices") or [])

    async def settled() -> bool:  # published, with the first GC pass's ConflictFree condition
        mn = await mig_node(agent_kube, node.name)
        conds = ((mn or {}).get("status") or {}).get("conditions") or []
        return any(c.get("type") == CONFLICT_FREE for c in conds)

    async with running_agent(settings):
        await eventually(settled, what="MigNode published")
        writes: list[list[str]] = []
        last: list[str] = []

        async def watch() -> None:  # every change of the listed slices, as the API server has it
            nonlocal last
            while True:
                now = await listed()
                if now != last:
                    writes.append(now)
                    last = now
                await asyncio.sleep(0.02)

        watcher = asyncio.create_task(watch())
        try:
            allocs = []
            for start in (0, 1, 2):  # one after another, each Ready before the next
                alloc = slice_allocation(alloc_ns, node, [("c", "1g.18gb", 0, start, 1)])
                await create_allocation(agent_kube, alloc)
                await wait_phase(agent_kube, alloc, "Ready")
                allocs.append(alloc)
            claims = sorted(a["metadata"]["name"] for a in allocs)

            async def all_listed() -> bool:
                return last == claims

            await eventually(all_listed, within=20, what="the three slices listed")
            assert writes == [claims], f"one write for the three slices, not {writes}"

            gone = allocs[0]["metadata"]
            path = instaslice_path("sliceallocations", gone["namespace"], gone["name"])
            await agent_kube.delete(path)

            async def freed() -> bool:
                return last == sorted(set(claims) - {gone["name"]})

            # well inside the 6 s a made slice may wait: freed slots are listed at once
            await eventually(freed, within=3, what="the freed slice gone from the MigNode")
        finally:
            watcher.cancel()


async def test_a_failed_creating_write_lets_the_intent_write_finish(
    agent_kube: Kube,
    alloc_ns: str,
    h200: NodeAndAgent,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The status write fails while the intent record is being written: the create gives up
    only once that write has ended. Cutting it short would free the checkpoint's lock while
    its thread still writes, and another allocation's write could start beside it."""
    node, settings = h200
    async with running_agent(settings) as agents:
        life = agents[node.name].life
        ended: list[bool] = []
        real_append = checkpoint.append_intent

        def slow_append(path: Path, seq: int, rec: checkpoint.ClaimRecord) -> None:
            time.sleep(0.5)
            real_append(path, seq, rec)
            ended.append(True)

        async def failing(alloc: SliceAllocation, body: dict[str, Any]) -> bool:
            raise ApiError(500, "InternalError", "the API server failed")

        monkeypatch.setattr(checkpoint, "append_intent", slow_append)
        life.status = failing  # type: ignore[method-assign]
        obj = slice_allocation(alloc_ns, node, [("c", "1g.18gb", 0, 0, 1)])
        obj["metadata"]["uid"] = "uid-never-created"
        with pytest.raises(ApiError):
            await life.create(SliceAllocation.parse(obj))
        assert True in ended, "the create gave up while its intent record was being written"
        assert node.instances() == []


async def test_a_create_puts_its_intent_on_disk_with_one_sync_before_nvml(
    agent_kube: Kube,
    alloc_ns: str,
    h200: NodeAndAgent,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 37: the intent record, on disk before NVML makes anything, costs one sync (a
    journal line `fdatasync`ed), not two (the snapshot's fsync, then its directory's): the
    agent's step is on every pod's path. What a crash then finds is
    test_nodeagent.py's `test_sigkill_after_the_intent_before_nvml_then_restart`."""
    node, settings = h200
    syncs: list[str] = []
    at_create: list[list[str]] = []
    real_syncs = {name: getattr(os, name) for name in ("fsync", "fdatasync")}
    for name in real_syncs:

        def counting(fd: int, name: str = name) -> None:
            syncs.append(name)
            real_syncs[name](fd)

        monkeypatch.setattr(os, name, counting)
    async with running_agent(settings) as agents:
        session = agents[node.name].life.gpus.s
        real_create = session.create_gi

        def create_gi(gpu_index: int, profile_id: int, start: int, size: int) -> int:
            at_create.append(list(syncs))
            return real_create(gpu_index, profile_id, start, size)

        session.create_gi = create_gi  # type: ignore[method-assign]
        alloc = slice_allocation(alloc_ns, node, [("c", "1g.18gb", 0, 0, 1)])
        syncs.clear()
        await create_allocation(agent_kube, alloc)
        got = await wait_phase(agent_kube, alloc, "Ready")
    assert at_create == [["fdatasync"]], at_create
    rec = checkpoint.load(node.checkpoint, node.name).claims[got["metadata"]["uid"]]
    assert rec.state == "ready"


async def test_a_fresh_create_checks_its_placements_without_the_mig_walk(
    agent_kube: Kube,
    alloc_ns: str,
    h200: NodeAndAgent,
) -> None:
    """Issue 37: before its intent record, a fresh create (no record yet) reads the GPU's GIs
    to check its placements are free, not the MIG devices behind them (the walk for CIs and
    MIG UUIDs, most of a scan's NVML calls): an instance at a placement fails the create
    whatever its CIs, and none is adopted. Still refused: a placement an instance InstaSlice
    did not create overlaps (test_nodeagent.py's
    `test_foreign_instance_is_reported_and_never_touched`)."""
    node, settings = h200
    scans: list[list[str]] = []  # the NVML calls of each scan (garbage collection's too)
    inside: list[list[str]] = []  # the scan running now, if one is
    made: list[int] = []  # how many scans had begun when the first GI was made
    async with running_agent(settings) as agents:
        session = agents[node.name].life.gpus.s
        real_call, real_instances = session.call, session.instances

        def counting(name: str, *args: Any) -> Any:
            if inside:
                inside[-1].append(name)
            if name == "nvmlDeviceCreateGpuInstanceWithPlacement" and not made:
                made.append(len(scans))
            return real_call(name, *args)

        def scan(gpu: Any, *args: Any) -> Any:
            scans.append([])
            inside.append(scans[-1])
            try:
                return real_instances(gpu, *args)
            finally:
                inside.pop()

        session.call = counting  # type: ignore[method-assign]
        session.instances = scan  # type: ignore[method-assign,assignment]
        alloc = slice_allocation(alloc_ns, node, [("c", "1g.18gb", 0, 0, 1)])
        scans.clear()
        await create_allocation(agent_kube, alloc)
        await wait_phase(agent_kube, alloc, "Ready")
    assert made, "no GI was made"
    before = scans[: made[0]]
    assert any(
        "nvmlDeviceGetGpuInstances" in s and "nvmlDeviceGetMigDeviceHandleByIndex" not in s
        for s in before
    ), before  # the create's own scan read the GIs, and no MIG device


async def test_an_agent_stopped_right_after_making_a_slice_lists_it_first(
    agent_kube: Kube,
    alloc_ns: str,
    h200: NodeAndAgent,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stopped agent writes no MigNode until it is back: a slice made just before the stop
    and not listed yet would be drawn free (`kubectl instaslice nodes`) meanwhile, although
    the GPU holds it (seen in the troubleshooting e2e test)."""
    monkeypatch.setattr(create, "SLICES_LISTED_WITHIN_S", 60.0)
    node, settings = h200
    alloc = slice_allocation(alloc_ns, node, [("c", "1g.18gb", 0, 0, 1)])
    async with running_agent(settings):
        await create_allocation(agent_kube, alloc)
        await wait_phase(agent_kube, alloc, "Ready")
    mn = await mig_node(agent_kube, node.name)
    slices = (((mn or {}).get("status") or {}).get("gpus") or [{}])[0].get("slices") or []
    assert [s.get("claim") for s in slices] == [alloc["metadata"]["name"]], slices


async def test_the_ready_write_does_not_wait_for_the_ready_record(
    agent_kube: Kube,
    alloc_ns: str,
    h200: NodeAndAgent,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The record's `ready` is written after the Ready status write, not before it: nothing
    waits for it (a restart that lost it adopts the slices: the next test)."""
    node, settings = h200
    saves: list[tuple[str, float]] = []
    real_save = checkpoint.save

    def slow_save(path: Path, cp: checkpoint.Checkpoint, durable: bool = True) -> None:
        if not durable and any(c.state == "ready" for c in cp.claims.values()):
            time.sleep(0.5)
        real_save(path, cp, durable)
        states = ",".join(sorted(c.state for c in cp.claims.values()))
        saves.append((states, time.monotonic()))

    monkeypatch.setattr(checkpoint, "save", slow_save)
    async with running_agent(settings) as agents:
        life = agents[node.name].life
        real_status = life.status
        sent: dict[str, float] = {}

        async def timed_status(alloc: SliceAllocation, body: dict[str, Any]) -> bool:
            sent.setdefault(str(body["status"].get("phase")), time.monotonic())
            return await real_status(alloc, body)

        life.status = timed_status  # type: ignore[method-assign]
        alloc = slice_allocation(alloc_ns, node, [("c", "1g.18gb", 0, 0, 1)])
        await create_allocation(agent_kube, alloc)
        await wait_phase(agent_kube, alloc, "Ready")

        async def ready_saved() -> bool:
            return any(states == "ready" for states, _ in saves)

        await eventually(ready_saved, what="the ready record written")
    saved = next(t for states, t in saves if states == "ready")
    assert sent["Ready"] < saved - 0.3, "the Ready write waited for the record's write"
    rec = checkpoint.load(node.checkpoint, node.name).claims
    assert [r.state for r in rec.values()] == ["ready"]


async def test_a_ready_allocation_whose_record_still_says_creating_is_adopted(
    agent_kube: Kube, alloc_ns: str, h200: NodeAndAgent
) -> None:
    """The window the previous test opens: the agent stops after its Ready write and before
    the record's `ready` reached the disk. The next start finds the allocation Ready and the
    record `creating`: it adopts the slices the record claims (the status names their MIG
    UUIDs), makes nothing twice, leaks nothing, and the CDI file is there."""
    node, settings = h200
    alloc = slice_allocation(alloc_ns, node, [("c", "1g.18gb", 0, 0, 1), ("c", "2g.35gb", 0, 4, 2)])
    async with running_agent(settings):
        await create_allocation(agent_kube, alloc)
        ready = await wait_phase(agent_kube, alloc, "Ready")
    uid = ready["metadata"]["uid"]
    cp = checkpoint.load(node.checkpoint, node.name)
    assert cp.claims[uid].state == "ready"
    lost = replace(cp.claims[uid], state="creating")  # as if the last write never landed
    checkpoint.save(node.checkpoint, cp.with_claim(lost))
    made = sorted(str(r.mig_uuid) for r in node.emu.instances())
    cdi_file = next(node.cdi_dir.glob("instaslice.io-*.json"))
    cdi_file.unlink()
    async with running_agent(settings):

        async def adopted() -> bool:
            rec = checkpoint.load(node.checkpoint, node.name).claims.get(uid)
            return rec is not None and rec.state == "ready" and cdi_file.exists()

        await eventually(adopted, what="the slices adopted, the record ready, the CDI file back")
        got = await wait_phase(agent_kube, alloc, "Ready")
    assert sorted(str(r.mig_uuid) for r in node.emu.instances()) == made, "made twice or lost"
    assert {s["migUUID"] for s in got["status"]["slices"]} == set(made)
    assert sorted(node.instances()) == [(0, "1g.18gb", 0, 1, 0), (0, "2g.35gb", 4, 2, 0)]


async def test_a_slice_takes_one_trip_to_its_gpus_nvml_lane(
    agent_kube: Kube, alloc_ns: str, h200: NodeAndAgent
) -> None:
    """GI, CI and MIG UUID of a slice in one hand-off to the GPU's NVML thread (each hand-off
    costs a thread switch and a wait for the lane on a busy event loop)."""
    node, settings = h200
    async with running_agent(settings) as agents:
        gpus = agents[node.name].life.gpus
        trips: list[str] = []

        def counting(real_call: Any) -> Any:
            async def counted(index: int, fn: Any, *args: Any, **kwargs: Any) -> Any:
                trips.append(getattr(fn, "__name__", repr(fn)))
                return await real_call(index, fn, *args, **kwargs)

            return counted

        # a create's calls go through call_gpu_first (ahead of releases: nodeagent/lane.py)
        gpus.call_gpu = counting(gpus.call_gpu)  # type: ignore[method-assign]
        gpus.call_gpu_first = counting(gpus.call_gpu_first)  # type: ignore[method-assign]
        alloc = slice_allocation(alloc_ns, node, [("c", "1g.18gb", 0, 0, 1)])
        await create_allocation(agent_kube, alloc)
        await wait_phase(agent_kube, alloc, "Ready")
    making = {"create_gi", "create_ci", "mig_uuid", "_gi_ci_uuid"}  # (scans, listings aside)
    assert [t for t in trips if t in making] == ["_gi_ci_uuid"], trips
    assert node.instances() == [(0, "1g.18gb", 0, 1, 0)]


def _phases_written(life: Lifecycle) -> list[str]:
    """The phases `life` writes to allocations' status from now on, in order."""
    phases: list[str] = []
    real_status = life.status

    async def noted(alloc: SliceAllocation, body: dict[str, Any]) -> bool:
        phases.append(str(body["status"].get("phase")))
        return await real_status(alloc, body)

    life.status = noted  # type: ignore[method-assign]
    return phases


async def _watching(agent: NodeAgent) -> None:
    """Until `agent`'s allocation watch has listed: an allocation made after that is brought by
    the watch, fresh (one found by the first list goes `Creating` first, nodeagent/create.py)."""
    async with asyncio.timeout(30):
        await agent.synced.wait()


def _held_gi_creates(life: Lifecycle, monkeypatch: pytest.MonkeyPatch) -> tuple[Event, Event]:
    """NVML's GI creates of `life` wait for the second event once they set the first."""
    entered, go = Event(), Event()
    session = life.gpus.s
    real = session.create_gi

    def held(*args: Any) -> int:
        entered.set()
        assert go.wait(30), "the GI create was never let go"
        return int(real(*args))

    monkeypatch.setattr(session, "create_gi", held)
    return entered, go


async def test_a_fast_create_goes_to_ready_without_creating(
    agent_kube: Kube, alloc_ns: str, h200: NodeAndAgent
) -> None:
    """A fresh allocation (the watch brought it) made within `creating_after_s`: one status
    write, `Ready`; the allocation never shows `Creating` (issue 37 §1)."""
    node, settings = h200
    async with running_agent(replace(settings, creating_after_s=30.0)) as agents:
        await _watching(agents[node.name])
        phases = _phases_written(agents[node.name].life)
        alloc = slice_allocation(alloc_ns, node, [("c", "1g.18gb", 0, 0, 1)])
        await create_allocation(agent_kube, alloc)
        await wait_phase(agent_kube, alloc, "Ready")
    assert phases == ["Ready"]
    assert node.instances() == [(0, "1g.18gb", 0, 1, 0)]


async def test_a_slow_create_writes_creating_while_nvml_makes_the_slice(
    agent_kube: Kube, alloc_ns: str, h200: NodeAndAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A create that takes longer than `creating_after_s` (its GI create held) is written
    `Creating` while NVML works — not before NVML begins — then `Ready`."""
    node, settings = h200
    async with running_agent(replace(settings, creating_after_s=1.5)) as agents:
        await _watching(agents[node.name])
        life = agents[node.name].life
        phases = _phases_written(life)
        entered, go = _held_gi_creates(life, monkeypatch)
        alloc = slice_allocation(alloc_ns, node, [("c", "1g.18gb", 0, 0, 1)])
        await create_allocation(agent_kube, alloc)
        creating = await wait_phase(agent_kube, alloc, "Creating")
        assert entered.is_set(), "Creating was written before NVML began"
        assert phases == ["Creating"]
        go.set()
        ready = await wait_phase(agent_kube, alloc, "Ready")
    assert phases == ["Creating", "Ready"]
    assert int(ready["metadata"]["resourceVersion"]) > int(creating["metadata"]["resourceVersion"])
    assert node.instances() == [(0, "1g.18gb", 0, 1, 0)]


async def test_a_fresh_allocation_deleted_while_made_has_its_slices_destroyed(
    agent_kube: Kube, alloc_ns: str, h200: NodeAndAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Moved off while its slices were made (the allocator drops the finalizer of an
    allocation with no status and deletes it, docs/allocator.md): the `Ready` write finds it
    gone and what was made is destroyed at once — no instance, record or CDI file left —
    not after the garbage collector's grace (60 s)."""
    node, settings = h200
    async with running_agent(replace(settings, creating_after_s=30.0)) as agents:
        await _watching(agents[node.name])
        life = agents[node.name].life
        entered, go = _held_gi_creates(life, monkeypatch)
        alloc = slice_allocation(alloc_ns, node, [("c", "1g.18gb", 0, 0, 1)])
        meta = (await create_allocation(agent_kube, alloc))["metadata"]
        assert await asyncio.to_thread(entered.wait, 20), "the GI create never began"
        path = instaslice_path("sliceallocations", alloc_ns, meta["name"])
        await agent_kube.patch(path, {"metadata": {"finalizers": None}})
        await agent_kube.delete(path)
        go.set()

        async def nothing_left() -> bool:
            return bool(
                node.instances() == []
                and node.cdi_files() == []
                and meta["uid"] not in checkpoint.load(node.checkpoint, node.name).claims
            )

        await eventually(nothing_left, within=10, what="the slice made for it destroyed")
