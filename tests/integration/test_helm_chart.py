"""The Helm chart charts/instaslice: generated from manifests/, and as good as the overlay.

- The committed chart is exactly what `make chart` (hack/gen_chart.py) generates from the
  current manifests/, so it cannot drift from the kustomize base.
- `helm template` (helm from hack/helm/build.sh) renders the same objects as
  `kubectl kustomize` of the Kubernetes overlay: with default values, with `bindingMode=env`
  (= the component binding-env) and with `monitoring.enabled=true` (= the component monitoring).
- Its renderings pass `kubectl apply --dry-run=server --validate=strict` against the local
  control plane, with the same third-party CRDs as tests/integration/test_manifests.py (whose
  fixtures this module reuses), with no warnings.
- values.schema.json refuses a binding mode that does not exist, a single webhook replica and
  an empty metrics namespace selector (every namespace); `helm lint --strict` passes.
- `metricsNamespaceSelector` decides who reaches the metrics ports: the default admits the
  namespace `monitoring` only, OpenShift's two namespaces when set so (the NetworkPolicies
  read as test_manifests.py reads the overlays').

Leaves out: `helm install`/`upgrade` for real (the MutatingWebhookConfiguration would
intercept every pod of the shared control plane, and no cert-manager runs to issue its
certificate); the chart's NOTES.txt.
"""

from __future__ import annotations

import copy
import filecmp
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from hack.cluster import ControlPlane
from hack.cluster.bins import BinariesMissing, find_bin_dir, find_helm
from hack.gen_chart import (
    CHART_DIR,
    KEEP,
    build_chart,
    project_version,
    render_variants,
    write_chart,
)
from tests.integration import test_manifests as manifests

pytestmark = pytest.mark.integration

# the fixtures of test_manifests.py, registered in this module too
fetched = manifests.fetched
third_party_crds = manifests.third_party_crds
rendered = manifests.rendered
instaslice_namespace = manifests.instaslice_namespace
instaslice_crds = manifests.instaslice_crds

# chart values -> the kustomize rendering they must equal (render_variants' names)
# (the overlay's certificates come from cert-manager; the chart's default is self, test_helm_values)
CM = "certificates.mode=cert-manager"
VALUES = {
    "default": ((CM,), "default"),
    "binding-env": ((CM, "bindingMode=env"), "binding-env"),
    "monitoring": ((CM, "monitoring.enabled=true"), "monitoring"),
    "metrics-auth": ((CM, "metricsAuth.enabled=true"), "metrics-auth"),
    "monitoring-auth": (
        (CM, "monitoring.enabled=true", "metricsAuth.enabled=true"),
        "monitoring-auth",
    ),
    "dra": ((CM, "allocationMode=dra"), "dra"),
    "binding-env+dra": ((CM, "bindingMode=env", "allocationMode=dra"), "binding-env+dra"),
}


@pytest.fixture(scope="module")
def helm() -> Path:
    try:
        return find_helm()
    except BinariesMissing as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="module")
def kubectl() -> Path:
    try:
        return find_bin_dir() / "kubectl"
    except BinariesMissing as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="module")
def variants(kubectl: Path) -> dict[str, list[dict[str, Any]]]:
    return render_variants(kubectl)


# what Helm adds to every object and pod (the chart's standard labels), not in kustomize's
HELM_LABELS = (
    "helm.sh/chart",
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
)


def helm_template(
    helm: Path, *sets: str, check: bool = True, namespace: str = manifests.NAMESPACE
) -> subprocess.CompletedProcess[str]:
    args = [str(helm), "template", "instaslice", str(CHART_DIR), "--namespace", namespace]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.run(args, capture_output=True, text=True, check=False)
    if check:
        assert proc.returncode == 0, f"helm template {sets} failed:\n{proc.stderr}"
    return proc


def without_helm_labels(d: dict[str, Any]) -> dict[str, Any]:
    """d without the standard labels Helm adds (on the object and on its pod template)."""
    d = copy.deepcopy(d)
    metas = [d["metadata"], ((d.get("spec") or {}).get("template") or {}).get("metadata") or {}]
    for meta in metas:
        labels = meta.get("labels") or {}
        for k in HELM_LABELS:
            labels.pop(k, None)
        if "labels" in meta and not labels:
            del meta["labels"]
    annotations = d["metadata"].get("annotations") or {}
    kept = d["kind"] == "CustomResourceDefinition" and annotations.pop(KEEP[0], None) == KEEP[1]
    if kept and not annotations:
        del d["metadata"]["annotations"]
    return d


def _by_identity(docs: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    out = {}
    for d in docs:
        key = (d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"])
        assert key not in out, f"{key} rendered twice"
        out[key] = d
    return out


def test_committed_chart_is_what_the_generator_makes(
    variants: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    version = project_version()
    out = tmp_path / "chart"
    write_chart(build_chart(variants, version), out)
    committed = {p.relative_to(CHART_DIR) for p in CHART_DIR.rglob("*") if p.is_file()}
    generated = {p.relative_to(out) for p in out.rglob("*") if p.is_file()}
    assert committed == generated, (
        f"charts/instaslice is stale: only committed {sorted(committed - generated)}, "
        f"only generated {sorted(generated - committed)}; run `make chart`"
    )
    stale = [str(p) for p in sorted(committed) if not filecmp.cmp(CHART_DIR / p, out / p, False)]
    assert not stale, f"charts/instaslice is stale ({stale}); run `make chart`"


@pytest.mark.parametrize("values", VALUES)
def test_chart_renders_the_overlays_objects(
    helm: Path, variants: dict[str, list[dict[str, Any]]], values: str
) -> None:
    """Into the manifests' namespace, less Helm's labels, the CRDs' keep annotation and the
    uninstall hooks (test_helm_hooks.py): the same objects but the Namespace itself (the
    release's, `--create-namespace`)."""
    sets, variant = VALUES[values]
    docs = manifests._docs(helm_template(helm, *sets).stdout)
    hooks = [d for d in docs if "helm.sh/hook" in (d["metadata"].get("annotations") or {})]
    assert {d["kind"] for d in hooks} == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding",
                                          "Role", "RoleBinding", "Job"}  # fmt: skip
    own = [
        d for d in docs if d["metadata"]["name"] == "instaslice-grafana-dashboard"
    ]  # dashboards/
    chart = _by_identity([without_helm_labels(d) for d in docs if d not in hooks + own])
    kustomize = _by_identity([o for o in variants[variant] if o["kind"] != "Namespace"])
    assert chart.keys() == kustomize.keys(), (
        f"only in the chart: {sorted(chart.keys() - kustomize.keys())}; "
        f"only in kustomize: {sorted(kustomize.keys() - chart.keys())}"
    )
    differ = [k for k in chart if chart[k] != kustomize[k]]
    assert not differ, f"{values}: objects differ from kustomize's: {differ}"


def test_chart_values_reach_the_objects(helm: Path) -> None:
    """The parameterised values land where the overlay's would (and the comparison above is
    not blind: other values give other objects)."""
    docs = manifests._docs(
        helm_template(
            helm,
            "images.webhook.repository=registry.example/wh",
            "images.nodeagent.tag=v9",
            "webhook.replicas=3",
            "nodeagent.resources.limits.memory=1Gi",
        ).stdout
    )
    objs = _by_identity(docs)
    deploy = objs[("Deployment", "instaslice-system", "instaslice-webhook")]
    ds = objs[("DaemonSet", "instaslice-system", "instaslice-nodeagent")]
    assert deploy["spec"]["replicas"] == 3
    assert deploy["spec"]["template"]["spec"]["containers"][0]["image"] == (
        "registry.example/wh:v0.1.0"
    )
    (agent,) = ds["spec"]["template"]["spec"]["containers"]
    assert agent["image"] == "quay.io/instaslice/instaslice-nodeagent:v9"
    assert agent["resources"]["limits"]["memory"] == "1Gi"
    webhook_mode, agent_mode = manifests.binding_modes(
        manifests._docs(helm_template(helm, "bindingMode=env").stdout)
    )
    assert (webhook_mode, agent_mode) == ("env", "env")


@pytest.mark.parametrize("sets", [(), ("bindingMode=env", "monitoring.enabled=true")])
def test_helm_lint_strict(helm: Path, sets: tuple[str, ...]) -> None:
    args = [str(helm), "lint", "--strict", str(CHART_DIR)]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.run(args, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"helm lint --strict {sets}:\n{proc.stdout}{proc.stderr}"


def test_the_metrics_namespace_selector_decides_who_scrapes(helm: Path) -> None:
    manifests.check_policies(
        manifests._docs(helm_template(helm).stdout), manifests.SCRAPERS["kubernetes"]
    )
    expr = "metricsNamespaceSelector.matchExpressions[0]"
    openshift = (  # --set replaces a list whole: all of the item's fields
        f"{expr}.key=kubernetes.io/metadata.name",
        f"{expr}.operator=In",
        f"{expr}.values={{openshift-monitoring,openshift-user-workload-monitoring}}",
    )
    manifests.check_policies(
        manifests._docs(helm_template(helm, *openshift).stdout), manifests.SCRAPERS["openshift"]
    )


@pytest.mark.parametrize(
    ("value", "complaint"),
    [
        ("bindingMode=bogus", "bindingMode"),
        ("allocationMode=bogus", "allocationMode"),
        ("webhook.replicas=1", "replicas"),
        # `{}` would admit every namespace (Helm merges maps: null removes the default's key)
        ("metricsNamespaceSelector.matchExpressions=null", "metricsNamespaceSelector"),
    ],
)
def test_schema_refuses_bad_values(helm: Path, value: str, complaint: str) -> None:
    proc = helm_template(helm, value, check=False)
    assert proc.returncode != 0, f"helm template --set {value} was accepted"
    assert complaint in proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def crds_served(
    control_plane: ControlPlane, third_party_crds: list[str], instaslice_crds: None
) -> None:
    """Every CRD's objects can be listed (its watch cache is initialised). Without this the
    CRDs, installed just before this module's two dry-runs, are deleted again within seconds,
    and the apiserver's CRD finalizer then failed ("storage is (re)initializing") and held the
    teardown's `kubectl delete --wait` for ~290 s, in 2 of 6 runs."""
    names = [*third_party_crds, "mignodes.instaslice.io", "sliceallocations.instaslice.io"]
    deadline = time.monotonic() + 60
    for name in names:
        while True:
            proc = control_plane.kubectl("get", name, "-A", "-o", "name", check=False)
            if proc.returncode == 0:
                break
            assert time.monotonic() < deadline, f"cannot list {name}: {proc.stderr}"
            time.sleep(0.5)


@pytest.mark.parametrize(
    "sets",
    [(), ("bindingMode=env", "monitoring.enabled=true", "metricsAuth.enabled=true")],
    ids=["default", "env+monitoring+auth"],
)
def test_chart_passes_server_side_dry_run(
    control_plane: ControlPlane,
    helm: Path,
    crds_served: None,
    instaslice_namespace: str,
    sets: tuple[str, ...],
) -> None:
    text = helm_template(helm, *sets).stdout
    manifests.dry_run_server(control_plane, text, f"helm template {sets}")
