"""Size-based asks (common/sizing.py), memory-slot charges and Kueue's generated
configuration (common/quota.py), and what admission does with both (webhook/admission.py).

Pure: catalog data in, decisions out. The same features on the real control plane with Kueue:
tests/e2e/test_kueue.py."""

from __future__ import annotations

from typing import Any

import jsonpatch
import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.catalog import load_catalog
from common.constants import MEMORY_SLOTS_RESOURCE
from common.placement import Pending, Placement, Policy
from common.placement.model import (
    Gpu,
    NodeState,
    Occupied,
    PendingReason,
    PodRequest,
    SliceRequest,
    Snapshot,
)
from common.placement.modes import ModeView
from common.quota import flavor_name, kueue_resources, min_slots, profile_slots, resource_flavors
from common.sizing import Size, SizeAsk, SizeError, parse_size, place_sized, resolve, size_asks
from testkit.builders import container
from tests.unit.test_admission import NS, claims, make_request, team_pod
from webhook.admission import review
from webhook.reviews import Denied, Patched
from webhook.settings import AdmissionSettings

CAT = load_catalog()
GIB = 1024


def model(name: str) -> Any:
    m = CAT.model(name)
    assert m is not None
    return m


# --- the grammar ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("memory>=20Gi", Size(20 * GIB)),
        ("memory>=20Gi,multiprocessors>=26", Size(20 * GIB, 26)),
        (" memory >= 16Gi , count=2 ", Size(16 * GIB, 0, 2)),
        ("memory>=1.5Mi", Size(2)),  # a ceiling in MiB
        ("memory>=20G", Size(19074)),  # 20e9 bytes = 19073.49 MiB, rounded up
    ],
)
def test_size_grammar(text: str, want: Size) -> None:
    assert parse_size(text) == want


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("", "empty"),
        ("multiprocessors>=2", "memory>=<quantity> is required"),
        ("memory=20Gi", "memory takes '>='"),
        ("memory>=twenty", "not a quantity"),
        ("memory>=0", "must be positive"),
        ("memory>=-1Gi", "not a quantity"),
        ("memory>=20Gi,colour>=2", "unknown term 'colour'"),
        ("memory>=20Gi,count=0", "count '0' is not a positive integer"),
        ("memory>=20Gi,count>=2", "count takes '='"),
        ("memory>=20Gi,memory>=30Gi", "memory is given twice"),
        ("memory>=20Gi,count=2000", "exceeds the limit"),
        ("memory 20Gi", "is not key>=value"),
    ],
)
def test_bad_sizes_say_what_is_wrong(text: str, words: str) -> None:
    with pytest.raises(SizeError, match=words):
        parse_size(text)


# --- resolution: NVML MiB, never the rounded names -----------------------------------------------


@pytest.mark.parametrize(
    ("model_name", "size", "profile"),
    [
        ("H100-80GB", Size(20 * GIB), "3g.40gb"),  # 1g.20gb / 2g.20gb are 20096 MiB < 20 GiB
        ("H100-80GB", Size(19 * GIB), "1g.20gb"),  # ties on memory: fewer slots, then compute
        ("H100-80GB", Size(19 * GIB, 30), "2g.20gb"),  # 1g.20gb has 26 SMs
        ("H200-141GB", Size(20 * GIB), "1g.35gb"),
        ("H200-141GB", Size(18 * GIB), "1g.35gb"),  # "1g.18gb" is 16384 MiB
        ("H200-141GB", Size(16 * GIB), "1g.18gb"),
        ("A100-40GB", Size(20 * GIB), "7g.40gb"),  # 3g.20gb / 4g.20gb are 19968 MiB
        ("A30-24GB", Size(24 * GIB), None),  # 4g.24gb is 24000 MiB < 24576
    ],
)
def test_smallest_fitting_profile_per_model(
    model_name: str, size: Size, profile: str | None
) -> None:
    got = resolve(model(model_name), size)
    assert (got.name if got else None) == profile


@given(mib=st.integers(1, 200 * GIB), sm=st.integers(0, 150))
def test_resolution_is_the_minimum_over_every_fitting_plain_profile(mib: int, sm: int) -> None:
    size = Size(mib, sm)
    for m in CAT.models:
        got = resolve(m, size)
        fits = [
            p for p in m.profiles
            if "+" not in p.name and "-me" not in p.name
            and p.memory_mib >= mib and p.multiprocessors >= sm
        ]  # fmt: skip
        if not fits:
            assert got is None
            continue
        assert got is not None and got in fits
        assert all(got.memory_mib <= p.memory_mib for p in fits)


# --- placement across models --------------------------------------------------------------------


def node(
    name: str, model_name: str, gpus: int = 1, occupied: tuple[Occupied, ...] = ()
) -> NodeState:
    return NodeState(
        name, labels={"instaslice.io/gpu-model": model_name}, cpu_millis_free=64000,
        memory_bytes_free=1 << 40, pods_free=110,
        gpus=tuple(Gpu(i, model_name, occupied=occupied) for i in range(gpus)),
    )  # fmt: skip


ASK20 = [SizeAsk("main", Size(20 * GIB))]
NO_MODES = ModeView()  # every GPU as the snapshot shows it (no MIG mode change)


def test_the_model_wasting_least_memory_wins_and_its_smallest_profile_is_used() -> None:
    snap = Snapshot(
        (node("a100-0", "A100-40GB"), node("h100-0", "H100-80GB"), node("h200-0", "H200-141GB"))
    )
    got = place_sized(snap, PodRequest("ns/p"), ASK20, Policy.INSTASLICE, CAT, NO_MODES).result
    assert isinstance(got, Placement)
    assert (got.node, [s.profile for s in got.slices]) == ("h200-0", ["1g.35gb"])


def test_a_selector_for_one_model_gets_that_models_smallest_fit() -> None:
    snap = Snapshot((node("h100-0", "H100-80GB"), node("h200-0", "H200-141GB")))
    req = PodRequest("ns/p", node_selector={"instaslice.io/gpu-model": "H100-80GB"})
    got = place_sized(snap, req, ASK20, Policy.INSTASLICE, CAT, NO_MODES).result
    assert isinstance(got, Placement)
    assert (got.node, got.slices[0].profile, got.slices[0].size) == ("h100-0", "3g.40gb", 4)


def test_a_full_model_falls_back_to_the_next_one() -> None:
    full = (Occupied(0, 8, "7g.141gb"),)
    snap = Snapshot((node("h100-0", "H100-80GB"), node("h200-0", "H200-141GB", occupied=full)))
    got = place_sized(snap, PodRequest("ns/p"), ASK20, Policy.INSTASLICE, CAT, NO_MODES).result
    assert isinstance(got, Placement) and got.slices[0].profile == "3g.40gb"


def test_no_model_large_enough_is_named_with_the_largest_slice() -> None:
    snap = Snapshot((node("a30-0", "A30-24GB"),))
    ask = [SizeAsk("main", Size(24 * GIB))]
    got = place_sized(snap, PodRequest("ns/p"), ask, Policy.INSTASLICE, CAT, NO_MODES).result
    assert isinstance(got, Pending) and got.reason is PendingReason.NO_PROFILE
    assert "A30-24GB 4g.24gb = 24000 MiB" in got.message and "'main'" in got.message


def test_size_asks_read_from_annotations_name_the_bad_one() -> None:
    pod = {"metadata": {"annotations": {"instaslice.io/mig-size.main": "memory>=20Gi,count=2"}}}
    assert size_asks(pod) == [SizeAsk("main", Size(20 * GIB, 0, 2))]
    with pytest.raises(SizeError, match=r"annotations\[instaslice.io/mig-size.x\]"):
        size_asks({"metadata": {"annotations": {"instaslice.io/mig-size.x": "memory"}}})


# --- memory slots and Kueue's configuration ------------------------------------------------------


def test_slot_charges_are_the_smallest_over_models() -> None:
    assert min_slots(CAT, "1g.10gb") == 1  # 1 on A100-80GB / H100-80GB, 2 on A100-40GB
    assert min_slots(CAT, "3g.71gb") == 4
    assert min_slots(CAT, "7g.80gb") == 8
    assert min_slots(CAT, "9g.1gb") is None
    slots = profile_slots(CAT)
    assert slots["1g.18gb+me"] == 1 and all(v >= 1 for v in slots.values())


@pytest.mark.parametrize("accounting", [False, True])
def test_kueue_transformations_cover_every_profile_in_both_spellings(accounting: bool) -> None:
    by_input = {
        t["input"]: t for t in kueue_resources(CAT, slot_accounting=accounting)["transformations"]
    }
    for name, slots in profile_slots(CAT).items():
        spelled = name.replace("+", ".")
        rewritten = by_input[f"instaslice.io/mig-{spelled}"]
        # a rewritten pod: its slots (with accounting) come from the webhook, never from here
        assert rewritten["strategy"] == "Replace"
        assert rewritten["outputs"] == {f"nvidia.com/mig-{spelled}": "1"}
        job = by_input.get(f"nvidia.com/mig-{spelled}")
        if accounting:  # a Job's template is charged its slots too
            assert job is not None
            assert (job["strategy"], job["outputs"]) == (
                "Retain", {MEMORY_SLOTS_RESOURCE: str(slots)}
            )  # fmt: skip
        else:
            assert job is None
    assert len(by_input) == (2 if accounting else 1) * len(profile_slots(CAT))


def test_without_slot_accounting_kueue_sees_only_nvidias_names() -> None:
    """Issue 36: a ClusterQueue covering `nvidia.com/mig-<profile>` (and cpu, memory) must
    cover every resource a workload asks; Kueue refuses one asking anything else."""
    config = kueue_resources(CAT, slot_accounting=False)
    outputs = {r for t in config["transformations"] for r in t["outputs"]}
    assert outputs and all(r.startswith("nvidia.com/mig-") for r in outputs)


def test_one_flavor_per_model_selects_its_nodes() -> None:
    (f,) = resource_flavors(["H100-80GB"])
    assert f["metadata"]["name"] == flavor_name("H100-80GB") == "h100-80gb"
    assert f["spec"]["nodeLabels"] == {"instaslice.io/gpu-model": "H100-80GB"}


# --- admission ----------------------------------------------------------------------------------

SLOTS = AdmissionSettings.from_catalog(slot_accounting=True)
ENV = AdmissionSettings.from_catalog()


def admit(pod: dict[str, Any], s: AdmissionSettings) -> Any:
    return review(make_request(pod), s, new_claim=claims())


def test_slot_accounting_adds_memory_slots_to_each_asking_container() -> None:
    pod = team_pod(
        container("a", limits={"nvidia.com/mig-1g.10gb": "2", "nvidia.com/mig-3g.40gb": 1}),
        container("b"),
        container("c", requests={"cpu": "1"}),
        annotations={"instaslice.io/mig-size.c": "memory>=30Gi"},
    )
    d = admit(pod, SLOTS)
    assert isinstance(d, Patched), d
    out = jsonpatch.apply_patch(pod, d.patch)
    a, b, c = out["spec"]["containers"]
    assert a["resources"]["limits"][MEMORY_SLOTS_RESOURCE] == "6"  # 2x1 + 4
    assert "resources" not in b
    # >= 30 GiB: 2 slots on H200 (1g.35gb), ... but all 8 on A100-40GB (7g.40gb); no selector
    # keeps the pod off those (tests/unit/test_slot_charges.py)
    assert c["resources"]["limits"] == {MEMORY_SLOTS_RESOURCE: "8"}
    assert c["env"][0]["value"] == f"instaslice.io/mig={NS}_{d.claim}_c"
    plain = admit(pod, ENV)
    assert isinstance(plain, Patched)
    assert MEMORY_SLOTS_RESOURCE not in str(plain.patch)


@pytest.mark.parametrize(
    ("annotations", "words"),
    [
        ({"instaslice.io/mig-size.main": "memory>=20"}, None),  # 20 bytes: any slice fits
        (
            {"instaslice.io/mig-size.main": "memory=20Gi"},
            "annotations[instaslice.io/mig-size.main]",
        ),
        (
            {"instaslice.io/mig-size.ghost": "memory>=20Gi"},
            'no container or initContainer named "ghost"',
        ),
        (
            {"instaslice.io/mig-size.main": "memory>=500Gi"},
            "no GPU model in the catalog offers a slice with >= 500 GiB",
        ),
    ],
)
def test_size_annotations_are_validated_at_admission(
    annotations: dict[str, str], words: str | None
) -> None:
    d = admit(team_pod(container("main"), annotations=annotations), ENV)
    if words is None:
        assert isinstance(d, Patched)
    else:
        assert isinstance(d, Denied) and words in d.message, d


def test_size_requests_need_the_env_binding_mode() -> None:
    s = AdmissionSettings.from_catalog(ENV.binding_mode.__class__("device-plugin"))
    d = admit(
        team_pod(container("main"), annotations={"instaslice.io/mig-size.main": "memory>=1Gi"}), s
    )
    assert isinstance(d, Denied) and "env binding mode" in d.message


def test_the_dev_kueue_configuration_matches_the_dev_webhook() -> None:
    from pathlib import Path

    from hack.kueue import KueueSettings, kueue_config

    cfg = kueue_config(KueueSettings(), webhook_port=1, health_port=2, certs=Path("/c"))
    assert cfg["integrations"]["frameworks"] == ["batch/job", "pod"]
    assert cfg["webhook"] == {"port": 1, "host": "127.0.0.1", "certDir": "/c"}
    assert cfg["waitForPodsReady"]["timeout"] == "30s"
    # `kueue: true` alone: no slot accounting, so no memory slots a quota must cover
    assert cfg["resources"] == kueue_resources(CAT, slot_accounting=False)
    assert cfg["featureGates"] == {"VisibilityOnDemand": False}
    slots = KueueSettings(slot_accounting=True)
    cfg = kueue_config(slots, webhook_port=1, health_port=2, certs=Path("/c"))
    assert cfg["resources"] == kueue_resources(CAT, slot_accounting=True)


_MODELS = ["A100-40GB", "A100-80GB", "H100-80GB", "H200-141GB", "A30-24GB"]


@given(
    models=st.lists(st.sampled_from(_MODELS), min_size=1, max_size=3),
    full=st.lists(st.booleans(), min_size=3, max_size=3),
    gib=st.integers(1, 80),
)
def test_place_sized_takes_the_least_memory_any_model_can_place(
    models: list[str], full: list[bool], gib: int
) -> None:
    """Oracle: resolve on every node's model alone and place there with the engine; the
    answer is a placement of the smallest resolved memory among those that fit."""
    from common.placement import place

    nodes = tuple(
        node(f"n{i}", m, occupied=(Occupied(0, model(m).memory_slots, "x"),) if full[i] else ())
        for i, m in enumerate(models)
    )
    size = Size(gib * GIB)
    ask = [SizeAsk("main", size)]
    got = place_sized(Snapshot(nodes), PodRequest("ns/p"), ask, Policy.INSTASLICE, CAT, NO_MODES)
    feasible = []
    for n in nodes:
        p = resolve(model(n.gpus[0].model), size)
        if p is None:
            continue
        r = place(
            Snapshot((n,)),
            PodRequest("ns/p", slices=(SliceRequest("main", p.name),)),
            Policy.INSTASLICE,
            CAT,
        )
        if isinstance(r, Placement):
            feasible.append(p.memory_mib)
    if not feasible:
        assert isinstance(got.result, Pending)
        return
    assert isinstance(got.result, Placement)
    chosen_model = next(n.gpus[0].model for n in nodes if n.name == got.result.node)
    chosen = resolve(model(chosen_model), size)
    assert chosen is not None and got.result.slices[0].profile == chosen.name
    assert chosen.memory_mib == min(feasible)


@pytest.mark.parametrize("spec", [None, [], "x"])
def test_a_size_annotation_on_a_pod_without_a_spec_is_malformed_not_a_crash(spec: Any) -> None:
    pod: dict[str, Any] = {
        "metadata": {"annotations": {"instaslice.io/mig-size.main": "memory>=1Gi"}}
    }
    if spec is not None:
        pod["spec"] = spec
    d = admit(pod, ENV)
    assert isinstance(d, Denied) and d.code == 400 and "object.spec" in d.message
