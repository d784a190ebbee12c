"""A node agent that stops: the allocator leaves its nodes out until it is back.

Covers, with the real node agent, webhook/allocator and control plane: the Leases the agent
renews are the ones the allocator watches (holder, namespace); a pod placed just after the
agent was killed has its untouched allocation dropped once the Leases go stale; after a
Lease duration every node is counted down (`instaslice_nodes_agent_down`), both pods get
`AllocationPending` saying why and no SliceAllocation remains; the agent restarted, both
run, the early one on a new allocation.
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
from testkit.builders import user_pod
from tests.e2e.conftest import AGENT_LEASE_S
from tests.e2e.helpers import allocs_path, pods_path, wait_event, wait_pod_running
from tests.support import wait_for


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
    down = (
        f"every MIG node is left out: {len(system.nodes)} node(s) whose node agent is not "
        "running (Lease not renewed): "
    )
    system.kill("nodeagent")
    try:
        # placed while the Leases are still fresh: its allocation waits for a dead agent
        await kube.create(
            pods_path(namespace), user_pod(name="early", slices={"c": {"1g.10gb": 1}})
        )
        first = await wait_for(
            kube, allocs_path(namespace), lambda a: next(iter(a.values()), None), what="early's"
        )
        assert not first.get("status"), first  # no agent acted on it
        # a Lease duration, the leader's 5 s sweep, and some slack for a loaded machine
        await _wait_agents_down(system, len(system.nodes), AGENT_LEASE_S + 5 + 30)
        await kube.create(pods_path(namespace), user_pod(name="late", slices={"c": {"1g.10gb": 1}}))
        # early's allocation was dropped: it waits with late. Its node's Lease may go stale a
        # sweep before the others' (the agent's renewals spread out under load): then early
        # waits with fewer nodes named, and is told again only when its reason changes
        early = await wait_event(kube, namespace, "early", REASON_PENDING)
        assert (
            "node(s) whose node agent is not running (Lease not renewed): " in (early["message"])
        ), early["message"]
        late = await wait_event(kube, namespace, "late", REASON_PENDING)
        assert late["message"].startswith(down), late["message"]
        assert (await kube.list(allocs_path(namespace)))["items"] == []
    finally:
        system.start_agent(die_with_parent=True)
    for name in ("early", "late"):
        await wait_pod_running(kube, namespace, name)
    allocs = (await kube.list(allocs_path(namespace)))["items"]
    assert len(allocs) == 2 and first["metadata"]["uid"] not in {
        a["metadata"]["uid"] for a in allocs
    }
    await _wait_agents_down(system, 0, 30)
