"""The informers' handlers: watched objects in, the cluster model and the pods' workers out.

Every replica runs them (a standby keeps warm caches, not records): each event updates
`ClusterState`, and while leading kicks the workers of the pods it concerns (their own
pods, those waiting for a claim name or for a victim's slots) and, when capacity may have
grown, every parked pod (`after_change`). Namespaces are read here too: only opted-in ones
are served (`instaslice.io/enabled`, and `instaslice.io/whole-gpu` for whole GPUs), and
Kueue's are those the admin's selector picks. What it deliberately does not do: decide
(track.next_step, placer.py) or write (steps.py, writes.py), but for the background
MigNode writes it hands to the controller (`set_modes`, `warn`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from common.catalog import Catalog, GpuModel
from common.clock import Clock, monotonic_at
from common.constants import (
    ENABLED_KEY,
    GATE_NAME,
    LEASE_API_VERSION,
    MIG_NODE_PAGE_SIZE,
    MIG_NODE_PLURAL,
    REASON_GPU_OUT_OF_BOUNDS,
    SLICE_ALLOCATION_PLURAL,
    WHOLE_GPU_KEY,
    EventReason,
)
from common.kubeapi import (
    EventType,
    Informer,
    Kube,
    Obj,
    core_path,
    group_path,
    identity,
    instaslice_path,
    lean,
)
from common.placeholders import is_placeholder
from common.placement.geometry import token
from common.placement.search import catalog_tables
from common.placement.tables import TableTooLarge, warm
from webhook.allocator import pods as podlib
from webhook.allocator.agents import AgentWatch
from webhook.allocator.maintenance import Ampere, withdrawals
from webhook.allocator.preemption import Budgets, selects
from webhook.allocator.settings import AllocatorSettings
from webhook.allocator.state import ClusterState
from webhook.allocator.track import PodTrack, Seen, Tracks
from webhook.allocator.views import GpuView, gpus_of

log = structlog.get_logger("allocator")


def _warm_all(models: list[GpuModel]) -> None:
    """`tables.warm` each model (in a worker thread); one past the slot bound has no tables."""
    for model in models:
        try:
            warm(model)
        except TableTooLarge:
            continue


@dataclass(eq=False)
class Handlers:
    state: ClusterState
    tracks: Tracks
    clock: Clock
    catalog: Catalog
    agents: AgentWatch
    budgets: Budgets
    ampere: Ampere
    leading: Callable[[], bool]  # this replica acts (records are made only then)
    kick: Callable[[str], None]  # look at a pod again (leading only)
    after_change: Callable[[], None]  # capacity may have grown: retry parked pods
    # MigNode `node`'s desiredMigMode entries (add, drop), written in the background
    set_modes: Callable[[str, dict[str, str], set[str]], None]
    warn: Callable[[str, EventReason, str], None]  # a Warning event on a MigNode, in the background
    leases_synced: Callable[[], bool]  # the Lease informer has listed
    kueue_selector: Obj | None = None  # namespaces whose pods Kueue manages: the admin's
    kueue_namespaces: set[str] = field(default_factory=set)
    opted_in: set[str] = field(default_factory=set)  # namespaces labelled ENABLED_KEY=true
    whole_gpu: set[str] = field(default_factory=set)  # namespaces labelled WHOLE_GPU_KEY=true

    async def on_pod(self, etype: EventType, obj: Obj) -> None:
        if etype != "DELETED" and is_placeholder(obj):
            # a placeholder stands for demand: it must not hold a node's cpu in our model.
            # Recognised by all InstaSlice gives one, never by its label alone (tenants can
            # write labels: docs/security.md); and a removal is never skipped, so a pod seen
            # before still leaves the model and has its slices released
            return
        uid = podlib.uid(obj)
        if etype == "DELETED":
            self.state.remove_pod(obj)
            track = self.tracks.get(uid) if self.leading() else None
            if track is not None:  # released without asking again (finished pods too)
                track.gone = "the pod finished" if podlib.is_terminal(obj) else "its pod is gone"
            elif not self.leading():
                self.tracks.forget(uid)
            if track is not None or self.state.allocations_of(uid):
                self.kick(uid)
        else:
            view = self.state.upsert_pod(obj)
            if self.leading() and view.claim is not None:
                track = self.tracks.ensure(uid)
                fresh = track.ungate_start is None and not track.pinned
                if fresh and view.gates == (GATE_NAME,):  # ours became its only gate now
                    track.ungate_start = self.clock.monotonic()
            if view.claim is not None or self.tracks.get(uid) or self.state.allocations_of(uid):
                self.kick(uid)
        self.after_change()

    async def on_allocation(self, etype: EventType, obj: Obj) -> None:
        view = (
            self.state.remove_allocation(obj)
            if etype == "DELETED"
            else self.state.upsert_allocation(obj)
        )
        if view is not None:
            self.kick(view.pod_uid)
            if etype == "DELETED":  # a pod may have been waiting for the name to free up
                waiting = self.state.pod_by_claim(view.namespace, view.name)
                if waiting is not None:
                    self.kick(waiting.uid)
                for uid in self.tracks.preempting():  # or for a victim's slots
                    self.kick(uid)
        self.after_change()

    async def on_node(self, etype: EventType, obj: Obj) -> None:
        name = str(obj.get("metadata", {}).get("name", ""))
        if etype == "DELETED":
            self.state.remove_node(obj)
        else:
            self.state.upsert_node(obj)
        for alloc in self.state.allocations_on(name):
            self.kick(alloc.pod_uid)
        self.after_change()

    async def on_mig_node(self, etype: EventType, obj: Obj) -> None:
        if etype == "DELETED":
            self.state.remove_mig_node(obj)
        else:
            name = str(obj["metadata"]["name"])
            gpus = gpus_of(obj, self.state.geometries)  # GPUs beyond the bounds: refused
            await self._warm(gpus)
            before = self.state.gpus.get(name, ())
            self.state.upsert_mig_node(obj, gpus)
            self._tell_refused(name, before, gpus)
            done = withdrawals(obj) if self.ampere.on else set()
            if done:  # the asked mode is reached, or the agent failed it: withdraw the ask
                self.set_modes(str(obj["metadata"]["name"]), {}, done)
                self.ampere.asks.done(done)
            for uid in self.tracks.preempting():  # one may wait for a GPU's MIG mode
                self.kick(uid)
        self.after_change()

    async def _warm(self, gpus: tuple[GpuView, ...]) -> None:
        """Build the tables of the models these GPUs bring that placement has not met, in a
        worker thread: a new table (up to 2^16 occupancy masks, tables.MIG_MAX_MEMORY_SLOTS)
        must not stall admission and the Lease renewal on this loop. Placement then finds
        them built (tables.warm: what its first decision on such a GPU reads)."""
        ct = catalog_tables(self.catalog)
        fresh: dict[str, GpuModel] = {}
        for g in gpus:
            key = token(g.geometry) if g.geometry is not None else g.model
            model = g.geometry or self.catalog.model(g.model)
            if model is not None and not ct.known(key):
                fresh[key] = model
        if not fresh:
            return
        await asyncio.to_thread(_warm_all, list(fresh.values()))
        for key in fresh:
            ct.tables(key)  # built: only kept here, on the loop

    def _tell_refused(
        self, node: str, before: tuple[GpuView, ...], gpus: tuple[GpuView, ...]
    ) -> None:
        """A Warning event `GpuOutOfBounds` on the MigNode when the GPUs it refuses (or why)
        change; the gauge `instaslice_allocator_gpus_refused` and `kubectl instaslice nodes`
        show them meanwhile (docs/troubleshooting.md). Only the agent writes MigNode status,
        so this is no condition there (docs/security.md)."""
        now = [g for g in gpus if g.refused]
        if not now or {(g.uuid, g.refused) for g in now} == {
            (g.uuid, g.refused) for g in before if g.refused
        }:
            return
        message = "; ".join(f"GPU {g.index} ({g.uuid[:48]}): {g.refused}" for g in now)
        message += "; nothing is placed on it until its node agent publishes it within bounds"
        log.warning("MigNode GPUs beyond bounds, not used", node=node, why=message)
        if self.leading():
            self.warn(node, REASON_GPU_OUT_OF_BOUNDS, message)

    async def on_namespace(self, etype: EventType, obj: Obj) -> None:
        """Only opted-in namespaces are served: a pod carrying InstaSlice's marks elsewhere
        (the admission policy refuses to create one; this is the second line) is not placed;
        nor is a pod asking for whole GPUs in a namespace that did not opt in to them."""
        meta = obj.get("metadata") or {}
        name = str(meta.get("name") or "")
        labels = meta.get("labels") or {}
        kueue = self.kueue_selector is not None and etype != "DELETED"
        if kueue and selects(self.kueue_selector or {}, labels):
            self.kueue_namespaces.add(name)
        else:
            self.kueue_namespaces.discard(name)
        changed = False
        for key, names in ((ENABLED_KEY, self.opted_in), (WHOLE_GPU_KEY, self.whole_gpu)):
            on = etype != "DELETED" and labels.get(key) == "true"
            if on != (name in names):
                changed = True
                if on:
                    names.add(name)
                else:
                    names.discard(name)
        if not changed:
            return
        for pod in list(self.state.pods.values()):
            if pod.namespace == name and pod.claim is not None:
                self.kick(pod.uid)

    async def on_pdb(self, etype: EventType, obj: Obj) -> None:
        if etype == "DELETED":
            self.budgets.remove(obj)
        else:
            self.budgets.upsert(obj)

    async def on_lease(self, etype: EventType, obj: Obj) -> None:
        await self.agents.on_lease(etype, obj, initial=not self.leases_synced())

    def revisit(self) -> None:
        """A term begins: look at every pod InstaSlice places and every allocation's pod."""
        ours = {a.pod_uid for a in self.state.allocations.values()}
        for pod in list(self.state.pods.values()):
            if pod.claim is not None:
                ours.add(pod.uid)
                track = self.tracks.ensure(pod.uid)
                if track.ungate_start is None and pod.gates == (GATE_NAME,):
                    # seen before this term: timed from its creation (whole seconds)
                    track.ungate_start = monotonic_at(self.clock, pod.created)
        for uid in sorted(ours):
            self.kick(uid)

    def merge_allocations(self, items: list[Obj]) -> None:
        """Add allocations a previous leader may have written that our watch has not shown
        yet (a quorum list, `Writes.list_allocations`). Add-only: seeing too much is safe,
        too little is not."""
        for item in items:
            meta = item.get("metadata", {})
            if f"{meta.get('namespace')}/{meta.get('name')}" not in self.state.allocations:
                self.state.upsert_allocation(item)

    def seen(self, uid: str, track: PodTrack | None = None) -> Seen:
        """What the caches show for pod `uid`, as `next_step` reads it."""
        pod = self.state.pods.get(uid)
        alive: frozenset[str] = frozenset()
        holding: frozenset[str] = frozenset()
        pending = False
        p = track.preempt if track is not None else None
        if p is not None:
            pods = [self.state.pods.get(v.uid) for v in p.victims]
            alive = frozenset(v.uid for v in pods if v and not (v.deleting or v.terminal))
            holding = frozenset(u for u in p.waits_for if self.state.allocations_of(u))
            modes = [self.state.gpu(n, i) for n, i in p.resets]
            pending = any(g is None or g.maintenance or g.whole_if_idle != "off" for g in modes)
        allocs = tuple(self.state.allocations_of(uid))
        holder = None
        if pod is not None and pod.claim is not None and not allocs:
            other = self.state.allocations.get(f"{pod.namespace}/{pod.claim}")
            holder = other.pod_uid if other is not None else None
        return Seen(
            pod=pod,
            allocations=allocs,
            assumed=frozenset(a.key for a in allocs if self.state.is_assumed(a.key)),
            nodes=frozenset(a.node for a in allocs if a.node in self.state.nodes),
            agents_down=frozenset(a.node for a in allocs if a.node in self.state.agents_down),
            name_holder=holder,
            opted_in=pod is not None and pod.namespace in self.opted_in,
            whole_gpu=pod is not None and pod.namespace in self.whole_gpu,
            victims_alive=alive,
            holding=holding,
            modes_pending=pending,
            now=self.clock.monotonic(),
        )


_ACTIVE_POD_SELECTOR = "status.phase!=Succeeded,status.phase!=Failed"


def _cached_pod(obj: Obj) -> Obj:
    return podlib.slim(lean(obj))


def informers(
    kube: Kube, settings: AllocatorSettings, h: Handlers
) -> tuple[Informer, Informer, list[Informer]]:
    """The informers feeding `h`: (pods, the agents' Leases, all of them)."""
    pods = Informer(
        kube,
        core_path("pods"),
        h.on_pod,
        field_selector=_ACTIVE_POD_SELECTOR,
        name="pods",
        # every pod of the cluster is cached: of most, only what placement reads
        transform=_cached_pod,
    )
    path = group_path(LEASE_API_VERSION, "leases", settings.namespace)
    leases = Informer(kube, path, h.on_lease, name="leases", transform=lean)
    # Nodes and MigNodes are parsed into `state` (NodeView, GpuView): their informers keep
    # only each object's identity, not the object (a MigNode is 83 KB in memory).
    out = [
        pods,
        Informer(
            kube,
            core_path("nodes"),
            h.on_node,
            label_selector=settings.node_selector,
            name="nodes",
            keep=identity,
        ),
        Informer(
            kube,
            instaslice_path(MIG_NODE_PLURAL),
            h.on_mig_node,
            name="mignodes",
            keep=identity,
            page_size=MIG_NODE_PAGE_SIZE,
        ),
        Informer(
            kube,
            instaslice_path(SLICE_ALLOCATION_PLURAL),
            h.on_allocation,
            name="sliceallocations",
        ),
        leases,  # the node agents' heartbeats (and our own Lease, skipped)
        Informer(kube, core_path("namespaces"), h.on_namespace, name="namespaces"),
    ]
    if settings.preemption:  # which victims a PodDisruptionBudget protects
        pdbs = group_path("policy/v1", "poddisruptionbudgets")
        out.append(Informer(kube, pdbs, h.on_pdb, name="pdbs"))
    return pods, leases, out
