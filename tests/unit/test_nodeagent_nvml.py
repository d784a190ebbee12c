"""The NVML seam (nodeagent.nvml) against the NVML emulator: discovery equals the catalog,
create at exactly a placement + default CI + MIG UUID by walking handles, destroy order and
errors, health events, and the read-only guarantee of --discover-only.

The emulator raises pynvml's own error classes through pynvml's call surface, so this is
the same code path as on a real GPU; what it cannot show is the real driver's timing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from common.catalog import load_catalog
from nodeagent.discover import discover, render, report
from nodeagent.emulator import EmulatedNvml, EmulatorControl, provision
from nodeagent.model import NVML_IN_USE, NVML_INSUFFICIENT_RESOURCES, NvmlFailure
from nodeagent.nvml import READ_ONLY_CALLS, EventWatcher, NvmlSession, ReadOnly, catalog_diff

MUTATING_WORDS = ("Create", "Destroy", "Set", "Register", "Reset", "Clear", "Enable", "Disable")


class Recording:
    """Wraps an nvml module and records every nvml* function called through it."""

    def __init__(self, nv: Any) -> None:
        self._nv = nv
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._nv, name)
        if name.startswith("nvml") and callable(value):

            def wrapped(*args: Any, **kwargs: Any) -> Any:
                self.calls.append(name)
                return value(*args, **kwargs)

            return wrapped
        return value


@pytest.fixture
def emu(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    provision(tmp_path, "n1", ["H200-141GB", "A100-40GB", "A30-24GB"])
    yield tmp_path, "n1"


@pytest.fixture
def session(emu: tuple[Path, str]) -> Iterator[NvmlSession]:
    s = NvmlSession(EmulatedNvml(*emu), load_catalog())
    s.open()
    yield s
    s.close()


def test_discovery_matches_the_catalog(session: NvmlSession) -> None:
    inv = session.inventory()
    assert [g.model for g in inv.gpus] == ["H200-141GB", "A100-40GB", "A30-24GB"]
    catalog = load_catalog()
    for g in inv.gpus:
        model = catalog.model(g.model)
        assert model is not None and g.mig_enabled and not g.warnings
        assert catalog_diff(model, g.profiles) == []
        assert {p.name: (p.id, p.instance_count) for p in g.profiles} == {
            p.name: (p.id, p.max_count) for p in model.profiles
        }
        for p in g.profiles:
            known = model.profile(p.name)
            assert known is not None
            assert p.placements == tuple((s, known.size) for s in known.starts)
    assert inv.instances == ()


def test_catalog_diff_names_each_disagreement() -> None:
    model = load_catalog().model("H200-141GB")
    assert model is not None
    from testkit.builders import G0, gpu

    profiles = list(gpu(0, G0).profiles)
    p1g = profiles[0]
    profiles[0] = type(p1g)(
        p1g.name, p1g.id, p1g.enum, p1g.slice_count, 6, p1g.memory_mib, p1g.multiprocessors,
        p1g.placements[:-1],
    )  # fmt: skip
    profiles.pop()  # drop the last catalog profile
    diff = catalog_diff(model, profiles)
    assert any("NVML max 6, catalog 7" in d for d in diff)
    assert any("NVML placements" in d for d in diff)
    assert any("not reported by NVML" in d for d in diff)


def test_create_at_placement_default_ci_and_uuid_walk(
    session: NvmlSession, emu: tuple[Path, str]
) -> None:
    ctl = EmulatorControl(*emu)
    gi = session.create_gi(0, 15, 6, 2)  # 1g.35gb at slots 6-7
    ci = session.create_ci(0, gi, 1, hint=None)  # no hint: probe picks the 26-SM REV1 CI
    uuid = session.mig_uuid(0, gi, ci)
    rows = ctl.instances()
    assert [(r.profile_name, r.start, r.size, r.gi_id, r.ci_id, r.mig_uuid) for r in rows] == [
        ("1g.35gb", 6, 2, gi, ci, uuid)
    ]
    state = ctl.state()
    assert state.gpus[0].gi(gi).cis[0].profile == 7  # type: ignore[union-attr]
    assert uuid.startswith("MIG-") and uuid != state.gpus[0].uuid
    inv = session.inventory()
    assert [(i.gi_id, i.start, i.size, i.ci_ids, i.mig_uuids) for i in inv.instances] == [
        (gi, 6, 2, (ci,), (uuid,))
    ]
    with pytest.raises(NvmlFailure) as err:
        session.create_gi(0, 19, 6, 1)
    assert err.value.code == NVML_INSUFFICIENT_RESOURCES
    assert "INSUFFICIENT_RESOURCES" in str(err.value)


def test_destroy_ci_then_gi_in_use_and_not_found(
    session: NvmlSession, emu: tuple[Path, str]
) -> None:
    ctl = EmulatorControl(*emu)
    gi = session.create_gi(1, 9, 4, 4)
    ci = session.create_ci(1, gi, 3, hint=2)
    uuid = session.mig_uuid(1, gi, ci)
    with pytest.raises(NvmlFailure) as err:
        session.destroy_gi(1, gi)  # a CI still exists
    assert err.value.in_use
    pid = ctl.add_process(uuid)
    with pytest.raises(NvmlFailure) as err:
        session.destroy_ci(1, gi, ci)
    assert err.value.code == NVML_IN_USE
    ctl.remove_process(uuid, pid)
    assert session.destroy_ci(1, gi, ci) is True
    assert session.destroy_gi(1, gi) is True
    assert session.destroy_ci(1, gi, ci) is False  # NOT_FOUND counts as done
    assert session.destroy_gi(1, gi) is False
    assert ctl.instances() == []


def test_events_xid_and_gpu_lost(session: NvmlSession, emu: tuple[Path, str]) -> None:
    ctl = EmulatorControl(*emu)
    w = EventWatcher(session, [0, 1, 2])
    assert w.open() == []
    assert w.wait(0) is None
    ctl.emit_xid(1, 48)
    ev = w.wait(1000)
    assert ev is not None and (ev.gpu_index, ev.kind, ev.xid) == (1, "xid", 48)
    ctl.gpu_lost(2)
    ev = w.wait(1000)
    assert ev is not None and (ev.gpu_index, ev.kind) == (2, "lost")
    assert w.probe_lost() == [2]
    w.close()
    inv = session.inventory()
    assert inv.lost == (2,) and inv.gpus[2].uuid == "GPU-lost-2"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_discover_only_calls_only_read_only_functions(emu: tuple[Path, str]) -> None:
    state_dir, node = emu
    setup = NvmlSession(EmulatedNvml(state_dir, node), load_catalog())
    setup.open()
    gi = setup.create_gi(0, 19, 2, 1)
    setup.create_ci(0, gi, 1, hint=0)
    setup.create_gi(0, 14, 4, 2)  # a GI without a CI
    setup.close()
    before = _digest(state_dir / f"{node}.json")
    rec = Recording(EmulatedNvml(state_dir, node))
    inv = discover(rec, load_catalog())
    assert _digest(state_dir / f"{node}.json") == before
    assert rec.calls and set(rec.calls) <= READ_ONLY_CALLS
    assert not [c for c in rec.calls if any(w in c for w in MUTATING_WORDS)]
    doc = report(node, inv, load_catalog())
    g0 = doc["gpus"][0]
    assert g0["catalog"] == {"model": "H200-141GB", "matches": True, "differences": []}
    assert [(i["profile"], i["placement"], len(i["ciIDs"])) for i in g0["instances"]] == [
        ("1g.18gb", "2:1", 1),
        ("2g.35gb", "4:2", 0),
    ]
    text = render(doc, "text")
    assert "1g.18gb" in text and "0:1 1:1 2:1 3:1 4:1 5:1 6:1" in text
    assert "instance: GI" in text and "no compute instance" in text


def test_read_only_proxy_refuses_mutation(emu: tuple[Path, str]) -> None:
    rec = Recording(EmulatedNvml(*emu))
    s = NvmlSession(ReadOnly(rec), load_catalog())
    s.open()
    with pytest.raises(PermissionError, match="nvmlDeviceCreateGpuInstanceWithPlacement"):
        s.create_gi(0, 19, 0, 1)
    assert "nvmlDeviceCreateGpuInstanceWithPlacement" not in rec.calls
    s.close()
