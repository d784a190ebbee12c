"""Writes the node's pool (nodeagent/dra/pool.py) as ResourceSlices, by the pool protocol.

kube-scheduler reads a pool only when it sees all of it: `resourceSliceCount` slices of the
pool's highest `generation`. So a change is written as a new generation: every slice of the
pool is written (created or replaced) with the generation bumped and the new count, then the
slices that are no longer part of it are deleted; until the last write lands the scheduler
uses the older, complete generation, or none. The generation comes from what the API server
holds (the highest found at the first write), so a restarted agent goes on counting up; one
that finds its own pool unchanged writes nothing, and one that finds a generation of its pool
cut short (its last run stopped between two slices) writes only the slices missing from it,
in that generation. The node's slices are watched: a change that is not our own write coming
back (the kubelet deletes a driver's slices when its plugin unregisters, e.g. across a
kubelet or agent restart) has the pool written again, as a new generation.

Slices are named `<node>-instaslice.io-<part>` (cut and hashed past 253 characters), so the
agent finds its own by name as well as by its node's field selector. What it deliberately does
not do: publish for other nodes, or keep a slice of a GPU it no longer publishes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from common.constants import DRA_DRIVER
from common.kubeapi import ApiError, Kube, group_path
from nodeagent.dra.pool import Slice, slice_body

log = structlog.get_logger("dra.pool")
Obj = dict[str, Any]
MAX_NAME = 253


def slices_path(name: str | None = None) -> str:
    return group_path("resource.k8s.io/v1", "resourceslices", name=name)


def slice_name(node: str, part: str) -> str:
    name = f"{node}-{DRA_DRIVER}-{part}"
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(node.encode()).hexdigest()[:10]
    return f"{node[: MAX_NAME - len(part) - len(DRA_DRIVER) - 13]}-{digest}-{DRA_DRIVER}-{part}"


def _missing(existing: Sequence[Obj], desired: dict[str, Obj]) -> set[str] | None:
    """The desired slices the API server lacks, when every slice it holds is one of the
    desired pool's, as desired, all of one generation and count: an empty set when it holds
    the whole pool, some names when a write of it was cut short (an agent stopped between
    two slices of a generation). None when anything else is there (or nothing)."""
    gens = {o["spec"]["pool"].get("generation") for o in existing}
    if len(gens) != 1:
        return None
    for o in existing:
        want = desired.get(o["metadata"]["name"])
        if want is None:
            return None
        have = {k: v for k, v in o["spec"].items() if k != "pool"}
        pool = o["spec"]["pool"]
        if have != {k: v for k, v in want["spec"].items() if k != "pool"}:
            return None
        if (
            pool.get("resourceSliceCount") != len(desired)
            or pool.get("name") != want["spec"]["pool"]["name"]
        ):
            return None
    return set(desired) - {o["metadata"]["name"] for o in existing}


class PoolPublisher:
    """One node's pool; `publish` is called with the pool as it should be, on every change
    the agent notices, and writes only when it differs from what was last written."""

    def __init__(self, kube: Kube, node: str, changed: Callable[[], None] = lambda: None) -> None:
        self.kube = kube
        self.node = node
        self.changed = changed  # asks for a publish (the agent's publisher loop)
        self.generation = 0  # of the pool last written (or found)
        self.writes = 0  # slices written or deleted (tests: a no-change restart writes none)
        self._last: list[Slice] | None = None
        self._written: dict[str, str] = {}  # slice name -> the resourceVersion we wrote

    def on_event(self, etype: str, obj: Obj) -> None:
        """One of this node's slices changed: our own write coming back is recognised by its
        resourceVersion; anything else (the kubelet wipes a driver's slices when its plugin
        goes, on restart; another writer) makes the next publish compare and write again."""
        meta = obj.get("metadata") or {}
        name, rv = meta.get("name", ""), meta.get("resourceVersion", "")
        if etype != "DELETED" and self._written.get(name) == rv:
            return
        if etype == "DELETED" and name not in self._written:
            return  # one we deleted ourselves, or never wrote
        if self._last is not None:
            log.info("pool changed underneath; publishing again", node=self.node, slice=name)
        self._last = None
        self._written.pop(name, None)
        self.changed()

    async def ours(self) -> list[Obj]:
        got = await self.kube.list(
            slices_path(), fieldSelector=f"spec.nodeName={self.node},spec.driver={DRA_DRIVER}"
        )
        return list(got.get("items") or [])

    async def publish(self, slices: Sequence[Slice]) -> None:
        if self._last is not None and list(slices) == self._last:
            return
        existing = await self.ours()
        names = [slice_name(self.node, s.part) for s in slices]
        found = max((int(o["spec"]["pool"].get("generation") or 0) for o in existing), default=0)
        generation = max(found, self.generation)
        bodies = {
            n: slice_body(self.node, n, s, generation, len(slices))
            for n, s in zip(names, slices, strict=True)
        }
        missing = _missing(existing, bodies)
        if missing and self.generation:  # completed at start only: a slice of ours deleted
            missing = None  # underneath later has the pool written as a new generation
        if missing is not None:
            self._written = {
                o["metadata"]["name"]: o["metadata"]["resourceVersion"] for o in existing
            }
            for n in sorted(missing):  # the rest of a generation cut short: same generation
                await self._write(bodies[n], None)
            if missing:
                log.info(
                    "pool completed", node=self.node, generation=generation, slices=len(missing)
                )
        else:
            generation += 1
            by_name = {o["metadata"]["name"]: o for o in existing}
            for n, s in zip(names, slices, strict=True):
                body = slice_body(self.node, n, s, generation, len(slices))
                await self._write(body, by_name.get(n))
            for n, o in by_name.items():
                if n not in bodies:
                    await self._delete(n, o)
            log.info("pool published", node=self.node, generation=generation, slices=len(slices))
        self.generation = generation
        self._last = list(slices)

    async def _write(self, body: Obj, current: Obj | None) -> None:
        self.writes += 1
        name = body["metadata"]["name"]
        if current is None:
            got = await self.kube.create(slices_path(), body)
        else:
            body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
            got = await self.kube.replace(slices_path(name), body)
        self._written[name] = got["metadata"]["resourceVersion"]

    async def _delete(self, name: str, current: Obj) -> None:
        self.writes += 1
        self._written.pop(name, None)
        uid = current["metadata"]["uid"]
        try:
            await self.kube.delete(slices_path(name), {"preconditions": {"uid": uid}})
        except ApiError as exc:
            if not exc.not_found:
                raise
