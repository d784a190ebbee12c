"""Init containers and slices (docs/contract.md §1): only sidecars may ask.

An init container that is not a sidecar (`restartPolicy: Always`) would hold its slices for the
pod's whole life while ResourceQuota, the scheduler and Kueue charge the pod only its largest
init container's ask. Covers: the webhook refuses every such ask — by profile (limits,
requests only, InstaSlice's spelling), whole GPU (in a whole-GPU namespace) and size — naming
the field and saying why and what to do; a sidecar's asks are admitted and wired like an app
container's; what is not InstaSlice's (ephemeral containers, `nvidia.com/gpu` outside the
whole-GPU opt-in, an init container asking only cpu) passes as before; and what comes after
admission (`podspec.slice_requests`, `sizing.size_asks`) refuses a pod that carries such an
ask anyway. Leaves out: the pod policy on the real API server (tests/integration/
test_admission_policy.py) and placement of a sidecar (tests/integration/test_allocator.py).
"""

from __future__ import annotations

from typing import Any

import jsonpatch
import pytest

from common.constants import VISIBLE_DEVICES_ENV
from common.podspec import SliceAsk, SliceRequestError, slice_requests
from common.sizing import Size, SizeAsk, SizeError, size_asks
from testkit.builders import container, sidecar
from tests.unit.test_admission import ENV, MIG, NS, claims, make_request, team_pod
from webhook.admission import review
from webhook.reviews import Allowed, Denied, Patched, Verdict

GPU = "nvidia.com/gpu"
SIZE = "instaslice.io/mig-size."
WHY = [
    "ResourceQuota, the scheduler and Kueue charge a pod only its largest init container's ask",
    "held uncharged",
    "Move the ask to an app container (spec.containers)",
    "make this init container a sidecar (restartPolicy: Always)",
]


def decide(pod: Any, whole: bool = False) -> Verdict:
    return review(make_request(pod), ENV, new_claim=claims(), whole_gpu=whole)


def _main() -> dict[str, Any]:
    return container("main", limits={MIG: "1"})


@pytest.mark.parametrize(
    ("pod", "whole", "field"),
    [
        (team_pod(_main(), init=[container("prep", limits={MIG: "1"})]), False,
         f"spec.initContainers[0].resources.limits[{MIG}]"),
        (team_pod(container("main"), init=[container("prep", limits={MIG: "2"})]), False,
         f"spec.initContainers[0].resources.limits[{MIG}]"),
        (team_pod(_main(), init=[container("prep", requests={MIG: "1"})]), False,
         f"spec.initContainers[0].resources.requests[{MIG}]"),
        (team_pod(_main(), init=[container("prep", limits={"instaslice.io/mig-1g.18gb": "1"})]),
         False, "spec.initContainers[0].resources.limits[instaslice.io/mig-1g.18gb]"),
        (team_pod(container("main", limits={GPU: "1"}),
                  init=[container("a"), container("prep", limits={GPU: "1"})]), True,
         f"spec.initContainers[1].resources.limits[{GPU}]"),
        (team_pod(_main(), init=[container("prep", limits={"instaslice.io/gpu": "1"})]), False,
         "spec.initContainers[0].resources.limits[instaslice.io/gpu]"),
        (team_pod(_main(), init=[container("prep")], annotations={SIZE + "prep": "memory>=1Gi"}),
         False, f"metadata.annotations[{SIZE}prep] (spec.initContainers[0])"),
        # only "Always" makes a sidecar (the API server refuses any other value anyway)
        (team_pod(_main(), init=[{**container("prep", limits={MIG: "1"}),
                                  "restartPolicy": "OnFailure"}]), False,
         f"spec.initContainers[0].resources.limits[{MIG}]"),
    ],
)  # fmt: skip
def test_an_init_container_that_is_not_a_sidecar_may_not_ask(
    pod: Any, whole: bool, field: str
) -> None:
    d = decide(pod, whole)
    assert isinstance(d, Denied) and (d.code, d.reason) == (422, "Invalid"), d
    assert (d.causes[0]["field"], d.causes[0]["reason"]) == (
        field.split(" ")[0],
        "FieldValueForbidden",
    )
    assert f'{field}: init container "prep" is not a sidecar, so it may not ask' in d.message
    for words in WHY:
        assert words in d.message, (words, d.message)


def test_the_reason_is_given_once_and_every_ask_is_named() -> None:
    prep = container("prep", limits={MIG: "1", "nvidia.com/mig-3g.71gb": "1"})
    d = decide(team_pod(_main(), init=[prep, container("more", limits={MIG: "1"})]))
    assert isinstance(d, Denied)
    problems = d.message.split("; ")
    assert [p.split(":")[0] for p in problems] == [
        f"spec.initContainers[0].resources.limits[{MIG}]",
        "spec.initContainers[0].resources.limits[nvidia.com/mig-3g.71gb]",
        f"spec.initContainers[1].resources.limits[{MIG}]",
    ]
    assert d.message.count("held uncharged") == 1


@pytest.mark.parametrize(
    ("pod", "whole", "asks"),
    [
        (team_pod(_main(), init=[sidecar(container("side", limits={MIG: "2"}))]), False,
         (SliceAsk("main", "1g.18gb", 1), SliceAsk("side", "1g.18gb", 2))),
        (team_pod(container("main"), init=[sidecar(container("side", limits={MIG: "1"}))]),
         False, (SliceAsk("side", "1g.18gb", 1),)),
        (team_pod(container("main", limits={GPU: "1"}),
                  init=[sidecar(container("side", limits={GPU: "1"}))]), True,
         (SliceAsk("main", "gpu", 1), SliceAsk("side", "gpu", 1))),
        (team_pod(_main(), init=[sidecar(container("side"))],
                  annotations={SIZE + "side": "memory>=1Gi"}), False,
         (SliceAsk("main", "1g.18gb", 1),)),
    ],
)  # fmt: skip
def test_a_sidecar_asks_like_an_app_container(
    pod: Any, whole: bool, asks: tuple[SliceAsk, ...]
) -> None:
    d = decide(pod, whole)
    assert isinstance(d, Patched), d
    assert d.asks == asks
    out = jsonpatch.apply_patch(pod, d.patch)
    side = out["spec"]["initContainers"][0]
    device = f"instaslice.io/mig={NS}_{d.claim}_side"
    assert {"name": VISIBLE_DEVICES_ENV, "value": device} in side["env"]
    assert [(a.container, a.profile, a.count) for a in slice_requests(out)] == [
        (a.container, a.profile, a.count) for a in asks
    ]


@pytest.mark.parametrize(
    ("pod", "whole", "want"),
    [
        # ephemeral containers never get slices and are not looked at, as before
        ({**team_pod(), "spec": {"containers": [container()], "ephemeralContainers": [
            container("dbg", limits={MIG: "1"})]}}, False, Allowed("no MIG request")),
        # nvidia.com/gpu outside the whole-GPU opt-in is NVIDIA's device plugin's, not ours
        (team_pod(container("main"), init=[container("prep", limits={GPU: "1"})]), False,
         Allowed("no MIG request")),
        (team_pod(_main(), init=[container("prep", limits={"cpu": "1"})]), False, Patched),
    ],
)  # fmt: skip
def test_what_is_not_a_slice_ask_of_an_init_container_passes(
    pod: Any, whole: bool, want: Any
) -> None:
    d = decide(pod, whole)
    if isinstance(want, type):
        assert isinstance(d, want), d
    else:
        assert d == want


def test_after_admission_such_asks_are_refused_too() -> None:
    """A pod that bypassed the webhook (the pod policy refuses it too) is not placed."""
    prep = container("prep", limits={"instaslice.io/mig-1g.18gb": "1"})
    with pytest.raises(SliceRequestError, match=r"init container 'prep'.*not a sidecar"):
        slice_requests(team_pod(container("main"), init=[prep]))
    assert slice_requests(team_pod(container("main"), init=[sidecar(prep)])) == [
        SliceAsk("prep", "1g.18gb", 1)
    ]
    sized = {SIZE + "prep": "memory>=1Gi"}
    with pytest.raises(SizeError, match=r"mig-size.prep\]: names an init container"):
        size_asks(team_pod(container("main"), init=[container("prep")], annotations=sized))
    got = size_asks(
        team_pod(container("main"), init=[sidecar(container("prep"))], annotations=sized)
    )
    assert got == [SizeAsk("prep", Size(1024))]
