"""The allocator's mode views (ClusterState.mode_view / whole_view) and the placer's choice.

Covers: a GPU is flex only while nothing occupies it (an allocation made but not yet carried
out counts); an Ampere GPU with MIG off needs a reset; a whole-GPU allocation keeps both MIG
slices and other whole GPUs off its GPU (its occupancy spans every slot), before and after the
agent turned MIG off; a GPU whose asked mode change (Ampere maintenance) is under way is listed
`under_way` in the view of its target mode, while nothing occupies it, and a pod that would fit
there waits MigModeChangeUnderWay; the placer builds a `kind: gpu` allocation for a whole-GPU
pod and a MIG one on a flex GPU only when no MIG GPU fits.
Leaves out: the pure engines (test_placement_modes.py, test_placement_whole.py).
"""

from __future__ import annotations

from typing import Any

from common.placement import Pending, PendingReason, Placement, Policy
from common.placement.modes import place_with_modes
from common.placement.whole import place_whole
from testkit.builders import GpuSpec, gpu_uuid, make_allocation, make_mig_node, make_node, make_pod
from webhook.allocator import pods as podlib
from webhook.allocator.state import ClusterState

H100 = "H100-80GB"
A100 = "A100-40GB"


def _mig_node(name: str, specs: list[GpuSpec]) -> dict[str, Any]:
    node = make_mig_node(name, specs)
    for g, spec in zip(node["status"]["gpus"], specs, strict=True):
        g["modeToggle"] = "reset" if spec.model.startswith("A") else "resetless"
        g["computeProcesses"] = 0
    return node


def state_with(specs: list[GpuSpec]) -> ClusterState:
    state = ClusterState()
    state.upsert_node(make_node("n1", cpu="8", memory="32Gi", pods=10, gpus=len(specs)))
    state.upsert_mig_node(_mig_node("n1", specs))
    return state


def test_flex_only_while_nothing_occupies_it() -> None:
    state = state_with(
        [GpuSpec(H100, mig=False), GpuSpec(H100, mig=False), GpuSpec(A100, mig=False)]
    )
    view = state.mode_view(state.snapshot())
    assert view.flex == {("n1", 0), ("n1", 1)} and view.needs_reset == {("n1", 2)}
    pod = make_pod("w", uid="w", claim="cw")
    whole = make_allocation(pod, "n1", [("main", "gpu", 0, 0, 8)])
    whole["spec"]["slices"][0]["kind"] = "gpu"
    state.upsert_allocation(whole)
    snap = state.snapshot()
    assert state.mode_view(snap).flex == {("n1", 1)}  # the whole GPU's is taken
    assert state.whole_view(snap).right_mode == {("n1", 1), ("n1", 2)}
    req = podlib.pod_request(make_pod("m", uid="m", claim="cm"))  # one 1g.10gb
    got = place_with_modes(snap, req, state.mode_view(snap), Policy.INSTASLICE)
    assert isinstance(got.result, Placement) and [s.gpu_index for s in got.result.slices] == [1]


def test_whole_gpu_pod_goes_to_mig_off_gpu_and_never_beside_slices() -> None:
    state = state_with([GpuSpec(H100), GpuSpec(H100, mig=False)])
    pod = make_pod("w", uid="w", claim="cw")
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    limits.pop("instaslice.io/mig-1g.10gb")
    limits["instaslice.io/gpu"] = "1"  # as admission rewrites nvidia.com/gpu
    req = podlib.pod_request(pod)
    snap = state.snapshot()
    got = place_whole(snap, req, state.whole_view(snap))
    assert isinstance(got.result, Placement) and got.toggles == ()
    assert [(s.gpu_index, s.profile, s.start, s.size) for s in got.result.slices] == [
        (1, "gpu", 0, 8)
    ]
    # a MIG slice on GPU 0 (not yet carried out): GPU 0 is no whole GPU any more
    m = make_pod("m", uid="m", claim="cm")
    state.upsert_allocation(make_allocation(m, "n1", [("main", "1g.10gb", 0, 6, 1)]))
    snap = state.snapshot()
    assert state.whole_view(snap).toggle == frozenset()
    again = place_whole(snap, req, state.whole_view(snap))
    assert isinstance(again.result, Placement) and again.result.slices[0].gpu_index == 1


def test_a_gpu_under_way_is_in_the_view_of_its_target_mode() -> None:
    state = state_with([GpuSpec(A100, mig=False), GpuSpec(A100), GpuSpec(A100, mig=False)])
    asks = {gpu_uuid("n1", 0): "enabled", gpu_uuid("n1", 1): "disabled"}
    mig_node = _mig_node("n1", [GpuSpec(A100, mig=False), GpuSpec(A100), GpuSpec(A100, mig=False)])
    mig_node["spec"] = {"gpus": [{"uuid": u, "desiredMigMode": m} for u, m in asks.items()]}
    state.upsert_mig_node(mig_node)
    snap = state.snapshot()
    modes, whole = state.mode_view(snap), state.whole_view(snap)
    assert modes.under_way == {("n1", 0)} and modes.needs_reset == {("n1", 2)}
    assert whole.under_way == {("n1", 1)} and whole.needs_reset == frozenset()
    req = podlib.pod_request(make_pod("m", uid="m", claim="cm"))  # one 1g.10gb
    got = place_with_modes(snap, req, state.mode_view(snap), Policy.INSTASLICE)
    assert isinstance(got.result, Pending), got.result
    assert got.result.reason is PendingReason.MIG_MODE_CHANGE_UNDER_WAY
    assert "n1/GPU 0" in got.result.message and got.resets == ()
    # an allocation on the GPU (made before the ask): the pod no longer waits for it
    other = make_pod("o", uid="o", claim="co")
    state.upsert_allocation(make_allocation(other, "n1", [("main", "1g.10gb", 0, 6, 1)]))
    assert state.mode_view(state.snapshot()).under_way == frozenset()
