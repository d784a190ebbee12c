"""A GPU model that is in no catalog, end to end: learned from NVML, admitted, placed, run.

Covers, with the whole system (webhook + allocator, the emulated node agent, KWOK node): the
X10-120GB group of `SPEC` is emulated from its table file alone (hack/specs/models/); the agent
publishes its 10-slot geometry in the MigNode as NVML reports it; a pod asking for 4g.60gb
and then one asking for 3g.36gb — profiles no catalog model offers — are admitted, placed at
legal placements of that geometry (4g at 0 or 5, 3g at 0, 3 or 6, not overlapping) and run,
with the instances really on the emulated GPU; a misspelt profile is refused with a "did you
mean" and the list of profiles the cluster offers.
Leaves out: engine choices among legal placements (tests/unit/test_placement_geometry.py) and
catalog models (test_lifecycle.py).
"""

from __future__ import annotations

import pytest

from common.constants import MIG_NODE_PLURAL
from common.kubeapi import ApiError, Kube, instaslice_path
from hack.dev import DevSystem
from testkit.builders import user_pod
from tests.e2e.helpers import assert_holds_slices, assert_node_matches, pods_path, wait_pod_running
from tests.support import wait_for

NODE = "x10-0"
# hack/specs/models/x10-120gb.yaml: profile -> (size, legal starts)
GEOMETRY = {"4g.60gb": (5, {0, 5}), "3g.36gb": (3, {0, 3, 6}), "8g.120gb": (10, {0})}


async def _published(kube: Kube) -> dict[str, tuple[int, set[int]]]:
    node = await wait_for(
        kube,
        instaslice_path(MIG_NODE_PLURAL),
        lambda nodes: (
            nodes[NODE] if (nodes.get(NODE, {}).get("status") or {}).get("gpus") else None
        ),
        what=f"MigNode {NODE} with its GPUs",
        within=60,
    )
    gpu = node["status"]["gpus"][0]
    assert gpu["model"] == "NVIDIA X10", gpu["model"]  # NVML's product name: no catalog entry
    out = {}
    for p in gpu["profiles"]:
        sizes = {pl["size"] for pl in p["placements"]}
        assert len(sizes) == 1, p
        out[p["name"]] = (sizes.pop(), {pl["start"] for pl in p["placements"]})
    return out


async def test_a_model_in_no_catalog_is_published_admitted_placed_and_run(
    kube: Kube, system: DevSystem, namespace: str
) -> None:
    published = await _published(kube)
    for profile, shape in GEOMETRY.items():
        assert published.get(profile) == shape, (profile, published.get(profile))

    taken = 0
    for name, profile in (("big", "4g.60gb"), ("mid", "3g.36gb")):
        await kube.create(pods_path(namespace), user_pod(name=name, slices={"c": {profile: 1}}))
        await wait_pod_running(kube, namespace, name)
        alloc = await assert_holds_slices(kube, system, namespace, name)
        assert alloc["spec"]["nodeName"] == NODE, alloc["spec"]
        (s,) = alloc["spec"]["slices"]
        size, starts = GEOMETRY[profile]
        assert (s["profile"], s["size"]) == (profile, size), s
        assert s["start"] in starts, f"{profile} at {s['start']}: not a legal start {starts}"
        mask = ((1 << size) - 1) << s["start"]
        assert not taken & mask, f"{profile} at {s['start']} overlaps {taken:#b}"
        taken |= mask
    await assert_node_matches(kube, system, NODE)


async def test_a_misspelt_profile_is_refused_with_the_offered_ones(
    kube: Kube, system: DevSystem, namespace: str
) -> None:
    await _published(kube)  # the webhook has had the MigNode event by the time we ask

    async def refusal() -> str:
        with pytest.raises(ApiError) as refused:
            await kube.create(
                pods_path(namespace), user_pod(name="typo", slices={"c": {"3g.63gb": 1}})
            )
        assert refused.value.status == 422, refused.value
        return refused.value.message

    msg = await refusal()
    assert "unknown MIG profile 3g.63gb" in msg, msg
    assert "did you mean 3g.36gb" in msg, msg
    for offered in ("3g.36gb", "4g.60gb", "8g.120gb", "1g.10gb", "4g.24gb"):
        assert offered in msg.split("GPUs offer:", 1)[-1], f"{offered} not listed: {msg}"
