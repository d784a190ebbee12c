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

Verdicts live only for the term (a new leader re-parks every pod within a pass) and signals
of pods that are still gated are kept across terms, so a leader change does not flap them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Literal

import structlog

from common.catalog import Catalog
from common.clock import Clock, cancel_until_done, wait_or_sleep
from common.constants import GATE_NAME, SCALE_UP_LABEL, EventReason
from common.kubeapi import ApiError, Informer, Kube, Obj, core_path, group_path
from common.objects import node_label_value
from common.placeholders import signal_name, stands_for
from common.placement import Pending, PodRequest, Policy
from webhook.allocator.autoscale import (
    PROVREQ_API_VERSION,
    REASON_FAILED,
    REASON_PROVISIONED,
    REASON_REQUESTED,
    ScaleUpSettings,
    SignalMode,
    Verdict,
    after_releases,
    classify,
    condition,
    hostname_value,
    kept_off,
    misplaced,
    placeholder_identity,
    placeholder_pod,
    provisioning_request,
    releasing,
    selection,
)
from webhook.allocator.leader import LeaderElector, NotLeader
from webhook.allocator.state import ClusterState
from webhook.allocator.views import PodView

log = structlog.get_logger("allocator")

Tell = Callable[[Obj, EventReason, str, Literal["Normal", "Warning"]], None]
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
    # set once this term's watches have listed the signals (`make_room` waits for it)
    synced: asyncio.Event = field(default_factory=asyncio.Event)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _withdrawing: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    _raising: dict[str, asyncio.Event] = field(default_factory=dict)  # creates in flight
    rounds: int = 0  # reconcile rounds ended, failed ones too (a test's proof of a chance)

    @property
    def on(self) -> bool:
        return self.settings.mode is not SignalMode.OFF

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

    def in_the_way(self, uid: str, node: str) -> list[str]:
        """The signals to withdraw before pod `uid` is pinned to `node`: its own, every
        placeholder bound to `node`, also one whose pod still waits for a node (the pins
        fill the node's GPUs, and a placeholder asks for the same `instaslice.io/mig-*`
        upper bound), and every one no longer wanted wherever it stands (the scheduler may
        bind it to `node` before the round deletes it). One left there holds the pinned
        pod's room in the kube-scheduler's eyes: it preempts the placeholder, and its async
        preemption can leave the pod unschedulable until its 5-minute flush
        (kubernetes/kubernetes#141694: a redundant second preemption finds the victim gone,
        whether we deleted it meanwhile or the first preemption did and the scheduler's
        cache lagged; our timer deleted the pod first, seen in CI). Deleted first, the
        deletions reach the scheduler's pod watch before the pin does, and the scheduler
        never preempts."""
        return sorted(
            other
            for other, obj in self.signals.items()
            if other == uid or (obj.get("spec") or {}).get("nodeName") == node or self._goes(other)
        )

    async def make_room(self, uid: str, node: str) -> None:
        """Withdraw `in_the_way(uid, node)` before the pin, the deletes sent together and
        answered. It waits first for this term's watches to have listed the signals (a new
        leader's first pins would see none) and for `uid`'s own create if one is in flight
        (answered after the pin, it would stand there). Only `uid`'s own delete must
        succeed; another's failure is logged (the round tries it again). A pod still
        waiting for a node whose placeholder went so asks again after `lost`'s wait, as if
        the scheduler had preempted it (at once, it would take the room back); pins to the
        node at the same time share the delete and count it once."""
        if not self.on:
            return
        await self.synced.wait()
        raising = self._raising.get(uid)
        if raising is not None:
            await raising.wait()
        ways = self.in_the_way(uid, node)
        if any(
            not (o.get("spec") or {}).get("nodeName")
            for other, o in self.signals.items()
            if other not in ways  # own and unwanted ones go wherever they stand
        ):
            ways = sorted({*ways, *await self._bound_now(node)})
        wanted = {o for o in ways if o != uid and o not in self._withdrawing and not self._goes(o)}
        deletes = [asyncio.shield(self._withdrawal(o)) for o in ways]  # before another pin looks
        outcomes = await asyncio.gather(*deletes, return_exceptions=True)
        for other, outcome in zip(ways, outcomes, strict=True):
            if isinstance(outcome, ApiError) and other != uid:
                log.warning("scale-up signal delete failed", pod_uid=other, error=str(outcome))
            elif isinstance(outcome, BaseException):
                raise outcome
            elif other in wanted:
                self.lost(other)

    async def _bound_now(self, node: str) -> set[str]:
        """The placeholders the API server has bound to `node` by now, of pods we hold a
        signal for. Asked only while one that would stay is unbound as far as the watch told: the
        scheduler may have bound it to `node` in an event still on its way to a busy
        allocator, and there it holds the pin's room (`in_the_way`; seen with the event
        loop stalled under load, the pin written before the placeholder's delete)."""
        if self.settings.mode is not SignalMode.PLACEHOLDER:
            return set()
        found = await self.kube.list(
            core_path("pods"), labelSelector=SCALE_UP_LABEL, fieldSelector=f"spec.nodeName={node}"
        )
        bound = set()
        for obj in found.get("items") or []:
            other = stands_for(obj)
            if other is not None and other in self.signals:
                self.signals[other] = placeholder_identity(obj)  # bound, before the watch says
                bound.add(other)
        return bound

    def _still_gated(self, uid: str) -> bool:
        pod = self.state.pods.get(uid)
        return (
            pod is not None
            and pod.gates == (GATE_NAME,)
            and not pod.deleting
            and not self.state.allocations_of(uid)
        )

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

    def _avoid(self, need: Need, lists: dict[Hashable, list[str]]) -> list[str]:
        """The `NotIn` values of `need`'s signal: `kept_off`, the same list for every pod of
        one selection and requests in a round (a burst's pods share it), and the nodes its
        placeholders were misplaced on. Karpenter refuses a pod naming
        kubernetes.io/hostname ("might interfere with the internal provisioning logic",
        measured): placeholders name the agents' own label."""
        placeholder = self.settings.mode is SignalMode.PLACEHOLDER
        key = selection(need.request)
        if key not in lists and placeholder:
            # a placeholder bound where its pod cannot go is replaced (`misplaced`), so the
            # nodes whose room cannot take it now may be left out; not those whose agent is
            # down: `misplaced` leaves a placeholder there alone
            down = self.state.agents_down
            lists[key] = kept_off(
                self.state.node_states(),
                need.request,
                lambda node: None if node in down else self.state.room(node),
            )
        elif key not in lists:
            # nothing replaces a ProvisioningRequest the autoscaler found room for on an
            # existing node (`CapacityIsFound`: no node is made): name every such node
            lists[key] = kept_off(self.state.node_states(), need.request, value=hostname_value)
        if not placeholder or not need.misplaced_on:
            return lists[key]
        return sorted({*lists[key], *(node_label_value(n) for n in need.misplaced_on)})

    async def _raise(
        self, uid: str, note: str = "", keep_off: dict[Hashable, list[str]] | None = None
    ) -> None:
        pod = self.state.pods.get(uid)
        need = self.needs.get(uid)
        if pod is None or need is None:
            return
        ns = pod.namespace
        self.elector.check()
        raising = self._raising[uid] = asyncio.Event()
        try:
            avoid = self._avoid(need, {} if keep_off is None else keep_off)
            if self.settings.mode is SignalMode.PLACEHOLDER:
                body = placeholder_pod(pod.obj, need.request, avoid, self.settings.image)
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
        except ApiError as exc:
            if exc.status != 409:
                raise
            return  # raced with ourselves (or a previous term's): the watch shows it
        else:
            placeholder = self.settings.mode is SignalMode.PLACEHOLDER
            self.signals[uid] = placeholder_identity(made) if placeholder else made
        finally:
            raising.set()
            del self._raising[uid]
        log.info("scale-up requested", pod=pod.key, signal=what, why=need.why, kept_off=len(avoid))
        self.tell(
            pod.obj,
            REASON_REQUESTED,
            f"asked the cluster autoscaler for a new node: {need.why}; {what} "
            f"(kept off the {len(avoid)} node(s) that cannot serve it){note}",
            "Normal",
        )

    async def _withdraw(self, uid: str) -> None:
        """Delete `uid`'s signal; callers at the same time (pins to one node, the round)
        share one delete and all see its outcome."""
        await asyncio.shield(self._withdrawal(uid))

    def _withdrawal(self, uid: str) -> asyncio.Task[None]:
        """The delete of `uid`'s signal under way, started here if none is."""
        task = self._withdrawing.get(uid)
        if task is None:
            task = asyncio.create_task(self._delete_signal(uid), name=f"withdraw-{uid}")
            self._withdrawing[uid] = task
            task.add_done_callback(lambda _: self._withdrawing.pop(uid, None))
        return task

    async def _delete_signal(self, uid: str) -> None:
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
        uid = stands_for(obj)
        if uid is None:  # the label alone is no signal of ours: anyone may write it
            return
        held = self.signals.get(uid)
        if held is not None and _older(obj, held):
            return  # a replaced placeholder's late event: the replacement's create answered first
        if etype == "DELETED":
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

    def _tell_once(
        self, uid: str, reason: EventReason, message: str, type_: Literal["Normal", "Warning"]
    ) -> None:
        if self.told.get((uid, reason)) == message:
            return
        pod = self.state.pods.get(uid)
        if pod is None:
            return
        self.told[(uid, reason)] = message
        log.info("scale-up answer", pod=pod.key, reason=reason, message=message)
        self.tell(pod.obj, reason, message, type_)


def _older(event: Obj, held: Obj) -> bool:
    """`event`'s object is older than the signal `held`: another object of the same name
    (deleted and created again since) with a lower resourceVersion. The API server's are
    etcd revisions; one that is no number compares as not older."""
    e, h = event.get("metadata") or {}, held.get("metadata") or {}
    if e.get("uid") == h.get("uid"):
        return False
    try:
        return int(e.get("resourceVersion") or "") < int(h.get("resourceVersion") or "")
    except ValueError:
        return False
