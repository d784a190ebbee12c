"""The MIG catalog against its sources, and profile-name grammar.

Covers: every model loads with unique names/ids/enums; the H200 entry equals the real NVML
answers (tests/data/h200-141gb/nvml.json) and real `-lgipp` placements; every model's
values equal the per-GPU tables of docs/mig-facts.md §2 (ids, counts, placements, SMs,
GiB, engines; cells the reference leaves open are not checked); profile names follow
go-nvlib's GB rule; placements of one profile never overlap and lie inside the GPU;
lookups by name, PCI id and product; profile-name parse/print and resource-name mapping.
Leaves out: how the emulator or placement engine use the catalog (their own tests).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from common.catalog import GpuModel, load_catalog
from common.profiles import (
    ProfileName,
    ProfileNameError,
    instaslice_resource,
    nvidia_resource,
    parse_profile,
    profile_from_resource,
    profile_from_suffix,
    resource_suffix,
)

# The shared docs sit next to the checkout (../shared), as the project's hooks expect.
H200_DIR = Path(__file__).resolve().parents[1] / "data" / "h200-141gb"

CATALOG = load_catalog()


def model(name: str) -> GpuModel:
    found = CATALOG.model(name)
    assert found is not None, name
    return found


# ---- structure -----------------------------------------------------------------------------


def test_catalog_has_the_contract_models() -> None:
    names = [m.name for m in CATALOG.models]
    assert names == [
        "A30-24GB",
        "A100-40GB",
        "A100-80GB",
        "H100-80GB",
        "H100-94GB",
        "H100-96GB",
        "H200-141GB",
        "GH200-144GB",
        "B200-180GB",
        "RTX-PRO-6000",
    ]


@pytest.mark.parametrize("m", CATALOG.models, ids=lambda m: m.name)
def test_model_is_self_consistent(m: GpuModel) -> None:
    for attr in ("name", "id", "enum"):
        values = [getattr(p, attr) for p in m.profiles]
        assert len(values) == len(set(values)), f"{m.name}: duplicate profile {attr}"
    assert m.architecture in ("ampere", "hopper", "blackwell")
    assert m.nvml_arch == {"ampere": 7, "hopper": 9, "blackwell": 10}[m.architecture]
    assert m.pci_device_ids and m.product_names
    full = max(m.profiles, key=lambda p: p.memory_slots)
    assert full.memory_slots == m.memory_slots and full.starts == (0,)
    assert full.compute_slices == m.compute_slices
    for p in m.profiles:
        assert p.memory_mib <= m.memory_total_mib
        assert 0 <= p.enum < 17  # past the driver's NVML_GPU_INSTANCE_PROFILE_COUNT otherwise
        assert p.engines.fits_within(m.full_engines), p.name
        assert parse_profile(p.name).gi_slices == p.compute_slices


@pytest.mark.parametrize("m", CATALOG.models, ids=lambda m: m.name)
def test_placements_of_one_profile_never_overlap_and_fit(m: GpuModel) -> None:
    for p in m.profiles:
        assert list(p.starts) == sorted(set(p.starts)), p.name
        assert len(p.starts) >= p.max_count, p.name
        mask = 0
        for s in p.starts:
            assert s >= 0 and s + p.memory_slots <= m.memory_slots, (p.name, s)
            assert not mask & p.mask(s), (p.name, s)
            mask |= p.mask(s)


@pytest.mark.parametrize("m", CATALOG.models, ids=lambda m: m.name)
def test_profile_names_follow_go_nvlib_gb_rule(m: GpuModel) -> None:
    total_bytes = m.memory_total_mib << 20
    gpu_gb = math.ceil(total_bytes / 2**30)
    for p in m.profiles:
        frac = math.ceil((p.memory_mib << 20) / total_bytes * 8) / 8
        gb = math.floor(frac * gpu_gb + 0.5)  # Go's math.Round: halves away from zero
        assert parse_profile(p.name).memory_gb == gb, (p.name, p.memory_mib, gb)


# ---- the real H200 -------------------------------------------------------------------------


def test_h200_equals_real_nvml_answers() -> None:
    real = json.loads((H200_DIR / "nvml.json").read_text())["devices"][0]
    h200 = model("H200-141GB")
    assert real["pci_device_id"].lower() == f"{h200.pci_device_ids[0]:#x}".lower()
    assert real["mem_total"] >> 20 == h200.memory_total_mib
    assert real["arch"] == h200.nvml_arch
    assert real["name"] in h200.product_names
    assert not h200.inferred
    seen = 0
    for entry in real["gi_profiles"]:
        p = h200.profile_by_enum(entry["profile"])
        if "info_err" in entry:
            assert p is None, entry["const"]
            continue
        seen += 1
        assert p is not None, entry["const"]
        assert not p.inferred
        assert f"MIG {p.name}" == entry["name"]
        assert (p.id, p.max_count, p.compute_slices) == (
            entry["id"],
            entry["instanceCount"],
            entry["sliceCount"],
        )
        assert (p.multiprocessors, p.memory_mib) == (
            entry["multiprocessorCount"],
            entry["memorySizeMB"],
        )
        assert p.engines.as_tuple() == (
            entry["copyEngineCount"],
            entry["decoderCount"],
            entry["encoderCount"],
            entry["jpegCount"],
            entry["ofaCount"],
        )
        assert entry["remaining"] == p.max_count
    assert seen == len(h200.profiles) == 7


def test_h200_placements_equal_real_lgipp() -> None:
    found = {}
    for line in (H200_DIR / "lgipp.txt").read_text().splitlines():
        m = re.match(r"GPU\s+0 Profile ID\s+(\d+) Placements?\s*: \{([\d,]+)\}:(\d+)$", line)
        assert m, line
        found[int(m[1])] = (tuple(int(s) for s in m[2].split(",")), int(m[3]))
    h200 = model("H200-141GB")
    assert found == {p.id: (p.starts, p.memory_slots) for p in h200.profiles}


# ---- the reference tables (docs/mig-facts.md §2) -----------------------------------------

S1 = (0, 1, 2, 3, 4, 5, 6)
EVEN = (0, 2, 4, 6)


@dataclass(frozen=True)
class Row:
    """One reference-table row; None = the reference does not give that cell."""

    name: str
    id: int
    max: int
    starts: tuple[int, ...] | None
    size: int | None
    sm: int | None
    gib: str | None
    ce: int | None = None
    dec: int | None = None
    jpeg: int | None = None
    ofa: int | None = None
    enc: int | None = None


def eight_slot(names: list[str], sm: list[int | None], gib: list[str | None], eng: list[str]):
    """Rows of an 8-slot part, in the order 1g, 1g+me, 1g(2x mem), 2g, 3g, 4g, 7g."""
    layout = [(19, 7, S1, 1), (20, 1, S1, 1), (15, 4, EVEN, 2), (14, 3, (0, 2, 4), 2)]
    layout += [(9, 2, (0, 4), 4), (5, 1, (0,), 4), (0, 1, (0,), 8)]
    rows = []
    for n, (pid, mx, starts, size), s, g, e in zip(names, layout, sm, gib, eng, strict=True):
        ce, dec, jpeg, ofa = (None if x == "?" else int(x) for x in e.split("/"))
        rows.append(Row(n, pid, mx, starts, size, s, g, ce, dec, jpeg, ofa))
    return rows


TABLES: dict[str, list[Row]] = {
    "A30-24GB": [
        Row("1g.6gb", 14, 4, (0, 1, 2, 3), 1, 14, "5.81", 1, 1, 0, 0),
        Row("1g.6gb+me", 21, 1, (0, 1, 2, 3), 1, 14, "5.81", 1, 1, 1, 1),
        Row("2g.12gb", 5, 2, (0, 2), 2, 28, "11.69", 2, 2, 0, 0),
        Row("2g.12gb+me", 6, 1, (0, 2), 2, 28, "11.69", 2, 2, 1, 1),
        Row("4g.24gb", 0, 1, (0,), 4, 56, "23.44", 4, 4, 1, 1),
    ],
    "A100-40GB": eight_slot(
        ["1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"],
        [14, 14, 14, 28, 42, 56, 98],
        ["4.75", "4.75", "9.62", "9.62", "19.50", "19.50", "39.25"],
        ["1/0/0/0", "1/1/1/1", "1/1/0/0", "2/1/0/0", "3/2/0/0", "4/2/0/0", "7/5/1/1"],
    ),
    "A100-80GB": eight_slot(
        ["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"],
        [14, 14, 14, 28, 42, 56, 98],
        ["9.50", "9.50", "19.50", "19.50", "39.25", "39.25", "78.75"],
        ["1/0/0/0", "1/1/1/1", "1/1/0/0", "2/1/0/0", "3/2/0/0", "4/2/0/0", "7/5/1/1"],
    ),
    "H100-80GB": eight_slot(
        ["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"],
        [16, 16, 26, 32, 60, 64, 132],
        ["9.75", "9.75", "19.62", "19.62", "39.50", "39.50", "79.25"],
        ["1/1/1/0", "1/1/1/1", "1/1/1/0", "2/2/2/0", "3/3/3/0", "4/4/4/0", "8/7/7/1"],
    ),
    "H100-94GB": eight_slot(
        ["1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb"],
        [16, 16, 26, 32, 60, 64, 132],
        ["10.62", "10.62", "21.50", "21.50", "46.12", "46.12", "92.62"],
        ["1/1/1/0", "1/1/1/1", "1/1/1/0", "2/2/2/0", "3/3/3/0", "4/4/4/0", "8/7/7/1"],
    ),
    "H100-96GB": eight_slot(
        ["1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb"],
        [16, 16, 26, 32, 60, 64, 132],
        ["11.00", "11.00", "23.00", "23.00", "46.50", "46.50", "93.00"],
        ["1/1/1/0", "1/1/1/1", "1/1/1/0", "2/2/2/0", "3/3/3/0", "4/4/4/0", "8/7/7/1"],
    ),
    "H200-141GB": eight_slot(
        ["1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"],
        [16, 16, 26, 32, 60, 64, 132],
        ["16.00", "16.00", "32.50", "32.50", "69.75", "69.75", "140.00"],
        ["1/1/1/0", "1/1/1/1", "1/1/1/0", "2/2/2/0", "3/3/3/0", "4/4/4/0", "8/7/7/1"],
    ),
    # §2.8: only the first four rows are real; the rest are counts from config names.
    "GH200-144GB": eight_slot(
        ["1g.18gb", "1g.18gb+me", "1g.36gb", "2g.36gb", "3g.72gb", "4g.72gb", "7g.144gb"],
        [16, None, 26, 32, None, None, None],
        ["17.50", None, "35.25", "35.25", None, None, None],
        ["?/?/?/?"] * 7,
    ),
    # §2.9: 3g/4g/7g SMs and memory not found; CE from the user guide.
    "B200-180GB": eight_slot(
        ["1g.23gb", "1g.23gb+me", "1g.45gb", "2g.45gb", "3g.90gb", "4g.90gb", "7g.180gb"],
        [18, 18, 30, 36, None, None, None],
        ["22.00", "22.00", "44.25", "44.25", None, None, None],
        ["2/1/1/0", "2/1/1/1", "2/1/1/0", "4/2/2/0", "6/?/?/?", "8/?/?/?", "16/?/?/1"],
    ),
}
_Q = (0, 3, 6, 9)
TABLES["RTX-PRO-6000"] = [
    Row("1g.24gb", 14, 4, _Q, 3, 46, "23.62", 1, 1, 1, 0, enc=1),
    Row("1g.24gb+me", 21, 1, _Q, 3, 46, "23.62", 1, 1, 1, 1, enc=1),
    Row("1g.24gb+gfx", 47, 4, _Q, 3, 46, "23.62", 1, 1, 1, 0, enc=1),
    Row("1g.24gb+me.all", 65, 1, _Q, 3, 46, "23.62", 1, 4, 4, 1, enc=4),
    Row("1g.24gb-me", 67, 4, _Q, 3, 46, "23.62", 1, 0, 0, 0, enc=0),
    Row("2g.48gb", 5, 2, (0, 6), 6, 94, "47.38", 2, 2, 2, 0, enc=2),
    Row("2g.48gb+gfx", 35, 2, (0, 6), 6, 94, "47.38", 2, 2, 2, 0, enc=2),
    Row("2g.48gb+me.all", 64, 1, (0, 6), 6, 94, "47.38", 2, 4, 4, 1, enc=4),
    Row("2g.48gb-me", 66, 2, (0, 6), 6, 94, "47.38", 2, 0, 0, 0, enc=0),
    Row("4g.96gb", 0, 1, (0,), 12, 188, "95.12", 4, 4, 4, 1, enc=4),
    Row("4g.96gb+gfx", 32, 1, (0,), 12, 188, "95.12", 4, 4, 4, 1, enc=4),
]
# The H200 has no NVENC (nvml.json encoderCount 0).
TABLES["H200-141GB"] = [Row(**{**r.__dict__, "enc": 0}) for r in TABLES["H200-141GB"]]

CASES = [(m, r) for m, rows in TABLES.items() for r in rows]


def test_tables_cover_every_catalog_profile() -> None:
    assert set(TABLES) == {m.name for m in CATALOG.models}
    for m in CATALOG.models:
        assert [r.name for r in TABLES[m.name]] == [p.name for p in m.profiles], m.name


@pytest.mark.parametrize(("model_name", "row"), CASES, ids=[f"{m}:{r.name}" for m, r in CASES])
def test_profile_matches_reference_table(model_name: str, row: Row) -> None:
    p = model(model_name).profile(row.name)
    assert p is not None
    assert (p.id, p.max_count) == (row.id, row.max)
    if row.starts is not None:
        assert (p.starts, p.memory_slots) == (row.starts, row.size)
    if row.sm is not None:
        assert p.multiprocessors == row.sm
    if row.gib is not None:
        assert f"{p.memory_mib / 1024:.2f}" == row.gib
    e = p.engines
    for attr in ("ce", "dec", "enc", "jpeg", "ofa"):
        if getattr(row, attr) is not None:
            assert getattr(e, attr) == getattr(row, attr), attr


def test_default_compute_instances() -> None:
    """`-cgi ... -C` creates the full-size CI; Hopper+ 1g(2x mem) gets CI profile 7 (§2.11)."""
    size_to_enum = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4}
    for m in CATALOG.models:
        for p in m.profiles:
            rev1 = p.enum == 9 and m.architecture != "ampere"
            assert p.default_ci == (7 if rev1 else size_to_enum[p.compute_slices]), p.name


# ---- lookups -------------------------------------------------------------------------------


def test_lookups() -> None:
    h200 = model("H200-141GB")
    assert CATALOG.model("H200") is None
    assert CATALOG.model_by_pci(0x233510DE) is h200
    assert CATALOG.model_by_pci(0x233B10DE) is h200  # H200 NVL shares the table
    assert CATALOG.model_by_pci(0x20B010DE) is model("A100-40GB")
    assert CATALOG.model_by_pci(0x2BB510DE) is model("RTX-PRO-6000")
    assert CATALOG.model_by_pci(0x233310DE) is None  # go-nvml mock's wrong H200 id
    assert CATALOG.model_by_product_name("NVIDIA H200") is h200
    assert CATALOG.model_by_product_name("NVIDIA H300") is None
    assert h200.profile("1g.18gb+me") is h200.profile_by_id(20) is h200.profile_by_enum(7)
    assert h200.profile("1g.18gb.me") is None
    assert [m.name for m in CATALOG.models_offering("1g.18gb")] == ["H200-141GB", "GH200-144GB"]
    assert "1g.24gb-me" in CATALOG.profile_names()
    assert h200.full_engines.as_tuple() == (8, 7, 0, 7, 1)
    assert not h200.resets_for_mig_mode and model("A30-24GB").resets_for_mig_mode


# ---- profile names -------------------------------------------------------------------------

NAMES = [
    ("1g.18gb", ProfileName(1, 18)),
    ("1g.18gb+me", ProfileName(1, 18, None, "+me")),
    ("1c.3g.40gb", ProfileName(3, 40, 1)),
    ("1g.24gb-me", ProfileName(1, 24, None, "-me")),
    ("1g.24gb+me.all", ProfileName(1, 24, None, "+me.all")),
    ("1g.24gb+gfx", ProfileName(1, 24, None, "+gfx")),
    ("7g.141gb", ProfileName(7, 141)),
]


@pytest.mark.parametrize(("text", "parsed"), NAMES)
def test_profile_name_round_trip(text: str, parsed: ProfileName) -> None:
    assert parse_profile(text) == parsed
    assert str(parsed) == text


def test_compute_instance_prefix_names_its_gpu_instance() -> None:
    assert parse_profile("2c.7g.80gb").gi_profile == "7g.80gb"
    assert parse_profile("1g.18gb+me").gi_profile == "1g.18gb+me"


RESOURCES = [
    ("1g.18gb", "1g.18gb"),
    ("1g.18gb+me", "1g.18gb.me"),
    ("1g.24gb+me.all", "1g.24gb.me.all"),
    ("1g.24gb+gfx", "1g.24gb.gfx"),
    ("1g.24gb-me", "1g.24gb-me"),
    ("3g.71gb", "3g.71gb"),
]


@pytest.mark.parametrize(("profile", "suffix"), RESOURCES)
def test_resource_names_both_ways(profile: str, suffix: str) -> None:
    assert resource_suffix(profile) == suffix
    assert profile_from_suffix(suffix) == profile
    assert nvidia_resource(profile) == f"nvidia.com/mig-{suffix}"
    assert instaslice_resource(profile) == f"instaslice.io/mig-{suffix}"
    assert profile_from_resource(nvidia_resource(profile)) == profile
    assert profile_from_resource(instaslice_resource(profile)) == profile


def test_every_catalog_profile_maps_to_a_resource_and_back() -> None:
    for name in CATALOG.profile_names():
        assert profile_from_resource(nvidia_resource(name)) == name
        assert "+" not in nvidia_resource(name)


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "1g",
        "1g.18",
        "0g.5gb",
        "1g.0gb",
        "1g.5GB",
        "1g.5gb+foo",
        "1g.5gb+me-me",
        "1g.5gb-me.all",
        "4c.3g.40gb",
        "c.3g.40gb",
        " 1g.5gb",
        "1g.5gb ",
        "mig-1g.5gb",
    ],
)
def test_bad_profile_names_are_rejected(bad: str) -> None:
    with pytest.raises(ProfileNameError):
        parse_profile(bad)


def test_bad_resource_names() -> None:
    assert profile_from_resource("cpu") is None
    assert profile_from_resource("nvidia.com/gpu") is None
    for bad in ("nvidia.com/mig-", "nvidia.com/mig-1g", "instaslice.io/mig-1g.18gb+me"):
        with pytest.raises(ProfileNameError):
            profile_from_resource(bad)
    with pytest.raises(ProfileNameError):
        resource_suffix("1c.3g.40gb")  # resource names take GI profiles only
    with pytest.raises(ProfileNameError):
        profile_from_suffix("1g.18gb.foo")
