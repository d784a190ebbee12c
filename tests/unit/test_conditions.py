"""The condition builders (common/conditions.py) and the event builders (common/events.py) as
tables of plain data.

Covers: every condition has metav1.Condition's shape with `observedGeneration`; the `Ready`
summary of a SliceAllocation per phase and per blocking condition, and of a MigNode per
finding; a transition time kept while a status holds; an event's name identifying a repeat
(same object, reason, type, message and reporter) and nothing else; the count patch; the
gather filter derived from the one list of reasons. Leaves out the API server (aggregation,
columns and `kubectl wait`: integration/test_api_conventions.py).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from common.conditions import (
    READY,
    allocation_ready,
    allocation_status,
    condition,
    node_ready,
    observed,
    with_condition,
)
from common.constants import EventReason
from common.events import INSTANCE_MAX, NAME_MAX, count_patch, event_name, new_event
from common.gather import EVENT_REASONS, instaslice_events
from nodeagent.report import base_spec_condition, conflict_condition, conflicts

Obj = dict[str, Any]
METAV1_KEYS = {"type", "status", "reason", "message", "lastTransitionTime"}


def _c(type_: str, status: str, reason: str = "R", ltt: str = "T0") -> Obj:
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": "",
        "lastTransitionTime": ltt,
    }


@pytest.mark.parametrize(
    ("phase", "others", "want"),
    [
        ("Pending", [], ("False", "Pending")),
        ("Creating", [], ("False", "Creating")),
        ("Ready", [], ("True", "SlicesCreated")),
        ("Ready", [_c("GPUHealthy", "True", "Healthy")], ("True", "SlicesCreated")),
        ("Ready", [_c("GPUHealthy", "False", "GPUUnhealthy")], ("False", "GPUUnhealthy")),
        (
            "Ready",
            [_c("SlicesPresent", "False", "InstancesVanished")],
            ("False", "InstancesVanished"),
        ),
        ("Ready", [_c("DeviceBound", "True", "KubeletDevicePlugin")], ("True", "SlicesCreated")),
        ("Releasing", [_c("GPUHealthy", "True")], ("False", "Releasing")),
        ("Failed", [], ("False", "CreateFailed")),
    ],
)
def test_an_allocations_ready_sums_up_its_phase_and_blockers(
    phase: str, others: list[Obj], want: tuple[str, str]
) -> None:
    got = allocation_ready(phase, "msg", others, "T1")
    assert (got["type"], got["status"], got["reason"]) == (READY, *want)
    assert got.keys() >= METAV1_KEYS


def test_an_allocation_status_carries_every_condition_with_ready_and_generation() -> None:
    existing = [_c("GPUHealthy", "True", "Healthy"), _c(READY, "True", "SlicesCreated", "T0")]
    # a phase write without conditions (Releasing): the existing ones go with it, Ready flips
    got = allocation_status({"phase": "Releasing", "message": "m"}, existing, "Ready", 3, "T1")
    by_type = {c["type"]: c for c in got["conditions"]}
    assert set(by_type) == {"GPUHealthy", READY}
    assert (by_type[READY]["status"], by_type[READY]["reason"]) == ("False", "Releasing")
    assert by_type[READY]["lastTransitionTime"] == "T1"  # a transition
    assert all(c["observedGeneration"] == 3 and c.keys() >= METAV1_KEYS for c in by_type.values())
    assert got["phase"] == "Releasing" and got["message"] == "m"


def test_an_unchanged_ready_keeps_its_transition_time() -> None:
    existing = [_c(READY, "True", "SlicesCreated", "T0")]
    # a condition-only write (no phase): Ready follows the current phase, still True
    body = {"conditions": [_c("GPUHealthy", "True", "Healthy", "T1")]}
    got = allocation_status(body, existing, "Ready", 1, "T2")
    ready = next(c for c in got["conditions"] if c["type"] == READY)
    assert (ready["status"], ready["lastTransitionTime"]) == ("True", "T0")


def test_ready_keeps_the_message_its_writer_gave_and_a_condition_write_keeps_it_too() -> None:
    """The agent's Ready names the slices by MIG UUID (docs/troubleshooting.md reads it)."""
    given = _c(READY, "True", "SlicesCreated", "T0")
    given["message"] = "main: MIG-1"
    got = allocation_status({"phase": "Ready", "conditions": [given]}, [], "Pending", 1, "T1")
    ready = next(c for c in got["conditions"] if c["type"] == READY)
    assert (ready["status"], ready["message"]) == ("True", "main: MIG-1")
    body = {"conditions": [_c("GPUHealthy", "True", "Healthy", "T2")]}
    again = allocation_status(body, got["conditions"], "Ready", 1, "T3")
    assert next(c for c in again["conditions"] if c["type"] == READY)["message"] == "main: MIG-1"


@pytest.mark.parametrize(
    ("gpus", "findings", "want"),
    [
        ([], [], ("False", "NoGpus")),
        ([{"healthy": False}], [], ("False", "NoHealthyGpu")),
        ([{"healthy": False}, {"healthy": True}], [], ("True", "AgentReady")),
        ([{"healthy": True}], [_c("ConflictFree", "True", "NoConflict")], ("True", "AgentReady")),
        (
            [{"healthy": True}],
            [_c("ConflictFree", "False", "DevicePluginActive")],
            ("False", "DevicePluginActive"),
        ),
        (
            [{"healthy": True}],
            [_c("BaseCdiSpecFound", "False", "BaseCdiSpecNotFound")],
            ("False", "BaseCdiSpecNotFound"),
        ),
        ([{"healthy": True}], [_c(READY, "False", "NoGpus")], ("True", "AgentReady")),
    ],
)
def test_a_mig_nodes_ready_sums_up_its_gpus_and_findings(
    gpus: list[Obj], findings: list[Obj], want: tuple[str, str]
) -> None:
    got = node_ready(gpus, findings, "T")
    assert (got["status"], got["reason"]) == want
    assert got.keys() >= METAV1_KEYS


def test_observed_completes_an_older_agents_condition() -> None:
    old = {"type": "X", "status": "True"}  # written before reason etc. were required
    (got,) = observed([old], 4, "T")
    assert got == {**old, "reason": "Unknown", "message": "", "lastTransitionTime": "T",
                   "observedGeneration": 4}  # fmt: skip
    assert "observedGeneration" not in observed([old], 0, "T")[0]


def test_with_condition_keeps_the_time_of_an_unchanged_status_only() -> None:
    kept = with_condition([_c("A", "True", ltt="T0")], condition("A", True, "R2", "m", "T1"))
    moved = with_condition([_c("A", "True", ltt="T0")], condition("A", False, "R2", "m", "T1"))
    assert kept[0]["lastTransitionTime"] == "T0" and kept[0]["reason"] == "R2"
    assert moved[0]["lastTransitionTime"] == "T1"
    assert condition("A", None, "R", "m", "T")["status"] == "Unknown"


def test_every_false_node_finding_is_an_event_reason() -> None:
    """A False node condition is told as an event with its reason (nodeagent/writes.py): each
    must be in the one list, or the event could not be written."""
    labels = {
        "nvidia.com/gpu.deploy.device-plugin": "true",
        "nvidia.com/mig.config": "all-1g.10gb",
    }
    found = conflicts(labels, foreign=2)
    reasons = {conflict_condition({k: v}, "T")["reason"] for k, v in found.items()}
    reasons.add(base_spec_condition(None, [])["reason"])
    assert reasons <= set(EventReason)


# --- events ---------------------------------------------------------------------------------

POD = {"apiVersion": "v1", "kind": "Pod", "name": "p", "namespace": "ns", "uid": "u1"}
KEY = ("SliceReady", "Normal", "main: MIG-1", "instaslice-nodeagent", "node-a")


@pytest.mark.parametrize(
    ("involved", "key"),
    [
        ({**POD, "uid": "u2"}, KEY),  # another pod of the same name
        ({**POD, "namespace": "other"}, KEY),
        (POD, ("SliceReleased", *KEY[1:])),
        (POD, (KEY[0], "Warning", *KEY[2:])),
        (POD, (*KEY[:2], "main: MIG-2", *KEY[3:])),
        (POD, (*KEY[:4], "node-b")),  # another reporter
    ],
)
def test_an_event_name_is_the_same_only_for_a_repeat(involved: Obj, key: tuple[str, ...]) -> None:
    assert event_name(POD, KEY) == event_name(dict(POD), tuple(KEY))
    assert event_name(involved, key) != event_name(POD, KEY)


def test_an_event_names_its_reporter_and_fits_the_api_servers_bounds() -> None:
    long_name = "n" * 250 + ".x"
    ev = new_event(
        {**POD, "name": long_name}, EventReason.SLICE_READY, "m" * 2000,
        component="instaslice-nodeagent", instance="node-" + "a" * 300, type_="Normal",
        stamp="T", host="node-a",
    )  # fmt: skip
    name = ev["metadata"]["name"]
    assert len(name) <= NAME_MAX and name.startswith("n" * 200) and ".." not in name
    assert ev["reportingInstance"] == ("node-" + "a" * 300)[:INSTANCE_MAX]
    assert ev["source"] == {"component": "instaslice-nodeagent", "host": "node-a"}
    assert (ev["count"], ev["reason"], len(ev["message"])) == (1, "SliceReady", 1024)


def test_a_repeat_counts_one_more_only_if_nobody_counted_since() -> None:
    assert count_patch(3, "T") == [
        {"op": "test", "path": "/count", "value": 3},
        {"op": "replace", "path": "/count", "value": 4},
        {"op": "replace", "path": "/lastTimestamp", "value": "T"},
    ]
    assert count_patch(None, "T")[0] == {"op": "add", "path": "/count", "value": 2}


def test_gather_keeps_every_reason_of_the_one_list() -> None:
    assert set(EventReason) == EVENT_REASONS
    for reason in ("Preempting", "Preempted", "MigModeDrainTimedOut", "GpuOutOfBounds"):
        assert reason in EVENT_REASONS
    events = {"items": [{"reason": r, "source": {}, "involvedObject": {}} for r in EventReason]}
    assert len(instaslice_events(json.dumps(events))) == len(EventReason)
