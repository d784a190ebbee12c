"""Warm slices in the allocator's model (docs/warm-slices.md): a MigNode slice marked `warm`
is free capacity (never occupied), and a single-slice decision that ties goes onto it.

The pure tie-break itself: tests/unit/test_placement_warm.py.
"""

from __future__ import annotations

import pytest

from common.placement import Placement, PodRequest, Policy
from testkit.builders import GpuSpec, make_allocation, make_mig_node, make_node, make_pod
from webhook.allocator import pods as podlib
from webhook.allocator.state import ClusterState

pytestmark = pytest.mark.timeout(10)


def _warm(start: int) -> dict[str, object]:
    return {"profile": "1g.10gb", "start": start, "size": 1, "migUUID": f"W{start}", "warm": True}


def _state(*gpus: GpuSpec) -> ClusterState:
    state = ClusterState()
    state.upsert_node(make_node("n1", gpus=len(gpus)))
    state.upsert_mig_node(make_mig_node("n1", list(gpus)))
    return state


def test_a_warm_slice_is_free_capacity() -> None:
    state = _state(GpuSpec(slices=[_warm(5), {"profile": "1g.10gb", "start": 6, "size": 1,
                                               "migUUID": "F"}]))  # fmt: skip
    (gpu,) = state.snapshot().nodes[0].gpus
    assert [(o.start, o.size) for o in gpu.occupied] == [(6, 1)]  # the foreign one only
    assert state.gpus["n1"][0].warm == ((5, 1, "1g.10gb"),)


def test_a_tie_goes_onto_the_warm_slice_of_the_node() -> None:
    """Two empty GPUs: the engine picks GPU 0; GPU 1's warm slice at the same start ties."""
    state = _state(GpuSpec(), GpuSpec(slices=[_warm(5)]))
    pod = make_pod("p", uid="p", claim="c1", slices={"main": {"1g.10gb": 1}})
    chosen = state.decide(_request(pod), Policy.INSTASLICE, None)
    assert isinstance(chosen, Placement) and chosen.slices[0].gpu_index == 0
    moved = state.prefer_warm(chosen, None)
    assert (moved.slices[0].gpu_index, moved.slices[0].start) == (1, 5)


def test_a_warm_slice_covered_by_an_allocation_is_not_offered() -> None:
    """The allocator placed a pod over it (the agent destroys it first): not a tie any more."""
    state = _state(GpuSpec(), GpuSpec(slices=[_warm(5)]))
    other = make_pod("q", uid="q", claim="c2")
    state.upsert_allocation(make_allocation(other, "n1", [("main", "2g.20gb", 1, 4, 2)]))
    pod = make_pod("p", uid="p", claim="c1", slices={"main": {"1g.10gb": 1}})
    chosen = state.decide(_request(pod), Policy.INSTASLICE, None)
    assert isinstance(chosen, Placement)
    assert state.prefer_warm(chosen, None) == chosen


def _request(pod: dict[str, object]) -> PodRequest:
    return podlib.pod_request(pod, podlib.pod_resources(pod))
