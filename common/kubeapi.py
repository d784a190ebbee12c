"""The one module that talks to kubernetes_asyncio (docs/style.md §1).

Everything else sees Kubernetes objects as plain JSON dicts in wire format (camelCase, as
in YAML) and calls a handful of verbs on `Kube`. kubernetes_asyncio supplies what it does
well — kubeconfig / in-cluster loading, auth, TLS, the aiohttp session — and nothing of its
generated models or its request plumbing (`Kube._call` sends on its session directly): raw
dicts are faster to decode, match the manifests one to one, and keep one code path for core
objects and our CRDs alike.

Errors are classified once, here: `ApiError.status` plus the predicates `not_found`,
`conflict`, `gone`, `retryable`. Watches follow docs/style.md §4 (`Informer`): list, then watch
from the list's resourceVersion with bookmarks; re-list on 410 Gone; reconnect with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import quote, urlencode

import aiohttp
import structlog
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.client.exceptions import ApiException

from common.constants import GROUP, VERSION

Obj = dict[str, Any]
PatchType = Literal["merge", "json", "strategic"]
_CONTENT_TYPES: Mapping[PatchType, str] = {
    "merge": "application/merge-patch+json",
    "json": "application/json-patch+json",
    "strategic": "application/strategic-merge-patch+json",
}
log = structlog.get_logger("kubeapi")


class ApiError(Exception):
    """A non-2xx answer from the API server (or a transport failure, status 0)."""

    def __init__(self, status: int, reason: str, message: str, body: Obj | None = None) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        self.body = body or {}

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409

    @property
    def gone(self) -> bool:
        return self.status == 410

    @property
    def retryable(self) -> bool:
        """Worth retrying unchanged: transport errors, throttling, server-side trouble."""
        return self.status in (0, 429) or self.status >= 500


# --- resource paths -------------------------------------------------------------------


def core_path(resource: str, namespace: str | None = None, name: str | None = None) -> str:
    return _path("/api/v1", resource, namespace, name)


def group_path(
    group_version: str, resource: str, namespace: str | None = None, name: str | None = None
) -> str:
    return _path(f"/apis/{group_version}", resource, namespace, name)


def instaslice_path(resource: str, namespace: str | None = None, name: str | None = None) -> str:
    return group_path(f"{GROUP}/{VERSION}", resource, namespace, name)


def _path(prefix: str, resource: str, namespace: str | None, name: str | None) -> str:
    path = prefix
    if namespace is not None:
        path += f"/namespaces/{quote(namespace, safe='')}"
    path += f"/{resource}"
    if name is not None:
        path += f"/{quote(name, safe='')}"
    return path


# --- the client -------------------------------------------------------------------------


class Kube:
    """A connection to one API server. Use `async with await Kube.connect(...)`."""

    def __init__(self, api: k8s_client.ApiClient) -> None:
        self._api = api
        # kubernetes_asyncio opens its aiohttp session with trust_env=True, so aiohttp looks
        # for a ~/.netrc password before every request, in a worker thread: one thread hop
        # per API call (6 % of the allocator's CPU in a 1000-pod burst, docs/benchmarks-history.md).
        # Credentials come only from the kubeconfig or service account here; a proxy only
        # from the kubeconfig's proxy-url (HTTP(S)_PROXY variables are not consulted).
        harden(api)

    @classmethod
    async def connect(
        cls, kubeconfig: str | None = None, *, qps_pool: int = 64, context: str | None = None
    ) -> Kube:
        """From a kubeconfig file (its current context, or `context`), or the in-cluster
        service account when None."""
        cfg = k8s_client.Configuration()
        if kubeconfig:
            await k8s_config.load_kube_config(
                config_file=kubeconfig, context=context, client_configuration=cfg
            )
        else:
            k8s_config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        cfg.connection_pool_maxsize = qps_pool
        return cls(k8s_client.ApiClient(configuration=cfg))

    def sibling(self) -> Kube:
        """Another connection pool to the same server, with the same credentials.

        For requests that must not wait behind bulk traffic queued on this client's pool:
        a Lease renewal queued behind hundreds of writes in a burst misses its deadline.
        The caller closes it (`async with kube.sibling() as other:`)."""
        return Kube(k8s_client.ApiClient(configuration=self._api.configuration))

    async def close(self) -> None:
        await self._api.close()

    async def __aenter__(self) -> Kube:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, Any] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        request_timeout: float | None = 30.0,
    ) -> Any:
        """One request; returns the raw aiohttp response (caller reads it).

        `request_timeout` bounds connecting and each wait for the server's bytes, not the
        wait for a free pooled connection: in a burst hundreds of requests queue for the
        pool, and a total deadline timed them out there and had them retried, a storm that
        kept 1000 emulated nodes from publishing for minutes (docs/benchmarks-history.md).

        The request goes straight to kubernetes_asyncio's aiohttp session, past its
        `ApiClient.call_api`: that walks every body (`sanitize_for_serialization`, for its
        generated models, which nothing here uses) and the headers and query before sending,
        and was 12-15 % of the node agent's Python time in a 1000-pod burst, most of it on
        MigNode status bodies (docs/benchmarks-history.md). Its auth layer is kept (the bearer token
        and its refresh hook); the body goes out as compact JSON (`encode`).
        """
        params = [(k, _query_value(v)) for k, v in (query or {}).items() if v is not None]
        timeout = (
            aiohttp.ClientTimeout()
            if request_timeout is None
            else aiohttp.ClientTimeout(sock_connect=request_timeout, sock_read=request_timeout)
        )
        api = self._api
        headers = {"Content-Type": content_type, "Accept": "application/json"}
        headers.update(api.default_headers)
        if api.cookie:
            headers["Cookie"] = api.cookie
        try:
            # kubernetes_asyncio's auth layer: a bearer token, refreshed by its hook if any
            await api.update_params_for_auth(headers, params, ["BearerToken"])
            url = f"{api.configuration.host}{path}"
            if params:
                url += "?" + urlencode(params)
            rest = api.rest_client
            extra: dict[str, Any] = {}
            if rest.proxy:
                extra["proxy"] = rest.proxy
            if rest.proxy_headers:
                extra["proxy_headers"] = rest.proxy_headers
            if rest.server_hostname:
                extra["server_hostname"] = rest.server_hostname
            return await rest.pool_manager.request(
                method,
                url,
                data=None if body is None else encode(body),
                headers=headers,
                timeout=timeout,
                **extra,
            )
        except ApiException as exc:  # raised by the auth/refresh layers
            raise ApiError(exc.status or 0, exc.reason or "", str(exc)) from exc
        except (OSError, TimeoutError) as exc:
            raise ApiError(0, type(exc).__name__, str(exc)) from exc
        except Exception as exc:  # aiohttp.ClientError and friends
            if (err := _transport_error(exc)) is None:
                raise
            raise err from exc

    async def request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, Any] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> Obj:
        resp = await self._call(method, path, query=query, body=body, content_type=content_type)
        try:
            raw = await resp.read()
        except Exception as exc:
            raise ApiError(0, type(exc).__name__, str(exc)) from exc
        finally:
            resp.release()
        try:
            data: Obj = json.loads(raw) if raw else {}
        except ValueError as exc:  # not JSON: a proxy's error page, a truncated body
            raise ApiError(resp.status, "BadResponse", f"{exc}: {raw[:200]!r}") from exc
        if not 200 <= resp.status <= 299:
            raise ApiError(resp.status, data.get("reason", ""), data.get("message", ""), data)
        return data

    async def get(self, path: str) -> Obj:
        return await self.request("GET", path)

    async def list(self, path: str, **query: Any) -> Obj:
        return await self.request("GET", path, query=query)

    async def list_pages(self, path: str, limit: int, **query: Any) -> AsyncIterator[Obj]:
        """A list in pages of at most `limit` items (`limit` / `continue`): one consistent
        snapshot, but never more than one page in memory at a time. A `continue` token that
        expired meanwhile raises ApiError 410, as a too old resourceVersion does."""
        token: str | None = None
        while True:
            page = await self.request(
                "GET", path, query={**query, "limit": limit, "continue": token}
            )
            yield page
            token = page.get("metadata", {}).get("continue") or None
            if token is None:
                return

    async def create(self, path: str, body: Obj, **query: Any) -> Obj:
        return await self.request("POST", path, body=body, query=query)

    async def replace(self, path: str, body: Obj) -> Obj:
        return await self.request("PUT", path, body=body)

    async def patch(self, path: str, body: Any, kind: PatchType = "merge", **query: Any) -> Obj:
        return await self.request(
            "PATCH", path, body=body, content_type=_CONTENT_TYPES[kind], query=query
        )

    async def delete(self, path: str, body: Obj | None = None, **query: Any) -> Obj:
        return await self.request("DELETE", path, body=body, query=query)

    async def delete_ignore_missing(self, path: str, **query: Any) -> None:
        try:
            await self.delete(path, **query)
        except ApiError as exc:
            if not exc.not_found:
                raise

    async def watch(
        self, path: str, resource_version: str, *, timeout_s: int = 300, **query: Any
    ) -> AsyncIterator[tuple[str, Obj]]:
        """Yield (type, object) watch events until the server closes the stream.

        Raises ApiError(410) when the resourceVersion is too old (the caller re-lists).
        """
        q = dict(query)
        q.update(
            watch="true",
            resourceVersion=resource_version,
            allowWatchBookmarks="true",
            timeoutSeconds=timeout_s,
        )
        resp = await self._call("GET", path, query=q, request_timeout=None)
        try:
            if resp.status != 200:
                raw = await resp.read()
                data = json.loads(raw) if raw else {}
                raise ApiError(resp.status, data.get("reason", ""), data.get("message", ""), data)
            while True:
                try:
                    # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a
                    # cancellation (gh-86296), leaving an informer that never stops
                    async with asyncio.timeout(timeout_s + 30):
                        line = await resp.content.readline()
                except TimeoutError as exc:  # inactivity: treat like a dropped stream
                    raise ApiError(0, "WatchInactive", "no data on the watch") from exc
                except Exception as exc:  # the stream broke (e.g. the apiserver restarted)
                    if (err := _transport_error(exc)) is None:
                        raise
                    raise err from exc
                if not line:
                    return
                try:
                    event = json.loads(line)
                except ValueError as exc:  # a line cut off by a dropped connection
                    raise ApiError(0, "BadWatchEvent", str(exc)) from exc
                etype, obj = event.get("type", ""), event.get("object", {})
                if etype == "ERROR":
                    status = int(obj.get("code", 500))
                    raise ApiError(status, obj.get("reason", ""), obj.get("message", ""), obj)
                yield etype, obj
        finally:
            resp.release()


# How long an idle pooled connection to the API server is kept (aiohttp's default: 15 s).
# In a 1000-pod burst the node agent's and the allocator's request rates pause for longer
# than 15 s between waves: each pause closed the pool, and the next wave opened ~60 new TLS
# connections, each a handshake (12 % of the agent's event-loop time in a burst's first 30 s,
# docs/benchmarks-history.md). Below kube-apiserver's own idle timeout (90 s, its http.Server
# IdleTimeout), so the client, not the server, ends an idle connection.
KEEPALIVE_S = 60.0


def harden(api: k8s_client.ApiClient) -> k8s_client.ApiClient:
    """What `Kube` does to its kubernetes_asyncio client, for code that uses one directly
    (tests, hack/): no ~/.netrc lookup per request, closed TLS connections aborted, idle
    connections kept `KEEPALIVE_S`."""
    session = api.rest_client.pool_manager
    assert hasattr(session, "_trust_env"), "aiohttp renamed ClientSession._trust_env"
    session._trust_env = False
    connector = session.connector
    assert connector is not None and hasattr(connector, "_keepalive_timeout"), "aiohttp changed"
    connector._keepalive_timeout = KEEPALIVE_S
    _abort_closed_tls(connector)
    return api


def _abort_closed_tls(connector: aiohttp.BaseConnector | None) -> None:
    """Have aiohttp abort, 2 s after closing, every TLS connection it closes.

    On Python before 3.12.8 asyncio can leave the socket under a closed TLS transport open
    when the TLS shutdown does not complete (CPython PR 118960); aiohttp's documented
    remedy is `enable_cleanup_closed`, which kubernetes_asyncio does not set. Without it a
    watch closed mid-stream or a pooled connection the server dropped leaked a socket,
    found later by the garbage collector (an unclosed-socket ResourceWarning that failed
    unrelated e2e tests, twice in CI)."""
    needed = getattr(aiohttp.connector, "NEEDS_CLEANUP_CLOSED", False)
    if not needed or not isinstance(connector, aiohttp.TCPConnector):
        return
    assert hasattr(connector, "_cleanup_closed_disabled"), "aiohttp renamed cleanup-closed"
    if connector._cleanup_closed_disabled:
        connector._cleanup_closed_disabled = False
        connector._cleanup_closed()  # from now on every 2 s (aiohttp's own period)


def _transport_error(exc: Exception) -> ApiError | None:
    """aiohttp's errors (a refused connection, a payload cut short when the apiserver
    restarts) as ApiError(0), which callers retry; None for anything else (a bug)."""
    if isinstance(exc, OSError) or type(exc).__module__.startswith("aiohttp"):
        return ApiError(0, type(exc).__name__, str(exc))
    return None


def encode(body: Any) -> bytes:
    """A request body as the API server gets it: compact JSON (no blanks after `,` and
    `:`), ASCII with escapes as `json.dumps` writes by default."""
    return json.dumps(body, separators=(",", ":")).encode()


def _query_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


# --- informers ----------------------------------------------------------------------------

EventType = Literal["ADDED", "MODIFIED", "DELETED"]
Handler = Callable[[EventType, Obj], Awaitable[None]]


def obj_key(obj: Obj) -> str:
    meta = obj.get("metadata", {})
    ns = meta.get("namespace")
    return f"{ns}/{meta.get('name')}" if ns else str(meta.get("name"))


def _uid(obj: Obj) -> str:
    return str(obj.get("metadata", {}).get("uid", ""))


@dataclass
class Informer:
    """List-then-watch one collection, keep a cache, and call `handler` on each change.

    After a re-list (410 Gone, reconnect) objects that vanished meanwhile are reported as
    DELETED and changed ones as MODIFIED, so handlers never miss a transition. An object
    replaced meanwhile by a new one of the same name (another UID: a StatefulSet pod
    recreated during the gap) is reported as DELETED(old) then ADDED(new), never as MODIFIED:
    consumers keyed by UID would otherwise hold what the old one held forever.
    `synced` is set once the first list has been delivered. `transform` (idempotent) is
    applied to every object before it is cached or handed on, e.g. `lean`; a list is read in
    pages of `page_size` objects, each transformed before the next page is read, so a list
    of a large collection never holds it whole, untransformed, in memory.

    `keep` (e.g. `identity`), for handlers that parse each object into a model of their own
    and keep nothing of it: the cache then holds only `keep(obj)` (what a re-list needs to
    tell ADDED, MODIFIED and DELETED apart), and a re-list hands each page on before it reads
    the next, so neither the cache nor a list of the collection holds its objects whole (the
    allocator's 5000 MigNodes were 83 KB each, twice). What this costs: an object that
    vanished during a gap, or was replaced by another of its name, reaches the handler as
    DELETED with only what `keep` kept, and a re-list reports the gap's deletions after its
    additions and changes, not before.
    """

    kube: Kube
    path: str
    handler: Handler
    label_selector: str | None = None
    field_selector: str | None = None
    name: str = "informer"
    transform: Callable[[Obj], Obj] | None = None
    page_size: int = 500
    keep: Callable[[Obj], Obj] | None = None

    def __post_init__(self) -> None:
        self.cache: dict[str, Obj] = {}
        self.synced = asyncio.Event()

    async def run(self) -> None:
        backoff = 0.2
        rv: str | None = None
        while True:
            try:
                if rv is None:
                    rv = await self._relist()
                    backoff = 0.2
                async for etype, obj in self.kube.watch(
                    self.path,
                    rv,
                    labelSelector=self.label_selector,
                    fieldSelector=self.field_selector,
                ):
                    rv = obj.get("metadata", {}).get("resourceVersion", rv)
                    if etype == "BOOKMARK":
                        continue
                    await self._apply(etype, obj)  # type: ignore[arg-type]
                    backoff = 0.2
            except ApiError as exc:
                if exc.gone:
                    rv = None  # too old: list again
                    continue
                log.warning("watch interrupted", informer=self.name, error=str(exc))
                if exc.status in (401, 403, 404):
                    rv = None
                await asyncio.sleep(backoff * (1 + random.random() / 2))
                backoff = min(backoff * 2, 10.0)

    async def _relist(self) -> str:
        fresh: dict[str, Obj] = {}  # listed objects by key (with `keep`: what is kept of them)
        rv = ""
        async for page in self.kube.list_pages(
            self.path,
            self.page_size,
            labelSelector=self.label_selector,
            fieldSelector=self.field_selector,
        ):
            kind = page.get("kind", "").removesuffix("List")
            api_version = page.get("apiVersion", "")
            listed = []
            for o in page.get("items", []):
                o.setdefault("kind", kind)
                o.setdefault("apiVersion", api_version)
                if self.transform is not None:
                    o = self.transform(o)
                fresh[obj_key(o)] = o if self.keep is None else self.keep(o)
                listed.append(o)
            if self.keep is not None:
                for o in listed:  # handed on now: the page is not kept
                    await self._listed(o)
            del listed
            rv = str(page.get("metadata", {}).get("resourceVersion", ""))
        for key in [k for k in self.cache if k not in fresh]:
            await self._apply("DELETED", self.cache[key], transformed=True)
        if self.keep is None:
            for o in fresh.values():
                await self._listed(o)
        self.synced.set()
        return rv

    async def _listed(self, o: Obj) -> None:
        """A listed object: ADDED when not cached, MODIFIED when its resourceVersion moved."""
        old = self.cache.get(obj_key(o))
        if old is None:
            await self._apply("ADDED", o, transformed=True)
        elif old.get("metadata", {}).get("resourceVersion") != o["metadata"].get("resourceVersion"):
            await self._apply("MODIFIED", o, transformed=True)

    async def _apply(self, etype: EventType, obj: Obj, *, transformed: bool = False) -> None:
        if self.transform is not None and not transformed:
            obj = self.transform(obj)
        key = obj_key(obj)
        old = self.cache.get(key)
        if etype != "DELETED" and old is not None and _uid(old) != _uid(obj):
            # same name, another object: the old one is gone
            await self._apply("DELETED", old, transformed=True)
            etype = "ADDED"
        if etype == "DELETED":
            self.cache.pop(key, None)
        else:
            self.cache[key] = obj if self.keep is None else self.keep(obj)
        try:
            await self.handler(etype, obj)
        except Exception:  # a handler bug must not kill the watch; it is logged loudly
            log.exception("informer handler failed", informer=self.name, key=key)


def identity(obj: Obj) -> Obj:
    """What an informer must remember of an object to diff a re-list against its cache and
    report it DELETED by name and UID: kind, name, namespace, uid, resourceVersion (an
    `Informer.keep` for handlers that keep their own model of each object)."""
    meta = obj.get("metadata") or {}
    return {
        "apiVersion": obj.get("apiVersion", ""),
        "kind": obj.get("kind", ""),
        "metadata": {k: meta[k] for k in _IDENTITY if k in meta},
    }


_IDENTITY = ("name", "namespace", "uid", "resourceVersion")


def lean(obj: Obj) -> Obj:
    """`obj` without what no InstaSlice component reads and what can be most of its size:
    `metadata.managedFields` (server-side apply's bookkeeping; an update that leaves it out
    keeps it as it is, so a cached pod can still be PUT back) and a Node's `status.images`.
    For informers whose caches hold every pod and node of the cluster (the allocator's)."""
    meta = obj.get("metadata")
    status = obj.get("status")
    if not (isinstance(meta, dict) and "managedFields" in meta) and not (
        isinstance(status, dict) and "images" in status
    ):
        return obj
    out = dict(obj)
    if isinstance(meta, dict) and "managedFields" in meta:
        out["metadata"] = {k: v for k, v in meta.items() if k != "managedFields"}
    if isinstance(status, dict) and "images" in status:
        out["status"] = {k: v for k, v in status.items() if k != "images"}
    return out


@contextlib.asynccontextmanager
async def connected(kubeconfig: str | None) -> AsyncIterator[Kube]:
    kube = await Kube.connect(kubeconfig)
    try:
        yield kube
    finally:
        await kube.close()
