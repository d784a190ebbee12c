"""--metrics-auth against the real API server: the node agent's /metrics behind a real
TokenReview and SubjectAccessReview (common.metricsauth), with the RBAC of
manifests/components/metrics-auth applied.

A ServiceAccount bound to `instaslice-metrics-reader` scrapes (200); one without the binding
is refused (403), so is a made-up JWT-shaped token (403, the API server's answer), while a
made-up token of another shape and a scrape with no token are refused without a review (401);
/healthz stays open; the port speaks TLS only (a plain-HTTP scrape fails), for the node agent
and for the webhook's metrics port (its admission pair). Leaves out: a real Prometheus.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import yaml

from certs.make import make_ca, make_serving_cert, write_pair
from common.kubeapi import Kube, core_path, group_path
from common.metricsauth import MetricsAuth, MetricsAuthLimits
from hack.cluster import ControlPlane
from hack.cluster.procs import free_port
from nodeagent.metrics import AgentMetrics, health_server
from webhook.server import running
from webhook.settings import AdmissionSettings, ServerSettings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
RBAC = Path(__file__).parents[2] / "manifests/components/metrics-auth/rbac.yaml"


@pytest.fixture(scope="module")
async def kube(control_plane: ControlPlane) -> AsyncIterator[Kube]:
    async with await Kube.connect(str(control_plane.kubeconfig)) as k:
        yield k


async def _service_account_token(kube: Kube, ns: str, name: str) -> str:
    await kube.create(core_path("serviceaccounts", ns), {"metadata": {"name": name}})
    got = await kube.create(
        core_path("serviceaccounts", ns, name) + "/token",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {}},
    )
    return str(got["status"]["token"])


async def _bind_reader(kube: Kube, ns: str, sa: str) -> None:
    """The component's reader ClusterRole, bound to `sa` (as to Prometheus's)."""
    docs = [d for d in yaml.safe_load_all(RBAC.read_text()) if d]
    role = next(d for d in docs if d["metadata"]["name"] == "instaslice-metrics-reader"
                and d["kind"] == "ClusterRole")  # fmt: skip
    roles = group_path("rbac.authorization.k8s.io/v1", "clusterroles")
    bindings = group_path("rbac.authorization.k8s.io/v1", "clusterrolebindings")
    await kube.delete_ignore_missing(f"{roles}/{role['metadata']['name']}")
    await kube.create(roles, role)
    await kube.create(bindings, {
        "metadata": {"name": f"metrics-reader-{ns}"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": "instaslice-metrics-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}],
    })  # fmt: skip


async def _get(port: int, path: str, token: str | None, scheme: str = "https") -> int:
    """The status of a scrape; with metrics auth on, the port speaks TLS only (a
    self-signed pair for the node agent: not verified, as the shipped PodMonitor does)."""
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"{scheme}://127.0.0.1:{port}{path}", headers=headers, ssl=False) as r,
    ):
        await r.read()
        return r.status


async def test_metrics_only_for_a_token_granted_the_url(kube: Kube, namespace: str) -> None:
    scraper = await _service_account_token(kube, namespace, "scraper")
    stranger = await _service_account_token(kube, namespace, "stranger")
    await _bind_reader(kube, namespace, "scraper")
    port = free_port()
    # ask every time (the grant may take a moment), and often: the polling below
    auth = MetricsAuth(kube, MetricsAuthLimits(ttl_s=0.0, reviews_per_s=100, review_burst=100))

    async def status(token: str | None, path: str = "/metrics") -> int:
        return await _get(port, path, token)

    async with health_server(port, AgentMetrics(), lambda: True, "127.0.0.1", auth=auth):
        assert await status(None) == 401
        assert await status(stranger) == 403
        assert await status("not-a-token-" + secrets.token_hex(8)) == 401  # no review
        made_up = ".".join(secrets.token_urlsafe(24) for _ in range(3))  # JWT-shaped
        assert await status(made_up) == 403  # the API server's no
        assert await status(None, "/healthz") == 200  # the kubelet's probes carry no token
        with pytest.raises(aiohttp.ClientError):  # no token in clear text: TLS only
            await _get(port, "/metrics", scraper, scheme="http")
        for _ in range(50):  # the authorizer may see the new binding a little later
            if await status(scraper) == 200:
                break
            await asyncio.sleep(0.2)
        assert await status(scraper) == 200
    bindings = group_path("rbac.authorization.k8s.io/v1", "clusterrolebindings")
    await kube.delete_ignore_missing(f"{bindings}/metrics-reader-{namespace}")


async def test_webhook_metrics_port_speaks_tls_when_auth_is_on(kube: Kube, tmp_path: Path) -> None:
    ca = make_ca()
    write_pair(make_serving_cert(ca, ["localhost"], ["127.0.0.1"]), tmp_path / "c", tmp_path / "k")
    settings = ServerSettings(cert_file=tmp_path / "c", key_file=tmp_path / "k",
                              host="127.0.0.1", port=0, metrics_port=0,
                              admission=AdmissionSettings.from_catalog())  # fmt: skip
    auth = MetricsAuth(kube, MetricsAuthLimits(ttl_s=0.0))
    async with running(settings, metrics_auth=auth) as srv:
        assert srv.metrics_port is not None
        assert await _get(srv.metrics_port, "/metrics", None) == 401
        assert await _get(srv.metrics_port, "/healthz", None) == 200
        with pytest.raises(aiohttp.ClientError):
            await _get(srv.metrics_port, "/healthz", None, scheme="http")
    async with running(settings) as srv:  # auth off: plain HTTP, as before
        assert srv.metrics_port is not None
        assert await _get(srv.metrics_port, "/metrics", None, scheme="http") == 200
