"""Fixtures and helpers for tests where the real kube-apiserver calls InstaSlice's webhook.

`webhook` (module scope): the admission server of webhook.server, running in the test's event
loop on a free 127.0.0.1 port over TLS (CA and serving certificate from certs.make), plus the
namespace label mirror (webhook.nsmirror); registered with the shipped
manifests/base/webhook/mutatingwebhookconfiguration.yaml — namespaceSelector, rules,
matchConditions, failurePolicy and timeout exactly as shipped — with only `clientConfig`
pointed at the test server (`url` + `caBundle`) and the name made unique. Torn down (the
configuration deleted, then the server stopped) when the module ends, so test modules never
see each other's webhooks.

The helpers wait on conditions with short polls under a deadline: whether the apiserver's
admission chain has picked up a configuration or a namespace label has no watchable signal
other than trying (server-side dry-run creates, which call the webhook but store nothing).
"""

from __future__ import annotations

import asyncio
import copy
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from certs.make import ca_bundle, make_ca, make_serving_cert, write_pair
from common.constants import ENABLED_KEY, GATE_NAME
from common.kubeapi import ApiError, Kube, Obj, core_path, group_path
from common.objects import new_claim_id
from hack.cluster import ControlPlane
from testkit.builders import container, user_pod
from tests import support
from webhook.metrics import WebhookMetrics
from webhook.nsmirror import run_namespace_mirror
from webhook.server import RunningServer, running
from webhook.settings import AdmissionSettings, ServerSettings

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "manifests" / "base"
ADMISSIONREG = "admissionregistration.k8s.io/v1"
MIG = "nvidia.com/mig-1g.18gb"


@dataclass
class Webhook:
    server: RunningServer
    metrics: WebhookMetrics
    config_name: str

    def reviews(self) -> float:
        """AdmissionReviews the server has answered so far (any outcome)."""
        return self.metrics.reviews_total()


def load_manifest(relpath: str) -> list[Obj]:
    return [d for d in yaml.safe_load_all((MANIFESTS / relpath).read_text()) if d]


@pytest.fixture(scope="module")
async def kube(control_plane: ControlPlane) -> AsyncIterator[Kube]:
    """common.kubeapi client as cluster admin."""
    async with await Kube.connect(str(control_plane.kubeconfig)) as k:
        yield k


@pytest.fixture(scope="module")
async def webhook(kube: Kube, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Webhook]:
    tmp = tmp_path_factory.mktemp("webhook-tls")
    ca = make_ca()
    write_pair(
        make_serving_cert(ca, ["localhost"], ["127.0.0.1"]), tmp / "tls.crt", tmp / "tls.key"
    )
    settings = ServerSettings(
        cert_file=tmp / "tls.crt", key_file=tmp / "tls.key", host="127.0.0.1", port=0,
        admission=AdmissionSettings.from_catalog(),
    )  # fmt: skip
    metrics = WebhookMetrics()
    mirror_synced = asyncio.Event()
    async with running(settings, metrics=metrics, new_claim=new_claim_id) as srv:
        mirror = asyncio.create_task(run_namespace_mirror(kube, synced=mirror_synced))
        config = load_manifest("webhook/mutatingwebhookconfiguration.yaml")[0]
        config["metadata"]["name"] = f"instaslice-it-{secrets.token_hex(3)}"
        for hook in config["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"{srv.url}{path}", "caBundle": ca_bundle(ca)}
        path = group_path(ADMISSIONREG, "mutatingwebhookconfigurations")
        await kube.create(path, config)
        try:
            await asyncio.wait_for(mirror_synced.wait(), 30)
            yield Webhook(srv, metrics, config["metadata"]["name"])
        finally:
            await kube.delete_ignore_missing(f"{path}/{config['metadata']['name']}")
            mirror.cancel()
            await asyncio.gather(mirror, return_exceptions=True)


# --- builders --------------------------------------------------------------------------------


def mig_pod(**kw: Any) -> Obj:
    return user_pod(container(limits={MIG: "1"}), **kw)


def is_rewritten(pod: Obj) -> bool:
    gates = pod["spec"].get("schedulingGates") or []
    return {"name": GATE_NAME} in gates


async def dry_run_create(kube: Kube, namespace: str, pod: Obj) -> Obj:
    return await kube.create(core_path("pods", namespace), pod, dryRun="All")


async def opt_in(kube: Kube, namespace: str, enabled: bool = True) -> None:
    value = "true" if enabled else None
    await kube.patch(
        core_path("namespaces", name=namespace), {"metadata": {"annotations": {ENABLED_KEY: value}}}
    )


async def webhook_applies(kube: Kube, namespace: str) -> bool:
    """Whether a MIG pod created in `namespace` now comes back rewritten (dry run)."""
    try:
        return is_rewritten(await dry_run_create(kube, namespace, mig_pod()))
    except ApiError:
        return False


async def opted_in_namespace(kube: Kube, namespace: str) -> str:
    """Opt `namespace` in and wait until the apiserver sends its MIG pods to the webhook."""
    await opt_in(kube, namespace)
    await support.eventually(lambda: webhook_applies(kube, namespace), what="the opt-in")
    return namespace


def strip_for_create(pod: Obj) -> Obj:
    """A pod as returned by the API, made creatable again (what `kubectl get -o yaml |
    kubectl create -f -` effectively sends)."""
    out = copy.deepcopy(pod)
    out.pop("status", None)
    meta = out["metadata"]
    for k in ("uid", "resourceVersion", "creationTimestamp", "managedFields", "generation"):
        meta.pop(k, None)
    return out
