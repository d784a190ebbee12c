"""Least privilege of every InstaSlice identity, proved against the real authorizers.

Installs the shipped RBAC (manifests/base/{webhook,allocator,nodeagent}) and admission
policies (manifests/base/nodeagent/policy.yaml, manifests/base/policy) and checks:

- the exact RBAC table: SubjectAccessReviews for each identity — the webhook/allocator
  ServiceAccount `instaslice-system/instaslice-controller`, the node agent's ServiceAccount
  and its per-node certificate identity (group `instaslice:nodeagents`) — over a universe
  of resources x verbs (InstaSlice's own, the core ones, and the escalation paths: secrets,
  tokens, exec, impersonation, RBAC, admission configuration). Allowed must be exactly the
  table in docs/security.md: nothing missing, nothing extra;
- the node agent is confined to its own node's objects, with the credential it really
  runs with: a ServiceAccount token bound to a pod scheduled on node A (the apiserver puts
  the node name into the token) may write A's allocations' status and finalizer, MigNode
  A, Node A's instaslice.io/* capacity, its instaslice.io/gpu-* labels and Lease A, and
  nothing of node B, no other capacity, no finalizer added, no other relabelling, no spec,
  on its own Node's status nothing but instaslice.io/* capacity (no forged condition,
  address, endpoint, label or annotation); a token bound to no pod may write nothing, nor
  may another member of the group instaslice:nodeagents; the same for a per-node client
  certificate;
- the node agent's rules are sufficient: the real agent, under its node's certificate
  identity and nothing else, takes an allocation to Ready and releases it;
- the pod policy of docs/contract.md §4 holds in namespaces tests elsewhere do not use (kube-system,
  InstaSlice's own even when labelled opted-in, one that opted out: no device of another
  pod, no InstaSlice marks at all), and InstaSlice's *other* identity (the node agent) may not
  remove the gate or change the claim either;
- the controller's confinement is sufficient for the namespace mirror: the real mirror, as
  the controller ServiceAccount under its RBAC and policies, mirrors both ways;
- the controller's MigNode writes (policy instaslice-controller-mignodes): the allocator's
  own writes (ask and withdraw `spec.gpus[].desiredMigMode` of a GPU the status lists,
  delete a gone node's MigNode) pass as the ServiceAccount; a GPU the status does not list,
  a label, annotation or finalizer change are refused, and a member of the group
  instaslice:controllers given more RBAC still creates no MigNode and writes no status;
- the pod security settings of the manifests: non-root, read-only, no privilege escalation
  and all capabilities dropped for the webhook; privileged (NVML needs it) only for the
  node agent, with no host network/PID/IPC and only the host paths it needs (two of them
  read-only).

Leaves out what test_admission_policy.py already proves (device names, ephemeral
containers, CDI annotations, gate on create, gate/claim by cluster-admin and by users, the
webhook's pods) and what test_allocator_rbac.py proves (the allocator works with exactly
its rules). TLS 1.2+ of the webhook: tests/unit/test_webhook_server.py.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
import yaml

from common.clock import SystemClock
from common.constants import (
    CLAIM_ANNOTATION,
    ENABLED_KEY,
    GATE_NAME,
    NODE_LABEL,
    NODEAGENT_COMPONENT,
    RELEASE_FINALIZER,
    EventReason,
)
from common.events import new_event
from common.kubeapi import ApiError, Kube, Obj, core_path, group_path, instaslice_path
from common.objects import desired_modes, node_label_value
from hack.cluster import ControlPlane
from hack.cluster.nodes import NodeGroup, node_manifest
from tests.integration.agent_fixtures import (
    ROOT,
    agent_settings,
    apply,
    create_allocation,
    eventually,
    gpu_node,
    install_instaslice,
    manifest_docs,
    mig_node,
    running_agent,
    slice_allocation,
    wait_gone,
    wait_phase,
)
from webhook.allocator.leader import LeaderElector
from webhook.allocator.maintenance import spec_patch
from webhook.allocator.writes import Writes
from webhook.nsmirror import run_namespace_mirror

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

NS = "instaslice-system"
BASE = ROOT / "manifests" / "base"
AUTHZ = "authorization.k8s.io/v1"
RBAC = "rbac.authorization.k8s.io/v1"
ADMISSIONREG = "admissionregistration.k8s.io/v1"
LEASES = "coordination.k8s.io/v1"
CONTROLLER = "system:serviceaccount:instaslice-system:instaslice-controller"
AGENT_SA = "system:serviceaccount:instaslice-system:instaslice-nodeagent"
SA_GROUPS = ("system:serviceaccounts", f"system:serviceaccounts:{NS}", "system:authenticated")
ALL_VERBS = ("get", "list", "watch", "create", "update", "patch", "delete", "deletecollection")


# --- the table ------------------------------------------------------------------------------

# (api group, resource, subresource, namespace or "" for cluster scope)
Res = tuple[str, str, str, str]
UNIVERSE: tuple[Res, ...] = (
    ("", "pods", "", "team-a"),
    ("", "pods", "status", "team-a"),
    ("", "pods", "ephemeralcontainers", "team-a"),
    ("", "pods", "exec", "team-a"),
    ("", "pods", "eviction", "team-a"),
    ("", "pods", "binding", "team-a"),
    ("", "nodes", "", ""),
    ("", "nodes", "status", ""),
    ("", "namespaces", "", ""),
    ("", "events", "", "team-a"),
    ("", "secrets", "", NS),
    ("", "secrets", "", "team-a"),
    ("", "configmaps", "", NS),
    ("", "serviceaccounts", "", NS),
    ("", "serviceaccounts", "token", NS),
    ("", "services", "", NS),
    ("", "persistentvolumes", "", ""),
    ("", "podtemplates", "", "team-a"),
    ("autoscaling.x-k8s.io", "provisioningrequests", "", "team-a"),
    ("events.k8s.io", "events", "", "team-a"),
    ("coordination.k8s.io", "leases", "", NS),
    ("coordination.k8s.io", "leases", "", "kube-node-lease"),
    ("apps", "deployments", "", NS),
    ("apps", "daemonsets", "", NS),
    ("batch", "jobs", "", "team-a"),
    ("policy", "poddisruptionbudgets", "", "team-a"),
    ("instaslice.io", "sliceallocations", "", "team-a"),
    ("instaslice.io", "sliceallocations", "status", "team-a"),
    ("instaslice.io", "mignodes", "", ""),
    ("instaslice.io", "mignodes", "status", ""),
    ("admissionregistration.k8s.io", "validatingadmissionpolicies", "", ""),
    ("admissionregistration.k8s.io", "validatingadmissionpolicybindings", "", ""),
    ("admissionregistration.k8s.io", "mutatingwebhookconfigurations", "", ""),
    ("apiextensions.k8s.io", "customresourcedefinitions", "", ""),
    ("rbac.authorization.k8s.io", "clusterroles", "", ""),
    ("rbac.authorization.k8s.io", "clusterrolebindings", "", ""),
    ("rbac.authorization.k8s.io", "roles", "", NS),
    ("rbac.authorization.k8s.io", "rolebindings", "", NS),
    ("certificates.k8s.io", "certificatesigningrequests", "", ""),
)
# escalation verbs on their resources: (group, resource, verb)
SPECIAL: tuple[tuple[str, str, str], ...] = (
    ("", "users", "impersonate"),
    ("", "groups", "impersonate"),
    ("", "serviceaccounts", "impersonate"),
    ("rbac.authorization.k8s.io", "clusterroles", "escalate"),
    ("rbac.authorization.k8s.io", "clusterroles", "bind"),
    ("certificates.k8s.io", "signers", "approve"),
)

CONTROLLER_RULES: dict[tuple[str, str, str], set[str]] = {
    # pin+ungate; unstick; create: autoscaler placeholders (the controller policy confines it)
    ("", "pods", ""): {"get", "list", "watch", "update", "delete", "create"},
    ("", "pods", "eviction"): {"create"},  # preemption (the Eviction API keeps PDBs)
    ("policy", "poddisruptionbudgets", ""): {"list", "watch"},  # which victims a PDB guards
    ("", "nodes", ""): {"get", "list", "watch"},
    ("", "namespaces", ""): {"get", "list", "watch", "patch"},  # the opt-in label mirror
    # patch: a repeat counted on its event; list/watch: Karpenter's answers
    ("", "events", ""): {"create", "patch", "list", "watch"},
    ("", "podtemplates", ""): {"create", "delete"},  # --autoscaler-signal=provisioning-request
    ("autoscaling.x-k8s.io", "provisioningrequests", ""): {"get", "list", "watch", "create"}
    | {"delete"},
    ("instaslice.io", "mignodes", ""): {"get", "list", "watch", "patch", "delete"},
    ("instaslice.io", "sliceallocations", ""): {"get", "list", "watch", "create", "patch"}
    | {"delete"},
}
CONTROLLER_IN_NS: dict[tuple[str, str, str], set[str]] = {
    # get/update: only its own Lease; list/watch: the node agents' heartbeats
    ("coordination.k8s.io", "leases", ""): {"create", "list", "watch", "delete"},
}
AGENT_RULES: dict[tuple[str, str, str], set[str]] = {
    ("instaslice.io", "sliceallocations", ""): {"get", "list", "watch", "patch"},
    ("instaslice.io", "sliceallocations", "status"): {"patch"},
    ("instaslice.io", "mignodes", ""): {"get", "list", "watch", "create"},
    ("instaslice.io", "mignodes", "status"): {"patch"},
    ("", "nodes", ""): {"get", "list", "watch", "patch"},
    ("", "nodes", "status"): {"patch"},
    ("", "events", ""): {"create", "patch"},  # patch: a repeat counted on its event
}
AGENT_IN_NS: dict[tuple[str, str, str], set[str]] = {
    ("coordination.k8s.io", "leases", ""): {"create", "patch"},
}


@dataclass(frozen=True)
class Identity:
    user: str
    groups: tuple[str, ...]
    rules: dict[tuple[str, str, str], set[str]]
    in_ns: dict[tuple[str, str, str], set[str]]

    def expected(self, r: Res, verb: str) -> bool:
        group, resource, sub, ns = r
        if verb in self.rules.get((group, resource, sub), set()):
            return True
        return ns == NS and verb in self.in_ns.get((group, resource, sub), set())


IDENTITIES = {
    "controller": Identity(CONTROLLER, SA_GROUPS, CONTROLLER_RULES, CONTROLLER_IN_NS),
    "nodeagent-sa": Identity(AGENT_SA, SA_GROUPS, AGENT_RULES, AGENT_IN_NS),
    "nodeagent-cert": Identity(
        "system:instaslice:node:gpu-a",
        ("instaslice:nodeagents", "system:authenticated"),
        AGENT_RULES,
        AGENT_IN_NS,
    ),
}


async def allowed(
    kube: Kube, who: Identity, group: str, resource: str, verb: str, *,
    sub: str = "", ns: str = "", name: str = "",
) -> bool:  # fmt: skip
    attrs: Obj = {"group": group, "resource": resource, "verb": verb}
    attrs.update({k: v for k, v in (("subresource", sub), ("namespace", ns), ("name", name)) if v})
    review = {
        "apiVersion": AUTHZ,
        "kind": "SubjectAccessReview",
        "spec": {"user": who.user, "groups": list(who.groups), "resourceAttributes": attrs},
    }
    got = await kube.create(group_path(AUTHZ, "subjectaccessreviews"), review)
    return bool(got["status"].get("allowed"))


# --- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
async def kube(control_plane: ControlPlane) -> AsyncIterator[Kube]:
    """Admin client; the shipped RBAC and policies installed (the pod policy removed again
    at the end, as test_admission_policy.py creates it fresh)."""
    async with await Kube.connect(str(control_plane.kubeconfig)) as k:
        await install_instaslice(k)  # CRDs, namespace, node agent SA + RBAC + policies
        for doc in manifest_docs(BASE / "webhook") + manifest_docs(BASE / "allocator"):
            if doc["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role",
                               "RoleBinding"):  # fmt: skip
                await apply(k, doc)
        pod_policy = manifest_docs(BASE / "policy")
        for doc in pod_policy:
            await apply(k, doc)
        stolen = _device_pod("team-b", "cvictim")
        stolen["spec"]["containers"][0]["env"][0]["value"] = "instaslice.io/mig=x_y_main"

        async def enforced() -> bool:  # policies take a moment to reach the admission chain
            try:
                await k.create(core_path("pods", "default"), stolen, dryRun="All")
            except ApiError as exc:
                return "instaslice-pods" in exc.message
            return False

        await eventually(enforced, within=30, what="the pod policy enforced")
        try:
            yield k
        finally:
            for doc in pod_policy:
                kind = doc["kind"].lower()
                plural = kind[:-1] + "ies" if kind.endswith("y") else kind + "s"
                await k.delete_ignore_missing(
                    group_path(ADMISSIONREG, plural, name=doc["metadata"]["name"])
                )


def _kwok_node(name: str) -> Obj:
    body = node_manifest(NodeGroup(prefix=name, count=1, gpus=1, model="H100-80GB"), 0)
    body["metadata"]["name"] = name
    body["metadata"]["labels"]["kubernetes.io/hostname"] = name
    return body


@dataclass
class Nodes:
    a: str
    b: str


@pytest.fixture(scope="module")
async def nodes(kube: Kube) -> AsyncIterator[Nodes]:
    pair = Nodes(f"rbac-a-{secrets.token_hex(2)}", f"rbac-b-{secrets.token_hex(2)}")
    for n in (pair.a, pair.b):
        await kube.create(core_path("nodes"), _kwok_node(n))
    try:
        yield pair
    finally:
        for n in (pair.a, pair.b):
            await kube.delete_ignore_missing(core_path("nodes", name=n))


def _token_kubeconfig(cp: ControlPlane, path: Path, token: str) -> Path:
    ca = base64.b64encode(cp.ca_cert_pem).decode()
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": cp.server,
                                               "certificate-authority-data": ca}}],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    }))  # fmt: skip
    return path


async def _agent_token(kube: Kube, node: str | None) -> str:
    """A token of the node agent's ServiceAccount: bound to a pod scheduled on `node` (as
    the kubelet projects it into the DaemonSet's pods), or bound to nothing if None."""
    spec: Obj = {"expirationSeconds": 3600}
    if node is not None:
        pod = await kube.create(core_path("pods", NS), {
            "metadata": {"generateName": "agent-token-"},
            "spec": {"serviceAccountName": "instaslice-nodeagent", "nodeName": node,
                     "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]},
        })  # fmt: skip
        m = pod["metadata"]
        spec["boundObjectRef"] = {"kind": "Pod", "apiVersion": "v1", "name": m["name"],
                                  "uid": m["uid"]}  # fmt: skip
    path = core_path("serviceaccounts", NS, "instaslice-nodeagent") + "/token"
    got = await kube.create(path, {"apiVersion": "authentication.k8s.io/v1",
                                   "kind": "TokenRequest", "spec": spec})  # fmt: skip
    return str(got["status"]["token"])


@pytest.fixture(scope="module")
async def agents(
    control_plane: ControlPlane, kube: Kube, nodes: Nodes, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[dict[str, Kube]]:
    """Clients as node A's agent: bound SA token, per-node certificate; and an SA token
    bound to no pod (no node identity)."""
    d = tmp_path_factory.mktemp("rbac")
    configs = {
        "token": _token_kubeconfig(control_plane, d / "a.kc", await _agent_token(kube, nodes.a)),
        "unbound": _token_kubeconfig(control_plane, d / "u.kc", await _agent_token(kube, None)),
        "cert": control_plane.user_kubeconfig(
            f"system:instaslice:node:{nodes.a}", ("instaslice:nodeagents",)
        ),
        # a member of the agents' group under another name: RBAC grants it what the group
        # has; the policies must not let it write anything (issue 17 item 11)
        "member": control_plane.user_kubeconfig("eve", ("instaslice:nodeagents",)),
    }
    clients = {k: await Kube.connect(str(v)) for k, v in configs.items()}
    probe = {"metadata": {"name": nodes.a}, "spec": {"holderIdentity": "probe"}}

    async def enforced() -> bool:  # the node policies reach the admission chain
        try:
            await clients["unbound"].create(group_path(LEASES, "leases", NS), probe, dryRun="All")
        except ApiError as exc:
            return "no node identity" in exc.message
        return False

    try:
        await eventually(enforced, within=30, what="the node agent policies enforced")
        yield clients
    finally:
        for c in clients.values():
            await c.close()


# --- 1. the exact table -------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(IDENTITIES))
async def test_rbac_grants_exactly_the_table(kube: Kube, name: str) -> None:
    who = IDENTITIES[name]
    cases = [(r, v) for r in UNIVERSE for v in ALL_VERBS]

    async def one(r: Res, verb: str) -> str | None:
        group, resource, sub, ns = r
        got = await allowed(kube, who, group, resource, verb, sub=sub, ns=ns)
        want = who.expected(r, verb)
        if got == want:
            return None
        where = f"{group or 'core'}/{resource}{'/' + sub if sub else ''} in {ns or 'cluster'}"
        return f"{'EXTRA' if got else 'MISSING'}: {verb} {where}"

    diffs: list[str | None] = []
    for i in range(0, len(cases), 32):  # a few dozen reviews at a time
        diffs += await asyncio.gather(*(one(r, v) for r, v in cases[i : i + 32]))
    for group, resource, verb in SPECIAL:
        if await allowed(kube, who, group, resource, verb):
            diffs.append(f"EXTRA: {verb} {group or 'core'}/{resource}")
    problems = [d for d in diffs if d]
    assert not problems, f"{who.user}: RBAC differs from the table:\n" + "\n".join(problems)


async def test_controller_lease_rights_are_its_own_lease_only(kube: Kube) -> None:
    who = IDENTITIES["controller"]
    lease = ("coordination.k8s.io", "leases")
    for verb in ("get", "update"):
        assert await allowed(kube, who, *lease, verb, ns=NS, name="instaslice-allocator")
        assert not await allowed(kube, who, *lease, verb, ns=NS, name="gpu-a")  # an agent's
        assert not await allowed(kube, who, *lease, verb, ns="kube-system", name="kcm")
    # delete: RBAC allows it in InstaSlice's namespace (a gone node's agent Lease); the
    # policy instaslice-controller-leases refuses every Lease but an agent's
    # (test_admission_policy.py::test_instaslice_deletes_only_node_agent_leases)
    assert await allowed(kube, who, *lease, "delete", ns=NS, name="gone-node")
    assert not await allowed(kube, who, *lease, "delete", ns="kube-node-lease", name="n")
    assert not await allowed(kube, who, *lease, "create", ns="kube-node-lease")


# --- 2. the node agent stays on its node ------------------------------------------------------


async def _refused(call: Any, *words: str, status: int | None = None) -> str:
    """`status`: the one expected (the pod policy's content rules answer 422 Invalid, its
    who-may-write rules 403 Forbidden); None: either."""
    with pytest.raises(ApiError) as exc:
        await call
    assert exc.value.status in ((403, 422) if status is None else (status,)), exc.value
    for w in words:
        assert w in exc.value.message, (w, exc.value.message)
    return exc.value.message


async def _wait_confined(client: Kube, path: str, body: Obj, policy: str) -> None:
    """Until `policy` refuses `client`'s (dry-run) merge patch `body` of `path`: policies take
    a moment to reach the admission chain."""

    async def confined() -> bool:
        try:
            await client.patch(path, body, dryRun="All")
        except ApiError as exc:
            return policy in exc.message
        return False

    await eventually(confined, within=30, what=f"{policy} enforced")


async def _wait_readable(client: Kube, path: str) -> None:
    """Until `client` may read `path`: a test's RBAC binding takes a moment (caches)."""

    async def can_read() -> bool:
        try:
            await client.get(path)
        except ApiError:
            return False
        return True

    await eventually(can_read, within=10, what="the test's RBAC binding")


def _allocation(ns: str, node: str, finalizers: Iterable[str] = (RELEASE_FINALIZER,)) -> Obj:
    claim = f"c{secrets.token_hex(5)}"
    return {
        "apiVersion": "instaslice.io/v1alpha1",
        "kind": "SliceAllocation",
        "metadata": {"name": claim, "namespace": ns, "labels": {NODE_LABEL: node},
                     "finalizers": list(finalizers)},
        "spec": {"podName": f"p-{claim}", "podUID": f"u-{claim}", "nodeName": node,
                 "slices": [{"container": "main", "profile": "1g.10gb",
                             "gpuUUID": f"GPU-{node}", "start": 0, "size": 1}]},
    }  # fmt: skip


async def _confined(kube: Kube, agent: Kube, nodes: Nodes, ns: str) -> None:
    """What the agent of node A may and may not write (RBAC + the node policies)."""
    mine = await kube.create(instaslice_path("sliceallocations", ns), _allocation(ns, nodes.a))
    theirs = await kube.create(instaslice_path("sliceallocations", ns), _allocation(ns, nodes.b))
    a_path = instaslice_path("sliceallocations", ns, mine["metadata"]["name"])
    b_path = instaslice_path("sliceallocations", ns, theirs["metadata"]["name"])
    status = {"status": {"phase": "Creating"}}

    # its node's allocation: status, and dropping (not adding) a finalizer
    await agent.patch(a_path + "/status", status)
    more = {"metadata": {"finalizers": [RELEASE_FINALIZER, "x.io/mine"]}}
    await _refused(agent.patch(a_path, more), "never add")
    await _refused(agent.patch(a_path, {"metadata": {"labels": {NODE_LABEL: nodes.b}}}), "bound to")
    await agent.patch(a_path, {"metadata": {"finalizers": None}})
    # another node's: nothing
    await _refused(agent.patch(b_path + "/status", status), "only update SliceAllocations")
    await _refused(agent.patch(b_path, {"metadata": {"finalizers": None}}), "bound to")
    # RBAC: no create, no delete of allocations, no deleting MigNodes, no Node spec
    await _refused(agent.create(instaslice_path("sliceallocations", ns), _allocation(ns, nodes.a)))
    await _refused(agent.delete(b_path), "forbidden")

    # MigNodes: its own only
    mig_a = {"apiVersion": "instaslice.io/v1alpha1", "kind": "MigNode",
             "metadata": {"name": nodes.a}}  # fmt: skip
    await kube.delete_ignore_missing(instaslice_path("mignodes", name=nodes.a))
    await agent.create(instaslice_path("mignodes"), mig_a)
    await agent.patch(instaslice_path("mignodes", name=nodes.a) + "/status",
                      {"status": {"gpuCount": 0}})  # fmt: skip
    mig_b = {**mig_a, "metadata": {"name": nodes.b}}
    await _refused(agent.create(instaslice_path("mignodes"), mig_b), "may only write MigNode")
    await _refused(agent.delete(instaslice_path("mignodes", name=nodes.a)), "forbidden")

    # Node status: only its own, only instaslice.io/* entries
    node_a = core_path("nodes", name=nodes.a) + "/status"
    cap = {"status": {"capacity": {"instaslice.io/mig-1g.10gb": "7"},
                      "allocatable": {"instaslice.io/mig-1g.10gb": "7"}}}  # fmt: skip
    await agent.patch(node_a, cap)
    await _refused(agent.patch(core_path("nodes", name=nodes.b) + "/status", cap),
                   "may only update the status of Node")  # fmt: skip
    await _refused(agent.patch(node_a, {"status": {"capacity": {"cpu": "1000"}}}),
                   "only instaslice.io/*")  # fmt: skip
    # Node itself: only its instaslice.io/gpu-* labels (Kueue flavors select on them)
    mine = {"metadata": {"labels": {"instaslice.io/gpu-model": "H100-80GB"}}}
    await agent.patch(core_path("nodes", name=nodes.a), mine)
    # and instaslice.io/node as its own name only (placeholders' NotIn): an agent naming its
    # node after another would draw the other's placeholders onto it
    await agent.patch(
        core_path("nodes", name=nodes.a), {"metadata": {"labels": {NODE_LABEL: nodes.a}}}
    )
    await _refused(agent.patch(core_path("nodes", name=nodes.b), mine),
                   "may only update the status of Node")  # fmt: skip
    # the GPU Operator's deploy labels: an existing one paused and restored (Ampere
    # maintenance), nothing else
    dcgm = "nvidia.com/gpu.deploy.dcgm"
    await kube.patch(core_path("nodes", name=nodes.a), {"metadata": {"labels": {dcgm: "true"}}})
    paused = {"metadata": {"labels": {dcgm: "paused-for-mig-change"}}}
    await agent.patch(core_path("nodes", name=nodes.a), paused)
    await agent.patch(core_path("nodes", name=nodes.a), {"metadata": {"labels": {dcgm: "true"}}})
    await _refused(agent.patch(core_path("nodes", name=nodes.b), paused),
                   "may only update the status of Node")  # fmt: skip
    for bad in (
        {"metadata": {"labels": {"x": "y"}}},
        {"metadata": {"labels": {"kubernetes.io/hostname": None}}},
        {"metadata": {"labels": {NODE_LABEL: nodes.b}}},
        {"metadata": {"labels": {NODE_LABEL: None}}},
        {"metadata": {"labels": {dcgm: "false"}}},  # only to or from paused
        {"metadata": {"labels": {dcgm: None}}},  # never removed
        {"metadata": {"labels": {"nvidia.com/gpu.deploy.nvsm": "paused-for-mig-change"}}},
        {"spec": {"unschedulable": True}},
        {"spec": {"taints": [{"key": "x", "effect": "NoSchedule"}]}},
    ):
        await _refused(agent.patch(core_path("nodes", name=nodes.a), bad), "may change only")

    # Leases: its own heartbeat only
    leases = group_path(LEASES, "leases", NS)
    lease = {"metadata": {"name": nodes.a}, "spec": {"holderIdentity": "agent"}}
    await kube.delete_ignore_missing(f"{leases}/{nodes.a}")
    await agent.create(leases, lease)
    await agent.patch(f"{leases}/{nodes.a}", {"spec": {"leaseDurationSeconds": 40}})
    await _refused(
        agent.create(leases, {**lease, "metadata": {"name": nodes.b}}), "may only write Lease"
    )
    await _refused(agent.create(group_path(LEASES, "leases", "kube-node-lease"), lease))

    # Events: only those it reports as its node; a repeat's patch only of its own
    events = core_path("events", ns)

    def event(instance: str) -> Obj:
        pod = {"apiVersion": "v1", "kind": "Pod", "name": "p", "namespace": ns, "uid": "u"}
        return new_event(pod, EventReason.SLICE_READY, f"from {instance}",
                         component=NODEAGENT_COMPONENT, instance=instance,
                         type_="Normal", stamp="2026-01-01T00:00:00Z")  # fmt: skip

    async def events_confined() -> bool:  # the policy reaches the admission chain
        try:
            await agent.create(events, event(nodes.b), dryRun="All")
        except ApiError as exc:
            return "may only write events" in exc.message
        return False

    await eventually(events_confined, within=30, what="instaslice-nodeagent-events enforced")
    own = await agent.create(events, event(nodes.a))
    own_path = core_path("events", ns, own["metadata"]["name"])
    await agent.patch(own_path, {"lastTimestamp": "2026-01-01T00:00:01Z"})
    await _refused(agent.patch(own_path, {"reportingInstance": nodes.b}), "may only write events")
    await _refused(agent.create(events, event(nodes.b)), "may only write events")
    others = await kube.create(events, event("instaslice-allocator-0"))
    await _refused(
        agent.patch(core_path("events", ns, others["metadata"]["name"]), {"count": 9}),
        "may only write events",
    )

    # nothing else: secrets, pods
    await _refused(agent.list(core_path("secrets", NS)), "forbidden")
    await _refused(agent.list(core_path("pods")), "forbidden")
    await kube.patch(b_path, {"metadata": {"finalizers": None}})


async def test_agent_token_bound_to_a_pod_on_its_node_is_confined_to_that_node(
    kube: Kube, agents: dict[str, Kube], nodes: Nodes, namespace: str
) -> None:
    await _confined(kube, agents["token"], nodes, namespace)


async def test_agent_node_certificate_is_confined_to_its_node(
    kube: Kube, agents: dict[str, Kube], nodes: Nodes, namespace: str
) -> None:
    await _confined(kube, agents["cert"], nodes, namespace)


async def test_agent_of_a_long_named_node_sets_only_its_cut_and_hashed_name(
    control_plane: ControlPlane, kube: Kube, agents: dict[str, Kube], tmp_path: Path
) -> None:
    """A node name over 63 characters is no label value: the agent writes its first 50,
    `-` and 12 hex digits of its sha256 (common.objects.node_label_value). CEL cannot hash,
    so the policy checks the cut and the length: another cut, or the name's first 63, is
    refused. (A per-node certificate cannot name such a node: a CN holds 64 characters.)"""
    name = f"rbac-long-{secrets.token_hex(2)}.{'x' * 60}"
    body = _kwok_node(name)
    body["metadata"]["labels"]["kubernetes.io/hostname"] = name[:63]  # a hostname is a label
    await kube.create(core_path("nodes"), body)
    kc = _token_kubeconfig(control_plane, tmp_path / "long.kc", await _agent_token(kube, name))
    try:
        async with await Kube.connect(str(kc)) as agent:
            path = core_path("nodes", name=name)
            own = node_label_value(name)
            assert len(own) == 63 and own != name[:63]
            await agent.patch(path, {"metadata": {"labels": {NODE_LABEL: own}}})
            for bad in (name[:63], f"rbac-long-{'y' * 40}-{'0' * 12}"):
                body = {"metadata": {"labels": {NODE_LABEL: bad}}}
                await _refused(agent.patch(path, body), "may change only")
    finally:
        await kube.delete_ignore_missing(core_path("nodes", name=name))


async def test_agent_token_without_a_node_writes_nothing(
    kube: Kube, agents: dict[str, Kube], nodes: Nodes, namespace: str
) -> None:
    agent = agents["unbound"]
    mine = await kube.create(
        instaslice_path("sliceallocations", namespace), _allocation(namespace, nodes.a, ())
    )
    path = instaslice_path("sliceallocations", namespace, mine["metadata"]["name"])
    await agent.get(path)  # reading is RBAC's, and allowed
    await _refused(agent.patch(path + "/status", {"status": {"phase": "Ready"}}),
                   "has no node identity")  # fmt: skip
    await _refused(
        agent.patch(core_path("nodes", name=nodes.a) + "/status",
                    {"status": {"capacity": {"instaslice.io/mig-1g.10gb": "1"}}}),
        "has no node identity",
    )  # fmt: skip
    lease = {"metadata": {"name": nodes.a}, "spec": {"holderIdentity": "x"}}
    await _refused(agent.create(group_path(LEASES, "leases", NS), lease), "has no node identity")
    pod = {"apiVersion": "v1", "kind": "Pod", "name": "p", "namespace": namespace, "uid": "u"}
    ev = new_event(pod, EventReason.SLICE_READY, "m", component=NODEAGENT_COMPONENT,
                   instance=nodes.a, type_="Normal", stamp="2026-01-01T00:00:00Z")  # fmt: skip
    await _refused(agent.create(core_path("events", namespace), ev), "has no node identity")


async def test_another_member_of_the_agents_group_writes_nothing(
    kube: Kube, agents: dict[str, Kube], nodes: Nodes, namespace: str
) -> None:
    """The group instaslice:nodeagents carries the agent's RBAC; a member whose name is not
    system:instaslice:node:<node> has no node, and the policies match the group, so every
    write is refused (before issue 17 item 11 they matched usernames only: this member wrote
    every Node's status, every allocation, MigNode and Lease)."""
    eve = agents["member"]
    mine = await kube.create(
        instaslice_path("sliceallocations", namespace), _allocation(namespace, nodes.a)
    )
    path = instaslice_path("sliceallocations", namespace, mine["metadata"]["name"])
    await eve.get(path)  # reading is RBAC's, and allowed
    no_node = "has no node identity"
    await _refused(eve.patch(path + "/status", {"status": {"phase": "Ready"}}), no_node)
    await _refused(eve.patch(path, {"metadata": {"finalizers": None}}), no_node)
    await _refused(
        eve.patch(core_path("nodes", name=nodes.a) + "/status",
                  {"status": {"capacity": {"instaslice.io/mig-1g.10gb": "1"}}}),
        no_node,
    )  # fmt: skip
    mig = {"apiVersion": "instaslice.io/v1alpha1", "kind": "MigNode",
           "metadata": {"name": nodes.b}}  # fmt: skip
    await _refused(eve.create(instaslice_path("mignodes"), mig, dryRun="All"), no_node)
    lease = {"metadata": {"name": nodes.b}, "spec": {"holderIdentity": "eve"}}
    await _refused(eve.create(group_path(LEASES, "leases", NS), lease, dryRun="All"), no_node)
    await kube.patch(path, {"metadata": {"finalizers": None}})


async def test_agent_changes_nothing_of_its_node_status_but_instaslice_capacity(
    kube: Kube, agents: dict[str, Kube], nodes: Nodes
) -> None:
    """Issue 17 item 11: the Node rule also checks the status fields other than capacity
    and allocatable (a forged Ready condition, addresses, daemon endpoints) and the labels
    and annotations a status write can carry."""
    agent = agents["cert"]
    status = core_path("nodes", name=nodes.a) + "/status"
    node = await kube.get(core_path("nodes", name=nodes.a))
    conditions = [
        {**c, "status": "False", "reason": "Forged"} if c["type"] == "Ready" else c
        for c in node["status"].get("conditions", [])
    ] or [{"type": "Ready", "status": "False", "reason": "Forged"}]
    for bad in (
        {"status": {"conditions": conditions}},
        {"status": {"addresses": [{"type": "InternalIP", "address": "10.66.66.66"}]}},
        {"status": {"daemonEndpoints": {"kubeletEndpoint": {"Port": 1}}}},
        {"metadata": {"labels": {"node-role.kubernetes.io/control-plane": ""}}},
        {"metadata": {"annotations": {"x.io/forged": "1"}}},
    ):
        await _refused(agent.patch(status, bad), "node agents may change only")
    mine = {"instaslice.io/mig-1g.10gb": "3"}
    await agent.patch(status, {"status": {"capacity": mine, "allocatable": mine}})


async def test_agent_runs_with_exactly_its_rbac(
    control_plane: ControlPlane, kube: Kube, namespace: str, tmp_path: Path
) -> None:
    """Sufficiency: the real agent, as its node's certificate identity and nothing more,
    makes and releases slices, publishes its MigNode, capacity and Lease."""
    node = await gpu_node(kube, tmp_path, ["H100-80GB"], prefix="rbac")
    identity = control_plane.user_kubeconfig(
        f"system:instaslice:node:{node.name}", ("instaslice:nodeagents",)
    )
    try:
        async with running_agent(agent_settings([node], identity)):
            alloc = slice_allocation(namespace, node, [("main", "1g.10gb", 0, 0, 1)])
            await create_allocation(kube, alloc)
            ready = await wait_phase(kube, alloc, "Ready", within=30)
            assert ready["status"]["slices"][0]["migUUID"].startswith("MIG-")
            assert len(node.instances()) == 1

            async def published() -> bool:
                got = await mig_node(kube, node.name)
                n = await kube.get(core_path("nodes", name=node.name))
                lease = await kube.get(group_path(LEASES, "leases", NS, node.name))
                cap = n["status"].get("capacity", {})
                return bool(got and got.get("status", {}).get("gpus")) and bool(
                    cap.get("instaslice.io/mig-1g.10gb") and lease
                )

            await eventually(published, within=30, what="MigNode, capacity and Lease")
            m = alloc["metadata"]
            await kube.delete(instaslice_path("sliceallocations", m["namespace"], m["name"]))
            await wait_gone(kube, alloc, within=30)
            assert node.instances() == []
    finally:
        await kube.delete_ignore_missing(core_path("nodes", name=node.name))


# --- 3. the pod policy: namespaces and identities not covered elsewhere --------------------------


def _device_pod(ns: str, claim: str) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"generateName": "p-", "annotations": {CLAIM_ANNOTATION: claim}},
        "spec": {
            "schedulingGates": [{"name": GATE_NAME}],
            "containers": [{
                "name": "main", "image": "registry.k8s.io/pause:3.10",
                "env": [{"name": "NVIDIA_VISIBLE_DEVICES",
                         "value": f"instaslice.io/mig={ns}_{claim}_main"}],
            }],
        },
    }  # fmt: skip


async def test_pod_policy_holds_in_system_and_opted_out_namespaces(
    kube: Kube, namespace: str
) -> None:
    await kube.patch(
        core_path("namespaces", name=namespace),
        {"metadata": {"labels": {"instaslice.io/enabled": "false"}}},
    )
    # instaslice-system and kube-system are never opted in, whatever their labels say
    opted = {"metadata": {"labels": {"instaslice.io/enabled": "true"}}}
    await kube.patch(core_path("namespaces", name=NS), opted)
    try:
        for ns in ("kube-system", NS, namespace):
            stolen = _device_pod("team-b", "cvictim")  # another pod's device, other namespace
            stolen["spec"]["containers"][0]["env"][0]["value"] = "instaslice.io/mig=team-b_cv_main"
            await _refused(
                kube.create(core_path("pods", ns), stolen, dryRun="All"),
                "ValidatingAdmissionPolicy 'instaslice-pods'",
                "not their own",
                status=422,
            )
            # even its own device, as InstaSlice wires it: InstaSlice's marks only in a
            # namespace that opted in (issue 17 item 3)
            bare = _device_pod(ns, "cmine")
            del bare["spec"]["containers"][0]["env"]
            for pod in (_device_pod(ns, "cmine"), bare):
                await _refused(
                    kube.create(core_path("pods", ns), pod, dryRun="All"),
                    "may only be created in a namespace that opted in",
                    status=422,
                )
    finally:
        off = {"metadata": {"labels": {"instaslice.io/enabled": None}}}
        await kube.patch(core_path("namespaces", name=NS), off)


async def test_node_agent_identity_may_not_ungate_or_reclaim(
    control_plane: ControlPlane, kube: Kube, namespace: str
) -> None:
    """Even given RBAC to edit pods, InstaSlice's other identity is not 'InstaSlice' to the
    pod policy: only the webhook/allocator's ServiceAccount is."""
    role = f"rbac-it-pods-{secrets.token_hex(2)}"
    await kube.create(group_path(RBAC, "clusterroles"), {
        "metadata": {"name": role},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "patch"]}],
    })  # fmt: skip
    await kube.create(group_path(RBAC, "clusterrolebindings"), {
        "metadata": {"name": role},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
        "subjects": [{"kind": "ServiceAccount", "name": "instaslice-nodeagent", "namespace": NS},
                     {"kind": "Group", "apiGroup": "rbac.authorization.k8s.io",
                      "name": "instaslice:nodeagents"}],
    })  # fmt: skip
    try:
        enabled = {ENABLED_KEY: "true"}  # InstaSlice's pods exist only in opted-in namespaces
        await kube.patch(core_path("namespaces", name=namespace),
                         {"metadata": {"annotations": enabled, "labels": enabled}})  # fmt: skip
        pod = await kube.create(core_path("pods", namespace), _device_pod(namespace, "cmine"))
        path = core_path("pods", namespace, pod["metadata"]["name"])
        bare = _device_pod(namespace, "cbare")  # device-plugin mode: no env names a device,
        del bare["spec"]["containers"][0]["env"]  # so only the claim rule speaks
        bare = await kube.create(core_path("pods", namespace), bare)
        bare_path = core_path("pods", namespace, bare["metadata"]["name"])
        agent_ids = (
            (AGENT_SA, SA_GROUPS[:2]),
            ("system:instaslice:node:n1", ("instaslice:nodeagents",)),
        )
        for user, groups in agent_ids:
            async with await Kube.connect(
                str(control_plane.user_kubeconfig(user, groups))
            ) as agent:
                await _wait_readable(agent, path)
                await _refused(
                    agent.patch(path, [{"op": "remove", "path": "/spec/schedulingGates/0"}],
                                "json"),
                    "only InstaSlice may remove",
                )  # fmt: skip
                claim = {"metadata": {"annotations": {CLAIM_ANNOTATION: "cx"}}}
                await _refused(agent.patch(bare_path, claim), "only InstaSlice may set or change")
    finally:
        await kube.delete_ignore_missing(group_path(RBAC, "clusterrolebindings", name=role))
        await kube.delete_ignore_missing(group_path(RBAC, "clusterroles", name=role))


async def test_namespace_mirror_runs_with_exactly_its_rights(
    control_plane: ControlPlane, kube: Kube, namespace: str
) -> None:
    """Sufficiency of the confined controller identity for the namespace mirror: the real
    mirror, as the controller ServiceAccount (its RBAC, under instaslice-controller-namespaces),
    mirrors the annotation both ways; the same identity may not touch another label."""
    identity = control_plane.user_kubeconfig(CONTROLLER, SA_GROUPS[:2])
    path = core_path("namespaces", name=namespace)
    async with await Kube.connect(str(identity)) as controller:
        psa = {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "privileged"}}}
        await _wait_confined(controller, path, psa, "instaslice-controller-namespaces")
        mirror = asyncio.create_task(run_namespace_mirror(controller))
        try:

            async def label_is(value: str | None) -> bool:
                got = await kube.get(path)
                return (got["metadata"].get("labels") or {}).get(ENABLED_KEY) == value

            await kube.patch(path, {"metadata": {"annotations": {ENABLED_KEY: "true"}}})
            await eventually(lambda: label_is("true"), within=30, what="label mirrored")
            await kube.patch(path, {"metadata": {"annotations": {ENABLED_KEY: None}}})
            await eventually(lambda: label_is(None), within=30, what="label removed")
        finally:
            mirror.cancel()
            with pytest.raises(asyncio.CancelledError):
                await mirror


MIGNODES_POLICY = "instaslice-controller-mignodes"


class _Leading:
    """`Writes`' Lease check, always passing: no election here, only the writes."""

    def check(self) -> None:
        return None


async def _reported_mig_node(kube: Kube, name: str, uuids: Iterable[str]) -> str:
    """MigNode `name` whose status (as its node agent writes it) reports GPUs `uuids`."""
    await kube.create(
        instaslice_path("mignodes"),
        {"apiVersion": "instaslice.io/v1alpha1", "kind": "MigNode", "metadata": {"name": name}},
    )
    gpus = [{"index": i, "uuid": u, "model": "A100-SXM4-40GB", "healthy": True,
             "migMode": {"current": "disabled", "pending": "disabled"}}
            for i, u in enumerate(uuids)]  # fmt: skip
    path = instaslice_path("mignodes", name=name)
    await kube.patch(path + "/status", {"status": {"gpuCount": len(gpus), "gpus": gpus}})
    return path


async def test_controller_asks_mig_modes_only_of_the_gpus_a_mig_node_reports(
    control_plane: ControlPlane, kube: Kube
) -> None:
    """Policy instaslice-controller-mignodes, with the allocator's own write code
    (webhook/allocator/writes.py, maintenance.py) as the controller ServiceAccount under its
    RBAC: asking and withdrawing a MIG mode of a reported GPU passes; naming a GPU the status
    does not list, or changing a label, an annotation or a finalizer, is refused; deleting
    the MigNode of a node gone for good passes (`Writes.forget_node`)."""
    name = f"gone-{secrets.token_hex(3)}"  # no Node of that name: gone for good
    path = await _reported_mig_node(kube, name, ["GPU-a", "GPU-b"])
    identity = control_plane.user_kubeconfig(CONTROLLER, SA_GROUPS[:2])
    async with await Kube.connect(str(identity)) as controller:
        writes = Writes(controller, cast(LeaderElector, _Leading()), SystemClock(), "test")
        stray = spec_patch({}, {"GPU-elsewhere": "enabled"}, set())
        await _wait_confined(controller, path, stray, MIGNODES_POLICY)
        vap = group_path(ADMISSIONREG, "validatingadmissionpolicies", name=MIGNODES_POLICY)

        async def type_checked() -> Obj | None:  # against the MigNode CRD's schema
            status: Obj = (await kube.get(vap)).get("status", {})
            return status if "typeChecking" in status else None

        checked = await eventually(type_checked, within=30, what="the policy type-checked")
        assert not checked["typeChecking"].get("expressionWarnings"), checked
        await writes.set_desired_modes(name, spec_patch({}, {"GPU-a": "enabled"}, set()))
        assert desired_modes(await kube.get(path)) == {"GPU-a": "enabled"}
        await writes.set_desired_modes(name, spec_patch({"GPU-a": "enabled"}, {}, {"GPU-a"}))
        assert desired_modes(await kube.get(path)) == {}

        await _refused(
            writes.set_desired_modes(name, spec_patch({}, {"GPU-a": "enabled", "GPU-x": "enabled"},
                                                      set())),
            "instaslice-controller-mignodes", "spec.gpus names GPU-x", "status does not list",
        )  # fmt: skip
        for change in (
            {"metadata": {"labels": {"team": "x"}}},
            {"metadata": {"annotations": {"note": "x"}}},
            {"metadata": {"finalizers": ["example.com/keep"]}},
        ):
            await _refused(controller.patch(path, change), "changes nothing of a MigNode but")
        assert desired_modes(await kube.get(path)) == {}
        assert await writes.forget_node(name, NS)
        assert await mig_node(kube, name) is None


async def test_controllers_group_may_not_make_or_report_mig_nodes(
    control_plane: ControlPlane, kube: Kube
) -> None:
    """A member of the group instaslice:controllers, even with RBAC over MigNodes and their
    status, creates none and writes no status: those are the node agent's."""
    role = f"rbac-it-mignodes-{secrets.token_hex(2)}"
    user = f"controller-{secrets.token_hex(2)}"
    await kube.create(group_path(RBAC, "clusterroles"), {
        "metadata": {"name": role},
        "rules": [{"apiGroups": ["instaslice.io"], "resources": ["mignodes", "mignodes/status"],
                   "verbs": ["get", "create", "patch", "update", "delete"]}],
    })  # fmt: skip
    await kube.create(group_path(RBAC, "clusterrolebindings"), {
        "metadata": {"name": role},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
        "subjects": [{"kind": "User", "apiGroup": "rbac.authorization.k8s.io", "name": user}],
    })  # fmt: skip
    name = f"node-{secrets.token_hex(3)}"
    path = await _reported_mig_node(kube, name, ["GPU-a"])
    try:
        identity = control_plane.user_kubeconfig(user, ("instaslice:controllers",))
        async with await Kube.connect(str(identity)) as controller:
            await _wait_readable(controller, path)
            made = {"apiVersion": "instaslice.io/v1alpha1", "kind": "MigNode",
                    "metadata": {"name": f"{name}-new"}}  # fmt: skip
            await _refused(
                controller.create(instaslice_path("mignodes"), made),
                "instaslice-controller-mignodes", "never CREATE a MigNode",
            )  # fmt: skip
            status = {"status": {"gpuCount": 2}}
            await _refused(
                controller.patch(path + "/status", status), "never UPDATE mignodes/status"
            )
            await controller.patch(path, spec_patch({}, {"GPU-a": "enabled"}, set()))
    finally:
        await kube.delete_ignore_missing(path)
        await kube.delete_ignore_missing(group_path(RBAC, "clusterrolebindings", name=role))
        await kube.delete_ignore_missing(group_path(RBAC, "clusterroles", name=role))


# --- 4. pod security of the manifests (static) ---------------------------------------------------


def _workload(path: Path) -> Obj:
    return next(d for d in yaml.safe_load_all(path.read_text()) if d)


def test_webhook_runs_non_root_read_only_without_capabilities() -> None:
    pod = _workload(BASE / "webhook" / "deployment.yaml")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
    assert not [v for v in pod.get("volumes", []) if "hostPath" in v]
    for c in pod["containers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, c["name"]
        assert sc["readOnlyRootFilesystem"] is True, c["name"]
        assert sc["capabilities"] == {"drop": ["ALL"]}, c["name"]
        assert not sc.get("privileged") and sc.get("runAsUser", 1) != 0, c["name"]
    users = [line.split()[1] for line in (ROOT / "Containerfile.webhook").read_text().splitlines()
             if line.startswith("USER ")]  # fmt: skip
    assert users[-1] not in ("0", "root"), f"the webhook image ends as USER {users[-1]}"


def test_node_agent_is_privileged_only_as_nvml_needs() -> None:
    ds = _workload(BASE / "nodeagent" / "daemonset.yaml")["spec"]["template"]["spec"]
    assert not any(ds.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
    assert [c["name"] for c in ds["containers"]] == ["nodeagent"]
    assert not ds.get("initContainers")
    sc = ds["containers"][0]["securityContext"]
    assert sc["privileged"] is True  # NVML's mig/config capability and the GPUs' device nodes
    assert sc["readOnlyRootFilesystem"] is True
    host = {v["hostPath"]["path"]: v["name"] for v in ds["volumes"] if "hostPath" in v}
    # CDI specs it writes, the toolkit's spec it reads, its checkpoint; the kubelet's
    # device-plugin sockets and PodResources API (device-plugin binding mode)
    read_only = {"/etc/cdi", "/var/lib/kubelet/pod-resources"}
    writable = {"/var/run/cdi", "/var/lib/instaslice", "/var/lib/kubelet/device-plugins"}
    assert set(host) == read_only | writable
    mounts = {m["name"]: m for m in ds["containers"][0]["volumeMounts"]}
    for path in read_only:
        assert mounts[host[path]].get("readOnly") is True, path
