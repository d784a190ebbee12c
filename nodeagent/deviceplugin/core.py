"""Which prepared slice a kubelet device id stands for: the pure bookkeeping of the
device-plugin binding (no I/O, no gRPC).

A *unit* is the slices of one profile that one container of one Ready allocation asks for.
The kubelet's `Allocate` carries device ids but no pod identity, so same-profile units on a
node are interchangeable there: `allocate` binds the request's ids to any unbound unit of
that profile and count. The kubelet's PodResources API later tells which pod holds which ids;
`settle` then rebinds the ids to the holder's *own* unit (swapping with whichever ids held it,
as long as those are not known to run yet). Before a container starts (PreStartContainer) its
ids are settled, so every container runs on the slices its own SliceAllocation describes and
release, which destroys the allocation's own slices, destroys what the pod really had. A
container whose ids are not settled on a Ready unit is refused (`refusal`), and the ids of a
pod that has no allocation are unbound, so such a pod never gets another pod's slice.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, order=True)
class Unit:
    namespace: str
    claim: str
    container: str
    profile: str
    count: int
    uid: str = ""  # the SliceAllocation's: one name may be held by a newer allocation


IdKey = tuple[str, ...]  # a container's device ids for one resource, sorted


def key_of(ids: list[str] | tuple[str, ...]) -> IdKey:
    return tuple(sorted(ids))


class NoSlice(Exception):
    """No prepared, unbound slice of this profile and count on the node."""


@dataclass
class Bindings:
    ready: set[Unit] = field(default_factory=set)
    bound: dict[IdKey, Unit] = field(default_factory=dict)  # ids → unit they resolve to
    settled: set[IdKey] = field(default_factory=set)  # ids whose holder is known

    def unit_key(self, unit: Unit) -> IdKey | None:
        return next((k for k, u in self.bound.items() if u == unit), None)

    def allocate(self, profile: str, ids: list[str]) -> Unit:
        key = key_of(ids)
        if key in self.bound:  # the kubelet retried
            return self.bound[key]
        taken = set(self.bound.values())
        free = sorted(
            u for u in self.ready if u.profile == profile and u.count == len(key) and u not in taken
        )
        if not free:
            raise NoSlice(f"no prepared {profile} slice x{len(key)} left unassigned on this node")
        self.bound[key] = free[0]
        return free[0]

    def settle(self, key: IdKey, own: Unit) -> list[IdKey]:
        """The holder of `key` is the container of `own`: make `key` resolve to `own`. Returns
        the keys whose unit changed (their CDI aliases must be rewritten)."""
        current = self.bound.get(key)
        if current == own or own not in self.ready:
            self.settled.add(key)
            return []
        other = self.unit_key(own)
        if other is not None and other in self.settled:
            return []  # `own` already runs under other ids: leave both as they are
        changed = [key]
        self.bound[key] = own
        if other is not None:
            if current is None:
                del self.bound[other]
            else:
                self.bound[other] = current
            changed.append(other)
        self.settled.add(key)
        return changed

    def unbind(self, key: IdKey) -> bool:
        """The holder of `key` has no allocation: `key` resolves to nothing (its unit is
        free again for its owner). True when it was bound."""
        self.settled.discard(key)
        return self.bound.pop(key, None) is not None

    def refusal(self, key: IdKey) -> str | None:
        """Why a container holding `key` must not start, or None: its ids must be settled
        (its holder known) on a prepared unit."""
        unit = self.bound.get(key)
        if unit is None or key not in self.settled:
            return (
                f"devices {','.join(key)} are not bound to a slice of their pod's "
                "SliceAllocation (a pod without one gets no slice)"
            )
        if unit not in self.ready:
            return f"devices {','.join(key)} resolve to a slice that is not Ready"
        return None

    def add_ready(self, units: list[Unit]) -> None:
        self.ready.update(units)

    def release(self, namespace: str, claim: str, uid: str | None = None) -> list[IdKey]:
        """Forget a released allocation's units (given `uid`, only that allocation's: a
        newer one of the same name keeps its own); the keys that pointed at them."""
        gone = {
            u
            for u in self.ready
            if (u.namespace, u.claim) == (namespace, claim) and uid in (None, u.uid)
        }
        self.ready -= gone
        keys = [k for k, u in self.bound.items() if u in gone]
        for k in keys:
            del self.bound[k]
            self.settled.discard(k)
        return keys
