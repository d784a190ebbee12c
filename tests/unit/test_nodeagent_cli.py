"""`instaslice-nodeagent` command line (nodeagent.main): argument rules, settings, the
label selector, the unimplemented device-plugin binding, and `--discover-only` end to end on
the emulator (read-only: the emulated node's state file is unchanged)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from common.catalog import load_catalog
from nodeagent.emulator import EmulatorControl, provision
from nodeagent.main import main, parse_args, selector


def test_settings_from_args(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    s, extra = parse_args(["--node", "n1", "--gc-grace-s", "5"])
    assert s.nodes == ("n1",) and s.gc_grace_s == 5 and s.binding == "env" and not s.emulate
    assert s.node_cdi_dir("n1") == Path("/var/run/cdi")
    assert s.checkpoint_path("n1") == Path("/var/lib/instaslice/n1.agent.json")
    assert extra == "text:info"
    assert s.maintenance_drain_timeout_s == 1800.0
    s, _ = parse_args(["--node", "n1", "--maintenance-drain-timeout-s", "0"])
    assert s.maintenance_drain_timeout_s == 0.0  # no timeout
    monkeypatch.setenv("NODE_NAME", "from-env")
    s, _ = parse_args([])
    assert s.nodes == ("from-env",)
    s, _ = parse_args(
        ["--nodes", "a, b", "--emulate", "--emu-state", str(tmp_path), "--cdi-root", "/r"]
    )
    assert s.nodes == ("a", "b")
    assert s.node_cdi_dir("b") == Path("/r/b/cdi")
    assert s.checkpoint_path("a") == tmp_path / "a.agent.json"


def test_dra_plugin_only_for_a_node_with_a_kubelet(tmp_path: Path) -> None:
    """DRA mode: the kubelet plugin is served by the agent of one real node (or of one
    emulated node under a real kubelet, --dev-root), never by emulated KWOK nodes."""
    emu = ["--emulate", "--emu-state", str(tmp_path)]
    s, _ = parse_args(["--node", "n1", "--allocation-mode", "dra"])
    assert s.allocation == "dra"
    assert s.dra_registry_dir == Path("/var/lib/kubelet/plugins_registry")
    assert s.dra_plugins_dir == Path("/var/lib/kubelet/plugins")
    s, _ = parse_args(["--node", "n1", *emu, "--allocation-mode", "dra"])
    assert s.dra_registry_dir is None  # a KWOK node
    s, _ = parse_args(["--node", "n1", *emu, "--dev-root", "/d", "--kubelet-registry-dir", "/r"])
    assert s.dra_registry_dir == Path("/r")
    s, _ = parse_args(["--nodes", "a,b", *emu, "--cdi-root", "/c"])
    assert s.dra_registry_dir is None and s.allocation == "gates"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ([], "no node"),
        (["--nodes", "a,b"], "needs --emulate"),
        (["--node", "a", "--emulate"], "needs --emu-state"),
        (["--nodes", "a,b", "--emulate", "--emu-state", "/x"], "--cdi-root"),
        (["--node", "a", "--binding", "dra"], "invalid choice"),
        (["--node", "a", "--maintenance-drain-timeout-s", "-1"], "--maintenance-drain-timeout-s"),
        (["--node", "a", "--maintenance-drain-timeout-s", "nan"], "--maintenance-drain-timeout-s"),
    ],
)
def test_bad_arguments(
    argv: list[str],
    needle: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("NODE_NAME", raising=False)
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2 and needle in capsys.readouterr().err


def test_selector() -> None:
    assert selector(["a"]) == "instaslice.io/node=a"
    assert selector(["a", "b"]) == "instaslice.io/node in (a,b)"
    assert selector([f"n{i}" for i in range(500)]) == "instaslice.io/node"


def test_device_plugin_binding_serves_one_node(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--nodes", "a,b", "--emulate", "--emu-state", "/tmp/x", "--cdi-root", "/tmp/y"]
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--binding", "device-plugin"])
    assert exc.value.code == 2
    assert "one node's kubelet" in capsys.readouterr().err


def test_discover_only_prints_and_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    provision(tmp_path, "n1", ["H200-141GB", "A30-24GB"])
    state = tmp_path / "n1.json"
    before = hashlib.sha256(state.read_bytes()).hexdigest()
    argv = ["--discover-only", "--emulate", "--emu-state", str(tmp_path), "--node", "n1"]
    assert main([*argv, "--output", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert hashlib.sha256(state.read_bytes()).hexdigest() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["n1.json", "n1.lock"]
    h200 = load_catalog().model("H200-141GB")
    assert h200 is not None
    g0 = doc["gpus"][0]
    assert g0["catalog"]["matches"] and g0["migMode"]["current"] == "enabled"
    assert {p["name"]: p["placements"] for p in g0["profiles"]} == {
        p.name: [f"{s}:{p.size}" for s in p.starts] for p in h200.profiles
    }
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert (
        "GPU 1  NVIDIA A30" in text and "catalog: A30-24GB (profiles and placements match)" in text
    )


def test_discover_only_prints_architecture_and_mode_change_capability(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    provision(tmp_path, "n1", ["H100-80GB", "A100-40GB"], "disabled")
    ctl = EmulatorControl(tmp_path, "n1")
    ctl.add_process(ctl.state().gpus[0].uuid)
    ctl.set_vm(True)  # a VM guest cannot be told apart without trying: never tried here
    before = hashlib.sha256((tmp_path / "n1.json").read_bytes()).hexdigest()
    argv = ["--discover-only", "--emulate", "--emu-state", str(tmp_path), "--node", "n1"]
    assert main([*argv, "--output", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert hashlib.sha256((tmp_path / "n1.json").read_bytes()).hexdigest() == before
    got = [(g["architecture"], g["modeToggle"], g["computeProcesses"]) for g in doc["gpus"]]
    assert got == [("hopper", "resetless", 1), ("ampere", "reset", 0)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "architecture hopper; MIG mode change: resetless (on demand, without a reset" in text
    assert "architecture ampere; MIG mode change: reset (only with a GPU reset" in text
