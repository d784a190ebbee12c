"""Admission of whole-GPU asks (`nvidia.com/gpu`) in namespaces opted in to whole GPUs.

Covers: with `whole_gpu` (the namespace carries `instaslice.io/whole-gpu: "true"`) a pod
asking `nvidia.com/gpu: N` is gated, claimed, renamed to `instaslice.io/gpu` and wired to its
CDI device like a slice ask; without it the same pod is left alone; bad counts, requests that
differ from limits, a request without a limit, and whole GPUs together with MIG slices are
refused with the container and field named; the rewritten pod reads back as a "gpu" ask.
Leaves out: the webhook configuration that routes such namespaces (test_manifests.py) and
MIG asks (test_admission.py).
"""

from __future__ import annotations

from typing import Any

import jsonpatch

from common.constants import CLAIM_ANNOTATION, GATE_NAME, VISIBLE_DEVICES_ENV
from common.podspec import SliceAsk, slice_requests
from testkit.builders import container
from tests.unit.test_admission import ENV, NS, claims, make_request, team_pod
from webhook.admission import review
from webhook.reviews import Allowed, Denied, Patched, Verdict


def decide(pod: Any, whole: bool = True) -> Verdict:
    return review(make_request(pod), ENV, new_claim=claims(), whole_gpu=whole)


def test_whole_gpu_pod_is_gated_claimed_renamed_and_wired() -> None:
    pod = team_pod(
        container(limits={"nvidia.com/gpu": "2", "cpu": "1"}, requests={"nvidia.com/gpu": "2"})
    )
    d = decide(pod)
    assert isinstance(d, Patched), d
    out = jsonpatch.apply_patch(pod, d.patch)
    c = out["spec"]["containers"][0]
    assert c["resources"]["limits"] == {"instaslice.io/gpu": "2", "cpu": "1"}
    assert c["resources"]["requests"] == {"instaslice.io/gpu": "2"}
    assert out["spec"]["schedulingGates"] == [{"name": GATE_NAME}]
    claim = out["metadata"]["annotations"][CLAIM_ANNOTATION]
    dev = f"instaslice.io/mig={NS}_{claim}_main"
    assert {"name": VISIBLE_DEVICES_ENV, "value": dev} in c["env"]
    assert d.asks == (SliceAsk("main", "gpu", 2),)
    assert slice_requests(out) == [SliceAsk("main", "gpu", 2)]


def test_without_the_second_opt_in_nvidia_gpu_is_left_alone() -> None:
    pod = team_pod(container(limits={"nvidia.com/gpu": "1"}))
    assert isinstance(decide(pod, whole=False), Allowed)


def _denied(pod: Any) -> str:
    d = decide(pod)
    assert isinstance(d, Denied), d
    return d.message


def test_bad_whole_gpu_asks_are_refused_naming_the_field() -> None:
    msg = _denied(team_pod(container(limits={"nvidia.com/gpu": "0"})))
    assert 'container "main": resources.limits[nvidia.com/gpu]: count "0"' in msg
    msg = _denied(
        team_pod(container(limits={"nvidia.com/gpu": "1"}, requests={"nvidia.com/gpu": "2"}))
    )
    assert "resources.requests[nvidia.com/gpu]" in msg and "differs from the limit" in msg
    msg = _denied(team_pod(container(requests={"nvidia.com/gpu": "1"})))
    assert "must also be in limits" in msg
    msg = _denied(
        team_pod(container(limits={"nvidia.com/gpu": "1", "nvidia.com/mig-1g.10gb": "1"}))
    )
    assert "whole GPUs (nvidia.com/gpu) and MIG slices (1g.10gb) together" in msg
    msg = _denied(team_pod(container(limits={"nvidia.com/gpu": "1", "instaslice.io/gpu": "1"})))
    assert "both nvidia.com/gpu and instaslice.io/gpu" in msg


def test_mig_pods_in_a_whole_gpu_namespace_are_rewritten_as_usual() -> None:
    d = decide(team_pod(container(limits={"nvidia.com/mig-1g.10gb": "1"})))
    assert isinstance(d, Patched) and d.asks == (SliceAsk("main", "1g.10gb", 1),)
