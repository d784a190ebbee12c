"""The values of the Helm chart charts/instaslice: their JSON schema and the comments of
values.yaml (hack/gen_chart.py writes both; the defaults come from the kustomize rendering).

Kept apart from the generator so that the list of values, their types and their one-line
docs read in one place; docs/install.md "Chart values" lists the same keys (a test compares).
"""

from __future__ import annotations

from typing import Any

import yaml

from common.placement import Policy
from hack.chart_certs import MODES as CERT_MODES
from webhook.allocator.autoscale import SignalMode

__all__ = [
    "AGENT_HOST_PATHS",
    "ALLOCATION_MODES",
    "ARG_VALUES",
    "BINDING_MODES",
    "LOG_LEVELS",
    "MODE_VARIANTS",
    "POD_FIELDS",
    "WORKLOAD_PARTS",
    "schema",
    "values_yaml",
]

BINDING_MODES = ("device-plugin", "env")
ALLOCATION_MODES = ("gates", "dra")
# (binding mode, allocation mode) -> the rendering with exactly the components that set them
MODE_VARIANTS = {
    ("device-plugin", "gates"): "default",
    ("env", "gates"): "binding-env",
    ("device-plugin", "dra"): "dra",
    ("env", "dra"): "binding-env+dra",
}
LOG_LEVELS = ("debug", "info", "warning", "error")
WORKLOAD_PARTS = ("webhook", "nodeagent")

# pod spec fields that are values of each workload, with what "unset" is
POD_FIELDS: dict[str, Any] = {
    "nodeSelector": {},
    "tolerations": [],
    "affinity": {},
    "priorityClassName": "",
}

# the node agent's host directories that are values: nodeagent.hostPaths.KEY -> its volume
AGENT_HOST_PATHS = {"cdi": "cdi", "state": "state"}

# (workload, flag) -> the value path that sets it; the flag's value in manifests/ is the default
ARG_VALUES: dict[tuple[str, str], str] = {
    ("webhook", "--policy"): "allocator.policy",
    ("webhook", "--preemption"): "allocator.preemption",
    ("webhook", "--autoscaler-signal"): "allocator.autoscalerSignal",
    ("webhook", "--log-level"): "logLevel",
    ("nodeagent", "--log-level"): "logLevel",
    ("nodeagent", "--warm-slices"): "warmSlices",
}

_OBJ = {"type": "object"}
_DIR = {"type": "string", "pattern": "^/.*[^/]$"}  # an absolute directory, no trailing /
_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}


def _image() -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["repository", "tag", "digest", "pullPolicy"],
        "properties": {
            "repository": {"type": "string", "minLength": 1},
            "tag": {"type": "string", "minLength": 1},
            # set: the image is pulled by digest (repository@digest) and the tag is ignored
            "digest": {"type": "string", "pattern": "^(sha256:[a-f0-9]{64})?$"},
            "pullPolicy": {"enum": ["", "Always", "IfNotPresent", "Never"]},
        },
    }


def _object(props: dict[str, Any]) -> dict[str, Any]:
    """An object with exactly these properties, all required."""
    return {
        "type": "object",
        "additionalProperties": False,
        "required": list(props),
        "properties": props,
    }


def _workload(extra: dict[str, Any], required: list[str]) -> dict[str, Any]:
    props = {
        "resources": _OBJ,
        "nodeSelector": _STR_MAP,
        "tolerations": {"type": "array", "items": _OBJ},
        "affinity": _OBJ,
        "priorityClassName": {"type": "string"},
        "podLabels": _STR_MAP,
        "podAnnotations": _STR_MAP,
        **extra,
    }
    return {
        "type": "object",
        "additionalProperties": False,
        "required": [*required, *(k for k in props if k not in extra)],
        "properties": props,
    }


_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "minProperties": 1,
    "properties": {
        "matchLabels": {
            "type": "object",
            "minProperties": 1,
            "additionalProperties": {"type": "string"},
        },
        "matchExpressions": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["key", "operator"],
                "properties": {
                    "key": {"type": "string", "minLength": 1},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}


def schema() -> dict[str, Any]:
    props: dict[str, Any] = {
        "images": {
            "type": "object",
            "additionalProperties": False,
            "required": list(WORKLOAD_PARTS),
            "properties": {part: _image() for part in WORKLOAD_PARTS},
        },
        "imagePullSecrets": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name"],
                "properties": {"name": {"type": "string", "minLength": 1}},
            },
        },
        "bindingMode": {"enum": list(BINDING_MODES)},
        "allocationMode": {"enum": list(ALLOCATION_MODES)},
        "logLevel": {"enum": list(LOG_LEVELS)},
        "warmSlices": {"enum": ["on", "off"]},
        "allocator": {
            "type": "object",
            "additionalProperties": False,
            "required": ["policy", "preemption", "autoscalerSignal"],
            "properties": {
                "policy": {"enum": [p.value for p in Policy]},
                "preemption": {"enum": ["gpu", "off"]},
                "autoscalerSignal": {"enum": [m.value for m in SignalMode]},
            },
        },
        # the PodDisruptionBudget keeps 1 available: with 1 replica drains would block
        "webhook": _workload({"replicas": {"type": "integer", "minimum": 2}}, ["replicas"]),
        "nodeagent": _workload(
            {"kubeletDir": _DIR, "hostPaths": _object({k: _DIR for k in AGENT_HOST_PATHS})},
            ["kubeletDir", "hostPaths"],
        ),
        "monitoring": {
            "type": "object",
            "additionalProperties": False,
            "required": ["enabled"],
            "properties": {"enabled": {"type": "boolean"}},
        },
        "metricsAuth": {
            "type": "object",
            "additionalProperties": False,
            "required": ["enabled"],
            "properties": {"enabled": {"type": "boolean"}},
        },
        # a LabelSelector that selects something: `{}` would admit every namespace
        "metricsNamespaceSelector": _SELECTOR,
        "certificates": {
            "type": "object",
            "additionalProperties": False,
            "required": ["mode"],
            "properties": {"mode": {"enum": list(CERT_MODES)}},
        },
        # tests only: the node agent on the NVML emulator (make dev-up's `install: chart`)
        "testing": _object(
            {
                "emulator": {
                    **_object(
                        {
                            "enabled": {"type": "boolean"},
                            "stateDir": {"type": "string"},
                            "devRoot": {"type": "string"},
                        }
                    ),
                    # both host directories when on: the emulated GPUs and their device files
                    "if": {"properties": {"enabled": {"const": True}}},
                    "then": {"properties": {"stateDir": _DIR, "devRoot": _DIR}},
                }
            }
        ),
        "uninstallHook": {
            "type": "object",
            "additionalProperties": False,
            "required": ["enabled", "timeoutSeconds"],
            "properties": {
                "enabled": {"type": "boolean"},
                "timeoutSeconds": {"type": "integer", "minimum": 1},
            },
        },
    }
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "object",
        "additionalProperties": False,
        "required": list(props),
        "properties": props,
    }


_VALUES_COMMENT = """\
# Values of the InstaSlice chart (generated by hack/gen_chart.py from manifests/; defaults are
# the Kubernetes overlay's). values.schema.json refuses anything else; docs/install.md
# "Chart values" lists every key.
#
# The namespace is the release's: `helm install -n instaslice-system --create-namespace ...`.
# The node agent needs the `privileged` Pod Security level there (docs/install.md "Helm").
"""

_VALUE_DOCS = {
    "images": "images of the two components (the overlay's `images:`). digest (sha256:...):\n"
    '# pull by digest, the tag is then ignored; pullPolicy: "" leaves Kubernetes\' default',
    "imagePullSecrets": "Secrets (in the release namespace) for pulling both images",
    "bindingMode": "device-plugin | env: the component manifests/components/binding-env\n"
    "# (docs/binding.md)",
    "allocationMode": "gates (scheduling gates + the allocator, docs/contract.md) | dra: the "
    "component\n# manifests/components/dra (docs/dra.md; Kubernetes 1.36 or later); dra adds "
    "the DeviceClasses\n# and the node agent's DRA RBAC",
    "logLevel": "both daemons' --log-level",
    "warmSlices": "the node agent's --warm-slices: on keeps a few slices of the profiles most "
    "asked for\n# made ahead of demand (docs/warm-slices.md); off: never",
    "allocator": "the allocator's flags (docs/configuration.md): --policy, --preemption,\n"
    "# --autoscaler-signal",
    "webhook": "the admission webhook + allocator Deployment (replicas >= 2: its PDB keeps one)",
    "nodeagent": "the node agent DaemonSet; kubeletDir: the kubelet's root directory on the "
    "nodes\n# (pod-resources/, plugins_registry/ and plugins/ under it, mounted at the same paths: "
    "the DRA\n# plugin's socket path is what the kubelet dials; the device plugins' directory "
    "is\n# /var/lib/kubelet/device-plugins whatever the root, the kubelet fixes it); hostPaths: "
    "the node's\n# CDI-spec (cdi) and agent-state (state) directories",
    "monitoring": "PodMonitor + PrometheusRule (manifests/components/monitoring); needs the\n"
    "# Prometheus Operator's monitoring.coreos.com CRDs",
    "metricsAuth": "the component manifests/components/metrics-auth: /metrics over TLS for a "
    "bearer token\n# granted instaslice-metrics-reader only; the PodMonitor sends the "
    "token of instaslice-metrics-scraper",
    "metricsNamespaceSelector": "the namespaces whose pods may connect to the metrics ports "
    '(both NetworkPolicies;\n# docs/metrics.md "Who may scrape"): your Prometheus\'s, by '
    "name (the label the API server sets).\n# Never empty: {} would admit every namespace. "
    "OpenShift: values [openshift-monitoring,\n# openshift-user-workload-monitoring]. "
    "Helm merges maps: to select by matchLabels instead,\n# set matchExpressions to null.",
    "certificates": "the webhook's serving certificate. self: the webhook issues, rotates and "
    "injects it\n# itself (no cert-manager needed); cert-manager: the overlay's Issuer and "
    "Certificate (cert-manager\n# 1.x); openshift: the service CA operator",
    "testing": "tests only (make dev-up's `install: chart`, docs/control-plane.md): the node "
    "agent runs the\n# NVML emulator, its state and device files in these host directories. "
    "Never on real GPUs.",
    "uninstallHook": "`helm uninstall` runs instaslice-uninstall as pre-/post-delete Jobs: it "
    "refuses while a slice\n# is in use, else releases everything as `make uninstall` does "
    '(docs/upgrade.md "Helm");\n# timeoutSeconds bounds each of its waits. The CRDs are '
    "kept (helm.sh/resource-policy: keep).",
}


def values_yaml(values: dict[str, Any], dumper: type[yaml.SafeDumper]) -> str:
    parts = [_VALUES_COMMENT]
    for key, value in values.items():
        parts.append(f"\n# {_VALUE_DOCS[key]}\n")
        parts.append(yaml.dump({key: value}, Dumper=dumper, sort_keys=False))
    return "".join(parts)
