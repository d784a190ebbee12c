"""The real kube-apiserver calling InstaSlice's admission webhook over TLS (docs/contract.md §1-2).

Covers, with the shipped MutatingWebhookConfiguration (only clientConfig redirected to the
in-process server): a MIG pod in an opted-in namespace comes back rewritten, gated, claimed
and wired to its CDI device names (containers and initContainers); in a namespace that never
opted in it is unchanged and the webhook never sees it; pods without MIG requests never reach
the webhook (its own review counter proves it), nor do UPDATEs; opting a namespace in and out
by annotation takes effect within seconds; every invalid case of §2 is refused with its
message, 422 Invalid and a field-path cause per problem, and nothing is created; in a
namespace opted in to whole GPUs too, a refusal names the entry that judged it; a replayed
`--dry-run=server` output gets one gate and a fresh claim; pods made by the Deployment, Job
and StatefulSet controllers of kube-controller-manager are rewritten too; review latency
p50/p99 through the apiserver (printed, and bounded loosely).
Leaves out: the ValidatingAdmissionPolicy (test_admission_policy.py), what happens after
admission (allocator and node agent tests), the device-plugin binding mode (unit tests).
"""

from __future__ import annotations

import re
import statistics
import time
from typing import Any

import pytest
from structlog.testing import capture_logs

from common.constants import (
    CLAIM_ANNOTATION,
    ENABLED_KEY,
    GATE_NAME,
    NVIDIA_GPU,
    VISIBLE_DEVICES_ENV,
    WHOLE_GPU_KEY,
)
from common.kubeapi import ApiError, Kube, Obj, core_path, group_path
from testkit.builders import container, sidecar, user_pod
from tests.integration.webhook_fixtures import (
    MIG,
    Webhook,
    dry_run_create,
    is_rewritten,
    kube,
    mig_pod,
    opt_in,
    opted_in_namespace,
    strip_for_create,
    webhook,
    webhook_applies,
)
from tests.support import eventually
from webhook.metrics import LATENCY_BUCKETS

__all__ = ["kube", "webhook"]  # fixtures, imported for pytest
pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


@pytest.fixture
async def opted_in(kube: Kube, webhook: Webhook, namespace: str) -> str:
    return await opted_in_namespace(kube, namespace)


def _env(c: Obj) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in c.get("env") or []}


def assert_rewritten(pod: Obj, namespace: str) -> str:
    """§2 holds for `pod`; returns its claim."""
    claim = pod["metadata"]["annotations"][CLAIM_ANNOTATION]
    assert DNS_LABEL.match(claim), claim
    assert [g for g in pod["spec"]["schedulingGates"] if g["name"] == GATE_NAME] == [
        {"name": GATE_NAME}
    ]
    for c in pod["spec"]["containers"] + pod["spec"].get("initContainers", []):
        resources = c.get("resources") or {}
        keys = [k for section in resources.values() for k in section]
        assert not [k for k in keys if k.startswith("nvidia.com/mig-")], c
        if any(k.startswith("instaslice.io/mig-") for k in keys):
            device = f"instaslice.io/mig={namespace}_{claim}_{c['name']}"
            assert _env(c)[VISIBLE_DEVICES_ENV] == device
        else:
            assert VISIBLE_DEVICES_ENV not in _env(c)
    return str(claim)


# --- rewriting -------------------------------------------------------------------------------


async def test_mig_pod_in_opted_in_namespace_is_rewritten(
    kube: Kube, webhook: Webhook, opted_in: str
) -> None:
    before = webhook.reviews()
    pod = user_pod(
        container("train", limits={MIG: "2", "cpu": "1"}, requests={MIG: "2", "cpu": "500m"},
                  env=[{"name": "EPOCHS", "value": "3"}]),
        container("logger", limits={"cpu": "100m"}),
        init=[sidecar(container("warmup", limits={"nvidia.com/mig-2g.35gb": "1"}))],
    )  # fmt: skip
    created = await kube.create(core_path("pods", opted_in), pod)
    claim = assert_rewritten(created, opted_in)
    train, logger = created["spec"]["containers"]
    assert train["resources"]["limits"] == {"instaslice.io/mig-1g.18gb": "2", "cpu": "1"}
    assert train["resources"]["requests"] == {"instaslice.io/mig-1g.18gb": "2", "cpu": "500m"}
    assert train["env"] == [
        {"name": "EPOCHS", "value": "3"},
        {"name": VISIBLE_DEVICES_ENV, "value": f"instaslice.io/mig={opted_in}_{claim}_train"},
    ]
    assert VISIBLE_DEVICES_ENV not in _env(logger)
    warmup = created["spec"]["initContainers"][0]
    assert warmup["resources"]["limits"] == {"instaslice.io/mig-2g.35gb": "1"}
    assert _env(warmup)[VISIBLE_DEVICES_ENV] == f"instaslice.io/mig={opted_in}_{claim}_warmup"
    assert created["status"]["phase"] == "Pending"
    stored = await kube.get(core_path("pods", opted_in, created["metadata"]["name"]))
    assert stored["spec"] == created["spec"]
    assert webhook.reviews() == before + 1

    # another pod, another claim
    other = await kube.create(core_path("pods", opted_in), mig_pod())
    assert assert_rewritten(other, opted_in) != claim


async def test_namespace_that_never_opted_in_is_never_sent(
    kube: Kube, webhook: Webhook, namespace: str
) -> None:
    before = webhook.reviews()
    created = await kube.create(core_path("pods", namespace), mig_pod())
    assert not is_rewritten(created)
    assert created["spec"]["containers"][0]["resources"]["limits"] == {MIG: "1"}
    assert CLAIM_ANNOTATION not in (created["metadata"].get("annotations") or {})
    assert webhook.reviews() == before


async def test_pods_without_mig_requests_and_updates_never_reach_the_webhook(
    kube: Kube, webhook: Webhook, opted_in: str
) -> None:
    mig = await kube.create(core_path("pods", opted_in), mig_pod())
    before = webhook.reviews()
    plain = [
        user_pod(container("a", limits={"cpu": "1", "memory": "1Gi"})),
        user_pod(container("a", limits={"nvidia.com/gpu": "1"})),
        user_pod(container("a"), init=[container("i", limits={"cpu": "1"})]),
    ]
    for pod in plain:
        created = await kube.create(core_path("pods", opted_in), pod)
        assert not is_rewritten(created)
        assert CLAIM_ANNOTATION not in (created["metadata"].get("annotations") or {})
        for sent, got in zip(pod["spec"]["containers"], created["spec"]["containers"], strict=True):
            assert got["resources"].get("limits") == sent.get("resources", {}).get("limits")
            assert VISIBLE_DEVICES_ENV not in _env(got)
    name = mig["metadata"]["name"]
    await kube.patch(core_path("pods", opted_in, name), {"metadata": {"labels": {"x": "y"}}})
    assert webhook.reviews() == before  # not one call: matchConditions and rules filtered


async def test_opt_in_and_out_by_annotation_takes_effect_within_seconds(
    kube: Kube, webhook: Webhook, namespace: str
) -> None:
    ns_path = core_path("namespaces", name=namespace)
    assert not await webhook_applies(kube, namespace)
    await opt_in(kube, namespace)
    t0 = time.monotonic()
    await eventually(lambda: webhook_applies(kube, namespace), within=10)
    took_in = time.monotonic() - t0
    labels = (await kube.get(ns_path))["metadata"]["labels"]
    assert labels[ENABLED_KEY] == "true"

    await opt_in(kube, namespace, enabled=False)

    async def not_applied() -> bool:
        return not await webhook_applies(kube, namespace)

    t0 = time.monotonic()
    await eventually(not_applied, within=10)
    took_out = time.monotonic() - t0
    assert ENABLED_KEY not in ((await kube.get(ns_path))["metadata"].get("labels") or {})
    print(f"\nopt-in took {took_in:.2f}s, opt-out {took_out:.2f}s")
    assert took_in < 5 and took_out < 5

    # a label set by hand without the annotation is taken back: the annotation is the truth
    await kube.patch(ns_path, {"metadata": {"labels": {ENABLED_KEY: "true"}}})

    async def label_gone() -> bool:
        ns = await kube.get(ns_path)
        return ENABLED_KEY not in (ns["metadata"].get("labels") or {})

    await eventually(label_gone, within=10)


async def test_a_refusal_names_the_webhook_entry_that_judged_it(
    kube: Kube, webhook: Webhook, namespace: str
) -> None:
    """In a namespace opted in to whole GPUs too, a misspelt MIG profile is judged (and named)
    by mig.pods.instaslice.io, a whole-GPU ask by whole-gpu.pods.instaslice.io, and a pod the
    whole-GPU entry rewrote is not sent to the MIG entry (one gate, one claim)."""
    await kube.patch(core_path("namespaces", name=namespace), {"metadata": {"annotations": {
        ENABLED_KEY: "true", WHOLE_GPU_KEY: "true"}}})  # fmt: skip
    whole = user_pod(container("train", limits={NVIDIA_GPU: "1"}))

    async def whole_gpus_served() -> bool:
        try:
            return is_rewritten(await dry_run_create(kube, namespace, whole))
        except ApiError:
            return False

    await eventually(whole_gpus_served)
    cases = [
        (user_pod(container("m", limits={"nvidia.com/mig-5g.99gb": "1"})), "mig.pods"),
        (user_pod(container("m", limits={MIG: "1", NVIDIA_GPU: "1"})), "whole-gpu.pods"),
    ]
    for pod, entry in cases:
        with pytest.raises(ApiError) as exc:
            await kube.create(core_path("pods", namespace), pod)
        assert exc.value.status == 422, exc.value
        assert f'admission webhook "{entry}.instaslice.io" denied' in exc.value.message
    for pod in (whole, mig_pod()):
        out = await dry_run_create(kube, namespace, pod)
        assert out["spec"]["schedulingGates"] == [{"name": GATE_NAME}], out["spec"]
        assert CLAIM_ANNOTATION in out["metadata"]["annotations"]


# --- denials ---------------------------------------------------------------------------------

INVALID: list[tuple[str, Obj, list[str]]] = [
    ("unknown profile", user_pod(container("train", limits={"nvidia.com/mig-9g.99gb": "1"})),
     ['container "train"', "resources.limits[nvidia.com/mig-9g.99gb]",
      "unknown MIG profile 9g.99gb", "no GPU model in the catalog offers it"]),
    ("fractional count", user_pod(container("train", limits={MIG: "0.5"})),
     ['container "train"', f"resources.limits[{MIG}]", 'count "500m" is not a positive integer']),
    ("zero count", user_pod(container("train", limits={MIG: "0"})),
     ['container "train"', 'count "0" is not a positive integer']),
    ("negative count", user_pod(container("train", limits={MIG: "-1"})),
     ['container "train"', 'count "-1" is not a positive integer']),
    ("suffixed count", user_pod(container("train", limits={MIG: "1k"})),
     ['container "train"', 'count "1k" is not a positive integer']),
    ("requests differ", user_pod(container("train", limits={MIG: "1"}, requests={MIG: "2"})),
     ['container "train"', f"resources.requests[{MIG}]", "must equal limits"]),
    ("requests only", user_pod(container("train", requests={MIG: "1"})),
     ['container "train"', f"resources.requests[{MIG}]", "must also be in limits"]),
    ("node name set", mig_pod(node_name="gpu-0"),
     ["spec.nodeName", "must let InstaSlice choose its node"]),
    ("sets NVIDIA_VISIBLE_DEVICES", user_pod(container("train", limits={MIG: "1"}, env=[
        {"name": VISIBLE_DEVICES_ENV, "value": "all"}])),
     ['container "train"', f"{VISIBLE_DEVICES_ENV} (value)", "may not set it"]),
    ("NVIDIA_VISIBLE_DEVICES from a ConfigMap", user_pod(container("train", limits={MIG: "1"}, env=[
        {"name": VISIBLE_DEVICES_ENV, "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}
    ])),
     ['container "train"', f"{VISIBLE_DEVICES_ENV} (valueFrom)"]),
    ("names a device", user_pod(container("train", limits={MIG: "1"}), container("peek", env=[
        {"name": "DEV", "value": "instaslice.io/mig=other_cabc_train"}])),
     ['container "peek"', 'env[0] "DEV"', "names an instaslice.io/mig CDI device itself"]),
    ("CDI annotation", mig_pod(annotations={"cdi.k8s.io/gpu": "instaslice.io/mig=x_c_y"}),
     ["metadata.annotations[cdi.k8s.io/gpu]", "never by pod annotation"]),
    ("init container not a sidecar", mig_pod(init=[container("prep", limits={MIG: "1"})]),
     [f"spec.initContainers[0].resources.limits[{MIG}]", 'init container "prep" is not a sidecar',
      "held uncharged", "Move the ask to an app container", "restartPolicy: Always"]),
]  # fmt: skip


@pytest.mark.parametrize(("case", "pod", "words"), INVALID, ids=[c[0] for c in INVALID])
async def test_invalid_pods_are_refused_with_their_message(
    kube: Kube, webhook: Webhook, opted_in: str, case: str, pod: Obj, words: list[str]
) -> None:
    with pytest.raises(ApiError) as exc:
        await kube.create(core_path("pods", opted_in), pod)
    # the API server passes the webhook's status on: 422 Invalid (not 403, which users read
    # as RBAC), a cause naming the field path of each problem, as its own validation does
    assert (exc.value.status, exc.value.reason) == (422, "Invalid"), exc.value
    causes = exc.value.body["details"]["causes"]
    assert causes and all(c["field"].startswith(("spec.", "metadata.")) for c in causes), causes
    message = exc.value.message
    assert 'admission webhook "mig.pods.instaslice.io" denied the request' in message
    for w in words:
        assert w in message, (w, message)
    listing = await kube.list(core_path("pods", opted_in))
    assert not [p for p in listing["items"] if p["metadata"]["name"] == pod["metadata"]["name"]]


# --- re-admission ----------------------------------------------------------------------------


async def test_replayed_dry_run_output_gets_one_gate_and_a_fresh_claim(
    kube: Kube, webhook: Webhook, opted_in: str
) -> None:
    preview = await dry_run_create(kube, opted_in, mig_pod())
    first = assert_rewritten(preview, opted_in)
    created = await kube.create(core_path("pods", opted_in), strip_for_create(preview))
    second = assert_rewritten(created, opted_in)
    assert second != first
    copy_of_live = strip_for_create(created)
    copy_of_live["metadata"]["name"] += "-copy"
    third = assert_rewritten(await kube.create(core_path("pods", opted_in), copy_of_live), opted_in)
    assert third not in (first, second)


# --- pods made by controllers ------------------------------------------------------------------


def _template(app: str) -> Obj:
    pod = user_pod(
        container("train", limits={MIG: "1"}),
        init=[sidecar(container("prep", limits={"nvidia.com/mig-1g.18gb.me": "1"}))],
    )
    return {"metadata": {"labels": {"app": app}}, "spec": pod["spec"]}


async def _pods_of(kube: Kube, namespace: str, app: str, count: int) -> list[Obj]:
    pods: list[Obj] = []

    async def enough() -> bool:
        nonlocal pods
        listing = await kube.list(core_path("pods", namespace), labelSelector=f"app={app}")
        pods = listing["items"]
        return len(pods) >= count

    await eventually(enough, within=30)
    return pods


async def test_pods_of_deployments_jobs_and_statefulsets_are_rewritten(
    kube: Kube, webhook: Webhook, opted_in: str
) -> None:
    apps = "apps/v1"
    job = _template("job")
    job["spec"]["restartPolicy"] = "Never"
    objects: list[tuple[str, Obj, str, int]] = [
        (group_path(apps, "deployments", opted_in), {
            "apiVersion": apps, "kind": "Deployment", "metadata": {"name": "dep"},
            "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "dep"}},
                     "template": _template("dep")}}, "dep", 2),
        (group_path("batch/v1", "jobs", opted_in), {
            "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "job"},
            "spec": {"parallelism": 2, "completions": 2, "template": job}},
         "job", 2),
        (group_path(apps, "statefulsets", opted_in), {
            "apiVersion": apps, "kind": "StatefulSet", "metadata": {"name": "sts"},
            "spec": {"replicas": 2, "serviceName": "sts", "podManagementPolicy": "Parallel",
                     "selector": {"matchLabels": {"app": "sts"}}, "template": _template("sts")}},
         "sts", 2),
    ]  # fmt: skip
    for path, body, _, _ in objects:
        await kube.create(path, body)
    claims: set[str] = set()
    for path, body, app, count in objects:
        for pod in await _pods_of(kube, opted_in, app, count):
            claims.add(assert_rewritten(pod, opted_in))
            owner = pod["metadata"]["ownerReferences"][0]["kind"]
            assert owner in ("ReplicaSet", "Job", "StatefulSet")
        stored = await kube.get(f"{path}/{body['metadata']['name']}")
        template_limits = stored["spec"]["template"]["spec"]["containers"][0]["resources"]
        assert template_limits["limits"] == {MIG: "1"}  # templates are never touched
    assert len(claims) == 6


# --- latency ---------------------------------------------------------------------------------


def _quantile(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q * 100) - 1]


async def test_review_latency_through_the_apiserver(
    kube: Kube, webhook: Webhook, opted_in: str, namespace: str
) -> None:
    """N dry-run creates of a MIG pod, sequential: with the webhook (opted-in namespace) and,
    as the baseline, the same create the apiserver admits without calling it."""
    n = 300

    async def timed(ns: str, expect_rewritten: bool) -> list[float]:
        out: list[float] = []
        for _ in range(n):
            t = time.perf_counter()
            pod = await dry_run_create(kube, ns, mig_pod())
            out.append(time.perf_counter() - t)
            assert is_rewritten(pod) == expect_rewritten
        return out

    plain_ns = namespace + "-plain"
    await kube.create(core_path("namespaces"), {"metadata": {"name": plain_ns}})
    try:
        await timed(opted_in, True)  # warm connections and caches
        with capture_logs() as logs:  # the server logs each review with its own duration
            with_hook = await timed(opted_in, True)
        without = await timed(plain_ns, False)
    finally:
        await kube.delete_ignore_missing(core_path("namespaces", name=plain_ns))
    server_ms = [e["ms"] for e in logs if e.get("event") == "review"]
    assert len(server_ms) == n
    s50, s99 = _quantile(server_ms, 0.50), _quantile(server_ms, 0.99)
    bucket = {q: _server_quantile(webhook, q) for q in (0.5, 0.99)}
    p50, p99 = _quantile(with_hook, 0.50), _quantile(with_hook, 0.99)
    b50, b99 = _quantile(without, 0.50), _quantile(without, 0.99)
    print(
        f"\nreview latency over {n} sequential dry-run pod creates through kube-apiserver:\n"
        f"  with webhook    p50 {p50 * 1000:.2f} ms  p99 {p99 * 1000:.2f} ms\n"
        f"  without webhook p50 {b50 * 1000:.2f} ms  p99 {b99 * 1000:.2f} ms\n"
        f"  added by the webhook: p50 {(p50 - b50) * 1000:.2f} ms, "
        f"p99 {(p99 - b99) * 1000:.2f} ms\n"
        f"  server-side (request read to answer encoded): p50 {s50:.3f} ms  p99 {s99:.3f} ms\n"
        f"  server-side histogram bucket bounds: p50 <= {bucket[0.5] * 1000:.2f} ms, "
        f"p99 <= {bucket[0.99] * 1000:.2f} ms"
    )
    assert p99 < 1.0  # generous: the webhook's timeout is 5 s; numbers go to docs/webhook.md


def _server_quantile(webhook: Webhook, q: float) -> float:
    """Upper bound of the histogram bucket holding quantile `q` of patched reviews."""
    sample = webhook.metrics.registry.get_sample_value
    labels = {"outcome": "patched"}
    total = sample("instaslice_webhook_review_seconds_count", labels) or 0.0
    for bound in LATENCY_BUCKETS:
        le = sample("instaslice_webhook_review_seconds_bucket", {**labels, "le": str(float(bound))})
        if (le or 0.0) >= q * total:
            return bound
    return float("inf")
