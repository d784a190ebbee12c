"""The node agent's pure MIG-mode rules (nodeagent/modes.py) and the intent record's codec.

Covers: the toggle capability per architecture and after a refused reset-less change; why a
change may not be made (pending reset, back-off, Ampere, unknown architecture) as a table;
the idle re-check; the MigNode fields; a checkpoint with a mode intent round-trips, and an
older one without the key still loads. Leaves out: NVML and the agent's I/O
(tests/integration/test_nodeagent_modes.py).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from nodeagent import checkpoint, modes
from nodeagent.checkpoint import Checkpoint, ModeIntent, SliceRecord
from nodeagent.model import MIG_DISABLED, MIG_ENABLED, GpuInfo, Instance

GPU = GpuInfo(
    index=3,
    uuid="GPU-x",
    name="NVIDIA H100",
    pci_device_id=0x233010DE,
    minor=3,
    mig_current=MIG_DISABLED,
    mig_pending=MIG_DISABLED,
    memory_total_mib=81559,
    model="H100-80GB",
    architecture="hopper",
)
FAILED = modes.ModeFailure(MIG_ENABLED, "IN_USE", "2026-12-01T00:00:00Z", until=100.0)


@pytest.mark.parametrize(
    ("arch", "refused", "want"),
    [
        ("hopper", False, "resetless"),
        ("blackwell", False, "resetless"),
        ("ampere", False, "reset"),
        ("ada", False, "none"),
        ("", False, "none"),
        ("hopper", True, "none"),
        ("ampere", True, "none"),
    ],
)
def test_toggle(arch: str, refused: bool, want: str) -> None:
    assert modes.toggle(replace(GPU, architecture=arch), refused) == want


@pytest.mark.parametrize(
    ("gpu", "target", "how", "failure", "now", "want"),
    [
        (GPU, MIG_ENABLED, "resetless", None, 0.0, None),
        (GPU, MIG_DISABLED, "none", FAILED, 0.0, None),  # there already: nothing to do
        (GPU, MIG_ENABLED, "resetless", FAILED, 99.0, "not retried for 1 s"),
        (GPU, MIG_ENABLED, "resetless", FAILED, 100.0, None),  # back-off over
        (GPU, MIG_ENABLED, "reset", None, 0.0, "needs a GPU reset"),
        (GPU, MIG_ENABLED, "none", None, 0.0, "cannot change MIG mode without a reset"),
        (replace(GPU, mig_pending=MIG_ENABLED), MIG_ENABLED, "resetless", None, 0.0, "pending"),
    ],
)
def test_mode_problem(
    gpu: GpuInfo,
    target: str,
    how: modes.Toggle,
    failure: modes.ModeFailure | None,
    now: float,
    want: str | None,
) -> None:
    got = modes.mode_problem(gpu, target, how, failure, now)
    if want is None:
        assert got is None
    else:
        assert got is not None and want in got and "GPU 3" in got


def test_idle_problem() -> None:
    inst = Instance(gpu_index=3, gpu_uuid="GPU-x", gi_id=1, profile_id=19, start=0, size=1)
    assert modes.idle_problem(3, MIG_ENABLED, 0, []) is None
    assert modes.idle_problem(3, MIG_ENABLED, 0, [inst]) is None  # enabling: instances moot
    assert "2 compute process(es)" in str(modes.idle_problem(3, MIG_ENABLED, 2, []))
    assert "1 GPU instance(s)" in str(modes.idle_problem(3, MIG_DISABLED, 0, [inst]))


def test_needed_modes() -> None:
    s = SliceRecord("c", "1g.10gb", 19, "GPU-x", 3, 0, 1)
    assert modes.needed_modes([s, replace(s, start=1)]) == {"GPU-x": MIG_ENABLED}
    assert modes.needed_modes([]) == {}


def test_mode_status() -> None:
    done = modes.ModeChanged(MIG_DISABLED, MIG_ENABLED, "2026-12-01T00:00:01Z")
    assert modes.mode_status("resetless", None, None, False, 0.0) == {"modeToggle": "resetless"}
    got = modes.mode_status("resetless", FAILED, done, False, 50.0)
    assert got["modeChange"]["phase"] == "Failed" and got["modeChange"]["message"] == "IN_USE"
    assert got["lastModeChange"] == {"from": "disabled", "to": "enabled", "time": done.time}
    assert "modeChange" not in modes.mode_status("reset", FAILED, None, False, 100.0)
    assert modes.mode_status("none", FAILED, None, True, 0.0)["modeChange"] == {"phase": "Changing"}


def test_checkpoint_with_mode_intent_round_trips() -> None:
    cp = Checkpoint(node="n", boot_id="b").with_mode_intent(
        ModeIntent("GPU-x", 3, MIG_ENABLED, "uid-1")
    )
    back = checkpoint.from_json(checkpoint.to_json(cp))
    assert back.mode_changes == cp.mode_changes
    assert back.without_mode_intent("GPU-x").mode_changes == {}
    old = checkpoint.to_json(Checkpoint(node="n"))
    del old["modeChanges"]  # a checkpoint written before the key existed
    assert checkpoint.from_json(old).mode_changes == {}


@pytest.mark.parametrize(
    ("labels", "want"),
    [
        ({}, None),
        ({"instaslice.io/idle-mig-mode": "any"}, None),
        ({"instaslice.io/idle-mig-mode": "enabled"}, MIG_ENABLED),
        ({"instaslice.io/idle-mig-mode": "disabled"}, MIG_DISABLED),
        ({"other": "disabled"}, None),
    ],
)
def test_idle_mode_label(labels: dict[str, str], want: str | None) -> None:
    assert modes.idle_mode(labels) == want


def test_a_bad_idle_mode_label_names_the_label() -> None:
    with pytest.raises(modes.BadIdleMode, match=r"instaslice.io/idle-mig-mode='off'.*any"):
        modes.idle_mode({"instaslice.io/idle-mig-mode": "off"})


ON = replace(GPU, mig_current=MIG_ENABLED, mig_pending=MIG_ENABLED)


@pytest.mark.parametrize(
    ("gpu", "target", "how", "busy", "idle_for", "want"),
    [
        (ON, MIG_DISABLED, "resetless", False, 11.0, MIG_DISABLED),
        (GPU, MIG_ENABLED, "resetless", False, 11.0, MIG_ENABLED),
        (ON, MIG_DISABLED, "resetless", False, 10.0, None),  # not idle long enough
        (ON, MIG_DISABLED, "resetless", True, 11.0, None),  # an allocation or instance on it
        (replace(ON, compute_processes=1), MIG_DISABLED, "resetless", False, 11.0, None),
        (ON, MIG_DISABLED, "reset", False, 11.0, None),  # Ampere: never for resting
        (ON, MIG_DISABLED, "none", False, 11.0, None),  # a VM guest
        (ON, MIG_ENABLED, "resetless", False, 11.0, None),  # there already
        (ON, None, "resetless", False, 11.0, None),  # label any
        (replace(ON, mig_pending=MIG_DISABLED), MIG_DISABLED, "resetless", False, 11.0, None),
    ],
)
def test_rest_target(
    gpu: GpuInfo, target: str | None, how: modes.Toggle, busy: bool, idle_for: float, want: str
) -> None:
    assert modes.rest_target(gpu, target, how, busy, idle_for, after_s=10.0) == want
