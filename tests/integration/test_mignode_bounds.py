"""The MigNode and SliceAllocation CRDs' bounds, on the real API server (docs/security.md).

A node agent may write only its own MigNode, yet every GPU table it publishes is planned by
the allocator, whose tables double with each memory slot: a placement at slot 20 cost the
leader 5 s and 300 MiB on its event loop, a start of 10^18 more than any machine has. The
CRD refuses what lies beyond the bounds of common/constants.py (`MIG_MAX_*`) before it is
stored, so no allocator meets it: a status write with a placement past 16 memory slots,
too many profiles, placements, GPUs, or a model name too long is answered 422 naming the
field, and the same table at the bounds' very edge is stored. A SliceAllocation's slices
end within the same 16 slots.

Leaves out: what the allocator does with a GPU beyond the bounds that reached it anyway (an
older CRD, a cluster admin's write): tests/unit/test_mignode_bounds.py.
"""

from __future__ import annotations

import copy
import secrets
from typing import Any

import pytest

from common.constants import MIG_MAX_GPUS, MIG_MAX_MEMORY_SLOTS, MIG_MAX_PROFILES
from common.kubeapi import ApiError, Kube, instaslice_path
from tests.integration.allocator_fixtures import GpuSpec, make_mig_node

pytestmark = pytest.mark.integration

Obj = dict[str, Any]


def h100() -> Obj:
    gpu: Obj = make_mig_node("x", [GpuSpec()])["status"]["gpus"][0]
    return gpu


def with_placement(start: int, size: int) -> Obj:
    gpu = h100()
    gpu["profiles"][0]["placements"].append({"start": start, "size": size})
    return gpu


def with_instance(start: int, size: int) -> Obj:
    gpu = h100()
    gpu["slices"] = [{"profile": "1g.10gb", "start": start, "size": size, "migUUID": "MIG-x"}]
    return gpu


def many_profiles() -> Obj:
    gpu = h100()
    first = gpu["profiles"][0]
    gpu["profiles"] = [
        {**first, "name": f"1g.{i}gb", "id": 100 + i} for i in range(MIG_MAX_PROFILES + 1)
    ]
    return gpu


def many_placements() -> Obj:
    gpu = h100()
    gpu["profiles"][0]["placements"] = [{"start": 0, "size": 1}] * (MIG_MAX_MEMORY_SLOTS + 1)
    return gpu


# case → (status.gpus, what the refusal names)
REFUSED: dict[str, tuple[list[Obj], str]] = {
    "placement at slot 20": ([with_placement(20, 1)], "placements[7].start"),
    "placement start 10^18": ([with_placement(10**18, 1)], "placements[7].start"),
    "placement past 16 slots": ([with_placement(15, 2)], "within 16 memory slots"),
    "placement size 17": ([with_placement(0, 17)], "placements[7].size"),
    "instance past 16 slots": ([with_instance(14, 4)], "within 16 memory slots"),
    "instance start 16": ([with_instance(16, 1)], "slices[0].start"),
    "33 profiles": ([many_profiles()], "profiles: Too many"),
    "17 placements": ([many_placements()], "placements: Too many"),
    "index 64": ([{**h100(), "index": MIG_MAX_GPUS}], "gpus[0].index"),
    "65 GPUs": ([{**h100(), "index": 0}] * (MIG_MAX_GPUS + 1), "gpus: Too many"),
    "model name of 257": ([{**h100(), "model": "X" * 257}], "gpus[0].model: Too long"),
}


@pytest.fixture
async def mig_node(agent_kube: Kube) -> Any:
    name = f"bounds-{secrets.token_hex(3)}"
    body = {"apiVersion": "instaslice.io/v1alpha1", "kind": "MigNode", "metadata": {"name": name}}
    await agent_kube.create(instaslice_path("mignodes"), body)
    yield instaslice_path("mignodes", name=name)
    await agent_kube.delete_ignore_missing(instaslice_path("mignodes", name=name))


async def test_a_status_beyond_the_bounds_is_refused(agent_kube: Kube, mig_node: str) -> None:
    """Each write is refused with the field named; nothing of it is stored."""
    edge = [with_placement(MIG_MAX_MEMORY_SLOTS - 1, 1) | {"index": MIG_MAX_GPUS - 1}]
    await agent_kube.patch(mig_node + "/status", {"status": {"gpus": edge}})
    for case, (gpus, field) in REFUSED.items():
        with pytest.raises(ApiError) as exc:
            await agent_kube.patch(mig_node + "/status", {"status": {"gpus": gpus}})
        assert exc.value.status == 422, (case, exc.value)
        assert field in exc.value.message, (case, exc.value.message)
    stored = (await agent_kube.get(mig_node))["status"]["gpus"]
    assert stored == edge  # the edge table, as written, and nothing after it


async def test_a_slice_allocation_ends_within_the_slots(agent_kube: Kube, alloc_ns: str) -> None:
    body: Obj = {
        "apiVersion": "instaslice.io/v1alpha1",
        "kind": "SliceAllocation",
        "metadata": {"name": f"c{secrets.token_hex(4)}", "namespace": alloc_ns},
        "spec": {
            "podName": "p",
            "podUID": "u",
            "nodeName": "n",
            "slices": [
                {"container": "c", "profile": "1g.10gb", "gpuUUID": "GPU-x", "start": 15, "size": 2}
            ],
        },
    }
    path = instaslice_path("sliceallocations", alloc_ns)
    with pytest.raises(ApiError) as exc:
        await agent_kube.create(path, copy.deepcopy(body))
    assert exc.value.status == 422 and "within 16 memory slots" in exc.value.message
    body["spec"]["slices"][0]["size"] = 1
    await agent_kube.create(path, body)  # start 15, size 1: the last slot
