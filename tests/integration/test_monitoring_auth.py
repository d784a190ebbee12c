"""Monitoring as shipped with metrics auth on: the components monitoring + metrics-auth.

- Rendered (the Kubernetes overlay with both components, monitoring first): the PodMonitor
  scrapes over https, skips verifying the node agent's self-signed certificate and sends
  the token of the Secret instaslice-metrics-scraper-token, which belongs to a
  ServiceAccount bound to instaslice-metrics-reader; both workloads get --metrics-auth and
  HTTPS probes (their metrics ports speak TLS only). It passes the server's dry run.
- On the real API server: the token controller fills that Secret, and its token is what a
  node agent's /metrics (behind the real TokenReview and SubjectAccessReview) lets in.

Leaves out: a real Prometheus Operator reading the PodMonitor.
"""

from __future__ import annotations

import asyncio
import base64
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from common.kubeapi import Kube
from common.metricsauth import MetricsAuth, MetricsAuthLimits
from hack.cluster import ControlPlane
from hack.cluster.procs import free_port
from nodeagent.metrics import AgentMetrics, health_server
from tests.integration import test_manifests as manifests

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
fetched = manifests.fetched
third_party_crds = manifests.third_party_crds
rendered = manifests.rendered
instaslice_namespace = manifests.instaslice_namespace
instaslice_crds = manifests.instaslice_crds
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def docs(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp = tmp_path_factory.mktemp("monitoring-auth")
    return manifests._render_with(control_plane, tmp, "kubernetes", ("monitoring", "metrics-auth"))


def _one(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (o,) = [d for d in objs if d["kind"] == kind and d["metadata"]["name"] == name]
    return o


def test_pod_monitor_carries_the_credentials_it_needs(docs: str) -> None:
    objs = manifests._docs(docs)
    (ep,) = _one(objs, "PodMonitor", "instaslice")["spec"]["podMetricsEndpoints"]
    assert (ep["port"], ep["scheme"], ep["tlsConfig"]) == (
        "metrics", "https", {"insecureSkipVerify": True}
    )  # fmt: skip
    cred = ep["authorization"]["credentials"]
    assert ep["authorization"]["type"] == "Bearer" and cred["key"] == "token"
    secret = _one(objs, "Secret", cred["name"])
    assert secret["type"] == "kubernetes.io/service-account-token"
    sa = secret["metadata"]["annotations"]["kubernetes.io/service-account.name"]
    assert secret["metadata"]["namespace"] == "instaslice-system"
    bound = [b for b in objs if b["kind"] == "ClusterRoleBinding"
             and {"kind": "ServiceAccount", "name": sa, "namespace": "instaslice-system"}
             in b["subjects"]]  # fmt: skip
    (binding,) = bound
    role = _one(objs, "ClusterRole", binding["roleRef"]["name"])
    assert role["rules"] == [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]
    for kind, name in (("Deployment", "instaslice-webhook"), ("DaemonSet", "instaslice-nodeagent")):
        (c,) = _one(objs, kind, name)["spec"]["template"]["spec"]["containers"]
        assert "--metrics-auth" in c["args"]
        for probe in ("livenessProbe", "readinessProbe"):
            assert c[probe]["httpGet"]["scheme"] == "HTTPS", f"{name} {probe}"


def test_monitoring_with_metrics_auth_passes_server_side_dry_run(
    control_plane: ControlPlane,
    docs: str,
    third_party_crds: list[str],
    instaslice_crds: None,
    instaslice_namespace: str,
) -> None:
    manifests.dry_run_server(control_plane, docs, "monitoring + metrics-auth")


async def test_the_shipped_scraper_token_is_let_in(
    control_plane: ControlPlane, docs: str, instaslice_namespace: str
) -> None:
    objs = manifests._docs(docs)
    names = {"instaslice-metrics-scraper", "instaslice-metrics-scraper-token",
             "instaslice-metrics-reader"}  # fmt: skip
    mine = [o for o in objs if o["metadata"]["name"] in names]
    text = yaml.safe_dump_all(mine)
    proc = control_plane.kubectl("apply", "-f", "-", stdin=text, check=False)
    assert proc.returncode == 0, proc.stderr
    try:
        async with await Kube.connect(str(control_plane.kubeconfig)) as kube:
            path = "/api/v1/namespaces/instaslice-system/secrets/instaslice-metrics-scraper-token"
            deadline = time.monotonic() + 30
            while not ((await kube.get(path)).get("data") or {}).get("token"):
                assert time.monotonic() < deadline, "the token controller did not fill it"
                await asyncio.sleep(0.2)
            token = base64.b64decode((await kube.get(path))["data"]["token"]).decode()
            port = free_port()
            auth = MetricsAuth(kube, MetricsAuthLimits(ttl_s=0.0, reviews_per_s=100))
            async with (
                health_server(port, AgentMetrics(), lambda: True, "127.0.0.1", auth=auth),
                aiohttp.ClientSession() as s,
            ):
                status = 0
                url, bearer = f"https://127.0.0.1:{port}/metrics", f"Bearer {token}"
                for _ in range(50):  # the authorizer may see the new binding a little later
                    async with s.get(url, ssl=False, headers={"Authorization": bearer}) as r:
                        status = r.status
                    if status == 200:
                        break
                    await asyncio.sleep(0.2)
                assert status == 200
    finally:
        control_plane.kubectl("delete", "-f", "-", "--ignore-not-found", stdin=text, check=False)
