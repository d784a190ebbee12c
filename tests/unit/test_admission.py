"""The pure admission decision (webhook.admission.review) against docs/contract.md §1-2.

Covers: every rewrite (resource rename with JSON Pointer escaping, gate, claim, CDI device in
`env` mode and not in `device-plugin` mode, containers and sidecars), every denial with
the words of its message, what is passed through unchanged (no MIG request, UPDATE, other
kinds, subresources), the normalisation of a pod that already carries InstaSlice's marks, and
hypothesis properties: for any valid pod the patch applies cleanly and changes nothing but
what §2 says; reviewing the result again yields the same shape under a fresh claim.
Leaves out: the HTTP shell (test_webhook_server.py) and the real apiserver
(tests/integration/test_webhook.py).
"""

from __future__ import annotations

import copy
import itertools
from functools import partial
from typing import Any

import jsonpatch
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.catalog import load_catalog
from common.constants import (
    CLAIM_ANNOTATION,
    GATE_NAME,
    SCALE_UP_LABEL,
    VISIBLE_DEVICES_ENV,
    BindingMode,
)
from common.podspec import SliceAsk
from common.profiles import instaslice_resource, nvidia_resource, profile_from_resource
from testkit.builders import container, sidecar, user_pod
from testkit.builders import make_pod as allocator_pod
from webhook.admission import pod_slice_requests, review
from webhook.allocator import pods as podlib
from webhook.allocator.autoscale import placeholder_pod
from webhook.reviews import AdmissionRequest, Allowed, Denied, Patched, Verdict, response_for
from webhook.settings import AdmissionSettings

ENV = AdmissionSettings.from_catalog()
PLUGIN = AdmissionSettings.from_catalog(BindingMode.DEVICE_PLUGIN)
NS = "team-a"
MIG = "nvidia.com/mig-1g.18gb"
ISL = "instaslice.io/mig-1g.18gb"
MIG_PREFIX = "nvidia.com/mig-"


# --- builders ------------------------------------------------------------------------------


# A pod as a user writes it in the test's namespace; named "p" unless the test names it.
team_pod = partial(user_pod, name="p", namespace=NS)


def make_request(
    pod: Any, *, op: str = "CREATE", namespace: str | None = NS, kind: str = "Pod"
) -> AdmissionRequest:
    req: dict[str, Any] = {
        "uid": "0e1f",
        "kind": {"group": "", "version": "v1", "kind": kind},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "operation": op,
        "userInfo": {"username": "alice"},
        "object": pod,
    }
    if namespace is not None:
        req["namespace"] = namespace
    return req  # type: ignore[return-value]


def claims() -> Any:
    counter = itertools.count()
    return lambda: f"c{next(counter):015d}"


def decide(pod: Any, s: AdmissionSettings = ENV, **kw: Any) -> Verdict:
    return review(make_request(pod, **kw), s, new_claim=claims())


def patched(pod: dict[str, Any], s: AdmissionSettings = ENV) -> tuple[Patched, dict[str, Any]]:
    d = decide(pod, s)
    assert isinstance(d, Patched), d
    return d, jsonpatch.apply_patch(pod, d.patch)


def denial(pod: Any, s: AdmissionSettings = ENV, **kw: Any) -> str:
    d = decide(pod, s, **kw)
    assert isinstance(d, Denied), d
    return d.message


CLAIM0 = "c000000000000000"
DEV = f"instaslice.io/mig={NS}_{CLAIM0}_main"


# --- rewrites ------------------------------------------------------------------------------


def test_limits_only_pod_is_gated_claimed_renamed_and_wired() -> None:
    pod = team_pod(container(limits={MIG: "1", "cpu": "2"}))
    d, out = patched(pod)
    assert d.claim == CLAIM0
    assert out["metadata"]["annotations"] == {CLAIM_ANNOTATION: CLAIM0}
    assert out["spec"]["schedulingGates"] == [{"name": GATE_NAME}]
    c = out["spec"]["containers"][0]
    assert c["resources"] == {"limits": {"cpu": "2", ISL: "1"}}
    assert c["env"] == [{"name": VISIBLE_DEVICES_ENV, "value": DEV}]
    assert d.devices == (DEV,)
    assert d.asks == (SliceAsk("main", "1g.18gb", 1),)
    assert d.warnings == ()


def test_patch_paths_escape_slash_and_tilde() -> None:
    d, _ = patched(team_pod(container(limits={MIG: "1"}, requests={MIG: "1"})))
    paths = [(op["op"], op["path"]) for op in d.patch]
    assert ("remove", "/spec/containers/0/resources/limits/nvidia.com~1mig-1g.18gb") in paths
    assert ("add", "/spec/containers/0/resources/limits/instaslice.io~1mig-1g.18gb") in paths
    assert ("remove", "/spec/containers/0/resources/requests/nvidia.com~1mig-1g.18gb") in paths
    assert ("add", "/metadata/annotations") in paths  # no annotations yet: add the map
    pod = team_pod(container(limits={MIG: "1"}), annotations={"a~b/c": "x"})
    d, out = patched(pod)
    assert {"op": "add", "path": "/metadata/annotations/instaslice.io~1claim", "value": CLAIM0} in (
        d.patch
    )
    assert out["metadata"]["annotations"] == {"a~b/c": "x", CLAIM_ANNOTATION: CLAIM0}


def test_requests_equal_to_limits_are_renamed_too() -> None:
    _, out = patched(team_pod(container(limits={MIG: "2"}, requests={MIG: "2", "memory": "1Gi"})))
    assert out["spec"]["containers"][0]["resources"] == {
        "limits": {ISL: "2"},
        "requests": {"memory": "1Gi", ISL: "2"},
    }


def test_several_profiles_and_me_spelling() -> None:
    limits = {MIG: "2", "nvidia.com/mig-3g.71gb": "1", "nvidia.com/mig-1g.18gb.me": "1"}
    d, out = patched(team_pod(container(limits=limits)))
    assert out["spec"]["containers"][0]["resources"]["limits"] == {
        ISL: "2",
        "instaslice.io/mig-3g.71gb": "1",
        "instaslice.io/mig-1g.18gb.me": "1",
    }
    assert {(a.profile, a.count) for a in d.asks} == {
        ("1g.18gb", 2),
        ("3g.71gb", 1),
        ("1g.18gb+me", 1),
    }
    assert pod_slice_requests(out) == [
        ("main", "1g.18gb", 2),
        ("main", "3g.71gb", 1),
        ("main", "1g.18gb+me", 1),
    ]


def test_sidecars_are_rewritten_and_other_containers_left_alone() -> None:
    logger = container("logger", limits={"cpu": "1"}, env=[{"name": "A", "value": "b"}])
    env = [{"name": "X", "value": "1"}]
    side = sidecar(container("warmup", limits={"nvidia.com/mig-2g.35gb": "1"}, env=env))
    d, out = patched(team_pod(container(limits={MIG: "1"}), logger, init=[side]))
    assert out["spec"]["containers"][1] == logger
    w = out["spec"]["initContainers"][0]
    assert w["resources"]["limits"] == {"instaslice.io/mig-2g.35gb": "1"}
    assert w["env"] == [
        {"name": "X", "value": "1"},
        {"name": VISIBLE_DEVICES_ENV, "value": f"instaslice.io/mig={NS}_{CLAIM0}_warmup"},
    ]
    assert d.asks[1] == SliceAsk("warmup", "2g.35gb", 1)
    assert pod_slice_requests(out) == [("main", "1g.18gb", 1), ("warmup", "2g.35gb", 1)]


def test_only_a_sidecar_asks() -> None:
    _, out = patched(
        team_pod(container("app"), init=[sidecar(container("prep", limits={MIG: "1"}))])
    )
    assert "env" not in out["spec"]["containers"][0]
    assert out["spec"]["initContainers"][0]["env"][0]["value"].endswith("_prep")


def test_other_gates_and_annotations_are_kept_and_ours_appended() -> None:
    pod = team_pod(
        container(limits={MIG: "1"}), annotations={"x": "y"}, gates=["kueue.x-k8s.io/admission"]
    )
    _, out = patched(pod)
    assert out["spec"]["schedulingGates"] == [
        {"name": "kueue.x-k8s.io/admission"},
        {"name": GATE_NAME},
    ]
    assert out["metadata"]["annotations"] == {"x": "y", CLAIM_ANNOTATION: CLAIM0}


def test_null_annotations_gates_and_env_are_replaced() -> None:
    pod = team_pod(container(limits={MIG: "1"}))
    pod["metadata"]["annotations"] = None
    pod["spec"]["schedulingGates"] = None
    pod["spec"]["containers"][0]["env"] = None
    _, out = patched(pod)
    assert out["metadata"]["annotations"] == {CLAIM_ANNOTATION: CLAIM0}
    assert out["spec"]["schedulingGates"] == [{"name": GATE_NAME}]
    assert out["spec"]["containers"][0]["env"] == [{"name": VISIBLE_DEVICES_ENV, "value": DEV}]


def test_missing_metadata_uses_request_namespace() -> None:
    pod = team_pod(container(limits={MIG: "1"}))
    del pod["metadata"]
    _, out = patched(pod)
    assert out["metadata"] == {"annotations": {CLAIM_ANNOTATION: CLAIM0}}


def test_namespace_from_object_when_request_has_none() -> None:
    d = decide(team_pod(container(limits={MIG: "1"})), namespace=None)
    assert isinstance(d, Patched) and d.devices == (DEV,)


def test_device_plugin_mode_sets_no_env() -> None:
    d, out = patched(team_pod(container(limits={MIG: "1"})), PLUGIN)
    assert "env" not in out["spec"]["containers"][0]
    assert d.devices == ()
    assert out["spec"]["schedulingGates"] == [{"name": GATE_NAME}]


def test_asking_in_instaslice_spelling_is_gated_without_rename() -> None:
    d, out = patched(team_pod(container(limits={ISL: "1"}, requests={ISL: "1"})))
    assert not [op for op in d.patch if "resources" in op["path"]]
    assert out["spec"]["containers"][0]["resources"]["limits"] == {ISL: "1"}
    assert out["spec"]["schedulingGates"] == [{"name": GATE_NAME}]


def test_json_int_counts_are_accepted() -> None:
    d, out = patched(team_pod(container(limits={MIG: 3})))
    assert d.asks == (SliceAsk("main", "1g.18gb", 3),)
    assert out["spec"]["containers"][0]["resources"]["limits"] == {ISL: 3}


# --- what passes unchanged -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("pod", "kw", "reason"),
    [
        (team_pod(container(limits={"cpu": "1", "nvidia.com/gpu": "1"})), {}, "no MIG request"),
        (team_pod(container(limits={MIG: "1"})), {"op": "UPDATE"}, "only CREATE is mutated"),
        (team_pod(container(limits={MIG: "1"})), {"op": "DELETE"}, "only CREATE is mutated"),
        (team_pod(container(limits={MIG: "1"})), {"kind": "Deployment"}, "not a v1 Pod"),
        # an ephemeral container never gets slices, and is not even looked at
        (
            {**team_pod(), "spec": {"containers": [container()], "ephemeralContainers": [
                container("dbg", limits={MIG: "1"})]}},
            {},
            "no MIG request",
        ),
    ],
)  # fmt: skip
def test_allowed_unchanged(pod: Any, kw: dict[str, Any], reason: str) -> None:
    assert decide(pod, **kw) == Allowed(reason)


def test_subresource_is_allowed() -> None:
    req = make_request(team_pod(container(limits={MIG: "1"})))
    req["subResource"] = "ephemeralcontainers"
    assert review(req, ENV, new_claim=claims()) == Allowed("a subresource")


def test_pod_without_mig_is_allowed_even_if_otherwise_odd() -> None:
    pod = team_pod(container(env=[{"name": VISIBLE_DEVICES_ENV, "value": "all"}]), node_name="n1")
    assert decide(pod) == Allowed("no MIG request")


def test_do_not_disrupt_annotation_when_asked() -> None:
    pod = team_pod(container(limits={"nvidia.com/mig-1g.18gb": "1"}))
    s = AdmissionSettings.from_catalog(BindingMode.ENV, do_not_disrupt=True)
    _, out = patched(pod, s)
    assert out["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] == "true"
    pod["metadata"]["annotations"] = {"team": "a"}
    _, out = patched(pod, s)
    assert out["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] == "true"
    assert out["metadata"]["annotations"]["team"] == "a"
    _, plain = patched(team_pod(container(limits={"nvidia.com/mig-1g.18gb": "1"})))
    assert "karpenter.sh/do-not-disrupt" not in plain["metadata"]["annotations"]


PLACEHOLDER = Allowed("an autoscaler placeholder (docs/autoscaling.md)")


def _placeholder() -> dict[str, Any]:
    """An autoscaler placeholder as InstaSlice's allocator makes it, for gated pod u-gated."""
    gated = allocator_pod("p", namespace=NS, uid="u-gated", slices={"main": {"3g.40gb": 1}})
    return placeholder_pod(gated, podlib.pod_request(gated), ["n1"])


def test_an_autoscaler_placeholder_passes_unchanged() -> None:
    """Its instaslice.io/mig-* asks stand for a gated pod's demand (docs/autoscaling.md); the
    pod policy lets only InstaSlice create one."""
    assert decide(_placeholder()) == PLACEHOLDER


def _forged(where: str, key: str, value: Any = None) -> dict[str, Any]:
    """The placeholder with `key` of `where` (metadata, labels or spec) set to `value`, or
    dropped when it is None."""
    pod = _placeholder()
    part = pod["metadata"]["labels"] if where == "labels" else pod[where]
    if value is None:
        del part[key]
    else:
        part[key] = value
    return pod


@pytest.mark.parametrize(
    "pod",
    [
        _forged("metadata", "ownerReferences"),
        _forged("metadata", "ownerReferences", [{"kind": "Pod", "name": "x", "uid": "u-other"}]),
        _forged("metadata", "ownerReferences", [{"kind": "Pod", "name": "p", "uid": "u-gated"},
                                                {"kind": "ReplicaSet", "name": "r", "uid": "r"}]),
        _forged("metadata", "name", "train"),
        _forged("labels", "app.kubernetes.io/managed-by"),
        _forged("labels", SCALE_UP_LABEL, "u-other"),
        _forged("spec", "priorityClassName"),
        _forged("spec", "priorityClassName", "high"),
        _forged("metadata", "annotations", {CLAIM_ANNOTATION: "cforged"}),
        _forged("spec", "schedulingGates", [{"name": GATE_NAME}]),
        _forged("metadata", "labels", [SCALE_UP_LABEL]),  # the label, on a malformed field
    ],
    ids=[
        "no-owner", "owned-by-another-pod", "owned-by-more", "other-name", "not-managed",
        "stands-for-another", "no-priority-class", "other-priority-class", "claimed", "gated",
        "malformed-labels",
    ],
)  # fmt: skip
def test_a_labelled_pod_that_is_no_placeholder_of_ours_is_rewritten(pod: dict[str, Any]) -> None:
    """The label `instaslice.io/scale-up-for` alone proves nothing (anyone may write a
    label): a pod lacking any of what InstaSlice gives its placeholders is rewritten like
    any other (docs/security.md, threat model)."""
    d, out = patched(pod)
    assert out["spec"]["schedulingGates"] == [{"name": GATE_NAME}]
    assert out["metadata"]["annotations"][CLAIM_ANNOTATION] == d.claim


def test_a_tenant_pod_labelled_as_a_placeholder_is_rewritten_or_refused_like_any() -> None:
    """A tenant's own pod carrying the label (the value another pod's uid): its MIG asks are
    rewritten, gated and claimed as for every pod; an invalid one is refused with the same
    message. The pod policy then refuses the label itself (tests/integration/
    test_admission_policy.py)."""
    labels = {SCALE_UP_LABEL: "u-victim", "app.kubernetes.io/managed-by": "instaslice"}
    tenant = team_pod(container(limits={MIG: "1"}))
    tenant["metadata"]["labels"] = labels
    d, out = patched(tenant)
    assert out["spec"]["schedulingGates"] == [{"name": GATE_NAME}]
    assert out["spec"]["containers"][0]["resources"]["limits"] == {ISL: "1"}
    assert out["metadata"]["annotations"][CLAIM_ANNOTATION] == d.claim == CLAIM0
    written = team_pod(container(limits={ISL: "1"}))  # the rewritten form, by hand
    written["metadata"]["labels"] = labels
    assert patched(written)[1]["spec"]["schedulingGates"] == [{"name": GATE_NAME}]
    bad = team_pod(container(limits={"nvidia.com/mig-9g.99gb": "1"}))
    plain = denial(copy.deepcopy(bad))
    bad["metadata"]["labels"] = labels
    assert denial(bad) == plain


# --- denials -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pod", "words"),
    [
        (
            team_pod(container("train", limits={"nvidia.com/mig-9g.99gb": "1"})),
            ['container "train"', "resources.limits[nvidia.com/mig-9g.99gb]",
             "unknown MIG profile 9g.99gb", "no GPU model in the catalog offers it"],
        ),
        (
            team_pod(container("train", limits={"nvidia.com/mig-big": "1"})),
            ['container "train"', "resources.limits[nvidia.com/mig-big]",
             '"big" is not a MIG profile'],
        ),
        (
            team_pod(container("train", limits={"nvidia.com/mig-1c.2g.35gb": "1"})),
            ["resources.limits[nvidia.com/mig-1c.2g.35gb]", "is not a MIG profile"],
        ),
        (
            team_pod(container("train", limits={MIG: "1"}, requests={MIG: "2"})),
            ['container "train"', f"resources.requests[{MIG}]", '"2" differs from the limit "1"',
             "requests, if given, must equal limits)"],
        ),
        (
            team_pod(container("train", limits={"cpu": "1"}, requests={MIG: "1"})),
            ['container "train"', f"resources.requests[{MIG}]",
             "a MIG resource in requests must also be in limits"],
        ),
        (
            team_pod(container("a", limits={MIG: "1"}), node_name="gpu-node-3"),
            ['spec.nodeName', '"gpu-node-3"', "must let InstaSlice choose its node"],
        ),
        (
            team_pod(container("a", limits={MIG: "1"},
                               env=[{"name": VISIBLE_DEVICES_ENV, "value": "all"}])),
            ['container "a"', f"env[0] {VISIBLE_DEVICES_ENV} (value)", "may not set it",
             "remove this env entry"],
        ),
        (
            team_pod(container("a", limits={MIG: "1"}, env=[
                {"name": "X", "value": "1"},
                {"name": VISIBLE_DEVICES_ENV,
                 "valueFrom": {"configMapKeyRef": {"name": "m", "key": "k"}}}])),
            ['container "a"', f"env[1] {VISIBLE_DEVICES_ENV} (valueFrom)", "may not set it"],
        ),
        (
            team_pod(container("a", limits={MIG: "1"}),
                     container("side", env=[{"name": VISIBLE_DEVICES_ENV, "value": "0"}])),
            ['container "side"', f"env[0] {VISIBLE_DEVICES_ENV} (value)"],
        ),
        (
            team_pod(container("a", limits={MIG: "1"}),
                     container("side", env=[{"name": "GPU", "value":
                                             f"instaslice.io/mig={NS}_cother_a"}])),
            ['container "side"', 'env[0] "GPU"', "names an instaslice.io/mig CDI device itself"],
        ),
        (
            team_pod(container("a", limits={MIG: "1"}),
                     annotations={"cdi.k8s.io/x": "instaslice.io/mig=ns_c_a"}),
            ["metadata.annotations[cdi.k8s.io/x]", "never by pod annotation"],
        ),
        (
            team_pod(container("a", limits={MIG: "1", ISL: "1"})),
            ['container "a"', f"resources.limits[{ISL}]",
             f"profile 1g.18gb is also asked as {MIG}"],
        ),
        (
            team_pod(container("Bad_Name", limits={MIG: "1"})),
            ['spec.containers[0]: name "Bad_Name" is not a DNS-1123 label'],
        ),
        (
            team_pod(container("a", limits={MIG: "1"}), init=[container("a")]),
            ['spec.initContainers[0]: container name "a" is used twice'],
        ),
        (
            team_pod(container("a", limits={MIG: "2000"})),
            ["count 2000 exceeds the limit of 1024"],
        ),
    ],
)  # fmt: skip
def test_denied_with_container_field_and_reason(pod: Any, words: list[str]) -> None:
    message = denial(pod)
    for w in words:
        assert w in message, (w, message)
    d = decide(pod)
    assert isinstance(d, Denied) and (d.code, d.reason) == (422, "Invalid"), d
    assert d.message == message and d.causes, d
    for c in d.causes:  # kubectl prints `<field>: <message>`: the field is not said twice
        assert c["message"] and not c["message"].startswith(c["field"]), c
        assert f"{c['field']}: " not in c["message"], c
    assert all(c["field"].startswith(("spec.", "metadata.")) for c in d.causes), d.causes


@pytest.mark.parametrize(
    ("pod", "field", "reason"),
    [
        (team_pod(container("a", limits={"nvidia.com/mig-1g.99gb": "1"})),
         "spec.containers[0].resources.limits[nvidia.com/mig-1g.99gb]", "FieldValueInvalid"),
        (team_pod(container("a"), container("b", limits={MIG: "0"})),
         f"spec.containers[1].resources.limits[{MIG}]", "FieldValueInvalid"),
        (team_pod(container("a", limits={MIG: "1"}, requests={MIG: "2"})),
         f"spec.containers[0].resources.requests[{MIG}]", "FieldValueInvalid"),
        (team_pod(container("a", limits={MIG: "1"},
                            env=[{"name": VISIBLE_DEVICES_ENV, "value": "all"}])),
         "spec.containers[0].env[0]", "FieldValueForbidden"),
        (team_pod(container("a", limits={MIG: "1"}), init=[container("a")]),
         "spec.initContainers[0].name", "FieldValueDuplicate"),
    ],
)  # fmt: skip
def test_a_denial_is_invalid_with_the_api_field_path_of_each_problem(
    pod: Any, field: str, reason: str
) -> None:
    """Refusals of a pod's content read like the API server's own validation errors: 422
    `Invalid` with one cause per problem naming its field path (not 403, read as RBAC)."""
    d = decide(pod)
    assert isinstance(d, Denied) and (d.code, d.reason) == (422, "Invalid"), d
    assert [(c["field"], c["reason"]) for c in d.causes] == [(field, reason)], d.causes
    relative = field.partition("].")[2]
    assert f": {relative}: " not in d.causes[0]["message"], d.causes
    assert not d.causes[0]["message"].startswith("spec."), d.causes
    status = response_for("u", d)["response"]["status"]
    name = pod["metadata"].get("name") or pod["metadata"]["generateName"]
    assert status["details"] == {"kind": "Pod", "name": name, "causes": list(d.causes)}


@pytest.mark.parametrize(
    "count", ["0", "-1", "0.5", "1k", "1e3", "", " 1", "1.0", "500m", "01", 0, -1, 1.5, True,
              None, [1], {"n": 1}, "1" * 40]
)  # fmt: skip
def test_counts_must_be_positive_integers(count: Any) -> None:
    message = denial(team_pod(container("a", limits={MIG: count}, requests={MIG: count})))
    assert f'container "a": resources.limits[{MIG}]: count ' in message
    assert "is not a positive integer" in message


def test_every_problem_is_reported_at_once() -> None:
    pod = team_pod(
        container("a", limits={"nvidia.com/mig-9g.99gb": "1", MIG: "0"}),
        init=[sidecar(container("b", requests={MIG: "1"}))],
        node_name="n",
    )
    parts = denial(pod).split("; ")
    assert len(parts) == 4
    assert parts[0].startswith("spec.nodeName")


def test_problem_list_is_capped() -> None:
    limits = {f"nvidia.com/mig-{g}g.{n}gb": "1" for g in (5, 6) for n in range(100, 130)}
    message = denial(team_pod(container("a", limits=limits)))
    assert message.count("; ") == 20
    assert message.endswith("and 40 more problems")


@pytest.mark.parametrize(
    ("pod", "kw", "words"),
    [
        (None, {}, "request.object is missing"),
        (team_pod(container(limits={MIG: "1"})), {"namespace": "Bad_NS"}, "namespace"),
        ({"spec": {"containers": [container(limits={MIG: "1"})]}}, {"namespace": None},
         "namespace null is not a DNS-1123 label"),
        ({**team_pod(container(limits={MIG: "1"})), "metadata": "x"}, {}, "object.metadata"),
        ({**team_pod(container(limits={MIG: "1"})), "metadata": {"annotations": [1]}}, {},
         "object.metadata.annotations is not an object"),
        ({"spec": {"containers": [container(limits={MIG: "1"})], "schedulingGates": {}}}, {},
         "object.spec.schedulingGates is not a list"),
    ],
)  # fmt: skip
def test_malformed_objects_are_refused_with_400(pod: Any, kw: dict[str, Any], words: str) -> None:
    d = decide(pod, **kw)
    assert isinstance(d, Denied) and d.code == 400 and d.reason == "BadRequest", d
    assert words in d.message
    assert d.message.startswith("malformed AdmissionReview: ")


@pytest.mark.parametrize(
    ("mutate", "words"),
    [
        (lambda c: c.update(env={"X": "1"}), 'container "a": env is not a list'),
        (lambda c: c.update(env=["X"]), 'container "a": env[0] is not an object'),
        (lambda c: c.update(resources=[]), 'container "a": resources is not an object'),
        (lambda c: c["resources"].update(requests="1"), "resources.requests is not an object"),
    ],
)
def test_malformed_containers_are_denied(mutate: Any, words: str) -> None:
    pod = team_pod(container("a", limits={MIG: "1"}), container("b", limits={MIG: "1"}))
    mutate(pod["spec"]["containers"][0])
    assert words in denial(pod)


def test_non_object_container_is_denied() -> None:
    pod = team_pod(container("a", limits={MIG: "1"}))
    pod["spec"]["initContainers"] = ["oops"]
    assert "spec.initContainers[0]: is not a container object" in denial(pod)


# --- re-admission of a pod that already carries the marks ----------------------------------


def test_rewritten_pod_reviewed_again_gets_one_gate_and_a_fresh_claim() -> None:
    pod = team_pod(
        container("a", limits={MIG: "1"}, env=[{"name": "K", "value": "v"}]),
        init=[sidecar(container("i", limits={MIG: "1"}))],
    )
    first, out = patched(pod)
    second = review(make_request(out), ENV, new_claim=lambda: "cfresh")
    assert isinstance(second, Patched)
    again = jsonpatch.apply_patch(out, second.patch)
    assert again["spec"]["schedulingGates"] == [{"name": GATE_NAME}]
    assert again["metadata"]["annotations"] == {CLAIM_ANNOTATION: "cfresh"}
    assert again["spec"]["containers"][0]["env"] == [
        {"name": "K", "value": "v"},
        {"name": VISIBLE_DEVICES_ENV, "value": f"instaslice.io/mig={NS}_cfresh_a"},
    ]
    assert again["spec"]["initContainers"][0]["env"] == [
        {"name": VISIBLE_DEVICES_ENV, "value": f"instaslice.io/mig={NS}_cfresh_i"}
    ]
    assert second.asks == first.asks
    assert second.warnings and "fresh claim cfresh" in second.warnings[0]


def test_replay_into_device_plugin_mode_drops_the_old_device() -> None:
    _, out = patched(team_pod(container("a", limits={MIG: "1"})))
    d = review(make_request(out), PLUGIN, new_claim=lambda: "cnew")
    assert isinstance(d, Patched)
    assert jsonpatch.apply_patch(out, d.patch)["spec"]["containers"][0]["env"] == []


def test_replay_naming_another_claims_device_is_denied() -> None:
    pod = team_pod(
        container("a", limits={ISL: "1"}, env=[
            {"name": VISIBLE_DEVICES_ENV, "value": f"instaslice.io/mig={NS}_cvictim_a"}]),
        annotations={CLAIM_ANNOTATION: "cmine"},
        gates=[GATE_NAME],
    )  # fmt: skip
    assert f"env[0] {VISIBLE_DEVICES_ENV} (value)" in denial(pod)


def test_replay_in_another_namespace_is_denied() -> None:
    _, out = patched(team_pod(container("a", limits={MIG: "1"})))
    assert "may not set it" in denial(out, namespace="elsewhere")


# --- properties ----------------------------------------------------------------------------

_LABEL = st.builds(
    lambda a, b: a + b, st.sampled_from("abcxyz"), st.text("abz09-", max_size=6)
).filter(lambda s: not s.endswith("-"))
_PROFILES = sorted(load_catalog().profile_names())
_SAFE_TEXT = st.text(max_size=12).filter(lambda s: "instaslice.io/mig=" not in s)


@st.composite
def _container(draw: st.DrawFn, name: str) -> dict[str, Any]:
    profiles = draw(st.lists(st.sampled_from(_PROFILES), max_size=3, unique=True))
    limits: dict[str, Any] = {nvidia_resource(p): str(draw(st.integers(1, 7))) for p in profiles}
    if draw(st.booleans()):
        limits["cpu"] = draw(st.sampled_from(["100m", "1", "2"]))
    requests = {k: v for k, v in limits.items() if draw(st.booleans())}
    env_names = draw(st.lists(st.text("ABNV_", min_size=1, max_size=8), max_size=3))
    env = [{"name": n, "value": draw(_SAFE_TEXT)} for n in env_names if n != VISIBLE_DEVICES_ENV]
    empty_limits, empty_env = draw(st.booleans()), draw(st.booleans())
    return container(
        name,
        limits=limits if limits or empty_limits else None,
        requests=requests if requests else None,
        env=env if env or empty_env else None,
    )


@st.composite
def valid_pods(draw: st.DrawFn) -> dict[str, Any]:
    names = draw(st.lists(_LABEL, min_size=1, max_size=6, unique=True))
    split = draw(st.integers(1, len(names)))
    containers = [draw(_container(n)) for n in names[:split]]
    init = []
    for n in names[split:]:  # only sidecars may ask; the others may be plain init containers
        c = draw(_container(n))
        asks = any(k.startswith(MIG_PREFIX) for k in c.get("resources", {}).get("limits", {}))
        init.append(sidecar(c) if asks or draw(st.booleans()) else c)
    annotations = draw(st.dictionaries(st.text("ab/~", min_size=1, max_size=6),
                                       _SAFE_TEXT, max_size=3) | st.none())  # fmt: skip
    gates = draw(
        st.lists(st.sampled_from(["a.io/x", "b.io/y"]), max_size=2, unique=True) | st.none()
    )
    return team_pod(*containers, init=init or None, annotations=annotations, gates=gates)


def _undo(out: dict[str, Any], claim: str) -> dict[str, Any]:
    """`out` with exactly §2's changes reverted: the original pod if nothing else changed."""
    pod = copy.deepcopy(out)
    pod["metadata"]["annotations"].pop(CLAIM_ANNOTATION)
    pod["spec"]["schedulingGates"].remove({"name": GATE_NAME})
    for fld in ("containers", "initContainers"):
        for c in pod["spec"].get(fld, []):
            for section in c.get("resources", {}).values():
                for k in [k for k in section if k.startswith("instaslice.io/mig-")]:
                    section["nvidia.com/mig-" + k.removeprefix("instaslice.io/mig-")] = section.pop(
                        k
                    )
            dev = f"instaslice.io/mig={NS}_{claim}_{c['name']}"
            if "env" in c:
                c["env"] = [e for e in c["env"] if e != {"name": VISIBLE_DEVICES_ENV, "value": dev}]
    return pod


def _normal(pod: dict[str, Any], s: AdmissionSettings) -> dict[str, Any]:
    """`pod` with the empty containers §2's additions leave behind once undone."""
    pod = copy.deepcopy(pod)
    pod["metadata"].setdefault("annotations", {})
    pod["spec"].setdefault("schedulingGates", [])
    for fld in ("containers", "initContainers"):
        for c in pod["spec"].get(fld, []):
            limits = c.get("resources", {}).get("limits", {})
            if s.binding_mode is BindingMode.ENV and any(k.startswith(MIG_PREFIX) for k in limits):
                c.setdefault("env", [])
    return pod


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(valid_pods(), st.sampled_from([ENV, PLUGIN]))
def test_patch_applies_and_changes_only_what_the_contract_says(
    pod: dict[str, Any], s: AdmissionSettings
) -> None:
    original = copy.deepcopy(pod)
    d = review(make_request(pod), s, new_claim=lambda: "cprop")
    assert pod == original  # the decision never mutates its input
    asks = [
        (c["name"], profile_from_resource(key), int(count))
        for fld in ("containers", "initContainers")
        for c in pod["spec"].get(fld, [])
        for key, count in c.get("resources", {}).get("limits", {}).items()
        if key.startswith(MIG_PREFIX)
    ]
    if not asks:
        assert d == Allowed("no MIG request")
        return
    assert isinstance(d, Patched), d
    out = jsonpatch.apply_patch(pod, d.patch)
    assert out["metadata"]["annotations"][CLAIM_ANNOTATION] == "cprop"
    assert [g for g in out["spec"]["schedulingGates"] if g == {"name": GATE_NAME}] == [
        {"name": GATE_NAME}
    ]
    assert pod_slice_requests(out) == asks
    assert [(a.container, a.profile, a.count) for a in d.asks] == asks
    for fld in ("containers", "initContainers"):
        for c in out["spec"].get(fld, []):
            for section in c.get("resources", {}).values():
                assert not [k for k in section if k.startswith("nvidia.com/mig-")]
            asking = any(a.container == c["name"] for a in d.asks)
            vis = [e for e in c.get("env") or [] if e["name"] == VISIBLE_DEVICES_ENV]
            if asking and s.binding_mode is BindingMode.ENV:
                assert vis == [
                    {
                        "name": VISIBLE_DEVICES_ENV,
                        "value": f"instaslice.io/mig={NS}_cprop_{c['name']}",
                    }
                ]
            else:
                assert vis == []
    assert _undo(out, "cprop") == _normal(original, s)
    # reviewing the result again: same shape under a fresh claim, never stacked
    d2 = review(make_request(out), s, new_claim=lambda: "cagain")
    assert isinstance(d2, Patched)
    again = jsonpatch.apply_patch(out, d2.patch)
    assert _undo(again, "cagain") == _undo(out, "cprop")
    assert d2.asks == d.asks


def test_resource_spellings_round_trip_for_every_catalog_profile() -> None:
    for p in _PROFILES:
        pod = team_pod(container("a", limits={nvidia_resource(p): "1"}))
        d, out = patched(pod)
        assert out["spec"]["containers"][0]["resources"]["limits"] == {instaslice_resource(p): "1"}
        assert d.asks == (SliceAsk("a", p, 1),)
