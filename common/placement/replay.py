"""Placement traces: parse them, and replay them through the engine on a simulated cluster.

A trace is JSON (the format of `instaslice-place`, docs/contract.md §6):

    {"nodes": [{"name": "n0", "cpu": "64", "memory": "512Gi", "pods": 110,
                "gpus": [{"model": "H100-80GB"}, {"model": "H100-80GB"}]}],
     "events": [{"op": "add", "pod": "p1", "cpu": "1", "memory": "1Gi",
                 "containers": [{"name": "c", "slices": {"1g.10gb": 1}}]},
                {"op": "remove", "pod": "p1"}]}

Optional, beyond the issue's format: per node `labels` and `taints`
([{"key", "value", "effect"}]); per GPU `migEnabled` / `healthy` (default true); per add
`initContainers` (same shape as `containers`), `nodeSelector` and `tolerations`
([{"key", "operator", "value", "effect"}]); per event `t` (a time, used by the benchmark)
and a top-level `end` (the time the trace ends). GPUs start empty.

`Cluster` is the replayer's own mutable state — which pod holds what where — and hands the
engine a fresh immutable `Snapshot`, rebuilding only the node an event touched; it decides
through a `FleetIndex` (index.py) kept up to date the same way, or with `indexed=False` by
the engine's scan over the snapshot (same answers: tests/unit/test_placement_index.py). A pod that
cannot be placed when it arrives is dropped (no retry); removing a dropped or unknown pod is
a no-op. No I/O here: cli.py reads files and prints.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from common.catalog import Catalog, load_catalog
from common.placement.engine import place
from common.placement.index import FleetIndex
from common.placement.model import (
    Gpu,
    NodeState,
    Occupied,
    Pending,
    Placement,
    PodRequest,
    Policy,
    SliceRequest,
    Snapshot,
    Taint,
    Toleration,
)
from common.quantity import parse_bytes, parse_cpu_millis


class TraceError(ValueError):
    """A trace that does not follow the format; the message names the offending field."""


@dataclass(frozen=True, slots=True)
class TraceNode:
    name: str
    cpu_millis: int
    memory_bytes: int
    pods: int
    gpus: tuple[Gpu, ...]
    labels: Mapping[str, str]
    taints: tuple[Taint, ...]


@dataclass(frozen=True, slots=True)
class AddEvent:
    pod: str
    request: PodRequest
    t: float = 0.0


@dataclass(frozen=True, slots=True)
class RemoveEvent:
    pod: str
    t: float = 0.0


Event = AddEvent | RemoveEvent


@dataclass(frozen=True, slots=True)
class Trace:
    nodes: tuple[TraceNode, ...]
    events: tuple[Event, ...]
    end: float | None = None


def _field(obj: Mapping[str, Any], key: str, where: str) -> Any:
    if not isinstance(obj, Mapping):
        raise TraceError(f"{where}: expected an object, got {type(obj).__name__}")
    if key not in obj:
        raise TraceError(f"{where}: missing {key!r}")
    return obj[key]


def _quantity(fn: Any, value: Any, where: str) -> int:
    try:
        result: int = fn(value)
    except (ValueError, TypeError) as e:
        raise TraceError(f"{where}: {e}") from None
    return result


def _str_map(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise TraceError(f"{where}: expected an object of strings")
    return dict(value)


def _node(raw: Any, i: int) -> TraceNode:
    where = f"nodes[{i}]"
    name = _field(raw, "name", where)
    if not isinstance(name, str) or not name:
        raise TraceError(f"{where}.name: expected a non-empty string")
    gpus_raw = raw.get("gpus", [])
    if not isinstance(gpus_raw, list):
        raise TraceError(f"{where}.gpus: expected a list")
    gpus = []
    for k, g in enumerate(gpus_raw):
        model = _field(g, "model", f"{where}.gpus[{k}]")
        if not isinstance(model, str):
            raise TraceError(f"{where}.gpus[{k}].model: expected a string")
        gpus.append(
            Gpu(k, model, bool(g.get("migEnabled", True)), bool(g.get("healthy", True)), ())
        )
    taints = tuple(
        Taint(
            str(_field(t, "key", f"{where}.taints[{k}]")),
            str(t.get("value", "")),
            str(t.get("effect", "NoSchedule")),
        )
        for k, t in enumerate(raw.get("taints", []))
    )
    pods = raw.get("pods", 110)
    if not isinstance(pods, int) or isinstance(pods, bool) or pods < 0:
        raise TraceError(f"{where}.pods: expected a non-negative integer")
    return TraceNode(
        name=name,
        cpu_millis=_quantity(parse_cpu_millis, raw.get("cpu", "0"), f"{where}.cpu"),
        memory_bytes=_quantity(parse_bytes, raw.get("memory", "0"), f"{where}.memory"),
        pods=pods,
        gpus=tuple(gpus),
        labels=_str_map(raw.get("labels", {}), f"{where}.labels"),
        taints=taints,
    )


def _containers(raw: Any, where: str) -> list[SliceRequest]:
    if not isinstance(raw, list):
        raise TraceError(f"{where}: expected a list")
    out = []
    for k, c in enumerate(raw):
        name = _field(c, "name", f"{where}[{k}]")
        slices = c.get("slices", {})
        if not isinstance(slices, Mapping):
            raise TraceError(f"{where}[{k}].slices: expected an object profile -> count")
        for profile, count in slices.items():
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise TraceError(f"{where}[{k}].slices[{profile!r}]: expected a count >= 1")
            out.append(SliceRequest(str(name), str(profile), count))
    return out


def _event(raw: Any, i: int) -> Event:
    where = f"events[{i}]"
    op = _field(raw, "op", where)
    pod = _field(raw, "pod", where)
    if not isinstance(pod, str):
        raise TraceError(f"{where}.pod: expected a string")
    t = raw.get("t", 0.0)
    if not isinstance(t, int | float):
        raise TraceError(f"{where}.t: expected a number")
    if op == "remove":
        return RemoveEvent(pod, float(t))
    if op != "add":
        raise TraceError(f"{where}.op: expected 'add' or 'remove', got {op!r}")
    slices = _containers(raw.get("initContainers", []), f"{where}.initContainers")
    slices += _containers(raw.get("containers", []), f"{where}.containers")
    tolerations = tuple(
        Toleration(
            str(t.get("key", "")),
            str(t.get("operator", "Equal")),
            str(t.get("value", "")),
            str(t.get("effect", "")),
        )
        for t in raw.get("tolerations", [])
    )
    request = PodRequest(
        name=pod,
        cpu_millis=_quantity(parse_cpu_millis, raw.get("cpu", "0"), f"{where}.cpu"),
        memory_bytes=_quantity(parse_bytes, raw.get("memory", "0"), f"{where}.memory"),
        slices=tuple(slices),
        node_selector=_str_map(raw.get("nodeSelector", {}), f"{where}.nodeSelector"),
        tolerations=tolerations,
    )
    return AddEvent(pod, request, float(t))


def parse_trace(doc: Any) -> Trace:
    """A `Trace` from decoded JSON; raises TraceError naming the first bad field."""
    try:
        return _parse_trace(doc)
    except (AttributeError, TypeError, KeyError) as e:  # a value of the wrong JSON type
        raise TraceError(f"malformed trace: {e}") from None


def _parse_trace(doc: Any) -> Trace:
    nodes_raw = _field(doc, "nodes", "trace")
    events_raw = _field(doc, "events", "trace")
    if not isinstance(nodes_raw, list) or not isinstance(events_raw, list):
        raise TraceError("trace: 'nodes' and 'events' must be lists")
    nodes = tuple(_node(n, i) for i, n in enumerate(nodes_raw))
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        raise TraceError("trace: node names must be unique")
    end = doc.get("end")
    if end is not None and not isinstance(end, int | float):
        raise TraceError("trace.end: expected a number")
    return Trace(nodes, tuple(_event(e, i) for i, e in enumerate(events_raw)), end)


@dataclass(frozen=True, slots=True)
class _Held:
    node: int
    placement: Placement
    cpu_millis: int
    memory_bytes: int


class Cluster:
    """A simulated cluster that applies the engine's decisions (the replayer's state)."""

    def __init__(
        self,
        nodes: Sequence[TraceNode],
        policy: Policy = Policy.INSTASLICE,
        catalog: Catalog | None = None,
        *,
        indexed: bool = True,
    ) -> None:
        self.policy = policy
        self.indexed = indexed
        self.catalog = catalog if catalog is not None else load_catalog()
        self._spec = tuple(nodes)
        self._nodes = [
            NodeState(
                n.name, n.labels, n.taints, False, n.cpu_millis, n.memory_bytes, n.pods, n.gpus
            )
            for n in nodes
        ]
        self._index = {n.name: i for i, n in enumerate(nodes)}
        self._fleet = FleetIndex()
        for i, state in enumerate(self._nodes):
            self._fleet.put(state, i)
        self._held: dict[str, _Held] = {}
        self._snapshot: Snapshot | None = None
        self.used_slots = 0
        self.total_slots = 0
        for n in nodes:
            for g in n.gpus:
                m = self.catalog.model(g.model)
                if m is not None and g.usable:
                    self.total_slots += m.memory_slots

    @property
    def snapshot(self) -> Snapshot:
        if self._snapshot is None:
            self._snapshot = Snapshot(tuple(self._nodes))
        return self._snapshot

    def holds(self, pod: str) -> bool:
        return pod in self._held

    def node(self, name: str) -> NodeState:
        """The node's state now."""
        return self._nodes[self._index[name]]

    def node_of(self, pod: str) -> str | None:
        """The node holding `pod`, None when it holds nothing."""
        held = self._held.get(pod)
        return None if held is None else self._nodes[held.node].name

    def add(self, request: PodRequest) -> Placement | Pending:
        if request.name in self._held:
            raise TraceError(f"pod {request.name!r} added twice without a remove")
        result = self.decide(request)
        if isinstance(result, Placement):
            self.assume(request, result)
        return result

    def decide(self, request: PodRequest, *, indexed: bool | None = None) -> Placement | Pending:
        """The engine's decision for `request` now, recorded nowhere (`indexed`: through the
        index or by the scan; default: the cluster's own choice)."""
        if self.indexed if indexed is None else indexed:
            return self._fleet.place(request, self.policy, self.catalog, lambda: self.snapshot)
        return place(self.snapshot, request, self.policy, self.catalog)

    def assume(self, request: PodRequest, placement: Placement) -> None:
        """Record a placement decided elsewhere (the engine, or a preloaded state).
        Not re-validated: the caller vouches for it."""
        if request.name in self._held:
            raise TraceError(f"pod {request.name!r} added twice without a remove")
        i = self._index[placement.node]
        self._held[request.name] = _Held(i, placement, request.cpu_millis, request.memory_bytes)
        self._update(i, placement, request.cpu_millis, request.memory_bytes, +1)

    def remove(self, pod: str) -> bool:
        held = self._held.pop(pod, None)
        if held is None:
            return False
        self._update(held.node, held.placement, held.cpu_millis, held.memory_bytes, -1)
        return True

    def _update(self, i: int, pl: Placement, cpu: int, mem: int, sign: int) -> None:
        old = self._nodes[i]
        gpus = list(old.gpus)
        by_pos = {g.index: k for k, g in enumerate(gpus)}
        for s in pl.slices:
            k = by_pos[s.gpu_index]
            g = gpus[k]
            occ = Occupied(s.start, s.size, s.profile)
            if sign > 0:
                occupied = (*g.occupied, occ)
            else:
                rest = list(g.occupied)
                rest.remove(occ)
                occupied = tuple(rest)
            gpus[k] = Gpu(g.index, g.model, g.mig_enabled, g.healthy, occupied)
            self.used_slots += sign * s.size
        self._nodes[i] = NodeState(
            old.name,
            old.labels,
            old.taints,
            old.unschedulable,
            old.cpu_millis_free - sign * cpu,
            old.memory_bytes_free - sign * mem,
            old.pods_free - sign,
            tuple(gpus),
        )
        self._fleet.put(self._nodes[i], i)
        self._snapshot = None


def result_line(event: Event, result: Placement | Pending | bool) -> dict[str, Any]:
    """The JSON object `instaslice-place` prints for one event."""
    if isinstance(event, RemoveEvent):
        return {"op": "remove", "pod": event.pod, "removed": bool(result)}
    if isinstance(result, Placement):
        return {
            "op": "add",
            "pod": event.pod,
            "placed": True,
            "node": result.node,
            "slices": [
                {
                    "container": s.container,
                    "profile": s.profile,
                    "gpu": s.gpu_index,
                    "start": s.start,
                    "size": s.size,
                }
                for s in result.slices
            ],
        }
    assert isinstance(result, Pending)
    return {
        "op": "add",
        "pod": event.pod,
        "placed": False,
        "reason": result.message,
        "code": str(result.reason),
    }


def replay(
    trace: Trace, policy: Policy = Policy.INSTASLICE, catalog: Catalog | None = None
) -> list[dict[str, Any]]:
    """Every event's result line, in order."""
    cluster = Cluster(trace.nodes, policy, catalog)
    out = []
    for ev in trace.events:
        if isinstance(ev, AddEvent):
            out.append(result_line(ev, cluster.add(ev.request)))
        else:
            out.append(result_line(ev, cluster.remove(ev.pod)))
    return out
