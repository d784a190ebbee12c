"""The placement engine (common.placement.place), table-driven.

Covers: every PendingReason with the words of its message and the precedence between them;
the known fragmentation traps; nodeSelector / required affinity (every operator) / taints /
cordons; several containers, counts above one, init containers, heterogeneous models on one
node and across nodes; what each baseline policy prefers; packing across nodes; count and
engine limits (+me); placements in request order.
Leaves out: random snapshots (test_placement_properties.py), the benchmark and the CLI
(test_placement_bench.py), quantity parsing (test_quantity.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import pytest

from common.placement import (
    Gpu,
    NodeSelectorRequirement,
    NodeState,
    Occupied,
    Pending,
    PendingReason,
    Placement,
    PodRequest,
    Policy,
    Snapshot,
    Taint,
    Toleration,
    place,
)
from testkit.builders import pod_request

GI = 1 << 30


# --- builders ---------------------------------------------------------------------------
def make_gpu(
    model: str,
    index: int = 0,
    occupied: Iterable[tuple[str, int, int]] = (),
    *,
    mig: bool = True,
    healthy: bool = True,
) -> Gpu:
    """`occupied`: (profile, start, size) triples."""
    occ = tuple(Occupied(start, size, profile) for profile, start, size in occupied)
    return Gpu(index, model, mig, healthy, occ)


def make_node(
    name: str,
    gpus: Iterable[Gpu] | None = None,
    *,
    model: str = "A100-40GB",
    count: int = 1,
    cpu: int = 64_000,
    memory: int = 512 * GI,
    pods: int = 110,
    labels: Mapping[str, str] | None = None,
    taints: tuple[Taint, ...] = (),
    unschedulable: bool = False,
) -> NodeState:
    if gpus is None:
        gpus = [make_gpu(model, i) for i in range(count)]
    gpus = tuple(Gpu(i, g.model, g.mig_enabled, g.healthy, g.occupied) for i, g in enumerate(gpus))
    return NodeState(name, dict(labels or {}), taints, unschedulable, cpu, memory, pods, gpus)


def snap(*nodes: NodeState) -> Snapshot:
    return Snapshot(tuple(nodes))


def apply(s: Snapshot, p: Placement, pod: PodRequest) -> Snapshot:
    """The snapshot after `p` (what the allocator's cache does)."""
    out = []
    for n in s.nodes:
        if n.name != p.node:
            out.append(n)
            continue
        gpus = []
        for g in n.gpus:
            extra = tuple(
                Occupied(x.start, x.size, x.profile) for x in p.slices if x.gpu_index == g.index
            )
            gpus.append(Gpu(g.index, g.model, g.mig_enabled, g.healthy, g.occupied + extra))
        out.append(
            NodeState(
                n.name,
                n.labels,
                n.taints,
                n.unschedulable,
                n.cpu_millis_free - pod.cpu_millis,
                n.memory_bytes_free - pod.memory_bytes,
                n.pods_free - 1,
                tuple(gpus),
            )
        )
    return Snapshot(tuple(out))


def placed(result: Placement | Pending) -> Placement:
    assert isinstance(result, Placement), result
    return result


def pending(result: Placement | Pending, reason: PendingReason) -> str:
    assert isinstance(result, Pending), result
    assert result.reason is reason, result
    return result.message


def spots(p: Placement) -> list[tuple[str, str, int, int, int]]:
    return [(s.container, s.profile, s.gpu_index, s.start, s.size) for s in p.slices]


def run_sequence(
    s: Snapshot, profiles: Iterable[str], policy: Policy = Policy.INSTASLICE
) -> tuple[Snapshot, list[Placement | Pending]]:
    results: list[Placement | Pending] = []
    for i, profile in enumerate(profiles):
        pod = pod_request(("c", profile), name=f"p{i}")
        r = place(s, pod, policy)
        results.append(r)
        if isinstance(r, Placement):
            s = apply(s, r, pod)
    return s, results


# --- the traps ----------------------------------------------------------------------------
def test_trap_1g_then_4g_on_one_a100() -> None:
    _, results = run_sequence(snap(make_node("a")), ["1g.5gb", "4g.20gb"])
    assert all(isinstance(r, Placement) for r in results)
    # First fit walks straight into it.
    _, ff = run_sequence(snap(make_node("a")), ["1g.5gb", "4g.20gb"], Policy.FIRST_FIT)
    assert placed(ff[0]).slices[0].start == 0
    pending(ff[1], PendingReason.FRAGMENTED)


def test_trap_3g_1g_3g_4g_on_two_h200() -> None:
    s = snap(make_node("a", model="H200-141GB", count=2))
    _, results = run_sequence(s, ["3g.71gb", "1g.18gb", "3g.71gb", "4g.71gb"])
    assert all(isinstance(r, Placement) for r in results), results
    _, ff = run_sequence(s, ["3g.71gb", "1g.18gb", "3g.71gb", "4g.71gb"], Policy.FIRST_FIT)
    pending(ff[3], PendingReason.FRAGMENTED)


@pytest.mark.parametrize("policy", list(Policy))
def test_trap_one_pod_1g_1g_2g_3g_on_one_a100(policy: Policy) -> None:
    pod = pod_request(("a", "1g.5gb"), ("b", "1g.5gb"), ("c", "2g.10gb"), ("d", "3g.20gb"))
    p = placed(place(snap(make_node("n")), pod, policy))
    layout = {(s.profile, s.start) for s in p.slices}
    # Only the 3g at slot 4 leaves slots 0-3 for the 2g and both 1g.
    assert ("3g.20gb", 4) in layout
    assert sorted(s.start for s in p.slices if s.profile != "3g.20gb") in ([0, 1, 2], [0, 2, 3])


def test_removal_order_islands_are_reported_as_fragmented() -> None:
    """dra-driver-nvidia-gpu#933: 1g GIs left at 0, 1 and 5 block every size-4 placement."""
    s = snap(
        make_node(
            "a", [make_gpu("A100-40GB", 0, [("1g.5gb", 0, 1), ("1g.5gb", 1, 1), ("1g.5gb", 5, 1)])]
        )
    )
    msg = pending(place(s, pod_request(("c", "3g.20gb"))), PendingReason.FRAGMENTED)
    assert msg.startswith(
        "3g.20gb needs 4 contiguous slots at start 0 or 4; "
        "free slots are fragmented: a gpu0 {2-4,6,7}"
    )


# --- Pending reasons ------------------------------------------------------------------------
def test_no_profile_names_the_catalog_models_that_have_it() -> None:
    msg = pending(
        place(snap(make_node("a")), pod_request(("c", "1g.18gb"))), PendingReason.NO_PROFILE
    )
    assert msg.startswith(
        "no GPU model in the cluster offers 1g.18gb (the catalog has it on H200-141GB"
    )


def test_no_profile_unknown_to_the_catalog() -> None:
    msg = pending(
        place(snap(make_node("a")), pod_request(("c", "5g.99gb"))), PendingReason.NO_PROFILE
    )
    assert msg == "no GPU model in the cluster offers 5g.99gb (no catalog model has it)"


def test_no_profile_when_no_single_node_has_all_models() -> None:
    s = snap(make_node("a"), make_node("b", model="H200-141GB"))
    msg = pending(
        place(s, pod_request(("c", "1g.5gb"), ("d", "1g.18gb"))), PendingReason.NO_PROFILE
    )
    assert "no node has GPUs offering all of 1g.18gb and 1g.5gb" in msg


def test_full() -> None:
    full = [make_gpu("H100-80GB", i, [("7g.80gb", 0, 8)]) for i in range(2)]
    msg = pending(
        place(snap(make_node("a", full)), pod_request(("c", "3g.40gb"))), PendingReason.FULL
    )
    assert msg.startswith("all 2 H100-80GB GPUs that offer 3g.40gb are full")


def test_full_counts_gpus_across_models_and_mentions_unavailable_ones() -> None:
    gpus = [
        make_gpu("A100-80GB", 0, [("7g.80gb", 0, 8)]),
        make_gpu("H100-80GB", 1, [("7g.80gb", 0, 8)]),
        make_gpu("H100-80GB", 2, healthy=False),
    ]
    msg = pending(
        place(snap(make_node("a", gpus)), pod_request(("c", "3g.40gb"))), PendingReason.FULL
    )
    assert msg.startswith("all 2 GPUs (1 A100-80GB, 1 H100-80GB) that offer 3g.40gb are full")
    assert msg.endswith("; besides, 1 GPU unhealthy")


def test_full_when_the_pod_needs_more_gpus_than_a_node_has() -> None:
    msg = pending(
        place(snap(make_node("a", model="H100-80GB", count=2)), pod_request(("c", "7g.80gb", 3))),
        PendingReason.FULL,
    )
    assert msg.startswith("no node has room for 3x 7g.80gb")
    assert "needs 24" in msg


def test_fragmented_lists_free_slots_per_gpu_largest_first_and_truncates() -> None:
    gpus = [make_gpu("A100-40GB", i, [("1g.5gb", 0, 1), ("1g.5gb", 4, 1)]) for i in range(3)]
    nodes = [make_node(f"n{k}", gpus) for k in range(2)]
    msg = pending(place(snap(*nodes), pod_request(("c", "3g.20gb"))), PendingReason.FRAGMENTED)
    assert msg == (
        "3g.20gb needs 4 contiguous slots at start 0 or 4; free slots are fragmented: "
        "n0 gpu0 {1-3,5-7}, n0 gpu1 {1-3,5-7}, n0 gpu2 {1-3,5-7}, n1 gpu0 {1-3,5-7}, "
        "… (+2 more GPUs)"
    )


def test_node_resources_says_which_resource_and_the_most_free() -> None:
    nodes = [make_node(f"n{i}", cpu=2000) for i in range(3)]
    msg = pending(
        place(snap(*nodes), pod_request(("c", "1g.5gb"), cpu=4000)), PendingReason.NODE_RESOURCES
    )
    assert msg == "node cpu short on all 3 candidate nodes (need 4 cpu, most free 2)"


def test_node_resources_memory_and_pods() -> None:
    s = snap(make_node("a", memory=GI, pods=0))
    msg = pending(
        place(s, pod_request(("c", "1g.5gb"), memory=8 * GI)), PendingReason.NODE_RESOURCES
    )
    assert msg == (
        "node memory and pods short on the only candidate node "
        "(need 8Gi memory, most free 1Gi; need 1 pod slot, most free 0)"
    )


def test_node_resources_wins_over_fragmented_and_full_elsewhere() -> None:
    fragmented = make_node("frag", [make_gpu("A100-40GB", 0, [("1g.5gb", 0, 1), ("1g.5gb", 4, 1)])])
    full = make_node("full", [make_gpu("A100-40GB", 0, [("7g.40gb", 0, 8)])])
    short = make_node("short", cpu=500)
    r = place(snap(fragmented, full, short), pod_request(("c", "3g.20gb")))
    assert "the only candidate node" in pending(r, PendingReason.NODE_RESOURCES)


def test_fragmented_wins_over_full() -> None:
    fragmented = make_node("frag", [make_gpu("A100-40GB", 0, [("1g.5gb", 0, 1), ("1g.5gb", 4, 1)])])
    full = make_node("full", [make_gpu("A100-40GB", 0, [("7g.40gb", 0, 8)])])
    pending(place(snap(full, fragmented), pod_request(("c", "3g.20gb"))), PendingReason.FRAGMENTED)


def test_gpu_unavailable_counts_unhealthy_and_mig_disabled() -> None:
    gpus = [make_gpu("H100-80GB", 0, healthy=False), make_gpu("H100-80GB", 1, healthy=False)]
    gpus += [make_gpu("H100-80GB", i, mig=False) for i in range(2, 8)]
    msg = pending(
        place(snap(make_node("a", gpus)), pod_request(("c", "1g.10gb"))),
        PendingReason.GPU_UNAVAILABLE,
    )
    assert msg.startswith("2 GPUs unhealthy, 6 in MIG-disabled mode: no usable GPU offers 1g.10gb")


def test_full_wins_over_unavailable() -> None:
    sick = make_node("sick", [make_gpu("A100-40GB", 0, healthy=False)])
    full = make_node("full", [make_gpu("A100-40GB", 0, [("7g.40gb", 0, 8)])])
    pending(place(snap(sick, full), pod_request(("c", "1g.5gb"))), PendingReason.FULL)


def test_no_matching_node_breaks_the_exclusions_down() -> None:
    nodes = [
        make_node("a", labels={"zone": "x"}),
        make_node("b", taints=(Taint("gpu", "yes", "NoSchedule"),), labels={"zone": "y"}),
        make_node("c", unschedulable=True, labels={"zone": "y"}),
    ]
    msg = pending(
        place(snap(*nodes), pod_request(("c", "1g.5gb"), selector={"zone": "y"})),
        PendingReason.NO_MATCHING_NODE,
    )
    assert msg.startswith(
        "no node matches the pod's nodeSelector/affinity/tolerations (of 3 nodes: "
    )
    for part in (
        "1 fail the nodeSelector",
        "1 have taints the pod does not tolerate",
        "1 are cordoned",
    ):
        assert part in msg


def test_no_matching_node_when_the_offering_nodes_are_excluded() -> None:
    nodes = [make_node("a", model="H200-141GB"), make_node("b", labels={"team": "x"})]
    msg = pending(
        place(snap(*nodes), pod_request(("c", "1g.5gb"), selector={"team": "y"})),
        PendingReason.NO_MATCHING_NODE,
    )
    assert msg.startswith("no node matches")
    nodes = [make_node("a", model="H200-141GB", labels={"team": "y"}), make_node("b")]
    msg = pending(
        place(snap(*nodes), pod_request(("c", "1g.5gb"), selector={"team": "y"})),
        PendingReason.NO_MATCHING_NODE,
    )
    assert msg == (
        "no node that matches the pod's nodeSelector/affinity/tolerations has GPUs offering "
        "1g.5gb; the 1 node that do is excluded (1 fail the nodeSelector)"
    )


def test_empty_cluster() -> None:
    pending(place(snap(), pod_request(("c", "1g.5gb"))), PendingReason.NO_PROFILE)


# --- selectors, affinity, taints ------------------------------------------------------------
def _req(key: str, op: str, *values: str) -> NodeSelectorRequirement:
    return NodeSelectorRequirement(key, op, tuple(values))


@pytest.mark.parametrize(
    ("terms", "expected"),
    [
        (((_req("zone", "In", "y", "z"),),), "b"),
        (((_req("zone", "NotIn", "x"),),), "b"),
        (((_req("ssd", "Exists"),),), "a"),
        (((_req("ssd", "DoesNotExist"),),), "b"),
        (((_req("gen", "Gt", "3"),),), "b"),
        (((_req("gen", "Lt", "3"),),), "a"),
        (((_req("gen", "Gt", "x"),),), None),  # not an integer: matches nothing
        (((_req("zone", "In", "x"), _req("ssd", "DoesNotExist")),), None),  # AND
        (((_req("zone", "In", "q"),), (_req("gen", "Gt", "4"),)), "b"),  # OR of terms
        (((),), None),  # an empty term matches nothing
    ],
)
def test_required_affinity(
    terms: tuple[tuple[NodeSelectorRequirement, ...], ...], expected: str | None
) -> None:
    a = make_node("a", labels={"zone": "x", "ssd": "1", "gen": "2"})
    b = make_node("b", labels={"zone": "y", "gen": "5"})
    r = place(snap(a, b), pod_request(("c", "1g.5gb"), affinity=terms))
    if expected is None:
        pending(r, PendingReason.NO_MATCHING_NODE)
    else:
        assert placed(r).node == expected


@pytest.mark.parametrize(
    ("toleration", "ok"),
    [
        (Toleration("gpu", "Equal", "yes", "NoSchedule"), True),
        (Toleration("gpu", "Equal", "no", "NoSchedule"), False),
        (Toleration("gpu", "Exists", "", ""), True),
        (Toleration("", "Exists", "", ""), True),
        (Toleration("gpu", "Exists", "", "NoExecute"), False),
        (Toleration("other", "Exists", "", ""), False),
    ],
)
def test_tolerations(toleration: Toleration, ok: bool) -> None:
    s = snap(make_node("a", taints=(Taint("gpu", "yes", "NoSchedule"),)))
    r = place(s, pod_request(("c", "1g.5gb"), tolerations=(toleration,)))
    assert isinstance(r, Placement) is ok


def test_prefer_no_schedule_taint_does_not_filter() -> None:
    s = snap(make_node("a", taints=(Taint("gpu", "yes", "PreferNoSchedule"),)))
    placed(place(s, pod_request(("c", "1g.5gb"))))


def test_cordoned_node_needs_the_unschedulable_toleration() -> None:
    s = snap(make_node("a", unschedulable=True))
    pending(place(s, pod_request(("c", "1g.5gb"))), PendingReason.NO_MATCHING_NODE)
    t = Toleration("node.kubernetes.io/unschedulable", "Exists", "", "NoSchedule")
    placed(place(s, pod_request(("c", "1g.5gb"), tolerations=(t,))))


def test_node_selector() -> None:
    s = snap(make_node("a", labels={"x": "1"}), make_node("b", labels={"x": "2"}))
    assert placed(place(s, pod_request(("c", "1g.5gb"), selector={"x": "2"}))).node == "b"


# --- several slices ---------------------------------------------------------------------------
def test_slices_come_back_in_request_order() -> None:
    pod = pod_request(("small", "1g.10gb"), ("big", "4g.40gb"), ("mid", "2g.20gb", 2))
    p = placed(place(snap(make_node("a", model="H100-80GB", count=2)), pod))
    assert [(s.container, s.profile) for s in p.slices] == [
        ("small", "1g.10gb"),
        ("big", "4g.40gb"),
        ("mid", "2g.20gb"),
        ("mid", "2g.20gb"),
    ]
    assert [s.size for s in p.slices] == [1, 4, 2, 2]


def test_a_pod_spreads_over_the_gpus_of_one_node() -> None:
    s = snap(make_node("a", model="H100-80GB", count=1), make_node("b", model="H100-80GB", count=2))
    p = placed(place(s, pod_request(("c", "7g.80gb", 2))))
    assert p.node == "b"
    assert sorted(x.gpu_index for x in p.slices) == [0, 1]


def test_init_containers_get_their_own_slices() -> None:
    """Init containers' slices are requested like any other container's; they never share
    a slice with an app container (docs/placement.md)."""
    pod = pod_request(("init", "3g.20gb"), ("app", "3g.20gb"), ("app", "1g.5gb"))
    p = placed(place(snap(make_node("a", count=2)), pod))
    used = [(x.gpu_index, x.start) for x in p.slices]
    assert len(set(used)) == 3
    assert [x.container for x in p.slices] == ["init", "app", "app"]


def test_heterogeneous_models_on_one_node() -> None:
    node = make_node("a", [make_gpu("A100-40GB", 0), make_gpu("H200-141GB", 1)])
    p = placed(place(snap(node), pod_request(("c", "1g.5gb"), ("d", "1g.18gb"))))
    assert {(x.profile, x.gpu_index) for x in p.slices} == {("1g.5gb", 0), ("1g.18gb", 1)}


def test_same_profile_name_on_two_models_uses_each_models_size() -> None:
    """1g.10gb is one slot on an A100-80GB but two (the 2x-memory 1g) on an A100-40GB."""
    node = make_node("a", [make_gpu("A100-40GB", 0, [("7g.40gb", 0, 8)]), make_gpu("A100-80GB", 1)])
    p = placed(place(snap(node), pod_request(("c", "1g.10gb"))))
    assert (p.slices[0].gpu_index, p.slices[0].size) == (1, 1)
    node = make_node("a", [make_gpu("A100-40GB", 0), make_gpu("A100-80GB", 1, [("7g.80gb", 0, 8)])])
    p = placed(place(snap(node), pod_request(("c", "1g.10gb"))))
    assert (p.slices[0].gpu_index, p.slices[0].size) == (0, 2)


def test_only_one_plus_me_instance_per_gpu() -> None:
    s = snap(make_node("a", model="H100-80GB", count=2))
    p = placed(place(s, pod_request(("c", "1g.10gb+me", 2))))
    assert sorted(x.gpu_index for x in p.slices) == [0, 1]
    pending(
        place(snap(make_node("a", model="H100-80GB")), pod_request(("c", "1g.10gb+me", 2))),
        PendingReason.FULL,
    )


def test_unknown_model_and_unusable_gpus_are_skipped() -> None:
    node = make_node(
        "a", [make_gpu("Z9000"), make_gpu("A100-40GB", mig=False), make_gpu("A100-40GB")]
    )
    assert placed(place(snap(node), pod_request(("c", "1g.5gb")))).slices[0].gpu_index == 2


def test_pod_without_slices_goes_to_a_node_with_room() -> None:
    s = snap(make_node("a", cpu=0), make_node("b"))
    assert place(s, pod_request()) == Placement("b", ())


# --- the policies' preferences ----------------------------------------------------------------
def test_instaslice_puts_a_lone_1g_where_it_keeps_the_4g() -> None:
    p = placed(place(snap(make_node("a")), pod_request(("c", "1g.5gb"))))
    assert p.slices[0].start >= 4


def test_instaslice_packs_into_a_broken_gpu_and_a_busy_node() -> None:
    busy = make_node(
        "busy", [make_gpu("A100-40GB", 0, [("1g.5gb", 6, 1)]), make_gpu("A100-40GB", 1)]
    )
    idle = make_node("idle", count=2)
    p = placed(place(snap(idle, busy), pod_request(("c", "1g.5gb"))))
    assert (p.node, p.slices[0].gpu_index) == ("busy", 0)
    assert p.slices[0].start in (4, 5)


def test_instaslice_keeps_whole_gpus_for_7g() -> None:
    s = snap(make_node("a", model="H100-80GB", count=2))
    s, results = run_sequence(s, ["1g.10gb", "1g.10gb", "2g.20gb", "1g.20gb", "1g.10gb"])
    assert {placed(r).slices[0].gpu_index for r in results} == {0}
    placed(place(s, pod_request(("c", "7g.80gb"))))


def test_first_fit_takes_the_lowest_start_first_gpu_first_node() -> None:
    s = snap(make_node("a", count=2), make_node("b", count=2))
    p = placed(place(s, pod_request(("c", "1g.5gb")), Policy.FIRST_FIT))
    assert (p.node, p.slices[0].gpu_index, p.slices[0].start) == ("a", 0, 0)


def test_spread_takes_the_emptiest_node_and_gpu() -> None:
    busy = make_node("busy", count=2)
    idle = make_node(
        "idle", [make_gpu("A100-40GB", 0, [("1g.5gb", 0, 1)]), make_gpu("A100-40GB", 1)]
    )
    p = placed(place(snap(idle, busy), pod_request(("c", "1g.5gb")), Policy.SPREAD))
    assert (p.node, p.slices[0].gpu_index, p.slices[0].start) == ("busy", 0, 0)
    p = placed(place(snap(idle), pod_request(("c", "1g.5gb")), Policy.SPREAD))
    assert (p.slices[0].gpu_index, p.slices[0].start) == (1, 0)


def test_static_balanced_only_hands_out_layout_slices() -> None:
    s = snap(make_node("a"))
    p = placed(place(s, pod_request(("c", "3g.20gb")), Policy.STATIC_BALANCED))
    assert p.slices[0].start == 4
    p = placed(place(s, pod_request(("c", "1g.5gb")), Policy.STATIC_BALANCED))
    assert p.slices[0].start == 2
    msg = pending(
        place(s, pod_request(("c", "4g.20gb")), Policy.STATIC_BALANCED), PendingReason.NO_PROFILE
    )
    assert msg == "the static all-balanced layout has no 4g.20gb slice"
    taken = snap(make_node("a", [make_gpu("A100-40GB", 0, [("3g.20gb", 4, 4)])]))
    pending(place(taken, pod_request(("c", "3g.20gb")), Policy.STATIC_BALANCED), PendingReason.FULL)


def test_policy_values_are_the_cli_spellings() -> None:
    assert [p.value for p in Policy] == ["instaslice", "first-fit", "spread", "static-balanced"]


def test_custom_catalog_is_honoured() -> None:
    from common.catalog import Catalog, load_catalog

    only_a30 = Catalog(tuple(m for m in load_catalog().models if m.name == "A30-24GB"))
    s = snap(make_node("a", model="A30-24GB"), make_node("b"))
    assert placed(place(s, pod_request(("c", "2g.12gb")), catalog=only_a30)).node == "a"
    pending(place(s, pod_request(("c", "1g.5gb")), catalog=only_a30), PendingReason.NO_PROFILE)
