"""The HTTPS admission server: a thin aiohttp shell around `webhook.admission.review`.

Routes: `POST /mutate` (AdmissionReview v1; `POST /mutate-whole-gpu` the same for namespaces
also opted in to whole GPUs), `GET /healthz` (the process answers),
`GET /readyz` (serving, not shutting down), `GET /metrics` (Prometheus, the registry given).
With `metrics_port` set, the three GET routes are also served in plain HTTP on that port
(for Prometheus and kubelet probes, which should not need the webhook's CA); /mutate never is.

Every body gets a well-formed answer: a body that is not JSON, or has no request uid to answer
to, gets HTTP 400; any other malformed review gets an AdmissionReview denial (code 400); a bug
in the decision gets a denial (code 500), never a dropped connection. The decision is
synchronous and takes microseconds, so it runs inline on the event loop.

TLS 1.2+ only. The certificate and key are re-read when their files change (cert-manager and
kubelet replace Secret volume files in place; stat() is compared every few seconds). A new
pair is loaded into the live `SSLContext` only after it loaded cleanly into a scratch one,
from the same private copy of the bytes, so a half-written or mismatched pair never replaces
a working one; connections already open keep the certificate they started with.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import ssl
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from common.metricsauth import OK, MetricsAuth, refusal
from common.metricstls import self_signed_context
from common.objects import new_claim_id
from webhook.admission import review
from webhook.metrics import Outcome, WebhookMetrics
from webhook.offered import OfferedProfiles
from webhook.reviews import (
    Allowed,
    Denied,
    MalformedReview,
    Patched,
    Verdict,
    malformed,
    parse_review,
    response_for,
)
from webhook.settings import AdmissionSettings, ServerSettings

log = structlog.get_logger("webhook")
WHOLE_GPU_PATH = "/mutate-whole-gpu"  # the webhook entry of namespaces also opted in to whole GPUs


# --- TLS -----------------------------------------------------------------------------------


def _signature(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()  # follows symlinks: kubelet swaps the ..data link of a Secret volume
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


@dataclass
class CertReloader:
    """The server's SSLContext, kept in step with the certificate and key files."""

    cert_file: Path
    key_file: Path
    metrics: WebhookMetrics | None = None
    context: ssl.SSLContext = field(init=False)
    _seen: tuple[object, object] | None = field(init=False, default=None)  # of the last load

    def __post_init__(self) -> None:
        self.context = _server_context()
        if not self.reload():
            raise ssl.SSLError(f"cannot load {self.cert_file} / {self.key_file}")

    def reload(self) -> bool:
        """Load the pair if its files changed since the last load. True if now current."""
        seen = (_signature(self.cert_file), _signature(self.key_file))
        if seen == self._seen:
            return True
        try:
            cert, key = self.cert_file.read_bytes(), self.key_file.read_bytes()
            with tempfile.TemporaryDirectory(prefix="instaslice-tls-") as tmp:
                cert_copy, key_copy = Path(tmp, "tls.crt"), Path(tmp, "tls.key")
                cert_copy.write_bytes(cert)
                fd = os.open(key_copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(key)
                _server_context().load_cert_chain(cert_copy, key_copy)  # validate first
                self.context.load_cert_chain(cert_copy, key_copy)
        except (OSError, ssl.SSLError, ValueError) as exc:
            log.warning("serving certificate not loaded", cert=str(self.cert_file), error=str(exc))
            if self.metrics is not None and self._seen is not None:
                self.metrics.cert_reloads.labels("error").inc()
            return False
        if self._seen is not None:
            log.info("serving certificate reloaded", cert=str(self.cert_file))
            if self.metrics is not None:
                self.metrics.cert_reloads.labels("ok").inc()
        self._seen = seen
        return True

    async def watch(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.reload()


def _server_context() -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


# --- the app -------------------------------------------------------------------------------


@dataclass
class _State:
    settings: ServerSettings
    metrics: WebhookMetrics
    new_claim: Callable[[], str]
    timer: Callable[[], float]
    tls: CertReloader | None
    metrics_auth: MetricsAuth | None = None  # None: /metrics open (plain Kubernetes default)
    offered: OfferedProfiles | None = None  # None: the catalog's profiles alone
    ready: bool = False


STATE = web.AppKey("instaslice_webhook_state", _State)


def build_app(
    settings: ServerSettings,
    *,
    metrics: WebhookMetrics | None = None,
    new_claim: Callable[[], str] = new_claim_id,
    timer: Callable[[], float] = time.perf_counter,
    metrics_auth: MetricsAuth | None = None,
    offered: OfferedProfiles | None = None,
) -> web.Application:
    """The admission app. With `settings.cert_file` None it has no TLS (unit tests only).
    `offered`: the profiles nodes published (webhook/offered.py), accepted on top of the
    catalog's."""
    metrics = metrics or WebhookMetrics()
    tls = None
    if settings.cert_file is not None and settings.key_file is not None:
        tls = CertReloader(settings.cert_file, settings.key_file, metrics)
    app = web.Application(client_max_size=settings.max_body_bytes)
    app[STATE] = _State(settings, metrics, new_claim, timer, tls, metrics_auth, offered)
    app.router.add_post("/mutate", _mutate)
    app.router.add_post(WHOLE_GPU_PATH, _mutate)  # namespaces opted in to whole GPUs too
    # /metrics only where the NetworkPolicies let monitoring alone in: the admission port is
    # open to every source (the API server's address differs per cluster; docs/metrics.md)
    _add_ops_routes(app, metrics=settings.metrics_port is None)
    app.cleanup_ctx.append(_lifecycle)
    return app


def _add_ops_routes(app: web.Application, *, metrics: bool = True) -> None:
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    if metrics:
        app.router.add_get("/metrics", _metrics)


def build_ops_app(admission_app: web.Application) -> web.Application:
    """/healthz, /readyz and /metrics of `admission_app`, for a plain-HTTP port."""
    app = web.Application()
    app[STATE] = admission_app[STATE]
    _add_ops_routes(app)
    return app


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    watcher = None
    if state.tls is not None:
        watcher = asyncio.create_task(
            state.tls.watch(state.settings.cert_check_interval_s), name="cert-reload"
        )
    state.ready = True
    try:
        yield
    finally:
        state.ready = False
        if watcher is not None:
            watcher.cancel()
            await asyncio.wait({watcher})  # a cancellation of ours still propagates


def _outcome(decision: Verdict) -> Outcome:
    if isinstance(decision, Patched):
        return Outcome.PATCHED
    if isinstance(decision, Allowed):
        return Outcome.ALLOWED
    return Outcome.MALFORMED if decision.code == 400 else Outcome.DENIED


def _admission(state: _State) -> AdmissionSettings:
    settings = state.settings.admission
    offered = state.offered
    if offered is None or not offered.cluster:
        return settings
    return replace(settings, known_profiles=offered.known, cluster_profiles=offered.cluster)


async def _mutate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    started = state.timer()
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        state.metrics.observe(Outcome.MALFORMED, state.timer() - started)
        raise
    try:
        req = parse_review(json.loads(body))
    except (ValueError, RecursionError) as exc:  # JSON, UTF-8 or envelope errors
        uid = exc.uid if isinstance(exc, MalformedReview) else None
        message = str(exc) if isinstance(exc, MalformedReview) else "body is not JSON"
        state.metrics.observe(Outcome.MALFORMED, state.timer() - started)
        log.info("malformed review", uid=uid, error=message[:200])
        if uid is None:
            return web.json_response({"error": message[:200]}, status=400)
        return web.json_response(response_for(uid, malformed(message)))

    try:
        decision = review(
            req,
            _admission(state),
            new_claim=state.new_claim,
            whole_gpu=request.path == WHOLE_GPU_PATH,
        )
    except Exception:  # a bug: refuse this pod, keep serving, make noise
        log.exception("admission decision failed", uid=req["uid"])
        decision = Denied("internal error in the InstaSlice webhook", 500, "InternalError")
    answer = response_for(req["uid"], decision)
    outcome = Outcome.ERROR if isinstance(decision, Denied) and decision.code == 500 else None
    outcome = outcome or _outcome(decision)
    elapsed = state.timer() - started
    state.metrics.observe(outcome, elapsed)
    _log_review(req, decision, outcome, elapsed)
    return web.json_response(answer)


def _log_review(req: object, decision: Verdict, outcome: Outcome, elapsed: float) -> None:
    assert isinstance(req, dict)
    pod = req.get("object") if isinstance(req.get("object"), dict) else {}
    meta = pod.get("metadata") if isinstance(pod, dict) else None
    meta = meta if isinstance(meta, dict) else {}
    fields: dict[str, object] = {
        "uid": req.get("uid"),
        "namespace": req.get("namespace"),
        "pod": meta.get("name") or meta.get("generateName"),
        "operation": req.get("operation"),
        "dry_run": bool(req.get("dryRun")),
        "outcome": outcome.value,
        "ms": round(elapsed * 1000, 3),
    }
    if isinstance(decision, Patched):
        fields["claim"] = decision.claim
        fields["devices"] = list(decision.devices)
    elif isinstance(decision, Denied):
        fields["message"] = decision.message[:500]
    else:
        fields["reason"] = decision.reason
    log.info("review", **fields)


async def _healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _readyz(request: web.Request) -> web.Response:
    if request.app[STATE].ready:
        return web.Response(text="ok")
    return web.Response(text="not ready", status=503)


async def _metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.metrics_auth is not None:
        code = await state.metrics_auth.check(request.headers.get("Authorization"), request.path)
        if code != OK:
            return web.Response(status=code, text=refusal(code))
    body = generate_latest(state.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


# --- running it ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RunningServer:
    app: web.Application
    port: int
    url: str  # https://host:port (http:// without TLS)
    metrics_port: int | None = None


@contextlib.asynccontextmanager
async def running(
    settings: ServerSettings,
    *,
    metrics: WebhookMetrics | None = None,
    new_claim: Callable[[], str] = new_claim_id,
    metrics_auth: MetricsAuth | None = None,
    offered: OfferedProfiles | None = None,
) -> AsyncIterator[RunningServer]:
    """Serve until the block exits (port 0 in the settings picks a free port)."""
    app = build_app(
        settings, metrics=metrics, new_claim=new_claim, metrics_auth=metrics_auth, offered=offered
    )
    tls = app[STATE].tls
    runner = web.AppRunner(
        app, access_log=None, handle_signals=False, shutdown_timeout=settings.shutdown_timeout_s
    )
    ops = None
    await runner.setup()
    try:
        site = web.TCPSite(
            runner, settings.host, settings.port, ssl_context=tls.context if tls else None
        )
        await site.start()
        port = int(runner.addresses[0][1])
        metrics_port = None
        if settings.metrics_port is not None:
            ops = web.AppRunner(build_ops_app(app), access_log=None, handle_signals=False)
            await ops.setup()
            # a token must not cross the network in clear text: TLS wherever auth is on,
            # with the admission pair (a self-signed one without: tests only)
            ops_tls = None
            if metrics_auth is not None:
                ops_tls = tls.context if tls else self_signed_context("instaslice-webhook")
            await web.TCPSite(
                ops, settings.host, settings.metrics_port, ssl_context=ops_tls
            ).start()
            metrics_port = int(ops.addresses[0][1])
        scheme = "https" if tls else "http"
        log.info(
            "admission server listening",
            host=settings.host, port=port, tls=bool(tls), metrics_port=metrics_port,
        )  # fmt: skip
        yield RunningServer(app, port, f"{scheme}://{settings.host}:{port}", metrics_port)
    finally:
        if ops is not None:
            await ops.cleanup()
        await runner.cleanup()


async def serve(
    settings: ServerSettings,
    *,
    metrics: WebhookMetrics | None = None,
    new_claim: Callable[[], str] = new_claim_id,
    metrics_auth: MetricsAuth | None = None,
    offered: OfferedProfiles | None = None,
) -> None:
    """Serve until cancelled (the entry point's TaskGroup cancels it on SIGTERM)."""
    async with running(
        settings, metrics=metrics, new_claim=new_claim, metrics_auth=metrics_auth, offered=offered
    ):
        await asyncio.Event().wait()
