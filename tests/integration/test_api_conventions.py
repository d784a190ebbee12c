"""InstaSlice's objects and events as an administrator's tools read them, on the real control
plane: `kubectl get` (columns, `-o wide`, the `instaslice` category, the MigNode short name),
`kubectl wait --for=condition=Ready` on both kinds, `kubectl describe pod`.

Covers: the printer columns of docs/contract.md §3 and their wide-only ones, filled from a
real node agent's writes; conditions shaped like metav1.Condition with `observedGeneration`;
MigNode `status.observedGeneration` following a spec change; an event repeated by one reporter
counted on one Event object (shown `(x2 over ...)` by `kubectl describe pod`), another reporter
getting its own, `reportingInstance` naming the reporter. Leaves out the condition builders'
every case (unit/test_conditions.py) and the allocator's events (e2e).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import yaml

from common.constants import EventReason
from common.events import pod_event
from common.kubeapi import Kube, core_path, instaslice_path
from hack.cluster import ControlPlane
from nodeagent import cdi
from nodeagent.main import find_base_spec
from tests.integration.agent_fixtures import agent_settings as base_settings
from tests.integration.agent_fixtures import (
    create_allocation,
    eventually,
    get_allocation,
    gpu_node,
    mig_node,
    pod_events,
    running_agent,
    slice_allocation,
)
from tests.integration.private_cluster import kubectl_ok

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
H200 = "H200-141GB"
Obj = dict[str, Any]
METAV1_KEYS = {"type", "status", "reason", "message", "lastTransitionTime", "observedGeneration"}


async def kubectl(cp: ControlPlane, *args: str) -> str:
    """kubectl off the event loop (the agent under test runs on it), which must succeed."""
    return await asyncio.to_thread(kubectl_ok, cp, *args)


def table(text: str) -> list[dict[str, str]]:
    """`kubectl get`'s table as rows of column → cell, cut at the header's column starts (a
    cell may hold single spaces)."""
    header, *rows = text.rstrip("\n").split("\n")
    names = header.split()
    starts = [header.index(f" {n} ") + 1 if i else 0 for i, n in enumerate(names[:-1])]
    starts.append(header.rindex(" " + names[-1]) + 1)
    bounds = [*starts[1:], None]
    return [
        {n: row[s:e].strip() for n, s, e in zip(names, starts, bounds, strict=True)} for row in rows
    ]


def assert_metav1(obj: Obj) -> None:
    generation = obj["metadata"]["generation"]
    conds = obj["status"]["conditions"]
    assert conds and all(c.keys() >= METAV1_KEYS for c in conds), conds
    assert all(c["observedGeneration"] == generation for c in conds), conds


async def test_kubectl_reads_the_columns_and_waits_for_ready(
    kube: Kube, ns: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    cp = control_plane
    node = await gpu_node(kube, tmp_path, [H200])
    spec = tmp_path / "nvidia.yaml"
    spec.write_text(yaml.safe_dump(cdi.fake_nvidia_spec("580.159.04", [0])))

    def facts(n: str, driver: str, minors: Any) -> Any:
        return (cdi.DeviceNumbers.emulated(), *find_base_spec([spec]))

    settings = base_settings([node], cp.kubeconfig, conflict_check_period_s=0.0)
    try:
        async with running_agent(settings, cdi_facts_for=facts):
            alloc = slice_allocation(ns, node, [("main", "1g.18gb", 0, 0, 1)])
            name = alloc["metadata"]["name"]
            await create_allocation(kube, alloc)
            await kubectl(cp, "wait", "--for=condition=Ready", f"sliceallocation/{name}", "-n", ns,
                          "--timeout=30s")  # fmt: skip
            await kubectl(cp, "wait", "--for=condition=Ready", f"mn/{node.name}", "--timeout=30s")

            (row,) = table(await kubectl(cp, "get", "slicealloc", name, "-n", ns))
            assert (row["POD"], row["NODE"], row["PHASE"]) == (f"pod-{name}", node.name, "Ready")
            assert "READY" not in row  # wide only
            (wide,) = table(await kubectl(cp, "get", "slicealloc", name, "-n", ns, "-o", "wide"))
            assert (wide["POD"], wide["READY"], wide["REASON"]) == (
                f"pod-{name}",
                "True",
                "SlicesCreated",
            )

            (row,) = table(await kubectl(cp, "get", "mn", node.name))
            assert (row["GPUS"], row["READY"], row["CONFLICTFREE"]) == ("1", "True", "True")
            assert "REASON" not in row
            (wide,) = table(await kubectl(cp, "get", "mignode", node.name, "-o", "wide"))
            assert (wide["REASON"], wide["CONFLICT"], wide["CDISPEC"]) == (
                "AgentReady", "NoConflict", "True",
            )  # fmt: skip
            assert wide["MESSAGE"] == "1 of 1 GPUs healthy"

            listed = (await kubectl(cp, "get", "instaslice", "-A", "-o", "name")).split()
            assert f"sliceallocation.instaslice.io/{name}" in listed
            assert f"mignode.instaslice.io/{node.name}" in listed

            got = await get_allocation(kube, ns, name)
            assert got is not None
            assert_metav1(got)
            mn = await mig_node(kube, node.name)
            assert mn is not None
            assert_metav1(mn)
            assert mn["status"]["observedGeneration"] == mn["metadata"]["generation"]

            # a spec change (a GPU asked the MIG mode it has: nothing to carry out) is observed
            ask = {"spec": {"gpus": [{"uuid": node.gpu_uuid(0), "desiredMigMode": "enabled"}]}}
            changed = await kube.patch(instaslice_path("mignodes", name=node.name), ask)
            generation = changed["metadata"]["generation"]
            assert generation > mn["metadata"]["generation"]

            async def observed() -> Obj | None:
                now = await mig_node(kube, node.name)
                st = (now or {}).get("status") or {}
                return now if st.get("observedGeneration") == generation else None

            assert_metav1(await eventually(observed, what=f"observedGeneration {generation}"))
    finally:  # nothing of this node left for tests that count every MigNode (kubectl_plugin)
        await kube.delete_ignore_missing(instaslice_path("mignodes", name=node.name))
        await kube.delete_ignore_missing(core_path("nodes", name=node.name))


async def test_a_repeated_event_is_counted_on_one_object_per_reporter(
    kube: Kube, ns: str, control_plane: ControlPlane
) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": ns},
        "spec": {"containers": [{"name": "main", "image": "busybox"}]},
    }
    pod = await kube.create(core_path("pods", ns), pod)
    options: Any = {"component": "instaslice-nodeagent", "instance": "node-a", "host": "node-a"}
    for _ in range(3):
        await pod_event(kube, pod, EventReason.SLICE_IN_USE, "main: MIG-1 in use", **options)
    await pod_event(kube, pod, EventReason.SLICE_IN_USE, "main: MIG-1 in use",
                    **{**options, "instance": "node-b"})  # fmt: skip

    events = [e for e in await pod_events(kube, ns, "p") if e["reason"] == "SliceInUse"]
    by_instance = {e["reportingInstance"]: e for e in events}
    assert len(events) == 2 and set(by_instance) == {"node-a", "node-b"}, events
    assert (by_instance["node-a"]["count"], by_instance["node-b"]["count"]) == (3, 1)
    assert by_instance["node-a"]["reportingComponent"] == "instaslice-nodeagent"
    assert by_instance["node-a"]["source"] == {
        "component": "instaslice-nodeagent",
        "host": "node-a",
    }

    described = await kubectl(control_plane, "describe", "pod", "p", "-n", ns)
    lines = [line for line in described.splitlines() if "SliceInUse" in line]
    assert len(lines) == 2 and any("(x3 over" in line for line in lines), described
