"""A GPU's NVML lane (`nodeagent.lane.Lane`) and `NodeGpus.call_gpu_first` on it: one holder
at a time; waiters served by rank (a create's calls first), then in arrival order; the holder
is never cut short; a cancelled waiter is skipped, and one cancelled after it was handed the
lane hands it on.

A create whose slots a release holds waits outside the lane (`create.wait_for_releases`)
until that record is dropped, or for at most its cap on the agent's clock.

Leaves out which calls of the agent are a create's (tests/integration/test_nodeagent_lane.py
runs the agent) and which records a create waits for (`reconcile.held_by_release`).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeagent.create import wait_for_releases
from nodeagent.lane import FIRST, NEXT, Lane
from nodeagent.state import AgentNode
from testkit.builders import G0
from tests.unit.test_nodeagent_reconcile import rec, srec
from tests.unit.test_nodeagent_shared_pool import Probe, gpus


async def _queue(lane: Lane, ranks: list[int]) -> list[int]:
    """Hold the lane, queue one waiter per rank (in list order), let go: the order the
    waiters got it in, by their index in `ranks`."""
    order: list[int] = []

    async def waiter(i: int, rank: int) -> None:
        async with lane.hold(rank):
            order.append(i)
            await asyncio.sleep(0)  # holds across a suspension

    async with lane.hold(NEXT):
        tasks = [asyncio.create_task(waiter(i, r)) for i, r in enumerate(ranks)]
        await asyncio.sleep(0)  # every waiter queued
        assert lane.waiting == len(ranks)
    await asyncio.gather(*tasks)
    return order


@pytest.mark.parametrize(
    ("ranks", "want"),
    [
        ([NEXT, NEXT, NEXT], [0, 1, 2]),  # one rank: first come, first served
        ([NEXT, NEXT, FIRST], [2, 0, 1]),  # a create overtakes queued releases
        ([NEXT, FIRST, NEXT, FIRST], [1, 3, 0, 2]),  # creates in their order, then the rest
        ([FIRST, FIRST], [0, 1]),
        ([], []),
    ],
)
async def test_waiters_go_by_rank_then_arrival(ranks: list[int], want: list[int]) -> None:
    assert await _queue(Lane(), ranks) == want


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([FIRST, NEXT]), max_size=12))
def test_the_order_is_rank_then_arrival_for_any_queue(ranks: list[int]) -> None:
    got = asyncio.run(_queue(Lane(), ranks))
    assert got == sorted(range(len(ranks)), key=lambda i: (ranks[i], i))


async def test_a_free_lane_is_taken_at_once_and_freed_after() -> None:
    lane = Lane()
    async with lane.hold(NEXT):
        pass
    async with asyncio.timeout(1):
        async with lane.hold(FIRST):
            assert lane.waiting == 0


async def test_the_holder_is_not_cut_short_by_a_create() -> None:
    lane = Lane()
    events: list[str] = []

    async def holder() -> None:
        async with lane.hold(NEXT):
            events.append("release starts")
            await asyncio.sleep(0.05)
            events.append("release ends")

    async def create() -> None:
        async with lane.hold(FIRST):
            events.append("create")

    h = asyncio.create_task(holder())
    await asyncio.sleep(0)
    await asyncio.gather(create(), h)
    assert events == ["release starts", "release ends", "create"]


async def test_a_cancelled_waiter_is_skipped() -> None:
    lane = Lane()
    order: list[str] = []

    async def waiter(name: str, rank: int) -> None:
        async with lane.hold(rank):
            order.append(name)

    async with lane.hold(NEXT):
        gone = asyncio.create_task(waiter("cancelled", FIRST))
        stays = asyncio.create_task(waiter("next", NEXT))
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)
    await stays
    assert gone.cancelled()
    assert order == ["next"]
    async with asyncio.timeout(1), lane.hold(NEXT):  # free again
        pass


async def test_a_waiter_cancelled_after_it_was_handed_the_lane_hands_it_on() -> None:
    lane = Lane()
    order: list[str] = []

    async def waiter(name: str) -> None:
        async with lane.hold(NEXT):
            order.append(name)

    first = asyncio.create_task(waiter("handed"))
    second = asyncio.create_task(waiter("after"))
    async with lane.hold(NEXT):
        await asyncio.sleep(0)  # both queued behind this holder
    first.cancel()  # handed the lane on the exit above, not yet resumed: cancelled now
    await asyncio.gather(first, second, return_exceptions=True)
    assert first.cancelled()
    assert order == ["after"]
    async with asyncio.timeout(1), lane.hold(NEXT):
        pass


async def test_call_gpu_first_overtakes_the_calls_queued_on_its_gpu() -> None:
    probe = Probe()
    with ThreadPoolExecutor(max_workers=8) as pool:
        g = gpus("a", pool)
        running = asyncio.create_task(g.call_gpu(0, probe.work, "g0", 0, 0.1))
        await asyncio.sleep(0.02)  # call 0 runs in its thread
        queued = [asyncio.create_task(g.call_gpu(0, probe.work, "g0", i, 0.0)) for i in (1, 2)]
        await asyncio.sleep(0)
        create = asyncio.create_task(g.call_gpu_first(0, probe.work, "g0", 3, 0.0))
        other_gpu = asyncio.create_task(g.call_gpu(1, probe.work, "g1", 4, 0.0))
        t0 = time.monotonic()
        await asyncio.gather(running, *queued, create, other_gpu)
    assert [i for n, i in probe.order if n == "g0"] == [0, 3, 1, 2]
    assert not probe.overlap
    assert time.monotonic() - t0 < 5


# ---- a create waiting for a release holding its slots (create.wait_for_releases) --------


class StepClock:
    """The agent's clock, moved only by the test: `sleep` returns once `advance` passed it."""

    def __init__(self) -> None:
        self.now = 0.0
        self._moved = asyncio.Event()

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> dt.datetime:
        return dt.datetime.fromtimestamp(self.now, dt.UTC)

    async def sleep(self, seconds: float) -> None:
        until = self.now + seconds
        while self.now < until:
            await self._moved.wait()

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self._moved.set()
        self._moved = asyncio.Event()


def _held(tmp_path: Path) -> AgentNode:
    """A node whose record u2 is releasing GPU G0's slots 4:4."""
    st = AgentNode(node="n1", boot_id="b1", checkpoint_path=tmp_path / "cp.json")
    st.set_checkpoint(st.cp.with_claim(rec("u2", srec(G0, 9, 4, 4), state="releasing")))
    return st


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_release_that_never_ends_is_waited_for_up_to_the_cap_of_the_agents_clock(
    tmp_path: Path,
) -> None:
    """The cap runs on the injected clock (docs/style.md §8): with it held still the create keeps
    waiting; once it passes the cap the create goes on ("still held": the placement check
    then fails it)."""
    st, clock = _held(tmp_path), StepClock()
    waiting = asyncio.create_task(
        wait_for_releases(st, clock, "ns/c", "u1", [srec(G0, 19, 5, 1)], cap_s=30.0)
    )
    await _settle()
    clock.advance(29.5)
    await _settle()
    assert not waiting.done()
    clock.advance(0.5)
    assert await asyncio.wait_for(waiting, 5) == "still held"


async def test_a_create_waits_until_the_release_drops_its_record(tmp_path: Path) -> None:
    st, clock = _held(tmp_path), StepClock()
    st.set_checkpoint(st.cp.with_claim(rec("u3", srec(G0, 19, 7, 1), state="releasing")))
    fresh = [srec(G0, 9, 4, 4)]
    waiting = asyncio.create_task(wait_for_releases(st, clock, "ns/c", "u1", fresh, cap_s=30.0))
    await _settle()
    st.drop("u3")  # another release: the slots are still held
    await _settle()
    assert not waiting.done()
    st.drop("u2")
    assert await asyncio.wait_for(waiting, 5) == "released"
    assert clock.now == 0.0
    assert await wait_for_releases(st, clock, "ns/c", "u1", fresh, cap_s=30.0) == "free"
