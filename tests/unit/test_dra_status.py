"""A prepared claim's status.devices (nodeagent/dra/status.py) and when the worker writes it
(nodeagent/dra/claims.py `unreported`): pure tables. The write itself, its authorization and
the policy around it are tests/integration/test_dra_rbac.py's."""

from __future__ import annotations

from typing import Any

import pytest

from nodeagent.checkpoint import ClaimRecord, SliceRecord
from nodeagent.dra.claims import ClaimView, Result, parse, unreported
from nodeagent.dra.status import entries, merged, reported

NODE = "n1"
DEV = "gpu-0-mig-19-6"
NOW = "2026-12-08T00:00:00Z"
BOOT = "boot"


def record(state: str = "ready", boot: str = BOOT) -> ClaimRecord:
    s = SliceRecord(DEV, "1g.10gb", 19, "GPU-0", 0, 6, 1, gi_id=9, ci_id=0, mig_uuid="MIG-a")
    return ClaimRecord("u1", "ns", "c", state, (s,), boot_id=boot)  # type: ignore[arg-type]


def entry(pool: str = NODE, device: str = DEV, driver: str = "instaslice.io", **kw: Any) -> Any:
    ready = {"type": "Ready", "status": kw.get("status", "True"), "reason": "SliceMade",
             "message": kw.get("message", ""), "lastTransitionTime": kw.get("at", NOW)}  # fmt: skip
    return {"driver": driver, "pool": pool, "device": device, "conditions": [ready],
            "data": kw.get("data", {})}  # fmt: skip


def test_an_entry_per_made_slice_names_its_mig_device() -> None:
    (e,) = entries(NODE, record(), NOW)
    assert (e["driver"], e["pool"], e["device"]) == ("instaslice.io", NODE, DEV)
    assert e["data"] == {"migUUID": "MIG-a", "gpuUUID": "GPU-0", "profile": "1g.10gb"}
    (c,) = e["conditions"]
    assert (c["type"], c["status"], c["reason"], c["lastTransitionTime"]) == (
        "Ready", "True", "SliceMade", NOW
    )  # fmt: skip
    assert "MIG-a" in c["message"]


def test_merge_keeps_other_drivers_and_pools_and_replaces_ours() -> None:
    others = [entry(driver="gpu.nvidia.com"), entry(pool="n2")]
    stale = entry(device="gpu-0-mig-19-5")
    (ours,) = entries(NODE, record(), NOW)
    assert merged([*others, stale], NODE, [ours]) == [*others, ours]
    assert merged([*others, stale], NODE, []) == others  # released: ours taken out
    assert merged(None, NODE, [ours]) == [ours]


def test_merge_keeps_an_unchanged_conditions_transition_time() -> None:
    (ours,) = entries(NODE, record(), "2027-01-01T00:00:00Z")
    before = {**ours, "conditions": [{**ours["conditions"][0], "lastTransitionTime": NOW}]}
    assert merged([before], NODE, [ours]) == [before]  # nothing to write


@pytest.mark.parametrize(
    ("devices", "want"),
    [
        ([], set()),
        ([entry()], {DEV}),
        ([entry(status="False")], set()),
        ([entry(pool="n2"), entry(driver="gpu.nvidia.com")], set()),
    ],
)
def test_reported_is_this_pools_ready_devices(devices: list[Any], want: set[str]) -> None:
    assert reported({"status": {"devices": devices}}, NODE) == want


def view(reported_: frozenset[str] = frozenset(), *, ours: bool = True, **kw: Any) -> ClaimView:
    return ClaimView(
        "u1", "ns", "c", (Result("slice", DEV),) if ours else (), reserved=True,
        deleting=kw.get("deleting", False), has_finalizer=False, reported=reported_,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("v", "rec", "want"),
    [
        (view(), record(), True),  # made, not shown yet
        (view(frozenset({DEV})), record(), False),  # shown
        (view(), record("creating"), False),  # not made yet
        (view(), record(boot="older"), False),  # made before a reboot: carved again first
        (view(frozenset({DEV})), None, True),  # released while allocated: take ours out
        (view(frozenset({DEV}), ours=False), None, False),  # deallocated: cleared with it
        (view(frozenset({DEV}), deleting=True), None, False),  # going: nothing to write
        (None, record(), False),
    ],
)
def test_unreported(v: ClaimView | None, rec: ClaimRecord | None, want: bool) -> None:
    assert unreported(v, rec, BOOT) is want


def test_parse_reads_what_the_status_shows() -> None:
    claim = {
        "metadata": {"uid": "u1", "namespace": "ns", "name": "c"},
        "status": {
            "allocation": {"devices": {"results": [
                {"request": "slice", "driver": "instaslice.io", "pool": NODE, "device": DEV}
            ]}},
            "reservedFor": [{"resource": "pods", "name": "p", "uid": "p1"}],
            "devices": [entry()],
        },
    }  # fmt: skip
    assert parse(claim, NODE).reported == {DEV}
