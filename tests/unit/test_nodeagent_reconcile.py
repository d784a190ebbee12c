"""The node agent's pure decisions (nodeagent.reconcile): what to do with an allocation,
which instances are ours, whether placements are free, reboot and orphan handling.

Table-driven over (allocation, record, instances); no NVML, no API. The lifecycle that
executes these is covered by tests/integration/test_nodeagent.py.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from common.allocation import SliceAllocation
from common.constants import NODE_LABEL, RELEASE_FINALIZER
from nodeagent.checkpoint import Checkpoint, ClaimRecord, SliceRecord
from nodeagent.model import Health, Instance, NodeInventory
from nodeagent.reconcile import (
    Action,
    adopt_from_status,
    after_reboot,
    blocked,
    decide,
    held_by_release,
    match,
    merge_plan,
    orphans,
    plan,
    vanished_claims,
)
from testkit.builders import G0, G1, gpu

INV = NodeInventory(gpus=(gpu(0, G0), gpu(1, G1)))


def alloc(
    *slices: tuple[str, str, str, int, int],
    phase: str | None = "Pending",
    deleting: bool = False,
    boot: str = "",
    status_slices: list[dict[str, Any]] | None = None,
    uid: str = "u1",
) -> dict[str, Any]:
    status: dict[str, Any] = {}
    if phase:
        status["phase"] = phase
    if boot:
        status["bootID"] = boot
    if status_slices is not None:
        status["slices"] = status_slices
    meta: dict[str, Any] = {
        "name": "c1",
        "namespace": "ns",
        "uid": uid,
        "labels": {NODE_LABEL: "n1"},
        "finalizers": [RELEASE_FINALIZER],
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "metadata": meta,
        "spec": {
            "podName": "p",
            "podUID": "pu",
            "nodeName": "n1",
            "slices": [
                {"container": c, "profile": p, "gpuUUID": g, "start": s, "size": z}
                for c, p, g, s, z in slices
            ],
        },
        "status": status,
    }


def rec(uid: str, *slices: SliceRecord, state: str = "ready") -> ClaimRecord:
    return ClaimRecord(uid, "ns", f"claim-{uid}", state, tuple(slices), "b1")  # type: ignore[arg-type]


def srec(gpu_uuid: str, pid: int, start: int, size: int, gi: int | None = None) -> SliceRecord:
    return SliceRecord(
        "main", "x", pid, gpu_uuid, 0 if gpu_uuid == G0 else 1, start, size, gi, 0, "MIG-x"
    )


def inst(gpu_uuid: str, gi: int, pid: int, start: int, size: int, mig: str = "") -> Instance:
    return Instance(
        0 if gpu_uuid == G0 else 1,
        gpu_uuid,
        gi,
        pid,
        start,
        size,
        (0,) if mig else (),
        (mig,) if mig else (),
    )


# --- decide ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("obj", "want"),
    [
        (alloc(phase=None), Action.CREATE),
        (alloc(phase="Pending"), Action.CREATE),
        (alloc(phase="Creating"), Action.CREATE),
        (alloc(phase="Ready", boot="b1"), Action.VERIFY),
        (alloc(phase="Ready", boot="b0"), Action.RECREATE),
        (alloc(phase="Ready"), Action.VERIFY),
        (alloc(phase="Ready", deleting=True), Action.RELEASE),
        (alloc(phase="Pending", deleting=True), Action.RELEASE),
        (alloc(phase="Failed"), Action.NONE),
        (alloc(phase="Releasing"), Action.NONE),
    ],
)
def test_decide(obj: dict[str, Any], want: Action) -> None:
    assert decide(SliceAllocation.parse(obj), None, "b1").action is want


MADE = srec(G0, 9, 0, 1, gi=1)


@pytest.mark.parametrize(
    ("obj", "record", "want"),
    [
        # our own Failed is final: a late echo (or a forged status) is answered with Failed
        (alloc(phase="Creating"), rec("u1", state="failed"), Action.REFAIL),
        (alloc(phase="Ready"), rec("u1", state="failed"), Action.REFAIL),
        (alloc(phase="Failed"), rec("u1", state="failed"), Action.NONE),
        # a failed create whose rollback NVML refused: retried, not made again
        (alloc(phase="Creating"), rec("u1", MADE, state="releasing"), Action.ROLLBACK),
        (alloc(phase="Creating", deleting=True), rec("u1", state="failed"), Action.RELEASE),
        # our own Ready told: a late Creating echo is not news
        (alloc(phase="Creating"), replace(rec("u1", MADE), announced=True), Action.NONE),
        # made but not told (a crash before the Ready write): say Ready again
        (alloc(phase="Creating"), rec("u1", MADE), Action.CREATE),
        # told, but in an earlier boot: the slices are gone, make them again
        (
            alloc(phase="Creating"),
            replace(rec("u1", MADE), announced=True, boot_id="b0"),
            Action.CREATE,
        ),
    ],
    ids=[
        "failed-echo",
        "failed-forged-ready",
        "failed-stays",
        "rollback-pending",
        "failed-deleted",
        "ready-echo",
        "untold",
        "old-boot",
    ],
)
def test_decide_recognises_our_own_writes(
    obj: dict[str, Any], record: ClaimRecord, want: Action
) -> None:
    assert decide(SliceAllocation.parse(obj), record, "b1").action is want


def test_the_allocation_model_reads_the_wire() -> None:
    v = SliceAllocation.parse(alloc(("main", "1g.18gb", G0, 3, 1), ("side", "3g.71gb", G1, 4, 4)))
    assert v.key == "ns/c1" and v.node == "n1" and v.has_finalizer and not v.deleting
    assert v.containers() == ["main", "side"]
    assert v.slices[1].start == 4 and v.slices[1].gpu_uuid == G1


# --- plan ---------------------------------------------------------------------------------


def test_plan_resolves_profile_ids() -> None:
    out = plan(
        SliceAllocation.parse(alloc(("a", "1g.35gb", G0, 6, 2), ("b", "7g.141gb", G1, 0, 8))),
        INV,
        {},
    )
    assert not isinstance(out, str)
    assert [(s.profile_id, s.gpu_index, s.start, s.size) for s in out] == [
        (15, 0, 6, 2),
        (0, 1, 0, 8),
    ]


@pytest.mark.parametrize(
    ("slices", "inv", "health", "needle"),
    [
        ([("a", "1g.18gb", "GPU-nope", 0, 1)], INV, {}, "not on node"),
        ([("a", "1g.18gb", G0, 7, 1)], INV, {}, "not a placement"),
        ([("a", "3g.71gb", G0, 2, 4)], INV, {}, "not a placement"),
        ([("a", "1g.5gb", G0, 0, 1)], INV, {}, "has no profile 1g.5gb"),
        ([("a", "1g.18gb", G0, 0, 1)], INV, {0: Health(False, "XID 79")}, "unhealthy (XID 79)"),
        (
            [("a", "1g.18gb", G0, 0, 1)],
            NodeInventory(gpus=(gpu(0, G0, mig="disabled"),)),
            {},
            "MIG mode is disabled",
        ),
        ([("a", "2g.35gb", G0, 0, 2), ("b", "1g.18gb", G0, 1, 1)], INV, {}, "slices overlap"),
    ],
)
def test_plan_refuses(
    slices: list[tuple[str, str, str, int, int]],
    inv: NodeInventory,
    health: dict[int, Health],
    needle: str,
) -> None:
    out = plan(SliceAllocation.parse(alloc(*slices)), inv, health)
    assert isinstance(out, str) and needle in out


# --- ownership ------------------------------------------------------------------------------


def test_match_by_placement_then_by_gi_id() -> None:
    cp = Checkpoint(
        "n1",
        "b1",
        {
            "u1": rec("u1", srec(G0, 19, 3, 1)),  # interrupted create: no GI id yet
            "u2": rec("u2", srec(G0, 15, 4, 2, gi=5)),  # GI id known
            "u3": rec("u3", srec(G1, 9, 0, 4, gi=1)),  # GI id known, but a different GI is there
        },
    )
    instances = [
        inst(G0, 10, 19, 3, 1),
        inst(G0, 5, 15, 4, 2),
        inst(G1, 2, 9, 0, 4),  # same placement as u3 but GI 2: not provably ours
        inst(G1, 13, 19, 6, 1),
    ]
    own = match(cp, instances)
    assert own.owner == {(G0, 10): ("u1", 0), (G0, 5): ("u2", 0)}
    assert {i.key for i in own.foreign} == {(G1, 2), (G1, 13)}
    assert own.found[("u1", 0)].gi_id == 10


def test_blocked_reports_foreign_and_other_claims() -> None:
    fresh = [srec(G0, 9, 4, 4)]
    cp = Checkpoint("n1", "b1", {"u2": rec("u2", srec(G0, 19, 5, 1, gi=12))})
    other = [inst(G0, 12, 19, 5, 1)]
    why = blocked(fresh, "u1", other, match(cp, other))
    assert why and "another allocation (uid u2)" in why
    foreign = [inst(G0, 7, 19, 6, 1)]
    why = blocked(fresh, "u1", foreign, match(Checkpoint("n1"), foreign))
    assert why and "did not create" in why
    assert blocked(fresh, "u1", [inst(G0, 3, 14, 0, 2)], match(Checkpoint("n1"), [])) is None
    assert blocked(fresh, "u1", [inst(G1, 1, 9, 4, 4)], match(Checkpoint("n1"), [])) is None
    # an instance exactly where our own record claims it is not a blocker
    mine = Checkpoint("n1", "b1", {"u1": rec("u1", srec(G0, 9, 4, 4), state="creating")})
    at = [inst(G0, 2, 9, 4, 4)]
    assert blocked(fresh, "u1", at, match(mine, at)) is None


def test_merge_plan_keeps_known_ids_of_unchanged_slices() -> None:
    old = rec("u1", srec(G0, 19, 3, 1, gi=10), srec(G0, 19, 4, 1, gi=11), state="creating")
    fresh = (srec(G0, 19, 3, 1), srec(G0, 19, 5, 1))
    merged = merge_plan(old, fresh)
    assert merged[0].gi_id == 10 and merged[1].gi_id is None
    assert merge_plan(None, fresh) == fresh


def test_adopt_from_status_needs_every_uuid_at_its_placement() -> None:
    a = SliceAllocation.parse(
        alloc(
            ("a", "1g.18gb", G0, 3, 1),
            ("b", "1g.18gb", G0, 4, 1),
            phase="Ready",
            status_slices=[
                {"container": "a", "migUUID": "MIG-a"},
                {"container": "b", "migUUID": "MIG-b"},
            ],
        )
    )
    fresh = plan(a, INV, {})
    assert not isinstance(fresh, str)
    both = [inst(G0, 10, 19, 3, 1, "MIG-a"), inst(G0, 11, 19, 4, 1, "MIG-b")]
    got = adopt_from_status(a, fresh, both)
    assert got is not None and [(s.gi_id, s.mig_uuid) for s in got] == [
        (10, "MIG-a"),
        (11, "MIG-b"),
    ]
    assert adopt_from_status(a, fresh, both[:1]) is None
    moved = [inst(G0, 10, 19, 3, 1, "MIG-a"), inst(G0, 12, 19, 5, 1, "MIG-b")]
    assert adopt_from_status(a, fresh, moved) is None
    recreated = [inst(G0, 10, 19, 3, 1, "MIG-a"), inst(G0, 11, 19, 4, 1, "MIG-new")]
    assert adopt_from_status(a, fresh, recreated) is None


# --- reboot and orphans ------------------------------------------------------------------------


def test_after_reboot_forgets_ids_but_keeps_intent() -> None:
    cp = Checkpoint("n1", "b0", {"u1": rec("u1", srec(G0, 19, 3, 1, gi=10))})
    same = after_reboot(cp, "b0")
    assert same is cp
    fresh = after_reboot(Checkpoint("n1", "", cp.claims), "b1")
    assert fresh.boot_id == "b1" and fresh.claims["u1"].slices[0].gi_id == 10
    rebooted = after_reboot(cp, "b1")
    s = rebooted.claims["u1"].slices[0]
    assert rebooted.boot_id == "b1" and (s.gi_id, s.ci_id, s.mig_uuid) == (None, None, None)
    assert rebooted.claims["u1"].state == "ready"


def test_orphans_wait_for_the_grace_period() -> None:
    cp = Checkpoint("n1", "b1", {"u1": rec("u1"), "u2": rec("u2")})
    due, seen = orphans(cp, {"u2"}, {}, now=100.0, grace_s=60)
    assert due == [] and seen == {"u1": 100.0}
    due, seen = orphans(cp, {"u2"}, seen, now=159.0, grace_s=60)
    assert due == []
    due, seen = orphans(cp, {"u2"}, seen, now=160.0, grace_s=60)
    assert due == ["u1"]
    due, seen = orphans(cp, {"u1", "u2"}, seen, now=161.0, grace_s=60)  # it came back
    assert due == [] and seen == {}
    due, _ = orphans(replace(cp, claims={}), set(), {"u9": 0.0}, now=1e9, grace_s=0)
    assert due == []


def test_vanished_claims_are_ready_records_missing_an_instance() -> None:
    cp = Checkpoint(
        "n1",
        "b1",
        {
            "kept": replace(rec("kept", srec(G0, 15, 4, 2, gi=5)), updated=10.0),
            "gone": replace(rec("gone", srec(G0, 19, 0, 1, gi=7)), updated=10.0),
            "lost": replace(rec("lost", srec(G1, 9, 0, 4, gi=1)), updated=10.0),  # GPU lost
            "new": replace(rec("new", srec(G0, 19, 1, 1, gi=8)), updated=99.0),  # after scan
            "making": replace(rec("making", srec(G0, 19, 2, 1), state="creating"), updated=1.0),
        },
    )
    own = match(cp, [inst(G0, 5, 15, 4, 2)])
    assert vanished_claims(cp, own, lambda i: i == 1, before=50.0) == {"gone"}
    assert vanished_claims(cp, own, lambda i: False, before=50.0) == {"gone", "lost"}


@pytest.mark.parametrize(
    ("held", "state", "want"),
    [
        ([srec(G0, 9, 4, 4)], "releasing", "u2"),  # the same slots
        ([srec(G0, 19, 5, 1)], "releasing", "u2"),  # one slot of ours
        ([srec(G0, 19, 3, 1)], "releasing", None),  # the slot before ours
        ([srec(G0, 19, 0, 4)], "releasing", None),  # next to ours, not on them
        ([srec(G1, 9, 4, 4)], "releasing", None),  # another GPU
        ([srec(G0, 9, 4, 4)], "ready", None),  # not being released: the placement check's
        ([srec(G0, 9, 4, 4)], "creating", None),
        ([srec(G0, 19, 0, 1), srec(G0, 19, 7, 1)], "releasing", "u2"),  # its second slice
        ([replace(srec(G0, 0, 0, 8), kind="gpu")], "releasing", None),  # a whole GPU: no instance
    ],
)
def test_held_by_release(held: list[SliceRecord], state: str, want: str | None) -> None:
    fresh = [srec(G1, 14, 0, 2), srec(G0, 9, 4, 4)]
    cp = Checkpoint("n1", "b1", {"u2": rec("u2", *held, state=state)})
    assert held_by_release(cp, "u1", fresh) == want


def test_held_by_release_ignores_the_claims_own_record() -> None:
    cp = Checkpoint("n1", "b1", {"u1": rec("u1", srec(G0, 9, 4, 4), state="releasing")})
    assert held_by_release(cp, "u1", [srec(G0, 9, 4, 4)]) is None
