"""Every value of the Helm chart charts/instaslice, proven by a render (`helm template`).

- Each leaf of values.schema.json has a row in VALUE_ROWS that sets it to something other
  than its default and checks where it lands in the rendered objects (a meta-test keeps the
  table complete), and docs/install.md "Chart values" names every one.
- The namespace is the release's everywhere: no rendering for another namespace names
  instaslice-system, not even inside the admission policies' CEL or the webhook's
  namespaceSelector; the webhook's leader Lease namespace follows the pod's.
- Every object carries the standard labels, app.kubernetes.io/version included.
- A rendering with every workload value set passes the server's dry run.

Leaves out: installing the chart for real (tests/e2e, against an `install: chart` cluster);
the equality with kustomize's rendering at the defaults (test_helm_chart.py).
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from hack.cluster import ControlPlane
from hack.gen_chart import CHART_DIR
from nodeagent.dra.plugin import Registration, Sockets
from nodeagent.main import parse_args as agent_args
from tests.integration import test_helm_chart as chart
from tests.integration import test_manifests as manifests

pytestmark = pytest.mark.integration

helm = chart.helm
fetched = manifests.fetched
third_party_crds = manifests.third_party_crds
rendered = manifests.rendered
instaslice_namespace = manifests.instaslice_namespace
instaslice_crds = manifests.instaslice_crds
crds_served = chart.crds_served

ROOT = Path(__file__).resolve().parents[2]
Objs = dict[tuple[str, str], dict[str, Any]]
DIGEST = "sha256:" + "ab" * 32
WORKLOADS = {"webhook": ("Deployment", "instaslice-webhook"),
             "nodeagent": ("DaemonSet", "instaslice-nodeagent")}  # fmt: skip
# testing.emulator's values only work together (the schema wants both paths when enabled)
EMULATOR = {"enabled": True, "stateDir": "/e/state", "devRoot": "/e/dev"}
# maps whose keys are the user's, not the chart's: one value each
OPAQUE = {"metricsNamespaceSelector"}


def render(helm: Path, values: dict[str, Any], tmp: Path, namespace: str = "instaslice-system"
           ) -> subprocess.CompletedProcess[str]:  # fmt: skip
    f = tmp / "values.yaml"
    f.write_text(yaml.safe_dump(values))
    return subprocess.run(
        [str(helm), "template", "rel", str(CHART_DIR), "-n", namespace, "-f", str(f)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip


def objects(proc: subprocess.CompletedProcess[str]) -> Objs:
    assert proc.returncode == 0, proc.stderr
    return {(d["kind"], d["metadata"]["name"]): d for d in manifests._docs(proc.stdout)}


def pod(objs: Objs, part: str) -> dict[str, Any]:
    spec: dict[str, Any] = objs[WORKLOADS[part]]["spec"]["template"]
    return spec


def container(objs: Objs, part: str) -> dict[str, Any]:
    (c,) = pod(objs, part)["spec"]["containers"]
    out: dict[str, Any] = c
    return out


def args(objs: Objs, part: str) -> list[str]:
    return list(container(objs, part)["args"])


def _nested(path: str, value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    node = out
    *heads, leaf = path.split(".")
    for h in heads:
        node = node.setdefault(h, {})
    node[leaf] = value
    return out


Check = Callable[[Objs], None]


def _row(path: str, value: Any, check: Check) -> tuple[str, Any, Check]:
    return (path, value, check)


def image(objs: Objs, part: str) -> str:
    return str(container(objs, part)["image"])


Get = Callable[[Objs, str], Any]
TOLERATIONS = [{"key": "k", "operator": "Exists", "effect": "NoSchedule"}]
AFFINITY = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
    "nodeSelectorTerms": [{"matchExpressions": [
        {"key": "zone", "operator": "In", "values": ["a"]}]}]}}}  # fmt: skip
# per workload: (value path with {p}, a value, what to read in the rendering, what it must be)
PART_ROWS: list[tuple[str, Any, Get, Any]] = [
    ("images.{p}.repository", "r.example/img", image, "r.example/img:v0.1.0"),
    ("images.{p}.tag", "v9", lambda o, p: image(o, p).rpartition(":")[2], "v9"),
    ("images.{p}.digest", DIGEST, image, f"quay.io/instaslice/instaslice-{{p}}@{DIGEST}"),
    (
        "images.{p}.pullPolicy",
        "Always",
        lambda o, p: container(o, p)["imagePullPolicy"],
        "Always",
    ),
    (
        "{p}.resources",
        {"limits": {"memory": "1Gi"}},
        lambda o, p: container(o, p)["resources"]["limits"],
        {"memory": "1Gi"},
    ),
    (
        "{p}.nodeSelector",
        {"disk": "ssd"},
        lambda o, p: pod(o, p)["spec"]["nodeSelector"],
        {"disk": "ssd"},
    ),
    (
        "{p}.tolerations",
        TOLERATIONS,
        lambda o, p: pod(o, p)["spec"]["tolerations"],
        TOLERATIONS,
    ),
    ("{p}.affinity", AFFINITY, lambda o, p: pod(o, p)["spec"]["affinity"], AFFINITY),
    (
        "{p}.priorityClassName",
        "system-cluster-critical",
        lambda o, p: pod(o, p)["spec"]["priorityClassName"],
        "system-cluster-critical",
    ),
    ("{p}.podLabels", {"team": "gpu"}, lambda o, p: _pod_labels(o, p), "gpu"),
    (
        "{p}.podAnnotations",
        {"a.example/x": "1"},
        lambda o, p: pod(o, p)["metadata"]["annotations"],
        {"a.example/x": "1"},
    ),
]


def _check(part: str, get: Get, want: Any) -> Check:
    if isinstance(want, str):
        want = want.replace("{p}", part)
    return lambda objs: _eq(get(objs, part), want)


def _rows() -> Iterator[tuple[str, Any, Check]]:
    """(value path, a non-default value, what it must do to the rendered objects)."""
    for part in WORKLOADS:
        for path, value, get, want in PART_ROWS:
            yield _row(path.replace("{p}", part), value, _check(part, get, want))
    yield _row("imagePullSecrets", [{"name": "regcred"}], _pull_secrets)
    yield _row("bindingMode", "env",
           lambda o: _eq(manifests.binding_modes(list(o.values())), ("env", "env")))  # fmt: skip
    yield _row("allocationMode", "dra", _dra)
    yield _row("logLevel", "debug", lambda o: _flag(o, "--log-level=debug", "webhook", "nodeagent"))
    yield _row("warmSlices", "on", lambda o: _flag(o, "--warm-slices=on", "nodeagent"))
    yield _row("allocator.policy", "spread", lambda o: _flag(o, "--policy=spread", "webhook"))
    yield _row("allocator.preemption", "off", lambda o: _flag(o, "--preemption=off", "webhook"))
    yield _row("allocator.autoscalerSignal", "placeholder",
           lambda o: _flag(o, "--autoscaler-signal=placeholder", "webhook"))  # fmt: skip
    yield _row("webhook.replicas", 3,
           lambda o: _eq(o[WORKLOADS["webhook"]]["spec"]["replicas"], 3))  # fmt: skip
    yield _row("nodeagent.kubeletDir", "/data/kubelet", _kubelet_dir)
    for key in ("cdi", "state"):
        yield _row(f"nodeagent.hostPaths.{key}", f"/data/{key}", _host_path_is(key))
    for key in EMULATOR:  # set together (the schema), each checked where it lands
        yield _row(f"testing.emulator.{key}", EMULATOR[key], _emulator)
    yield _row("uninstallHook.enabled", False,
               lambda o: _eq([k for k in o if k[0] == "Job"], []))  # fmt: skip
    yield _row("uninstallHook.timeoutSeconds", 90,
               lambda o: _eq(_hook_args(o)["--timeout"], "90"))  # fmt: skip
    yield _row("certificates.mode", "cert-manager", _cert_manager)
    yield _row("metricsAuth.enabled", True, _metrics_auth)
    yield _row("monitoring.enabled", True, lambda o: _eq(("PodMonitor", "instaslice") in o, True))
    sel = {"matchLabels": {"team": "obs"}}  # null drops the default's matchExpressions
    yield _row("metricsNamespaceSelector", {**sel, "matchExpressions": None},
           lambda o: _scrapers(o, sel))  # fmt: skip


def _eq(got: Any, want: Any) -> None:
    assert got == want, f"{got!r} != {want!r}"


def _flag(objs: Objs, flag: str, *parts: str) -> None:
    for part in parts:
        assert flag in args(objs, part), f"{part}: {args(objs, part)}"


def _pod_labels(objs: Objs, part: str) -> str:
    """The pod's `team` label; the selector is unchanged and still selects the pod."""
    labels = pod(objs, part)["metadata"]["labels"]
    selector = objs[WORKLOADS[part]]["spec"]["selector"]["matchLabels"]
    assert "team" not in selector and set(selector.items()) <= set(labels.items())
    return str(labels.get("team"))


def _dra(objs: Objs) -> None:
    """DRA mode (docs/dra.md): the ConfigMap both components read says dra, and the objects
    manifests/components/dra adds are there."""
    (cm,) = [o for (k, _), o in objs.items() if k == "ConfigMap" and "allocation-mode" in o["data"]]
    _eq(cm["data"]["allocation-mode"], "dra")
    classes = {n for k, n in objs if k == "DeviceClass"}
    _eq(classes, {"mig.instaslice.io", "gpu.instaslice.io"})
    assert ("ClusterRole", "instaslice-nodeagent-dra") in objs
    assert ("ValidatingAdmissionPolicy", "instaslice-nodeagent-dra") in objs


def _metrics_auth(objs: Objs) -> None:
    _flag(objs, "--metrics-auth", "webhook", "nodeagent")
    for part in WORKLOADS:
        assert container(objs, part)["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert ("Secret", "instaslice-metrics-scraper-token") in objs


def _cert_manager(objs: Objs) -> None:
    assert {("Certificate", "instaslice-webhook"), ("Issuer", "instaslice-ca")} <= objs.keys()
    ann = objs[("MutatingWebhookConfiguration", "instaslice")]["metadata"]["annotations"]
    assert ann == {"cert-manager.io/inject-ca-from": "instaslice-system/instaslice-webhook"}
    _flag(objs, "--cert-mode=files", "webhook")
    assert ("Role", "instaslice-webhook-cert") not in objs


def _hook_args(objs: Objs) -> dict[str, str]:
    job = objs[("Job", "instaslice-uninstall-pre-delete")]
    (c,) = job["spec"]["template"]["spec"]["containers"]
    return dict(a.partition("=")[::2] for a in c["args"])


def _pull_secrets(objs: Objs) -> None:
    for part in WORKLOADS:
        _eq(pod(objs, part)["spec"]["imagePullSecrets"], [{"name": "regcred"}])


def _host_paths(objs: Objs) -> dict[str, str]:
    return {v["name"]: v["hostPath"]["path"]
            for v in pod(objs, "nodeagent")["spec"]["volumes"] if "hostPath" in v}  # fmt: skip


def _host_path_is(volume: str) -> Check:
    return lambda objs: _eq(_host_paths(objs)[volume], f"/data/{volume}")


def on_host(objs: Objs, inside: Path) -> Path:
    """Where a path inside the node agent's container is on the node (its hostPath mounts)."""
    spec = pod(objs, "nodeagent")["spec"]
    vols = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    mounts = [m for m in container(objs, "nodeagent")["volumeMounts"] if m["name"] in vols]
    (m,) = [m for m in mounts if inside.is_relative_to(m["mountPath"])] or [None]
    assert m is not None, f"{inside} is on no hostPath mount: {mounts}"
    return Path(vols[m["name"]]) / inside.relative_to(m["mountPath"])


def _kubelet_dir(objs: Objs) -> None:
    """Every kubelet path follows the value, and the agent hands the kubelet the DRA plugin's
    socket path as the kubelet sees it on the node, not a path inside its container."""
    paths = _host_paths(objs)
    assert paths["pod-resources"] == "/data/kubelet/pod-resources", paths
    values = {"INSTASLICE_BINDING_MODE": "device-plugin", "INSTASLICE_ALLOCATION_MODE": "dra"}
    argv = [re.sub(r"\$\((\w+)\)", lambda m: values.get(m[1], "x"), a)
            for a in args(objs, "nodeagent")]  # fmt: skip
    settings, _ = agent_args([*argv, "--node=n"])
    assert settings.dra_registry_dir is not None, argv
    sockets = Sockets(settings.dra_registry_dir, settings.dra_plugins_dir)
    registration = Registration(sockets.plugin)
    endpoint = Path(registration.plugin_socket)  # what GetInfo tells the kubelet
    kubelet = Path("/data/kubelet")
    _eq(on_host(objs, sockets.registration), kubelet / "plugins_registry/instaslice.io-reg.sock")
    _eq(on_host(objs, sockets.plugin), kubelet / "plugins/instaslice.io/dra.sock")
    _eq(endpoint, kubelet / "plugins/instaslice.io/dra.sock")
    _eq(on_host(objs, settings.pod_resources_socket), kubelet / "pod-resources/kubelet.sock")
    # the kubelet fixes the device plugins' directory whatever its --root-dir
    assert paths["device-plugins"] == "/var/lib/kubelet/device-plugins", paths


def _emulator(objs: Objs) -> None:
    """The node agent on the NVML emulator: its flags, and both host directories mounted."""
    _flag(objs, "--emulate", "nodeagent")
    _flag(objs, "--emu-state=/e/state", "nodeagent")
    _flag(objs, "--dev-root=/e/dev", "nodeagent")
    paths = _host_paths(objs)
    _eq((paths["emu-state"], paths["emu-dev"]), ("/e/state", "/e/dev"))
    mounts = {m["name"]: m for m in container(objs, "nodeagent")["volumeMounts"]}
    _eq(mounts["emu-state"]["mountPath"], "/e/state")
    _eq((mounts["emu-dev"]["mountPath"], mounts["emu-dev"]["readOnly"]), ("/e/dev", True))


def _scrapers(objs: Objs, sel: dict[str, Any]) -> None:
    for name in WORKLOADS.values():
        policy = objs[("NetworkPolicy", name[1])]
        rules = [r for r in policy["spec"]["ingress"]
                 if any(p.get("port") == "metrics" for p in r["ports"])]  # fmt: skip
        _eq([r["from"] for r in rules], [[{"namespaceSelector": sel}]])


VALUE_ROWS = list(_rows())


def schema_leaves(node: dict[str, Any], prefix: str = "") -> list[str]:
    """Every value path the schema types (maps of the user's own keys count as one)."""
    out = []
    for key, sub in node.get("properties", {}).items():
        path = f"{prefix}{key}"
        if "properties" in sub and path not in OPAQUE:
            out += schema_leaves(sub, path + ".")
        else:
            out.append(path)
    return out


@pytest.fixture(scope="module")
def leaves() -> list[str]:
    return schema_leaves(json.loads((CHART_DIR / "values.schema.json").read_text()))


def test_every_value_has_a_render_row(leaves: list[str]) -> None:
    rows = [r[0] for r in VALUE_ROWS]
    assert sorted(leaves) == sorted(rows)


@pytest.mark.parametrize(("path", "value", "check"), VALUE_ROWS, ids=[r[0] for r in VALUE_ROWS])
def test_value_reaches_the_objects(
    helm: Path, tmp_path: Path, path: str, value: Any, check: Check
) -> None:
    values = _nested(path, value)
    if path.startswith("testing.emulator."):
        values = {"testing": {"emulator": EMULATOR}}
    check(objects(render(helm, values, tmp_path)))


def test_defaults_leave_optional_fields_out(helm: Path, tmp_path: Path) -> None:
    """Unset pull policy, pull secrets and annotations render as absent, and a workload's
    default scheduling fields can be emptied (the node agent's tolerations)."""
    objs = objects(render(helm, {"nodeagent": {"tolerations": []}}, tmp_path))
    for part in WORKLOADS:
        assert "imagePullPolicy" not in container(objs, part)
        assert "imagePullSecrets" not in pod(objs, part)["spec"]
        assert "annotations" not in pod(objs, part)["metadata"]
    assert "tolerations" not in pod(objs, "nodeagent")["spec"]
    assert pod(objs, "nodeagent")["spec"]["priorityClassName"] == "system-node-critical"


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"allocationMode": "claims"}, "allocationMode"),
        ({"images": {"webhook": {"digest": "sha256:short"}}}, "digest"),
        ({"images": {"nodeagent": {"pullPolicy": "Sometimes"}}}, "pullPolicy"),
        ({"logLevel": "loud"}, "logLevel"),
        ({"allocator": {"policy": "best"}}, "policy"),
        ({"nodeagent": {"kubeletDir": "var/lib/kubelet"}}, "kubeletDir"),
        ({"webhook": {"nodeSelektor": {}}}, "nodeSelektor"),
        ({"nodeagent": {"hostPaths": {"cdi": "run/cdi"}}}, "cdi"),
        ({"nodeagent": {"hostPaths": {"podResources": "/p"}}}, "podResources"),  # kubeletDir's
        ({"testing": {"emulator": {"enabled": True}}}, "stateDir"),  # no host directories
    ],
)
def test_refuses_values_it_cannot_honour(
    helm: Path, tmp_path: Path, values: dict[str, Any], complaint: str
) -> None:
    proc = render(helm, values, tmp_path)
    assert proc.returncode != 0, f"{values} was accepted"
    assert complaint in proc.stderr, proc.stderr


def test_the_webhook_makes_its_own_certificate_by_default(helm: Path, tmp_path: Path) -> None:
    """certificates.mode self: no cert-manager object or annotation; the webhook issues the
    pair (--cert-mode=self) into a writable in-memory volume, with RBAC for its one Secret
    and the caBundle of its one webhook configuration."""
    objs = objects(render(helm, {}, tmp_path))
    assert not {k for k in objs if k[0] in ("Certificate", "Issuer")}
    mwc = objs[("MutatingWebhookConfiguration", "instaslice")]
    assert "annotations" not in mwc["metadata"]
    _flag(objs, "--cert-mode=self", "webhook")
    (vol,) = [v for v in pod(objs, "webhook")["spec"]["volumes"] if v["name"] == "tls"]
    assert vol == {"name": "tls", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}
    (mount,) = [m for m in container(objs, "webhook")["volumeMounts"] if m["name"] == "tls"]
    assert mount["readOnly"] is False
    role = objs[("Role", "instaslice-webhook-cert")]
    mine = {"apiGroups": [""], "resources": ["secrets"],
            "verbs": ["get", "list", "watch", "update"],
            "resourceNames": ["instaslice-webhook-tls"]}  # fmt: skip
    assert mine in role["rules"]
    (rule,) = objs[("ClusterRole", "instaslice-webhook-cert")]["rules"]
    assert (rule["resourceNames"], rule["verbs"]) == (["instaslice"], ["get", "patch"])


def test_openshift_certificates_come_from_the_service_ca(helm: Path, tmp_path: Path) -> None:
    objs = objects(render(helm, {"certificates": {"mode": "openshift"}}, tmp_path))
    svc = objs[("Service", "instaslice-webhook")]["metadata"]["annotations"]
    assert svc == {"service.beta.openshift.io/serving-cert-secret-name": "instaslice-webhook-tls"}
    mwc = objs[("MutatingWebhookConfiguration", "instaslice")]["metadata"]["annotations"]
    assert mwc == {"service.beta.openshift.io/inject-cabundle": "true"}
    assert not {k for k in objs if k[0] in ("Certificate", "Issuer")}
    assert ("Role", "instaslice-webhook-cert") not in objs
    _flag(objs, "--cert-mode=files", "webhook")


def test_grafana_dashboard_ships_as_a_config_map(helm: Path, tmp_path: Path) -> None:
    objs = objects(render(helm, {"monitoring": {"enabled": True}}, tmp_path))
    cm = objs[("ConfigMap", "instaslice-grafana-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"  # Grafana's sidecar loads it
    dashboard = (ROOT / "dashboards" / "instaslice-grafana.json").read_text()
    assert json.loads(cm["data"]["instaslice-grafana.json"]) == json.loads(dashboard)
    assert ("ConfigMap", "instaslice-grafana-dashboard") not in objects(render(helm, {}, tmp_path))


def test_gates_is_the_default_allocation_mode(helm: Path, tmp_path: Path) -> None:
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    assert values["allocationMode"] == "gates"
    objects(render(helm, {"allocationMode": "gates"}, tmp_path))


@pytest.mark.parametrize("mode", ["self", "cert-manager", "openshift"])
def test_namespace_is_the_releases(helm: Path, tmp_path: Path, mode: str) -> None:
    values = {"monitoring": {"enabled": True}, "certificates": {"mode": mode}}
    proc = render(helm, values, tmp_path, namespace="gpu-ops")
    objs = objects(proc)
    assert manifests.NAMESPACE not in proc.stdout
    assert "Namespace" not in {k for k, _ in objs}  # --create-namespace makes it
    for (kind, name), o in objs.items():
        ns = o["metadata"].get("namespace")
        assert ns in (None, "gpu-ops"), f"{kind}/{name} in {ns}"
    sa = "system:serviceaccount:gpu-ops:instaslice-controller"
    assert sa in json.dumps(objs[("ValidatingAdmissionPolicy", "instaslice-pods")])
    (hook,) = objs[("MutatingWebhookConfiguration", "instaslice")]["webhooks"][:1]
    exprs = hook["namespaceSelector"]["matchExpressions"]
    assert {"key": "kubernetes.io/metadata.name", "operator": "NotIn"}.items() <= next(
        e for e in exprs if e["key"] == "kubernetes.io/metadata.name"
    ).items()
    assert "gpu-ops" in json.dumps(exprs)
    lease_ns = [a for a in manifests.resolved_args(list(objs.values()), *WORKLOADS["webhook"])
                if a.startswith("--namespace=")]  # fmt: skip
    assert lease_ns == ["--namespace=<POD_NAMESPACE>"]


def test_standard_labels_on_every_object(helm: Path, tmp_path: Path) -> None:
    objs = objects(render(helm, {"monitoring": {"enabled": True}}, tmp_path))
    app_version = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())["appVersion"]
    want = {
        "app.kubernetes.io/managed-by": "Helm",
        "app.kubernetes.io/instance": "rel",
        "app.kubernetes.io/version": app_version,
        "app.kubernetes.io/part-of": "instaslice",
    }
    for (kind, name), o in objs.items():
        labels = o["metadata"].get("labels") or {}
        assert want.items() <= labels.items(), f"{kind}/{name}: {labels}"
        assert re.fullmatch(r"instaslice-\S+", labels["helm.sh/chart"])
    for part in WORKLOADS:
        assert want.items() - {("app.kubernetes.io/part-of", "instaslice")} <= (
            pod(objs, part)["metadata"]["labels"].items()
        )


def test_install_doc_lists_every_value(leaves: list[str]) -> None:
    doc = (ROOT / "docs" / "install.md").read_text()
    section = doc.partition("### Chart values")[2].partition("\n### ")[0]
    listed = set(re.findall(r"^\| `([\w.]+)` \|", section, re.M))
    assert listed == set(leaves), (
        f"docs/install.md 'Chart values': missing {sorted(set(leaves) - listed)}, "
        f"unknown {sorted(listed - set(leaves))}"
    )


def test_every_workload_value_passes_server_side_dry_run(
    control_plane: ControlPlane,
    helm: Path,
    crds_served: None,
    instaslice_namespace: str,
    tmp_path: Path,
) -> None:
    values: dict[str, Any] = {"imagePullSecrets": [{"name": "regcred"}]}
    for path, value, _ in VALUE_ROWS:
        if path.startswith(("webhook.", "nodeagent.", "images.")):
            head, _, leaf = path.rpartition(".")
            node = values
            for h in head.split("."):
                node = node.setdefault(h, {})
            node[leaf] = value
    proc = render(helm, values, tmp_path)
    objects(proc)
    manifests.dry_run_server(control_plane, proc.stdout, "every workload value")
