"""common.kubeapi turns a broken connection into ApiError(0), never a raw aiohttp error.

Regression for what `make chaos` found (seed 3, --quick, fault restart-apiserver): a watch
cut off mid-body when kube-apiserver was killed raised aiohttp's ClientPayloadError out of
`Kube.watch`, which ended the Informer and, through its TaskGroup, the whole node agent and
webhook/allocator process. A local socket server stands in for the apiserver: it answers
with a body shorter than its Content-Length, or with a non-JSON body, and hangs up. Also:
kubeconfig credentials only (no netrc), and no socket left open under a TLS connection
closed mid-stream. Leaves out the real apiserver (the chaos soak restarts it).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ssl
import time
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest

from certs.make import make_ca, make_serving_cert, write_pair
from common.kubeapi import ApiError, Kube

pytestmark = pytest.mark.timeout(30)


async def _server(reply: bytes) -> tuple[asyncio.Server, int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(reply)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@pytest.fixture
async def kube_for(tmp_path: Path) -> AsyncIterator[object]:
    opened: list[tuple[asyncio.Server, Kube]] = []

    async def make(reply: bytes) -> Kube:
        server, port = await _server(reply)
        cfg = tmp_path / f"kubeconfig-{port}"
        cfg.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
            f"clusters: [{{name: c, cluster: {{server: 'http://127.0.0.1:{port}'}}}}]\n"
            "users: [{name: u, user: {token: t}}]\n"
            "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
        )
        kube = await Kube.connect(str(cfg))
        opened.append((server, kube))
        return kube

    yield make
    for server, kube in opened:
        await kube.close()
        server.close()
        await server.wait_closed()


async def test_watch_cut_off_mid_body_is_an_api_error(kube_for) -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 4000\r\n\r\n"
    kube = await kube_for(head + b'{"type": "ADDED", "object": {"metadata": {"na')
    with pytest.raises(ApiError) as exc:
        async for _ in kube.watch("/api/v1/pods", "1"):
            pass
    assert exc.value.status == 0 and not exc.value.gone


async def test_non_json_answer_is_an_api_error(kube_for) -> None:
    body = b"<html>bad gateway</html>"
    head = f"HTTP/1.1 502 Bad Gateway\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    kube = await kube_for(head + body)
    with pytest.raises(ApiError) as exc:
        await kube.get("/api/v1/pods")
    assert exc.value.status == 502 and exc.value.retryable


async def test_a_netrc_entry_for_the_api_server_is_ignored(
    kube_for, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Credentials come from the kubeconfig only. With aiohttp's trust_env (the library's
    default) a ~/.netrc entry for the API server's host was looked up in a worker thread
    before every request and, next to the kubeconfig's bearer token, made every request fail
    with "Cannot combine AUTHORIZATION header with AUTH argument"."""
    netrc = tmp_path / "netrc"
    netrc.write_text("machine 127.0.0.1 login someone password secret\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    body = b'{"kind": "PodList", "items": []}'
    head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
    kube = await kube_for(head.encode() + b"\r\n\r\n" + body)
    assert await kube.get("/api/v1/pods") == {"kind": "PodList", "items": []}


async def test_a_tls_watch_closed_mid_stream_leaves_no_socket_open(tmp_path: Path) -> None:
    """The socket under a TLS connection closed mid-stream is closed within aiohttp's 2 s
    cleanup period even when the peer never completes the TLS shutdown. asyncio alone holds
    it open for its 30 s shutdown timeout and, before Python 3.12.8 (CPython PR 118960), can
    leak it: CI twice failed an e2e test on the garbage collector finding such a socket.
    Fails without `_abort_closed_tls` (the socket is still open after 5 s)."""
    ca = make_ca("test-ca")
    pair = make_serving_cert(ca, ips=("127.0.0.1",))
    write_pair(pair, tmp_path / "tls.crt", tmp_path / "tls.key")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")
    line = b'{"type": "ADDED", "object": {"metadata": {"resourceVersion": "2"}}}\n'

    done = asyncio.Event()
    peers: list[asyncio.Transport] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        writer.write(b"%x\r\n%s\r\n" % (len(line), line))
        await writer.drain()
        transport = cast(asyncio.Transport, writer.transport)
        transport.pause_reading()  # a peer that never completes the TLS shutdown
        peers.append(transport)
        await done.wait()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ctx)
    port = server.sockets[0].getsockname()[1]
    cfg = tmp_path / "kubeconfig"
    cfg.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: c, cluster: {{server: 'https://127.0.0.1:{port}', "
        f"certificate-authority-data: {base64.b64encode(ca.cert_pem).decode()}}}}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    sockets: list[Any] = []
    async with await Kube.connect(str(cfg)) as kube:
        events = cast(AsyncGenerator[tuple[str, Any], None], kube.watch("/api/v1/pods", "1"))
        async with contextlib.aclosing(events):
            async for _ in events:
                conn: Any = kube._api.rest_client.pool_manager.connector
                sockets = [p.transport.get_extra_info("socket") for p in conn._acquired]
                break
        assert len(sockets) == 1
        deadline = time.monotonic() + 5
        while sockets[0].fileno() != -1 and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        assert sockets[0].fileno() == -1, "the socket of the closed TLS watch is still open"
    for peer in peers:  # the server side has the same problem: end it without a shutdown
        peer.abort()
    done.set()
    server.close()
    await server.wait_closed()
    await asyncio.sleep(0)


# --- lean: what the allocator's caches leave out --------------------------------------------


def test_lean_drops_managed_fields_and_node_images_only() -> None:

    from common.kubeapi import lean

    pod: dict[str, Any] = {
        "metadata": {"name": "p", "uid": "u", "managedFields": [{"manager": "kubectl"}] * 50},
        "spec": {"containers": [{"name": "c"}]},
        "status": {"phase": "Running"},
    }
    node = {"metadata": {"name": "n"}, "status": {"images": [{"names": ["x"]}] * 80,
                                                  "allocatable": {"cpu": "8"}}}  # fmt: skip
    slim_pod, slim_node = lean(pod), lean(node)
    assert slim_pod == {"metadata": {"name": "p", "uid": "u"}, "spec": pod["spec"],
                        "status": pod["status"]}  # fmt: skip
    assert slim_node == {"metadata": {"name": "n"}, "status": {"allocatable": {"cpu": "8"}}}
    assert "managedFields" in pod["metadata"]  # the input is left as it was
    assert lean(slim_pod) is slim_pod  # idempotent, and no copy when there is nothing to drop


async def test_an_informer_caches_and_hands_on_the_transformed_object() -> None:

    from common.kubeapi import Informer, lean

    bulky = {"metadata": {"name": "p", "namespace": "ns", "uid": "u", "resourceVersion": "1",
                          "managedFields": [{"manager": "m"}]}}  # fmt: skip

    class Api:
        async def list_pages(
            self, path: str, limit: int, **_: Any
        ) -> AsyncIterator[dict[str, Any]]:
            yield {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"},
                   "items": [bulky]}  # fmt: skip

    seen: list[dict[str, Any]] = []

    async def handler(etype: str, obj: dict[str, Any]) -> None:
        seen.append(obj)

    inf = Informer(Api(), "/api/v1/pods", handler, transform=lean)  # type: ignore[arg-type]
    await inf._relist()
    assert "managedFields" not in seen[0]["metadata"]
    assert all("managedFields" not in o["metadata"] for o in inf.cache.values())
