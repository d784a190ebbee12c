"""`install: chart`'s pure parts: the spec key, the dev install's chart values, the pod
network's CNI config, and the documented install blocks hack/cluster/chartinstall.py runs.

The install itself (images, Helm, the pods on the real node) is tests/e2e/test_installed.py.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from hack.cluster import podnet
from hack.cluster.chartinstall import (
    UPGRADE_DOC,
    ChartInstallError,
    chart_values,
    doc_block,
    with_helm_args,
)
from hack.cluster.nodes import REAL_NODE_TAINT, SpecError, parse_spec
from hack.images import Built

REAL = {"prefix": "real", "count": 1, "gpus": 1, "model": "H100-80GB", "runtime": "containerd"}
KWOK = {"prefix": "kwok", "count": 1, "gpus": 1, "model": "H100-80GB"}


def test_install_chart_is_a_spec_key_that_needs_a_real_node() -> None:
    assert parse_spec({"nodes": [KWOK]}).install == "processes"
    assert parse_spec({"install": "chart", "nodes": [KWOK, REAL]}).install == "chart"
    with pytest.raises(SpecError, match="runtime: containerd"):
        parse_spec({"install": "chart", "nodes": [KWOK]})
    with pytest.raises(SpecError, match="install: 'kustomize'"):
        parse_spec({"install": "kustomize", "nodes": [KWOK, REAL]})


def test_dev_values_put_both_workloads_on_the_real_node_with_the_emulator() -> None:
    root, state = Path("/d/realnode/real-0"), Path("/d/gpus")
    images = {
        c: Built(Path(f"/d/images/{c}.tar"), f"localhost/instaslice/instaslice-{c}:dev-abc")
        for c in ("webhook", "nodeagent")
    }
    v = chart_values(node="real-0", root=root, gpu_state=state, images=images)
    key, value, effect = REAL_NODE_TAINT
    for part in ("webhook", "nodeagent"):
        assert v[part]["nodeSelector"] == {"kubernetes.io/hostname": "real-0"}
        assert v[part]["tolerations"] == [
            {"key": key, "operator": "Equal", "value": value, "effect": effect}
        ]
        assert v["images"][part] == {
            "repository": f"localhost/instaslice/instaslice-{part}",
            "tag": "dev-abc",
            "pullPolicy": "Never",  # imported, never pulled
        }
    # the kubelet's --root-dir (its pod-resources/ under it); the agent's own directories
    assert v["nodeagent"]["kubeletDir"] == "/d/realnode/real-0/kubelet"
    assert v["nodeagent"]["hostPaths"] == {
        "cdi": "/d/realnode/real-0/cdi",
        "state": "/d/realnode/real-0/agent-state",
    }
    assert v["testing"]["emulator"] == {
        "enabled": True,
        "stateDir": "/d/gpus",
        "devRoot": "/d/realnode/real-0/dev",
    }
    extra = chart_values(
        node="real-0", root=root, gpu_state=state, images=images,
        extra={"webhook": {"replicas": 3}, "bindingMode": "env"},
    )  # fmt: skip
    assert extra["webhook"]["replicas"] == 3 and extra["webhook"]["nodeSelector"]  # merged
    assert extra["bindingMode"] == "env"


def test_the_pod_network_is_a_bridge_with_host_local_ips() -> None:
    conf = podnet.conflist(Path("/d/cni/ipam"))
    (bridge,) = conf["plugins"]
    assert (bridge["type"], bridge["bridge"], bridge["isGateway"]) == ("bridge", "islice0", True)
    ipam = bridge["ipam"]
    assert ipam["type"] == "host-local" and ipam["dataDir"] == "/d/cni/ipam"
    assert ipam["ranges"] == [[{"subnet": podnet.SUBNET, "gateway": podnet.GATEWAY}]]
    assert set(podnet.CNI_PLUGINS) == {"bridge", "host-local"}


def test_the_documented_install_is_helm_install_with_the_self_managed_certificate() -> None:
    """docs/install.md "Helm without cert-manager": what an administrator without cert-manager
    runs, one helm command; nothing makes a certificate or the namespace beforehand."""
    install = doc_block("install")
    words = shlex.split(install.replace("\\\n", " "))
    assert words == [
        "helm", "install", "instaslice", "charts/instaslice",
        "--namespace", "instaslice-system", "--create-namespace",
    ]  # fmt: skip
    assert "openssl" not in install and "certificate" not in install


def test_the_dev_values_go_onto_the_blocks_helm_command() -> None:
    """chartinstall appends its --values to a block's one helm command, wherever it is in the
    block (docs/upgrade.md's Helm block ends with the rollouts)."""
    upgrade = doc_block("upgrade", UPGRADE_DOC)
    out = with_helm_args(upgrade, "--values=v.json")
    (helm_line,) = [c for c in out.splitlines() if c.startswith("helm ")]
    assert helm_line.startswith("helm upgrade instaslice charts/instaslice")
    assert helm_line.endswith(" --reuse-values --values=v.json"), helm_line
    assert "rollout status daemonset/instaslice-nodeagent" in out.splitlines()[-1]
    joined = with_helm_args("helm install a \\\n  --set x=1\nkubectl get pods\n", "--y")
    assert joined == "helm install a \\\n  --set x=1 --y\nkubectl get pods\n"
    with pytest.raises(ChartInstallError, match="one helm command"):
        with_helm_args("kubectl get pods\n", "--y")
