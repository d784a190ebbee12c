"""No secret ever reaches a log line: tokens, private keys, env values of pods.

Runs real code paths under a structlog capture (rendered as the components render it,
tracebacks included) with recognisable secrets planted where a careless log call would pick
them up, and asserts none of them, nor any PEM block or Bearer header, shows up:

- the admission server: a review whose pod carries secret env values (plain and in a denied
  container), a projected token volume, and a userInfo whose extras carry a token; a
  malformed review with the secret in it;
- the serving-certificate reload: a "key" file that is a PEM block of secret text;
- the Kubernetes client (`common.kubeapi`): a bearer token and a client key in the
  kubeconfig; requests answered 401, 403 and 500, a refused connection, and an Informer
  retrying against all of them;
- every log call in common/, webhook/ and nodeagent/ (static): no keyword named like a
  credential, and no whole object (`obj=`, `pod=`, ... bound to a dict) handed to a logger.

Leaves out: the API server's own audit log and the container runtime (not ours).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Iterator, MutableMapping
from pathlib import Path
from typing import Any

import pytest
import structlog
from aiohttp.test_utils import TestClient, TestServer

from certs.make import make_ca, make_serving_cert, write_pair
from common.kubeapi import ApiError, Informer, Kube, core_path
from tests.support import eventually
from webhook.server import CertReloader, build_app
from webhook.settings import ServerSettings

pytestmark = pytest.mark.timeout(30)
# fixtures live in the session loop (pyproject), so the async tests run there too
session_loop = pytest.mark.asyncio(loop_scope="session")

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "eyJhbGciOiJSUzI1NiJ9.SECRET-TOKEN-7f3a9c.signature"
ENV_SECRET = "hunter2-ENV-SECRET-41d8"
KEY_SECRET = "KEY-SECRET-c0ffee"
MARKERS = (TOKEN, "SECRET-TOKEN", ENV_SECRET, KEY_SECRET, "PRIVATE KEY", "Bearer ")
PEM = re.compile(r"-----BEGIN [A-Z ]+-----")


@contextlib.contextmanager
def captured() -> Iterator[list[str]]:
    """Every log line as the components render it (JSON, tracebacks formatted)."""
    lines: list[str] = []

    def sink(_: Any, __: str, event: MutableMapping[str, Any]) -> str:
        lines.append(json.dumps(event, default=str))
        raise structlog.DropEvent

    old = structlog.get_config()
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.format_exc_info,
            sink,
        ],
        cache_logger_on_first_use=False,
    )
    try:
        yield lines
    finally:
        structlog.configure(**old)


def assert_clean(lines: list[str]) -> None:
    text = "\n".join(lines)
    found = [m for m in MARKERS if m in text] + PEM.findall(text)
    assert not found, f"secret material {found} in logs:\n{text[:3000]}"


# --- the admission server ---------------------------------------------------------------------


def _review(pod: dict[str, Any], **extra: Any) -> dict[str, Any]:
    req = {
        "uid": "u-1",
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "namespace": "ns",
        "operation": "CREATE",
        "userInfo": {
            "username": "alice",
            "extra": {"authentication.kubernetes.io/credential-id": [TOKEN]},
        },
        "object": pod,
        **extra,
    }
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": req}


def _pod(*containers: dict[str, Any]) -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "namespace": "ns", "annotations": {"token": TOKEN}},
        "spec": {
            "containers": list(containers),
            "volumes": [{"name": "tok", "projected": {"sources": [
                {"serviceAccountToken": {"path": TOKEN}}]}}],
        },
    }  # fmt: skip


def _container(name: str, env: list[dict[str, str]], limits: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "image": "x", "env": env, "resources": {"limits": limits}}


@pytest.fixture
async def webhook() -> AsyncIterator[TestClient[Any, Any]]:
    app = build_app(ServerSettings(cert_file=None, key_file=None), new_claim=lambda: "cfixed")
    async with TestClient(TestServer(app)) as c:
        yield c


@session_loop
async def test_admission_logs_no_env_values_tokens_or_user_extras(
    webhook: TestClient[Any, Any],
) -> None:
    secret_env = [{"name": "API_KEY", "value": ENV_SECRET}, {"name": "T", "value": TOKEN}]
    mig = {"nvidia.com/mig-1g.10gb": "1"}
    cases = [
        _review(_pod(_container("main", secret_env, mig))),  # patched
        # denied: the container sets NVIDIA_VISIBLE_DEVICES itself (to a secret, even)
        _review(_pod(_container("main", [{"name": "NVIDIA_VISIBLE_DEVICES",
                                          "value": ENV_SECRET}, *secret_env], mig))),
        _review(_pod(_container("main", secret_env, {"nvidia.com/mig-9g.999gb": "1"}))),
        _review(_pod(_container("main", secret_env, {"cpu": "1"}))),  # not ours
    ]  # fmt: skip
    malformed = _review(_pod(_container("main", secret_env, mig)))
    malformed["request"]["object"] = ENV_SECRET  # not an object: refused as malformed
    with captured() as lines:
        for doc in [*cases, malformed]:
            r = await webhook.post("/mutate", json=doc)
            assert r.status == 200, await r.text()
        r = await webhook.post("/mutate", data=f'{{"token": "{TOKEN}"'.encode())
        assert r.status == 400
    assert len(lines) >= 5, lines
    assert_clean(lines)


def test_certificate_reload_failure_logs_no_key_material(tmp_path: Path) -> None:
    ca = make_ca()
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    write_pair(make_serving_cert(ca, ["localhost"], ["127.0.0.1"]), cert, key)
    reloader = CertReloader(cert, key)
    bogus = f"-----BEGIN PRIVATE KEY-----\n{KEY_SECRET}\n-----END PRIVATE KEY-----\n"
    key.write_text(bogus)
    with captured() as lines:
        assert reloader.reload() is False
        cert.write_text(bogus)  # a "certificate" that is secret text, too
        assert reloader.reload() is False
    assert len(lines) == 2, lines
    assert_clean(lines)


# --- the Kubernetes client ----------------------------------------------------------------------


async def _api_server(statuses: list[int]) -> tuple[asyncio.Server, int]:
    """Answers each request with the next status (a Status body, as the apiserver would)."""
    answers = iter(statuses)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        code = next(answers, 500)
        body = json.dumps({"kind": "Status", "status": "Failure", "code": code,
                           "reason": "Unauthorized" if code == 401 else "Forbidden",
                           "message": "no"}).encode()  # fmt: skip
        writer.write(
            f"HTTP/1.1 {code} X\r\nContent-Type: application/json\r\n"
            f"WWW-Authenticate: Bearer realm=k8s\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def _kubeconfig(
    path: Path, port: int, *, cert: Path | None = None, key: Path | None = None
) -> Path:
    user = {"client-certificate": str(cert), "client-key": str(key)} if cert else {"token": TOKEN}
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    }))  # fmt: skip
    return path


@session_loop
async def test_kube_client_errors_and_retries_log_no_credentials(tmp_path: Path) -> None:
    server, port = await _api_server([401, 403, 500, 401, 403, 500])
    seen: list[str] = []
    try:
        with captured() as lines:
            async with await Kube.connect(str(_kubeconfig(tmp_path / "kc", port))) as kube:
                for _ in range(3):
                    with pytest.raises(ApiError) as exc:
                        await kube.get(core_path("pods", "ns", "p"))
                    seen.append(f"{exc.value!s} {exc.value.body}")

                async def ignore(*_: Any) -> None:
                    return None

                informer = Informer(kube, core_path("pods"), ignore, name="pods")
                task = asyncio.create_task(informer.run())

                async def logged() -> bool:  # a few failed lists, each logged
                    return sum("watch interrupted" in line for line in lines) >= 3

                await eventually(logged, what="three failed lists logged")
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    finally:
        server.close()
        await server.wait_closed()
    # a refused connection (nothing listens there any more), with a client key this time
    ca = make_ca()
    pair = make_serving_cert(ca, ["localhost"], ["127.0.0.1"])
    crt, key = tmp_path / "c.crt", tmp_path / "c.key"
    write_pair(pair, crt, key)
    key.write_text(key.read_text() + f"# {KEY_SECRET}\n")
    with captured() as more:
        async with await Kube.connect(str(_kubeconfig(tmp_path / "kc2", port, cert=crt,
                                                      key=key))) as kube:  # fmt: skip
            with pytest.raises(ApiError) as exc:
                await kube.get(core_path("pods"))
            seen.append(str(exc.value))
    assert any("watch interrupted" in line for line in lines), lines
    assert_clean(lines + more + seen)


# --- every log call (static) ----------------------------------------------------------------------

LOG_METHODS = {"debug", "info", "warning", "warn", "error", "exception", "critical", "msg"}
CREDENTIAL = re.compile(r"token|passw|secret|authoriz|bearer|credential|private|key_pem|cert_pem",
                        re.I)  # fmt: skip
WHOLE_OBJECTS = {"obj", "body", "object", "review", "request", "spec", "env", "headers"}


def _log_calls() -> Iterator[tuple[Path, ast.Call]]:
    for pkg in ("common", "webhook", "nodeagent"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in LOG_METHODS
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id in ("log", "logger")
                ):
                    yield path, node


def test_no_log_call_passes_credentials_or_whole_objects() -> None:
    calls = list(_log_calls())
    assert len(calls) > 50, "the scan found too few log calls; is it looking in the right place?"
    bad = []
    for path, call in calls:
        for kw in call.keywords:
            name = kw.arg or "**"
            value = ast.unparse(kw.value)
            if kw.arg is None or CREDENTIAL.search(name) or CREDENTIAL.search(value):
                bad.append(f"{path.relative_to(ROOT)}:{call.lineno} {name}={value}")
            elif name in WHOLE_OBJECTS:
                bad.append(f"{path.relative_to(ROOT)}:{call.lineno} whole object {name}={value}")
    allowed = {  # reviewed: a dict of plain, non-secret fields built for this one log call
        "webhook/server.py **=fields",
        "webhook/selfcert.py secret=s.secret",  # the Secret's name (SelfCertSettings), not its data
    }
    bad = [b for b in bad if re.sub(r":\d+ ", " ", b) not in allowed]
    assert not bad, "log calls that may carry secrets:\n" + "\n".join(bad)
