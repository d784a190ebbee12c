"""`make uninstall` (hack/uninstall.py) against a real control plane of its own.

Installs the Kubernetes overlay for real (cert-manager's CRDs first, fetched by
hack/fetch-crds.sh), opts a namespace in, leaves a SliceAllocation holding a slice (with the
release finalizer, as a node agent would) and a Node advertising `instaslice.io/mig-*`. Then:
the uninstall takes the namespace out but stops at its check, deleting nothing; once the
allocation is released (the finalizer dropped, as the agent does), it runs to the end: no
object of InstaSlice's is left (CRDs, hooks, policies, namespace) and the Node's capacity is
clean. A second test holds the namespace with a finalizer: the uninstall must stop at step 4
within its --timeout and say what is still terminating, then finish once that is gone. A third
stops kube-controller-manager: step 4 must say that no namespace controller acted. A fourth
holds the webhook configuration: step 4's first delete must stop within --timeout too.

Uses a private control plane (not the session's): it deletes InstaSlice's CRDs, which the
other integration tests share. Leaves out: node-side files (no host), running webhook pods
(no container runtime: the Deployment's pods never start, which the uninstall must not need).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from hack.cluster import ControlPlane
from tests.integration.private_cluster import hold_a_slice, private_control_plane
from tests.integration.private_cluster import kubectl_ok as _kubectl
from tests.integration.test_manifests import _fetch_dir

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]
ROOT = Path(__file__).resolve().parents[2]
OVERLAY = ROOT / "manifests" / "overlays" / "kubernetes"
NODE = "gpu-uninstall-0"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    with private_control_plane(tmp_path_factory, "uninstall-cp") as cp:
        yield cp


# An uninstall that must succeed: a CRD deleted soon after its install may answer "storage is
# (re)initializing" to the API server's CRD finalizer for a while (its retries back off; seen
# past 60 s under load), so its bound outlasts that. Only a failure waits that long.
STORAGE_SETTLES_S = 180


def _uninstall(cp: ControlPlane, timeout_s: int = 60) -> subprocess.CompletedProcess[str]:
    # step 3 and each of step 4's two waits poll at most timeout_s; the rest are single
    # requests. kubectl's cache is the cluster's own (ControlPlane.kubectl_cache_dir).
    return subprocess.run(
        [sys.executable, "-m", "hack.uninstall", "--overlay", str(OVERLAY),
         "--kubectl", str(cp.kubectl_path), "--kubeconfig", str(cp.kubeconfig),
         "--timeout", f"{timeout_s}s"],
        cwd=ROOT, capture_output=True, text=True, check=False, timeout=4 * timeout_s + 60,
        env={**os.environ, "KUBECACHEDIR": str(cp.kubectl_cache_dir)},
    )  # fmt: skip


def _install(cp: ControlPlane) -> None:
    for f in sorted((_fetch_dir() / "cert-manager").glob("*.yaml")):
        _kubectl(cp, "apply", "--server-side", "-f", str(f))
    _kubectl(cp, "wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")
    rendered = _kubectl(cp, "kustomize", str(OVERLAY))
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    crds = [d for d in docs if d["kind"] == "CustomResourceDefinition"]
    _kubectl(cp, "apply", "--server-side", "-f", "-", stdin=yaml.safe_dump_all(crds))
    _kubectl(cp, "wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")
    _kubectl(cp, "apply", "--server-side", "-f", "-", stdin=rendered)
    assert "mutatingwebhookconfiguration.admissionregistration.k8s.io/instaslice" in (_ours(cp))


def _ours(cp: ControlPlane) -> list[str]:
    """Everything still labelled part-of=instaslice, and InstaSlice's CRDs by name."""
    kinds = "crd,mutatingwebhookconfigurations,validatingadmissionpolicies,clusterroles,namespaces"
    out = _kubectl(cp, "get", kinds, "-l", "app.kubernetes.io/part-of=instaslice", "-o", "name")
    crds = _kubectl(cp, "get", "crd", "-o", "name")
    return sorted(set(out.split()) | {c for c in crds.split() if c.endswith(".instaslice.io")})


def test_uninstall_stops_while_slices_are_held_then_removes_everything(
    cluster: ControlPlane,
) -> None:
    cp = cluster
    _install(cp)

    # a tenant namespace, a slice held there, a node advertising slices
    hold_a_slice(cp, NODE)
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}}
    _kubectl(cp, "create", "-f", "-", stdin=json.dumps(node))
    cap = {"status": {"capacity": {"instaslice.io/mig-1g.18gb": "7", "example.com/other": "1"}}}
    _kubectl(cp, "patch", "node", NODE, "--subresource=status", "--type=merge",
             "-p", json.dumps(cap))  # fmt: skip

    first = _uninstall(cp)
    assert first.returncode == 1, first.stdout + first.stderr
    assert "holds slices: team-a/trainer" in first.stderr
    ns = json.loads(_kubectl(cp, "get", "namespace", "team-a", "-o", "json"))["metadata"]
    assert "instaslice.io/enabled" not in (ns.get("annotations") or {})
    assert "instaslice.io/enabled" not in (ns.get("labels") or {})
    left = _ours(cp)
    assert "customresourcedefinition.apiextensions.k8s.io/sliceallocations.instaslice.io" in left
    assert "namespace/instaslice-system" in left  # nothing was deleted

    # the node agent releases the slice: its finalizer goes, the allocation with it
    _kubectl(cp, "-n", "team-a", "delete", "sliceallocation", "claim-1", "--wait=false")
    _kubectl(cp, "-n", "team-a", "patch", "sliceallocation", "claim-1", "--type=merge",
             "-p", '{"metadata":{"finalizers":null}}')  # fmt: skip

    second = _uninstall(cp, timeout_s=STORAGE_SETTLES_S)
    assert second.returncode == 0, second.stdout + second.stderr
    assert _ours(cp) == []
    status = json.loads(_kubectl(cp, "get", "node", NODE, "-o", "json"))["status"]
    assert not [r for r in status.get("capacity", {}) if r.startswith("instaslice.io/")]
    assert status["capacity"].get("example.com/other") == "1"  # others' resources untouched


def test_uninstall_says_what_holds_the_namespace_when_its_deletion_does_not_finish(
    cluster: ControlPlane,
) -> None:
    """Step 4 waits at most --timeout, then names what is still terminating and why (here a
    ConfigMap whose finalizer nobody removes keeps the namespace); run again once it is gone."""
    cp = cluster
    _install(cp)
    held = {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "held", "namespace": "instaslice-system",
                         "finalizers": ["example.com/hold"]}}  # fmt: skip
    _kubectl(cp, "create", "-f", "-", stdin=json.dumps(held))

    stuck = _uninstall(cp, timeout_s=15)
    assert stuck.returncode == 1, stuck.stdout + stuck.stderr
    assert "[4/5]" not in stuck.stdout  # stopped in step 4, step 5 not run
    assert "still there:" in stuck.stderr, stuck.stderr
    assert "Namespace instaslice-system: " in stuck.stderr
    assert "NamespaceFinalizersRemaining" in stuck.stderr  # the namespace's own why

    _kubectl(cp, "-n", "instaslice-system", "patch", "configmap", "held", "--type=merge",
             "-p", '{"metadata":{"finalizers":null}}')  # fmt: skip
    again = _uninstall(cp, timeout_s=STORAGE_SETTLES_S)
    assert again.returncode == 0, again.stdout + again.stderr
    assert _ours(cp) == []


def test_uninstall_says_when_no_namespace_controller_acts_on_the_namespace(
    cluster: ControlPlane,
) -> None:
    """With kube-controller-manager gone, nothing empties and finalizes the namespace: step 4
    stops at its --timeout and says the namespace controller has not acted (the namespace has
    no condition at all), not a bare "no condition"; with it back, the rerun finishes."""
    cp = cluster
    _install(cp)
    kcm = next(p for p in cp.processes if p.name == "kube-controller-manager")
    os.killpg(kcm.pid, signal.SIGKILL)
    try:
        # nothing can act on the namespace: a short --timeout proves the stop as well
        stuck = _uninstall(cp, timeout_s=5)
        assert stuck.returncode == 1, stuck.stdout + stuck.stderr
        assert "[4/5]" not in stuck.stdout
        assert "Namespace instaslice-system: no condition at all" in stuck.stderr, stuck.stderr
        assert "is kube-controller-manager running?" in stuck.stderr
    finally:
        assert cp.restart_exited() == ["kube-controller-manager"]
    again = _uninstall(cp, timeout_s=STORAGE_SETTLES_S)
    assert again.returncode == 0, again.stdout + again.stderr
    assert _ours(cp) == []


def test_uninstall_bounds_the_wait_for_the_admission_hooks_too(cluster: ControlPlane) -> None:
    """Step 4's first delete (the webhook configuration, the policies) waits for what it
    deleted as well: held by a finalizer, the uninstall stops within --timeout naming it,
    deleting nothing else (it once waited kubectl's default of a week)."""
    cp = cluster
    _install(cp)
    hook = "mutatingwebhookconfiguration/instaslice"
    _kubectl(cp, "patch", hook, "--type=merge", "-p",
             '{"metadata":{"finalizers":["example.com/hold"]}}')  # fmt: skip

    stuck = _uninstall(cp, timeout_s=3)  # the finalizer holds it: no wait could end sooner
    assert stuck.returncode == 1, stuck.stdout + stuck.stderr
    assert (
        "the admission hooks are still there after 3s: "
        "mutatingwebhookconfiguration.admissionregistration.k8s.io/instaslice"
    ) in stuck.stderr, stuck.stderr
    assert "namespace/instaslice-system" in _ours(cp)  # the overlay's delete was not reached

    _kubectl(cp, "patch", hook, "--type=merge", "-p", '{"metadata":{"finalizers":null}}')
    again = _uninstall(cp, timeout_s=STORAGE_SETTLES_S)
    assert again.returncode == 0, again.stdout + again.stderr
    assert _ours(cp) == []
