"""The node agents' heartbeats, as the allocator watches them (docs/allocator.md "Node
agent down").

Each node agent renews a Lease named after its node in InstaSlice's namespace. A renewal
counts when it is *seen* (a new `renewTime`), on the allocator's own monotonic clock, as the
node lifecycle controller times kubelets, so clock skew between a node and the allocator
does not matter; Leases found by the initial list count from their `renewTime`. The leader's
sweep leaves out of placement the nodes not renewed for longer than their Lease's duration;
a renewal seen brings the node back at once. A node with no Lease is unknown, not down.

The same sweep forgets nodes removed for good: a MigNode whose Node has been gone for the
grace period is deleted, with its agent's Lease (`forget_gone_nodes`); a node back within it
keeps them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from common.clock import Clock, monotonic_at
from common.constants import AGENT_LEASE_DURATION_S, NODEAGENT_COMPONENT
from common.kubeapi import ApiError, EventType, Obj
from webhook.allocator.state import ClusterState
from webhook.allocator.writes import Writes

log = structlog.get_logger("allocator")

_AGENT_HOLDER = f"{NODEAGENT_COMPONENT}/"


class AgentLeases:
    """Node agents' heartbeats, timed as the node lifecycle controller times kubelets': a
    renewal counts when it is seen (a new `renewTime`), on the allocator's own monotonic
    clock, so clock skew between a node and the allocator does not matter."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[str, float, float]] = {}  # node -> renewTime, seen, duration

    def observe(self, node: str, renew_time: str, duration_s: float, seen: float) -> None:
        """A Lease as watched; `seen` counts only when `renew_time` is new."""
        prev = self._seen.get(node)
        if prev is not None and prev[0] == renew_time:
            seen = prev[1]
        self._seen[node] = (renew_time, seen, duration_s)

    def forget(self, node: str) -> None:
        self._seen.pop(node, None)

    def expired(self, now: float) -> set[str]:
        """Nodes whose agent has not renewed its Lease for longer than the Lease's duration.
        A node without a Lease is not among them (unknown is not down)."""
        return {n for n, (_, seen, duration) in self._seen.items() if now - seen > duration}

    def is_expired(self, node: str, now: float) -> bool:
        """`node in expired(now)`, for one node (a Lease event must not scan them all)."""
        entry = self._seen.get(node)
        return entry is not None and now - entry[1] > entry[2]

    def silent_s(self, node: str, now: float) -> float | None:
        entry = self._seen.get(node)
        return None if entry is None else now - entry[1]


@dataclass(eq=False)
class AgentWatch:
    state: ClusterState
    clock: Clock
    kick: Callable[[str], None]  # look at a pod again (its allocation may move)
    after_change: Callable[[], None]  # capacity may have grown (an agent is back)
    leases: AgentLeases = field(default_factory=lambda: AgentLeases())
    gone_since: dict[str, float] = field(default_factory=dict)  # MigNodes without a Node

    async def forget_gone_nodes(self, writes: Writes, namespace: str, grace_s: float) -> None:
        """A MigNode whose Node has been gone for `grace_s` (the node was removed for good)
        is deleted, with its agent's Lease in `namespace`; a node back within it keeps them."""
        now = self.clock.monotonic()
        gone = set(self.state.gpus) - set(self.state.nodes)
        for name in [n for n in self.gone_since if n not in gone]:
            del self.gone_since[name]
        for name in sorted(gone):
            since = self.gone_since.setdefault(name, now)
            if now - since < grace_s:
                continue
            del self.gone_since[name]  # looked at again after another grace if it stays
            try:
                if await writes.forget_node(name, namespace):
                    log.info("node gone; its MigNode and agent Lease deleted", node=name)
            except ApiError as exc:
                log.warning("could not delete a gone node's records", node=name, error=str(exc))

    async def on_lease(self, etype: EventType, obj: Obj, *, initial: bool) -> None:
        """A Lease event; `initial`: found by the informer's first list."""
        spec = obj.get("spec") or {}
        if not str(spec.get("holderIdentity") or "").startswith(_AGENT_HOLDER):
            return  # not a node agent's heartbeat (e.g. the allocator's own Lease)
        node = str(obj.get("metadata", {}).get("name", ""))
        if etype == "DELETED":
            self.leases.forget(node)  # no heartbeat at all reads as unknown, not down
        else:
            renew = str(spec.get("renewTime") or "")
            duration = float(spec.get("leaseDurationSeconds") or AGENT_LEASE_DURATION_S)
            seen = monotonic_at(self.clock, renew) if initial else self.clock.monotonic()
            self.leases.observe(node, renew, duration, seen)
        now = self.clock.monotonic()
        if not self.leases.is_expired(node, now) and self.state.set_agent_down(node, False):
            log.info("node agent back; node offered to placement again", node=node)
            self.after_change()

    def sweep(self) -> None:
        """Leave out of placement the nodes whose agent stopped renewing (the leader's)."""
        now = self.clock.monotonic()
        expired = self.leases.expired(now)
        for node in sorted(expired - self.state.agents_down):
            self.state.set_agent_down(node, True)
            for alloc in self.state.allocations_on(node):
                self.kick(alloc.pod_uid)  # an untouched one moves elsewhere
            silent = self.leases.silent_s(node, now) or 0.0
            log.warning(
                "node agent's Lease not renewed; node left out of placement",
                node=node,
                silent_s=round(silent, 1),
            )
        # no revival here: a renewal (or a deleted Lease) is seen by on_lease at once
