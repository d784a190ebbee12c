"""Ampere maintenance, the pure halves: the allocator's asks and withdrawals
(webhook/allocator/maintenance.py, views.in_maintenance) and the agent's choices
(nodeagent/maintenance.py: which Operator labels to pause, which asked GPUs are due).

Covers: a GPU with a desired mode not reached is locked (unhealthy to the engine, no reset
or flex candidate) and counted in flight; reached or failed asks are withdrawn; the spec
patch keeps the other GPUs' asks; labels present and not `false` are paused, absent ones
are not added; only reset GPUs not in the mode and not failed within the back-off are due;
a drain runs out after the agent's timeout (its clock restarts when the GPU stops draining or
the target changes), and an ask the agent reports given up (`Failed`, reason
DrainTimedOut) no longer locks the GPU while a refused reset's `Failed` still does;
the checkpoint's maintenance record and drain clocks round-trip (old checkpoints still
read). Leaves out: I/O (the integration tests).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.catalog import load_catalog
from common.catalog.learned import Geometries
from common.constants import DRAIN_TIMED_OUT
from common.objects import desired_modes
from nodeagent import checkpoint, maintenance, modes
from nodeagent.checkpoint import Checkpoint, DrainClock, MaintenanceIntent
from nodeagent.model import MIG_DISABLED, MIG_ENABLED
from nodeagent.reconcile import after_reboot
from tests.unit.test_nodeagent_modes import GPU  # an H100 with MIG off
from webhook.allocator.maintenance import in_flight, spec_patch, withdrawals
from webhook.allocator.views import gpus_of

Obj = dict[str, Any]
GIVEN_UP: Obj = {"phase": "Failed", "reason": DRAIN_TIMED_OUT}


def mig_node(desired: dict[str, str], *gpus: Obj) -> Obj:
    return {
        "metadata": {"name": "n"},
        "spec": {"gpus": [{"uuid": u, "desiredMigMode": m} for u, m in desired.items()]},
        "status": {"gpus": list(gpus)},
    }


def gpu(uuid: str, current: str, pending: str | None = None, **extra: Any) -> Obj:
    return {
        "index": int(uuid[-1]),
        "uuid": uuid,
        "model": "A100-80GB",
        "healthy": True,
        "migMode": {"current": current, "pending": pending or current},
        "modeToggle": "reset",
        **extra,
    }


def test_an_asked_gpu_is_locked_until_its_mode_is_reached() -> None:
    obj = mig_node({"GPU-0": "enabled"}, gpu("GPU-0", "disabled"), gpu("GPU-1", "disabled"))
    g0, g1 = gpus_of(obj, Geometries(load_catalog()))
    assert (g0.healthy, g0.needs_reset, g0.maintenance, g0.desired) == (
        False,
        False,
        True,
        "enabled",
    )
    assert (g1.healthy, g1.needs_reset, g1.maintenance) == (True, True, False)
    assert [(n, g.uuid) for n, g in in_flight({"n": (g0, g1)})] == [("n", "GPU-0")]
    done = mig_node({"GPU-0": "enabled"}, gpu("GPU-0", "enabled"))
    (g0,) = gpus_of(done, Geometries(load_catalog()))
    assert (g0.healthy, g0.maintenance) == (True, False)
    assert withdrawals(done) == {"GPU-0"}


@pytest.mark.parametrize(
    ("status", "want"),
    [
        (gpu("GPU-0", "disabled"), set()),  # not yet
        (gpu("GPU-0", "disabled", "enabled"), set()),  # pending: the reset is still to come
        (gpu("GPU-0", "enabled"), {"GPU-0"}),  # reached
        (gpu("GPU-0", "disabled", modeChange={"phase": "Failed"}), {"GPU-0"}),
        (gpu("GPU-0", "disabled", modeChange={"phase": "Draining"}), set()),
    ],
)
def test_withdrawals(status: Obj, want: set[str]) -> None:
    assert withdrawals(mig_node({"GPU-0": "enabled"}, status)) == want


def test_draining_locks_a_gpu_even_without_an_ask() -> None:
    (g,) = gpus_of(
        mig_node({}, gpu("GPU-0", "enabled", modeChange={"phase": "Draining"})),
        Geometries(load_catalog()),
    )
    assert not g.healthy and g.maintenance


@pytest.mark.parametrize(
    ("change", "desired", "locked"),
    [
        ({"phase": "Draining"}, "enabled", True),
        ({"phase": "Resetting"}, "enabled", True),
        (GIVEN_UP | {"target": "enabled"}, "enabled", False),  # the ask is given up
        (GIVEN_UP | {"target": "disabled"}, "enabled", True),  # a newer ask
        (GIVEN_UP | {"target": "enabled"}, "", False),  # withdrawn
        # a refused reset: only a back-off before the agent retries, so still locked
        ({"phase": "Failed", "target": "enabled"}, "enabled", True),
        ({"phase": "Failed", "target": "enabled", "reason": "Other"}, "enabled", True),
        ({"phase": "Failed", "target": "enabled"}, "", False),  # withdrawn
        ({"phase": "Changing"}, "enabled", True),  # not reached yet
        (None, "enabled", True),
    ],
)
def test_a_failed_ask_no_longer_locks_the_gpu(
    change: Obj | None, desired: str, locked: bool
) -> None:
    status = gpu("GPU-0", "disabled")
    if change:
        status["modeChange"] = change
    obj = mig_node({"GPU-0": desired} if desired else {}, status)
    (g,) = gpus_of(obj, Geometries(load_catalog()))
    assert (g.maintenance, g.healthy) == (locked, not locked)
    assert [u.uuid for _, u in in_flight({"n": (g,)})] == (["GPU-0"] if locked else [])
    assert not g.needs_reset  # whatever the phase: no reset candidate while it shows


E, D = MIG_ENABLED, MIG_DISABLED


def test_only_a_given_up_failure_says_so_on_mig_node() -> None:
    failed = modes.ModeFailure(E, "reset refused", "2026-12-01T00:00:00Z", until=10.0)
    given_up = replace(failed, message="drain timed out", reason=DRAIN_TIMED_OUT)
    assert "reason" not in modes.mode_status("reset", failed, None, False, 0.0)["modeChange"]
    change = modes.mode_status("reset", given_up, None, False, 0.0)["modeChange"]
    assert change == {
        "phase": "Failed",
        "reason": "DrainTimedOut",
        "target": E,
        "message": "drain timed out",
        "time": "2026-12-01T00:00:00Z",
    }


@pytest.mark.parametrize(
    ("draining", "started", "now", "timeout", "clocks", "ran_out"),
    [
        ({"a": E}, {}, 10.0, 5.0, {"a": (E, 10.0)}, set()),  # starts now
        ({"a": E}, {"a": (E, 10.0)}, 14.9, 5.0, {"a": (E, 10.0)}, set()),
        ({"a": E}, {"a": (E, 10.0)}, 15.0, 5.0, {"a": (E, 10.0)}, {"a"}),  # ran out
        ({"a": E}, {"a": (D, 0.0)}, 15.0, 5.0, {"a": (E, 15.0)}, set()),  # a new target
        ({}, {"a": (E, 0.0)}, 15.0, 5.0, {}, set()),  # stopped draining: forgotten
        ({"a": E}, {"a": (E, 0.0)}, 1e9, 0.0, {"a": (E, 0.0)}, set()),  # 0: no timeout
        ({"a": E, "b": D}, {"a": (E, 0.0)}, 5.0, 5.0, {"a": (E, 0.0), "b": (D, 5.0)}, {"a"}),
    ],
)
def test_drain_clocks(
    draining: dict[str, str],
    started: dict[str, tuple[str, float]],
    now: float,
    timeout: float,
    clocks: object,
    ran_out: set[str],
) -> None:
    assert maintenance.drain_clocks(draining, started, now, timeout) == (clocks, ran_out)


uuids = st.sampled_from(["a", "b", "c"])
targets = st.sampled_from([E, D])
times = st.floats(0, 1e6, allow_nan=False)


@given(
    st.dictionaries(uuids, targets),
    st.dictionaries(uuids, st.tuples(targets, times)),
    times,
    st.floats(0, 1e4, allow_nan=False),
)
def test_drain_clocks_properties(
    draining: dict[str, str],
    started: dict[str, tuple[str, float]],
    now: float,
    timeout: float,
) -> None:
    """Only draining GPUs keep a clock, for their current target; a clock kept for the same
    target never moves; one started now has not run out; none runs out with no timeout set;
    the same drain, `timeout` later, has run out everywhere, and what ran out stays so."""
    clocks, ran_out = maintenance.drain_clocks(draining, started, now, timeout)
    assert set(clocks) == set(draining) and ran_out <= set(clocks)
    for u, (target, since) in clocks.items():
        assert target == draining[u]
        if started.get(u, ("", 0.0))[0] == target:
            assert since == started[u][1]
        else:
            assert since == now
            assert u not in ran_out
    if timeout <= 0:
        assert not ran_out
        return
    then = max([now, *(since for _, since in clocks.values())]) + timeout + 1.0
    later, all_out = maintenance.drain_clocks(draining, clocks, then, timeout)
    assert later == clocks and all_out == set(draining) and ran_out <= all_out


def test_spec_patch_keeps_other_asks() -> None:
    body = spec_patch({"GPU-0": "enabled", "GPU-1": "disabled"}, {"GPU-2": "enabled"}, {"GPU-0"})
    assert body == {
        "spec": {
            "gpus": [
                {"uuid": "GPU-1", "desiredMigMode": "disabled"},
                {"uuid": "GPU-2", "desiredMigMode": "enabled"},
            ]
        }
    }


@pytest.mark.parametrize(
    ("labels", "want"),
    [
        ({}, {}),
        (
            {
                "nvidia.com/gpu.deploy.dcgm": "true",
                "nvidia.com/gpu.deploy.device-plugin": "false",  # forced off: left alone
                "nvidia.com/gpu.deploy.nvsm": "paused-for-mig-change",  # paused already
                "nvidia.com/gpu.deploy.other": "true",  # not a component MIG Manager pauses
                "nvidia.com/gpu.present": "true",
            },
            {"nvidia.com/gpu.deploy.dcgm": "true"},
        ),
        (
            {"nvidia.com/gpu.deploy.dcgm-exporter": "custom"},
            {"nvidia.com/gpu.deploy.dcgm-exporter": "custom"},
        ),
    ],
)
def test_labels_to_pause(labels: dict[str, str], want: dict[str, str]) -> None:
    assert maintenance.to_pause(labels) == want


A100 = replace(GPU, index=0, uuid="GPU-0", model="A100-80GB", architecture="ampere")
H100 = replace(A100, uuid="GPU-1", index=1, model="H100-80GB", architecture="hopper")
FAILED = modes.ModeFailure(MIG_ENABLED, "reset refused", "2026-12-01T00:00:00Z", until=100.0)


@pytest.mark.parametrize(
    ("desired", "failures", "now", "want"),
    [
        ({"GPU-0": MIG_ENABLED}, {}, 0.0, {"GPU-0": MIG_ENABLED}),
        ({"GPU-0": MIG_DISABLED}, {}, 0.0, {}),  # there already
        ({"GPU-1": MIG_ENABLED}, {}, 0.0, {"GPU-1": MIG_ENABLED}),  # Hopper: no reset needed
        ({"GPU-2": MIG_ENABLED}, {}, 0.0, {}),  # unknown architecture: cannot change
        ({"GPU-0": MIG_ENABLED}, {"GPU-0": FAILED}, 99.0, {}),  # within the back-off
        ({"GPU-0": MIG_ENABLED}, {"GPU-0": FAILED}, 100.0, {"GPU-0": MIG_ENABLED}),
        ({"GPU-9": MIG_ENABLED}, {}, 0.0, {}),  # not on this node
    ],
)
def test_due(
    desired: dict[str, str], failures: dict[str, modes.ModeFailure], now: float, want: object
) -> None:
    gpus = (A100, H100, replace(H100, index=2, uuid="GPU-2", architecture="ada"))
    assert maintenance.due(desired, gpus, modes.toggle, failures, now) == want


def test_desired_modes_reads_the_spec() -> None:
    obj = {"spec": {"gpus": [{"uuid": "GPU-0", "desiredMigMode": "enabled"}, {"uuid": "x"}]}}
    assert desired_modes(obj) == {"GPU-0": "enabled"}
    assert desired_modes({}) == {}


def test_checkpoint_keeps_drain_clocks_across_restarts_and_reboots() -> None:
    drains = {
        "GPU-0": DrainClock(E, 1_800_000_000.5),
        "GPU-1": DrainClock(
            D, 1_700_000_000.0, "drain timed out after 1800 s", "2026-12-01T00:00:00Z"
        ),
    }
    cp = Checkpoint(node="n", boot_id="b").with_drains(drains)
    assert checkpoint.from_json(checkpoint.to_json(cp)).drains == drains
    assert after_reboot(cp, "other boot").drains == drains  # a given-up ask stays so
    old = checkpoint.to_json(Checkpoint(node="n"))
    del old["drains"]  # written before drains were kept: still read
    assert checkpoint.from_json(old).drains == {}


def test_checkpoint_keeps_the_maintenance_record() -> None:
    intent = MaintenanceIntent({"GPU-0": MIG_ENABLED}, {"nvidia.com/gpu.deploy.dcgm": "true"})
    cp = Checkpoint(node="n", boot_id="b").with_maintenance(intent)
    back = checkpoint.from_json(checkpoint.to_json(cp))
    assert back.maintenance == intent
    assert checkpoint.from_json(checkpoint.to_json(back.with_maintenance(None))).maintenance is None
