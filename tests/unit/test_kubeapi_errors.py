"""common.kubeapi turns a broken connection into ApiError(0), never a raw aiohttp error.

Regression for what `make chaos` found (seed 3, --quick, fault restart-apiserver): a watch
cut off mid-body when kube-apiserver was killed raised aiohttp's ClientPayloadError out of
`Kube.watch`, which ended the Informer and, through its TaskGroup, the whole node agent and
webhook/allocator process. A local socket server stands in for the apiserver: it answers
with a body shorter than its Content-Length, or with a non-JSON body, and hangs up.
Leaves out the real apiserver (the chaos soak restarts it).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from common.kubeapi import ApiError, Kube

pytestmark = pytest.mark.timeout(20)


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
