"""Autoscaler signal, the shell: raise a signal for pods no node can serve, withdraw it after.

The placer calls `pending(pod, request, result)` for each pod it parks and `placed(uid)` for
each it decides; this keeps one verdict per pod (`autoscale.classify`) and, while leading, a
loop every `interval_s` makes the signal objects in the cluster match:

- a pod whose verdict is *needs a node* for `delay_s` (burst arrivals settle first) gets one
  signal: a placeholder pod (Karpenter) or a PodTemplate + ProvisioningRequest
  (cluster-autoscaler), and a `ScaleUpRequested` event;
- a signal whose pod is gone, no longer gated, decided, or now classified *waits* is deleted
  (owner references also take it away with a deleted pod).

What the autoscaler answers comes back as a pod event: Karpenter's `FailedScheduling` on a
placeholder (no instance type offers it, the NodePool's limits) and a ProvisioningRequest's
`Failed`, `BookingExpired` or `CapacityRevoked` condition become `ScaleUpFailed` on the real
pod; `Provisioned` becomes `ScaleUpProvisioned`. Each is told once per message.

Verdicts live only for the term (a new leader re-parks every pod within a pass) and signals
of pods that are still gated are kept across terms, so a leader change does not flap them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import structlog

from common.catalog import Catalog
from common.clock import Clock, cancel_until_done, wait_or_sleep
from common.constants import GATE_NAME, SCALE_UP_LABEL
from common.kubeapi import ApiError, Informer, Kube, Obj, core_path, group_path, lean
from common.placement import Pending, PodRequest, Policy
from webhook.allocator.autoscale import (
    HOSTNAME_LABEL,
    PROVREQ_API_VERSION,
    REASON_FAILED,
    REASON_PROVISIONED,
    REASON_REQUESTED,
    ScaleUpSettings,
    SignalMode,
    after_releases,
    classify,
    condition,
    placeholder_pod,
    provisioning_request,
    releasing,
    signal_name,
)
from webhook.allocator.leader import LeaderElector, NotLeader
from webhook.allocator.state import ClusterState
from webhook.allocator.views import PodView

log = structlog.get_logger("allocator")

Tell = Callable[[Obj, str, str, Literal["Normal", "Warning"]], None]
_PROVREQ_FAILURES = ("Failed", "BookingExpired", "CapacityRevoked")
LOST_BACKOFF_S = 30.0


@dataclass
class Need:
    since: float  # monotonic: when it was first found to need a node (or may ask again)
    request: PodRequest
    why: str
    lost: int = 0  # signals of it deleted by someone else (a placeholder preempted)


@dataclass(eq=False)
class ScaleUp:
    kube: Kube
    elector: LeaderElector
    state: ClusterState
    settings: ScaleUpSettings
    policy: Policy
    catalog: Catalog
    clock: Clock
    tell: Tell
    needs: dict[str, Need] = field(default_factory=dict)  # pod uid → since when
    waits: set[str] = field(default_factory=set)  # classified: no new node needed
    told: dict[tuple[str, str], str] = field(default_factory=dict)  # (uid, reason) → message
    signals: dict[str, Obj] = field(default_factory=dict)  # pod uid → its signal object
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def on(self) -> bool:
        return self.settings.mode is not SignalMode.OFF

    # --- called by the placer (synchronous, pure bookkeeping) -------------------------------

    def pending(self, pod: PodView, request: PodRequest, result: Pending, name_label: bool) -> None:
        if not self.on:
            return
        live = {uid: not p.terminal for uid, p in self.state.pods.items()}
        freed = releasing(self.state.allocations.values(), live)
        snapshot = after_releases(self.state.snapshot(name_label=name_label), freed)
        verdict = classify(request, result, snapshot, self.policy, self.catalog)
        if verdict.needs_node:
            self.waits.discard(pod.uid)
            if pod.uid not in self.needs:
                self.needs[pod.uid] = Need(self.clock.monotonic(), request, verdict.why)
                self._wake.set()
        else:
            self.needs.pop(pod.uid, None)
            self.waits.add(pod.uid)

    def lost(self, uid: str) -> None:
        """A signal went that we did not withdraw: the kube-scheduler preempted a placeholder
        for a real pod pinned where it stood (its node is full). Raised again at once, it
        would take that room back before the real pod binds (seen: the pinned pod timed out
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

    async def run(self) -> None:
        if not self.on:
            return
        informers = self._informers()
        tasks = [asyncio.create_task(i.run(), name=f"informer-{i.name}") for i in informers]
        try:
            for i in informers:
                await i.synced.wait()
            while True:
                try:
                    await self.reconcile()
                except NotLeader:
                    pass  # lost for good: the term is about to end; else next round
                except Exception:  # a bug here must not end the allocator's term
                    log.exception("scale-up signal round failed")
                await wait_or_sleep(self.clock, self._wake, self.settings.interval_s)
                self._wake.clear()
        finally:
            await cancel_until_done(tasks)
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
                    transform=lean,
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
        withdraw = {
            uid
            for uid in self.signals
            if uid not in self.needs and (uid in self.waits or not self._still_gated(uid))
        }
        return raise_, withdraw

    def _still_gated(self, uid: str) -> bool:
        pod = self.state.pods.get(uid)
        return (
            pod is not None
            and pod.gates == (GATE_NAME,)
            and not pod.deleting
            and not self.state.allocations_of(uid)
        )

    async def reconcile(self) -> None:
        raise_, withdraw = self.wanted(self.clock.monotonic())
        for uid in sorted(withdraw):
            try:
                await self._withdraw(uid)
            except ApiError as exc:  # the others go on; this one is tried next round
                log.warning("scale-up signal delete failed", pod_uid=uid, error=str(exc))
        if raise_:
            # Karpenter's nodes are named apart from their hostname label (the NodeClaim's)
            avoid = sorted(n.labels.get(HOSTNAME_LABEL, n.name) for n in self.state.node_states())
            for uid in sorted(raise_):
                try:
                    await self._raise(uid, avoid)
                except ApiError as exc:
                    log.warning("scale-up signal write failed", pod_uid=uid, error=str(exc))

    async def _raise(self, uid: str, avoid: list[str]) -> None:
        pod = self.state.pods.get(uid)
        need = self.needs.get(uid)
        if pod is None or need is None:
            return
        ns = pod.namespace
        self.elector.check()
        try:
            if self.settings.mode is SignalMode.PLACEHOLDER:
                # Karpenter refuses a pod naming kubernetes.io/hostname ("might interfere
                # with the internal provisioning logic"): no NotIn list for it (measured)
                body = placeholder_pod(pod.obj, need.request, [], self.settings.image)
                kept_off = ""
                made = await self.kube.create(core_path("pods", ns), body)
                what = f"placeholder pod {body['metadata']['name']} for Karpenter"
            else:
                template, provreq = provisioning_request(
                    pod.obj,
                    need.request,
                    avoid,
                    self.settings.provisioning_class,
                    self.settings.image,
                )
                await self.kube.create(core_path("podtemplates", ns), template)
                made = await self.kube.create(
                    group_path(PROVREQ_API_VERSION, "provisioningrequests", ns), provreq
                )
                what = f"ProvisioningRequest {provreq['metadata']['name']}"
                kept_off = f" (kept off the {len(avoid)} node(s) that cannot serve it)"
        except ApiError as exc:
            if exc.status != 409:
                raise
            return  # raced with ourselves (or a previous term's): the watch shows it
        self.signals[uid] = made
        log.info("scale-up requested", pod=pod.key, signal=what, why=need.why)
        self.tell(
            pod.obj,
            REASON_REQUESTED,
            f"asked the cluster autoscaler for a new node: {need.why}; {what}{kept_off}",
            "Normal",
        )

    async def _withdraw(self, uid: str) -> None:
        obj = self.signals.get(uid)
        if obj is None:
            return
        ns = obj["metadata"]["namespace"]
        name = signal_name(uid)
        self.elector.check()
        if self.settings.mode is SignalMode.PLACEHOLDER:
            await self.kube.delete_ignore_missing(core_path("pods", ns, name), gracePeriodSeconds=0)
        else:
            path = group_path(PROVREQ_API_VERSION, "provisioningrequests", ns, name)
            await self.kube.delete_ignore_missing(path)
            await self.kube.delete_ignore_missing(core_path("podtemplates", ns, name))
        self.signals.pop(uid, None)
        for key in [k for k in self.told if k[0] == uid]:
            del self.told[key]
        log.info("scale-up withdrawn", pod_uid=uid, signal=name)

    # --- what the autoscaler answers --------------------------------------------------------

    async def _on_signal(self, etype: str, obj: Obj) -> None:
        uid = ((obj.get("metadata") or {}).get("labels") or {}).get(SCALE_UP_LABEL, "")
        if not uid:
            return
        if etype == "DELETED":
            if self.signals.pop(uid, None) is not None:
                self.lost(uid)
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

    def _tell_once(
        self, uid: str, reason: str, message: str, type_: Literal["Normal", "Warning"]
    ) -> None:
        if self.told.get((uid, reason)) == message:
            return
        pod = self.state.pods.get(uid)
        if pod is None:
            return
        self.told[(uid, reason)] = message
        log.info("scale-up answer", pod=pod.key, reason=reason, message=message)
        self.tell(pod.obj, reason, message, type_)
