"""DRA mode's view of ResourceClaims on the node (nodeagent/dra/claims.py): pure.

- `parse` keeps only the results of driver instaslice.io in this node's pool, and refuses an
  allocation whose nodeSelector names another node;
- `slices_for` turns device names into the agent's intent records (MIG and whole GPU), or
  says why not;
- `decide`, as a table: carve when allocated here, reserved, not unprepared and not made;
  release otherwise while a record holds slices; drop the finalizer of a deleted claim that
  holds nothing.
Leaves out: executing the steps (tests/integration/test_dra_plugin.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from common.constants import RELEASE_FINALIZER
from nodeagent.checkpoint import ClaimRecord, SliceRecord
from nodeagent.dra.claims import (
    ClaimView,
    Result,
    Step,
    cdi_ids,
    decide,
    parse,
    parse_device,
    slices_for,
)
from nodeagent.model import NodeInventory
from testkit.builders import G0, gpu

NODE = "n1"


def claim(
    results: list[tuple[str, str, str]],
    *,
    reserved: bool = True,
    deleting: bool = False,
    node: str | None = NODE,
    finalizer: bool = False,
) -> dict[str, Any]:
    alloc: dict[str, Any] = {
        "devices": {
            "results": [
                {"request": "r", "driver": d, "pool": p, "device": dev} for d, p, dev in results
            ]
        }
    }
    if node is not None:
        alloc["nodeSelector"] = {
            "nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
            ]
        }
    meta: dict[str, Any] = {"uid": "u1", "namespace": "ns", "name": "c"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    if finalizer:
        meta["finalizers"] = [RELEASE_FINALIZER]
    status: dict[str, Any] = {"allocation": alloc}
    if reserved:
        status["reservedFor"] = [{"resource": "pods", "name": "p", "uid": "pu"}]
    return {"metadata": meta, "status": status}


def test_parse_keeps_this_drivers_devices_in_this_pool() -> None:
    v = parse(
        claim([("instaslice.io", NODE, "gpu-0-mig-19-5"), ("gpu.nvidia.com", NODE, "gpu-1")]),
        NODE,
    )
    assert v.ours == (Result("r", "gpu-0-mig-19-5"),) and v.reserved and not v.problem
    other = parse(claim([("instaslice.io", "n2", "gpu-0-mig-19-5")], node="n2"), NODE)
    assert other.ours == () and "pool n2" in other.problem
    # a forged pool name with a nodeSelector for another node: refused
    forged = parse(claim([("instaslice.io", NODE, "gpu-0-mig-19-5")], node="n2"), NODE)
    assert forged.ours == () and "nodeSelector" in forged.problem
    unalloc = parse({"metadata": {"uid": "u"}, "status": {}}, NODE)
    assert unalloc.ours == () and not unalloc.reserved


@pytest.mark.parametrize(
    ("name", "want"),
    [
        ("gpu-0-mig-19-5", (0, 19, 5)),
        ("gpu-3", (3, None, 0)),
        ("gpu-x", None),
        ("gpu-0-mig-19", None),
        ("cpu-0-mig-1-2", None),
    ],
)
def test_parse_device(name: str, want: tuple[int, int | None, int] | None) -> None:
    assert parse_device(name) == want


def test_slices_for_mig_and_whole_devices() -> None:
    inv = NodeInventory(gpus=(gpu(0, G0),))
    g = inv.gpus[0]
    p = g.profiles[0]
    start, size = p.placements[-1]
    view = parse(
        claim(
            [("instaslice.io", NODE, f"gpu-0-mig-{p.id}-{start}"), ("instaslice.io", NODE, "gpu-0")]
        ),
        NODE,
    )
    made = slices_for(view, inv)
    assert not isinstance(made, str), made
    mig, whole = made
    assert (mig.profile, mig.start, mig.size, mig.gpu_uuid) == (p.name, start, size, g.uuid)
    assert mig.container == f"gpu-0-mig-{p.id}-{start}" and not mig.whole
    assert whole.whole and whole.container == "gpu-0"
    bad = parse(claim([("instaslice.io", NODE, f"gpu-0-mig-{p.id}-99")]), NODE)
    assert "no such placement" in str(slices_for(bad, inv))
    gone = parse(claim([("instaslice.io", NODE, "gpu-7-mig-19-0")]), NODE)
    assert "no such device" in str(slices_for(gone, inv))
    assert cdi_ids(view)["gpu-0"] == "instaslice.io/mig=ns_c_gpu-0"


def _view(**kw: Any) -> ClaimView:
    base: dict[str, Any] = dict(
        uid="u1", namespace="ns", name="c", ours=(Result("r", "gpu-0"),), reserved=True,
        deleting=False, has_finalizer=False,
    )  # fmt: skip
    base.update(kw)
    return ClaimView(**base)


def _rec(state: str = "ready", done: bool = True, boot: str = "b1") -> ClaimRecord:
    s = SliceRecord(
        "gpu-0", "gpu", -1, "GPU-0", 0, 0, 8, mig_uuid="GPU-0" if done else None, kind="gpu"
    )
    return ClaimRecord("u1", "ns", "c", state, (s,), boot)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("view", "record", "unprepared", "step"),
    [
        (_view(), None, False, Step.CARVE),  # eager: allocated here and reserved
        (_view(), _rec(), False, Step.NOTHING),  # made already
        (_view(), _rec(done=False, state="creating"), False, Step.CARVE),  # a crash mid-create
        (_view(), _rec(boot="b0"), False, Step.CARVE),  # made before a reboot
        (_view(reserved=False), None, False, Step.NOTHING),  # allocated, nobody uses it yet
        (_view(reserved=False), _rec(), False, Step.RELEASE),  # no longer reserved
        (_view(), _rec(), True, Step.RELEASE),  # the kubelet unprepared it
        (_view(), None, True, Step.NOTHING),
        (_view(ours=()), _rec(), False, Step.RELEASE),  # deallocated
        (None, _rec(), False, Step.RELEASE),  # deleted
        (_view(deleting=True, has_finalizer=True), _rec(), False, Step.RELEASE),
        (_view(deleting=True, has_finalizer=True), None, False, Step.DROP_FINALIZER),
        (_view(deleting=True), None, False, Step.NOTHING),
        (_view(ours=(), has_finalizer=True), None, False, Step.NOTHING),  # not yet allocated
    ],
)
def test_decide(
    view: ClaimView | None, record: ClaimRecord | None, unprepared: bool, step: Step
) -> None:
    assert decide(view, record, "b1", unprepared) is step
