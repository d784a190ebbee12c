"""Autoscaler signal, the shell: raise a signal for pods no node can serve, withdraw it after.

The placer calls `pending(pod, request, result)` for each pod it parks and `placed(uid)` for
each it decides; this keeps one verdict per pod (`autoscale.classify`) and, while leading, a
loop every `interval_s` makes the signal objects in the cluster match:

- a pod whose verdict is *needs a node* for `delay_s` (burst arrivals settle first) gets one
  signal: a placeholder pod (Karpenter) or a PodTemplate + ProvisioningRequest
  (cluster-autoscaler), and a `ScaleUpRequested` event;
- a signal whose pod is gone, no longer gated, decided, or now classified *waits* is deleted
  (owner references also take it away with a deleted pod);
- a placeholder the kube-scheduler bound to a node that cannot serve its pod
  (`autoscale.misplaced`: raised before the node filled, or before its agent labelled it) is
  replaced at once by one kept off that node too (the affinity is immutable), unless
  `make_room` withdrew it meanwhile (its `lost` wait then holds, as for any).

What the autoscaler answers comes back as a pod event: Karpenter's `FailedScheduling` on a
placeholder (no instance type offers it, the NodePool's limits) and a ProvisioningRequest's
`Failed`, `BookingExpired` or `CapacityRevoked` condition become `ScaleUpFailed` on the real
pod; `Provisioned` becomes `ScaleUpProvisioned`. Each is told once per message.

A signal held from our own create's answer (or a read) may be ahead of the watch: until the
watch shows that object, an event of another object of the same name (a replaced
placeholder's late MODIFIED or DELETED) is older and changes nothing. Watch order tells it,
not the resourceVersions, which are opaque (Kubernetes API conventions: compared for
equality, never ordered).

Verdicts live only for the term (a new leader re-parks every pod within a pass) and signals
of pods that are still gated are kept across terms, so a leader change does not flap them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from dataclasses import dataclass, field

import structlog

from common.catalog import Catalog
from common.clock import Clock, cancel_until_done, wait_or_sleep
from common.constants import SCALE_UP_LABEL, EventReason
from common.kubeapi import ApiError, Informer, Kube, Obj, core_path, group_path
from common.placeholders import signal_name, stands_for
from common.placement import Pending, PodRequest, Policy
from webhook.allocator.autoscale import (
    PROVREQ_API_VERSION,
    REASON_FAILED,
    REASON_PROVISIONED,
    ScaleUpSettings,
    SignalMode,
    Verdict,
    after_releases,
    classify,
    condition,
    misplaced,
    placeholder_identity,
    releasing,
)
from webhook.allocator.leader import NotLeader
from webhook.allocator.signals import Signals, _uid
from webhook.allocator.state import ClusterState
from webhook.allocator.track import placeable
from webhook.allocator.views import PodView
from webhook.allocator.writes import EventType_, Tell, Writes

log = structlog.get_logger("allocator")

_PROVREQ_FAILURES = ("Failed", "BookingExpired", "CapacityRevoked")
LOST_BACKOFF_S = 30.0


@dataclass
class Need:
    since: float  # monotonic: when it was first found to need a node (or may ask again)
    request: PodRequest
    why: str
    lost: int = 0  # signals of it deleted by someone else (a placeholder preempted)
    # nodes its placeholders were bound to though it cannot go there (`misplaced`): the
    # scheduler found room there, so its next ones list them whatever `kept_off` reads
    misplaced_on: set[str] = field(default_factory=set)


@dataclass(eq=False)
class ScaleUp(Signals):
    kube: Kube  # its informers' (reads only)
    writes: Writes  # every write, Lease-checked: the controller's one Writes
    state: ClusterState
    settings: ScaleUpSettings
    policy: Policy
    catalog: Catalog
    clock: Clock
    tell: Tell
    needs: dict[str, Need] = field(default_factory=dict)  # pod uid → since when
    waits: set[str] = field(default_factory=set)  # classified: no new node needed
    told: dict[tuple[str, EventReason], str] = field(
        default_factory=dict
    )  # (uid, reason) → message
    signals: dict[str, Obj] = field(default_factory=dict)  # pod uid → its signal object
    # set once this term's watches have listed the signals (`listed`)
    synced: asyncio.Event = field(default_factory=asyncio.Event)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _withdrawing: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    _raising: dict[str, asyncio.Event] = field(default_factory=dict)  # creates in flight
    rounds: int = 0  # reconcile rounds ended, failed ones too (a test's proof of a chance)
    # pods whose signal we hold from our own create's answer (or a read), which the watch
    # has not shown yet: until it does, another object of that name it shows is older
    _unechoed: set[str] = field(default_factory=set)

    # --- called by the placer (synchronous, pure bookkeeping) -------------------------------

    def pending(self, pod: PodView, request: PodRequest, result: Pending, name_label: bool) -> None:
        if not self.on:
            return
        if name_label:  # its affinity names nodes (matchFields metadata.name): a new one,
            # named by its provisioner, never matches; a placeholder copying the names would
            # bind where the pod cannot go and be replaced every round
            verdict = Verdict(False, "its affinity names its nodes: no new node can match")
        else:
            snapshot = after_releases(self.state.snapshot(), self._freed())
            wholes = self.state.whole_view
            verdict = classify(request, result, snapshot, self.policy, self.catalog, wholes)
        if verdict.needs_node:
            self.waits.discard(pod.uid)
            if pod.uid not in self.needs:
                self.needs[pod.uid] = Need(self.clock.monotonic(), request, verdict.why)
                self._wake.set()
        else:
            self.needs.pop(pod.uid, None)
            self.waits.add(pod.uid)

    def _freed(self) -> dict[str, set[tuple[int, int, int]]]:
        live = {uid: not p.terminal for uid, p in self.state.pods.items()}
        return releasing(self.state.allocations.values(), live)

    def lost(self, uid: str) -> None:
        """A still-wanted signal went: `make_room` withdrew a placeholder standing where a
        real pod is pinned, or someone else deleted it. Raised again at once, it would take
        that room back before the real pod binds (seen: the pinned pod timed out
        unschedulable); so it waits, LOST_BACKOFF_S doubling per loss."""
        need = self.needs.get(uid)
        if need is not None:
            need.lost += 1
            wait = min(LOST_BACKOFF_S * 2 ** (need.lost - 1), 600.0)
            need.since = self.clock.monotonic() + wait

    def placed(self, uid: str) -> None:
        if self.needs.pop(uid, None) is not None or uid in self.signals:
            self._wake.set()
        self.waits.discard(uid)

    # --- the loop (leading) -----------------------------------------------------------------

    async def listed(self) -> None:
        """Return once this term's watches (`run`) have listed the signals. The controller
        starts the term's workers only then, so a pin's `make_room` reads the signals as
        listed and never waits for them itself."""
        if self.on:
            await self.synced.wait()

    async def run(self) -> None:
        if not self.on:
            return
        informers = self._informers()
        tasks = [asyncio.create_task(i.run(), name=f"informer-{i.name}") for i in informers]
        try:
            for i in informers:
                await i.synced.wait()
            self.synced.set()
            while True:
                try:
                    await self.reconcile()
                except NotLeader:
                    pass  # lost for good: the term is about to end; else next round
                except Exception:  # a bug here must not end the allocator's term
                    log.exception("scale-up signal round failed")
                self.rounds += 1
                await wait_or_sleep(self.clock, self._wake, self.settings.interval_s)
                self._wake.clear()
        finally:
            self.synced.clear()
            # a delete of a term that ended is not sent (its leader check ran before)
            await cancel_until_done([*tasks, *self._withdrawing.values()])
            self.needs.clear()
            self.waits.clear()

    def _informers(self) -> list[Informer]:
        selector = SCALE_UP_LABEL
        if self.settings.mode is SignalMode.PLACEHOLDER:
            return [
                Informer(
                    self.kube,
                    core_path("pods"),
                    self._on_signal,
                    label_selector=selector,
                    name="placeholders",
                    transform=placeholder_identity,
                ),
                Informer(
                    self.kube,
                    core_path("events"),
                    self._on_karpenter_event,
                    field_selector="source=karpenter,involvedObject.kind=Pod",
                    name="karpenter-events",
                ),
            ]
        return [
            Informer(
                self.kube,
                group_path(PROVREQ_API_VERSION, "provisioningrequests"),
                self._on_signal,
                label_selector=selector,
                name="provisioningrequests",
            )
        ]

    def wanted(self, now: float) -> tuple[set[str], set[str]]:
        """(pods to raise a signal for, pods whose signal goes). Drops needs of pods that
        are gone, ungated or decided."""
        for uid in list(self.needs):
            if not self._still_gated(uid):
                del self.needs[uid]
        raise_ = {
            uid
            for uid, n in self.needs.items()
            if now - n.since >= self.settings.delay_s and uid not in self.signals
        }
        withdraw = {uid for uid in self.signals if self._goes(uid)}
        return raise_, withdraw

    def misplaced(self) -> dict[str, str]:
        """Pod uid → node, for each placeholder bound to a node that cannot serve its pod
        (`autoscale.misplaced` on the node's current state), whose pod still needs a node
        and is not being withdrawn."""
        bound = {
            uid: node
            for uid, obj in self.signals.items()
            if (node := (obj.get("spec") or {}).get("nodeName"))
            and uid in self.needs
            and uid not in self._withdrawing
        }
        if not bound:
            return {}
        nodes = {n.name: n for n in self.state.snapshot().nodes}
        freed = self._freed()
        return {
            uid: node
            for uid, node in bound.items()
            if misplaced(
                nodes.get(node),
                self.needs[uid].request,
                freed.get(node, ()),
                self.policy,
                self.catalog,
                self.state.mode_view,
                self.state.whole_view,
            )
        }

    def _goes(self, uid: str) -> bool:
        """`uid`'s signal is no longer wanted: its pod is decided, gone, ungated or waits."""
        return uid not in self.needs and (uid in self.waits or not self._still_gated(uid))

    def _still_gated(self, uid: str) -> bool:
        pod = self.state.pods.get(uid)
        return pod is not None and placeable(pod) and not self.state.allocations_of(uid)

    async def reconcile(self) -> None:
        now = self.clock.monotonic()
        raise_, withdraw = self.wanted(now)
        replace = self.misplaced() if self.settings.mode is SignalMode.PLACEHOLDER else {}
        for uid in sorted(withdraw | set(replace)):
            if uid in replace:
                log.info("scale-up placeholder stands where its pod cannot go; replacing it",
                         pod_uid=uid, node=replace[uid])  # fmt: skip
            try:
                await self._withdraw(uid)
            except ApiError as exc:  # the others go on; this one is tried next round
                log.warning("scale-up signal delete failed", pod_uid=uid, error=str(exc))
        # at once, unless make_room withdrew it meanwhile and its lost wait holds
        replaced = {
            uid
            for uid in replace
            if uid not in self.signals and uid in self.needs and self.needs[uid].since <= now
        }
        for uid, node in replace.items():
            if uid in self.needs:
                self.needs[uid].misplaced_on.add(node)
        if raise_ or replaced:
            keep_off: dict[Hashable, list[str]] = {}  # per round, by the pods' selection
            for uid in sorted(raise_ | replaced):
                note = f"; replaces the one bound to {replace[uid]}" if uid in replaced else ""
                try:
                    await self._raise(uid, note, keep_off)
                except ApiError as exc:
                    log.warning("scale-up signal write failed", pod_uid=uid, error=str(exc))

    # --- what the autoscaler answers --------------------------------------------------------

    async def _on_signal(self, etype: str, obj: Obj) -> None:
        uid = stands_for(obj)
        if uid is None:  # the label alone is no signal of ours: anyone may write it
            return
        held = self.signals.get(uid)
        if held is not None and uid in self._unechoed:
            if _uid(obj) != _uid(held):
                return  # a replaced placeholder's late event: our create answered first
            self._unechoed.discard(uid)  # the watch has caught up with our own write
        if etype == "DELETED":
            self._unechoed.discard(uid)
            if self.signals.pop(uid, None) is not None and uid not in self._withdrawing:
                self.lost(uid)  # not our own delete, whose answer is still to come
            return
        if held is None and (obj.get("metadata") or {}).get("deletionTimestamp"):
            # the echo of a delete of ours that has already answered (the signal forgotten):
            # held again, the round's replacement would wait for it, and its DELETED would
            # count as lost (LOST_BACKOFF_S before the pod asks again)
            return
        self.signals[uid] = obj
        if obj.get("kind") == "ProvisioningRequest" or ("spec" in obj and "podSets" in obj["spec"]):
            for type_ in _PROVREQ_FAILURES:
                c = condition(obj, type_)
                if c is not None:
                    self._tell_once(
                        uid,
                        REASON_FAILED,
                        f"ProvisioningRequest {type_}: "
                        f"{c.get('reason', '')}: {c.get('message', '')}",
                        "Warning",
                    )
            c = condition(obj, "Provisioned")
            if c is not None:
                self._tell_once(
                    uid,
                    REASON_PROVISIONED,
                    f"ProvisioningRequest Provisioned: {c.get('message', '')}",
                    "Normal",
                )

    async def _on_karpenter_event(self, etype: str, obj: Obj) -> None:
        if etype == "DELETED":
            return
        involved = obj.get("involvedObject") or {}
        name = str(involved.get("name") or "")
        prefix = signal_name("")
        if not name.startswith(prefix):
            return
        uid = name[len(prefix) :]
        reason = str(obj.get("reason") or "")
        if reason == "FailedScheduling":
            self._tell_once(uid, REASON_FAILED, f"Karpenter: {obj.get('message', '')}", "Warning")

    def _tell_once(self, uid: str, reason: EventReason, message: str, type_: EventType_) -> None:
        if self.told.get((uid, reason)) == message:
            return
        pod = self.state.pods.get(uid)
        if pod is None:
            return
        self.told[(uid, reason)] = message
        log.info("scale-up answer", pod=pod.key, reason=reason, message=message)
        self.tell(pod.obj, reason, message, type_)
