"""Makes and releases the slices of the ResourceClaims allocated to this node (DRA mode).

One worker per claim UID (a KeyedQueue, as gate mode's allocations): it asks
`claims.decide` what to do and does it with gate mode's own steps (`Lifecycle`: the GPU's
NVML lane, MIG mode on demand, adopt-or-create per slice, CDI file, destroy CI then GI) and
records (`ClaimRecord` in the checkpoint, intent fsynced before NVML makes anything), so a
restart finishes or repeats what a crash interrupted and nothing is made twice. A placement
another record or a foreign instance holds is refused (`reconcile.blocked`), never carved over.

The kubelet's calls meet the workers here: `prepare` wakes the claim's worker and waits until
its slices are made (or it failed); `unprepare` releases them. Both are idempotent by claim
UID. Once made (after prepare was answered), the worker writes the claim's `status.devices`
entries of this pool (nodeagent/dra/status.py), and takes them out on a release. What it
does not do: write the allocation (the allocator's or the scheduler's), or tell pods (the
kubelet reports a failed prepare as a pod event).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import structlog

from common.allocation import drop_release_finalizer
from common.constants import RELEASE_FINALIZER
from common.kubeapi import ApiError, EventType, Kube, group_path
from common.workqueue import KeyedQueue
from nodeagent import cdi
from nodeagent.checkpoint import ClaimRecord
from nodeagent.create import CREATE_GI, NOT_OURS
from nodeagent.dra import status
from nodeagent.dra.claims import (
    ClaimView,
    Step,
    cdi_ids,
    decide,
    made,
    parse,
    slices_for,
    unreported,
)
from nodeagent.lifecycle import Lifecycle
from nodeagent.model import NvmlFailure
from nodeagent.reconcile import match

log = structlog.get_logger("dra.claims")
Obj = dict[str, Any]
RETRY_S = 5.0  # a failed carve or release is tried again after this long
API_RETRY_S = 1.0


def claim_path(namespace: str, name: str | None = None) -> str:
    return group_path("resource.k8s.io/v1", "resourceclaims", namespace, name)


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class PrepareFailed(Exception):
    """The claim's slices cannot be made here (the kubelet gets the message)."""


@dataclass(eq=False)
class DraClaims:
    life: Lifecycle
    kube: Kube
    clock_s: Callable[[], float] = time.monotonic
    views: dict[str, ClaimView] = field(default_factory=dict)
    unprepared: set[str] = field(default_factory=set)  # uids the kubelet let go of
    errors: dict[str, str] = field(default_factory=dict)  # uid -> why its carve failed
    synced: asyncio.Event = field(default_factory=asyncio.Event)
    _changed: dict[str, asyncio.Event] = field(default_factory=dict)
    queue: KeyedQueue = field(init=False)

    def __post_init__(self) -> None:
        self.queue = KeyedQueue(self.work, name=f"claims-{self.node}")

    @property
    def node(self) -> str:
        return self.life.st.node

    def live(self) -> set[str]:
        """Uids whose records garbage collection must leave alone (their claim lives here);
        before the first list, every record's."""
        if not self.synced.is_set():
            return set(self.life.st.cp.claims)
        return {uid for uid, v in self.views.items() if v.ours}

    # ---- informer -> workers ----------------------------------------------------------------

    def on_event(self, etype: EventType, obj: Obj) -> None:
        view = parse(obj, self.node)
        if etype == "DELETED":
            self.views.pop(view.uid, None)
            self.unprepared.discard(view.uid)
        elif view.ours or view.uid in self.views or view.uid in self.life.st.cp.claims:
            self.views[view.uid] = view
        else:
            return  # another node's claim, or not allocated: not ours to watch
        self.queue.kick(view.uid)

    def _tell(self, uid: str) -> None:
        ev = self._changed.pop(uid, None)
        if ev is not None:
            ev.set()

    # ---- the worker ---------------------------------------------------------------------------

    async def work(self, uid: str) -> float | None:
        st = self.life.st
        view = self.views.get(uid)
        step = decide(view, st.cp.claims.get(uid), st.boot_id, uid in self.unprepared)
        try:
            delay = None
            if step is Step.CARVE:
                assert view is not None
                delay = await self.carve(view)
            elif step is Step.RELEASE:
                delay = await self.release(uid, view)
            elif step is Step.DROP_FINALIZER:
                assert view is not None
                await self.drop_finalizer(view)
            elif (
                step is Step.NOTHING
                and view is not None
                and made(st.cp.claims.get(uid), st.boot_id)
            ):
                await self._cdi_in_place(st.cp.claims[uid])
            self._tell(uid)  # the kubelet's prepare waits for the slices, not the status
            if delay is None and unreported(view, st.cp.claims.get(uid), st.boot_id):
                assert view is not None
                await self.report(view)
            return delay
        except ApiError as exc:
            log.warning("api write failed; retrying", claim=uid, error=str(exc))
            return API_RETRY_S
        finally:
            self._tell(uid)

    async def report(self, view: ClaimView) -> None:
        """The claim's status.devices entries of this pool: the made slices', or none."""
        rec = self.life.st.cp.claims.get(view.uid)
        ours = (
            status.entries(self.node, rec, _now())
            if made(rec, self.life.st.boot_id) and rec is not None
            else []
        )
        if await status.write(self.kube, self.node, view.namespace, view.name, view.uid, ours):
            log.info("claim's device status written", claim=view.key, devices=len(ours))

    async def _cdi_in_place(self, rec: ClaimRecord) -> None:
        """A made claim's CDI file (an earlier process wrote it; rewritten if gone)."""
        life = self.life
        on_disk = await asyncio.to_thread(cdi.spec_uid, life.cdi_dir, rec.namespace, rec.name)
        if on_disk != rec.uid:
            await life.write_cdi(rec)

    async def carve(self, view: ClaimView) -> float | None:
        life, st = self.life, self.life.st
        t0 = self.clock_s()
        fresh = slices_for(view, st.inv)
        if isinstance(fresh, str):
            return self._failed(view, fresh)
        bad = [s.gpu_index for s in fresh if st.is_lost(s.gpu_index) or not st.healthy(s.gpu_index)]
        if bad:
            return self._failed(view, f"GPU {bad[0]} is unhealthy")
        written, _ = await life.intent(view, st.cp.claims.get(view.uid), fresh)  # before NVML
        if isinstance(written, str):  # a race with another allocator over the same slots
            return self._failed(view, written)
        rec = written
        why = await life.modes.ensure(view.uid, rec.slices)
        if why:
            await life.rollback(rec)
            return self._failed(view, why)
        own = match(st.cp, await life.instances({s.gpu_index for s in rec.slices}, first=True))
        slices = list(rec.slices)
        for i, s in enumerate(slices):
            try:
                slices[i] = await life.make_slice(s, own.found.get((view.uid, i)))
            except NvmlFailure as exc:
                life.note_nvml(exc, s.gpu_index)
                if exc.call == CREATE_GI:  # what sits there is not ours: never destroyed
                    slices[i] = replace(s, gi_id=NOT_OURS)
                st.put(replace(rec, slices=tuple(slices)))
                await life.rollback(st.cp.claims[view.uid])
                return self._failed(view, f"creating {s.container}: {exc}")
        rec = replace(rec, slices=tuple(slices))
        st.put(rec)
        try:
            await life.write_cdi(rec)
        except (cdi.CdiError, OSError) as exc:
            await life.rollback(rec)
            return self._failed(view, f"writing the CDI spec: {exc}")
        st.put(replace(rec, state="ready", updated=time.time()))
        await st.persist()
        st.publish.set()
        self.errors.pop(view.uid, None)
        ms = round((self.clock_s() - t0) * 1000, 1)
        log.info(
            "claim's slices made", claim=view.key, devices=[s.container for s in slices], ms=ms
        )
        return None

    def _failed(self, view: ClaimView, why: str) -> float:
        if self.errors.get(view.uid) != why:
            log.warning("claim's slices not made", claim=view.key, reason=why)
        self.errors[view.uid] = why
        return RETRY_S

    async def release(self, uid: str, view: ClaimView | None) -> float | None:
        rec = self.life.st.cp.claims[uid]
        try:
            done = await self.life.rollback(rec)  # destroy, CDI file, record
        except NvmlFailure as exc:
            log.warning("release failed; retrying", claim=rec.key, error=str(exc))
            return RETRY_S
        if not done:
            return RETRY_S
        self.errors.pop(uid, None)
        log.info("claim's slices released", claim=rec.key)
        if view is not None and view.deleting and view.has_finalizer:
            await self.drop_finalizer(view)
        return None

    async def drop_finalizer(self, view: ClaimView) -> None:
        """The claim is going and holds nothing here: its finalizer comes off (a JSON patch
        that tests the list it read, so another writer's change is not lost)."""
        path = claim_path(view.namespace, view.name)
        for _ in range(5):
            try:
                got = await self.kube.get(path)
            except ApiError as exc:
                if exc.not_found:
                    return
                raise
            if (got.get("metadata") or {}).get("uid") != view.uid:
                return
            current = list(got["metadata"].get("finalizers") or [])
            if RELEASE_FINALIZER not in current:
                return
            body = drop_release_finalizer(
                current, test_path="/metadata/finalizers", test_value=current
            )
            try:
                await self.kube.patch(path, body, kind="json")
                return
            except ApiError as exc:
                if exc.not_found:
                    return
                if exc.status not in (409, 422):
                    raise

    # ---- the kubelet's calls ------------------------------------------------------------------

    async def _wait(self, uid: str, done: Callable[[], bool], timeout_s: float) -> bool:
        async with asyncio.timeout(timeout_s):
            while not done():
                ev = self._changed.setdefault(uid, asyncio.Event())
                self.queue.kick(uid)
                await ev.wait()
        return True

    async def prepare(
        self, namespace: str, name: str, uid: str, timeout_s: float
    ) -> dict[str, str]:
        """device -> CDI id of the claim's slices, made (or adopted) by then; PrepareFailed
        when the claim is not allocated here, or its slices cannot be made."""
        self.unprepared.discard(uid)
        view = self.views.get(uid)
        if view is None or not view.ours:  # the kubelet may be ahead of our watch
            try:
                obj = await self.kube.get(claim_path(namespace, name))
            except ApiError as exc:
                raise PrepareFailed(f"reading claim {namespace}/{name}: {exc}") from None
            view = parse(obj, self.node)
            if view.uid != uid:
                raise PrepareFailed(f"claim {namespace}/{name} has uid {view.uid}, not {uid}")
            self.views[uid] = view
        if not view.ours:
            raise PrepareFailed(
                view.problem or f"claim {view.key} has no {self.node} device of this driver"
            )
        if not view.reserved:  # the kubelet prepares only reserved claims; our view is late
            self.views[uid] = view = replace(view, reserved=True)
        st = self.life.st

        def settled() -> bool:
            return made(st.cp.claims.get(uid), st.boot_id) or uid in self.errors

        try:
            await self._wait(uid, settled, timeout_s)
        except TimeoutError:
            raise PrepareFailed(f"claim {view.key}: slices not made within {timeout_s}s") from None
        if not made(st.cp.claims.get(uid), st.boot_id):
            raise PrepareFailed(f"claim {view.key}: {self.errors.get(uid, 'not made')}")
        return cdi_ids(view)

    async def unprepare(self, uid: str, timeout_s: float) -> None:
        """Release the claim's slices (nothing held: done at once)."""
        self.unprepared.add(uid)
        st = self.life.st
        try:
            await self._wait(uid, lambda: uid not in st.cp.claims, timeout_s)
        except TimeoutError:
            raise PrepareFailed(f"claim {uid}: slices not released within {timeout_s}s") from None
