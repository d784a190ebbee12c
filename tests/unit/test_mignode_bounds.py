"""One node agent's MigNode must not stall placement cluster-wide (docs/security.md).

Covers: the bounds check of a MigNode GPU entry (`common.objects.gpu_out_of_bounds`: slots,
starts, sizes, profile, placement and instance counts, placements of distinct shapes, the
model name), the CRD's bounds being the same, the per-node bound on learned tables, and the
allocator's answer to a GPU beyond them — an unhealthy GPU of no model, nothing placed there,
whatever it claims (a placement at slot 20, a start of 10^18) — told once as a
`GpuOutOfBounds` Warning on the MigNode and as the gauge `instaslice_allocator_gpus_refused`;
the catalog refusing a model past the slot bound; the capped table caches
(`tables.model_tables`, `search.CatalogTables`); a table the allocator has not met built off
its event loop, and a learned model placed as before. Leaves out: the CRD's own refusal on
the API server (tests/integration/test_mignode_bounds.py), the time a table takes
(bench/table_build.py).
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from common.catalog import (
    CatalogError,
    GpuModel,
    load_catalog,
    load_model_file,
    model_to_json,
    parse_model,
)
from common.constants import (
    MIG_MAX_GPUS,
    MIG_MAX_INSTANCES,
    MIG_MAX_MEMORY_SLOTS,
    MIG_MAX_MODEL_NAME,
    MIG_MAX_NODE_TABLES,
    MIG_MAX_PROFILES,
    REASON_GPU_OUT_OF_BOUNDS,
)
from common.objects import gpu_out_of_bounds
from common.placement import Pending, PodRequest, Policy, SliceRequest
from common.placement import search as search_module
from common.placement import tables as tables_module
from common.placement.geometry import token
from common.placement.search import CatalogTables
from common.placement.tables import MODEL_TABLES_CAP, TableTooLarge, model_tables
from testkit.builders import GpuSpec, make_mig_node, make_node, make_pod, profile_entries
from testkit.clock import FakeClock, settle
from tests.unit.test_allocator_controller import (
    RecordingKube,
    allocated_nodes,
    controller,
    event_reasons,
    leading,
)
from webhook.allocator.state import ClusterState

pytestmark = pytest.mark.timeout(20)

ROOT = Path(__file__).resolve().parents[2]
X10 = load_model_file(ROOT / "hack/specs/models/x10-120gb.yaml")
Obj = dict[str, Any]


def h100_node(name: str = "n1") -> Obj:
    return make_mig_node(name, [GpuSpec()])


def edited(change: str) -> Obj:
    """An H100 MigNode with one entry changed as a misbehaving agent would write it."""
    mig = h100_node()
    gpu = mig["status"]["gpus"][0]
    one_g = gpu["profiles"][0]
    match change:
        case "placement at slot 20":
            one_g["placements"].append({"start": 20, "size": 1})
        case "start 10^18":
            one_g["placements"].append({"start": 10**18, "size": 1})
        case "size 10^18":
            one_g["placements"].append({"start": 0, "size": 10**18})
        case "start + size 17":
            one_g["placements"].append({"start": 15, "size": 2})
        case "negative start":
            one_g["placements"].append({"start": -1, "size": 1})
        case "instance at 10^18":
            gpu["slices"] = [{"profile": "1g.10gb", "start": 10**18, "size": 1, "migUUID": "m"}]
        case "too many profiles":
            gpu["profiles"] = [
                {**one_g, "name": f"1g.{i}gb", "id": 100 + i} for i in range(MIG_MAX_PROFILES + 1)
            ]
        case "too many placements":
            one_g["placements"] = [{"start": 0, "size": 1}] * (MIG_MAX_MEMORY_SLOTS + 1)
        case "too many distinct placements":  # 5 shapes of 15: what a table build iterates
            gpu["profiles"] = [
                {**one_g, "name": f"1g.{i}gb", "id": 100 + i, "placements": [
                    {"start": s, "size": 1} for s in range(16) if s != i]}
                for i in range(5)
            ]  # fmt: skip
        case "huge model name":
            gpu["model"] = "X" * 100_000
        case "placement not an object":
            one_g["placements"].append("0:1")
    return mig


BAD = [
    "placement at slot 20",
    "start 10^18",
    "size 10^18",
    "start + size 17",
    "negative start",
    "instance at 10^18",
    "too many profiles",
    "too many placements",
    "too many distinct placements",
    "huge model name",
    "placement not an object",
]


def one_g(profile: str = "1g.10gb") -> PodRequest:
    return PodRequest("ns/p", cpu_millis=100, slices=(SliceRequest("main", profile, 1),))


@pytest.mark.parametrize("change", BAD)
def test_a_gpu_beyond_the_bounds_is_refused_as_unhealthy_of_no_model(change: str) -> None:
    """Finding 3: a placement at slot 20+ (or a start of 10^18) made the leader iterate
    2^21 (2^10^18) occupancy masks on its event loop. Now the GPU is refused before any
    table is learned or built from it, and the pod is not placed there."""
    mig = edited(change)
    problem = gpu_out_of_bounds(mig["status"]["gpus"][0])
    assert problem and len(problem) < 200  # a message, never the huge value itself
    state = ClusterState()
    state.upsert_node(make_node("n1", gpus=1))
    state.upsert_mig_node(mig)
    (gpu,) = state.gpus["n1"]
    assert (gpu.healthy, gpu.model, gpu.geometry, gpu.instances) == (False, "", None, ())
    assert gpu.refused == problem
    assert isinstance(state.decide(one_g(), Policy.INSTASLICE, None), Pending)


def test_the_crd_bounds_are_the_allocators() -> None:
    """manifests/base/crds/mignodes.yaml refuses what `gpu_out_of_bounds` refuses (the API
    server's refusal itself: tests/integration/test_mignode_bounds.py)."""
    crd = yaml.safe_load((ROOT / "manifests/base/crds/mignodes.yaml").read_text())
    status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    gpus = status["properties"]["gpus"]
    gpu = gpus["items"]["properties"]
    placements = gpu["profiles"]["items"]["properties"]["placements"]
    slices = gpu["slices"]
    assert gpus["maxItems"] == MIG_MAX_GPUS and gpu["index"]["maximum"] == MIG_MAX_GPUS - 1
    assert gpu["model"]["maxLength"] == MIG_MAX_MODEL_NAME
    assert gpu["profiles"]["maxItems"] == MIG_MAX_PROFILES
    assert placements["maxItems"] == MIG_MAX_MEMORY_SLOTS
    assert slices["maxItems"] == MIG_MAX_INSTANCES
    for ranges in (placements["items"], slices["items"]):
        assert ranges["properties"]["start"]["maximum"] == MIG_MAX_MEMORY_SLOTS - 1
        assert ranges["properties"]["size"]["maximum"] == MIG_MAX_MEMORY_SLOTS
        (rule,) = ranges["x-kubernetes-validations"]
        assert rule["rule"] == f"self.start + self.size <= {MIG_MAX_MEMORY_SLOTS}"


def test_a_gpu_within_the_bounds_is_served_as_before() -> None:
    """The table as the catalog has it is placed on; one whose last placement ends at the
    bound's very edge (slot 16) is within it (a 16-slot table takes seconds here: not built)."""
    state = ClusterState()
    state.upsert_node(make_node("n1", gpus=1))
    state.upsert_mig_node(h100_node())
    assert not state.gpus["n1"][0].refused
    assert not isinstance(state.decide(one_g(), Policy.INSTASLICE, None), Pending)
    edge = h100_node()["status"]["gpus"][0]
    edge["profiles"][0]["placements"].append({"start": MIG_MAX_MEMORY_SLOTS - 1, "size": 1})
    edge["slices"] = [{"profile": "1g.10gb", "start": MIG_MAX_MEMORY_SLOTS - 1, "size": 1}]
    assert gpu_out_of_bounds(edge) is None
    variants = h100_node()["status"]["gpus"][0]  # 32 profiles, variants of 4 shapes (of 64)
    one = variants["profiles"][0]
    shapes = [[{"start": s, "size": 1} for s in range(16) if s != k] for k in range(4)]
    variants["profiles"] = [
        {**one, "name": f"1g.{i}gb", "placements": shapes[i % 4]} for i in range(MIG_MAX_PROFILES)
    ]
    assert gpu_out_of_bounds(variants) is None


def test_a_node_with_more_distinct_tables_than_the_bound_gets_the_first_ones() -> None:
    """Each table that differs from the catalog's is built once; a node publishing a new one
    for every GPU (and changing them on every write) would cost that many builds a write."""
    mig = make_mig_node("n1", [GpuSpec()] * (MIG_MAX_NODE_TABLES + 2))
    for i, gpu in enumerate(mig["status"]["gpus"]):
        gpu["model"] = f"NVIDIA X{i % (MIG_MAX_NODE_TABLES + 1)}"  # the last repeats the first
    state = ClusterState()
    state.upsert_mig_node(mig)
    refused = [g.index for g in state.gpus["n1"] if g.refused]
    assert refused == [MIG_MAX_NODE_TABLES]
    assert [g.index for g in state.gpus["n1"] if g.geometry is not None] == [
        i for i in range(MIG_MAX_NODE_TABLES + 2) if i != MIG_MAX_NODE_TABLES
    ]


def test_the_catalog_and_the_tables_refuse_a_model_past_the_slot_bound() -> None:
    doc = model_to_json(X10)
    doc["memorySlots"] = MIG_MAX_MEMORY_SLOTS + 1
    with pytest.raises(CatalogError, match="memorySlots"):
        parse_model(doc)
    big = replace(X10, memory_slots=40)
    with pytest.raises(TableTooLarge):
        model_tables(big)  # refused before 2^40 masks are iterated


async def test_a_refused_gpu_is_told_on_the_mignode_once_and_gauged() -> None:
    """Who writes MigNode status is the agent alone (its conditions would be overwritten by
    the next publish), so the allocator tells it as an Event on the MigNode, when the
    refusal changes, and as a gauge."""
    kube, clock = RecordingKube(), FakeClock()
    c = controller(kube, clock)
    c.metrics.state_gauges.source = c._gauge_view
    reg = c.metrics.registry
    async with leading(c):
        await c.handlers.on_node("ADDED", make_node("n1", gpus=1))
        await c.handlers.on_mig_node("ADDED", edited("start 10^18"))
        await c.handlers.on_mig_node("MODIFIED", edited("start 10^18"))  # the same: not told again
        await settle()
        events = [w[2] for w in kube.writes("create") if w[1].endswith("/events")]
        assert [e["reason"] for e in events] == [REASON_GPU_OUT_OF_BOUNDS]
        assert events[0]["involvedObject"]["kind"] == "MigNode"
        assert events[0]["involvedObject"]["name"] == "n1"
        assert "GPU 0" in events[0]["message"] and "memory slots" in events[0]["message"]
        gauge = {"node": "n1", "gpu": "0"}
        assert reg.get_sample_value("instaslice_allocator_gpus_refused", gauge) == 1
        await c.handlers.on_mig_node("MODIFIED", h100_node())  # fixed: served, gauge gone
        assert reg.get_sample_value("instaslice_allocator_gpus_refused", gauge) is None
        await c.handlers.on_pod("ADDED", make_pod("p", uid="p"))
    assert allocated_nodes(kube) == ["n1"]
    assert event_reasons(kube).count(REASON_GPU_OUT_OF_BOUNDS) == 1


def _model(name: str, slots: int = 4) -> GpuModel:
    """A small model with its own name (so its own table), 1-slot profile at every slot."""
    base = load_catalog().model("A30-24GB")
    assert base is not None
    return replace(base, name=name, memory_slots=slots)


def test_the_table_caches_never_exceed_their_cap() -> None:
    """Every distinct table an agent publishes was kept for the process's life (an
    unbounded functools.cache and a plain dict in CatalogTables)."""
    ct = CatalogTables(load_catalog())
    for i in range(MODEL_TABLES_CAP * 2 + 5):
        m = _model(f"cap-{uuid.uuid4().hex[:8]}-{i}")
        model_tables(m)
        assert ct.tables(token(m)) is not None
        assert model_tables.cache_info().currsize <= MODEL_TABLES_CAP
        assert len(ct) <= MODEL_TABLES_CAP


def learned_node(name: str, model: str) -> Obj:
    """A MigNode whose one GPU is a model in no catalog (the X10 table under `model`)."""
    mig = h100_node(name)
    gpu = mig["status"]["gpus"][0]
    gpu["model"] = model
    gpu["profiles"] = profile_entries(X10)
    return mig


async def test_a_new_table_is_built_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A table the allocator meets for the first time is built in a worker thread, then a
    pod on that learned model is placed as before (docs/configuration.md)."""
    real = tables_module.model_tables
    built: list[int] = []  # the thread of each build (a cache miss)

    def recording(model: GpuModel) -> Any:
        before = real.cache_info().misses
        out = real(model)
        if real.cache_info().misses > before:
            built.append(threading.get_ident())
        return out

    monkeypatch.setattr(tables_module, "model_tables", recording)
    monkeypatch.setattr(search_module, "model_tables", recording)
    kube, clock = RecordingKube(), FakeClock()
    c = controller(kube, clock)
    loop_thread = threading.get_ident()
    async with leading(c):
        await c.handlers.on_node("ADDED", make_node("n1", gpus=1))
        await c.handlers.on_mig_node(
            "ADDED", learned_node("n1", f"NVIDIA X10 {uuid.uuid4().hex[:8]}")
        )
        await c.handlers.on_pod("ADDED", make_pod("p", uid="p", slices={"main": {"3g.36gb": 1}}))
    assert allocated_nodes(kube) == ["n1"]
    assert built and loop_thread not in built
