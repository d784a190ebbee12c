"""The Helm chart's lifecycle: CRDs kept, and the uninstall hooks' logic on a real API server.

- Render: the CRDs carry `helm.sh/resource-policy: keep`; the hook Jobs (pre-delete and
  post-delete) run `instaslice-uninstall` with the webhook's image, their own ServiceAccount,
  the release's namespace and a selector naming the release; the hook RBAC objects are hooks
  of both phases, deleted when they succeed.
- Logic, with the hook ServiceAccount's own rights (the rendered ClusterRole, applied to a
  private control plane, and a kubeconfig that RBAC treats as that ServiceAccount): the
  pre-delete phase takes the namespaces out and refuses while a slice is held, deleting
  nothing; with the allocation being released, it waits (on a watch) until the node agent's
  finalizer goes, then deletes the release's admission hooks and keeps the CRDs. The
  post-delete phase refuses while a node agent or webhook pod is left, then cleans the Nodes'
  `instaslice.io/*` capacity and deletes the webhook certificate's Secret (made at run time,
  so Helm would leave it), and nothing else.

Uses a private control plane (it deletes the admission policies other modules share).
Leaves out: a real `helm uninstall` running the Jobs (no kubelet here: tests/e2e on an
`install: chart` cluster).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from hack.cluster import ControlPlane
from tests.integration import test_helm_chart as chart
from tests.integration import test_manifests as manifests
from tests.integration.private_cluster import hold_a_slice, private_control_plane
from tests.integration.private_cluster import kubectl_ok as _kubectl

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
helm = chart.helm
NS = "instaslice-system"
NODE = "gpu-hook-0"
SA = "instaslice-uninstall"
SELECTOR = "app.kubernetes.io/part-of=instaslice,app.kubernetes.io/instance=instaslice"
ROOT = Path(__file__).resolve().parents[2]


def _hooks(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if "helm.sh/hook" in (d["metadata"].get("annotations") or {})]


def test_crds_are_kept_on_uninstall(helm: Path) -> None:
    docs = manifests._docs(chart.helm_template(helm).stdout)
    crds = [d for d in docs if d["kind"] == "CustomResourceDefinition"]
    assert len(crds) == 2
    for crd in crds:
        assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_uninstall_hook_jobs(helm: Path) -> None:
    sets = ("images.webhook.digest=sha256:" + "cd" * 32, "uninstallHook.timeoutSeconds=42")
    docs = _hooks(manifests._docs(chart.helm_template(helm, *sets, namespace="gpu-ops").stdout))
    jobs = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Job"}
    assert set(jobs) == {"instaslice-uninstall-pre-delete", "instaslice-uninstall-post-delete"}
    for phase in ("pre-delete", "post-delete"):
        job = jobs[f"instaslice-uninstall-{phase}"]
        ann = job["metadata"]["annotations"]
        assert ann["helm.sh/hook"] == phase
        assert ann["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
        assert job["metadata"]["namespace"] == "gpu-ops"
        assert job["spec"]["backoffLimit"] == 0
        pod = job["spec"]["template"]["spec"]
        assert (pod["serviceAccountName"], pod["restartPolicy"]) == (SA, "Never")
        (c,) = pod["containers"]
        assert c["image"] == "quay.io/instaslice/instaslice-webhook@sha256:" + "cd" * 32
        assert c["command"] == ["instaslice-uninstall"]
        assert c["args"] == [
            f"--phase={phase}",
            "--namespace=gpu-ops",
            f"--selector={SELECTOR}",  # the release's name: helm_template's `instaslice`
            "--timeout=42",
            *(["--secret=instaslice-webhook-tls"] if phase == "post-delete" else []),
        ]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
    rbac = [d for d in docs if d["kind"] != "Job"]
    assert {d["kind"] for d in rbac} == {
        "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"
    }  # fmt: skip
    (role,) = [d for d in rbac if d["kind"] == "Role"]  # the certificate's Secrets, by name
    assert role["metadata"]["namespace"] == "gpu-ops"
    names = ["instaslice-webhook-tls", "instaslice-ca"]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["delete"], "resourceNames": names}
    ]
    for d in rbac:  # there while either phase's Job runs, gone when it succeeded
        assert d["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete,post-delete"
        assert int(d["metadata"]["annotations"]["helm.sh/hook-weight"]) < 0


# --- the logic, on a private control plane --------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    with private_control_plane(tmp_path_factory, "hooks-cp") as cp:
        yield cp


def _hook_cmd(cp: ControlPlane, phase: str, timeout_s: int, *more: str) -> list[str]:
    kubeconfig = cp.service_account_kubeconfig(NS, SA)
    return [sys.executable, "-m", "webhook.uninstall", f"--phase={phase}",
            f"--kubeconfig={kubeconfig}", f"--namespace={NS}", f"--selector={SELECTOR}",
            f"--timeout={timeout_s}", *more]  # fmt: skip


def _run(
    cp: ControlPlane, phase: str, timeout_s: int = 30, *more: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_hook_cmd(cp, phase, timeout_s, *more), cwd=ROOT, capture_output=True,
                          text=True, check=False, timeout=timeout_s + 60)  # fmt: skip


@pytest.fixture(scope="module")
def installed(cluster: ControlPlane, helm: Path) -> ControlPlane:
    """The chart's CRDs, admission hooks and uninstall-hook RBAC, as Helm would apply them."""
    cp = cluster
    docs = manifests._docs(chart.helm_template(helm).stdout)
    crds = [d for d in docs if d["kind"] == "CustomResourceDefinition"]
    _kubectl(cp, "apply", "--server-side", "-f", "-", stdin=yaml.safe_dump_all(crds))
    _kubectl(cp, "wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")
    _kubectl(cp, "create", "namespace", NS)
    kinds = {"MutatingWebhookConfiguration", "ValidatingAdmissionPolicy",
             "ValidatingAdmissionPolicyBinding"}  # fmt: skip
    picked = [d for d in docs if d["kind"] in kinds]
    picked += [d for d in _hooks(docs) if d["kind"] != "Job"]
    _kubectl(cp, "apply", "--server-side", "-f", "-", stdin=yaml.safe_dump_all(picked))
    return cp


def _admission_hooks(cp: ControlPlane) -> list[str]:
    kinds = ",".join(("mutatingwebhookconfigurations", "validatingadmissionpolicies",
                      "validatingadmissionpolicybindings"))  # fmt: skip
    return _kubectl(cp, "get", kinds, "-l", SELECTOR, "-o", "name").split()


def test_pre_delete_refuses_while_a_slice_is_held_then_waits_for_its_release(
    installed: ControlPlane,
) -> None:
    cp = installed
    hold_a_slice(cp, NODE)
    hooks = _admission_hooks(cp)
    assert "mutatingwebhookconfiguration.admissionregistration.k8s.io/instaslice" in hooks

    refused = _run(cp, "pre-delete")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "holds slices: team-a/trainer" in refused.stderr
    ns = json.loads(_kubectl(cp, "get", "namespace", "team-a", "-o", "json"))["metadata"]
    assert "instaslice.io/enabled" not in (ns.get("annotations") or {})
    assert "instaslice.io/enabled" not in (ns.get("labels") or {})
    assert _admission_hooks(cp) == hooks  # nothing deleted

    # the node agent is releasing it: deleted, its finalizer still on
    _kubectl(cp, "-n", "team-a", "delete", "sliceallocation", "claim-1", "--wait=false")
    with subprocess.Popen(_hook_cmd(cp, "pre-delete", 120), cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:  # fmt: skip
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:  # waits until step 3 watches
            lines.append(line)
            if line.startswith("[2/5]"):
                break
        assert lines and lines[-1].startswith("[2/5]"), lines
        assert proc.poll() is None, "step 3 did not wait for the finalizer"
        _kubectl(cp, "-n", "team-a", "patch", "sliceallocation", "claim-1", "--type=merge",
                 "-p", '{"metadata":{"finalizers":null}}')  # fmt: skip
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, "".join(lines) + out + err
    assert "[3/5] no SliceAllocation left" in out
    assert _admission_hooks(cp) == []
    crds = _kubectl(cp, "get", "crd", "-o", "name").split()
    assert "customresourcedefinition.apiextensions.k8s.io/sliceallocations.instaslice.io" in crds


def _secrets(cp: ControlPlane) -> list[str]:
    return sorted(_kubectl(cp, "-n", NS, "get", "secrets", "-o", "name").split())


def test_post_delete_waits_for_the_pods_then_cleans_capacity_and_the_certificate(
    installed: ControlPlane,
) -> None:
    cp = installed
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}}
    _kubectl(cp, "create", "-f", "-", stdin=json.dumps(node))
    cap = {"status": {"capacity": {"instaslice.io/mig-1g.18gb": "7", "example.com/other": "1"}}}
    _kubectl(cp, "patch", "node", NODE, "--subresource=status", "--type=merge",
             "-p", json.dumps(cap))  # fmt: skip
    for name in ("instaslice-nodeagent", "instaslice-webhook"):
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": f"{name}-x", "namespace": NS,
                            "labels": {"app.kubernetes.io/name": name}},
               "spec": {"containers": [{"name": "a", "image": "x"}]}}  # fmt: skip
        _kubectl(cp, "create", "-f", "-", stdin=json.dumps(pod))
    # the webhook's own certificate (webhook/selfcert.py), and a Secret that is not ours
    for name in ("instaslice-webhook-tls", "someone-elses"):
        _kubectl(cp, "-n", NS, "create", "secret", "generic", name, "--from-literal=k=v")
    secret = "--secret=instaslice-webhook-tls"

    waiting = _run(cp, "post-delete", 2, secret)
    assert waiting.returncode == 1, waiting.stdout + waiting.stderr
    assert "pods still there" in waiting.stderr, waiting.stderr
    assert "instaslice-nodeagent-x" in waiting.stderr and "instaslice-webhook-x" in waiting.stderr
    status = json.loads(_kubectl(cp, "get", "node", NODE, "-o", "json"))["status"]
    assert status["capacity"]["instaslice.io/mig-1g.18gb"] == "7"  # untouched
    assert "secret/instaslice-webhook-tls" in _secrets(cp)  # a webhook could write it again

    _kubectl(cp, "-n", NS, "delete", "pod", "instaslice-nodeagent-x", "--wait=true")
    still = _run(cp, "post-delete", 2, secret)  # the webhook's pod alone holds it back
    assert still.returncode == 1 and "instaslice-webhook-x" in still.stderr, still.stderr
    _kubectl(cp, "-n", NS, "delete", "pod", "instaslice-webhook-x", "--wait=true")
    done = _run(cp, "post-delete", 30, secret)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Secrets deleted: instaslice-webhook-tls" in done.stdout, done.stdout
    status = json.loads(_kubectl(cp, "get", "node", NODE, "-o", "json"))["status"]
    assert not [r for r in status.get("capacity", {}) if r.startswith("instaslice.io/")]
    assert status["capacity"].get("example.com/other") == "1"  # others' resources untouched
    left = _secrets(cp)
    assert "secret/instaslice-webhook-tls" not in left and "secret/someone-elses" in left, left
    again = _run(cp, "post-delete", 30, secret)  # idempotent: an uninstall run again
    assert again.returncode == 0 and "none were left" in again.stdout, again.stdout


def test_cert_manager_mode_also_deletes_its_ca_secret(helm: Path) -> None:
    """cert-manager keeps a deleted Certificate's Secret (its default): both go too."""
    docs = manifests._docs(chart.helm_template(helm, "certificates.mode=cert-manager").stdout)
    (job,) = [d for d in docs if d["metadata"]["name"] == "instaslice-uninstall-post-delete"]
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[-2:] == ["--secret=instaslice-webhook-tls", "--secret=instaslice-ca"], args
