"""Ampere maintenance, the allocator's half (`--ampere-mode-changes=drain`; docs/allocator.md).

A pod that fits only after a MIG mode change on Ampere GPUs (NeedsMigModeChange) makes the
allocator ask for that change: it writes `spec.gpus[].desiredMigMode` on the node's MigNode
for exactly the GPUs the pod's would-be placement uses, and the node agent drains, pauses
the GPU Operator's clients, resets and restores (nodeagent/maintenance.py). From the moment
the ask is seen, the GPU takes nothing new (views.in_maintenance); once the agent publishes
the mode, the pod is placed like any other.

Never per pod, never a loop: one ask in flight in the whole cluster at a time (other pods
that need a reset wait for it, then ask if they still need one); the ask is withdrawn
(`desiredMigMode` removed) when the mode is reached or the agent reports `modeChange.phase:
Failed` — the failed GPU is then avoided for the agent's back-off, so a pod that still
needs a reset asks again at most once per back-off.

An ask must not outlive its reason, nor let one workload hold the slot (`AskBook`, the
allocator's record of the asks it wrote this leadership term):
- an ask is withdrawn as soon as no parked pod needs it any more (the pods that asked or
  wait for it were placed, or left), unless the agent is already resetting the GPU;
- an opposite change on one GPU waits `min_interval_s` after the agent's last change there
  (its `lastModeChange`), so pods alternating between whole GPUs and MIG slices cannot make
  the agent reset a GPU, and pause the node's GPU Operator, over and over;
- the slot goes round the namespaces that wait for it: the one served longest ago (or
  never) first, whatever the order in which their pods are looked at.
Asks an admin or an earlier leader wrote are never withdrawn here (they have no record).

Pure helpers and the record here, and `Ampere`, which the placer asks when a pod needs a
change (it keeps the record and the one-at-a-time turn); the write is the controller's (one
merge patch of the MigNode's spec, `ask_modes`/`withdraw_modes`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

from common.objects import DesiredGpu, desired_modes
from common.placement import Pending, PendingReason, PodRequest, Snapshot
from common.placement.whole import is_whole
from webhook.allocator.state import ClusterState
from webhook.allocator.views import GpuView

log = structlog.get_logger("allocator")

Obj = dict[str, Any]
ASK_OFF = "off"
ASK_DRAIN = "drain"
AMPERE_MODE_CHANGES = (ASK_OFF, ASK_DRAIN)


def in_flight(gpus: Mapping[str, Iterable[GpuView]]) -> list[tuple[str, GpuView]]:
    """(node, GPU) of every GPU whose asked mode is not reached yet (whoever asked)."""
    return [(node, g) for node, views in gpus.items() for g in views if g.maintenance]


def withdrawals(mig_node: Obj) -> set[str]:
    """GPU UUIDs whose `desiredMigMode` is done with: reached, or the agent failed it."""
    desired = desired_modes(mig_node)
    out = set()
    for g in (mig_node.get("status") or {}).get("gpus") or []:
        uuid = str(g.get("uuid", ""))
        if uuid not in desired:
            continue
        mode = g.get("migMode") or {}
        reached = mode.get("current") == mode.get("pending") == desired[uuid]
        failed = (g.get("modeChange") or {}).get("phase") == "Failed"
        if reached or failed:
            out.add(uuid)
    return out


def spec_patch(current: Mapping[str, str], add: Mapping[str, str], drop: set[str]) -> Obj:
    """The merge patch setting the MigNode's whole `spec.gpus` list (a JSON merge patch
    replaces a list): `current` with `add` set and `drop` removed."""
    want = {**{u: m for u, m in current.items() if u not in drop}, **add}
    gpus: list[DesiredGpu] = [{"uuid": u, "desiredMigMode": m} for u, m in sorted(want.items())]
    return {"spec": {"gpus": gpus}}


@dataclass
class Ask:
    """One GPU's change this term asked for, and the parked pods that need it."""

    node: str
    target: str
    owners: set[str] = field(default_factory=set)


@dataclass
class PodAsks:
    """What one parked pod has to do with the asks: the GPUs whose asks it needs, and
    whether it waits for the slot (busy, or another namespace's turn)."""

    namespace: str
    owns: frozenset[str] = frozenset()
    waiting: bool = False


@dataclass(eq=False)
class AskBook:
    """The asks this leadership term wrote, who needs them, and whose turn is next. Pure: the
    placer tells it what happened; `wake` is the wall-clock time a change held back by the
    interval may be asked (the controller's timer retries parked pods then)."""

    min_interval_s: float = 0.0
    asks: dict[str, Ask] = field(default_factory=dict)  # GPU UUID ->
    pods: dict[str, PodAsks] = field(default_factory=dict)  # pod UID ->
    queue: dict[str, int] = field(default_factory=dict)  # namespace -> waiting since (seq)
    served: dict[str, int] = field(default_factory=dict)  # namespace -> last granted (seq)
    seq: int = 0
    wake: float | None = None
    holds: int = 0  # changes held back so far (a plan that met one is not kept as failed)

    def turn(self, namespace: str) -> str:
        """The namespace the free slot goes to, `namespace` asking: of those waiting and it,
        the one served longest ago (never: first), then the one waiting longest."""
        return min(
            {*self.queue, namespace},
            key=lambda n: (self.served.get(n, 0), self.queue.get(n, self.seq + 1), n),
        )

    def head(self) -> str | None:
        """Whose turn it is among the namespaces waiting; None when none waits."""
        return self.turn(min(self.queue)) if self.queue else None

    def waiters(self, namespace: str) -> list[str]:
        return sorted(u for u, p in self.pods.items() if p.waiting and p.namespace == namespace)

    def grant(self, uid: str, namespace: str, node: str, wants: Mapping[str, str]) -> None:
        """Pod `uid` got the slot and asked for `wants` (GPU UUID -> mode) on `node`."""
        self.seq += 1
        self.served[namespace] = self.seq
        for uuid, target in wants.items():
            self.asks[uuid] = Ask(node, target, {uid})
        rec = self.pods.setdefault(uid, PodAsks(namespace))
        rec.owns = rec.owns | frozenset(wants)
        self.stop_waiting(uid)

    def wait(self, uid: str, namespace: str, needs: Mapping[str, str]) -> None:
        """Pod `uid` was refused the slot (busy, or another namespace's turn): it queues, and
        it needs the asks in flight for the same change on its GPUs (`needs`, UUID -> mode)."""
        shared = {u for u, t in needs.items() if (a := self.asks.get(u)) and a.target == t}
        self._queue(uid, namespace, shared)

    def under_way(self, uid: str, namespace: str) -> None:
        """Pod `uid` fits once the change under way is done (MigModeChangeUnderWay; one ask
        in the cluster at a time, so the ones in flight): it needs them, and it queues (if
        the change does not serve it after all, it wants the slot next)."""
        self._queue(uid, namespace, set(self.asks))

    def _queue(self, uid: str, namespace: str, needs: set[str]) -> None:
        rec = self.pods.setdefault(uid, PodAsks(namespace))
        for uuid in needs:
            self.asks[uuid].owners.add(uid)
        rec.owns = rec.owns | needs
        rec.waiting = True
        if namespace not in self.queue:
            self.seq += 1
            self.queue[namespace] = self.seq

    def stop_waiting(self, uid: str) -> bool:
        """Pod `uid` no longer waits for the slot (it keeps the asks it needs); True when its
        namespace left the queue with it (the turn may have moved on)."""
        rec = self.pods.get(uid)
        if rec is None or not rec.waiting:
            return False
        rec.waiting = False
        if self.waiters(rec.namespace):
            return False
        self.queue.pop(rec.namespace, None)
        return True

    def release(self, uid: str) -> dict[str, set[str]]:
        """Pod `uid` was placed, or left: it needs nothing any more. The asks now needed by
        no pod, node -> GPU UUIDs (removed here; the caller withdraws them)."""
        self.stop_waiting(uid)
        rec = self.pods.pop(uid, None)
        out: dict[str, set[str]] = {}
        for uuid in sorted(rec.owns if rec is not None else ()):
            ask = self.asks.get(uuid)
            if ask is None:
                continue
            ask.owners.discard(uid)
            if not ask.owners:
                del self.asks[uuid]
                out.setdefault(ask.node, set()).add(uuid)
        return out

    def done(self, uuids: Iterable[str]) -> None:
        """These asks were withdrawn (reached, failed): no longer this term's to withdraw."""
        for uuid in uuids:
            self.asks.pop(uuid, None)

    def held_until(self, last: tuple[str, float] | None, target: str) -> float | None:
        """When a change to `target` may be asked on a GPU whose last change was `last`
        (mode reached, wall time): None when at once (no interval, no change known, or the
        last one went the same way)."""
        if last is None or last[0] == target or self.min_interval_s <= 0:
            return None
        return last[1] + self.min_interval_s

    def hold(self, until: float) -> None:
        self.wake = until if self.wake is None else min(self.wake, until)
        self.holds += 1

    def clear(self) -> None:
        """A new leadership term: the asks written before are no longer ours to withdraw."""
        self.asks.clear()
        self.pods.clear()
        self.queue.clear()
        self.wake = None


@dataclass(eq=False)
class Ampere:
    """The placer's side of the Ampere maintenance: asks a MIG mode change for a pod that
    needs one (one in the cluster at a time, round the namespaces, opposite changes on one
    GPU spaced), and withdraws the asks no parked pod needs any more. Off (`on` False)
    unless the controller wires `ask_modes` and `withdraw_modes` (`--ampere-mode-changes`)."""

    state: ClusterState
    retry: Callable[[str], None]  # unpark pod `uid` and look at it again
    # (node, {GPU UUID: mode}) → the MigNode's desiredMigMode is written in the background
    ask_modes: Callable[[str, dict[str, str]], None] | None = None
    # ... and withdrawn (node, GPU UUIDs); the record of the asks, and the wall clock their
    # minimum interval is measured on
    withdraw_modes: Callable[[str, set[str]], None] | None = None
    asks: AskBook = field(default_factory=AskBook)
    wall: Callable[[], float] = time.time

    @property
    def on(self) -> bool:
        return self.ask_modes is not None

    def decided(self, uid: str, namespace: str | None, told: str | None) -> None:
        """The placer decided for pod `uid` (of `namespace`, None when gone): `told` is the
        pending reason it was parked with, None when placed, preempting or not placeable."""
        if told == PendingReason.MIG_MODE_CHANGE_UNDER_WAY.value and namespace is not None:
            self.asks.under_way(uid, namespace)  # it needs the ask in flight
        elif uid not in self.asks.pods:
            return
        elif told is None:
            self.release(uid)  # placed, preempting, or not ours to place any more
        elif told != PendingReason.NEEDS_MIG_MODE_CHANGE.value:
            self._stop_waiting(uid)  # pending for another reason; its asks still needed

    def ask(
        self,
        uid: str,
        namespace: str,
        snapshot: Snapshot,
        request: PodRequest,
        resets: tuple[tuple[str, int], ...],
        pending: Pending,
    ) -> Pending:
        """Ask for the MIG mode change the pod needs on Ampere GPUs, `resets` (its plan's;
        one ask in the cluster at a time, round the namespaces, opposite changes on one GPU
        spaced); the pod waits NeedsMigModeChange."""
        assert self.ask_modes is not None
        target = "disabled" if is_whole(request) else "enabled"  # whole GPUs need MIG off
        gpus = [(n, g) for n, i in resets if (g := self.state.gpu(n, i)) is not None]
        if names := self.under_way(snapshot):
            self.asks.wait(uid, namespace, {g.uuid: target for _, g in gpus})
            return Pending(
                pending.reason,
                f"it fits only after a MIG mode change (a GPU reset); one is under way on "
                f"{names} (Ampere maintenance), asked again once it is done",
            )
        if not resets:
            self._stop_waiting(uid)
            return pending
        node = resets[0][0]
        wants = {g.uuid: target for n, g in gpus if n == node}
        names = ", ".join(f"{node}/GPU {i}" for _, i in resets)
        held = [u for n, g in gpus if (u := self.asks.held_until(g.last_change, target))]
        if held and (until := max(held)) > self.wall():
            self._stop_waiting(uid)
            self.asks.hold(until)
            return Pending(
                pending.reason,
                f"it fits only after a MIG mode change on {names}, whose last change went the "
                f"other way less than {self.asks.min_interval_s:g} s ago "
                "(--ampere-mode-change-interval); asked once that has passed (Ampere "
                "maintenance)",
            )
        turn = self.asks.turn(namespace)
        if turn != namespace:
            self.asks.wait(uid, namespace, wants)
            self._kick_waiters(turn)
            return Pending(
                pending.reason,
                f"it fits only after a MIG mode change on {names}; the one change at a time "
                f"goes round the namespaces waiting for one, and namespace {turn} is next "
                "(Ampere maintenance)",
            )
        self.ask_modes(node, wants)
        self.asks.grant(uid, namespace, node, wants)
        log.info("MIG mode change asked (Ampere maintenance)", node=node, gpus=sorted(wants))
        return Pending(
            pending.reason,
            f"it fits only after a MIG mode change on {names}: asked for (Ampere maintenance: "
            "the node agent drains the GPU, pauses the GPU Operator's clients, resets it); "
            "the pod is placed once it is done",
        )

    def turn_off(self, node: str, gpus: Iterable[tuple[str, int]]) -> None:
        """A preemption plan reserved whole GPUs whose MIG mode goes off only by a reset:
        asked with the plan (the agent drains, the victims go, it resets)."""
        if self.ask_modes is not None:
            wants = {g.uuid: "disabled" for n, i in gpus if (g := self.state.gpu(n, i))}
            self.ask_modes(node, wants)

    def held_back(self, node: str, index: int) -> bool:
        """A whole-GPU plan may not turn MIG off on this Ampere GPU yet (its last change, to
        MIG on, was less than the interval ago); the controller looks again when it may."""
        g = self.state.gpu(node, index)
        if g is None or g.whole_if_idle != "reset":
            return False
        until = self.asks.held_until(g.last_change, "disabled")
        if until is None or until <= self.wall():
            return False
        self.asks.hold(until)
        return True

    def release(self, uid: str) -> None:
        """Pod `uid` was placed or left: the asks it alone needed are withdrawn, unless the
        agent is already resetting the GPU (that change completes and is withdrawn then)."""
        if uid not in self.asks.pods:
            return
        orphans = self.asks.release(uid)
        self._turn_moved()
        for node, uuids in orphans.items():
            views = {g.uuid: g for g in self.state.gpus.get(node, ())}
            stop = {u for u in uuids if (g := views.get(u)) is None or g.phase != "Resetting"}
            if stop and self.withdraw_modes is not None:
                log.info(
                    "MIG mode change no longer needed; withdrawn", node=node, gpus=sorted(stop)
                )
                self.withdraw_modes(node, stop)

    def _stop_waiting(self, uid: str) -> None:
        if self.asks.stop_waiting(uid):
            self._turn_moved()

    def _turn_moved(self) -> None:
        """A namespace stopped waiting for the slot: with the slot free, the next one's pods
        are looked at again (they may have been turned away for its turn)."""
        head = self.asks.head()
        if head is not None and not in_flight(self.state.gpus):
            self._kick_waiters(head)

    def _kick_waiters(self, namespace: str) -> None:
        for uid in self.asks.waiters(namespace):
            self.retry(uid)

    def under_way(self, snapshot: Snapshot) -> str:
        """The GPUs with an Ampere MIG mode change in flight on nodes in `snapshot` (one at a
        time in the cluster; an ask on a node that is down waits), named for a message
        ("node/GPU i, ..."); "" when there is none."""
        placeable = {n.name for n in snapshot.nodes}
        busy = [(n, g) for n, g in in_flight(self.state.gpus) if n in placeable]
        return ", ".join(f"{n}/GPU {g.index}" for n, g in busy[:4])
