"""What an idle node agent writes once it is up (issue 25, the 5000-node scale run), against
a real API server and a KWOK Node.

MigNode status is written on change only (docs/contract.md §3). At start the agent writes it
once, with every condition it knows; the garbage-collection passes after that find nothing
changed and write nothing. Before, the first pass's conflict check added ConflictFree in a
second write of every MigNode: at 5000 nodes, a wave of 5000 status writes (1.85 s each at
the API server) still flowing 15 minutes after startup.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest

from common.conditions import CONFLICT_FREE
from common.kubeapi import ApiError, Kube, instaslice_path
from hack.cluster import ControlPlane
from tests.integration.agent_fixtures import agent_settings, eventually, gpu_node, running_agent

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]
H200 = "H200-141GB"
Obj = dict[str, Any]


async def test_an_idle_agent_writes_its_mig_node_status_once_with_its_conditions(
    agent_kube: Kube, tmp_path: Path, control_plane: ControlPlane
) -> None:
    node = await gpu_node(agent_kube, tmp_path, [H200])
    settings = agent_settings([node], control_plane.kubeconfig)  # a GC pass every 0.5 s
    path = instaslice_path("mignodes")
    selector = f"metadata.name={node.name}"

    async def listed() -> str | None:  # a CRD just installed answers 429 while its storage starts
        try:
            return str(
                (await agent_kube.list(path, fieldSelector=selector))["metadata"]["resourceVersion"]
            )
        except ApiError as exc:
            if exc.status != 429:
                raise
            return None

    rv = await eventually(listed, what="MigNodes listed")
    statuses: list[Obj] = []  # each status the API server stored, in order

    async def watch() -> None:
        async for etype, obj in agent_kube.watch(path, rv, fieldSelector=selector):
            status = obj.get("status")
            if etype in ("ADDED", "MODIFIED") and status and status not in statuses[-1:]:
                statuses.append(status)

    watcher = asyncio.create_task(watch())
    try:
        async with running_agent(settings) as agents:
            agent = agents[node.name]
            passes = 0
            gc = agent.gc

            async def counted() -> None:
                nonlocal passes
                await gc()
                passes += 1

            agent.gc = counted  # type: ignore[method-assign]

            async def settled() -> bool:  # published, then three GC passes that followed it
                return bool(statuses) and passes >= 3

            await eventually(settled, within=30, what="MigNode published and 3 GC passes")
            await asyncio.sleep(0.5)  # a write the last pass asked for: past its coalescing
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    assert len(statuses) == 1, [
        sorted(c["type"] for c in s.get("conditions") or []) for s in statuses
    ]
    types = [c["type"] for c in statuses[0].get("conditions") or []]
    assert CONFLICT_FREE in types, types
