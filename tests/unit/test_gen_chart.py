"""hack/gen_chart.py's pure part: from kustomize renderings to chart files.

The real renderings (kubectl kustomize) and the drift check of the committed chart are in
tests/integration/test_helm_chart.py; here small synthetic renderings check what the generator
parameterises, that it escapes Go-template braces in the manifests' own text, and that it
refuses a component that changes something it does not parameterise.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import yaml

from hack.gen_chart import build_chart, check_variants

NS = "instaslice-system"


FLAGS = {
    "Deployment": ["--cert-mode=files", "--policy=instaslice", "--preemption=gpu",
                   "--autoscaler-signal=off", "--log-level=info", "--port=8443"],
    "DaemonSet": ["--log-level=info", "--warm-slices=off",
                  "--kubelet-dir=/var/lib/kubelet/device-plugins"],
}  # fmt: skip


def _workload(kind: str, name: str, image: str, cm: str) -> dict[str, Any]:
    container = {
        "name": name,
        "image": image,
        "args": FLAGS[kind],
        "env": [
            {"name": "M", "valueFrom": {"configMapKeyRef": {"name": cm, "key": "binding-mode"}}}
        ],
        "resources": {"limits": {"memory": "512Mi"}},
    }
    pod: dict[str, Any] = {"containers": [container]}
    spec: dict[str, Any] = {"template": {"metadata": {"labels": {"app": name}}, "spec": pod}}
    if kind == "Deployment":
        spec["replicas"] = 2
        container["volumeMounts"] = [{"name": "tls", "mountPath": "/tls", "readOnly": True}]
        pod["volumes"] = [{"name": "tls", "secret": {"secretName": "instaslice-webhook-tls"}}]
    else:  # host directories: kubeletDir's, the fixed device-plugins one, nodeagent.hostPaths
        pod["priorityClassName"] = "system-node-critical"
        paths = {"dp": "/var/lib/kubelet/device-plugins", "pod-resources":
                 "/var/lib/kubelet/pod-resources", "cdi": "/var/run/cdi",
                 "state": "/var/lib/instaslice"}  # fmt: skip
        pod["volumes"] = [{"name": k, "hostPath": {"path": v}} for k, v in paths.items()]
        container["volumeMounts"] = [{"name": "cdi", "mountPath": "/var/run/cdi"}]
    return {"apiVersion": "apps/v1", "kind": kind,
            "metadata": {"name": name, "namespace": NS}, "spec": spec}  # fmt: skip


MONITORING_NS = {
    "matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["monitoring"]}
    ]
}


def _policy(name: str, *rules: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"podSelector": {}, "ingress": list(rules)}}  # fmt: skip


def _metrics_rule(selector: dict[str, Any]) -> dict[str, Any]:
    return {"from": [{"namespaceSelector": selector}], "ports": [{"port": "metrics"}]}


def _rendering(
    mode: str = "device-plugin", cm: str = "instaslice-config-aaaa", allocation: str = "gates"
) -> list[Any]:
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}},
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "data": {"binding-mode": mode, "allocation-mode": allocation},
            "metadata": {"name": cm, "namespace": NS},
        },
        _workload("Deployment", "instaslice-webhook", "quay.io/x/instaslice-webhook:v1", cm),
        _workload("DaemonSet", "instaslice-nodeagent", "quay.io/x/instaslice-nodeagent:v1", cm),
        _policy(
            "instaslice-webhook", {"ports": [{"port": "webhook"}]}, _metrics_rule(MONITORING_NS)
        ),
        _policy("instaslice-nodeagent", _metrics_rule(MONITORING_NS)),
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "metadata": {
                "name": "instaslice",
                "annotations": {"cert-manager.io/inject-ca-from": f"{NS}/instaslice-webhook"},
            },
            "webhooks": [],
        },
    ]


RULE = {
    "apiVersion": "monitoring.coreos.com/v1",
    "kind": "PrometheusRule",
    "metadata": {"name": "instaslice", "namespace": NS},
    "spec": {"summary": "pod {{ $labels.pod }} down"},
}


CLASS = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "DeviceClass",
    "metadata": {"name": "mig.instaslice.io"},
    "spec": {"selectors": [{"cel": {"expression": 'device.driver == "instaslice.io"'}}]},
}


def _variants() -> dict[str, list[Any]]:
    return {
        "default": _rendering(),
        "binding-env": _rendering("env", "instaslice-config-bbbb"),
        "monitoring": [*_rendering(), RULE],
        "dra": [*_rendering("device-plugin", "instaslice-config-cccc", "dra"), CLASS],
        "binding-env+dra": [*_rendering("env", "instaslice-config-dddd", "dra"), CLASS],
        "metrics-auth": _with_auth(_rendering()),
    }


def _with_auth(objs: list[Any]) -> list[Any]:
    """What manifests/components/metrics-auth does to the synthetic rendering."""
    objs = copy.deepcopy(objs)
    for o in objs[2:4]:  # the two workloads
        o["spec"]["template"]["spec"]["containers"][0]["args"].append("--metrics-auth")
    reader = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
              "metadata": {"name": "instaslice-metrics-reader"}, "rules": []}  # fmt: skip
    return [*objs, reader]


def test_parameterises_what_users_set() -> None:
    files = build_chart(_variants(), "1")
    values = yaml.safe_load(files["values.yaml"])
    assert values["images"]["webhook"] == {
        "repository": "quay.io/x/instaslice-webhook",
        "tag": "v1",
        "digest": "",
        "pullPolicy": "",
    }
    assert values["bindingMode"] == "device-plugin"
    assert values["webhook"]["replicas"] == 2
    assert values["monitoring"] == {"enabled": False}
    chart = yaml.safe_load(files["Chart.yaml"])
    assert (chart["version"], chart["appVersion"]) == ("1", "v1")
    deploy = files["templates/deployment-instaslice-webhook.yaml"]
    assert "replicas: {{ .Values.webhook.replicas }}" in deploy
    assert '{{ include "instaslice.configName" . }}' in deploy
    assert "resources:\n{{- toYaml .Values.webhook.resources | nindent 10 }}" in deploy
    assert "instaslice-config-aaaa" not in deploy
    helpers = files["templates/_helpers.tpl"]
    assert '"device-plugin/gates" -}}\ninstaslice-config-aaaa' in helpers
    assert '"env/gates" -}}\ninstaslice-config-bbbb' in helpers
    assert '"device-plugin/dra" -}}\ninstaslice-config-cccc' in helpers
    assert '"env/dra" -}}\ninstaslice-config-dddd' in helpers
    cm = files["templates/configmap-instaslice-config.yaml"]
    assert "binding-mode: {{ .Values.bindingMode | quote }}" in cm
    assert "allocation-mode: {{ .Values.allocationMode | quote }}" in cm
    assert values["allocationMode"] == "gates"


def test_daemon_flags_pod_fields_and_kubelet_dir_are_values() -> None:
    """The manifests' flags give the defaults and become template expressions; pod fields
    the manifests set are defaults of optional values; host paths under the kubelet's dir
    follow `kubeletDir` but the device plugins' one; the CDI and state ones are values."""
    files = build_chart(_variants(), "1")
    values = yaml.safe_load(files["values.yaml"])
    assert values["allocator"] == {
        "policy": "instaslice", "preemption": "gpu", "autoscalerSignal": "off"
    }  # fmt: skip
    assert (values["logLevel"], values["allocationMode"]) == ("info", "gates")
    assert values["nodeagent"]["priorityClassName"] == "system-node-critical"
    assert values["nodeagent"]["kubeletDir"] == "/var/lib/kubelet"
    assert values["webhook"]["priorityClassName"] == ""
    deploy = files["templates/deployment-instaslice-webhook.yaml"]
    assert "- --policy={{ .Values.allocator.policy }}" in deploy
    assert "- --log-level={{ .Values.logLevel }}" in deploy
    assert "- --port=8443" in deploy  # not a value
    assert 'image: {{ include "instaslice.image" .Values.images.webhook | quote }}' in deploy
    ds = files["templates/daemonset-instaslice-nodeagent.yaml"]
    assert "priorityClassName: system-node-critical" not in ds
    assert (
        "{{- with .Values.nodeagent.priorityClassName }}\n      priorityClassName: "
        "{{ . | quote }}\n{{- end }}" in ds
    )
    assert "path: {{ .Values.nodeagent.kubeletDir }}/pod-resources" in ds
    # the kubelet fixes the device plugins' directory whatever its root
    assert "path: /var/lib/kubelet/device-plugins" in ds
    assert values["nodeagent"]["hostPaths"] == {
        "cdi": "/var/run/cdi",
        "state": "/var/lib/instaslice",
    }
    assert "path: {{ .Values.nodeagent.hostPaths.state | quote }}" in ds
    assert "path: {{ .Values.nodeagent.hostPaths.cdi | quote }}" in ds
    assert (
        '        app: instaslice-nodeagent\n{{- include "instaslice.labels" . | nindent 8 }}' in ds
    )


def test_the_namespace_is_the_releases() -> None:
    files = build_chart(_variants(), "1")
    assert not any(name.startswith("templates/namespace-") for name in files)
    for name, text in files.items():
        if name.startswith("templates/") and name.endswith(".yaml"):
            assert NS not in text, name
            assert 'include "instaslice.labels"' in text or name == "templates/validate.yaml"
    assert (
        "namespace: {{ .Release.Namespace }}" in files["templates/configmap-instaslice-config.yaml"]
    )


def test_refuses_a_workload_without_the_flags_it_parameterises() -> None:
    v = copy.deepcopy(_variants())
    for objs in v.values():
        objs[2]["spec"]["template"]["spec"]["containers"][0]["args"] = ["--port=8443"]
    with pytest.raises(SystemExit, match="no flag for the values"):
        build_chart(v, "1")


def test_kubelet_paths_follow_kubelet_dir_inside_the_container_too() -> None:
    """A kubelet dir is mounted at its host path and the flag naming it follows the value: the
    DRA plugin's socket path the agent registers is the one the kubelet dials on the node."""
    v = copy.deepcopy(_variants())
    for objs in v.values():
        c = objs[3]["spec"]["template"]["spec"]["containers"][0]
        c["args"] = [
            "--pod-resources-socket=/var/lib/kubelet/pod-resources/kubelet.sock",
            *c["args"],
        ]
        c["volumeMounts"].append(
            {"name": "pod-resources", "mountPath": "/var/lib/kubelet/pod-resources"}
        )
    ds = build_chart(v, "1")["templates/daemonset-instaslice-nodeagent.yaml"]
    kubelet_dir = "{{ .Values.nodeagent.kubeletDir }}"
    assert f"- --pod-resources-socket={kubelet_dir}/pod-resources/kubelet.sock" in ds
    assert f"mountPath: {kubelet_dir}/pod-resources\n" in ds
    for objs in v.values():  # mounted elsewhere: the kubelet could not dial what it is told
        objs[3]["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][-1]["mountPath"] = (
            "/kubelet/pod-resources"
        )
    with pytest.raises(SystemExit, match="not its host path"):
        build_chart(v, "1")


def test_the_metrics_namespace_selector_is_a_value() -> None:
    """Both NetworkPolicies' metrics rule admit `.Values.metricsNamespaceSelector`, whose
    default is the overlay's; the admission port's rule stays open to every source."""
    files = build_chart(_variants(), "1")
    assert yaml.safe_load(files["values.yaml"])["metricsNamespaceSelector"] == MONITORING_NS
    block = "- namespaceSelector:\n{{- toYaml .Values.metricsNamespaceSelector | nindent "
    for name in ("instaslice-webhook", "instaslice-nodeagent"):
        policy = files[f"templates/networkpolicy-{name}.yaml"]
        assert block in policy, policy
        assert "kubernetes.io/metadata.name" not in policy
    webhook = files["templates/networkpolicy-instaslice-webhook.yaml"]
    assert "- ports:\n    - port: webhook\n" in webhook, webhook  # no `from`: any source
    schema = json.loads(files["values.schema.json"])["properties"]["metricsNamespaceSelector"]
    assert schema["minProperties"] == 1  # `{}` would admit every namespace


@pytest.mark.parametrize(
    ("rules", "complaint"),
    [
        ([_metrics_rule({})], "expected one non-empty"),  # `{}`: every namespace
        ([_metrics_rule({"matchLabels": {"team": "x"}})], "expected one non-empty"),  # differs
        ([{"ports": [{"port": "metrics"}]}], "expected one namespaceSelector"),  # no `from`
    ],
    ids=["empty", "two-selectors", "open-to-all"],
)
def test_refuses_a_metrics_rule_it_cannot_parameterise(
    rules: list[dict[str, Any]], complaint: str
) -> None:
    v = copy.deepcopy(_variants())
    for objs in v.values():  # the node agent's policy, in every rendering alike
        next(o for o in objs if o["metadata"]["name"] == "instaslice-nodeagent"
             and o["kind"] == "NetworkPolicy")["spec"]["ingress"] = rules  # fmt: skip
    with pytest.raises(SystemExit, match=complaint):
        build_chart(v, "1")


def test_monitoring_objects_are_optional_and_braces_escaped() -> None:
    rule = build_chart(_variants(), "1")["templates/monitoring/prometheusrule-instaslice.yaml"]
    assert rule.startswith("{{- if .Values.monitoring.enabled }}\n")
    assert rule.endswith("{{- end }}\n")
    assert 'pod {{ "{{" }} $labels.pod }} down' in rule


def test_metrics_auth_is_a_value() -> None:
    files = build_chart(_variants(), "1")
    deploy = files["templates/deployment-instaslice-webhook.yaml"]
    assert "{{- if .Values.metricsAuth.enabled }}\n        - --metrics-auth\n{{- end }}" in deploy
    role = files["templates/metrics-auth/clusterrole-instaslice-metrics-reader.yaml"]
    assert role.startswith("{{- if .Values.metricsAuth.enabled }}\n")
    v = _variants()
    v["metrics-auth"][2]["spec"]["replicas"] = 5  # the component touching something else
    with pytest.raises(SystemExit, match="metrics-auth changes more"):
        build_chart(v, "1")


def test_refuses_a_component_that_changes_more() -> None:
    v = _variants()
    env = copy.deepcopy(v["binding-env"])
    env[2]["spec"]["replicas"] = 3  # binding-env touching the Deployment
    with pytest.raises(SystemExit, match="binding-env changes more"):
        check_variants({**v, "binding-env": env})
    mon = copy.deepcopy(v["monitoring"])
    mon[0]["metadata"]["labels"] = {"x": "y"}  # monitoring touching the Namespace
    with pytest.raises(SystemExit, match="monitoring changes existing objects"):
        check_variants({**v, "monitoring": mon})
    wrong = _rendering("env")  # the default rendering must be device-plugin
    with pytest.raises(SystemExit, match=r"expected .*'device-plugin'"):
        check_variants({**v, "default": wrong})
    dra = copy.deepcopy(v["dra"])
    dra[2]["spec"]["replicas"] = 3  # the dra component touching the Deployment
    with pytest.raises(SystemExit, match="dra changes more"):
        check_variants({**v, "dra": dra})
    with pytest.raises(SystemExit, match="binding-env changes more"):  # adds in gate mode
        check_variants({**v, "binding-env": [*v["binding-env"], CLASS]})


def test_dra_objects_render_only_in_dra_mode() -> None:
    """What the dra component adds (DeviceClasses, RBAC) is in the chart behind
    allocationMode=dra, never in a gate-mode install."""
    files = build_chart(_variants(), "1")
    cls = files["templates/dra/deviceclass-mig.instaslice.io.yaml"]
    assert cls.startswith('{{- if eq .Values.allocationMode "dra" }}\n')
    assert cls.endswith("{{- end }}\n")
    assert not any(f.startswith("templates/deviceclass") for f in files)
    schema = json.loads(files["values.schema.json"])["properties"]["allocationMode"]
    assert schema == {"enum": ["gates", "dra"]}


def test_the_chart_refuses_image_tags_other_than_its_version() -> None:
    """common/version.py is the one version: the chart's appVersion is v<version>, and an
    overlay pinning another image tag stops the generation instead of shipping both."""
    chart = yaml.safe_load(build_chart(_variants(), "1")["Chart.yaml"])
    assert chart["appVersion"] == "v1"
    with pytest.raises(ValueError, match="not v2"):
        build_chart(_variants(), "2")
