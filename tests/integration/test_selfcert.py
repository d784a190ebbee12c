"""`--cert-mode=self` (webhook/selfcert.py) on a real API server, with the chart's RBAC.

The Helm chart's default rendering (certificates.mode self) supplies the CRDs, the
MutatingWebhookConfiguration, the admission policies and every RBAC object; the webhook's
certificate code then runs as the controller ServiceAccount (a kubeconfig RBAC treats as it),
next to a real admission server reading the files it writes:

- the Secret is created and the configuration's caBundle patched with its CA; the server
  serves the Secret's certificate, which that caBundle verifies;
- a second replica starting meanwhile takes the same pair (no second CA);
- a pair in its renewal window, put into the Secret by hand, is rotated without a restart:
  the watch sees it, a new CA and certificate replace it, the caBundle holds the new CA and
  the previous one, and the running server serves the new certificate.

Uses a private control plane: the chart's webhook configuration would catch other modules'
pods. Leaves out: the API server calling the webhook through the Service (no kubelet, no
Service network here: tests/e2e on an `install: chart` cluster).
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from common.clock import SystemClock
from common.kubeapi import Kube, core_path, group_path
from hack.cluster import ControlPlane
from tests.integration import test_helm_chart as chart
from tests.integration import test_manifests as manifests
from tests.integration.private_cluster import kubectl_ok, private_control_plane
from webhook.selfcert import SelfCertSettings, ensure, issue, run_cert_rotation, secret_body
from webhook.server import running
from webhook.settings import AdmissionSettings, ServerSettings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
helm = chart.helm
NS = "instaslice-system"
MWC = group_path(
    "admissionregistration.k8s.io/v1", "mutatingwebhookconfigurations", name="instaslice"
)
SECRET = core_path("secrets", NS, "instaslice-webhook-tls")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, helm: Path) -> Iterator[ControlPlane]:
    with private_control_plane(tmp_path_factory, "selfcert-cp") as cp:
        docs = manifests._docs(chart.helm_template(helm).stdout)
        kinds = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
                 "MutatingWebhookConfiguration", "ValidatingAdmissionPolicy",
                 "ValidatingAdmissionPolicyBinding"}  # fmt: skip
        picked = [d for d in docs if d["kind"] in kinds
                  and "helm.sh/hook" not in (d["metadata"].get("annotations") or {})]  # fmt: skip
        crds = [d for d in docs if d["kind"] == "CustomResourceDefinition"]
        for args, stdin in (
            (("create", "namespace", NS), None),
            (("apply", "--server-side", "-f", "-"), yaml.safe_dump_all(crds)),
            (("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all"), None),
            (("apply", "--server-side", "-f", "-"), yaml.safe_dump_all(picked)),
        ):
            kubectl_ok(cp, *args, stdin=stdin)
        yield cp


def _settings(tmp: Path) -> SelfCertSettings:
    return SelfCertSettings(namespace=NS, cert_file=tmp / "tls.crt", key_file=tmp / "tls.key")


async def _served(port: int, ca: bytes) -> bytes:
    """The certificate the server presents, verified against `ca` (DER)."""
    ctx = ssl.create_default_context(cadata=ca.decode())
    ctx.check_hostname = False  # 127.0.0.1 is not one of the Service's names
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
    try:
        der: bytes = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        return der
    finally:
        writer.close()


def _der(pem: bytes) -> bytes:
    return x509.load_pem_x509_certificate(pem).public_bytes(Encoding.DER)


async def _until(what: str, check: Any, timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            got = await check()
        except (OSError, ssl.SSLError, KeyError):
            got = None
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)


def _data(secret: dict[str, Any], key: str) -> bytes:
    return base64.b64decode(secret["data"][key])


async def test_self_managed_certificate_is_injected_and_rotated_without_restart(
    cluster: ControlPlane, tmp_path: Path
) -> None:
    kubeconfig = cluster.service_account_kubeconfig(NS, "instaslice-controller")
    s = _settings(tmp_path / "a")
    async with await Kube.connect(str(kubeconfig)) as kube:
        first = await ensure(kube, s, SystemClock().wall())
        secret = await kube.get(SECRET)
        ca = _data(secret, "ca.crt")
        (hook, *rest) = (await kube.get(MWC))["webhooks"]
        assert [w["clientConfig"]["caBundle"] for w in (hook, *rest)] == [
            base64.b64encode(ca).decode()
        ] * (1 + len(rest))
        # a second replica starting now takes the same pair
        second = await ensure(kube, _settings(tmp_path / "b"), SystemClock().wall())
        assert second[0] == first[0]
        assert (tmp_path / "b" / "tls.crt").read_bytes() == _data(secret, "tls.crt")

        server = ServerSettings(cert_file=s.cert_file, key_file=s.key_file, host="127.0.0.1",
                                port=0, admission=AdmissionSettings.from_catalog(),
                                cert_check_interval_s=0.2)  # fmt: skip
        async with running(server) as srv:
            assert await _served(srv.port, ca) == _der(_data(secret, "tls.crt"))
            rotation = asyncio.create_task(
                run_cert_rotation(kube, s, SystemClock(), first=first), name="rotation"
            )
            try:
                # an administrator's (or a long-gone replica's) pair, 300 days old
                old = issue(SystemClock().wall() - dt.timedelta(days=300), s.dns_names,
                            s.validity_s)  # fmt: skip
                current = await kube.get(SECRET)
                await kube.replace(
                    SECRET, secret_body(old, s, current["metadata"]["resourceVersion"])
                )

                async def rotated() -> dict[str, Any] | None:
                    got = await kube.get(SECRET)
                    fresh = _data(got, "tls.crt") not in (old.cert, _data(secret, "tls.crt"))
                    return got if fresh else None

                new = await _until("the Secret's rotation", rotated)
                cas = x509.load_pem_x509_certificates(_data(new, "ca.crt"))
                assert cas[1] == x509.load_pem_x509_certificate(old.ca)  # still trusted
                want_bundle = base64.b64encode(_data(new, "ca.crt")).decode()

                async def injected() -> bool:
                    hooks = (await kube.get(MWC))["webhooks"]
                    return all(w["clientConfig"]["caBundle"] == want_bundle for w in hooks)

                await _until("the new caBundle", injected)
                new_der = _der(_data(new, "tls.crt"))

                async def serving_new() -> bool:
                    return await _served(srv.port, _data(new, "ca.crt")) == new_der

                await _until("the running server to serve the new certificate", serving_new)
                assert not rotation.done(), rotation
            finally:
                rotation.cancel()
                await asyncio.gather(rotation, return_exceptions=True)
