"""common.podspec: how everything after admission reads a rewritten pod's slice asks.

Covers: positive-integer counts only, containers then sidecars, ephemeral containers
ignored, `nvidia.com/mig-*` (not yet rewritten) ignored, malformed asks raising
SliceRequestError, the claim annotation reader, tolerance of malformed JSON. An init
container other than a sidecar asking: test_admission_init.py.
Leaves out: the rewrite itself (test_admission.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from common.podspec import SliceAsk, SliceRequestError, parse_count, pod_claim, slice_requests


@pytest.mark.parametrize(
    ("value", "count"),
    [("1", 1), ("7", 7), (3, 3), ("123456789012345678", 123456789012345678), ("0", None),
     ("-1", None), ("0.5", None), ("1k", None), ("1e3", None), ("01", None), ("", None),
     (0, None), (True, None), (1.0, None), (None, None), ("1" * 19, None), (10**18, None)],
)  # fmt: skip
def test_parse_count(value: Any, count: int | None) -> None:
    assert parse_count(value) == count


def _pod(**spec: Any) -> dict[str, Any]:
    return {"metadata": {"annotations": {"instaslice.io/claim": "cabc"}}, "spec": spec}


def test_slice_requests_in_container_order() -> None:
    pod = _pod(
        initContainers=[
            {"name": "i", "restartPolicy": "Always",
             "resources": {"limits": {"instaslice.io/mig-1g.18gb.me": "1"}}},
            {"name": "j", "resources": {"limits": {"cpu": "1"}}},
        ],
        containers=[
            {"name": "a", "resources": {"limits": {"instaslice.io/mig-3g.71gb": "2", "cpu": "1"}}},
            {"name": "b"},
            {"name": "c", "resources": {"limits": {"nvidia.com/mig-1g.18gb": "1"}}},
        ],
        ephemeralContainers=[
            {"name": "e", "resources": {"limits": {"instaslice.io/mig-1g.18gb": "1"}}}
        ],
    )  # fmt: skip
    assert slice_requests(pod) == [
        SliceAsk("a", "3g.71gb", 2),
        SliceAsk("i", "1g.18gb+me", 1),
    ]
    assert pod_claim(pod) == "cabc"


@pytest.mark.parametrize(
    ("limits", "words"),
    [
        ({"instaslice.io/mig-huge": "1"}, "'huge' is not a MIG profile resource suffix"),
        ({"instaslice.io/mig-1g.18gb": "1k"}, "is not a positive integer count"),
    ],
)
def test_malformed_asks_raise(limits: dict[str, Any], words: str) -> None:
    with pytest.raises(SliceRequestError, match=words):
        slice_requests(_pod(containers=[{"name": "a", "resources": {"limits": limits}}]))


@pytest.mark.parametrize(
    "pod",
    [{}, {"spec": None}, {"spec": {"containers": "x"}}, {"spec": {"containers": [1, None]}},
     {"spec": {"containers": [{"resources": []}, {"resources": {"limits": []}}]}}],
)  # fmt: skip
def test_malformed_json_reads_as_no_asks(pod: dict[str, Any]) -> None:
    assert slice_requests(pod) == []
    assert pod_claim(pod) is None


@pytest.mark.parametrize(
    "meta", [None, "x", {"annotations": None}, {"annotations": {"instaslice.io/claim": 5}}]
)
def test_pod_claim_absent(meta: Any) -> None:
    assert pod_claim({"metadata": meta}) is None
