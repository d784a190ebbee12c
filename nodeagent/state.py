"""The mutable state of one node agent, in one place, with one writer of the checkpoint.

Coroutines of the node change `cp` synchronously (no await between reading and replacing
it), then `await persist()`: a write started after a change contains it, writes are
serialized, and a change already covered by a later write is not written twice. A create's
intent is `persist_intent`: one line journaled and synced (nodeagent/checkpoint.py), the
snapshot written later; every `JOURNAL_COMPACT_AFTER` lines a snapshot is made durable and
the journal emptied, off the pods' path.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nodeagent import checkpoint
from nodeagent.checkpoint import Checkpoint, ClaimRecord
from nodeagent.model import GpuInfo, Health, Instance, NodeInventory
from nodeagent.modes import ModeChanged, ModeFailure

Obj = dict[str, Any]
# Intent-journal lines after which the next snapshot is made durable and the journal emptied:
# two syncs once per this many creates instead of each create's (the first snapshot after a
# start is made durable too: the journal may hold the last process's lines)
JOURNAL_COMPACT_AFTER = 32


@dataclass
class AgentNode:
    node: str
    boot_id: str
    checkpoint_path: Path
    inv: NodeInventory = field(default_factory=lambda: NodeInventory(gpus=()))
    health: dict[int, Health] = field(default_factory=dict)
    foreign: tuple[Instance, ...] = ()
    lost: set[int] = field(default_factory=set)  # GPUs that answered GPU_IS_LOST
    allocs: dict[str, Obj] = field(default_factory=dict)  # uid → latest SliceAllocation
    # allocations this process first saw by a watch event after its first list: fresh, so
    # made without the `Creating` write first (nodeagent/create.py); those found by the first
    # list may be moved off meanwhile (the agent was down) and are checked by that write
    live_added: set[str] = field(default_factory=set)
    # Ready allocations whose instances vanished while the agent ran (a driver reload or GPU
    # reset, same boot): marked and told once, kept until released (agent.gc, lifecycle.verify)
    vanished: set[str] = field(default_factory=set)
    # MIG mode on demand (nodeagent/modes.py), by GPU UUID: changes that failed (avoided for
    # a back-off), GPUs whose reset-less change answered RESET_REQUIRED, the last success
    mode_failures: dict[str, ModeFailure] = field(default_factory=dict)
    toggle_refused: set[str] = field(default_factory=set)
    mode_changed: dict[str, ModeChanged] = field(default_factory=dict)
    mode_phase: dict[str, str] = field(default_factory=dict)  # Ampere maintenance: Draining…
    cp: Checkpoint = field(init=False)
    publish: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.cp = Checkpoint(node=self.node, boot_id=self.boot_id)
        self._version = 0
        self._saved = 0
        self._durable = 0
        self._journaled = JOURNAL_COMPACT_AFTER  # lines since the journal was last emptied
        self._seq = 0  # the last journal line written (or loaded: `cp.intent_seq`)
        self._lock = asyncio.Lock()
        self._soon: asyncio.TimerHandle | None = None
        self._dropped = asyncio.Event()
        self._health_changed = asyncio.Event()

    def publish_soon(self, within_s: float) -> None:
        """Publish within `within_s`, together with whatever else changes meanwhile: for a
        change nobody waits on (a slice made: the allocator counts it from its allocation
        already). `publish.set()` is for changes someone waits on (slots freed, health,
        modes): the publisher writes those within its 20 ms coalescing."""
        if self._soon is not None:
            return

        def due() -> None:
            self._soon = None
            self.publish.set()

        self._soon = asyncio.get_running_loop().call_later(within_s, due)

    @property
    def publish_due(self) -> bool:
        """A `publish_soon` whose time has not come yet."""
        return self._soon is not None

    def set_checkpoint(self, cp: Checkpoint) -> None:
        self.cp = cp
        self._version += 1

    def put(self, rec: ClaimRecord) -> None:
        self.set_checkpoint(self.cp.with_claim(rec))

    def drop(self, uid: str) -> None:
        if uid in self.cp.claims:
            self.set_checkpoint(self.cp.without(uid))
            self._dropped.set()  # wakes the `next_drop` waiters (a create waiting for a release)
            self._dropped = asyncio.Event()

    def next_drop(self) -> asyncio.Event:
        """An event set when a record is dropped next."""
        return self._dropped

    async def persist(self, durable: bool = False) -> None:
        """Write the checkpoint if it changed; `durable` (fsync) for what must survive a power
        loss (MIG mode and maintenance intents; a create's intent is `persist_intent`'s)."""
        want = self._version
        async with self._lock:
            if self._saved >= want and not (durable and self._durable < want):
                return
            compact = self._journaled >= JOURNAL_COMPACT_AFTER
            durable = durable or compact
            snap, version = self.cp, self._version
            await asyncio.to_thread(self._save, snap, durable, compact)
            self._saved = version
            if durable:
                self._durable = version
                self._journaled = 0

    def _save(self, snap: Checkpoint, durable: bool, compact: bool) -> None:
        """The snapshot (holding every intent journaled so far); made `durable`, it lets the
        journal be emptied (`compact`)."""
        path = self.checkpoint_path
        seq = max(self._seq, snap.intent_seq)
        checkpoint.save(path, dataclasses.replace(snap, intent_seq=seq), durable)
        if compact:
            checkpoint.clear_journal(path)

    async def persist_intent(self, rec: ClaimRecord) -> None:
        """Put `rec` and have it on disk, durably, when this returns: one journal line synced
        (`checkpoint.append_intent`), the snapshot left to the next `persist`. What must be
        on disk before NVML makes anything (docs/nodeagent.md)."""
        self.put(rec)
        async with self._lock:
            self._seq = max(self._seq, self.cp.intent_seq) + 1
            await asyncio.to_thread(checkpoint.append_intent, self.checkpoint_path, self._seq, rec)
            self._journaled += 1

    def replace_gpu(self, gpu: GpuInfo) -> None:
        """A GPU read afresh (after a MIG mode change: minor, profiles, placements)."""
        gpus = tuple(gpu if g.index == gpu.index else g for g in self.inv.gpus)
        self.inv = dataclasses.replace(self.inv, gpus=gpus)

    def is_lost(self, gpu_index: int) -> bool:
        return gpu_index in self.lost or gpu_index in self.inv.lost

    def healthy(self, gpu_index: int) -> bool:
        return self.health.get(gpu_index, Health()).healthy

    def set_unhealthy(self, gpu_index: int, message: str) -> None:
        """The GPU is unhealthy from now on: the pool is published again (without it) and
        whoever waits on `next_health_change` (the DRA health stream) is woken."""
        self.health[gpu_index] = Health(False, message)
        self.publish.set()
        self._health_changed.set()
        self._health_changed = asyncio.Event()

    def next_health_change(self) -> asyncio.Event:
        """An event set when a GPU's health changes next."""
        return self._health_changed
