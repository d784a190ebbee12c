"""What `Kube` puts on the wire: compact JSON bodies, the kubeconfig's bearer token, the
query as given. A local socket server stands in for the API server and records each
request (the transport is what is tested here; the verbs against a real API server are
covered by the integration tests).

Regression for the CPU a burst spent in kubernetes_asyncio's `ApiClient.call_api`, which
walked every body before sending it (`sanitize_for_serialization`) and sent it with blanks
after every `,` and `:` (docs/benchmarks.md, "Issue 25, CPU per pod").
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import pytest
from kubernetes_asyncio.client import ApiClient

from common.kubeapi import Kube

pytestmark = pytest.mark.timeout(30)


class Recorder:
    """An HTTP/1.1 server answering `{}` to everything, keeping (method, target, headers,
    body) of each request."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict[str, str], bytes]] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One request per connection (`Connection: close`): no handler outlives it."""
        head = await reader.readuntil(b"\r\n\r\n")
        line, *rest = head.decode().split("\r\n")
        method, target, _ = line.split(" ")
        headers = {}
        for h in rest:
            if h:
                key, _, value = h.partition(":")
                headers[key.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        self.requests.append((method, target, headers, body))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: 2\r\n\r\n{}")  # fmt: skip
        await writer.drain()
        writer.close()
        await writer.wait_closed()


@pytest.fixture
async def wire(tmp_path: Path) -> AsyncIterator[Any]:
    """A factory: (a `Kube` whose kubeconfig names the recorder, the recorder); made in
    the test's own event loop."""
    opened: list[tuple[asyncio.Server, Kube]] = []

    async def make() -> tuple[Kube, Recorder]:
        rec = Recorder()
        server = await asyncio.start_server(rec.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        cfg = tmp_path / "kubeconfig"
        cfg.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
            f"clusters: [{{name: c, cluster: {{server: 'http://127.0.0.1:{port}'}}}}]\n"
            "users: [{name: u, user: {token: secret-token}}]\n"
            "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
        )
        kube = await Kube.connect(str(cfg))
        opened.append((server, kube))
        return kube, rec

    yield make
    for server, kube in opened:
        await kube.close()
        server.close()
        await server.wait_closed()


async def test_a_patch_goes_out_as_compact_json_with_the_token_and_the_query(wire) -> None:
    kube, rec = await wire()
    body = {"status": {"gpus": [{"uuid": "GPU-1", "free": [0, 1]}], "note": "é"}}
    assert await kube.patch("/apis/g/v1/mignodes/n1/status", body, labelSelector="a in (b,c)") == {}
    method, target, headers, sent = rec.requests[-1]
    url = urlsplit(target)
    assert (method, url.path) == ("PATCH", "/apis/g/v1/mignodes/n1/status")
    assert dict(parse_qsl(url.query)) == {"labelSelector": "a in (b,c)"}
    assert headers["content-type"] == "application/merge-patch+json"
    assert headers["accept"] == "application/json"
    assert headers["authorization"] == "Bearer secret-token"
    assert headers["user-agent"]  # kubernetes_asyncio's, as before
    assert sent == b'{"status":{"gpus":[{"uuid":"GPU-1","free":[0,1]}],"note":"\\u00e9"}}'
    assert json.loads(sent) == body


async def test_bodies_empty_or_absent_and_query_values(wire) -> None:
    kube, rec = await wire()
    await kube.create("/api/v1/namespaces/ns/events", {})
    await kube.get("/api/v1/pods")
    await kube.list("/api/v1/pods", limit=5, watch=False, fieldSelector=None)
    await kube.patch("/api/v1/pods/p", [{"op": "remove", "path": "/x"}], kind="json")
    (m1, _, h1, b1), (m2, t2, _, b2), (_, t3, _, _), (_, _, h4, b4) = rec.requests
    assert (m1, b1, h1["content-type"]) == ("POST", b"{}", "application/json")
    assert (m2, t2, b2) == ("GET", "/api/v1/pods", b"")
    assert dict(parse_qsl(urlsplit(t3).query)) == {"limit": "5", "watch": "false"}
    assert h4["content-type"] == "application/json-patch+json"
    assert b4 == b'[{"op":"remove","path":"/x"}]'


async def test_no_body_is_walked_by_kubernetes_asyncio(
    wire, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ApiClient.sanitize_for_serialization` (a recursive copy of every body, for generated
    models) is not on the request path any more."""
    kube, rec = await wire()

    def forbidden(self: Any, obj: Any) -> Any:
        raise AssertionError("sanitize_for_serialization called")

    monkeypatch.setattr(ApiClient, "sanitize_for_serialization", forbidden)
    await kube.replace("/api/v1/namespaces/ns/pods/p", {"spec": {"containers": [{"name": "c"}]}})
    assert rec.requests[-1][3] == b'{"spec":{"containers":[{"name":"c"}]}}'


def test_encode_is_compact_json() -> None:
    from common.kubeapi import encode

    obj = {"a": [1, {"b": None, "c": True}], "d": "x y"}
    assert encode(obj) == b'{"a":[1,{"b":null,"c":true}],"d":"x y"}'
    assert json.loads(encode(obj)) == obj


async def test_idle_connections_are_kept_for_a_minute(wire) -> None:
    """The pool keeps an idle connection `KEEPALIVE_S` (aiohttp's default is 15 s, shorter
    than the pauses between a burst's waves: each pause cost ~60 new TLS handshakes), and
    less than the API server's 90 s idle timeout."""
    from common.kubeapi import KEEPALIVE_S

    kube, _ = await wire()
    connector = kube._api.rest_client.pool_manager.connector
    assert connector is not None
    assert 15.0 < KEEPALIVE_S < 90.0
    assert connector._keepalive_timeout == KEEPALIVE_S
