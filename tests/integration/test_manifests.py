"""Every shipped manifest passes the real apiserver's schema and admission checks.

For each overlay (manifests/overlays/kubernetes, manifests/overlays/openshift): render it with
the control plane's own `kubectl kustomize`, install for real what it depends on — the
third-party CRDs (cert-manager's, OpenShift's SecurityContextConstraints; fetched from their
Go modules by hack/fetch-crds.sh; the Prometheus Operator's for manifests/components/monitoring),
InstaSlice's CRDs and the instaslice-system Namespace —
then `kubectl apply --dry-run=server` the whole rendering with strict field validation. Also
checks skaffold.yaml against skaffold's own JSON schema (fetched the same way). Also: the
binding mode resolves to the same value for the webhook and the node agents in every overlay,
with and without manifests/components/binding-env; the OpenShift agent's RuntimeClass; the
NetworkPolicies, read as a CNI would, admit only the monitoring namespaces to both components'
metrics ports (`monitoring`; OpenShift's two) and every source to the admission port.

Leaves out: anything that needs a running cert-manager, service-CA operator, OpenShift SCC
admission or a container engine (the certificate is never issued, the SCC never enforced,
the images never built or pulled). What the test installs for real is removed afterwards,
unless it was there before (InstaSlice's CRDs may be, from other tests).
"""

from __future__ import annotations

import json
import os
import re
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


def dry_run_server(cp: ControlPlane, text: str, what: str) -> None:
    """`kubectl apply --dry-run=server --validate=strict` of every object in `text`: each is
    accepted, and no warning is printed (deprecated APIs, Pod Security, duplicate ports) but
    kubectl's note about objects created without client-side apply."""
    proc = cp.kubectl(
        "apply", "--dry-run=server", "--validate=strict", "-f", "-", stdin=text, check=False
    )
    out = _ok(proc, f"kubectl apply --dry-run=server ({what})")
    applied = [line for line in out.splitlines() if line.endswith("(server dry run)")]
    assert len(applied) == len(_docs(text)), out
    warnings = [
        line
        for line in proc.stderr.splitlines()
        if line.startswith("Warning:") and "last-applied-configuration" not in line
    ]
    assert not warnings, "\n".join(warnings)


def _exists(cp: ControlPlane, kind: str, name: str) -> bool:
    return (
        cp.kubectl("get", kind, name, "--ignore-not-found", "-o", "name", check=False).stdout != ""
    )


@pytest.fixture(scope="module")
def fetched() -> Path:
    return _fetch_dir()


@pytest.fixture(scope="module")
def third_party_crds(control_plane: ControlPlane, fetched: Path) -> Iterator[list[str]]:
    """cert-manager's, OpenShift's SCC and the Prometheus Operator's CRDs, installed for real
    and Established."""
    files = [
        f
        for d in ("cert-manager", "openshift", "prometheus-operator")
        for f in sorted((fetched / d).glob("*.yaml"))
    ]
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
    "RuntimeClass",
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
    dry_run_server(control_plane, rendered[overlay], f"overlay {overlay}")


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


# --- settings the components share: one value, read by both ------------------------------------

COMPONENTS = {
    "default": (),
    "binding-env": ("binding-env",),
    "dra": ("dra",),
    "binding-env+dra": ("binding-env", "dra"),
}


def _render_with(cp: ControlPlane, tmp: Path, overlay: str, components: tuple[str, ...]) -> str:
    """An administrator's own overlay: one of ours plus some of manifests/components."""
    rel = Path(os.path.relpath(ROOT / "manifests", tmp))
    kust: dict[str, Any] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [str(rel / "overlays" / overlay)],
    }
    if components:
        kust["components"] = [str(rel / "components" / c) for c in components]
    (tmp / "kustomization.yaml").write_text(yaml.safe_dump(kust))
    return _ok(cp.kubectl("kustomize", str(tmp), check=False), f"kustomize {overlay}+{components}")


def resolved_args(docs: list[dict[str, Any]], kind: str, name: str) -> list[str]:
    """The container's args as the kubelet runs them: `$(VAR)` expanded from its env, whose
    configMapKeyRef values are looked up in the rendered ConfigMaps (which must exist)."""
    maps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    (obj,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    (container,) = obj["spec"]["template"]["spec"]["containers"]
    env: dict[str, str] = {}
    for e in container.get("env", []):
        ref = e.get("valueFrom", {}).get("configMapKeyRef")
        if ref is not None:
            assert ref["name"] in maps, f"{kind}/{name}: env {e['name']} names a missing ConfigMap"
            assert ref["key"] in maps[ref["name"]], f"{kind}/{name}: no key {ref['key']}"
            env[e["name"]] = maps[ref["name"]][ref["key"]]
        elif "value" in e:
            env[e["name"]] = e["value"]
        else:
            env[e["name"]] = f"<{e['name']}>"  # from the downward API
    out = []
    for arg in container.get("args", []):
        unresolved = [v for v in re.findall(r"\$\((\w+)\)", arg) if v not in env]
        assert not unresolved, f"{kind}/{name}: {arg} names undefined {unresolved}"
        out.append(re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg))
    return out


def binding_modes(docs: list[dict[str, Any]]) -> tuple[str, str]:
    """(webhook's, node agent's) binding mode, parsed by each binary's own command line."""
    (webhook, _), (agent, _) = parsed_modes(docs)
    return webhook, agent


def parsed_modes(docs: list[dict[str, Any]]) -> tuple[tuple[str, str], tuple[str, str]]:
    """((binding, allocation) mode of the webhook, the same of the node agent), parsed by each
    binary's own command line."""
    from nodeagent.main import parse_args as agent_args
    from webhook.main import parse_args as webhook_args

    webhook = webhook_args(resolved_args(docs, "Deployment", "instaslice-webhook"))
    assert webhook.server is not None
    agent, _ = agent_args(
        ["--node", "n1", *resolved_args(docs, "DaemonSet", "instaslice-nodeagent")]
    )
    return (
        (webhook.server.admission.binding_mode.value, webhook.allocation_mode.value),
        (agent.binding.value, agent.allocation.value),
    )


@pytest.mark.parametrize("components", COMPONENTS, ids=str)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_webhook_and_node_agents_agree_on_the_binding_mode(
    control_plane: ControlPlane, tmp_path: Path, overlay: str, components: str
) -> None:
    docs = _docs(_render_with(control_plane, tmp_path, overlay, COMPONENTS[components]))
    webhook, agent = parsed_modes(docs)
    assert webhook == agent, f"{overlay}+{components}: webhook {webhook}, node agents {agent}"
    want = (
        "env" if "binding-env" in components else "device-plugin",
        "dra" if "dra" in components else "gates",
    )
    assert webhook == want
    # the one setting lives in one object
    maps = [d for d in docs if d["kind"] == "ConfigMap" and "binding-mode" in d.get("data", {})]
    assert len(maps) == 1, maps
    assert set(maps[0]["data"]) == {"binding-mode", "allocation-mode"}


def test_binding_check_sees_a_disagreement(control_plane: ControlPlane, tmp_path: Path) -> None:
    """The negative control: a patch that pins one side's flag is caught."""
    docs = _docs(_render_with(control_plane, tmp_path, "kubernetes", ()))
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    ds["spec"]["template"]["spec"]["containers"][0]["args"].append("--binding=env")
    webhook, agent = binding_modes(docs)
    assert (webhook, agent) == ("device-plugin", "env")


def test_openshift_agent_runs_with_the_nvidia_runtime_class(
    control_plane: ControlPlane, tmp_path: Path, rendered: dict[str, str]
) -> None:
    """NVML reaches the agent through the NVIDIA runtime on OpenShift; the component creates
    the RuntimeClass where the GPU Operator does not."""
    for overlay, want in (("openshift", "nvidia"), ("kubernetes", None)):
        (ds,) = [d for d in _docs(rendered[overlay]) if d["kind"] == "DaemonSet"]
        assert ds["spec"]["template"]["spec"].get("runtimeClassName") == want, overlay
    docs = _docs(_render_with(control_plane, tmp_path, "openshift", ("runtimeclass-nvidia",)))
    (rc,) = [d for d in docs if d["kind"] == "RuntimeClass"]
    assert (rc["metadata"]["name"], rc["handler"]) == ("nvidia", "nvidia")
    assert "namespace" not in rc["metadata"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_monitoring_component_passes_server_side_dry_run(
    control_plane: ControlPlane,
    third_party_crds: list[str],
    instaslice_crds: None,
    instaslice_namespace: str,
    tmp_path: Path,
    overlay: str,
) -> None:
    """The PodMonitor and PrometheusRule against the Prometheus Operator's own CRD schemas."""
    text = _render_with(control_plane, tmp_path, overlay, ("monitoring",))
    docs = _docs(text)
    kinds = {d["kind"] for d in docs}
    assert {"PodMonitor", "PrometheusRule"} <= kinds
    mon = [d for d in docs if d["kind"] in ("PodMonitor", "PrometheusRule")]
    proc = control_plane.kubectl(
        "apply", "--dry-run=server", "--validate=strict", "-f", "-",
        stdin=yaml.safe_dump_all(mon), check=False,
    )  # fmt: skip
    out = _ok(proc, f"dry-run of the monitoring component ({overlay})")
    assert out.count("(server dry run)") == 2, out


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_dra_components_pass_server_side_dry_run(
    control_plane: ControlPlane, tmp_path: Path, overlay: str
) -> None:
    """The DRA component's objects (DeviceClasses, the agent's RBAC and policy) and the
    optional per-profile classes, against the v1.37.2 API server's own schemas."""
    text = _render_with(control_plane, tmp_path, overlay, ("dra", "dra-extended-resources"))
    docs = _docs(text)
    new = [
        d
        for d in docs
        if d["kind"] == "DeviceClass" or d["metadata"]["name"] == "instaslice-nodeagent-dra"
    ]
    assert {d["kind"] for d in new} == {
        "DeviceClass", "ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    }  # fmt: skip
    proc = control_plane.kubectl(
        "apply", "--dry-run=server", "--validate=strict", "-f", "-",
        stdin=yaml.safe_dump_all(new), check=False,
    )  # fmt: skip
    out = _ok(proc, f"dry-run of the dra components ({overlay})")
    assert out.count("(server dry run)") == len(new) == 2 + 6 + 4, out


# --- who may connect: the NetworkPolicies, read as a CNI would ------------------------------


def _selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A LabelSelector's meaning (matchLabels AND every matchExpression); None: nothing."""
    if selector is None:
        return False
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def admits(
    policies: list[dict[str, Any]],
    pod: dict[str, str],
    port: str,
    namespace: str,
    ns_labels: dict[str, str],
) -> bool:
    """Whether a pod in `namespace` (labelled `ns_labels`) may connect to named `port` of an
    InstaSlice pod labelled `pod`, by the NetworkPolicy API's rules: a pod no policy selects
    for ingress takes everything; otherwise some rule must match the port and the source (a
    `namespaceSelector` alone: any pod of a selected namespace; a `podSelector` alone: pods of
    the policy's own namespace; an ipBlock: no pod source here)."""
    selecting = [
        p for p in policies
        if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and _selects(p["spec"]["podSelector"], pod)
    ]  # fmt: skip
    if not selecting:
        return True
    for p in selecting:
        for rule in p["spec"].get("ingress") or []:
            ports = rule.get("ports")
            if ports and not any(x.get("port") == port for x in ports):
                continue
            peers = rule.get("from")
            if not peers:
                return True
            for peer in peers:
                if "ipBlock" in peer:
                    continue
                ns_ok = (
                    _selects(peer["namespaceSelector"], ns_labels)
                    if "namespaceSelector" in peer
                    else namespace == p["metadata"]["namespace"]
                )
                if ns_ok and ("podSelector" not in peer or peer["podSelector"] == {}):
                    return True
    return False


# every namespace carries its name as this label, set by the API server and immutable; a
# namespace labelling itself `name: monitoring` or the like must not count
SOURCES = {
    ns: {"kubernetes.io/metadata.name": ns, "name": "monitoring", "monitoring": "true"}
    for ns in (
        "monitoring",
        "openshift-monitoring",
        "openshift-user-workload-monitoring",
        "default",
        "tenant-a",
        "kube-system",
        NAMESPACE,
    )
}
SCRAPERS = {
    "kubernetes": {"monitoring"},
    "openshift": {"openshift-monitoring", "openshift-user-workload-monitoring"},
}
WORKLOADS = {"instaslice-webhook": "webhook", "instaslice-nodeagent": None}


def reachable(policies: list[dict[str, Any]], app: str, port: str) -> set[str]:
    return {
        ns
        for ns, labels in SOURCES.items()
        if admits(policies, {"app.kubernetes.io/name": app}, port, ns, labels)
    }


def check_policies(docs: list[dict[str, Any]], scrapers: set[str]) -> None:
    """Both components' metrics ports admit `scrapers` only; the webhook's admission port
    every source (the API server calls it from anywhere); nothing else is open."""
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    for app, other in WORKLOADS.items():
        assert reachable(policies, app, "metrics") == scrapers, app
        if other is not None:
            assert reachable(policies, app, other) == set(SOURCES), f"{app}: {other}"
        assert reachable(policies, app, "grpc") == set(), f"{app}: a port it does not open"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_monitoring_namespaces_reach_the_metrics_ports(
    rendered: dict[str, str], overlay: str
) -> None:
    check_policies(_docs(rendered[overlay]), SCRAPERS[overlay])


def test_policy_reading_sees_an_open_metrics_port(rendered: dict[str, str]) -> None:
    """The negative control: the metrics rule as it was (`namespaceSelector: {}`, every
    namespace) is caught."""
    docs = _docs(rendered["kubernetes"])
    for d in docs:
        if d["kind"] == "NetworkPolicy":
            for rule in d["spec"]["ingress"]:
                if rule.get("from"):
                    rule["from"] = [{"namespaceSelector": {}}]
    with pytest.raises(AssertionError):
        check_policies(docs, SCRAPERS["kubernetes"])
