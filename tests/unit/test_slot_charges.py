"""Memory-slot charges of whole GPUs and size asks (common/quota.py), as admission writes them
with `--slot-accounting` (webhook/admission.py), and the node bound that keeps such pods
schedulable (nodeagent/report.py) — docs/security.md, finding 8.

A charge must never be below the slots the pod can hold on any GPU model its nodeSelector and
required node affinity admit (the property below checks it against the placement engine's own
selector filter, common/placement/selectors.py). Profile asks keep their documented lower bound
(common/quota.py, tests/unit/test_sizing_quota.py). Pure: catalog data in, numbers out.
"""

from __future__ import annotations

from typing import Any

import jsonpatch
import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.catalog import load_catalog
from common.constants import GPU_MODEL_LABEL, MEMORY_SLOTS_RESOURCE
from common.placement.model import NodeSelectorRequirement, NodeState, PodRequest
from common.placement.selectors import mismatch
from common.quota import admitted_models, slot_bound
from common.sizing import resolve, size_asks
from nodeagent.model import Health, NodeInventory
from nodeagent.report import slot_capacity
from testkit.builders import G0, G1, container, gpu
from tests.unit.test_admission import claims, make_request, team_pod
from webhook.admission import review
from webhook.reviews import Patched
from webhook.settings import AdmissionSettings

CAT = load_catalog()
SLOTS = AdmissionSettings.from_catalog(slot_accounting=True)
LARGEST = max(m.memory_slots for m in CAT.models)  # RTX-PRO-6000: 12
MODELS = [m.name for m in CAT.models]
SIZE = "instaslice.io/mig-size.main"


def _expr(key: str, op: str, values: list[str]) -> dict[str, Any]:
    return {"key": key, "operator": op, "values": values}


def _affinity(*terms: list[tuple[str, list[str]]], key: str = GPU_MODEL_LABEL) -> dict[str, Any]:
    """Required node affinity: OR of `terms`, each an AND of (operator, values) on `key`."""
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [_expr(key, op, vs) for op, vs in t]} for t in terms
                ]
            }
        }
    }


def charged(
    *,
    gpus: int = 0,
    size: str | None = None,
    selector: dict[str, str] | None = None,
    affinity: dict[str, Any] | None = None,
) -> int:
    """The memory slots admission (with --slot-accounting) writes into container "main"."""
    limits = {"nvidia.com/gpu": str(gpus)} if gpus else None
    pod = team_pod(container("main", limits=limits),
                   annotations={SIZE: size} if size else None)  # fmt: skip
    if selector is not None:
        pod["spec"]["nodeSelector"] = selector
    if affinity is not None:
        pod["spec"]["affinity"] = affinity
    d = review(make_request(pod), SLOTS, new_claim=claims(), whole_gpu=bool(gpus))
    assert isinstance(d, Patched), d
    out = jsonpatch.apply_patch(pod, d.patch)
    return int(out["spec"]["containers"][0]["resources"]["limits"][MEMORY_SLOTS_RESOURCE])


H100 = {GPU_MODEL_LABEL: "H100-80GB"}


@pytest.mark.parametrize(
    ("kw", "slots"),
    [
        # a whole GPU: its model's slots; the largest catalog model's while it is open
        ({"gpus": 1}, LARGEST),
        ({"gpus": 2}, 2 * LARGEST),
        ({"gpus": 1, "selector": H100}, 8),
        ({"gpus": 2, "selector": {GPU_MODEL_LABEL: "A30-24GB"}}, 8),  # 2 x 4
        ({"gpus": 1, "affinity": _affinity([("In", ["A30-24GB", "H100-80GB"])])}, 8),
        ({"gpus": 1, "affinity": _affinity([("In", ["A30-24GB"])], [("In", ["H200-141GB"])])}, 8),
        # NotIn also admits a node without the label (a node of mixed models): any model
        ({"gpus": 1, "affinity": _affinity([("NotIn", ["RTX-PRO-6000"])])}, LARGEST),
        ({"gpus": 1, "affinity": _affinity([("Exists", []), ("NotIn", ["RTX-PRO-6000"])])}, 8),
        # a requirement on another label may hold anywhere
        ({"gpus": 1, "affinity": _affinity([("In", ["x"])], key="zone")}, LARGEST),
        # a model in no catalog, or nothing admitted: as if every model were
        ({"gpus": 1, "selector": {GPU_MODEL_LABEL: "NVIDIA-X10"}}, LARGEST),
        # a size: the most slots its fitting profile takes on an admitted model
        ({"size": "memory>=20Gi"}, 8),  # A100-40GB 7g.40gb (3g.20gb is 19968 MiB)
        ({"size": "memory>=20Gi", "selector": H100}, 4),  # 3g.40gb
        ({"size": "memory>=20Gi,count=2", "selector": H100}, 8),
        ({"size": "memory>=20Gi", "selector": {GPU_MODEL_LABEL: "H200-141GB"}}, 2),  # 1g.35gb
        ({"size": "memory>=20Gi", "affinity": _affinity([("In", ["H200-141GB", "B200-180GB"])])},
         2),  # B200 1g.23gb is 1
        ({"size": "memory>=20Gi", "affinity": _affinity([("In", ["A30-24GB"])],
                                                       [("In", ["B200-180GB"])])}, 4),
        ({"size": "memory>=20Gi", "selector": {GPU_MODEL_LABEL: "A30-24GB"},
          "affinity": _affinity([("In", ["B200-180GB"])])}, 8),  # contradictory: all models
        # no admitted model fits the size: the catalog's models that do
        ({"size": "memory>=30Gi", "selector": {GPU_MODEL_LABEL: "A30-24GB"}}, 8),
    ],
)  # fmt: skip
def test_whole_gpus_and_sizes_are_charged_the_most_an_admitted_model_takes(
    kw: dict[str, Any], slots: int
) -> None:
    assert charged(**kw) == slots


def test_admitted_models_read_only_the_gpu_model_label() -> None:
    def names(spec: dict[str, Any]) -> list[str]:
        return [m.name for m in admitted_models(CAT, spec)]

    assert names({}) == MODELS
    assert names({"nodeSelector": {**H100, "zone": "a"}}) == ["H100-80GB"]
    assert names({"affinity": _affinity([("DoesNotExist", [])])}) == MODELS  # a mixed node
    assert names({"affinity": _affinity([("In", ["H100-80GB"])], [])}) == ["H100-80GB"]
    assert names({"affinity": "junk", "nodeSelector": None}) == MODELS


# --- the property: never below what the pod can hold where its selectors admit it -------------

_OPS = st.sampled_from(["In", "NotIn", "Exists", "DoesNotExist"])
_TERM = st.lists(st.tuples(_OPS, st.lists(st.sampled_from(MODELS), max_size=3)), max_size=3)


def _node(model: str | None) -> NodeState:
    return NodeState("n", labels={} if model is None else {GPU_MODEL_LABEL: model})


@given(
    whole=st.booleans(),
    count=st.integers(1, 4),
    gib=st.integers(1, 150),
    sm=st.sampled_from([0, 0, 30, 60]),
    selected=st.none() | st.sampled_from(MODELS),
    terms=st.none() | st.lists(_TERM, min_size=1, max_size=3),
)
def test_the_charge_covers_the_slots_held_on_every_admitted_model(
    whole: bool,
    count: int,
    gib: int,
    sm: int,
    selected: str | None,
    terms: list[list[tuple[str, list[str]]]] | None,
) -> None:
    """Oracle: the placement engine's selector filter on a node of each model (and on a node
    without the label, which may hold any model); the slots held there are the whole GPUs'
    or the size's profile on that model, as the allocator resolves it."""
    size = f"memory>={gib}Gi" + (f",multiprocessors>={sm}" if sm else "") + f",count={count}"
    (ask,) = size_asks({"metadata": {"annotations": {SIZE: size}}})
    if not whole and all(resolve(m, ask.size) is None for m in CAT.models):
        return  # refused at admission
    selector = None if selected is None else {GPU_MODEL_LABEL: selected}
    request = PodRequest(
        "ns/p",
        node_selector=selector or {},
        required_affinity=tuple(
            tuple(NodeSelectorRequirement(GPU_MODEL_LABEL, op, tuple(vs)) for op, vs in t)
            for t in terms or ()
        ),
    )
    affinity = None if terms is None else _affinity(*terms)
    got = (
        charged(gpus=count, selector=selector, affinity=affinity)
        if whole
        else charged(size=size, selector=selector, affinity=affinity)
    )
    reachable = MODELS if mismatch(_node(None), request) is None else [
        m for m in MODELS if mismatch(_node(m), request) is None
    ]  # fmt: skip
    for name in reachable:
        m = CAT.model(name)
        assert m is not None
        if whole:
            assert got >= m.memory_slots * count, (name, got)
        elif (p := resolve(m, ask.size)) is not None:
            assert got >= p.memory_slots * count, (name, p.name, got)


# --- the node side: such pods stay schedulable ----------------------------------------------------


def test_nodes_advertise_the_most_their_gpus_pods_can_be_charged() -> None:
    two = NodeInventory(gpus=(gpu(0, G0), gpu(1, G1)))  # two H200s: 8 slots each
    per_gpu = 8 * LARGEST  # each slice takes a slot and is charged at most a whole GPU
    assert slot_bound(CAT, 8) == per_gpu
    assert slot_capacity(two, {}, CAT) == {MEMORY_SLOTS_RESOURCE: str(2 * per_gpu)}
    sick = {1: Health(False, "XID 48")}
    assert slot_capacity(two, sick, CAT) == {MEMORY_SLOTS_RESOURCE: str(per_gpu)}
    # a GPU with MIG off counts once it may serve slices or a whole GPU
    off = NodeInventory(gpus=(gpu(0, G0, mig="disabled"),))
    assert slot_capacity(off, {}, CAT) == {MEMORY_SLOTS_RESOURCE: "0"}
    whole = slot_capacity(off, {}, CAT, can_be_whole=lambda g: True)
    assert whole == {MEMORY_SLOTS_RESOURCE: str(per_gpu)}
    # the most pods one H200 holds, each charged as much as admission can charge it
    assert 7 * charged(size="memory>=1Mi") <= per_gpu and charged(gpus=1) <= per_gpu
    assert slot_bound(CAT, 0) == LARGEST  # a GPU reporting no placements: one whole GPU
