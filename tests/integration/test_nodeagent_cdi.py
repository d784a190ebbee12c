"""The node agent's CDI specs, read by a real consumer: the CDI reference library
(tags.cncf.io/container-device-interface, via hack/cdi-check — the code CRI-O and containerd
run) injects each container's device into a sample OCI runtime spec.

Covers: specs as nodeagent.cdi builds them for two allocations on a node (several
containers, several slices per container, slices on two GPUs) parse without errors; each
injected device yields exactly its slices' device nodes plus the control/UVM nodes, the
driver mounts and hooks of the base spec, device-cgroup rules for those nodes, and
NVIDIA_VISIBLE_DEVICES with exactly its MIG UUIDs — nothing of another slice. The specs the
running agent writes are fed through the same check in test_nodeagent.py.
Leaves out: a container actually starting (no runtime or GPU here).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nodeagent import cdi
from tests.integration.agent_fixtures import cdi_inject, injected_devices, injected_env

pytestmark = pytest.mark.timeout(120)

CONTROL = {"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}


def _write(tmp: Path) -> dict[str, tuple[set[str], set[str]]]:
    """Two allocations; returns device → (its device node paths, its MIG UUIDs)."""
    numbers = cdi.DeviceNumbers.emulated()
    common = cdi.common_edits(cdi.fake_nvidia_spec(gpu_minors=[0, 1]), numbers)
    layout = {
        ("team-a", "c1"): {
            "train": [("MIG-a1", 0, 13, 0), ("MIG-a2", 1, 1, 0)],
            "eval": [("MIG-a3", 0, 5, 0)],
        },
        ("team-b", "c2"): {"main": [("MIG-b1", 0, 11, 0)]},
    }
    want: dict[str, tuple[set[str], set[str]]] = {}
    for (ns, claim), containers in layout.items():
        nodes = {
            c: [numbers.slice_nodes(u, g, gi, ci) for u, g, gi, ci in slices]
            for c, slices in containers.items()
        }
        cdi.write_spec(tmp, ns, claim, cdi.build_spec(ns, claim, nodes, common))
        for c, slices in containers.items():
            paths = {f"/dev/nvidia{g}" for _, g, _, _ in slices}
            paths |= {
                f"/dev/nvidia-caps/nvidia-cap{cdi.formula_minor(g, gi)}" for _, g, gi, _ in slices
            }
            paths |= {
                f"/dev/nvidia-caps/nvidia-cap{cdi.formula_minor(g, gi, ci)}"
                for _, g, gi, ci in slices
            }
            want[f"instaslice.io/mig={ns}_{claim}_{c}"] = (paths, {u for u, *_ in slices})
    return want


def test_each_device_injects_exactly_its_slices(tmp_path: Path) -> None:
    want = _write(tmp_path)
    all_uuids = set().union(*(u for _, u in want.values()))
    for device, (paths, uuids) in want.items():
        out = cdi_inject([tmp_path], [device])
        assert out["rc"] == 0, out
        assert out["errors"] == {} and not out["unresolved"]
        assert set(injected_devices(out)) == paths | CONTROL, device
        visible = injected_env(out)["NVIDIA_VISIBLE_DEVICES"].split(",")
        assert set(visible) == uuids and not (set(visible) & (all_uuids - uuids))
        spec = out["spec"]
        mounts = {m["destination"] for m in spec["mounts"]}
        assert any("libcuda.so" in m for m in mounts) and "/usr/bin/nvidia-smi" in mounts
        hooks = spec["hooks"]["createContainer"]
        assert any("update-ldcache" in h["args"] for h in hooks)
        rules = spec["linux"]["resources"]["devices"]
        allowed = {(r["major"], r["minor"]) for r in rules if r.get("allow")}
        for d in spec["linux"]["devices"]:
            assert (d["major"], d["minor"]) in allowed


def test_unknown_device_is_unresolvable(tmp_path: Path) -> None:
    _write(tmp_path)
    out = cdi_inject([tmp_path], ["instaslice.io/mig=team-a_c1_nosuch"])
    assert out["rc"] == 1 and out["unresolved"] == ["instaslice.io/mig=team-a_c1_nosuch"]


def test_removed_spec_is_gone_for_the_consumer(tmp_path: Path) -> None:
    _write(tmp_path)
    assert cdi.remove_spec(tmp_path, "team-b", "c2")
    out = cdi_inject([tmp_path], ["instaslice.io/mig=team-b_c2_main"])
    assert out["unresolved"] == ["instaslice.io/mig=team-b_c2_main"]
    assert cdi_inject([tmp_path], ["instaslice.io/mig=team-a_c1_eval"])["rc"] == 0


def test_removing_an_older_allocation_of_the_same_name_keeps_the_newer_device(
    tmp_path: Path,
) -> None:
    """Issue 17 item 6, as the runtime sees it: after the newer allocation of claim c2 wrote
    its spec, removing the older one (by its UID) leaves the newer device resolvable."""
    numbers = cdi.DeviceNumbers.emulated()
    common = cdi.common_edits(cdi.fake_nvidia_spec(gpu_minors=[0]), numbers)

    def spec(uid: str, mig: str, gi: int) -> cdi.Obj:
        nodes = {"main": [numbers.slice_nodes(mig, 0, gi, 0)]}
        return cdi.build_spec("team-b", "c2", nodes, common, uid=uid)

    cdi.write_spec(tmp_path, "team-b", "c2", spec("uid-1", "MIG-old", 11))
    cdi.write_spec(tmp_path, "team-b", "c2", spec("uid-2", "MIG-new", 12))
    assert not cdi.remove_spec(tmp_path, "team-b", "c2", "uid-1")
    out = cdi_inject([tmp_path], ["instaslice.io/mig=team-b_c2_main"])
    assert out["rc"] == 0 and not out["unresolved"], out
    assert injected_env(out)["NVIDIA_VISIBLE_DEVICES"] == "MIG-new"
    assert cdi.remove_spec(tmp_path, "team-b", "c2", "uid-2")
    out = cdi_inject([tmp_path], ["instaslice.io/mig=team-b_c2_main"])
    assert out["unresolved"] == ["instaslice.io/mig=team-b_c2_main"]
