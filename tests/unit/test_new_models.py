"""GPU models in no catalog: the pure pieces, table-driven.

Covers: model table files (`common.catalog.load_model_file`: the X10 of hack/specs/models,
errors naming the field, JSON round trip); `common.catalog.learned` (a MigNode table that
agrees with the catalog plans with the catalog's entry, one that differs or names a model
the catalog lacks is learned, memoised per table); the engine with a GPU's own geometry
(10 slots, unaligned 3g placements, a 5-slot 4g; a geometry with a catalog name but other
placements never reuses the catalog's cached answers; catalog GPUs keep their keys, so
catalog decisions are unchanged); the webhook's offered-profile index and the refusal that
lists the offered profiles; the emulator keeping a table model in its state file; the
cluster spec's `modelFile`.
Leaves out: random snapshots (test_placement_properties.py draws the same geometries), the
agent reading NVML (tests/e2e/test_new_model.py and the discovery below through the
emulator), the system (tests/e2e/test_new_model.py).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from common.catalog import (
    CatalogError,
    GpuModel,
    load_catalog,
    load_model_file,
    model_to_json,
    parse_model,
)
from common.catalog.learned import Geometries
from common.objects import MigProfileStatus
from common.placement import Gpu, NodeState, Occupied, Placement, Snapshot, place
from common.placement.geometry import token
from common.placement.model import Pending, PendingReason, PodRequest, Policy, SliceRequest
from hack.cluster.nodes import SpecError, load_spec, parse_spec
from nodeagent.discover import discover
from nodeagent.emulator import EmulatedNvml, EmulatorControl, provision
from nodeagent.model import Health
from nodeagent.report import gpu_status
from testkit import builders
from webhook.admission import review
from webhook.offered import OfferedProfiles
from webhook.reviews import Denied
from webhook.settings import AdmissionSettings

REPO = Path(__file__).resolve().parents[2]
X10_FILE = REPO / "hack" / "specs" / "models" / "x10-120gb.yaml"
X10 = load_model_file(X10_FILE)
CATALOG = load_catalog()


def _h100() -> GpuModel:
    m = CATALOG.model("H100-80GB")
    assert m is not None
    return m


# --- table files -----------------------------------------------------------------------------


def test_the_x10_table_is_a_10_slot_model_in_no_catalog() -> None:
    assert CATALOG.model(X10.name) is None
    assert (X10.memory_slots, X10.compute_slices) == (10, 8)
    three = X10.profile("3g.36gb")
    assert three is not None and three.starts == (0, 3, 6) and three.memory_slots == 3
    assert parse_model(json.loads(json.dumps(model_to_json(X10)))) == X10


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda d: d.pop("memorySlots"), "missing field 'memorySlots'"),
        (lambda d: d["profiles"][3].pop("starts"), "profiles[3]: missing field 'starts'"),
        (lambda d: d["profiles"][0].update(maxCount=0), "profiles[0].maxCount: 0"),
        (lambda d: d["profiles"][4].update(starts=[0, 6]), "profiles[4].starts: [6] + size 5"),
        (lambda d: d["profiles"][1].update(engines={"nvenc": 1}), "profiles[1].engines"),
        (lambda d: d.update(profiles=[]), "profiles: a non-empty list"),
    ],
)
def test_a_bad_table_names_the_field(edit: Any, words: str, tmp_path: Path) -> None:
    doc = model_to_json(X10)
    edit(doc)
    path = tmp_path / "bad.yaml"
    path.write_text(json.dumps(doc))
    with pytest.raises(CatalogError, match=None) as err:
        load_model_file(path)
    assert str(path) in str(err.value) and words in str(err.value), err.value


# --- learned geometries --------------------------------------------------------------------


def _published(model: GpuModel) -> list[MigProfileStatus]:
    """What the node agent publishes for a GPU whose NVML reports exactly `model`."""
    return gpu_status(builders.gpu(0, "GPU-0", model), Health(), [], [])["profiles"]


def test_a_table_that_agrees_with_the_catalog_plans_with_the_catalog() -> None:
    geo = Geometries(CATALOG)
    assert geo.of("H100-80GB", _published(_h100())) is None
    assert geo.of("H100-80GB", []) is None  # an agent that published nothing (MIG off)
    old_agent = [{k: v for k, v in p.items() if k not in ("engines", "computeSlices")}
                 for p in _published(_h100())]  # fmt: skip
    assert geo.of("H100-80GB", old_agent) is None


def test_a_model_in_no_catalog_is_learned_from_its_table() -> None:
    geo = Geometries(CATALOG)
    learned = geo.of("NVIDIA X10", _published(X10))
    assert learned is not None
    assert (learned.name, learned.memory_slots, learned.compute_slices) == ("NVIDIA X10", 10, 8)
    for p in X10.profiles:
        q = learned.profile(p.name)
        assert q is not None
        assert (q.memory_slots, q.starts, q.max_count, q.engines, q.compute_slices) == (
            p.memory_slots, p.starts, p.max_count, p.engines, p.compute_slices,
        )  # fmt: skip
    assert geo.of("NVIDIA X10", _published(X10)) is learned  # one object per table


def test_a_catalog_model_whose_driver_differs_is_learned_nvml_wins() -> None:
    table = _published(_h100())
    one_g = next(p for p in table if p["name"] == "1g.10gb")
    one_g["placements"] = [pl for pl in one_g["placements"] if pl["start"] % 2 == 0]
    learned = Geometries(CATALOG).of("H100-80GB", table)
    assert learned is not None and learned.name == "H100-80GB"
    profile = learned.profile("1g.10gb")
    assert profile is not None and profile.starts == (0, 2, 4, 6)


def test_unplaceable_rows_are_not_learned() -> None:
    rows: list[dict[str, Any]] = [
        {"name": "1g.5gb", "id": 1, "maxCount": 2, "placements": []},
        {"bogus": True},
    ]
    assert Geometries(CATALOG).of("NVIDIA Y", rows) is None


# --- the engine with a GPU's own geometry ------------------------------------------------


def _node(name: str, *gpus: Gpu) -> NodeState:
    return NodeState(name, cpu_millis_free=64_000, memory_bytes_free=1 << 40, pods_free=10,
                     gpus=gpus)  # fmt: skip


def _x10(index: int = 0, occupied: tuple[tuple[str, int], ...] = ()) -> Gpu:
    occ = []
    for name, start in occupied:
        p = X10.profile(name)
        assert p is not None
        occ.append(Occupied(start, p.memory_slots, name))
    return Gpu(index, X10.name, occupied=tuple(occ), geometry=X10)


def _place(snap: Snapshot, *asks: tuple[str, int], policy: Policy = Policy.INSTASLICE) -> Any:
    req = PodRequest(
        "p", slices=tuple(SliceRequest(f"c{i}", p, n) for i, (p, n) in enumerate(asks))
    )
    return place(snap, req, policy)


@pytest.mark.parametrize("policy", [Policy.INSTASLICE, Policy.FIRST_FIT, Policy.SPREAD])
@pytest.mark.parametrize(
    ("occupied", "ask", "legal"),
    [
        ((), ("4g.60gb", 1), {(0, 5), (5, 5)}),
        ((("4g.60gb", 0),), ("3g.36gb", 1), {(6, 3)}),  # starts 0 and 3 overlap [0, 5)
        ((("4g.60gb", 5),), ("3g.36gb", 1), {(0, 3)}),  # 3 and 6 overlap [5, 10)
        ((("3g.36gb", 3),), ("4g.60gb", 1), set()),  # [3, 6) breaks both halves
        ((("1g.12gb", 9),), ("8g.120gb", 1), set()),
        ((), ("8g.120gb", 1), {(0, 10)}),
        ((("2g.24gb", 8),), ("2g.24gb", 3), {(0, 2), (2, 2), (4, 2), (6, 2)}),
        ((("2g.24gb", 8),), ("2g.24gb", 4), set()),  # maxCount 4, one is there
    ],
)
def test_the_engine_places_on_a_10_slot_geometry(
    policy: Policy,
    occupied: tuple[tuple[str, int], ...],
    ask: tuple[str, int],
    legal: set[tuple[int, int]],
) -> None:
    result = _place(Snapshot((_node("x", _x10(0, occupied)),)), ask, policy=policy)
    if not legal:
        assert isinstance(result, Pending), result
        assert result.reason in (PendingReason.FULL, PendingReason.FRAGMENTED), result
        return
    assert isinstance(result, Placement), result
    got = [(s.start, s.size) for s in result.slices]
    assert set(got) <= legal and len(set(got)) == len(got) == ask[1], (got, legal)


def test_static_balanced_uses_the_10_slot_all_balanced_layout() -> None:
    """2x1g + 1x2g + 1x3g, largest at its highest start: 3g at 6, the rest from 0 up."""
    snap = Snapshot((_node("x", _x10()),))
    got: dict[str, list[int]] = {}
    for profile in ("3g.36gb", "2g.24gb", "1g.12gb", "1g.12gb"):
        result = _place(snap, (profile, 1), policy=Policy.STATIC_BALANCED)
        assert isinstance(result, Placement), result
        s = result.slices[0]
        got.setdefault(profile, []).append(s.start)
        (gpu,) = snap.nodes[0].gpus
        gpu = replace(gpu, occupied=(*gpu.occupied, Occupied(s.start, s.size, profile)))
        snap = Snapshot((replace(snap.nodes[0], gpus=(gpu,)),))
    assert got == {"3g.36gb": [6], "2g.24gb": [0], "1g.12gb": [2, 3]}, got
    result = _place(snap, ("1g.12gb", 1), policy=Policy.STATIC_BALANCED)
    assert isinstance(result, Pending), result


def test_more_2g_than_the_count_limit_is_refused() -> None:
    result = _place(Snapshot((_node("x", _x10()),)), ("2g.24gb", 5))
    assert isinstance(result, Pending), result


def test_a_10_slot_gpu_and_a_catalog_gpu_share_one_node() -> None:
    h100 = Gpu(1, "H100-80GB")
    snap = Snapshot((_node("mixed", _x10(0), h100),))
    result = _place(snap, ("3g.36gb", 1), ("3g.40gb", 1))
    assert isinstance(result, Placement), result
    by_profile = {s.profile: s for s in result.slices}
    assert by_profile["3g.36gb"].gpu_index == 0 and by_profile["3g.36gb"].size == 3
    assert by_profile["3g.40gb"].gpu_index == 1 and by_profile["3g.40gb"].size == 4


def test_no_node_offering_the_profile_names_it() -> None:
    result = _place(Snapshot((_node("h", Gpu(0, "H100-80GB")),)), ("4g.60gb", 1))
    assert isinstance(result, Pending) and result.reason is PendingReason.NO_PROFILE, result


def test_a_geometry_with_a_catalog_name_never_shares_its_cached_answers() -> None:
    """1g.10gb on an empty catalog H100 goes to slot 5 (docs/placement.md). The variant,
    same name, allows only even starts: warm the catalog's caches first, then ask again."""
    h100 = _h100()
    variant = replace(
        h100,
        profiles=tuple(
            replace(p, starts=tuple(s for s in p.starts if s % 2 == 0))
            if p.memory_slots == 1 else p
            for p in h100.profiles
        ),
        _by_name={},
    )  # fmt: skip
    catalog = _place(Snapshot((_node("a", Gpu(0, "H100-80GB")),)), ("1g.10gb", 1))
    assert isinstance(catalog, Placement) and catalog.slices[0].start % 2 == 1, catalog
    mine = _place(Snapshot((_node("a", Gpu(0, "H100-80GB", geometry=variant)),)), ("1g.10gb", 1))
    assert isinstance(mine, Placement) and mine.slices[0].start % 2 == 0, mine
    assert token(variant) != token(replace(variant, name="other", _by_name={}))
    assert token(variant) == token(replace(variant, _by_name={}))  # content, not identity


def test_catalog_gpus_keep_their_keys() -> None:
    """A GPU without its own geometry is keyed by its model name, as before: the catalog's
    decisions and caches are those of the engine without this feature."""
    g = Gpu(0, "H100-80GB", occupied=(Occupied(0, 1, "1g.10gb"),))
    assert g.tables_key == "H100-80GB" and g.key.startswith("H100-80GB\x1e")
    assert _x10().tables_key.startswith("X10-120GB@")


# --- admission ---------------------------------------------------------------------------


def _mig_node(name: str, profiles: list[str]) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "status": {"gpus": [{"index": 0, "profiles": [{"name": p, "id": 0} for p in profiles]}]},
    }


def test_offered_profiles_follow_the_mig_nodes() -> None:
    offered = OfferedProfiles(CATALOG.profile_names())
    assert offered.known == CATALOG.profile_names() and not offered.cluster
    offered.update("ADDED", _mig_node("x10-0", ["3g.36gb", "4g.60gb"]))
    offered.update("ADDED", _mig_node("h100-0", ["1g.10gb"]))
    assert offered.cluster == {"3g.36gb", "4g.60gb", "1g.10gb"}
    assert {"3g.36gb", "4g.60gb"} <= offered.known
    offered.update("DELETED", _mig_node("x10-0", []))
    assert offered.cluster == {"1g.10gb"} and "3g.36gb" not in offered.known


def _review(profile: str, settings: AdmissionSettings) -> Any:
    pod = {
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": {"containers": [{"name": "c", "resources": {"limits": {
            f"nvidia.com/mig-{profile}": "1"}}}]},
    }  # fmt: skip
    req = {"uid": "u", "kind": {"group": "", "version": "v1", "kind": "Pod"},
           "operation": "CREATE", "namespace": "ns", "object": pod}  # fmt: skip
    return review(req, settings, new_claim=lambda: "c000000000000000")  # type: ignore[arg-type]


def test_admission_accepts_a_published_profile_and_lists_the_offered_on_a_typo() -> None:
    base = AdmissionSettings.from_catalog()
    assert isinstance(_review("3g.36gb", base), Denied)  # the catalog alone: unknown
    cluster = frozenset({"3g.36gb", "4g.60gb", "1g.10gb"})
    settings = replace(base, known_profiles=base.known_profiles | cluster, cluster_profiles=cluster)
    assert not isinstance(_review("3g.36gb", settings), Denied)
    denied = _review("3g.63gb", settings)
    assert isinstance(denied, Denied)
    assert "unknown MIG profile 3g.63gb" in denied.message
    assert "no GPU model in the catalog offers it" in denied.message  # the old words stay
    assert "did you mean 3g.36gb" in denied.message
    assert "The cluster's GPUs offer: 1g.10gb, 3g.36gb, 4g.60gb" in denied.message
    empty = _review("3g.63gb", base)
    assert "No node has published its GPUs yet, the catalog offers: 1g.10gb, " in empty.message


# --- emulator and cluster spec --------------------------------------------------------------


def test_the_emulator_serves_a_table_model_and_the_agent_publishes_it(tmp_path: Path) -> None:
    assert provision(tmp_path, "x", [X10.name] * 2, tables=(X10,)) == "created"
    assert provision(tmp_path, "x", [X10.name] * 2, tables=(X10,)) == "kept"
    state = EmulatorControl(tmp_path, "x").state()  # read back from the file
    assert [g.spec for g in state.gpus] == [X10, X10]
    inv = discover(EmulatedNvml(tmp_path, "x"), CATALOG)
    gpu = inv.gpus[0]
    assert gpu.model == "NVIDIA X10" and not any("placements" in w for w in gpu.warnings)
    published = gpu_status(gpu, Health(), [], [])["profiles"]
    learned = Geometries(CATALOG).of(gpu.model, published)
    assert learned is not None and learned.memory_slots == 10
    assert {p.name: p.starts for p in learned.profiles} == {p.name: p.starts for p in X10.profiles}
    assert {p.name: p.engines for p in learned.profiles} == {
        p.name: p.engines for p in X10.profiles
    }


def test_every_catalog_model_published_by_the_agent_plans_with_the_catalog(
    tmp_path: Path,
) -> None:
    geo = Geometries(CATALOG)
    for m in CATALOG.models:
        provision(tmp_path, m.name, [m.name])
        gpu = discover(EmulatedNvml(tmp_path, m.name), CATALOG).gpus[0]
        published = gpu_status(gpu, Health(), [], [])["profiles"]
        assert geo.of(gpu.model, published) is None, m.name


def test_the_cluster_spec_names_a_model_file() -> None:
    spec = load_spec(REPO / "hack" / "specs" / "new-model.yaml")
    group = spec.groups[0]
    assert (group.model, group.model_file) == ("X10-120GB", X10_FILE)
    with pytest.raises(SpecError, match=r"nodes\[0\]\.model: 'H100-80GB' but"):
        parse_spec({"nodes": [{"prefix": "x", "count": 1, "gpus": 1, "model": "H100-80GB",
                               "modelFile": str(X10_FILE)}]})  # fmt: skip
    with pytest.raises(SpecError, match=r"nodes\[0\]\.modelFile: .*missing"):
        parse_spec({"nodes": [{"prefix": "x", "count": 1, "gpus": 1,
                               "modelFile": "/nonexistent/missing.yaml"}]})  # fmt: skip
