"""CDI spec building (nodeagent.cdi): names, device nodes, minors, base-spec common edits.

Pure: no consumer here. tests/integration/test_nodeagent_cdi_consumer.py feeds the same specs
to the CDI reference library.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.constants import CDI_KIND
from nodeagent import cdi

MINORS = """config 1
monitor 2
gpu0/gi1/access 12
gpu0/gi1/ci0/access 13
gpu0/gi1/ci1/access 14
gpu0/gi13/access 120
gpu0/gi13/ci0/access 121
gpu1/gi5/access 183
gpu1/gi5/ci0/access 184
"""


@pytest.mark.parametrize(
    ("gpu", "gi", "ci", "want"),
    [
        (0, 1, None, 12),  # the MIG user guide's example: GI 1 → nvidia-cap12
        (0, 1, 0, 13),
        (0, 1, 2, 15),
        (0, 13, None, 120),
        (0, 13, 0, 121),
        (31, 14, 7, 4322),  # the last line of a real mig-minors file
        (1, 5, None, 183),
    ],
)
def test_formula_minor(gpu: int, gi: int, ci: int | None, want: int) -> None:
    assert cdi.formula_minor(gpu, gi, ci) == want


def test_parse_mig_minors_agrees_with_formula() -> None:
    minors = cdi.parse_mig_minors(MINORS)
    assert minors["config"] == 1
    for name, minor in minors.items():
        if name.startswith("gpu"):
            parts = name.split("/")
            g, i = int(parts[0][3:]), int(parts[1][2:])
            c = int(parts[2][2:]) if parts[2].startswith("ci") else None
            assert cdi.formula_minor(g, i, c) == minor


def test_parse_proc_devices_reads_char_section_only() -> None:
    text = (
        "Character devices:\n  1 mem\n195 nvidia\n236 nvidia-caps\n510 nvidia-uvm\n"
        "\nBlock devices:\n  8 sd\n"
    )
    assert cdi.parse_proc_devices(text) == {
        "mem": 1,
        "nvidia": 195,
        "nvidia-caps": 236,
        "nvidia-uvm": 510,
    }


def test_host_numbers_use_the_minors_file(tmp_path: Path) -> None:
    (tmp_path / "mig-minors").write_text(MINORS)
    (tmp_path / "devices").write_text("Character devices:\n236 nvidia-caps\n510 nvidia-uvm\n")
    numbers = cdi.DeviceNumbers.from_host(tmp_path / "mig-minors", tmp_path / "devices")
    nodes = numbers.slice_nodes("MIG-a", 0, 13, 0)
    assert nodes.parent == cdi.DevNode("/dev/nvidia0", 195, 0)
    assert nodes.gi_access == cdi.DevNode("/dev/nvidia-caps/nvidia-cap120", 236, 120)
    assert nodes.ci_access == cdi.DevNode("/dev/nvidia-caps/nvidia-cap121", 236, 121)
    with pytest.raises(cdi.CdiError, match="gpu0/gi2/access"):
        numbers.slice_nodes("MIG-b", 0, 2, 0)


def test_host_numbers_without_caps_major_leave_numbers_to_the_runtime(tmp_path: Path) -> None:
    (tmp_path / "mig-minors").write_text(MINORS)
    numbers = cdi.DeviceNumbers.from_host(tmp_path / "mig-minors", tmp_path / "missing")
    nodes = numbers.slice_nodes("MIG-a", 0, 1, 0)
    assert nodes.gi_access is not None
    assert nodes.gi_access.to_json() == {"path": "/dev/nvidia-caps/nvidia-cap12"}


def test_missing_minors_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(cdi.CdiError, match="cannot read"):
        cdi.DeviceNumbers.from_host(tmp_path / "nope", tmp_path / "nope2")


def _slice(uuid: str, gpu: int, gi: int, ci: int = 0) -> cdi.SliceNodes:
    return cdi.DeviceNumbers.emulated().slice_nodes(uuid, gpu, gi, ci)


def test_build_spec_one_device_per_container_with_exactly_its_nodes() -> None:
    common = cdi.common_edits(cdi.fake_nvidia_spec(), cdi.DeviceNumbers.emulated())
    spec = cdi.build_spec(
        "team-a",
        "c123",
        {"train": [_slice("MIG-1", 0, 13), _slice("MIG-2", 0, 5)], "side": [_slice("MIG-3", 1, 3)]},
        common,
    )
    assert spec["kind"] == CDI_KIND
    assert spec["cdiVersion"] == cdi.CDI_VERSION
    train, side = spec["devices"]
    assert train["name"] == "team-a_c123_train"
    assert train["containerEdits"]["env"] == ["NVIDIA_VISIBLE_DEVICES=MIG-1,MIG-2"]
    paths = [n["path"] for n in train["containerEdits"]["deviceNodes"]]
    # the parent node once, then each slice's GI and CI capability nodes
    assert paths == [
        "/dev/nvidia0",
        "/dev/nvidia-caps/nvidia-cap120",
        "/dev/nvidia-caps/nvidia-cap121",
        "/dev/nvidia-caps/nvidia-cap48",
        "/dev/nvidia-caps/nvidia-cap49",
    ]
    assert side["name"] == "team-a_c123_side"
    assert [n["path"] for n in side["containerEdits"]["deviceNodes"]] == [
        "/dev/nvidia1",
        f"/dev/nvidia-caps/nvidia-cap{cdi.formula_minor(1, 3)}",
        f"/dev/nvidia-caps/nvidia-cap{cdi.formula_minor(1, 3, 0)}",
    ]
    top = spec["containerEdits"]
    assert {n["path"] for n in top["deviceNodes"]} == {
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
    }
    assert top["mounts"] and top["hooks"]
    assert "env" not in top  # NVIDIA_VISIBLE_DEVICES=void of the base spec is dropped


def test_common_edits_add_missing_control_nodes_and_keep_base_ones() -> None:
    base = {
        "kind": "nvidia.com/gpu",
        "containerEdits": {
            "deviceNodes": [{"path": "/dev/nvidiactl"}, {"path": "/dev/nvidia-modeset"}],
            "env": ["NVIDIA_VISIBLE_DEVICES=void", "NVIDIA_CTK_LIBCUDA_DIR=/usr/lib64"],
        },
    }
    edits = cdi.common_edits(base, cdi.DeviceNumbers(None, None, None, False))
    assert [n["path"] for n in edits["deviceNodes"]] == [
        "/dev/nvidiactl",
        "/dev/nvidia-modeset",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
    ]
    assert edits["env"] == ["NVIDIA_CTK_LIBCUDA_DIR=/usr/lib64"]
    assert cdi.common_edits(None, cdi.DeviceNumbers.emulated())["deviceNodes"][0] == {
        "path": "/dev/nvidiactl",
        "type": "c",
        "major": 195,
        "minor": 255,
    }


def test_file_names_round_trip_and_foreign_files_are_ignored(tmp_path: Path) -> None:
    assert cdi.spec_file_name("ns", "c1") == "instaslice.io-ns_c1.json"
    assert cdi.claim_of_file("instaslice.io-ns_c1.json") == ("ns", "c1")
    assert cdi.claim_of_file("nvidia.yaml") is None
    assert cdi.claim_of_file("instaslice.io-broken.json") is None
    spec = cdi.build_spec("ns", "c1", {"a": [_slice("MIG-1", 0, 7)]}, {})
    path = cdi.write_spec(tmp_path, "ns", "c1", spec)
    (tmp_path / "nvidia.yaml").write_text("kind: nvidia.com/gpu\n")
    assert json.loads(path.read_text()) == spec
    assert list(cdi.our_spec_files(tmp_path)) == [("ns", "c1")]
    assert not list(tmp_path.glob(".*tmp"))
    assert cdi.remove_spec(tmp_path, "ns", "c1")
    assert not cdi.remove_spec(tmp_path, "ns", "c1")
    assert list(cdi.our_spec_files(tmp_path / "absent")) == []


def test_release_of_an_older_allocation_keeps_the_newer_ones_file(tmp_path: Path) -> None:
    """Issue 17 item 6: a pod re-placed after its slices were released gets a new
    allocation of the same name (its claim), i.e. the same file name. Removing by the old
    UID must leave the new allocation's file; removing by its own UID removes it."""
    old = cdi.build_spec("ns", "c1", {"a": [_slice("MIG-old", 0, 7)]}, {}, uid="uid-old")
    new = cdi.build_spec("ns", "c1", {"a": [_slice("MIG-new", 0, 9)]}, {}, uid="uid-new")
    assert old["annotations"] == {"instaslice.io/claim": "ns/c1", "instaslice.io/uid": "uid-old"}
    cdi.write_spec(tmp_path, "ns", "c1", old)
    assert cdi.spec_uid(tmp_path, "ns", "c1") == "uid-old"
    cdi.write_spec(tmp_path, "ns", "c1", new)  # the newer allocation, same name
    assert not cdi.remove_spec(tmp_path, "ns", "c1", "uid-old")
    assert json.loads((tmp_path / cdi.spec_file_name("ns", "c1")).read_text()) == new
    assert cdi.remove_spec(tmp_path, "ns", "c1", "uid-new")
    assert cdi.spec_uid(tmp_path, "ns", "c1") is None
    assert not cdi.remove_spec(tmp_path, "ns", "c1", "uid-new")


def test_a_file_without_uid_is_removed_by_any_uid(tmp_path: Path) -> None:
    """Files written before the UID annotation existed (or unreadable ones) go by name."""
    cdi.write_spec(tmp_path, "ns", "c1", cdi.build_spec("ns", "c1", {"a": []}, {}))
    assert cdi.spec_uid(tmp_path, "ns", "c1") == ""
    assert cdi.remove_spec(tmp_path, "ns", "c1", "uid-any")
    (tmp_path / cdi.spec_file_name("ns", "c2")).write_text("{not json")
    assert cdi.spec_uid(tmp_path, "ns", "c2") == ""
    assert cdi.remove_spec(tmp_path, "ns", "c2", "uid-any")


def test_load_base_spec_yaml_and_errors(tmp_path: Path) -> None:
    p = tmp_path / "nvidia.yaml"
    p.write_text("cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ncontainerEdits:\n  hooks: []\n")
    assert cdi.load_base_spec(p)["kind"] == "nvidia.com/gpu"
    p.write_text("- not a spec\n")
    with pytest.raises(cdi.CdiError, match="not a CDI spec"):
        cdi.load_base_spec(p)
    with pytest.raises(cdi.CdiError, match="cannot read"):
        cdi.load_base_spec(tmp_path / "missing.yaml")


def test_a_dev_root_points_every_device_node_there_and_drops_driver_files() -> None:
    """An emulated node under a real runtime: hostPaths in the dev root, no driver mounts or
    hooks (their host files do not exist), container paths unchanged."""
    numbers = cdi.DeviceNumbers.emulated(Path("/x/dev"))
    base = cdi.fake_nvidia_spec(gpu_minors=(0,), dev_root=Path("/x/dev"))
    assert "mounts" not in base["containerEdits"] and "hooks" not in base["containerEdits"]
    common = cdi.common_edits(base, numbers)
    nodes = numbers.slice_nodes("MIG-a", 0, 1, 0)
    spec = cdi.build_spec("ns", "c1", {"main": [nodes]}, common)
    device = spec["devices"][0]["containerEdits"]
    every = spec["containerEdits"]["deviceNodes"] + device["deviceNodes"]
    assert {n["hostPath"] for n in every} == {
        "/x/dev/nvidiactl", "/x/dev/nvidia-uvm", "/x/dev/nvidia-uvm-tools", "/x/dev/nvidia0",
        "/x/dev/nvidia-caps/nvidia-cap12", "/x/dev/nvidia-caps/nvidia-cap13",
    }  # fmt: skip
    assert all(n["path"] == "/dev" + n["hostPath"].removeprefix("/x/dev") for n in every)
    minors = cdi.formula_mig_minors([0, 1])
    assert minors["gpu0/gi1/access"] == 12 and minors["gpu1/gi14/ci7/access"] == 4 + 135 + 126 + 7
    assert len(minors) == 2 + 2 * 15 * 9
