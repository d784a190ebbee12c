"""Admission in DRA mode (docs/dra.md, docs/contract.md §8): the rewrite table.

Covers: a MIG ask, a whole-GPU ask, several asks in one container and in several containers
(sidecars too) are gated and claimed as in gate mode, but the extended resource is removed
(not renamed), the asks are kept in `instaslice.io/asks` (read back by `slice_requests`), the
pod names its ResourceClaim in `spec.resourceClaims` (the claim annotation's id) and each
asking container names exactly its own asks' requests; no NVIDIA_VISIBLE_DEVICES is set;
a user's own resourceClaims entries and claims are kept; an entry named like InstaSlice's and
size asks are refused; the autoscaler signal's placeholder asks what the pod asks.
Leaves out: the claim the allocator makes (test_draclaim.py) and gate
mode (test_admission.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jsonpatch
import pytest

from common.constants import ASKS_ANNOTATION, CLAIM_ANNOTATION, GATE_NAME, AllocationMode
from common.podspec import SliceAsk, slice_requests
from testkit.builders import container
from tests.unit.test_admission import ENV, claims, make_request, team_pod
from webhook.admission import review
from webhook.allocator.autoscale import placeholder_pod
from webhook.allocator.pods import pod_request
from webhook.reviews import Denied, Patched

DRA = dataclasses.replace(ENV, allocation_mode=AllocationMode.DRA)


def rewrite(pod: Any, whole: bool = False) -> tuple[Patched, Any]:
    d = review(make_request(pod), DRA, new_claim=claims(), whole_gpu=whole)
    assert isinstance(d, Patched), d
    return d, jsonpatch.apply_patch(pod, d.patch)


def _sidecar(name: str, limits: dict[str, str]) -> dict[str, Any]:
    return {**container(name, limits=limits), "restartPolicy": "Always"}


# (containers, initContainers, whole_gpu, the asks, each container's resources.claims requests)
CASES = [
    (
        [container(limits={"nvidia.com/mig-1g.18gb": "1", "cpu": "1"})],
        [],
        False,
        [SliceAsk("main", "1g.18gb", 1)],
        {"main": ["slice-0"]},
    ),
    (
        [container(limits={"nvidia.com/gpu": "2"}, requests={"nvidia.com/gpu": "2"})],
        [],
        True,
        [SliceAsk("main", "gpu", 2)],
        {"main": ["slice-0"]},
    ),
    (
        [
            container("a", limits={"nvidia.com/mig-1g.18gb": "2", "nvidia.com/mig-3g.71gb": "1"}),
            container("b"),
            container("c", limits={"instaslice.io/mig-2g.35gb": "1"}),
        ],
        [_sidecar("side", {"nvidia.com/mig-1g.18gb": "1"})],
        False,
        [
            SliceAsk("a", "1g.18gb", 2),
            SliceAsk("a", "3g.71gb", 1),
            SliceAsk("c", "2g.35gb", 1),
            SliceAsk("side", "1g.18gb", 1),
        ],
        {"a": ["slice-0", "slice-1"], "c": ["slice-2"], "side": ["slice-3"]},
    ),
]


@pytest.mark.parametrize(("containers", "inits", "whole", "asks", "requests"), CASES)
def test_asks_become_a_claim_reference(
    containers: list[Any], inits: list[Any], whole: bool, asks: list[SliceAsk],
    requests: dict[str, list[str]],
) -> None:  # fmt: skip
    pod = team_pod(*containers)
    if inits:
        pod["spec"]["initContainers"] = inits
    d, out = rewrite(pod, whole)
    claim = out["metadata"]["annotations"][CLAIM_ANNOTATION]
    assert out["spec"]["schedulingGates"] == [{"name": GATE_NAME}]
    assert out["spec"]["resourceClaims"] == [{"name": "instaslice", "resourceClaimName": claim}]
    assert list(d.asks) == asks
    assert slice_requests(out) == asks  # what the allocator reads
    assert ASKS_ANNOTATION in out["metadata"]["annotations"]
    for c in out["spec"]["containers"] + out["spec"].get("initContainers", []):
        res = c.get("resources") or {}
        keys = [*(res.get("limits") or {}), *(res.get("requests") or {})]
        assert not [k for k in keys if k.startswith(("nvidia.com/", "instaslice.io/"))], c
        assert "env" not in c or all(e["name"] != "NVIDIA_VISIBLE_DEVICES" for e in c["env"])
        want = [{"name": "instaslice", "request": r} for r in requests.get(c["name"], [])]
        assert res.get("claims", []) == want, c["name"]
    assert d.devices == ()


def test_users_own_claims_are_kept() -> None:
    mine = container(limits={"nvidia.com/mig-1g.18gb": "1"})
    mine["resources"]["claims"] = [{"name": "fpga"}]
    pod = team_pod(mine)
    pod["spec"]["resourceClaims"] = [{"name": "fpga", "resourceClaimName": "my-fpga"}]
    _, out = rewrite(pod)
    assert [e["name"] for e in out["spec"]["resourceClaims"]] == ["fpga", "instaslice"]
    assert out["spec"]["containers"][0]["resources"]["claims"] == [
        {"name": "fpga"},
        {"name": "instaslice", "request": "slice-0"},
    ]


def test_an_entry_named_like_ours_and_size_asks_are_refused() -> None:
    pod = team_pod(container(limits={"nvidia.com/mig-1g.18gb": "1"}))
    pod["spec"]["resourceClaims"] = [{"name": "instaslice", "resourceClaimName": "x"}]
    d = review(make_request(pod), DRA, new_claim=claims())
    assert isinstance(d, Denied) and "spec.resourceClaims" in d.message
    sized = team_pod(container())
    sized["metadata"]["annotations"] = {"instaslice.io/mig-size.main": "memory>=10Gi"}
    d = review(make_request(sized), DRA, new_claim=claims())
    assert isinstance(d, Denied) and "DRA mode" in d.message


def test_the_autoscaler_signal_asks_what_the_pod_asks() -> None:
    """§6 in DRA mode: the placeholder standing for a gated DRA pod (docs/autoscaling.md) asks
    the same `instaslice.io/mig-*` resources as for the gate-mode form of the pod: the asks
    come from `instaslice.io/asks`, and the placeholder names no claim."""
    pod = team_pod(container(limits={"nvidia.com/mig-1g.18gb": "2", "cpu": "1"}))
    _, dra = rewrite(pod)
    gate = jsonpatch.apply_patch(
        pod,
        review(make_request(pod), ENV, new_claim=claims()).patch,  # type: ignore[union-attr]
    )
    for out in (dra, gate):
        out["metadata"]["uid"] = "u1"
    signals = [placeholder_pod(p, pod_request(p), ()) for p in (dra, gate)]
    assert signals[0]["spec"] == signals[1]["spec"]
    assert signals[0]["spec"]["containers"][0]["resources"]["limits"] == {
        "instaslice.io/mig-1g.18gb": "2"
    }
    assert "resourceClaims" not in signals[0]["spec"]
