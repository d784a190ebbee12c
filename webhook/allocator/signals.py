"""Autoscaler signal, the objects: raise a signal, withdraw it, and make room for a pin.

A part of `ScaleUp` (scaleup.py), which keeps the verdicts and runs the round: here the
signal objects themselves — a placeholder pod (Karpenter) or a PodTemplate +
ProvisioningRequest (cluster-autoscaler), kept off the nodes that cannot serve the pod
(`_avoid`) — raised and withdrawn through `Writes` (each Lease-checked), with the deletes
of one signal shared by everyone waiting on it, and `make_room`, which withdraws the signals
in the way of a pin before it is written (docs/autoscaling.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import TYPE_CHECKING

import structlog

from common.constants import EventReason
from common.kubeapi import ApiError, Obj
from common.objects import node_label_value
from common.placeholders import signal_name, stands_for
from webhook.allocator.autoscale import (
    REASON_REQUESTED,
    ScaleUpSettings,
    SignalMode,
    hostname_value,
    kept_off,
    placeholder_identity,
    placeholder_pod,
    provisioning_request,
    selection,
)
from webhook.allocator.state import ClusterState
from webhook.allocator.writes import Tell, Writes

if TYPE_CHECKING:
    from webhook.allocator.scaleup import Need

log = structlog.get_logger("allocator")


class Signals:
    """The signal objects of `ScaleUp` (its tables, declared here)."""

    state: ClusterState
    settings: ScaleUpSettings
    tell: Tell
    writes: Writes
    needs: dict[str, Need]
    told: dict[tuple[str, EventReason], str]
    signals: dict[str, Obj]
    _withdrawing: dict[str, asyncio.Task[None]]
    _raising: dict[str, asyncio.Event]
    _unechoed: set[str]

    @property
    def on(self) -> bool:
        return self.settings.mode is not SignalMode.OFF

    def lost(self, uid: str) -> None:
        raise NotImplementedError  # ScaleUp's

    def _goes(self, uid: str) -> bool:
        raise NotImplementedError  # ScaleUp's

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
        answered. It reads the signals as this term's watches listed them: the controller
        starts the term's workers, and so its pins, only once they have (`ScaleUp.listed`;
        a new leader's first pins would otherwise see none). It waits for `uid`'s own
        create if one is in flight (answered after the pin, it would stand there). Only
        `uid`'s own delete must succeed; another's failure is logged (the round tries it
        again). A pod still waiting for a node whose placeholder went so asks again after
        `lost`'s wait, as if the scheduler had preempted it (at once, it would take the room
        back); pins to the node at the same time share the delete and count it once."""
        if not self.on:
            return
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
        bound = set()
        for obj in await self.writes.placeholders_on(node):
            other = stands_for(obj)
            if other is not None and other in self.signals:
                self.signals[other] = placeholder_identity(obj)  # bound, before the watch says
                self._unechoed.add(other)
                bound.add(other)
        return bound

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
        raising = self._raising[uid] = asyncio.Event()
        try:
            avoid = self._avoid(need, {} if keep_off is None else keep_off)
            if self.settings.mode is SignalMode.PLACEHOLDER:
                body = placeholder_pod(pod.obj, need.request, avoid, self.settings.image)
                made = await self.writes.raise_placeholder(body)
                what = f"placeholder pod {body['metadata']['name']} for Karpenter"
            else:
                template, provreq = provisioning_request(
                    pod.obj,
                    need.request,
                    avoid,
                    self.settings.provisioning_class,
                    self.settings.image,
                )
                made = await self.writes.raise_provisioning_request(template, provreq)
                what = f"ProvisioningRequest {provreq['metadata']['name']}"
        except ApiError as exc:
            if exc.status != 409:
                raise
            return  # raced with ourselves (or a previous term's): the watch shows it
        else:
            placeholder = self.settings.mode is SignalMode.PLACEHOLDER
            ours = placeholder_identity(made) if placeholder else made
            held = self.signals.get(uid)
            if held is None or _uid(held) != _uid(ours):
                self.signals[uid] = ours
                self._unechoed.add(uid)
            # else the watch showed our create before its answer came, maybe newer (bound
            # already): its view is kept, the answer is the object as we wrote it
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
        if self.settings.mode is SignalMode.PLACEHOLDER:
            await self.writes.withdraw_placeholder(ns, name)
        else:
            await self.writes.withdraw_provisioning_request(ns, name)
        self.signals.pop(uid, None)
        self._unechoed.discard(uid)
        for key in [k for k in self.told if k[0] == uid]:
            del self.told[key]
        log.info("scale-up withdrawn", pod_uid=uid, signal=name)


def _uid(obj: Obj) -> str:
    return str((obj.get("metadata") or {}).get("uid") or "")
