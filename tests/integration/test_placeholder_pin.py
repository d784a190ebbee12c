"""`--autoscaler-signal=placeholder` against the real local control plane and kube-scheduler:
a pod's placeholder is deleted before the pod is pinned to the node the placeholder stands on.

Karpenter cannot run here (tests/e2e/test_autoscaling.py runs it), so the test plays its part:
the new node comes once the placeholder is asked for, and the real kube-scheduler binds the
placeholder to it (the node's `instaslice.io/mig-*` upper bound fits it). Only then does the
node get its MigNode and the allocator decide the real pod onto it. Left there at the pin, the
placeholder holds the pod's room in the scheduler's eyes: the scheduler preempts it while the
allocator deletes it, and its async preemption then parks the pod for five minutes
(kubernetes/kubernetes#141694; a CI run's pinned pod timed out unschedulable so). Covers: the
placeholder's deletion reaches a pods watch before the pin, and the pod binds without a
preemption; so too for the placeholder of another pod, still waiting for a node, that the
scheduler bound to the node first (it holds the pinned pod's room just as well); a
placeholder bound to a node whose GPUs are full of 7g.80gb (its upper bound still shows
room for 1g.10gb) stays while the node lacks its agent's `instaslice.io/node` label, and is
replaced once, by one the scheduler keeps off the node, when the label comes; a node the
`NotIn` leaves off because its advertised room cannot hold the placeholder (its cpu taken by
a bound pod) is one the real scheduler refuses it too. The rules' cases (whose placeholders
go, which nodes are named) are tests/unit/test_autoscale.py's and test_autoscale_room.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from common.constants import CLAIM_ANNOTATION, NODE_LABEL
from common.kubeapi import Kube, Obj, core_path
from common.placeholders import PLACEHOLDER_PRIORITY_CLASS, signal_name
from hack.cluster.priority import ensure_priority_classes
from tests.integration.allocator_fixtures import (
    TEST_NODE_LABEL,
    AllocatorEnv,
    GpuSpec,
    allocator_env,
    create_mig_node,
    make_mig_node,
)
from tests.integration.test_allocator import kube  # noqa: F401  (fixture)
from tests.support import listed, wait_for
from webhook.allocator import pods as podlib
from webhook.allocator.autoscale import ScaleUpSettings, SignalMode
from webhook.allocator.scaleup import ScaleUp

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture
async def env(kube: Kube, namespace: str) -> AsyncIterator[AllocatorEnv]:  # noqa: F811
    await ensure_priority_classes(kube, {PLACEHOLDER_PRIORITY_CLASS: -1000000}, never={
        PLACEHOLDER_PRIORITY_CLASS})  # fmt: skip
    async with allocator_env(kube, namespace) as world:
        yield world


async def record(api: Kube, namespace: str, rv: str, seen: list[tuple[str, Obj]]) -> None:
    async for etype, obj in api.watch(core_path("pods", namespace), rv, timeout_s=120):
        if etype != "BOOKMARK":
            seen.append((etype, obj))


@contextlib.asynccontextmanager
async def recording(env: AllocatorEnv) -> AsyncIterator[list[tuple[str, Obj]]]:
    """Every event of the test namespace's pods watch while inside, in order."""
    listing = await env.kube.list(core_path("pods", env.namespace))
    seen: list[tuple[str, Obj]] = []
    watch = asyncio.create_task(
        record(env.kube, env.namespace, listing["metadata"]["resourceVersion"], seen)
    )
    try:
        yield seen
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)


def ours(env: AllocatorEnv) -> dict[str, str]:
    """The test's pods select the test's nodes, and so do their placeholders (a copy of the
    pod's nodeSelector): the suite's earlier tests leave KWOK nodes that advertise H100
    capacity (the node agent's), and the kube-scheduler bound a placeholder to one of those
    when the whole integration suite ran (the test then waited in vain)."""
    return {TEST_NODE_LABEL: env.namespace}


async def wait_pod_there(env: AllocatorEnv, name: str, node: str | None, what: str) -> None:
    """Until pod `name` exists (bound to `node`, if given)."""
    await wait_for(
        env.kube,
        core_path("pods", env.namespace),
        listed(
            lambda items: any(
                p["metadata"]["name"] == name
                and (node is None or p["spec"].get("nodeName") == node)
                for p in items
            )
        ),
        what=what,
    )


async def its_agent_comes_and_p_binds(env: AllocatorEnv, node: str) -> None:
    """`node` gets its MigNode (its agent is up); pod `p` binds there."""
    await create_mig_node(env.kube, make_mig_node(node, ["H100-80GB"]))
    bound = await env.wait_bound("p")
    assert bound["spec"]["nodeName"] == node
    await asyncio.sleep(0.5)  # the watch catches up with the binding


async def test_the_placeholder_goes_before_the_pin(
    env: AllocatorEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    delete = ScaleUp._delete_signal

    async def slow_delete(self: ScaleUp, uid: str) -> None:
        await asyncio.sleep(1.0)  # a loaded API server (CI): the delete answers late
        await delete(self, uid)

    monkeypatch.setattr(ScaleUp, "_delete_signal", slow_delete)
    env.start(scale_up=ScaleUpSettings(mode=SignalMode.PLACEHOLDER, delay_s=0.2, interval_s=0.2))
    async with recording(env) as seen:
        pod = await env.create_pod(
            "p", slices={"main": {"7g.80gb": 1}}, cpu="1", memory="1Gi", node_selector=ours(env)
        )
        placeholder = signal_name(pod["metadata"]["uid"])
        await wait_pod_there(env, placeholder, None, "the placeholder (no node serves the pod)")
        # what Karpenter brings: one H100, room for one 7g.80gb in the scheduler's eyes
        node = await env.add_node("new", mig_node=False)
        await wait_pod_there(
            env, placeholder, node, "the placeholder bound to the new node by the kube-scheduler"
        )
        await its_agent_comes_and_p_binds(env, node)
    assert_gone_before_the_pin(seen, placeholder, "p", node)


def assert_gone_before_the_pin(
    seen: list[tuple[str, Obj]], placeholder: str, pod: str, node: str
) -> None:
    """In the pods watch `seen`: `placeholder` was deleted before `pod` was pinned to `node`,
    and the kube-scheduler never preempted it (no DisruptionTarget on it, no nomination)."""

    def index(predicate: Any, what: str) -> int:
        found = [i for i, (etype, obj) in enumerate(seen) if predicate(etype, obj)]
        names = [(e, o["metadata"]["name"]) for e, o in seen]
        assert found, f"no {what} in the pods watch: {names}"
        return found[0]

    deleted = index(
        lambda etype, obj: etype == "DELETED" and obj["metadata"]["name"] == placeholder,
        "placeholder deletion",
    )
    pinned = index(
        lambda etype, obj: obj["metadata"]["name"] == pod and podlib.pinned_node(obj) == node,
        "pin",
    )
    assert deleted < pinned
    for _, obj in seen:
        name = obj["metadata"]["name"]
        status = obj.get("status") or {}
        if name == placeholder:
            assert "DisruptionTarget" not in [c["type"] for c in status.get("conditions") or []]
        if name == pod:
            assert not status.get("nominatedNodeName"), status


async def test_a_waiting_pods_placeholder_goes_before_another_pod_is_pinned_there(
    env: AllocatorEnv,
) -> None:
    """`q` asks for a 7g.80gb, which the node's one GPU cannot give (a 1g.10gb instance
    holds a slot), so it waits for a node of its own; the kube-scheduler bound its
    placeholder to the node first (the node's upper bound still says 7g.80gb: 1). `p` asks
    for a 1g.10gb, which the allocator places there; but `q`'s placeholder holds `p`'s room
    in the scheduler's eyes (cpu 5 + 4 of 8): left there, the scheduler preempts it, and
    its async preemption can park `p` for five minutes (kubernetes/kubernetes#141694). It
    goes before the pin instead. Only `p` can be placed, so the allocator's order among
    the two does not matter."""
    env.start(scale_up=ScaleUpSettings(mode=SignalMode.PLACEHOLDER, delay_s=0.2, interval_s=0.2))
    async with recording(env) as seen:
        q = await env.create_pod(
            "q", slices={"main": {"7g.80gb": 1}}, cpu="5", node_selector=ours(env)
        )
        placeholder = signal_name(q["metadata"]["uid"])
        node = await env.add_node("new", mig_node=False)  # cpu 8
        await wait_pod_there(
            env, placeholder, node, "q's placeholder bound to the new node by the kube-scheduler"
        )
        p = await env.create_pod(
            "p", slices={"main": {"1g.10gb": 1}}, cpu="4", node_selector=ours(env)
        )
        own = signal_name(p["metadata"]["uid"])
        await wait_pod_there(env, own, None, "p's placeholder (no room for it: q's holds it)")
        held = GpuSpec(slices=[{"profile": "1g.10gb", "start": 0, "size": 1, "migUUID": "MIG-h"}])
        await create_mig_node(env.kube, make_mig_node(node, [held]))  # its agent is up
        bound = await env.wait_bound("p")
        assert bound["spec"]["nodeName"] == node
        await asyncio.sleep(0.5)  # the watch catches up with the binding
    assert_gone_before_the_pin(seen, placeholder, "p", node)
    assert [a["metadata"]["name"] for a in await env.allocations()] == [
        p["metadata"]["annotations"][CLAIM_ANNOTATION]
    ]  # q still waits


async def test_a_placeholder_bound_where_its_pod_cannot_go_is_replaced_once(
    env: AllocatorEnv,
) -> None:
    """The node's one GPU is full of 7g.80gb, yet it advertises 7 of 1g.10gb. `q` asks
    1g.10gb: its placeholder is kept off the node by `instaslice.io/node NotIn`, but the
    node's agent has not labelled it yet, so the scheduler binds it there; it stays (a
    replacement could land there just the same). Once the node carries the label, the
    allocator replaces it: deleted, raised again at once kept off the node, and the
    scheduler leaves the new one unbound (Karpenter would make a node for it); no more
    replacements after that."""
    env.start(scale_up=ScaleUpSettings(mode=SignalMode.PLACEHOLDER, delay_s=0.2, interval_s=0.2))
    held = GpuSpec(slices=[{"profile": "7g.80gb", "start": 0, "size": 8, "migUUID": "MIG-h"}])
    node = await env.add_node("full", gpus=[held])
    pods = core_path("pods", env.namespace)
    async with recording(env) as seen:
        q = await env.create_pod(
            "q", slices={"main": {"1g.10gb": 1}}, cpu="1", node_selector=ours(env)
        )
        name = signal_name(q["metadata"]["uid"])
        await wait_pod_there(env, name, node, "q's placeholder bound to the unlabelled node")
        first = await env.kube.get(core_path("pods", env.namespace, name))
        await asyncio.sleep(1.0)  # five rounds: left alone while the node is not labelled
        still = await env.kube.get(core_path("pods", env.namespace, name))
        assert still["metadata"]["uid"] == first["metadata"]["uid"]
        await env.kube.patch(
            core_path("nodes", name=node), {"metadata": {"labels": {NODE_LABEL: node}}}
        )  # as its agent does
        replacement = await wait_for(
            env.kube,
            pods,
            listed(lambda items: next(
                (p for p in items if p["metadata"]["name"] == name
                 and p["metadata"]["uid"] != first["metadata"]["uid"]),
                None,
            )),
            what="q's placeholder replaced",
        )  # fmt: skip
        await asyncio.sleep(2.0)  # ten rounds, and the scheduler's tries
    # Read from the watch, not a GET: KWOK's pod-delete stage, played for the old
    # placeholder, deletes by name and may take the replacement too (a kubelet deletes with
    # the pod's uid as precondition); the allocator then asks again after the lost wait.
    new = replacement["metadata"]["uid"]
    assert not [o for _, o in seen if o["metadata"]["uid"] == new and o["spec"].get("nodeName")]
    terms = replacement["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    keep_off = [e for t in terms["nodeSelectorTerms"] for e in t["matchExpressions"]
                if e["key"] == NODE_LABEL]  # fmt: skip
    assert keep_off == [{"key": NODE_LABEL, "operator": "NotIn", "values": [node]}]
    created = [
        o["metadata"]["uid"] for e, o in seen if e == "ADDED" and o["metadata"]["name"] == name
    ]
    assert created == [first["metadata"]["uid"], new]  # replaced once


async def test_a_node_left_off_for_its_cpu_is_one_the_scheduler_refuses(env: AllocatorEnv) -> None:
    """The node's GPU is full of 7g.80gb (its upper bound still shows room for 1g.10gb) and
    a pod bound there took its cpu. `q` asks 1g.10gb and 1 cpu: the allocator leaves the
    node off its placeholder's `NotIn` (its advertised room cannot hold it), and the real
    kube-scheduler indeed finds no room there (`Insufficient cpu`) and leaves it unbound."""
    env.start(scale_up=ScaleUpSettings(mode=SignalMode.PLACEHOLDER, delay_s=0.2, interval_s=0.2))
    held = GpuSpec(slices=[{"profile": "7g.80gb", "start": 0, "size": 8, "migUUID": "MIG-h"}])
    name = env.node_name("full")
    node = await env.add_node("full", gpus=[held], cpu="2", labels={NODE_LABEL: name})
    await env.create_pod("hog", slices={}, cpu="2", gates=(), claim=None, node_name=node)
    q = await env.create_pod("q", slices={"main": {"1g.10gb": 1}}, cpu="1", node_selector=ours(env))
    refused = await env.wait_pod(
        signal_name(q["metadata"]["uid"]),
        lambda p: any(
            c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable"
            for c in (p.get("status") or {}).get("conditions") or []
        ),
        what="the scheduler found no node for the placeholder",
    )
    assert "affinity" not in refused["spec"]  # nothing to keep it off
    assert not refused["spec"].get("nodeName")
    (scheduled,) = [c for c in refused["status"]["conditions"] if c["type"] == "PodScheduled"]
    assert "Insufficient cpu" in scheduled["message"], scheduled
