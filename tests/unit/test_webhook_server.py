"""The HTTPS admission shell (webhook.server) over real sockets, without a cluster.

Covers: /mutate answers (patched, allowed, denied, malformed → denial or HTTP 400, oversized
→ 413), /healthz, /readyz, /metrics counters by outcome; TLS 1.2+ only; certificate reload
when the files change, and keeping the working pair when the new files are bad; a hypothesis
fuzz of malformed and hostile bodies (bad JSON, wrong kinds, huge counts, odd names, missing
fields, deep nesting) — every answer is a well-formed AdmissionReview or a 4xx, never a 5xx,
and the decision's internal-error path is never taken.
Leaves out: the apiserver calling us (tests/integration/test_webhook.py).
"""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from certs.make import KeyPair, make_ca, make_serving_cert, write_pair
from webhook.metrics import Outcome, WebhookMetrics
from webhook.server import STATE, build_app, running
from webhook.settings import ServerSettings

MIG = "nvidia.com/mig-1g.18gb"
# fixtures live in the session loop (pyproject), so the tests must run there too
pytestmark = pytest.mark.asyncio(loop_scope="session")


def review_doc(pod: Any = None, **request: Any) -> dict[str, Any]:
    if pod is None:
        pod = {
            "metadata": {"name": "p", "namespace": "ns"},
            "spec": {"containers": [{"name": "a", "resources": {"limits": {MIG: "1"}}}]},
        }
    req = {
        "uid": "u-1",
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "namespace": "ns",
        "operation": "CREATE",
        "userInfo": {"username": "alice"},
        "object": pod,
    }
    req.update(request)
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": req}


def plain_settings(**kw: Any) -> ServerSettings:
    return ServerSettings(cert_file=None, key_file=None, **kw)


@pytest.fixture
async def client() -> AsyncIterator[TestClient[web.Request, web.Application]]:
    app = build_app(plain_settings(max_body_bytes=256 * 1024), new_claim=lambda: "cfixed")
    async with TestClient(TestServer(app)) as c:
        yield c


def metrics_of(c: TestClient[web.Request, web.Application]) -> WebhookMetrics:
    return c.app[STATE].metrics


def check_answer(status: int, body: bytes, sent: Any) -> dict[str, Any] | None:
    """Assert the answer is well formed; return the AdmissionResponse (None for a 4xx)."""
    assert status < 500, (status, body[:300])
    if status != 200:
        assert status in (400, 413)
        return None
    doc = json.loads(body)
    assert doc["apiVersion"] == "admission.k8s.io/v1" and doc["kind"] == "AdmissionReview"
    resp = doc["response"]
    assert isinstance(resp["uid"], str) and resp["uid"]
    assert resp["uid"] == sent["request"]["uid"]
    assert isinstance(resp["allowed"], bool)
    if not resp["allowed"]:
        assert 400 <= resp["status"]["code"] < 500, resp
        assert resp["status"]["message"]
        assert len(resp["status"]["message"]) < 8192
    if "patch" in resp:
        assert resp["allowed"] and resp["patchType"] == "JSONPatch"
        patch = json.loads(base64.b64decode(resp["patch"]))
        jsonpatch.apply_patch(sent["request"]["object"], patch)  # applies cleanly
    return dict(resp)


# --- routes ----------------------------------------------------------------------------------


async def test_mutate_patches_a_mig_pod(client: TestClient[web.Request, web.Application]) -> None:
    sent = review_doc()
    r = await client.post("/mutate", json=sent)
    resp = check_answer(r.status, await r.read(), sent)
    assert resp is not None and resp["allowed"]
    patch = json.loads(base64.b64decode(resp["patch"]))
    claim = {"instaslice.io/claim": "cfixed"}
    assert {"op": "add", "path": "/metadata/annotations", "value": claim} in patch
    assert metrics_of(client).reviews_total(Outcome.PATCHED) == 1


async def test_mutate_allows_denies_and_counts(
    client: TestClient[web.Request, web.Application],
) -> None:
    no_mig = review_doc({"metadata": {}, "spec": {"containers": [{"name": "a"}]}})
    bad = review_doc(
        {"spec": {"containers": [{"name": "a", "resources": {"limits": {MIG: "0.5"}}}]}}
    )
    for sent in (no_mig, bad, review_doc(operation="UPDATE")):
        r = await client.post("/mutate", json=sent)
        check_answer(r.status, await r.read(), sent)
    r = await client.post("/mutate", json=bad)
    resp = (await r.json())["response"]
    assert resp["allowed"] is False
    assert (resp["status"]["code"], resp["status"]["reason"]) == (422, "Invalid")
    causes = resp["status"]["details"]["causes"]
    assert [c["field"] for c in causes] == [
        "spec.containers[0].resources.limits[nvidia.com/mig-1g.18gb]"
    ]
    assert (
        'container "a": resources.limits[nvidia.com/mig-1g.18gb]: count "0.5"'
        in (resp["status"]["message"])
    )
    m = metrics_of(client)
    assert m.reviews_total(Outcome.ALLOWED) == 2
    assert m.reviews_total(Outcome.DENIED) == 2
    text = await (await client.get("/metrics")).text()
    assert 'instaslice_webhook_reviews_total{outcome="denied"} 2.0' in text
    assert "instaslice_webhook_review_seconds_bucket" in text


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        (b"not json", 400, "body is not JSON"),
        (b"\xff\xfe", 400, "body is not JSON"),
        (b"[]", 400, "not a JSON object"),
        (b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}', 400, "no request"),
        (
            b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {}}',
            400,
            "uid",
        ),
        (b"[" * 100_000 + b"]" * 100_000, 400, "body is not JSON"),
        (b'{"request": {"uid": "' + b"9" * 5000 + b'"}, "n": ' + b"9" * 5000 + b"}", 400, "JSON"),
    ],
)
async def test_unanswerable_bodies_get_400(
    client: TestClient[web.Request, web.Application], body: bytes, status: int, words: str
) -> None:
    r = await client.post("/mutate", data=body)
    assert r.status == status
    assert words in (await r.json())["error"]
    assert metrics_of(client).reviews_total(Outcome.MALFORMED) == 1


@pytest.mark.parametrize(
    ("doc", "words"),
    [
        ({"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview",
          "request": {"uid": "u-1"}}, "expected kind AdmissionReview, admission.k8s.io/v1"),
        (review_doc(kind="Pod"), "request.kind is not a group/version/kind"),
        (review_doc(operation="PATCH"), "request.operation"),
        (review_doc(namespace=7), "request.namespace is not a string"),
        (review_doc(object=[1]), "request.object is not an object"),
    ],
)  # fmt: skip
async def test_malformed_reviews_with_a_uid_get_a_denial(
    client: TestClient[web.Request, web.Application], doc: dict[str, Any], words: str
) -> None:
    r = await client.post("/mutate", json=doc)
    resp = check_answer(r.status, await r.read(), doc)
    assert resp is not None and resp["allowed"] is False
    assert resp["status"]["code"] == 400
    assert words in resp["status"]["message"]


async def test_oversized_body_gets_413(client: TestClient[web.Request, web.Application]) -> None:
    r = await client.post("/mutate", data=b" " * (300 * 1024))
    assert r.status == 413
    assert metrics_of(client).reviews_total(Outcome.MALFORMED) == 1


async def test_health_ready_and_wrong_method(
    client: TestClient[web.Request, web.Application],
) -> None:
    assert (await client.get("/healthz")).status == 200
    assert (await client.get("/readyz")).status == 200
    assert (await client.get("/mutate")).status == 405
    client.app[STATE].ready = False
    assert (await client.get("/readyz")).status == 503


async def test_a_bug_in_the_decision_is_a_500_denial_not_a_crash() -> None:
    def broken() -> str:
        raise RuntimeError("boom")

    app = build_app(plain_settings(), new_claim=broken)
    async with TestClient(TestServer(app)) as c:
        sent = review_doc()
        r = await c.post("/mutate", json=sent)
        assert r.status == 200
        resp = (await r.json())["response"]
        assert resp["allowed"] is False and resp["status"]["code"] == 500
        assert metrics_of(c).reviews_total(Outcome.ERROR) == 1


# --- fuzz ------------------------------------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=20,
)
_names = st.sampled_from(["a", "", "A_b", "x" * 300, "a/b", "ü", "-a", "a-", None, 7, "main"])
_counts: st.SearchStrategy[Any] = st.sampled_from(
    ["1", "2", "0", "-1", "0.5", "1k", "1e3", "9" * 30, "9" * 5000, 10**30, 1.5, None, [], {}, True]
)
_keys = st.sampled_from(
    [MIG, "nvidia.com/mig-", "nvidia.com/mig-9g.1gb", "instaslice.io/mig-1g.18gb",
     "nvidia.com/mig-1g.18gb.me", "nvidia.com/mig-1g.18gb~x/y", "cpu", "nvidia.com/gpu"]
)  # fmt: skip


@st.composite
def _hostile_container(draw: st.DrawFn) -> Any:
    c: dict[str, Any] = {}
    if draw(st.booleans()):
        c["name"] = draw(_names)
    section = st.dictionaries(_keys, _counts, max_size=3) | _json
    resources = st.fixed_dictionaries({}, optional={"limits": section, "requests": section})
    c["resources"] = draw(resources | _json)
    env_entry = st.fixed_dictionaries(
        {},
        optional={
            "name": st.sampled_from(["NVIDIA_VISIBLE_DEVICES", "X", None, 1]),
            "value": st.sampled_from(["all", "instaslice.io/mig=ns_c_a", "", None]),
            "valueFrom": _json,
        },
    )
    if draw(st.booleans()):
        c["env"] = draw(st.lists(env_entry | _json, max_size=3) | _json)
    return c if draw(st.integers(0, 9)) else draw(_json)


@st.composite
def hostile_reviews(draw: st.DrawFn) -> Any:
    containers = st.lists(_hostile_container(), max_size=4)
    spec = st.fixed_dictionaries(
        {},
        optional={
            "containers": containers | _json,
            "initContainers": containers | _json,
            "ephemeralContainers": containers,
            "nodeName": st.sampled_from(["", "n1", None]),
            "schedulingGates": st.lists(st.fixed_dictionaries({"name": _names}), max_size=2)
            | _json,
        },
    )
    meta = st.fixed_dictionaries(
        {},
        optional={
            "name": _names,
            "namespace": _names,
            "annotations": st.dictionaries(
                st.sampled_from(["instaslice.io/claim", "cdi.k8s.io/x", "a"]),
                st.sampled_from(["c1", "instaslice.io/mig=x", ""]),
            )
            | _json,
        },
    )
    pod = st.fixed_dictionaries({}, optional={"metadata": meta | _json, "spec": spec | _json})
    request = st.fixed_dictionaries(
        {},
        optional={
            "uid": st.sampled_from(["u-1", "", None, 5, "x" * 1000]),
            "kind": st.sampled_from(
                [
                    {"group": "", "version": "v1", "kind": "Pod"},
                    {"group": "apps", "version": "v1", "kind": "Deployment"},
                    {"kind": "Pod"},
                    "Pod",
                ]
            ),
            "operation": st.sampled_from(["CREATE", "UPDATE", "DELETE", "CONNECT", "x", None]),
            "namespace": _names,
            "subResource": st.sampled_from(["", "status", None]),
            "object": pod | _json,
            "oldObject": pod | _json,
            "dryRun": st.booleans() | _json,
            "userInfo": _json,
        },
    )
    doc = st.fixed_dictionaries(
        {},
        optional={
            "apiVersion": st.sampled_from(["admission.k8s.io/v1", "v1", None]),
            "kind": st.sampled_from(["AdmissionReview", "Pod", None]),
            "request": request | _json,
        },
    )
    return draw(doc | _json)


@pytest.fixture(scope="module")
async def fuzz_client() -> AsyncIterator[TestClient[web.Request, web.Application]]:
    app = build_app(plain_settings(), new_claim=lambda: "cfuzz")
    async with TestClient(TestServer(app)) as c:
        yield c


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(doc=hostile_reviews())
async def test_fuzz_structured_reviews_always_get_a_well_formed_answer(
    fuzz_client: TestClient[web.Request, web.Application], doc: Any
) -> None:
    body = json.dumps(doc).encode()
    r = await fuzz_client.post("/mutate", data=body)
    resp = check_answer(r.status, await r.read(), doc)
    if r.status == 400:  # only when no request uid could be read
        req = doc.get("request") if isinstance(doc, dict) else None
        uid = req.get("uid") if isinstance(req, dict) else None
        assert not (isinstance(uid, str) and uid)
    elif resp is not None:
        assert isinstance(doc["request"]["uid"], str)
    assert metrics_of(fuzz_client).reviews_total(Outcome.ERROR) == 0


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=st.binary(max_size=512) | _json.map(lambda v: json.dumps(v).encode()))
async def test_fuzz_raw_bodies_never_5xx(
    fuzz_client: TestClient[web.Request, web.Application], body: bytes
) -> None:
    r = await fuzz_client.post("/mutate", data=body)
    assert r.status in (200, 400), r.status
    if r.status == 200:
        doc = json.loads(body)
        check_answer(r.status, await r.read(), doc)
    assert metrics_of(fuzz_client).reviews_total(Outcome.ERROR) == 0


# --- TLS -------------------------------------------------------------------------------------


def _tls_files(tmp: Path, ca: KeyPair) -> ServerSettings:
    write_pair(
        make_serving_cert(ca, ["localhost"], ["127.0.0.1"]), tmp / "tls.crt", tmp / "tls.key"
    )
    return ServerSettings(
        cert_file=tmp / "tls.crt", key_file=tmp / "tls.key", host="127.0.0.1", port=0,
        cert_check_interval_s=0.05, metrics_port=0,
    )  # fmt: skip


def _client_ctx(ca: KeyPair, max_version: ssl.TLSVersion | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cadata=ca.cert_pem.decode())
    if max_version is not None:
        with warnings.catch_warnings():  # TLS < 1.2 is deprecated: that is the point here
            warnings.simplefilter("ignore", DeprecationWarning)
            ctx.minimum_version = ssl.TLSVersion.MINIMUM_SUPPORTED
            ctx.maximum_version = max_version
    return ctx


async def _peer_serial(port: int, ctx: ssl.SSLContext) -> int:
    from cryptography import x509

    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        return int(x509.load_der_x509_certificate(der).serial_number)
    finally:
        writer.close()
        await writer.wait_closed()


async def test_tls_serves_reviews_and_refuses_old_protocols(tmp_path: Path) -> None:
    ca = make_ca()
    async with running(_tls_files(tmp_path, ca), new_claim=lambda: "ctls") as srv:
        assert srv.url.startswith("https://127.0.0.1:")
        async with ClientSession() as s:
            sent = review_doc()
            r = await s.post(f"{srv.url}/mutate", json=sent, ssl=_client_ctx(ca))
            resp = check_answer(r.status, await r.read(), sent)
            assert resp is not None and "patch" in resp
            r = await s.get(f"{srv.url}/readyz", ssl=_client_ctx(ca, ssl.TLSVersion.TLSv1_2))
            assert r.status == 200
            plain = f"http://127.0.0.1:{srv.metrics_port}"
            r = await s.get(f"{plain}/metrics")
            assert 'instaslice_webhook_reviews_total{outcome="patched"} 1.0' in await r.text()
            assert (await s.get(f"{plain}/readyz")).status == 200
            assert (await s.post(f"{plain}/mutate", json=sent)).status == 404
            # the admission port, open to every source, does not serve /metrics when the
            # plain port (which the NetworkPolicies open to monitoring only) does
            r = await s.get(f"{srv.url}/metrics", ssl=_client_ctx(ca))
            assert r.status == 404
        with pytest.raises(ssl.SSLError):
            await _peer_serial(srv.port, _client_ctx(ca, ssl.TLSVersion.TLSv1_1))


async def test_certificate_is_reloaded_when_files_change(tmp_path: Path) -> None:
    ca = make_ca()
    s = _tls_files(tmp_path, ca)
    assert s.cert_file is not None and s.key_file is not None
    metrics = WebhookMetrics()
    async with running(s, metrics=metrics) as srv:
        first = await _peer_serial(srv.port, _client_ctx(ca))
        # a bad pair (key of another certificate) is not taken: the old one keeps serving
        other = make_serving_cert(ca, ["localhost"], ["127.0.0.1"])
        s.key_file.write_bytes(other.key_pem)
        await _until(lambda: metrics.cert_reloads.labels("error")._value.get() >= 1)
        assert await _peer_serial(srv.port, _client_ctx(ca)) == first
        s.cert_file.write_bytes(b"garbage")
        await asyncio.sleep(0.2)
        assert await _peer_serial(srv.port, _client_ctx(ca)) == first
        # a good pair is taken by new connections
        write_pair(other, s.cert_file, s.key_file)
        await _until(lambda: metrics.cert_reloads.labels("ok")._value.get() >= 1)
        second = await _peer_serial(srv.port, _client_ctx(ca))
        assert second != first
        cert = other.cert_pem
        from cryptography import x509

        assert second == x509.load_pem_x509_certificate(cert).serial_number


async def _until(cond: Any, timeout_s: float = 5.0) -> None:
    """Wait for the reloader's next poll to have happened (it runs every 50 ms)."""
    async with asyncio.timeout(timeout_s):
        while not cond():  # noqa: ASYNC110 - polling a metric the server updates on its own
            await asyncio.sleep(0.02)


async def test_missing_certificate_fails_at_build(tmp_path: Path) -> None:
    s = ServerSettings(cert_file=tmp_path / "no.crt", key_file=tmp_path / "no.key")
    with pytest.raises(ssl.SSLError):
        build_app(s)
