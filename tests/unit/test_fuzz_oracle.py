"""bench.fuzz: its oracle catches each kind of bad answer, and a short run against the real
admission server (a child process, TLS) finds no crash and no malformed answer.

Leaves out the 100 000-review run (`make fuzz`, numbers in docs/security.md).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from bench import fuzz
from common.constants import GATE_NAME

pytestmark = pytest.mark.timeout(120)

UID = "u-1"


def _review(pod: object) -> bytes:
    return json.dumps(fuzz._envelope(pod, "ns", UID)).encode()


def _answer(resp: dict[str, object]) -> bytes:
    doc = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": resp}
    return json.dumps(doc).encode()


def _patch(ops: list[dict[str, object]]) -> str:
    return base64.b64encode(json.dumps(ops).encode()).decode()


POD = {"metadata": {}, "spec": {"containers": [
    {"name": "main", "resources": {"limits": {"nvidia.com/mig-1g.10gb": "1"}}}]}}  # fmt: skip
GOOD_OPS: list[dict[str, object]] = [
    {"op": "add", "path": "/metadata/annotations", "value": {"instaslice.io/claim": "cabc"}},
    {"op": "add", "path": "/spec/schedulingGates", "value": [{"name": GATE_NAME}]},
    {"op": "replace", "path": "/spec/containers/0/resources/limits",
     "value": {"instaslice.io/mig-1g.10gb": "1"}},
    {"op": "add", "path": "/spec/containers/0/env", "value": [
        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "instaslice.io/mig=ns_cabc_main"}]},
]  # fmt: skip


def _init_pod(restart_policy: str | None) -> dict[str, Any]:
    prep: dict[str, Any] = {
        "name": "prep", "resources": {"limits": {"nvidia.com/mig-1g.10gb": "1"}}}  # fmt: skip
    if restart_policy is not None:
        prep["restartPolicy"] = restart_policy
    return {"metadata": {}, "spec": {"containers": [{"name": "main"}], "initContainers": [prep]}}


INIT_OPS: list[dict[str, object]] = [
    GOOD_OPS[0], GOOD_OPS[1],
    {"op": "replace", "path": "/spec/initContainers/0/resources/limits",
     "value": {"instaslice.io/mig-1g.10gb": "1"}},
    {"op": "add", "path": "/spec/initContainers/0/env", "value": [
        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "instaslice.io/mig=ns_cabc_prep"}]},
]  # fmt: skip


@pytest.mark.parametrize(
    ("pod", "want"),
    [
        (_init_pod(None), "init container 'prep' (not a sidecar) asks for slices"),
        (_init_pod("OnFailure"), "init container 'prep' (not a sidecar) asks for slices"),
        (_init_pod("Always"), None),  # a sidecar
    ],
)
def test_the_oracle_flags_slices_admitted_for_an_init_container_that_is_not_a_sidecar(
    pod: object, want: str | None
) -> None:
    resp = {"uid": UID, "allowed": True, "patchType": "JSONPatch", "patch": _patch(INIT_OPS)}
    _, problem = fuzz.check(_review(pod), 200, _answer(resp))
    assert problem == want


@pytest.mark.parametrize(
    ("status", "resp", "want"),
    [
        (200, {"uid": UID, "allowed": True, "patchType": "JSONPatch", "patch": _patch(GOOD_OPS)},
         None),
        (200, {"uid": "other", "allowed": True}, "uid/allowed wrong"),
        (200, {"uid": UID, "allowed": "yes"}, "uid/allowed wrong"),
        (200, {"uid": UID, "allowed": False}, "denial without status"),
        (200, {"uid": UID, "allowed": False,
               "status": {"code": 500, "reason": "InternalError", "message": "boom"}},
         "internal error"),
        (200, {"uid": UID, "allowed": False,
               "status": {"code": 403, "reason": "Forbidden", "message": "bad"}},
         "not 422 Invalid"),
        (200, {"uid": UID, "allowed": False,
               "status": {"code": 422, "reason": "Invalid", "message": "bad"}},
         "without field causes"),
        (200, {"uid": UID, "allowed": False,
               "status": {"code": 422, "reason": "Invalid", "message": "bad", "details": {
                   "causes": [{"reason": "FieldValueInvalid", "message": "bad",
                               "field": "spec.containers[0]"}]}}},
         None),
        (500, {"uid": UID, "allowed": True}, "HTTP 500"),
        (200, {"uid": UID, "allowed": True, "patchType": "JSONPatch", "patch": "!!"},
         "patch does not apply"),
        (200, {"uid": UID, "allowed": True, "patchType": "JSONPatch",
               "patch": _patch(GOOD_OPS[:2] + GOOD_OPS[3:])}, "still asks for nvidia.com/mig-*"),
        (200, {"uid": UID, "allowed": True, "patchType": "JSONPatch",
               "patch": _patch([*GOOD_OPS[:3], {**GOOD_OPS[3], "value": [
                   {"name": "NVIDIA_VISIBLE_DEVICES", "value": "instaslice.io/mig=x_y_main"}]}])},
         "device"),
        (200, {"uid": UID, "allowed": True, "patchType": "JSONPatch",
               "patch": _patch([GOOD_OPS[0], GOOD_OPS[2], GOOD_OPS[3]])}, "gate 0 times"),
    ],
)  # fmt: skip
def test_the_oracle_flags_every_kind_of_bad_answer(
    status: int, resp: dict[str, object], want: str | None
) -> None:
    _, problem = fuzz.check(_review(POD), status, _answer(resp))
    if want is None:
        assert problem is None
    else:
        assert problem is not None and want in problem


def test_bodies_without_a_usable_uid_want_a_400() -> None:
    assert fuzz.check(b"{", 400, b'{"error": "body is not JSON"}') == ("unusable", None)
    assert fuzz.check(b"{", 200, b'{"error": "x"}')[1] is not None


def test_a_short_run_against_the_server_is_clean(tmp_path: Path) -> None:
    result = fuzz.run(600, 2, 7, tmp_path / "fuzz.json")
    assert result["server_alive"] and result["reviews"] == 600, result
    assert result["crashes"] == 0 and result["malformed_answers"] == 0, result["problems"]
    assert json.loads((tmp_path / "fuzz.json").read_text()) == result
