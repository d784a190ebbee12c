"""The cluster-wide ValidatingAdmissionPolicies of docs/contract.md §4, enforced by the real
apiserver.

Installs manifests/base/policy as shipped (the pod policy, the policies confining InstaSlice's
controller identity, their bindings) and checks, in namespaces that never opted in as well as
in opted-in ones (pods rewritten by the real webhook): a container's env may name only its
own `instaslice.io/mig=<ns>_<claim>_<container>` device (another pod's, another container's or
an ephemeral container's naming is refused); `cdi.k8s.io/` annotations may not name InstaSlice
devices (create and update); a pod created with a claim or `instaslice.io/*` resources must
carry the gate; a pod created with any of InstaSlice's marks must be in an opted-in namespace;
an init container that is not a sidecar asks for no `instaslice.io/*` resource on create;
NVIDIA_VISIBLE_DEVICES in a spec selects nothing but the container's own device (`all`,
indexes, UUIDs, other CDI names, valueFrom refused, in every container kind); only InstaSlice
removes the gate or changes the claim, through the pod or its status subresource —
InstaSlice being the ServiceAccount `instaslice-system/instaslice-controller` or the group
`instaslice:controllers` (client certificates from the test CA carry both identities), while
cluster-admin and an RBAC-empowered user are refused (403 Forbidden, while content rules
answer 422 Invalid); and InstaSlice itself only pins and
ungates gated pods (containers, tolerations, labels, annotations unchanged), deletes only pods
with a claim, creates none, and changes only the opt-in label of a namespace, to what its
annotation says — the real namespace mirror working under exactly that is
test_rbac.py's. Ordinary pods and ordinary updates are untouched.
Leaves out: env taken from ConfigMaps/Secrets/images (outside CEL's reach, docs/security.md);
system namespaces and the node agent's identity (test_rbac.py).
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

import pytest

from common.constants import (
    CLAIM_ANNOTATION,
    ENABLED_KEY,
    GATE_NAME,
    SCALE_UP_LABEL,
    VISIBLE_DEVICES_ENV,
    WHOLE_GPU_KEY,
)
from common.kubeapi import ApiError, Kube, Obj, core_path, group_path
from hack.cluster import ControlPlane
from testkit.builders import container, sidecar, user_pod
from tests.integration.webhook_fixtures import (
    ADMISSIONREG,
    MIG,
    Webhook,
    dry_run_create,
    is_rewritten,
    kube,
    load_manifest,
    opted_in_namespace,
    webhook,
)
from tests.support import eventually, wait_admission_sees_opt_in
from webhook.allocator import pods as podlib
from webhook.allocator.autoscale import placeholder_pod

__all__ = ["kube", "webhook"]  # fixtures, imported for pytest
pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

RBAC = "rbac.authorization.k8s.io/v1"
ISL = "instaslice.io/mig-1g.18gb"
POLICY = "instaslice-pods"
POLICY_DENIED = f"ValidatingAdmissionPolicy '{POLICY}'"
CONTROLLER_PODS = "ValidatingAdmissionPolicy 'instaslice-controller-pods'"
CONTROLLER_NAMESPACES = "ValidatingAdmissionPolicy 'instaslice-controller-namespaces'"
CONTROLLER_LEASES = "ValidatingAdmissionPolicy 'instaslice-controller-leases'"
NOT_OPTED_IN = "may only be created in a namespace that opted in"
NOT_WHOLE = "may only be created in a namespace that opted in to whole GPUs"
LABEL_GUARDED = "only InstaSlice may set, change or remove it"
SELF_SELECTING = "NVIDIA_VISIBLE_DEVICES may"


def _device(ns: str, claim: str, c: str) -> str:
    return f"instaslice.io/mig={ns}_{claim}_{c}"


def _wired_pod(
    ns: str, claim: str, env_container: str = "main", gate: bool = True, asks: bool = True
) -> Obj:
    """A pod as InstaSlice would leave it, built by hand (no webhook involved). `asks=False`
    leaves out the instaslice.io/mig-* resource, so that the webhook configuration (if a test
    of this module installed it) never sees the pod and only the policies speak."""
    env = [{"name": VISIBLE_DEVICES_ENV, "value": _device(ns, claim, env_container)}]
    return user_pod(
        container("main", limits={ISL: "1"} if asks else None, env=env),
        annotations={CLAIM_ANNOTATION: claim},
        gates=[GATE_NAME] if gate else None,
    )


async def _opt_in(kube: Kube, ns: str) -> str:
    """Opt `ns` in as the namespace mirror would leave it: annotation and label at once (the
    mirror, if running, then has nothing to change)."""
    enabled = {ENABLED_KEY: "true"}
    body = {"metadata": {"annotations": enabled, "labels": enabled}}
    await kube.patch(core_path("namespaces", name=ns), body)
    # the policies read the namespace from the API server's cache
    gated = user_pod(container("main"), gates=[GATE_NAME])
    await wait_admission_sees_opt_in(kube, ns, gated, refused_until=NOT_OPTED_IN)
    return ns


@pytest.fixture(scope="module")
async def policy(kube: Kube) -> AsyncIterator[None]:
    """The shipped policy and binding, installed and observed enforcing."""
    created: list[str] = []
    docs = load_manifest("policy/validatingadmissionpolicy.yaml") + load_manifest(
        "policy/binding.yaml"
    )
    for doc in docs + load_manifest("policy/instaslice-controller.yaml"):
        kind = doc["kind"].lower()
        plural = kind[:-1] + "ies" if kind.endswith("y") else kind + "s"
        path = group_path(ADMISSIONREG, plural)
        await kube.create(path, doc)
        created.append(f"{path}/{doc['metadata']['name']}")
    probe = user_pod(container("main", env=[{"name": "X", "value": _device("x", "c", "y")}]))

    async def enforced() -> bool:
        try:
            await dry_run_create(kube, "default", probe)
        except ApiError as exc:
            return POLICY_DENIED in exc.message
        return False

    try:
        await eventually(enforced, within=30)
        # the apiserver type-checks every expression against the schemas: no warnings
        for name in (POLICY, "instaslice-controller-pods", "instaslice-controller-namespaces"):
            vap_path = group_path(ADMISSIONREG, "validatingadmissionpolicies", name=name)
            vap: Obj = {}

            async def checked(path: str = vap_path) -> bool:
                nonlocal vap
                vap = await kube.get(path)
                return "typeChecking" in vap.get("status", {})

            await eventually(checked, within=30)
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
            {"apiGroups": [""], "resources": ["pods", "pods/ephemeralcontainers", "pods/status"],
             "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]},
            {"apiGroups": [""], "resources": ["pods/eviction", "pods/binding"],
             "verbs": ["create"]},
            {"apiGroups": [""], "resources": ["namespaces"],
             "verbs": ["get", "list", "watch", "patch", "update"]},
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
             "verbs": ["get", "create", "delete"]},
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
    # who may write (only InstaSlice): 403 Forbidden; the pod's content, whoever writes it:
    # 422 Invalid, as the API server's own validation (the policy's `reason` per validation)
    who = "only InstaSlice may" in exc.value.message
    assert (exc.value.status, exc.value.reason) == (
        (403, "Forbidden") if who else (422, "Invalid")
    ), exc.value
    assert POLICY_DENIED in exc.value.message, exc.value.message
    for w in words:
        assert w in exc.value.message, (w, exc.value.message)
    return exc.value.message


# --- device names ----------------------------------------------------------------------------


async def test_env_may_name_only_the_containers_own_device(
    kube: Kube, policy: None, namespace: str
) -> None:
    await _opt_in(kube, namespace)  # marks are refused elsewhere (test further down)
    pods = core_path("pods", namespace)
    ok = await kube.create(pods, _wired_pod(namespace, "cmine", asks=False))
    assert ok["spec"]["containers"][0]["env"][0]["value"] == _device(namespace, "cmine", "main")
    # another pod's device (other namespace), another container's, no claim at all
    victim = _wired_pod(namespace, "cmine", asks=False)
    victim["spec"]["containers"][0]["env"][0]["value"] = _device("team-b", "cvictim", "main")
    await _refused(kube.create(pods, victim), "containers main:", "not their own")
    await _refused(
        kube.create(pods, _wired_pod(namespace, "cmine", env_container="other", asks=False))
    )
    other_claim = _wired_pod(namespace, "cmine", asks=False)
    other_claim["metadata"]["annotations"][CLAIM_ANNOTATION] = "cother"
    await _refused(kube.create(pods, other_claim))
    no_claim = user_pod(
        container("main", env=[{"name": "GPU", "value": _device(namespace, "c", "main")}]),
        container("side"),
    )
    await _refused(kube.create(pods, no_claim), "containers main:")
    init = user_pod(
        container("main"),
        init=[container("prep", env=[{"name": "D", "value": _device(namespace, "c1", "x")}])],
    )
    await _refused(kube.create(pods, init), "containers prep:")


async def test_refused_in_default_namespace_too(kube: Kube, policy: None) -> None:
    env = [{"name": VISIBLE_DEVICES_ENV, "value": _device("a", "c", "main")}]
    pod = user_pod(container("main", env=env))
    await _refused(dry_run_create(kube, "default", pod))


async def test_ephemeral_containers_may_name_no_device(
    kube: Kube, policy: None, namespace: str
) -> None:
    pod = await kube.create(core_path("pods", namespace), user_pod(container("main")))
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
    annotated = user_pod(
        container("main"), annotations={"cdi.k8s.io/gpu": _device(namespace, "c", "main")}
    )
    await _refused(kube.create(pods, annotated), "cdi.k8s.io/")
    pod = await kube.create(
        pods, user_pod(container("main"), annotations={"cdi.k8s.io/x": "v/a=b"})
    )
    patch = {"metadata": {"annotations": {"cdi.k8s.io/x": _device(namespace, "c", "main")}}}
    await _refused(kube.patch(core_path("pods", namespace, pod["metadata"]["name"]), patch))


async def test_instaslice_marks_need_the_gate_on_create(
    kube: Kube, policy: None, namespace: str
) -> None:
    pods = core_path("pods", namespace)
    await _refused(kube.create(pods, user_pod(container("main", limits={ISL: "1"}))), "gate")
    claimed = user_pod(container("main"), annotations={CLAIM_ANNOTATION: "cabc"})
    await _refused(kube.create(pods, claimed), "gate")
    await _refused(kube.create(pods, _wired_pod(namespace, "cmine", gate=False)), "gate")
    whole_gpu = user_pod(container("main", limits={"instaslice.io/gpu": "1"}))
    await _refused(kube.create(pods, whole_gpu), "gate")
    # what users write outside opted-in namespaces is none of the policy's business
    plain = await kube.create(pods, user_pod(container("main", limits={MIG: "1"})))
    assert not is_rewritten(plain)


async def test_an_init_container_that_is_not_a_sidecar_may_not_ask_on_create(
    kube: Kube, policy: None, namespace: str
) -> None:
    """Rule 8: its slices would be held as long as the pod lives, while quota, scheduler
    and Kueue charge only the largest init container's ask. Refused in every namespace:
    opted in (the rewritten form written by hand — gate, claim, an `instaslice.io/*`
    resource the webhook configuration never sends — as a pod that skipped the webhook
    would be), never opted in, kube-system; the same pod with the init container a sidecar
    (restartPolicy: Always) passes."""
    ns = await _opt_in(kube, namespace)

    def pod(resource: str = "instaslice.io/gpu", *, is_sidecar: bool = False) -> Obj:
        prep = container("prep", limits={resource: "1", "cpu": "100m"})
        return user_pod(
            container("main"), init=[sidecar(prep) if is_sidecar else prep], gates=[GATE_NAME],
            annotations={CLAIM_ANNOTATION: "cmine"},
        )  # fmt: skip

    words = ("initContainers prep:", "not a sidecar", "only the ask of its largest init",
             "restartPolicy: Always")  # fmt: skip
    await _refused(kube.create(core_path("pods", ns), pod(), dryRun="All"), *words)
    slots = pod("instaslice.io/memory-slots")
    await _refused(kube.create(core_path("pods", ns), slots, dryRun="All"), *words)
    # (a sidecar asking whole GPUs needs the whole-GPU opt-in too: rule 10)
    await kube.create(core_path("pods", ns), pod(ISL, is_sidecar=True), dryRun="All")
    elsewhere = pod(ISL)
    for other in ("kube-system", "default"):  # never opted in: rule 8 is checked first
        await _refused(kube.create(core_path("pods", other), elsewhere, dryRun="All"), *words)


# --- gate and claim: only InstaSlice ----------------------------------------------------------


async def test_only_instaslice_removes_the_gate_or_changes_the_claim(
    kube: Kube, webhook: Webhook, policy: None, users: dict[str, Kube], namespace: str
) -> None:
    ns = await opted_in_namespace(kube, namespace)
    mallory, allocator, sa = users["mallory"], users["allocator"], users["serviceaccount"]

    async def gated_pod() -> str:
        asking = user_pod(container("main", limits={MIG: "1"}))
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


async def test_gate_and_claim_are_guarded_after_the_namespace_opted_out(
    kube: Kube, policy: None, users: dict[str, Kube], namespace: str
) -> None:
    """InstaSlice's pods exist only where the namespace opted in: these two were made while
    it was; then it opted out (annotation and label gone). The guards still hold, for the
    pod and for its status subresource (issue 17 item 10)."""
    mallory, allocator = users["mallory"], users["allocator"]
    await _opt_in(kube, namespace)
    pods = core_path("pods", namespace)
    pod = await kube.create(pods, _wired_pod(namespace, "cmine", asks=False))
    # a device-plugin-mode pod (no env names its device): only the claim rule speaks
    bare = _wired_pod(namespace, "cbare", asks=False)
    del bare["spec"]["containers"][0]["env"]
    created = await kube.create(pods, bare)
    off = {ENABLED_KEY: None}
    await kube.patch(
        core_path("namespaces", name=namespace), {"metadata": {"annotations": off, "labels": off}}
    )
    path = core_path("pods", namespace, pod["metadata"]["name"])
    bare_path = core_path("pods", namespace, created["metadata"]["name"])
    ungate = [{"op": "remove", "path": "/spec/schedulingGates/0"}]
    await _refused(mallory.patch(path, ungate, "json"), "only InstaSlice may remove")
    for claim in ("cx", None):
        await _refused(
            mallory.patch(bare_path, {"metadata": {"annotations": {CLAIM_ANNOTATION: claim}}}),
            "only InstaSlice may set or change it",
        )
        await _refused(
            mallory.patch(
                bare_path + "/status", {"metadata": {"annotations": {CLAIM_ANNOTATION: claim}}}
            ),
            "only InstaSlice may set or change it",
        )
    await mallory.patch(bare_path + "/status", {"metadata": {"labels": {"ok": "yes"}}})
    # InstaSlice itself never changes a claim either (instaslice-controller-pods)
    await _controller_policies_enforced(kube, allocator, namespace)
    with pytest.raises(ApiError) as exc:
        await allocator.patch(bare_path, {"metadata": {"annotations": {CLAIM_ANNOTATION: "cx"}}})
    assert CONTROLLER_PODS in exc.value.message and "the claim included" in exc.value.message
    await allocator.patch(bare_path, ungate, "json")
    plain = await mallory.create(pods, user_pod(container("main")))
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
    pod = user_pod(
        container("main", limits={MIG: "1"}), init=[sidecar(container("prep", limits={MIG: "1"}))]
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

    await eventually(both, within=30)
    assert all(is_rewritten(p) for p in pods)


# --- what the policy skips (matchConditions, issue 25) ----------------------------------------


async def test_updates_that_change_nothing_guarded_are_not_evaluated(
    kube: Kube, policy: None, users: dict[str, Kube], namespace: str
) -> None:
    """An UPDATE (of the pod or its status) that changes no annotation, of a pod that does
    not carry InstaSlice's gate, cannot change anything the policy guards: env and
    ephemeral containers cannot change through it, gates can only be removed, status writes
    keep the spec. The policy's matchConditions skip those (kubelets' status writes, most of
    a cluster's pod writes). Shown on a pod written while the policy was unbound (a pod from
    before InstaSlice): its env names another pod's device and a CDI annotation names one
    too. Its status and label updates go through; any annotation change is still checked,
    and refused."""
    mallory = users["mallory"]
    binding_path = group_path(ADMISSIONREG, "validatingadmissionpolicybindings", name=POLICY)
    binding = await kube.get(binding_path)
    foreign = _device("team-b", "cvictim", "main")
    probe = user_pod(container("main", env=[{"name": "X", "value": foreign}]))

    async def enforced(want: bool) -> bool:
        try:
            await dry_run_create(kube, namespace, probe)
        except ApiError as exc:
            return want and POLICY_DENIED in exc.message
        return not want

    await kube.delete(binding_path)
    try:
        await eventually(lambda: enforced(False), within=30)
        old = user_pod(
            container("main", env=[{"name": "D", "value": foreign}]),
            annotations={"cdi.k8s.io/gpu": foreign},
        )
        pod = await kube.create(core_path("pods", namespace), old)
    finally:
        meta = binding["metadata"]
        binding["metadata"] = {"name": meta["name"], "labels": meta.get("labels", {})}
        await kube.create(group_path(ADMISSIONREG, "validatingadmissionpolicybindings"), binding)
    await eventually(lambda: enforced(True), within=30)
    path = core_path("pods", namespace, pod["metadata"]["name"])
    cond = {"type": "Ready", "status": "False", "lastTransitionTime": "2026-12-02T00:00:00Z"}
    await mallory.patch(path + "/status", {"status": {"conditions": [cond]}})
    await mallory.patch(path, {"metadata": {"labels": {"team": "a"}}})
    await mallory.patch(path + "/status", {"metadata": {"labels": {"team": "b"}}})
    # a change of the placeholder label: evaluated, and refused (the first rule broken
    # speaks, as for annotations below)
    for sub, words in (("", "not their own"), ("/status", "cdi.k8s.io/")):
        await _refused(
            mallory.patch(path + sub, {"metadata": {"labels": {SCALE_UP_LABEL: "x"}}}), words
        )
    # an annotation change: evaluated, and refused as before (the first rule broken speaks:
    # the env rule on the pod, the CDI annotation rule on its status, which env rules skip)
    for sub, words in (("", "not their own"), ("/status", "cdi.k8s.io/")):
        await _refused(
            mallory.patch(path + sub, {"metadata": {"annotations": {"note": "x"}}}), words
        )
    # a plain pod: an annotation written through its status is checked too
    plain = await kube.create(core_path("pods", namespace), user_pod(container("main")))
    plain_status = core_path("pods", namespace, plain["metadata"]["name"]) + "/status"
    await _refused(
        mallory.patch(plain_status, {"metadata": {"annotations": {"cdi.k8s.io/x": foreign}}}),
        "cdi.k8s.io/",
    )
    await _refused(
        mallory.patch(plain_status, {"metadata": {"annotations": {CLAIM_ANNOTATION: "cmine"}}}),
        "only InstaSlice may set or change it",
    )
    await mallory.patch(plain_status, {"status": {"conditions": [cond]}})


def _env(*pairs: tuple[str, str]) -> list[Obj]:
    return [{"name": n, "value": v} for n, v in pairs]


def _from_secret(name: str) -> Obj:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}


async def test_a_create_is_checked_wherever_a_mark_hides(
    kube: Kube, policy: None, namespace: str
) -> None:
    """A create is evaluated only when it carries something a rule looks at (matchConditions,
    issue 25), and env is walked once for both env rules before the offenders are listed:
    a mark that only an init container carries, or a later container, or a later env entry,
    or an annotation among others, is still refused, with the offending container named."""
    device = _device(namespace, "c1", "side")
    no_env = container("empty")
    no_env["env"] = []
    cases: dict[str, tuple[Obj, tuple[str, ...]]] = {
        "a slice asked by a sidecar only": (
            user_pod(container("main"), init=[sidecar(container("prep", limits={ISL: "1"}))]),
            ("gate",),
        ),
        "a slice asked by an init container that is not a sidecar": (
            user_pod(
                container("main"), init=[container("x"), container("prep", limits={ISL: "1"})]
            ),
            ("initContainers prep:", "not a sidecar"),
        ),
        "a device in a later container's later env entry": (
            user_pod(
                container("main", env=_env(("A", "1"))),
                no_env,
                container("side", env=_env(("X", "1"), ("D", device))),
            ),
            ("containers side:", "not their own"),
        ),
        "NVIDIA_VISIBLE_DEVICES from a Secret, in an init container": (
            user_pod(
                container("main"),
                init=[
                    container("prep", env=[_from_secret("X"), _from_secret(VISIBLE_DEVICES_ENV)])
                ],
            ),
            ("containers prep:", SELF_SELECTING),
        ),
        "a claim among other annotations": (
            user_pod(container("main"), annotations={"team": "a", CLAIM_ANNOTATION: "c1"}),
            ("gate",),
        ),
        "a CDI annotation among others": (
            user_pod(container("main"), annotations={"team": "a", "cdi.k8s.io/x": device}),
            ("cdi.k8s.io/",),
        ),
        "every offending container, in order": (
            user_pod(
                container("main", env=_env((VISIBLE_DEVICES_ENV, "all"))),
                container("ok", env=_env((VISIBLE_DEVICES_ENV, "void"))),
                no_env,
                container("side", env=_env(("X", "1"), (VISIBLE_DEVICES_ENV, "0"))),
            ),
            ("containers main, side:", SELF_SELECTING),
        ),
        "every container naming a device": (
            user_pod(
                container("main", env=_env(("D", device))),
                container("side", env=_env(("D", device))),
            ),
            ("containers main, side:", "not their own"),
        ),
    }
    pods = core_path("pods", namespace)
    for what, (pod, words) in cases.items():
        with pytest.raises(ApiError) as exc:
            await kube.create(pods, pod, dryRun="All")
        assert POLICY_DENIED in exc.value.message, (what, exc.value.message)
        assert all(w in exc.value.message for w in words), (what, exc.value.message)


async def test_a_create_without_marks_passes_however_busy(
    kube: Kube, policy: None, namespace: str
) -> None:
    """What the create-time matchCondition lets through unevaluated breaks no rule: many
    env entries (values from fields and Secrets, empty ones, text that mentions InstaSlice
    without naming a device), annotations, init containers, other extended resources."""
    env = [
        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        _from_secret("TOKEN"),
        {"name": "EMPTY"},
        *_env(("NOTE", "see instaslice.io/mig-1g.10gb"), ("CUDA_VISIBLE_DEVICES", "0")),
    ]
    busy = user_pod(
        container("main", env=env, limits={"nvidia.com/gpu": "1", "cpu": "1"}),
        container("side", env=_env(("A", "1"))),
        init=[container("prep", env=env)],
        annotations={"team": "a", "instaslice.io/note": "x", "cdi.example.com/x": "y"},
        gates=["example.com/hold"],
    )
    made = await kube.create(core_path("pods", namespace), busy, dryRun="All")
    assert len(made["spec"]["containers"][0]["env"]) == len(env)


async def test_own_devices_pass_and_a_neighbours_does_not(
    kube: Kube, policy: None, namespace: str
) -> None:
    """Several containers of an InstaSlice pod each naming their own device (the one walk
    finds nothing to refuse); one naming its neighbour's is refused, and named."""
    await _opt_in(kube, namespace)
    own = {c: _device(namespace, "c1", c) for c in ("main", "side")}

    def pod(side_device: str) -> Obj:
        return user_pod(
            container("main", env=_env(("A", "1"), (VISIBLE_DEVICES_ENV, own["main"]))),
            container("side", env=_env((VISIBLE_DEVICES_ENV, side_device), ("D", side_device))),
            container("plain"),
            annotations={CLAIM_ANNOTATION: "c1"},
            gates=[GATE_NAME],
        )

    pods = core_path("pods", namespace)
    await kube.create(pods, pod(own["side"]), dryRun="All")
    await _refused(kube.create(pods, pod(own["main"]), dryRun="All"), "containers side:")


async def test_gate_and_claim_taken_at_once_name_the_gate(
    kube: Kube, policy: None, namespace: str
) -> None:
    """The gate rule and the claim rule are one validation (issue 25): an update breaking
    both is refused naming the gate, as when they were two (the first refusal speaks);
    one breaking only the claim names the claim."""
    await _opt_in(kube, namespace)
    bare = _wired_pod(namespace, "cboth", asks=False)
    del bare["spec"]["containers"][0]["env"]  # no env: the env rule stays out of it
    made = await kube.create(core_path("pods", namespace), bare)
    path = core_path("pods", namespace, made["metadata"]["name"])
    claim = "/metadata/annotations/instaslice.io~1claim"
    both = [{"op": "remove", "path": "/spec/schedulingGates/0"},
            {"op": "replace", "path": claim, "value": "cother"}]  # fmt: skip
    message = await _refused(kube.patch(path, both, "json"), "only InstaSlice may remove")
    assert "set or change" not in message, message
    message = await _refused(
        kube.patch(path, [{"op": "remove", "path": claim}], "json"),
        "metadata.annotations[instaslice.io/claim]: only InstaSlice may set or change it (user",
    )
    assert "schedulingGates" not in message, message


# --- opt-in (issue 17 item 3) ----------------------------------------------------------------


async def test_instaslice_marks_only_in_opted_in_namespaces(
    kube: Kube, policy: None, namespace: str
) -> None:
    """The rewritten form written by hand where the webhook is never called (a namespace
    that did not opt in) would skip the webhook's checks and the quota on opted-in
    namespaces: refused, whichever mark it carries."""
    pods = core_path("pods", namespace)
    marked = {
        "gate only": user_pod(container("main"), gates=[GATE_NAME]),
        "gate and claim": user_pod(
            container("main"), gates=[GATE_NAME], annotations={CLAIM_ANNOTATION: "cmine"}
        ),
        "gate and slice": user_pod(container("main", limits={ISL: "1"}), gates=[GATE_NAME]),
        "gate and whole GPU": user_pod(
            container("main", limits={"instaslice.io/gpu": "1"}), gates=[GATE_NAME]
        ),
    }
    for what, pod in marked.items():
        message = await _refused(kube.create(pods, pod, dryRun="All"), NOT_OPTED_IN)
        assert namespace in message, what
    await _opt_in(kube, namespace)
    for pod in (marked["gate only"], marked["gate and claim"]):  # (no webhook call for these)
        await kube.create(pods, pod, dryRun="All")
    off = {ENABLED_KEY: None}
    await kube.patch(
        core_path("namespaces", name=namespace), {"metadata": {"annotations": off, "labels": off}}
    )

    async def refused_again() -> bool:
        try:
            await kube.create(pods, marked["gate and claim"], dryRun="All")
        except ApiError as exc:
            assert NOT_OPTED_IN in exc.message, exc.message
            return True
        return False

    await eventually(refused_again, within=30)
    await kube.create(pods, user_pod(container("main")), dryRun="All")  # ordinary pods pass


async def test_whole_gpus_only_in_namespaces_opted_in_to_them(
    kube: Kube, policy: None, namespace: str
) -> None:
    """Security finding 4: the webhook sends a namespace's `instaslice.io/gpu` pods to its
    whole-GPU path only where the namespace opted in to whole GPUs, so a gated pod asking
    `instaslice.io/gpu` written by hand in a namespace opted in to MIG slices only would
    skip every check: refused, in a container or a sidecar (an init container that is not one
    may not ask at all, rule 8). Slices stay allowed;
    the whole-GPU opt-in (label mirrored from its annotation) lets it through."""
    await _opt_in(kube, namespace)
    pods = core_path("pods", namespace)
    whole = {"instaslice.io/gpu": "1"}
    hand = {
        "container": user_pod(container("main", limits=whole), gates=[GATE_NAME],
                              annotations={CLAIM_ANNOTATION: "cwhole"}),
        "sidecar": user_pod(container("main"), init=[sidecar(container("prep", limits=whole))],
                            gates=[GATE_NAME]),
    }  # fmt: skip
    for what, pod in hand.items():
        message = await _refused(kube.create(pods, pod, dryRun="All"), NOT_WHOLE)
        assert namespace in message and f'{WHOLE_GPU_KEY}="true"' in message, what
    await kube.create(pods, user_pod(container("main", limits={ISL: "1"}), gates=[GATE_NAME]),
                      dryRun="All")  # fmt: skip
    on = {WHOLE_GPU_KEY: "true"}
    body = {"metadata": {"annotations": on, "labels": on}}
    await kube.patch(core_path("namespaces", name=namespace), body)
    await wait_admission_sees_opt_in(kube, namespace, hand["container"], refused_until=NOT_WHOLE)
    await kube.create(pods, hand["sidecar"], dryRun="All")


# --- env mode: NVIDIA_VISIBLE_DEVICES (issue 17 item 9) ---------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        "all",
        "0",
        "0,1",
        "GPU-5f1b4c2e-8c1d-4b7a-9e3f-0a1b2c3d4e5f",
        "MIG-7a3c9d1e-2b4f-5a6c-8d9e-0f1a2b3c4d5e",
        "nvidia.com/gpu=all",
        "nvidia.com/mig=0:1",
        "vendor.example/dev=x",
    ],
)
async def test_env_mode_refuses_self_selected_devices(
    kube: Kube, policy: None, namespace: str, value: str
) -> None:
    """In env mode NVIDIA_VISIBLE_DEVICES selects the devices the toolkit injects, so a pod
    naming `all`, an index, a UUID or another CDI device would get GPUs or slices InstaSlice
    never gave it — in any namespace but the system ones, opted in or not."""
    env = [{"name": VISIBLE_DEVICES_ENV, "value": value}]
    pods = core_path("pods", namespace)
    await _refused(
        kube.create(pods, user_pod(container("main", env=env)), dryRun="All"),
        "containers main:",
        SELF_SELECTING,
    )
    init = user_pod(container("main"), init=[container("prep", env=env)])
    await _refused(kube.create(pods, init, dryRun="All"), "containers prep:", SELF_SELECTING)
    await kube.create(core_path("pods", "kube-system"), user_pod(container("main", env=env)),
                      dryRun="All")  # fmt: skip


async def test_env_mode_refuses_visible_devices_from_elsewhere_and_in_debug_containers(
    kube: Kube, policy: None, namespace: str
) -> None:
    pods = core_path("pods", namespace)
    from_cm = {"name": VISIBLE_DEVICES_ENV,
               "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}  # fmt: skip
    await _refused(
        kube.create(pods, user_pod(container("main", env=[from_cm])), dryRun="All"),
        SELF_SELECTING,
    )
    for harmless in ("void", "none"):
        env = [{"name": VISIBLE_DEVICES_ENV, "value": harmless}, {"name": "X", "value": "all"}]
        await kube.create(pods, user_pod(container("main", env=env)), dryRun="All")
    await kube.create(pods, user_pod(container("main", env=[{"name": VISIBLE_DEVICES_ENV}])),
                      dryRun="All")  # fmt: skip
    await _opt_in(kube, namespace)
    pod = await kube.create(pods, user_pod(container("main")))
    debug = {"name": "debug", "image": "busybox",
             "env": [{"name": VISIBLE_DEVICES_ENV, "value": "all"}]}  # fmt: skip
    patch = [{"op": "add", "path": "/spec/ephemeralContainers", "value": [debug]}]
    path = core_path("pods", namespace, pod["metadata"]["name"]) + "/ephemeralcontainers"
    await _refused(kube.patch(path, patch, "json"), "containers debug:", SELF_SELECTING)


# --- InstaSlice's own identity is confined (issue 17 item 4) ----------------------------------


async def _controller_policies_enforced(kube: Kube, allocator: Kube, namespace: str) -> None:
    """The controller policies reach the admission chain a moment after they are created."""
    probe = user_pod(container("main"))

    async def enforced() -> bool:
        try:
            await allocator.create(core_path("pods", namespace), probe, dryRun="All")
        except ApiError as exc:
            return CONTROLLER_PODS in exc.message
        return False

    await eventually(enforced, within=30)
    ns_path = core_path("namespaces", name=namespace)

    async def ns_enforced() -> bool:
        try:
            await allocator.patch(ns_path, {"metadata": {"labels": {"probe": "x"}}}, dryRun="All")
        except ApiError as exc:
            return CONTROLLER_NAMESPACES in exc.message
        return False

    await eventually(ns_enforced, within=30)


def _pin(node: str) -> list[Obj]:
    """What the allocator's one update does to a gated pod without affinity: a required
    node-name term, and its gate removed."""
    term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [term]}}}  # fmt: skip
    return [
        {"op": "add", "path": "/spec/affinity", "value": affinity},
        {"op": "remove", "path": "/spec/schedulingGates/0"},
    ]


async def test_instaslice_only_pins_and_ungates_gated_pods(
    kube: Kube, policy: None, users: dict[str, Kube], namespace: str
) -> None:
    await _opt_in(kube, namespace)
    pods = core_path("pods", namespace)
    for who in ("allocator", "serviceaccount"):
        me = users[who]
        await _controller_policies_enforced(kube, me, namespace)
        gated = await kube.create(pods, _wired_pod(namespace, f"c{who[:4]}", asks=False))
        path = core_path("pods", namespace, gated["metadata"]["name"])
        image = [{"op": "replace", "path": "/spec/containers/0/image", "value": "evil:1"}]
        tolerations = [*gated["spec"].get("tolerations", []), {"operator": "Exists"}]
        tolerate = [{"op": "add", "path": "/spec/tolerations", "value": tolerations}]
        label = [{"op": "add", "path": "/metadata/labels", "value": {"app": "frontend"}}]
        deadline = [{"op": "add", "path": "/spec/activeDeadlineSeconds", "value": 1}]
        for bad, words in (
            (image, "never changes a pod's containers"),
            (tolerate, "tolerations"),
            (label, "never changes a pod's labels"),
            (deadline, "deadlines"),
            (_pin("gpu-a") + image[:1], "never changes a pod's containers"),
        ):
            with pytest.raises(ApiError) as exc:
                await me.patch(path, bad, "json")
            assert CONTROLLER_PODS in exc.value.message and words in exc.value.message, bad
        pinned = await me.patch(path, _pin("gpu-a"), "json")
        assert not pinned["spec"].get("schedulingGates")
        # the pod is no longer gated: nothing more, not even its image
        with pytest.raises(ApiError) as exc:
            await me.patch(path, image, "json")
        assert "only pods that carry its instaslice.io/allocation gate" in exc.value.message
        # another controller's gate stays (Kueue's, say)
        two = _wired_pod(namespace, f"d{who[:4]}", asks=False)
        two["spec"]["schedulingGates"] = [{"name": "kueue.x-k8s.io/admission"},
                                          {"name": GATE_NAME}]  # fmt: skip
        two = await kube.create(pods, two)
        two_path = core_path("pods", namespace, two["metadata"]["name"])
        with pytest.raises(ApiError) as exc:
            await me.patch(two_path, [{"op": "remove", "path": "/spec/schedulingGates/0"}],
                           "json")  # fmt: skip
        assert "removes only its own scheduling gate" in exc.value.message
        await me.patch(two_path, [{"op": "remove", "path": "/spec/schedulingGates/1"}], "json")
        # never creates pods, writes status or adds debug containers
        with pytest.raises(ApiError) as exc:
            await me.create(pods, user_pod(container("main")), dryRun="All")
        assert CONTROLLER_PODS in exc.value.message
        with pytest.raises(ApiError) as exc:
            await me.patch(path + "/status", {"metadata": {"labels": {"x": "y"}}})
        assert "never UPDATE pods/status" in exc.value.message
        debug = [{"op": "add", "path": "/spec/ephemeralContainers",
                  "value": [{"name": "debug", "image": "busybox"}]}]  # fmt: skip
        with pytest.raises(ApiError) as exc:
            await me.patch(path + "/ephemeralcontainers", debug, "json")
        assert "never UPDATE pods/ephemeralcontainers" in exc.value.message


async def test_instaslice_deletes_only_pods_with_a_claim(
    kube: Kube, policy: None, users: dict[str, Kube], namespace: str
) -> None:
    await _opt_in(kube, namespace)
    allocator = users["allocator"]
    await _controller_policies_enforced(kube, allocator, namespace)
    pods = core_path("pods", namespace)
    plain = await kube.create(pods, user_pod(container("main")))
    plain_path = core_path("pods", namespace, plain["metadata"]["name"])
    with pytest.raises(ApiError) as exc:
        await allocator.delete(plain_path)
    assert "deletes only pods that carry an instaslice.io/claim" in exc.value.message
    assert await kube.get(plain_path)
    claimed = await kube.create(pods, _wired_pod(namespace, "cgone", asks=False))
    await allocator.delete(core_path("pods", namespace, claimed["metadata"]["name"]))


async def _priority_classes(kube: Kube) -> None:
    """InstaSlice's PriorityClasses (the placeholders'), and a higher one, `it-high`."""
    classes = group_path("scheduling.k8s.io/v1", "priorityclasses")
    higher = {"metadata": {"name": "it-high"}, "value": 1000}
    for doc in [*load_manifest("allocator/priorityclass.yaml"), higher]:
        try:
            await kube.create(classes, doc)
        except ApiError as err:
            if err.status != 409:
                raise


def _placeholder_for(owner: Obj) -> Obj:
    """The autoscaler placeholder InstaSlice's allocator makes for gated pod `owner`,
    asking one slice (docs/autoscaling.md)."""
    body = placeholder_pod(owner, podlib.pod_request(owner), ["n1"], image="busybox")
    body["spec"]["containers"][0]["resources"] = {"limits": {ISL: "1"}}
    return body


async def test_placeholder_is_the_only_pod_instaslice_creates(
    kube: Kube, policy: None, users: dict[str, Kube], namespace: str
) -> None:
    """An autoscaler placeholder (docs/autoscaling.md) asks for instaslice.io/mig-* without
    the gate; InstaSlice may create exactly that shape, nobody else may create it at all."""
    await _opt_in(kube, namespace)
    allocator, mallory = users["allocator"], users["mallory"]
    await _controller_policies_enforced(kube, allocator, namespace)
    pods = core_path("pods", namespace)
    owner = await kube.create(pods, _wired_pod(namespace, "cowner", asks=False))

    def placeholder(**spec: object) -> Obj:
        body = _placeholder_for(owner)
        body["spec"].update(spec)
        return body

    await _priority_classes(kube)

    made = await allocator.create(pods, placeholder())
    assert not made["spec"].get("schedulingGates")
    bad_container = {"name": "placeholder", "image": "busybox", "resources": {"limits": {ISL: "1"}}}
    for why, body in (
        ("a command", placeholder(containers=[{**bad_container, "command": ["sh"]}])),
        ("env", placeholder(containers=[{**bad_container, "env": [{"name": "A", "value": "1"}]}])),
        ("a volume", placeholder(volumes=[{"name": "v", "emptyDir": {}}])),
        ("host network", placeholder(hostNetwork=True)),
        ("a token", placeholder(automountServiceAccountToken=True)),
        ("two containers", placeholder(containers=[bad_container, {**bad_container, "name": "b"}])),
        ("a higher priority", placeholder(priorityClassName="it-high")),
    ):
        body["metadata"]["name"] = f"bad-{secrets.token_hex(3)}"
        with pytest.raises(ApiError) as exc:
            await allocator.create(pods, body, dryRun="All")
        assert CONTROLLER_PODS in exc.value.message, why
    unlabelled = placeholder()
    del unlabelled["metadata"]["labels"][SCALE_UP_LABEL]
    unlabelled["metadata"]["name"] = "unlabelled"
    with pytest.raises(ApiError) as exc:  # both policies refuse it
        await allocator.create(pods, unlabelled, dryRun="All")
    assert CONTROLLER_PODS in exc.value.message or POLICY_DENIED in exc.value.message
    forged = placeholder()
    forged["metadata"]["name"] = "forged"
    with pytest.raises(ApiError) as exc:  # a user cannot skip the gate with the label
        await mallory.create(pods, forged, dryRun="All")
    # the gate rule speaks first; where an earlier test left the webhook installed, it has
    # rewritten this pod (named so, it is no placeholder of ours) and the label rule speaks
    message = exc.value.message
    assert POLICY_DENIED in message and ("must carry" in message or LABEL_GUARDED in message)
    await allocator.delete(core_path("pods", namespace, made["metadata"]["name"]))


async def test_only_instaslice_sets_changes_or_removes_the_placeholder_label(
    kube: Kube, webhook: Webhook, policy: None, users: dict[str, Kube], namespace: str
) -> None:
    """Security finding 1: the label instaslice.io/scale-up-for marks InstaSlice's autoscaler
    placeholders, which the allocator charges to no node and the webhook leaves unrewritten.
    Nobody but InstaSlice may create a pod with it (a tenant's MIG pod, rewritten by the
    webhook, included), add it later, or alter or remove it on a placeholder — through the
    pod or its status; cluster-admin neither. InstaSlice's identity creates its real
    placeholder; other labels stay anyone's."""
    ns = await opted_in_namespace(kube, namespace)
    mallory, allocator = users["mallory"], users["allocator"]
    await _controller_policies_enforced(kube, allocator, ns)
    await _priority_classes(kube)
    pods = core_path("pods", ns)
    tagged = user_pod(container("main", limits={MIG: "1"}))  # rewritten by the webhook
    tagged["metadata"]["labels"] = {SCALE_UP_LABEL: "u-victim"}
    plain_tagged = user_pod(container("main"))  # nothing else a rule reads
    plain_tagged["metadata"]["labels"] = {SCALE_UP_LABEL: "u-victim", "team": "a"}
    for who in (mallory, kube):
        for body in (tagged, plain_tagged):
            await _refused(who.create(pods, body, dryRun="All"), LABEL_GUARDED)
    plain = await mallory.create(pods, user_pod(container("main")))
    path = core_path("pods", ns, plain["metadata"]["name"])
    add = {"metadata": {"labels": {SCALE_UP_LABEL: "u-victim"}}}
    for who in (mallory, kube):
        for sub in ("", "/status"):
            await _refused(who.patch(path + sub, add), LABEL_GUARDED)
    await mallory.patch(path, {"metadata": {"labels": {"team": "a"}}})  # other labels: fine
    owner = await kube.create(pods, _wired_pod(ns, "cowner", asks=False))
    made = await allocator.create(pods, _placeholder_for(owner))
    assert made["metadata"]["labels"][SCALE_UP_LABEL] == owner["metadata"]["uid"]
    placeholder = core_path("pods", ns, made["metadata"]["name"])
    for who in (mallory, kube):
        for change in ("u-other", None):
            for sub in ("", "/status"):
                body = {"metadata": {"labels": {SCALE_UP_LABEL: change}}}
                await _refused(who.patch(placeholder + sub, body), LABEL_GUARDED)
    await mallory.patch(placeholder, {"metadata": {"labels": {"team": "a"}}})
    await allocator.delete(placeholder)


async def test_instaslice_evicts_pods_and_creates_no_other_subresource(
    kube: Kube, policy: None, users: dict[str, Kube], namespace: str
) -> None:
    """Preemption evicts through pods/eviction (docs/allocator.md "Preemption"); the same
    CREATE rule that lets placeholders through refuses every other pod subresource."""
    allocator = users["allocator"]
    await _controller_policies_enforced(kube, allocator, namespace)
    pods = core_path("pods", namespace)
    victim = await kube.create(pods, user_pod(container("main")))
    name = victim["metadata"]["name"]
    binding = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": name},
        "target": {"apiVersion": "v1", "kind": "Node", "name": "n1"},
    }
    with pytest.raises(ApiError) as exc:
        await allocator.create(core_path("pods", namespace, name) + "/binding", binding)
    assert CONTROLLER_PODS in exc.value.message and "pods/binding" in exc.value.message
    eviction = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": name, "namespace": namespace},
    }
    await allocator.create(core_path("pods", namespace, name) + "/eviction", eviction)
    try:
        got = await kube.get(core_path("pods", namespace, name))
    except ApiError as err:
        assert err.status == 404
    else:
        assert got["metadata"].get("deletionTimestamp")


async def test_instaslice_deletes_only_node_agent_leases(
    kube: Kube, policy: None, users: dict[str, Kube], namespace: str
) -> None:
    """The allocator deletes the heartbeat Lease of a node gone for good; its identity may
    delete no other Lease (its own leader Lease included)."""
    allocator = users["allocator"]
    leases = group_path("coordination.k8s.io/v1", "leases", namespace)
    leader = await kube.create(leases, {"metadata": {"name": "instaslice-allocator"},
                                        "spec": {"holderIdentity": "replica-a"}})  # fmt: skip
    holder = {"holderIdentity": "instaslice-nodeagent/gone-node"}
    agent = await kube.create(leases, {"metadata": {"name": "gone-node"}, "spec": holder})
    leader_path = f"{leases}/{leader['metadata']['name']}"

    async def enforced() -> bool:
        try:
            await allocator.delete(leader_path, dryRun="All")
        except ApiError as exc:
            return CONTROLLER_LEASES in exc.message
        return False

    await eventually(enforced, within=30)
    with pytest.raises(ApiError) as exc:
        await allocator.delete(leader_path)
    assert "deletes only node agent Leases" in exc.value.message
    assert await kube.get(leader_path)
    await allocator.delete(f"{leases}/{agent['metadata']['name']}")
    with pytest.raises(ApiError) as gone:
        await kube.get(f"{leases}/{agent['metadata']['name']}")
    assert gone.value.not_found


async def test_instaslice_changes_only_the_opt_in_label_of_a_namespace(
    kube: Kube, policy: None, users: dict[str, Kube], namespace: str
) -> None:
    allocator = users["allocator"]
    await _controller_policies_enforced(kube, allocator, namespace)
    path = core_path("namespaces", name=namespace)
    on = {"metadata": {"labels": {ENABLED_KEY: "true"}}}
    with pytest.raises(ApiError) as exc:  # no annotation: no label
        await allocator.patch(path, on)
    assert CONTROLLER_NAMESPACES in exc.value.message and "mirror" in exc.value.message
    for bad in (
        {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "privileged"}}},
        {"metadata": {"annotations": {ENABLED_KEY: "true"}}},
        {"metadata": {"labels": {ENABLED_KEY: "yes"}}},
        {"metadata": {"finalizers": ["x.io/keep"]}},
    ):
        with pytest.raises(ApiError) as exc:
            await allocator.patch(path, bad)
        assert CONTROLLER_NAMESPACES in exc.value.message, bad
    await kube.patch(path, {"metadata": {"annotations": {ENABLED_KEY: "true"}}})
    await allocator.patch(path, on)
    await kube.patch(path, {"metadata": {"annotations": {ENABLED_KEY: None}}})
    await allocator.patch(path, {"metadata": {"labels": {ENABLED_KEY: None}}})
    got = await kube.get(path)
    assert ENABLED_KEY not in got["metadata"].get("labels", {})
    # the second opt-in (whole GPUs) is mirrored under the same rule
    whole = {"metadata": {"labels": {WHOLE_GPU_KEY: "true"}}}
    with pytest.raises(ApiError) as exc:  # no annotation: no label
        await allocator.patch(path, whole)
    assert "instaslice.io/whole-gpu only" in exc.value.message
    await kube.patch(path, {"metadata": {"annotations": {WHOLE_GPU_KEY: "true"}}})
    await allocator.patch(path, whole)
    assert (await kube.get(path))["metadata"]["labels"][WHOLE_GPU_KEY] == "true"
