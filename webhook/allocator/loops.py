"""The leader's loops beside the pods' workers: the placer's rounds, the timer, the agents' sweep.

- placement: each wake-up is a round (`placer.Placer`): gated pods popped in priority order
  and decided on a snapshot, with a CPU budget for preemption planning; pods whose plan a
  spent budget deferred go first in the next round, which starts at once
  (webhook/allocator/planning.py);
- the timer: pinned pods the scheduler cannot bind (`pinned_unschedulable_timeout_s`) are
  marked due and looked at, and parked pods are looked at again once a MIG mode change held
  back by `--ampere-mode-change-interval` may be asked;
- the agents' sweep every `agent_sweep_s`: nodes whose agent has not renewed its Lease are
  left out of placement (webhook/allocator/agents.py), nodes gone for good forgotten.

All three run on the injected clock, only while leading (the controller's term starts and
cancels them). What they deliberately do not do: decide or write for a pod themselves: they
only kick its worker (`kick`), which asks `track.next_step`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from common.clock import Clock, wait_or_sleep
from webhook.allocator.agents import AgentWatch
from webhook.allocator.placer import Placer
from webhook.allocator.settings import AllocatorSettings
from webhook.allocator.track import Tracks
from webhook.allocator.writes import Writes


@dataclass(eq=False)
class Loops:
    tracks: Tracks
    placer: Placer
    agents: AgentWatch
    writes: Writes
    clock: Clock
    settings: AllocatorSettings
    kick: Callable[[str], None]  # look at a pod again (its worker)
    wake_placer: asyncio.Event = field(default_factory=asyncio.Event)  # a pod was queued
    wake_timer: asyncio.Event = field(default_factory=asyncio.Event)  # a deadline may be nearer
    _held_wake: float | None = None  # the placer's asks.wake the timer waits for

    async def placement(self) -> None:
        while True:
            await self.wake_placer.wait()
            self.wake_placer.clear()
            self.placer.start_round()
            while self.placer.waiting():
                self.placer.place_queued()
                if self.placer.ampere.asks.wake != self._held_wake:  # a MIG mode change held back
                    self.wake_timer.set()
                await asyncio.sleep(0)  # let watch events and writes progress between pods
            if self.placer.rounds.deferred:  # plans a spent budget deferred: the next round
                self.wake_placer.set()

    async def timer(self) -> None:
        timeout = self.settings.pinned_unschedulable_timeout_s
        while True:
            deadline = self.tracks.next_deadline(timeout)
            wait = None if deadline is None else max(0.0, deadline - self.clock.monotonic())
            # a MIG mode change held back by --ampere-mode-change-interval: parked pods are
            # looked at again when it may be asked (a wall-clock time: the agent's)
            self._held_wake = self.placer.ampere.asks.wake
            if self._held_wake is not None:
                held = max(0.0, self._held_wake - self.clock.wall().timestamp())
                wait = held if wait is None else min(wait, held)
            await wait_or_sleep(self.clock, self.wake_timer, wait)
            self.wake_timer.clear()
            for uid in self.tracks.due(self.clock.monotonic(), timeout):
                self.kick(uid)
            wake = self.placer.ampere.asks.wake
            if wake is not None and self.clock.wall().timestamp() >= wake:
                self.placer.ampere.asks.wake = None
                for uid in self.tracks.take_parked():
                    self.kick(uid)

    async def agents_sweep(self) -> None:
        while True:
            self.agents.sweep()
            await self.agents.forget_gone_nodes(
                self.writes, self.settings.namespace, self.settings.node_gone_grace_s
            )
            await self.clock.sleep(self.settings.agent_sweep_s)
