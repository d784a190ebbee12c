"""Every shipped manifest passes the real apiserver's schema and admission checks.

For each overlay (manifests/overlays/kubernetes, manifests/overlays/openshift): render it with
the control plane's own `kubectl kustomize`, install for real what it depends on — the
third-party CRDs (cert-manager's, OpenShift's SecurityContextConstraints; fetched from their
Go modules by hack/fetch-crds.sh), InstaSlice's CRDs and the instaslice-system Namespace —
then `kubectl apply --dry-run=server` the whole rendering with strict field validation. Also
checks skaffold.yaml against skaffold's own JSON schema (fetched the same way).

Leaves out: anything that needs a running cert-manager, service-CA operator, OpenShift SCC
admission or a container engine (the certificate is never issued, the SCC never enforced,
the images never built or pulled). What the test installs for real is removed afterwards,
unless it was there before (InstaSlice's CRDs may be, from other tests).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from hack.cluster import ControlPlane

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ("kubernetes", "openshift")
NAMESPACE = "instaslice-system"


def _fetch_dir() -> Path:
    proc = subprocess.run(
        [str(ROOT / "hack" / "fetch-crds.sh")], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, f"hack/fetch-crds.sh failed:\n{proc.stderr}"
    return Path(proc.stdout.strip().splitlines()[-1])


def _ok(proc: subprocess.CompletedProcess[str], what: str) -> str:
    assert proc.returncode == 0, f"{what} failed (rc {proc.returncode}):\n{proc.stderr}"
    return proc.stdout


def _docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def _exists(cp: ControlPlane, kind: str, name: str) -> bool:
    return (
        cp.kubectl("get", kind, name, "--ignore-not-found", "-o", "name", check=False).stdout != ""
    )


@pytest.fixture(scope="module")
def fetched() -> Path:
    return _fetch_dir()


@pytest.fixture(scope="module")
def third_party_crds(control_plane: ControlPlane, fetched: Path) -> Iterator[list[str]]:
    """cert-manager's and OpenShift's SCC CRDs, installed for real and Established."""
    files = sorted((fetched / "cert-manager").glob("*.yaml")) + sorted(
        (fetched / "openshift").glob("*.yaml")
    )
    names = [_docs(f.read_text())[0]["metadata"]["name"] for f in files]
    ours = [n for n in names if not _exists(control_plane, "crd", n)]
    args = [a for f in files for a in ("-f", str(f))]
    # server-side: cert-manager's CRDs are too big for the last-applied annotation
    _ok(control_plane.kubectl("apply", "--server-side", *args, check=False), "installing CRDs")
    _ok(
        control_plane.kubectl(
            "wait", "--for=condition=Established", "--timeout=60s",
            *(f"crd/{n}" for n in names), check=False,
        ),
        "waiting for CRDs",
    )  # fmt: skip
    yield names
    if ours:
        control_plane.kubectl("delete", "--wait=true", *(f"crd/{n}" for n in ours), check=False)


@pytest.fixture(scope="module")
def rendered(control_plane: ControlPlane) -> dict[str, str]:
    return {
        o: _ok(
            control_plane.kubectl(
                "kustomize", str(ROOT / "manifests" / "overlays" / o), check=False
            ),
            f"kubectl kustomize manifests/overlays/{o}",
        )
        for o in OVERLAYS
    }


@pytest.fixture(scope="module")
def instaslice_namespace(control_plane: ControlPlane) -> Iterator[str]:
    """Namespaced objects cannot be dry-run into a namespace that does not exist."""
    created = not _exists(control_plane, "namespace", NAMESPACE)
    if created:
        _ok(control_plane.kubectl("create", "namespace", NAMESPACE, check=False), "namespace")
    yield NAMESPACE
    if created:
        control_plane.kubectl("delete", "namespace", NAMESPACE, "--wait=true", check=False)


@pytest.fixture(scope="module")
def instaslice_crds(control_plane: ControlPlane, rendered: dict[str, str]) -> Iterator[None]:
    """InstaSlice's CRDs, installed for real: custom resources are checked against them."""
    crds = [d for d in _docs(rendered["kubernetes"]) if d["kind"] == "CustomResourceDefinition"]
    assert {c["spec"]["group"] for c in crds} == {"instaslice.io"}
    names = [f"crd/{c['metadata']['name']}" for c in crds]
    ours = [n for n in names if not _exists(control_plane, *n.split("/"))]
    _ok(
        control_plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                              stdin=yaml.safe_dump_all(crds), check=False),
        "installing InstaSlice CRDs",
    )  # fmt: skip
    _ok(
        control_plane.kubectl(
            "wait", "--for=condition=Established", "--timeout=60s", *names, check=False
        ),
        "waiting for InstaSlice CRDs",
    )
    yield
    if ours:
        control_plane.kubectl("delete", "--wait=true", *ours, check=False)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_what_the_platform_needs(rendered: dict[str, str], overlay: str) -> None:
    docs = _docs(rendered[overlay])
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for kind in (
        "Namespace",
        "CustomResourceDefinition",
        "Deployment",
        "DaemonSet",
        "Service",
        "MutatingWebhookConfiguration",
        "ValidatingAdmissionPolicy",
        "PodDisruptionBudget",
        "NetworkPolicy",
    ):
        assert any(k == kind for k, _ in kinds), f"{overlay}: no {kind} rendered"
    namespaced = [d for d in docs if d["kind"] not in _CLUSTER_SCOPED and d["kind"] != "Namespace"]
    for d in namespaced:
        assert d["metadata"].get("namespace") == NAMESPACE, f"{d['kind']}/{d['metadata']['name']}"
    for d in docs:
        if d["kind"] in _CLUSTER_SCOPED:
            assert "namespace" not in d["metadata"], f"{d['kind']}/{d['metadata']['name']}"
    images = {
        c["image"]
        for d in docs
        if d["kind"] in ("Deployment", "DaemonSet")
        for c in d["spec"]["template"]["spec"]["containers"]
    }
    assert all(i.startswith("quay.io/instaslice/") for i in images), images
    mwc = [d for d in docs if d["kind"] == "MutatingWebhookConfiguration"]
    annotations = {k for m in mwc for k in m["metadata"].get("annotations", {})}
    if overlay == "kubernetes":
        assert "cert-manager.io/inject-ca-from" in annotations
        assert any(d["kind"] == "Certificate" for d in docs)
    else:
        assert "service.beta.openshift.io/inject-cabundle" in annotations
        services = [d for d in docs if d["kind"] == "Service"]
        assert any(
            "service.beta.openshift.io/serving-cert-secret-name"
            in s["metadata"].get("annotations", {})
            for s in services
        )
        assert ("SecurityContextConstraints", "instaslice-nodeagent") in kinds


_CLUSTER_SCOPED = {
    "CustomResourceDefinition",
    "ClusterRole",
    "ClusterRoleBinding",
    "MutatingWebhookConfiguration",
    "ValidatingWebhookConfiguration",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
    "MutatingAdmissionPolicy",
    "MutatingAdmissionPolicyBinding",
    "SecurityContextConstraints",
    "PriorityClass",
    "ClusterIssuer",
}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_passes_server_side_dry_run(
    control_plane: ControlPlane,
    third_party_crds: list[str],
    instaslice_crds: None,
    instaslice_namespace: str,
    rendered: dict[str, str],
    overlay: str,
) -> None:
    docs = _docs(rendered[overlay])
    proc = control_plane.kubectl(
        "apply", "--dry-run=server", "--validate=strict", "-f", "-",
        stdin=rendered[overlay], check=False,
    )  # fmt: skip
    out = _ok(proc, f"kubectl apply --dry-run=server (overlay {overlay})")
    applied = [line for line in out.splitlines() if line.endswith("(server dry run)")]
    assert len(applied) == len(docs), out
    # Warnings are findings (deprecated APIs, Pod Security, duplicate ports), except kubectl's
    # note about objects this test (or another) created without client-side apply.
    warnings = [
        line
        for line in proc.stderr.splitlines()
        if line.startswith("Warning:") and "last-applied-configuration" not in line
    ]
    assert not warnings, "\n".join(warnings)


def test_dry_run_really_checks_third_party_schemas(
    control_plane: ControlPlane, third_party_crds: list[str], instaslice_namespace: str
) -> None:
    """The negative control: a Certificate with a misspelt field is refused, so the passing
    dry-runs above were checked against the CRD schema, not waved through."""
    bad = {
        "apiVersion": "cert-manager.io/v1",
        "kind": "Certificate",
        "metadata": {"name": "bad", "namespace": NAMESPACE},
        "spec": {"secretName": "x", "dnsName": ["a"], "issuerRef": {"name": "i"}},
    }
    proc = control_plane.kubectl(
        "apply", "--dry-run=server", "--validate=strict", "-f", "-",
        stdin=json.dumps(bad), check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "dnsName" in proc.stderr


# --- skaffold.yaml against skaffold's JSON schema ------------------------------------------------


class SchemaError(AssertionError):
    pass


def _validate(value: Any, schema: dict[str, Any], defs: dict[str, Any], path: str) -> None:
    """The draft-07 subset skaffold's schema uses: $ref, type, properties, required,
    additionalProperties, items, enum, anyOf."""
    if "$ref" in schema:
        _validate(value, defs[schema["$ref"].removeprefix("#/definitions/")], defs, path)
        return
    if "anyOf" in schema:
        errors = []
        for i, alt in enumerate(schema["anyOf"]):
            try:
                _validate(value, alt, defs, path)
            except SchemaError as e:
                errors.append(f"  [{i}] {e}")
            else:
                break
        else:
            raise SchemaError(f"{path}: matches no alternative:\n" + "\n".join(errors))
    types: dict[str, type | tuple[type, ...]] = {
        "object": dict,
        "array": list,
        "string": str,
        "boolean": bool,
        "integer": int,
        "number": (int, float),
    }
    t = schema.get("type")
    if t is not None:
        ok = isinstance(value, types[t]) and not (t in ("integer", "number") and value is True)
        if not ok:
            raise SchemaError(f"{path}: expected {t}, got {type(value).__name__}")
    if "enum" in schema and value not in schema["enum"]:
        raise SchemaError(f"{path}: {value!r} not in {schema['enum']}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                raise SchemaError(f"{path}: missing {key}")
        for key, v in value.items():
            if key in props:
                _validate(v, props[key], defs, f"{path}.{key}")
            elif schema.get("additionalProperties") is False:
                raise SchemaError(f"{path}: unknown field {key!r}")
            elif isinstance(schema.get("additionalProperties"), dict):
                _validate(v, schema["additionalProperties"], defs, f"{path}.{key}")
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            _validate(v, schema["items"], defs, f"{path}[{i}]")


def test_skaffold_config_matches_skaffolds_schema(fetched: Path) -> None:
    config = yaml.safe_load((ROOT / "skaffold.yaml").read_text())
    version = config["apiVersion"].removeprefix("skaffold/")
    schema = json.loads((fetched / "skaffold" / f"{version}.json").read_text())
    _validate(config, schema, schema["definitions"], "skaffold.yaml")
    # and the validator is not a rubber stamp
    broken = {**config, "build": {**config["build"], "artifact": []}}
    with pytest.raises(SchemaError, match="unknown field 'artifact'"):
        _validate(broken, schema, schema["definitions"], "skaffold.yaml")
