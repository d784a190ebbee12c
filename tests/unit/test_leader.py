"""Lease-based leader election (webhook/allocator/leader.py) on a fake clock and a fake
Lease API: acquiring, renewing, expiry measured on the local clock, optimistic concurrency,
the renew deadline, hand-over on release. Leaves out the real API server (the two-replica
integration test covers it).
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, cast

import pytest

from common.kubeapi import ApiError, Kube
from testkit.clock import FakeClock
from webhook.allocator.leader import LeaderElector, LeadershipLost, LeaseSettings

pytestmark = pytest.mark.timeout(10)

PATH = "/apis/coordination.k8s.io/v1/namespaces/sys/leases/instaslice-allocator"


class FakeLeases:
    """get / create / replace of Lease objects with resourceVersion checks."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.rv = itertools.count(1)
        self.down = False
        self.gets = 0

    def _check(self) -> None:
        if self.down:
            raise ApiError(0, "ClientConnectorError", "connection refused")

    async def get(self, path: str) -> dict[str, Any]:
        self.gets += 1
        self._check()
        if path not in self.objects:
            raise ApiError(404, "NotFound", path)
        return dict(self.objects[path])

    async def create(self, collection: str, body: dict[str, Any]) -> dict[str, Any]:
        self._check()
        path = f"{collection}/{body['metadata']['name']}"
        if path in self.objects:
            raise ApiError(409, "AlreadyExists", path)
        obj = {**body, "metadata": {**body["metadata"], "resourceVersion": str(next(self.rv))}}
        self.objects[path] = obj
        return obj

    async def replace(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self._check()
        current = self.objects[path]
        if body["metadata"]["resourceVersion"] != current["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", "the object has been modified")
        obj = {**body, "metadata": {**body["metadata"], "resourceVersion": str(next(self.rv))}}
        self.objects[path] = obj
        return obj

    @property
    def spec(self) -> dict[str, Any]:
        return dict(self.objects[PATH]["spec"])


def elector(api: FakeLeases, clock: FakeClock, identity: str) -> LeaderElector:
    settings = LeaseSettings(namespace="sys", identity=identity)
    return LeaderElector(cast(Kube, api), settings, clock)


async def test_first_candidate_creates_the_lease_second_waits_for_expiry():
    api, clock = FakeLeases(), FakeClock()
    a, b = elector(api, clock, "a"), elector(api, clock, "b")
    assert await a.try_acquire_or_renew()
    assert a.is_leader and api.spec["holderIdentity"] == "a"
    assert api.spec["leaseDurationSeconds"] == 15
    assert not await b.try_acquire_or_renew()
    assert b.holder == "a" and not b.is_leader
    await clock.advance(10)
    assert not await b.try_acquire_or_renew()  # unchanged for 10 s only, as b measures it
    await clock.advance(5.1)
    assert await b.try_acquire_or_renew()
    assert api.spec["holderIdentity"] == "b" and api.spec["leaseTransitions"] == 1
    assert not a.is_leader  # its own deadline ran out long ago
    assert not await a.try_acquire_or_renew()


async def test_renewal_keeps_others_out():
    api, clock = FakeLeases(), FakeClock()
    a, b = elector(api, clock, "a"), elector(api, clock, "b")
    assert await a.try_acquire_or_renew()
    for _ in range(6):
        await clock.advance(5)
        assert await a.try_acquire_or_renew()
        assert not await b.try_acquire_or_renew()
    assert api.spec["leaseTransitions"] == 0
    acquired = api.spec["acquireTime"]
    assert await a.try_acquire_or_renew()
    assert api.spec["acquireTime"] == acquired  # renewals keep the acquire time


async def test_leadership_expires_on_the_local_clock_without_renewal():
    api, clock = FakeLeases(), FakeClock()
    a = elector(api, clock, "a")
    assert await a.try_acquire_or_renew()
    await clock.advance(9.9)
    assert a.is_leader
    a.check()
    await clock.advance(0.2)
    assert not a.is_leader
    with pytest.raises(Exception, match="not the allocator leader"):
        a.check()


async def test_a_concurrent_write_wins_once():
    api, clock = FakeLeases(), FakeClock()
    a, b = elector(api, clock, "a"), elector(api, clock, "b")
    results = await asyncio.gather(a.try_acquire_or_renew(), b.try_acquire_or_renew())
    assert sorted(results) == [False, True]
    assert api.spec["holderIdentity"] in ("a", "b")


async def test_hold_survives_a_short_outage_and_gives_up_after_the_deadline():
    api, clock = FakeLeases(), FakeClock()
    a = elector(api, clock, "a")
    await a.acquire()
    holding = asyncio.create_task(a.hold())
    await clock.advance(5)  # renewed
    api.down = True
    await clock.advance(6)  # one failed renewal, still within 10 s of the last one
    assert a.is_leader and not holding.done()
    api.down = False
    await clock.advance(2)  # the retry succeeds
    assert a.is_leader and not holding.done()
    api.down = True
    await clock.advance(12)
    assert holding.done()
    with pytest.raises(LeadershipLost):
        holding.result()
    assert not a.is_leader


async def test_hold_notices_another_holder():
    api, clock = FakeLeases(), FakeClock()
    a = elector(api, clock, "a")
    await a.acquire()
    holding = asyncio.create_task(a.hold())
    lease = api.objects[PATH]
    api.objects[PATH] = {
        **lease,
        "metadata": {**lease["metadata"], "resourceVersion": "999"},
        "spec": {**lease["spec"], "holderIdentity": "intruder"},
    }
    await clock.advance(5)
    assert holding.done()
    with pytest.raises(LeadershipLost):
        holding.result()


async def test_release_hands_over_at_once():
    api, clock = FakeLeases(), FakeClock()
    a, b = elector(api, clock, "a"), elector(api, clock, "b")
    await a.acquire()
    assert not await b.try_acquire_or_renew()
    await a.release()
    assert api.spec["holderIdentity"] == "" and not a.is_leader
    assert await b.try_acquire_or_renew()
    await a.release()  # not leading: nothing written
    assert api.spec["holderIdentity"] == "b"


async def test_same_identity_takes_its_own_lease_back_at_once():
    api, clock = FakeLeases(), FakeClock()
    assert await elector(api, clock, "a").try_acquire_or_renew()
    restarted = elector(api, clock, "a")
    assert await restarted.try_acquire_or_renew()
    assert api.spec["leaseTransitions"] == 0


async def test_acquire_retries_until_the_lease_is_free():
    api, clock = FakeLeases(), FakeClock()
    a, b = elector(api, clock, "a"), elector(api, clock, "b")
    await a.acquire()
    waiting = asyncio.create_task(b.acquire())
    await clock.advance(4)
    assert not waiting.done()
    await a.release()
    await clock.advance(2)
    assert waiting.done() and b.is_leader


@pytest.mark.parametrize(
    ("interval", "deadline", "duration"), [(5, 10, 10), (10, 5, 15), (0, 5, 15)]
)
def test_settings_refuse_unsafe_timings(interval, deadline, duration):
    with pytest.raises(ValueError):
        LeaseSettings(
            namespace="sys",
            identity="a",
            renew_interval_s=interval,
            renew_deadline_s=deadline,
            lease_duration_s=duration,
        )


async def test_a_leader_renews_with_one_write_and_reads_only_after_a_conflict():
    api, clock = FakeLeases(), FakeClock()
    a = elector(api, clock, "a")
    assert await a.try_acquire_or_renew()
    reads = api.gets
    for _ in range(3):
        await clock.advance(1)
        assert await a.try_acquire_or_renew()
    assert api.gets == reads  # renewals: PUTs of the Lease it wrote last
    lease = api.objects[PATH]  # someone else writes it (an admin, a racing candidate)
    api.objects[PATH] = {**lease, "metadata": {**lease["metadata"], "resourceVersion": "x"}}
    assert await a.try_acquire_or_renew()  # still its own: read, then written again
    assert api.gets == reads + 1
