"""KWOK GPU nodes from a cluster spec (docs/contract.md §5).

A spec lists node groups; each group becomes Node objects `<prefix>-0 .. <prefix>-<count-1>`
that KWOK manages (annotation `kwok.x-k8s.io/node: fake`), labelled with the GPU model, GPU
count and MIG mode, and with the given cpu/memory/pods as capacity and allocatable. KWOK's
node-initialize stage keeps that capacity and marks the node Ready.

It deliberately does not advertise GPU or MIG extended resources: which slices a node offers
is InstaSlice's business (its agents publish them). Parsing is pure (`parse_spec`,
`node_manifest`); only `create_nodes` talks to the API.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, cast, get_args

import yaml
from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client.exceptions import ApiException

from common.catalog import CatalogError, load_model_file
from common.constants import GPU_COUNT_LABEL, GPU_MODEL_LABEL
from hack.cluster.controlplane import KWOK_NODE_ANNOTATION

__all__ = [
    "KWOK_TYPE_LABEL",
    "MIG_MODE_LABEL",
    "REAL_NODE_TAINT",
    "ClusterSpec",
    "NodeGroup",
    "SpecError",
    "Taint",
    "create_nodes",
    "load_spec",
    "node_labels",
    "node_manifest",
    "node_manifests",
    "parse_spec",
    "wait_nodes_ready",
]

MIG_MODE_LABEL: Final = "instaslice.io/mig-mode"
KWOK_TYPE_LABEL: Final = ("type", "kwok")
TaintEffect = Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]
_EFFECTS: Final = ("NoSchedule", "PreferNoSchedule", "NoExecute")
Runtime = Literal["kwok", "containerd"]
_RUNTIMES: Final = ("kwok", "containerd")
Install = Literal["processes", "chart"]
# A `runtime: containerd` group's node is real (hack/cluster/realnode.py); only pods that
# tolerate this taint land there.
REAL_NODE_TAINT: Final = ("instaslice.io/real-node", "true", "NoSchedule")


class SpecError(ValueError):
    """The cluster spec is malformed; the message names the entry and field."""


@dataclass(frozen=True)
class Taint:
    key: str
    effect: TaintEffect
    value: str = ""


@dataclass(frozen=True)
class NodeGroup:
    prefix: str
    count: int
    gpus: int
    model: str
    mig_mode: Literal["enabled", "disabled"] = "enabled"
    cpu: str = "64"
    memory: str = "512Gi"
    pods: int = 110
    taints: tuple[Taint, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    runtime: Runtime = "kwok"  # containerd: a real kubelet + containerd node (count 1)
    autoscaled_max: int | None = None  # `autoscaled: {max: N}`: the autoscaler makes its nodes
    # A GPU model defined by a table file (in no catalog); `model` is then its name.
    model_file: Path | None = None

    def names(self) -> list[str]:
        return [f"{self.prefix}-{i}" for i in range(self.count)]

    @property
    def real(self) -> bool:
        return self.runtime == "containerd"


@dataclass(frozen=True)
class ClusterSpec:
    groups: tuple[NodeGroup, ...]
    kueue: bool = False  # top-level `kueue: true`: build, install and run Kueue (hack/kueue.py)
    # top-level `slotAccounting: true`: the webhook runs with --slot-accounting (and a Kueue
    # of the spec charges instaslice.io/memory-slots, docs/kueue.md)
    slot_accounting: bool = False
    # top-level `dra: true`: every component runs with --allocation-mode=dra (docs/dra.md).
    # No feature gate is set for it: on v1.37.2 resource.k8s.io/v1, partitionable devices
    # (shared counters) and the kubelet's DRA plugin API are on by default (the counters
    # survive the API server's field dropping: tests/integration/test_dra_pool.py)
    dra: bool = False
    # top-level `install: chart`: InstaSlice runs as pods from images built here, installed with
    # `helm install` on the real node (hack/cluster/chartinstall.py); `processes` (default):
    # the components run as local processes
    install: Install = "processes"

    def node_names(self) -> list[str]:
        return [n for g in self.groups for n in g.names()]

    @property
    def kwok_groups(self) -> tuple[NodeGroup, ...]:
        return tuple(g for g in self.groups if not g.real)

    @property
    def autoscaled_groups(self) -> tuple[NodeGroup, ...]:
        return tuple(g for g in self.groups if g.autoscaled_max is not None)

    @property
    def real_group(self) -> NodeGroup | None:
        """The `runtime: containerd` group (at most one: its kubelet uses host-wide paths)."""
        return next((g for g in self.groups if g.real), None)


def _group(i: int, e: Mapping[str, Any], base: Path | None = None) -> NodeGroup:
    where = f"nodes[{i}]"
    model_file = None
    if e.get("modelFile") is not None:
        model_file = Path(str(e["modelFile"]))
        if base is not None and not model_file.is_absolute():
            model_file = base / model_file
        try:
            table = load_model_file(model_file)
        except CatalogError as err:
            raise SpecError(f"{where}.modelFile: {err}") from None
        if e.get("model", table.name) != table.name:
            raise SpecError(f"{where}.model: {e['model']!r} but {model_file} defines {table.name}")
        e = {**e, "model": table.name}
    try:
        prefix, count, gpus, model = str(e["prefix"]), int(e["count"]), int(e["gpus"]), e["model"]
    except KeyError as err:
        raise SpecError(f"{where}: missing {err.args[0]!r}") from None
    except (TypeError, ValueError) as err:
        raise SpecError(f"{where}: {err}") from None
    mig_mode = e.get("migMode", "enabled")
    if mig_mode not in ("enabled", "disabled"):
        raise SpecError(f"{where}.migMode: {mig_mode!r} is not 'enabled' or 'disabled'")
    if count < 0 or gpus < 0:
        raise SpecError(f"{where}: count and gpus must be >= 0")
    runtime = e.get("runtime", "kwok")
    if runtime not in _RUNTIMES:
        raise SpecError(f"{where}.runtime: {runtime!r} is not one of {', '.join(_RUNTIMES)}")
    if runtime == "containerd" and count != 1:
        raise SpecError(
            f"{where}.count: a runtime: containerd group is one real node on this machine; "
            f"count must be 1, not {count}"
        )
    autoscaled_max = None
    if (auto := e.get("autoscaled")) is not None:
        if not isinstance(auto, Mapping) or not isinstance(auto.get("max"), int) or auto["max"] < 1:
            raise SpecError(f"{where}.autoscaled: must be {{max: N}} with an integer N >= 1")
        if count != 0 or runtime != "kwok":
            raise SpecError(
                f"{where}.count: an autoscaled group starts with no nodes (count: 0, KWOK); "
                f"the autoscaler creates them"
            )
        autoscaled_max = int(auto["max"])
    taints = []
    for j, t in enumerate(e.get("taints") or []):
        if t.get("effect") not in _EFFECTS or not t.get("key"):
            raise SpecError(f"{where}.taints[{j}]: needs a key and an effect in {_EFFECTS}")
        taints.append(Taint(key=str(t["key"]), effect=t["effect"], value=str(t.get("value", ""))))
    return NodeGroup(
        prefix=prefix,
        count=count,
        gpus=gpus,
        model=str(model),
        mig_mode=mig_mode,
        cpu=str(e.get("cpu", "64")),
        memory=str(e.get("memory", "512Gi")),
        pods=int(e.get("pods", 110)),
        taints=tuple(taints),
        labels={str(k): str(v) for k, v in (e.get("labels") or {}).items()},
        runtime=runtime,
        autoscaled_max=autoscaled_max,
        model_file=model_file,
    )


def parse_spec(doc: Mapping[str, Any], base: Path | None = None) -> ClusterSpec:
    """`base`: the directory relative `modelFile` paths are read from (the spec file's)."""
    entries = doc.get("nodes")
    if not isinstance(entries, list):
        raise SpecError("spec needs a top-level 'nodes' list")
    kueue = doc.get("kueue", False)
    if not isinstance(kueue, bool):
        raise SpecError(f"kueue: {kueue!r} is not true or false")
    slots = doc.get("slotAccounting", False)
    if not isinstance(slots, bool):
        raise SpecError(f"slotAccounting: {slots!r} is not true or false")
    dra = doc.get("dra", False)
    if not isinstance(dra, bool):
        raise SpecError(f"dra: {dra!r} is not true or false")
    install = doc.get("install", "processes")
    if install not in get_args(Install):
        raise SpecError(f"install: {install!r} is not one of {', '.join(get_args(Install))}")
    spec = ClusterSpec(
        tuple(_group(i, e, base) for i, e in enumerate(entries)),
        kueue=kueue,
        slot_accounting=slots,
        dra=dra,
        install=install,
    )
    if install == "chart" and spec.real_group is None:
        raise SpecError(
            "install: chart needs a `runtime: containerd` group (InstaSlice's pods run there)"
        )
    names = spec.node_names()
    if len(set(names)) != len(names):
        raise SpecError("node names collide; give each group its own prefix")
    real = [i for i, g in enumerate(spec.groups) if g.real]
    if len(real) > 1:
        raise SpecError(
            f"nodes[{real[1]}].runtime: only one group may be runtime: containerd "
            f"(nodes[{real[0]}] is already; a real node uses host-wide kubelet paths)"
        )
    return spec


def load_spec(path: Path) -> ClusterSpec:
    return parse_spec(yaml.safe_load(path.read_text()), base=path.parent)


def node_manifest(group: NodeGroup, index: int) -> dict[str, Any]:
    """The Node object for `group`'s `index`-th node (a plain dict, ready to POST)."""
    resources = {"cpu": group.cpu, "memory": group.memory, "pods": str(group.pods)}
    name = f"{group.prefix}-{index}"
    labels = {
        **group.labels,
        KWOK_TYPE_LABEL[0]: KWOK_TYPE_LABEL[1],
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        GPU_MODEL_LABEL: group.model,
        GPU_COUNT_LABEL: str(group.gpus),
        MIG_MODE_LABEL: group.mig_mode,
    }
    spec: dict[str, Any] = {}
    if group.taints:
        spec["taints"] = [
            {"key": t.key, "value": t.value, "effect": t.effect} for t in group.taints
        ]
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": labels,
            "annotations": {KWOK_NODE_ANNOTATION[0]: KWOK_NODE_ANNOTATION[1]},
        },
        "spec": spec,
        "status": {"capacity": dict(resources), "allocatable": dict(resources)},
    }


def node_manifests(spec: ClusterSpec) -> list[dict[str, Any]]:
    """The KWOK nodes' objects; a real node registers itself (its kubelet)."""
    return [node_manifest(g, i) for g in spec.kwok_groups for i in range(g.count)]


def node_labels(group: NodeGroup, name: str) -> dict[str, str]:
    """The labels a group's node carries (without KWOK's `type` label)."""
    return {
        k: v for k, v in node_manifest(group, 0)["metadata"]["labels"].items()
        if k != KWOK_TYPE_LABEL[0]
    } | {"kubernetes.io/hostname": name}  # fmt: skip


async def create_nodes(
    api: client.ApiClient, spec: ClusterSpec, *, exist_ok: bool = True, concurrency: int = 32
) -> list[str]:
    """Create the spec's nodes (already existing ones are kept if `exist_ok`); returns names."""
    core = client.CoreV1Api(api)
    sem = asyncio.Semaphore(concurrency)

    async def one(body: dict[str, Any]) -> None:
        async with sem:
            try:
                # the generated client sends a plain dict as-is; its stubs only say V1Node
                await core.create_node(cast(Any, body))
            except ApiException as e:
                if not (exist_ok and e.status == 409):
                    raise

    manifests = node_manifests(spec)
    async with asyncio.TaskGroup() as tg:
        for m in manifests:
            tg.create_task(one(m))
    return [m["metadata"]["name"] for m in manifests]


_LIFECYCLE_TAINTS: Final = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")


def _ready(node: Any) -> bool:
    """Ready=True, and KCM has lifted the not-ready taint (TaintNodesByCondition puts it on
    every new node), so the scheduler can use the node."""
    conditions = (node.status.conditions if node.status else None) or []
    taints = (node.spec.taints if node.spec else None) or []
    return any(c.type == "Ready" and c.status == "True" for c in conditions) and not any(
        t.key in _LIFECYCLE_TAINTS for t in taints
    )


async def wait_nodes_ready(
    api: client.ApiClient, names: Sequence[str], *, timeout_s: float = 60.0
) -> None:
    """Block until every named node is Ready (KWOK) and untainted (KCM), i.e. schedulable."""
    core = client.CoreV1Api(api)
    pending = set(names)
    async with asyncio.timeout(timeout_s):
        listing = await core.list_node()
        pending -= {n.metadata.name for n in listing.items if _ready(n)}
        rv = listing.metadata.resource_version
        while pending:
            async with watch.Watch() as w:
                async for ev in w.stream(
                    core.list_node, resource_version=rv, timeout_seconds=int(timeout_s) + 5
                ):
                    node = ev["object"]
                    rv = node.metadata.resource_version
                    if _ready(node):
                        pending.discard(node.metadata.name)
                    if not pending:
                        break
