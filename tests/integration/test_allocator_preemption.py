"""Preemption against the real local control plane (kube-apiserver with its Priority and
Eviction admission, KCM's disruption controller computing PodDisruptionBudget status,
kube-scheduler, KWOK nodes), `FakeAgent` playing the node agents.

Covers: a 7g evicts exactly the pods of one GPU (events on both sides); a PDB sends it to
the other GPU; a PDB guarding every candidate makes no pod immune: the API server refuses the
evictions (429) and, as kube-scheduler's preemption, the allocator deletes the victims of
that last-resort plan; `preemptionPolicy: Never` preempts nothing; victims that do not terminate are
given up for others; the allocator killed mid-preemption (a new leader keeps the reserved
slots from a lower-priority pod and evicts nobody else); a pod arriving while the victims
terminate, of higher priority than they, does not get the reserved slots; a preemptor deleted
mid-way leaves no reservation behind. The real node agent releasing victims' slices: tests/e2e.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import pytest

from common.constants import REASON_PENDING, REASON_PREEMPTED, REASON_PREEMPTING
from common.kubeapi import ApiError, Kube, core_path, group_path
from hack.cluster.priority import ensure_priority_classes
from tests.integration.allocator_fixtures import AllocatorEnv, assert_no_double_booking, make_pod
from tests.integration.test_allocator import env, kube  # noqa: F401  (fixtures)
from tests.support import eventually, listed, wait_for
from webhook.allocator import pods as podlib
from webhook.allocator.controller import Controller
from webhook.allocator.preemption import start_time

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

LOW, MID, HIGH, NEVER = "it-preempt-low", "it-preempt-mid", "it-preempt-high", "it-preempt-never"
HOLD = "instaslice.io/test-hold"  # a finalizer that keeps an evicted pod terminating


@pytest.fixture(scope="module")
async def priority_classes(kube: Kube) -> AsyncIterator[None]:  # noqa: F811
    values = {LOW: 100, MID: 500, HIGH: 1000, NEVER: 1000}
    await ensure_priority_classes(kube, values, never={NEVER})
    yield


async def create(
    env: AllocatorEnv,  # noqa: F811
    name: str,
    klass: str,
    profile: str = "1g.10gb",
    *,
    labels: dict[str, str] | None = None,
    hold: bool = False,
) -> dict[str, Any]:
    body = make_pod(name, namespace=env.namespace, slices={"main": {profile: 1}}, labels=labels)
    body["spec"]["priorityClassName"] = klass
    if hold:
        body["metadata"]["finalizers"] = [HOLD]
    return await env.kube.create(core_path("pods", env.namespace), body)


async def fill(env: AllocatorEnv, prefix: str, n: int, **kw: Any) -> dict[str, str]:  # noqa: F811
    """`n` low-priority 1g pods, each running before the next; their GPU uuid by name."""
    for i in range(n):
        await create(env, f"{prefix}{i}", LOW, **kw)
        await env.wait_bound(f"{prefix}{i}")
    allocs = {a["spec"]["podName"]: a for a in await env.allocations()}
    return {
        f"{prefix}{i}": allocs[f"{prefix}{i}"]["spec"]["slices"][0]["gpuUUID"] for i in range(n)
    }


async def alive(env: AllocatorEnv) -> set[str]:  # noqa: F811
    pods = (await env.kube.list(core_path("pods", env.namespace)))["items"]
    return {p["metadata"]["name"] for p in pods if not p["metadata"].get("deletionTimestamp")}


async def started_before_the_next(env: AllocatorEnv, pods: Iterable[str]) -> None:  # noqa: F811
    """Until a pod created now starts later than each of `pods`: their status.startTime is
    stamped (KWOK) in whole seconds, so the clock must pass the second after the latest. The
    stamps come from the real clock: there is none to move."""
    names = set(pods)

    async def stamped() -> list[float] | None:
        items = (await env.kube.list(core_path("pods", env.namespace)))["items"]
        got = [p for p in items if p["metadata"]["name"] in names]
        if len(got) != len(names) or not all(p.get("status", {}).get("startTime") for p in got):
            return None
        return [start_time(p) for p in got]

    latest = max(await eventually(stamped, what="the pods' start times"))
    await asyncio.sleep(max(0.0, latest + 1.0 - time.time()))


async def parked(alloc: Controller, pod: dict[str, Any]) -> None:
    """Until the allocator has parked `pod` as pending: it decided, and sent what it decided
    (evictions, a reservation) before; a parked pod waits for a change (no retry on a clock)."""

    async def seen() -> bool:
        return pod["metadata"]["uid"] in alloc.parked

    await eventually(seen, what=f"{pod['metadata']['name']} parked as pending")


async def release_holds(env: AllocatorEnv) -> None:  # noqa: F811
    for name in await all_pods(env):
        path = core_path("pods", env.namespace, name)
        try:
            await env.kube.patch(path, {"metadata": {"finalizers": None}})
        except ApiError as exc:
            if not exc.not_found:
                raise


async def all_pods(env: AllocatorEnv) -> list[str]:  # noqa: F811
    pods = (await env.kube.list(core_path("pods", env.namespace)))["items"]
    return [p["metadata"]["name"] for p in pods]


async def pdb(env: AllocatorEnv, selector: dict[str, str], pods: int) -> None:  # noqa: F811
    """A PDB keeping all `pods` it selects (bare pods: minAvailable; maxUnavailable needs a
    controller to count expected pods)."""
    body = {
        "metadata": {"name": "guard"},
        "spec": {"minAvailable": pods, "selector": {"matchLabels": selector}},
    }
    path = group_path("policy/v1", "poddisruptionbudgets", env.namespace)
    await env.kube.create(path, body)
    await wait_for(
        env.kube,
        path,
        listed(
            lambda items: (
                items if items and "disruptionsAllowed" in items[0].get("status", {}) else None
            )
        ),
        within=30,
        what="the PDB's status computed by the disruption controller",
    )


def two_gpus() -> list[str]:
    return ["H100-80GB", "H100-80GB"]


# --- the Done-when cases -----------------------------------------------------------------------


@pytest.mark.usefixtures("priority_classes")
async def test_a_7g_evicts_exactly_the_pods_of_one_gpu(env: AllocatorEnv) -> None:  # noqa: F811
    await env.add_node("n1", gpus=two_gpus())
    env.start(preemption=True)
    where = await fill(env, "low", 14)
    assert len(set(where.values())) == 2
    await create(env, "big", HIGH, "7g.80gb")
    bound = await env.wait_bound("big", within=60)
    big = next(a for a in await env.allocations() if a["spec"]["podName"] == "big")
    gpu = big["spec"]["slices"][0]["gpuUUID"]
    evicted = {n for n, g in where.items() if g == gpu}
    assert len(evicted) == 7
    assert await alive(env) == {"big"} | (set(where) - evicted)
    assert podlib.bound_node(bound) == env.node_name("n1")
    preempting = await env.wait_event("big", REASON_PREEMPTING)
    assert all(f"{env.namespace}/{n}" in preempting["message"] for n in evicted)
    for name in evicted:
        event = await env.wait_event(name, REASON_PREEMPTED)
        assert f"{env.namespace}/big" in event["message"]
    assert_no_double_booking(await env.allocations())


@pytest.mark.usefixtures("priority_classes")
async def test_a_pdb_guarding_one_gpu_sends_the_pod_to_the_other(env: AllocatorEnv) -> None:  # noqa: F811
    await env.add_node("n1", gpus=two_gpus())
    env.start(preemption=True)
    plain = await fill(env, "plain", 7)
    await started_before_the_next(env, plain)  # the guarded ones: without the PDB they'd go
    guarded = await fill(env, "guarded", 7, labels={"app": "guarded"})
    assert len(set(plain.values())) == 1 and set(plain.values()).isdisjoint(guarded.values())
    await pdb(env, {"app": "guarded"}, 7)
    await create(env, "big", HIGH, "7g.80gb")
    await env.wait_bound("big", within=60)
    assert await alive(env) == {"big"} | set(guarded)
    assert_no_double_booking(await env.allocations())


@pytest.mark.usefixtures("priority_classes")
async def test_a_pdb_guarding_every_candidate_is_violated_as_the_last_resort(
    env: AllocatorEnv,  # noqa: F811
) -> None:
    """Security (finding 5): a PDB keeping every pod in the way made them immune (the refused
    eviction was avoided for good). The API server still refuses each eviction (429); the
    plan being the last resort, the allocator deletes the victims, as kube-scheduler does."""
    await env.add_node("n1")
    env.start(preemption=True)
    guarded = await fill(env, "guarded", 7, labels={"app": "guarded"})
    await pdb(env, {"app": "guarded"}, 7)
    await create(env, "big", HIGH, "7g.80gb")
    await env.wait_bound("big", within=60)
    assert await alive(env) == {"big"}
    for name in guarded:
        event = await env.wait_event(name, REASON_PREEMPTED)
        assert "past its PodDisruptionBudget" in event["message"]
    assert_no_double_booking(await env.allocations())


@pytest.mark.usefixtures("priority_classes")
async def test_preemption_policy_never_preempts_nothing(env: AllocatorEnv) -> None:  # noqa: F811
    await env.add_node("n1")
    alloc = env.start(preemption=True)
    where = await fill(env, "low", 7)
    polite = await create(env, "polite", NEVER, "7g.80gb")
    event = await env.wait_event("polite", REASON_PENDING)
    assert "preemptionPolicy is Never" in event["message"]
    await parked(alloc, polite)  # decided: evictions would have been sent before
    assert await alive(env) == {"polite"} | set(where)
    assert not await env.events("polite", REASON_PREEMPTING)


# --- faults ----------------------------------------------------------------------------------


@pytest.mark.usefixtures("priority_classes")
async def test_victims_that_do_not_terminate_are_given_up_for_others(env: AllocatorEnv) -> None:  # noqa: F811
    await env.add_node("n1", gpus=two_gpus())
    alloc = env.start(preemption=True, preemption_wait_s=3.0)
    other = await fill(env, "other", 7)
    await started_before_the_next(env, other)  # the stuck pods: they are the first choice
    stuck = await fill(env, "stuck", 7, hold=True)
    assert set(other.values()).isdisjoint(stuck.values())
    try:
        await create(env, "big", HIGH, "7g.80gb")
        await env.wait_bound("big", within=60)
        big = next(a for a in await env.allocations() if a["spec"]["podName"] == "big")
        assert {big["spec"]["slices"][0]["gpuUUID"]} == set(other.values())
        assert await alive(env) == {"big"}  # the stuck ones were evicted, only never went
        assert set(stuck) <= set(await all_pods(env))
        assert alloc.metrics.count("preemption_abandoned") == 1
        assert_no_double_booking(await env.allocations())
    finally:
        await release_holds(env)


@pytest.mark.usefixtures("priority_classes")
async def test_killed_mid_preemption_the_new_leader_keeps_the_reservation(
    env: AllocatorEnv,  # noqa: F811
) -> None:
    await env.add_node("n1", gpus=two_gpus())
    env.start("first", preemption=True)
    where = await fill(env, "low", 14, hold=True)
    try:
        big = await create(env, "big", HIGH, "7g.80gb")
        await env.wait_event("big", REASON_PREEMPTING)

        def terminating(items: list[dict[str, Any]]) -> list[str] | None:
            names = [p["metadata"]["name"] for p in items if p["metadata"].get("deletionTimestamp")]
            return names if len(names) == 7 else None

        victims = await wait_for(
            env.kube,
            core_path("pods", env.namespace),
            listed(terminating),
            within=30,
            what="7 victims",
        )
        await env.stop("first")  # a crash mid-preemption: the victims still terminating
        same = await create(env, "same", LOW)  # equal to the victims: must not get their slots
        second = env.start("second", preemption=True)
        # the new leader has decided for both: "same" waits, "big" keeps its reservation
        await parked(second, same)

        async def kept() -> bool:  # waits for the victims, evicts nobody itself
            track = second.tracks.get(big["metadata"]["uid"])
            held = track.preempt if track is not None else None
            return held is not None and not held.victims and not held.evicted

        await eventually(kept, what="the new leader keeping big's reservation")
        assert set(await alive(env)) == {"big", "same"} | (set(where) - set(victims))
        await release_holds(env)  # the victims finish terminating
        await env.wait_bound("big", within=60)
        gpu = {where[v] for v in victims}
        big = next(a for a in await env.allocations() if a["spec"]["podName"] == "big")
        assert {big["spec"]["slices"][0]["gpuUUID"]} == gpu
        assert podlib.has_our_gate(await env.pod("same"))
        assert not await env.events("same", REASON_PREEMPTING)
        assert second.metrics.count("preempted") == 0  # the new leader evicted nobody
        assert_no_double_booking(await env.allocations())
    finally:
        await release_holds(env)


@pytest.mark.usefixtures("priority_classes")
async def test_reserved_slots_are_not_given_to_a_pod_arriving_while_victims_terminate(
    env: AllocatorEnv,  # noqa: F811
) -> None:
    """The reservation has the victim's exact shape (a 3g over a 3g): the soak once saw a
    second preemptor take such a slot, the terminating victim making it look free."""
    await env.add_node("n1")
    env.start(preemption=True)
    await create(env, "a", HIGH, "3g.40gb")  # no one's victim
    await env.wait_bound("a")
    await create(env, "b", LOW, "3g.40gb", hold=True)  # stays terminating until released
    await env.wait_bound("b")
    try:
        await create(env, "big", HIGH, "3g.40gb")
        await env.wait_event("big", REASON_PREEMPTING)
        await env.wait_pod(
            "b", lambda p: bool(p["metadata"].get("deletionTimestamp")), what="terminating"
        )
        # higher than b, lower than big: b's slot looks free soon, but it is big's
        await create(env, "mid", MID, "3g.40gb")
        event = await env.wait_event("mid", REASON_PENDING)
        assert "no set of lower-priority pods" in event["message"], event["message"]
        assert {a["spec"]["podName"] for a in await env.allocations()} == {"a", "b"}
        await release_holds(env)
        await env.wait_bound("big", within=60)
        assert podlib.has_our_gate(await env.pod("mid"))
        assert_no_double_booking(await env.allocations())
    finally:
        await release_holds(env)


@pytest.mark.usefixtures("priority_classes")
async def test_a_preemptor_deleted_midway_releases_its_reservation(env: AllocatorEnv) -> None:  # noqa: F811
    await env.add_node("n1")
    alloc = env.start(preemption=True)
    await fill(env, "low", 7, hold=True)
    try:
        await create(env, "big", HIGH, "7g.80gb")
        await env.wait_event("big", REASON_PREEMPTING)
        await env.delete_pod("big")
        await env.wait_gone("big")
        await release_holds(env)
        await create(env, "after", LOW, "3g.40gb")  # the freed GPU is anyone's again
        await env.wait_bound("after", within=60)
        assert alloc.metrics.count("preemption_abandoned") >= 1
    finally:
        await release_holds(env)
