"""Leader election through a coordination.k8s.io/v1 Lease, so several replicas are safe.

The algorithm is client-go's `leaderelection` with a Lease lock, reduced to what the
allocator needs:

- A candidate takes the Lease when it is free (no holder), already its own, or expired. A
  Lease counts as expired when its record has not changed for `leaseDurationSeconds` as
  measured on *this* replica's monotonic clock since it first saw that record; the
  `renewTime` written in it is informational only, so clock skew between machines does not
  matter. Every write carries the Lease's resourceVersion: of two racing candidates one
  wins, the other gets 409 and stays a follower.
- The leader renews every `renew_interval_s`. `is_leader` turns False on its own once
  `renew_deadline_s` has passed since the start of the last successful renewal, whether or
  not the renew loop got to run, and every allocator write checks it first (`check`). As
  `renew_deadline_s < lease_duration_s`, a replica that lost contact stops writing before
  anyone else may take over.
- On a clean shutdown the leader hands the Lease back (empty holder, 1 s duration), so a
  standby takes over at once instead of after a full lease duration.

What it does not do: fence writes at the API server. A write sent just before the deadline
may land just after it; the margin `lease_duration_s - renew_deadline_s` covers that.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

import structlog

from common.clock import Clock, micro_time
from common.constants import LEASE_API_VERSION
from common.kubeapi import ApiError, Kube, Obj, group_path

log = structlog.get_logger("allocator.leader")

LEASE_NAME = "instaslice-allocator"


class NotLeader(Exception):
    """Raised by `LeaderElector.check` when this replica may not write."""


class LeadershipLost(Exception):
    """Raised by `LeaderElector.hold` when the Lease could not be kept."""


@dataclass(frozen=True, slots=True)
class LeaseSettings:
    namespace: str
    identity: str
    name: str = LEASE_NAME
    lease_duration_s: float = 15.0
    renew_interval_s: float = 5.0
    renew_deadline_s: float = 10.0
    retry_interval_s: float = 2.0
    release_on_exit: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.renew_interval_s < self.renew_deadline_s < self.lease_duration_s:
            raise ValueError(
                "need 0 < renew_interval_s < renew_deadline_s < lease_duration_s, got "
                f"{self.renew_interval_s}, {self.renew_deadline_s}, {self.lease_duration_s}"
            )
        if not self.identity:
            raise ValueError("a leader-election identity must not be empty")


class LeaderElector:
    def __init__(self, kube: Kube, settings: LeaseSettings, clock: Clock) -> None:
        self._kube = kube
        self._s = settings
        self._clock = clock
        self._path = group_path(LEASE_API_VERSION, "leases", settings.namespace, settings.name)
        self._leading = False
        self._last_renew = float("-inf")
        self._observed_rv: str | None = None
        self._observed_at = float("-inf")
        self._mine: Obj | None = None  # the Lease as this replica last wrote it, while leading
        self.holder: str | None = None  # last holder seen, for logs and tests

    @property
    def identity(self) -> str:
        return self._s.identity

    @property
    def is_leader(self) -> bool:
        return (
            self._leading and self._clock.monotonic() < self._last_renew + self._s.renew_deadline_s
        )

    def check(self) -> None:
        """Raise NotLeader unless this replica holds a fresh Lease (call before every write)."""
        if not self.is_leader:
            raise NotLeader(f"{self._s.identity} is not the allocator leader")

    async def try_acquire_or_renew(self) -> bool:
        """One attempt to take or renew the Lease; True when this replica now holds it.

        A leader renews with one PUT of the Lease it last wrote (its resourceVersion proves
        nobody else wrote since); only a conflict costs the read first. Under load that
        halves the round trips a renewal has to fit into its deadline.
        """
        started = self._clock.monotonic()
        if self._leading and self._mine is not None:
            mine = self._mine
            try:
                written = await self._kube.replace(
                    self._path, {**mine, "spec": self._record(mine.get("spec") or {}, started)}
                )
            except ApiError as exc:
                self._mine = None
                if not exc.conflict:
                    log.warning("lease write failed", error=str(exc))
                    return self._failed()
            else:
                self._renewed(written, started)
                return True
        try:
            lease: Obj | None = await self._kube.get(self._path)
        except ApiError as exc:
            if not exc.not_found:
                log.warning("lease read failed", error=str(exc))
                return self._failed()
            lease = None
        if lease is None:
            return await self._write(None, self._record({}, started), started)
        spec: dict[str, Any] = lease.get("spec") or {}
        rv = str(lease.get("metadata", {}).get("resourceVersion", ""))
        if rv != self._observed_rv:
            self._observed_rv, self._observed_at = rv, started
        holder = spec.get("holderIdentity") or ""
        self.holder = holder or None
        duration = float(spec.get("leaseDurationSeconds") or self._s.lease_duration_s)
        if holder and holder != self._s.identity and started < self._observed_at + duration:
            self._leading = False
            self._mine = None
            return False
        return await self._write(lease, self._record(spec, started), started)

    def _record(self, old: dict[str, Any], started: float) -> dict[str, Any]:
        now = micro_time(self._clock.wall())
        mine = old.get("holderIdentity") == self._s.identity
        return {
            "holderIdentity": self._s.identity,
            "leaseDurationSeconds": max(1, round(self._s.lease_duration_s)),
            "acquireTime": old.get("acquireTime", now) if mine else now,
            "renewTime": now,
            "leaseTransitions": int(old.get("leaseTransitions") or 0) + (0 if mine else 1),
        }

    async def _write(self, lease: Obj | None, spec: dict[str, Any], started: float) -> bool:
        try:
            if lease is None:
                body: Obj = {
                    "apiVersion": LEASE_API_VERSION,
                    "kind": "Lease",
                    "metadata": {"name": self._s.name, "namespace": self._s.namespace},
                    "spec": {**spec, "leaseTransitions": 0},
                }
                written = await self._kube.create(self._path.rsplit("/", 1)[0], body)
            else:
                body = {**lease, "spec": spec}
                written = await self._kube.replace(self._path, body)
        except ApiError as exc:
            if not exc.conflict:
                log.warning("lease write failed", error=str(exc))
            return self._failed()
        self._renewed(written, started)
        return True

    def _renewed(self, written: Obj, started: float) -> None:
        if not self._leading:
            log.info("became allocator leader", identity=self._s.identity)
        self._leading = True
        self._last_renew = started
        self._mine = written
        self.holder = self._s.identity
        self._observed_rv = str(written.get("metadata", {}).get("resourceVersion", ""))
        self._observed_at = started

    def _failed(self) -> bool:
        # Keep leading until the deadline runs out: one failed renewal is not a lost lease.
        return self.is_leader

    async def acquire(self) -> None:
        """Block until this replica holds the Lease."""
        while not await self.try_acquire_or_renew():
            await self._clock.sleep(self._s.retry_interval_s)

    async def hold(self) -> None:
        """Renew until that fails for longer than the renew deadline; then raise LeadershipLost."""
        while True:
            await self._clock.sleep(self._s.renew_interval_s)
            while not await self._bounded_attempt():
                if not self.is_leader:
                    self._leading = False
                    self._mine = None
                    log.warning("lost allocator leadership", identity=self._s.identity)
                    raise LeadershipLost(self._s.identity)
                await self._clock.sleep(self._s.retry_interval_s)

    async def _bounded_attempt(self) -> bool:
        # A hung API call must not keep a stale leader believing in itself past its deadline;
        # the bound is on I/O (real time), `is_leader` already expires on the injected clock.
        try:
            async with asyncio.timeout(self._s.renew_deadline_s):
                return await self.try_acquire_or_renew()
        except TimeoutError:
            return self._failed()

    async def release(self) -> None:
        """Hand the Lease back if this replica holds it (best effort, bounded)."""
        was_leading, self._leading = self._leading, False
        self._mine = None
        if not was_leading:
            return
        with contextlib.suppress(ApiError, TimeoutError):
            async with asyncio.timeout(5):
                lease = await self._kube.get(self._path)
                spec = dict(lease.get("spec") or {})
                if spec.get("holderIdentity") != self._s.identity:
                    return
                spec.update(
                    holderIdentity="",
                    leaseDurationSeconds=1,
                    renewTime=micro_time(self._clock.wall()),
                )
                await self._kube.replace(self._path, {**lease, "spec": spec})
                log.info("released allocator leadership", identity=self._s.identity)
