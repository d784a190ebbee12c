"""The cluster-wide ValidatingAdmissionPolicy of CONTRACT.md §4, enforced by the real apiserver.

Installs manifests/base/policy as shipped (policy + binding, every namespace) and checks, in
namespaces that never opted in as well as in an opted-in one (pods rewritten by the real
webhook): a container's env may name only its own `instaslice.io/mig=<ns>_<claim>_<container>`
device (another pod's, another container's or an ephemeral container's naming is refused);
`cdi.k8s.io/` annotations may not name InstaSlice devices (create and update); a pod created
with a claim or `instaslice.io/mig-*` resources must carry the gate; only InstaSlice removes
the gate or changes the claim — InstaSlice being the ServiceAccount
`instaslice-system/instaslice-controller` or the group `instaslice:controllers` (client
certificates from the test CA carry both identities), while cluster-admin and an RBAC-empowered
user are refused; ordinary pods and ordinary updates are untouched.
Leaves out: env taken from ConfigMaps/Secrets/images (outside CEL's reach, docs/webhook.md).
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

import pytest

from common.constants import CLAIM_ANNOTATION, GATE_NAME, VISIBLE_DEVICES_ENV
from common.kubeapi import ApiError, Kube, Obj, core_path, group_path
from hack.cluster import ControlPlane
from tests.integration.webhook_fixtures import (
    ADMISSIONREG,
    MIG,
    Webhook,
    container,
    dry_run_create,
    eventually,
    is_rewritten,
    kube,
    load_manifest,
    make_pod,
    opted_in_namespace,
    webhook,
)

__all__ = ["kube", "webhook"]  # fixtures, imported for pytest
pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

RBAC = "rbac.authorization.k8s.io/v1"
ISL = "instaslice.io/mig-1g.18gb"
POLICY = "instaslice-pods"
POLICY_DENIED = f"ValidatingAdmissionPolicy '{POLICY}'"


def _device(ns: str, claim: str, c: str) -> str:
    return f"instaslice.io/mig={ns}_{claim}_{c}"


def _wired_pod(ns: str, claim: str, env_container: str = "main", gate: bool = True) -> Obj:
    """A pod as InstaSlice would leave it, built by hand (no webhook involved)."""
    env = [{"name": VISIBLE_DEVICES_ENV, "value": _device(ns, claim, env_container)}]
    return make_pod(
        container("main", limits={ISL: "1"}, env=env),
        annotations={CLAIM_ANNOTATION: claim},
        gates=[GATE_NAME] if gate else None,
    )


@pytest.fixture(scope="module")
async def policy(kube: Kube) -> AsyncIterator[None]:
    """The shipped policy and binding, installed and observed enforcing."""
    created: list[str] = []
    for doc in load_manifest("policy/validatingadmissionpolicy.yaml") + load_manifest(
        "policy/binding.yaml"
    ):
        kind = doc["kind"].lower()
        plural = kind[:-1] + "ies" if kind.endswith("y") else kind + "s"
        path = group_path(ADMISSIONREG, plural)
        await kube.create(path, doc)
        created.append(f"{path}/{doc['metadata']['name']}")
    probe = make_pod(container("main", env=[{"name": "X", "value": _device("x", "c", "y")}]))

    async def enforced() -> bool:
        try:
            await dry_run_create(kube, "default", probe)
        except ApiError as exc:
            return POLICY_DENIED in exc.message
        return False

    try:
        await eventually(enforced, timeout_s=30)
        # the apiserver type-checks every expression against the Pod schema: no warnings
        vap_path = group_path(ADMISSIONREG, "validatingadmissionpolicies", name=POLICY)
        vap: Obj = {}

        async def checked() -> bool:
            nonlocal vap
            vap = await kube.get(vap_path)
            return "typeChecking" in vap.get("status", {})

        await eventually(checked, timeout_s=30)
        assert not vap["status"]["typeChecking"].get("expressionWarnings"), vap["status"]
        yield
    finally:
        for path in reversed(created):
            await kube.delete_ignore_missing(path)


async def _identity(cp: ControlPlane, kube: Kube, user: str, groups: tuple[str, ...] = ()) -> Kube:
    """A client as `user` (in `groups`), allowed by RBAC to create and update pods."""
    name = f"instaslice-it-{secrets.token_hex(3)}"
    await kube.create(
        group_path(RBAC, "clusterrolebindings"),
        {
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": "instaslice-it-pod-editor"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
        },
    )  # fmt: skip
    path = cp.user_kubeconfig(user, groups)
    return await Kube.connect(str(path))


@pytest.fixture(scope="module")
async def users(control_plane: ControlPlane, kube: Kube) -> AsyncIterator[dict[str, Kube]]:
    role = {
        "metadata": {"name": "instaslice-it-pod-editor"},
        "rules": [
            {"apiGroups": [""], "resources": ["pods", "pods/ephemeralcontainers"],
             "verbs": ["get", "list", "create", "update", "patch"]},
        ],
    }  # fmt: skip
    await kube.create(group_path(RBAC, "clusterroles"), role)
    clients = {
        "mallory": await _identity(control_plane, kube, "mallory"),
        "allocator": await _identity(
            control_plane, kube, "instaslice-allocator-it", ("instaslice:controllers",)
        ),
        "serviceaccount": await _identity(
            control_plane,
            kube,
            "system:serviceaccount:instaslice-system:instaslice-controller",
            ("system:serviceaccounts", "system:serviceaccounts:instaslice-system"),
        ),
    }
    try:
        yield clients
    finally:
        for c in clients.values():
            await c.close()
        bindings = await kube.list(group_path(RBAC, "clusterrolebindings"))
        for b in bindings["items"]:
            if b["roleRef"]["name"] == "instaslice-it-pod-editor":
                await kube.delete_ignore_missing(
                    group_path(RBAC, "clusterrolebindings", name=b["metadata"]["name"])
                )
        await kube.delete_ignore_missing(
            group_path(RBAC, "clusterroles", name="instaslice-it-pod-editor")
        )


async def _refused(call: object, *words: str) -> str:
    with pytest.raises(ApiError) as exc:
        await call  # type: ignore[misc]
    assert exc.value.status in (403, 422), exc.value
    assert POLICY_DENIED in exc.value.message, exc.value.message
    for w in words:
        assert w in exc.value.message, (w, exc.value.message)
    return exc.value.message


# --- device names ----------------------------------------------------------------------------


async def test_env_may_name_only_the_containers_own_device(
    kube: Kube, policy: None, namespace: str
) -> None:
    pods = core_path("pods", namespace)
    ok = await kube.create(pods, _wired_pod(namespace, "cmine"))
    assert ok["spec"]["containers"][0]["env"][0]["value"] == _device(namespace, "cmine", "main")
    # another pod's device (other namespace), another container's, no claim at all
    victim = _wired_pod(namespace, "cmine")
    victim["spec"]["containers"][0]["env"][0]["value"] = _device("team-b", "cvictim", "main")
    await _refused(kube.create(pods, victim), "containers main:", "not their own")
    await _refused(kube.create(pods, _wired_pod(namespace, "cmine", env_container="other")))
    other_claim = _wired_pod(namespace, "cmine")
    other_claim["metadata"]["annotations"][CLAIM_ANNOTATION] = "cother"
    await _refused(kube.create(pods, other_claim))
    no_claim = make_pod(
        container("main", env=[{"name": "GPU", "value": _device(namespace, "c", "main")}]),
        container("side"),
    )
    await _refused(kube.create(pods, no_claim), "containers main:")
    init = make_pod(
        container("main"),
        init=[container("prep", env=[{"name": "D", "value": _device(namespace, "c1", "x")}])],
    )
    await _refused(kube.create(pods, init), "containers prep:")


async def test_refused_in_default_namespace_too(kube: Kube, policy: None) -> None:
    env = [{"name": VISIBLE_DEVICES_ENV, "value": _device("a", "c", "main")}]
    pod = make_pod(container("main", env=env))
    await _refused(dry_run_create(kube, "default", pod))


async def test_ephemeral_containers_may_name_no_device(
    kube: Kube, policy: None, namespace: str
) -> None:
    pod = await kube.create(core_path("pods", namespace), make_pod(container("main")))
    name = pod["metadata"]["name"]
    debug = {
        "name": "debug",
        "image": "busybox",
        "env": [{"name": VISIBLE_DEVICES_ENV, "value": _device(namespace, "c", "debug")}],
    }
    patch = [{"op": "add", "path": "/spec/ephemeralContainers", "value": [debug]}]
    path = core_path("pods", namespace, name) + "/ephemeralcontainers"
    await _refused(kube.patch(path, patch, "json"), "ephemeral containers never get MIG slices")
    debug["env"] = [{"name": "X", "value": "1"}]
    await kube.patch(path, patch, "json")  # an ordinary debug container is fine


async def test_cdi_annotations_may_not_name_instaslice_devices(
    kube: Kube, policy: None, namespace: str
) -> None:
    pods = core_path("pods", namespace)
    annotated = make_pod(
        container("main"), annotations={"cdi.k8s.io/gpu": _device(namespace, "c", "main")}
    )
    await _refused(kube.create(pods, annotated), "cdi.k8s.io/")
    pod = await kube.create(
        pods, make_pod(container("main"), annotations={"cdi.k8s.io/x": "v/a=b"})
    )
    patch = {"metadata": {"annotations": {"cdi.k8s.io/x": _device(namespace, "c", "main")}}}
    await _refused(kube.patch(core_path("pods", namespace, pod["metadata"]["name"]), patch))


async def test_instaslice_marks_need_the_gate_on_create(
    kube: Kube, policy: None, namespace: str
) -> None:
    pods = core_path("pods", namespace)
    await _refused(kube.create(pods, make_pod(container("main", limits={ISL: "1"}))), "gate")
    claimed = make_pod(container("main"), annotations={CLAIM_ANNOTATION: "cabc"})
    await _refused(kube.create(pods, claimed), "gate")
    await _refused(kube.create(pods, _wired_pod(namespace, "cmine", gate=False)), "gate")
    # what users write outside opted-in namespaces is none of the policy's business
    plain = await kube.create(pods, make_pod(container("main", limits={MIG: "1"})))
    assert not is_rewritten(plain)


# --- gate and claim: only InstaSlice ----------------------------------------------------------


async def test_only_instaslice_removes_the_gate_or_changes_the_claim(
    kube: Kube, webhook: Webhook, policy: None, users: dict[str, Kube], namespace: str
) -> None:
    ns = await opted_in_namespace(kube, namespace)
    mallory, allocator, sa = users["mallory"], users["allocator"], users["serviceaccount"]

    async def gated_pod() -> str:
        asking = make_pod(container("main", limits={MIG: "1"}))
        pod = await mallory.create(core_path("pods", ns), asking)
        assert is_rewritten(pod)
        return str(pod["metadata"]["name"])

    ungate = [{"op": "remove", "path": "/spec/schedulingGates/0"}]
    name = await gated_pod()
    path = core_path("pods", ns, name)
    for who in (mallory, kube):  # a user with RBAC rights, and cluster-admin
        await _refused(who.patch(path, ungate, "json"), "only InstaSlice may remove", "gate")
        # (the env rule refuses this too: the container's device names the old claim)
        await _refused(
            who.patch(path, {"metadata": {"annotations": {CLAIM_ANNOTATION: "cstolen"}}})
        )
        await _refused(who.patch(path, {"metadata": {"annotations": {CLAIM_ANNOTATION: None}}}))
    # ordinary updates of a gated pod are fine
    await mallory.patch(path, {"metadata": {"labels": {"team": "a"}}})
    # InstaSlice, by group (client certificate) and by ServiceAccount name
    done = await allocator.patch(path, ungate, "json")
    assert not done["spec"].get("schedulingGates")
    name2 = await gated_pod()
    await sa.patch(core_path("pods", ns, name2), ungate, "json")


async def test_gate_and_claim_are_guarded_in_namespaces_that_never_opted_in(
    kube: Kube, policy: None, users: dict[str, Kube], namespace: str
) -> None:
    mallory, allocator = users["mallory"], users["allocator"]
    pod = await kube.create(core_path("pods", namespace), _wired_pod(namespace, "cmine"))
    path = core_path("pods", namespace, pod["metadata"]["name"])
    ungate = [{"op": "remove", "path": "/spec/schedulingGates/0"}]
    await _refused(mallory.patch(path, ungate, "json"), "only InstaSlice may remove")
    # a device-plugin-mode pod (no env names its device): only the claim rule speaks
    bare = _wired_pod(namespace, "cbare")
    del bare["spec"]["containers"][0]["env"]
    created = await kube.create(core_path("pods", namespace), bare)
    bare_path = core_path("pods", namespace, created["metadata"]["name"])
    for claim in ("cx", None):
        await _refused(
            mallory.patch(bare_path, {"metadata": {"annotations": {CLAIM_ANNOTATION: claim}}}),
            "only InstaSlice may set or change it",
        )
    await allocator.patch(bare_path, {"metadata": {"annotations": {CLAIM_ANNOTATION: "cnew"}}})
    await allocator.patch(bare_path, ungate, "json")
    plain = await mallory.create(core_path("pods", namespace), make_pod(container("main")))
    plain_path = core_path("pods", namespace, plain["metadata"]["name"])
    await _refused(
        mallory.patch(plain_path, {"metadata": {"annotations": {CLAIM_ANNOTATION: "cmine"}}})
    )
    await mallory.patch(plain_path, {"metadata": {"labels": {"ok": "yes"}}})


async def test_controller_made_pods_pass_webhook_and_policy(
    kube: Kube, webhook: Webhook, policy: None, namespace: str
) -> None:
    """The policy must not stand in the way of what the webhook produces for controllers."""
    ns = await opted_in_namespace(kube, namespace)
    pod = make_pod(
        container("main", limits={MIG: "1"}), init=[container("prep", limits={MIG: "1"})]
    )
    spec = {**pod["spec"], "restartPolicy": "Never"}
    template = {"metadata": {"labels": {"app": "job"}}, "spec": spec}
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "job"},
           "spec": {"parallelism": 2, "completions": 2, "template": template}}  # fmt: skip
    await kube.create(group_path("batch/v1", "jobs", ns), job)
    pods: list[Obj] = []

    async def both() -> bool:
        nonlocal pods
        pods = (await kube.list(core_path("pods", ns), labelSelector="app=job"))["items"]
        return len(pods) == 2

    await eventually(both, timeout_s=30)
    assert all(is_rewritten(p) for p in pods)
