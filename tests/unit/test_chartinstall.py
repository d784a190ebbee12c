"""`install: chart`'s pure parts: the spec key, the dev install's chart values, the pod
network's CNI config, and the documented install blocks hack/cluster/chartinstall.py runs.

The install itself (images, Helm, the pods on the real node) is tests/e2e/test_installed.py.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from hack.cluster import podnet
from hack.cluster.chartinstall import chart_values, doc_block
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
    assert v["nodeagent"]["hostPaths"] == {
        "cdi": "/d/realnode/real-0/cdi",
        "podResources": "/d/realnode/real-0/kubelet/pod-resources",
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


def test_the_documented_install_is_three_blocks_the_last_one_helm_command() -> None:
    certs, prepare, install = (doc_block(n) for n in ("certs", "prepare", "install"))
    assert "openssl" in certs and "DNS:instaslice-webhook.instaslice-system.svc" in certs
    assert "secret tls instaslice-webhook-tls" in prepare
    assert "meta.helm.sh/release-name=instaslice" in prepare
    # chartinstall appends the dev values to the last command: it must be the one helm call
    words = shlex.split(install.replace("\\\n", " "))
    assert words[:5] == ["helm", "upgrade", "--install", "instaslice", "charts/instaslice"]
    assert "certificate.source=secret" in words
    assert install.count("\n") == 2 and install.rstrip().endswith(')"'), install
