"""A node agent that stops: the allocator leaves its nodes out until it is back.

Covers, with the real node agent, webhook/allocator and control plane: the Leases the agent
renews are the ones the allocator watches (holder, namespace); after a Lease duration with
the agent killed, every node is counted down (`instaslice_nodes_agent_down`), a new pod gets
`AllocationPending` saying why and no SliceAllocation; the agent restarted, the pod runs.
Leaves out: a partial outage (tests/unit/test_allocator_controller.py and
tests/integration/test_allocator.py place around a down node).
"""

from __future__ import annotations

import asyncio
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from common.constants import REASON_PENDING
from common.kubeapi import Kube
from hack.dev import DevSystem
from tests.e2e.conftest import AGENT_LEASE_S
from tests.e2e.helpers import allocs_path, make_pod, pods_path, wait_event, wait_pod_running


def _agents_down(system: DevSystem) -> float | None:
    url = f"http://127.0.0.1:{system.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "instaslice_nodes_agent_down":
                return s.value
    return None


async def _wait_agents_down(system: DevSystem, want: int, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while (have := _agents_down(system)) != want:
        assert time.monotonic() < deadline, f"nodes with agent down: {have}, want {want}"
        await asyncio.sleep(0.5)


async def test_pods_wait_while_the_node_agent_is_down(
    kube: Kube, system: DevSystem, namespace: str
) -> None:
    await _wait_agents_down(system, 0, 30)  # exported by the leading replica only
    system.kill("nodeagent")
    try:
        # a Lease duration, the leader's 5 s sweep, and some slack for a loaded machine
        await _wait_agents_down(system, len(system.nodes), AGENT_LEASE_S + 5 + 30)
        await kube.create(pods_path(namespace), make_pod("waits", slices={"c": {"1g.10gb": 1}}))
        event = await wait_event(kube, namespace, "waits", REASON_PENDING)
        assert event["message"].startswith(
            f"every MIG node is left out: {len(system.nodes)} node(s) whose node agent is not "
            "running (Lease not renewed): "
        ), event["message"]
        assert (await kube.list(allocs_path(namespace)))["items"] == []
    finally:
        system.start_agent(die_with_parent=True)
    await wait_pod_running(kube, namespace, "waits")
    await _wait_agents_down(system, 0, 30)
