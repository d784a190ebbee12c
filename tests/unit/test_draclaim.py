"""DRA mode's persistence adapter, pure parts: the ResourceClaim the allocator writes for a
decided SliceAllocation (common/draclaim.py) and how the model reads claims back.

Covers: the claim (name, owner, finalizer, one request per ask with its class, count and CEL
on the profile); its status (a result per slice naming the request of its container's ask and
the device of our pool, whole GPUs too; the node selector; reservedFor = the pod) in one
body; read back as the SliceAllocation it stands for, `Pending` before the status and `Ready`
after; a user's claim read as the devices it holds, never as ours; device names both ways;
the model counting a user's devices as occupied and naming our allocation they overlap; the
adapter (ClaimWrites) creating the claim, then allocation + reservation in one status update,
and taking the claim back when that update is refused; the controller ungating a DRA pod right
after that update, with no pin.
Leaves out: the API server (tests/integration/test_allocator_dra.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from common.allocation import SliceAllocation, allocation_for
from common.constants import (
    ASKS_ANNOTATION,
    DEVICE_CLASS_GPU,
    DEVICE_CLASS_MIG,
    RELEASE_FINALIZER,
    AllocationMode,
)
from common.draclaim import (
    as_allocation,
    claim_for,
    device_name,
    foreign_devices,
    parse_device,
    reserve,
)
from common.kubeapi import ApiError, Obj
from common.placement import Occupied, PlacedSlice, Placement
from common.podspec import SliceAsk, encode_asks
from testkit.builders import make_mig_node, make_pod
from testkit.clock import FakeClock, settle
from tests.unit.test_allocator_controller import RecordingKube, controller, leading, node
from webhook.allocator.claimwrites import ClaimWrites
from webhook.allocator.state import ClusterState

POD = make_pod("p", namespace="ns", uid="u1", claim="c1", slices={"a": {"1g.10gb": 2}})
ASKS = [SliceAsk("a", "1g.10gb", 2), SliceAsk("b", "3g.40gb", 1)]
PLACEMENT = Placement(
    "n1",
    (
        PlacedSlice("a", "1g.10gb", 0, 6, 1),
        PlacedSlice("a", "1g.10gb", 0, 5, 1),
        PlacedSlice("b", "3g.40gb", 1, 4, 4),
    ),
)
IDS = {"1g.10gb": 19, "3g.40gb": 9}


def body() -> dict:  # type: ignore[type-arg]
    return allocation_for(
        namespace="ns", claim="c1", pod=POD, placement=PLACEMENT, uuid=lambda i: f"GPU-{i}"
    )


def created() -> dict:  # type: ignore[type-arg]
    claim = claim_for(body(), ASKS)
    claim["metadata"] |= {"uid": "k1", "resourceVersion": "7"}
    return claim


def test_the_claim_stands_for_the_allocation() -> None:
    claim = claim_for(body(), ASKS)
    meta = claim["metadata"]
    assert (meta["name"], meta["namespace"], meta["finalizers"]) == (
        "c1",
        "ns",
        [RELEASE_FINALIZER],
    )
    assert [(o["kind"], o["uid"]) for o in meta["ownerReferences"]] == [("Pod", "u1")]
    requests = claim["spec"]["devices"]["requests"]
    assert [
        (r["name"], r["exactly"]["deviceClassName"], r["exactly"]["count"]) for r in requests
    ] == [
        ("slice-0", DEVICE_CLASS_MIG, 2),
        ("slice-1", DEVICE_CLASS_MIG, 1),
    ]
    assert '== "3g.40gb"' in requests[1]["exactly"]["selectors"][0]["cel"]["expression"]
    whole = claim_for(body(), [SliceAsk("a", "gpu", 1)])["spec"]["devices"]["requests"][0]
    assert whole["exactly"]["deviceClassName"] == DEVICE_CLASS_GPU and "selectors" not in whole


def test_allocation_and_reservation_in_one_status() -> None:
    claim = reserve(created(), ASKS, lambda i, p: IDS[p])
    status = claim["status"]
    assert status["reservedFor"] == [{"resource": "pods", "name": "p", "uid": "u1"}]
    assert [
        (r["request"], r["pool"], r["device"]) for r in status["allocation"]["devices"]["results"]
    ] == [
        ("slice-0", "n1", "gpu-0-mig-19-6"),
        ("slice-0", "n1", "gpu-0-mig-19-5"),
        ("slice-1", "n1", "gpu-1-mig-9-4"),
    ]
    terms = status["allocation"]["nodeSelector"]["nodeSelectorTerms"]
    assert terms == [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}
    ]


def test_read_back_pending_then_ready_and_users_claims_are_not_ours() -> None:
    before = as_allocation(created())
    assert before is not None
    view = SliceAllocation.parse(before)
    assert (view.name, view.uid, view.node, view.pod_uid, view.phase) == (
        "c1",
        "k1",
        "n1",
        "u1",
        "Pending",
    )
    assert [(s.gpu_uuid, s.start, s.size) for s in view.slices] == [
        ("GPU-0", 6, 1),
        ("GPU-0", 5, 1),
        ("GPU-1", 4, 4),
    ]
    after = as_allocation(reserve(created(), ASKS, lambda i, p: IDS[p]))
    assert after is not None and SliceAllocation.parse(after).ready
    assert foreign_devices(reserve(created(), ASKS, lambda i, p: IDS[p])) == ("", ())

    users = {"metadata": {"name": "mine", "namespace": "ns"}, "status": {"allocation": {
        "devices": {"results": [
            {"request": "r", "driver": "instaslice.io", "pool": "n1", "device": "gpu-0-mig-9-4"},
            {"request": "r", "driver": "gpu.nvidia.com", "pool": "n1", "device": "gpu-0"},
        ]}}}}  # fmt: skip
    assert as_allocation(users) is None
    assert foreign_devices(users) == ("n1", ("gpu-0-mig-9-4",))
    assert foreign_devices({"metadata": {"name": "x"}}) == ("", ())


@pytest.mark.parametrize(("gpu", "pid", "start"), [(0, 19, 6), (3, None, 0), (12, 0, 0)])
def test_device_names_both_ways(gpu: int, pid: int | None, start: int) -> None:
    assert parse_device(device_name(gpu, pid)(start)) == (gpu, pid, start)
    assert parse_device("gpu-x") is None and parse_device("other-1-mig-2-3") is None


def test_a_users_devices_are_occupied_and_overlaps_named() -> None:
    state = ClusterState()
    state.upsert_mig_node(make_mig_node("n1", ["H100-80GB", "H100-80GB"]))
    assert state.put_foreign("ns/mine", "n1", ("gpu-0-mig-9-4", "gpu-1"))
    assert not state.put_foreign("ns/mine", "n1", ("gpu-0-mig-9-4", "gpu-1"))  # unchanged
    occupied = state.occupied("n1")
    uuid0, uuid1 = (g.uuid for g in state.gpus["n1"])
    assert occupied[uuid0] == (Occupied(4, 4, "3g.40gb"),)
    assert occupied[uuid1] == (Occupied(0, 8, "gpu"),)
    ours = allocation_for(namespace="ns", claim="c1", pod=POD, placement=PLACEMENT,
                          uuid=lambda i: (uuid0, uuid1)[i])  # fmt: skip
    alloc = state.upsert_allocation(ours)
    assert state.overlapped(alloc) == "ns/mine (gpu-0-mig-9-4)"  # our 1g at 5 and 6
    epoch = state.epoch
    assert state.put_foreign("ns/mine", "", ())  # deallocated: capacity back
    assert state.epoch > epoch and state.overlapped(alloc) is None
    assert state.occupied("n1")[uuid1] == (Occupied(4, 4, "3g.40gb"),)  # ours alone


class _Elector:
    is_leader = True

    def check(self) -> None:
        pass


class _Kube:
    """Records ClaimWrites' requests; `status_fails`: the status update answers this."""

    def __init__(self, status_fails: int | None = None) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.status_fails = status_fails

    async def create(self, path: str, body: Obj) -> Obj:
        self.calls.append(("create", path, body))
        return {**body, "metadata": {**body["metadata"], "uid": "k1", "resourceVersion": "1"}}

    async def replace(self, path: str, body: Obj) -> Obj:
        self.calls.append(("replace", path, body))
        if self.status_fails is not None:
            raise ApiError(self.status_fails, "Forbidden", "no")
        return body

    async def delete(self, path: str, body: Obj | None = None) -> Obj:
        self.calls.append(("delete", path, body))
        return {}


def _writes(kube: _Kube) -> ClaimWrites:
    state = ClusterState()
    state.upsert_mig_node(make_mig_node("n1", ["H100-80GB", "H100-80GB"]))
    pod = make_pod("p", namespace="ns", uid="u1", claim="c1",
                   slices={"a": {"1g.10gb": 2}, "b": {"3g.40gb": 1}})  # fmt: skip
    pod["metadata"]["annotations"][ASKS_ANNOTATION] = encode_asks(ASKS)
    state.upsert_pod(pod)
    return ClaimWrites(kube, _Elector(), FakeClock(), "i", state=state)  # type: ignore[arg-type]


async def test_the_adapter_creates_then_allocates_and_reserves_in_one_update() -> None:
    kube = _Kube()
    got = await _writes(kube).create_allocation(body())
    assert [(c[0], c[1].rsplit("/", 2)[-1]) for c in kube.calls] == [
        ("create", "resourceclaims"),
        ("replace", "status"),
    ]
    status = kube.calls[1][2]["status"]
    assert status["reservedFor"][0]["uid"] == "u1" and status["allocation"]["devices"]["results"]
    assert SliceAllocation.parse(got).ready  # what the model is told: Ready, pin next


async def test_a_refused_status_update_takes_the_claim_back() -> None:
    kube = _Kube(status_fails=403)
    with pytest.raises(ApiError):
        await _writes(kube).create_allocation(body())
    assert kube.calls[-1][0] == "delete"
    assert kube.calls[-1][2] == {"preconditions": {"uid": "k1"}}


async def test_a_dra_pod_is_ungated_right_after_its_claim_is_written() -> None:
    """The allocator in DRA mode, watch events fed by hand (none for the claim): the claim is
    created, allocated and reserved in one status update, and the pod's gate comes off at
    once, with no pin and without waiting for the claim's watch echo."""
    kube, clock = RecordingKube(), FakeClock()
    c = controller(kube, clock, allocation_mode=AllocationMode.DRA)
    pod = make_pod("p", uid="p", claim="cclaim")
    async with leading(c):
        await node(c)
        await c.handlers.on_pod("ADDED", pod)
        await settle()
    writes = [(verb, path.rsplit("/", 2)[-2:]) for verb, path, _ in kube.writes()
              if "events" not in path]  # fmt: skip
    assert writes == [
        ("create", ["ns", "resourceclaims"]),
        ("replace", ["cclaim", "status"]),
        ("replace", ["pods", "p"]),
    ]
    ungated = kube.writes("replace")[-1][2]
    assert "schedulingGates" not in ungated["spec"] and "affinity" not in ungated["spec"]
