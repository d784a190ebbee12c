"""The kubelet's DRA plugin API (`v1.DRAPlugin`) and its plugin registration (DRA mode).

Two gRPC servers on unix sockets, as the kubelet expects of a DRA driver:
- registration, `<registry dir>/instaslice.io-reg.sock`: the kubelet's plugin watcher finds
  it, asks `GetInfo` (type DRAPlugin, name `instaslice.io`, the plugin socket, `v1.DRAPlugin`)
  and tells the outcome (`NotifyRegistrationStatus`);
- the plugin, `<plugins dir>/instaslice.io/dra.sock`: `NodePrepareResources` answers each
  claim with its devices' CDI ids once its slices are made (`DraClaims.prepare`, which checks
  the allocation names this driver and this node), `NodeUnprepareResources` releases them.
  Claims of one call are handled side by side, each idempotent by UID; a claim's failure is
  its own `error`, never the call's. The same socket serves `v1.DRAResourceHealth`
  (nodeagent/dra/health.py: the held devices' health, streamed), advertised at registration.
Both sockets are made anew at start (a stale file from an earlier process is removed): a
restarted agent is found again by the kubelet, which then re-prepares the claims of running
pods, answered from the records without making anything twice.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog

from common.constants import DRA_DRIVER
from nodeagent.deviceplugin._gen.dra.v1 import api_pb2 as dra
from nodeagent.deviceplugin._gen.dra.v1 import api_pb2_grpc as dra_grpc
from nodeagent.deviceplugin._gen.drahealth.v1 import api_pb2_grpc as health_grpc
from nodeagent.deviceplugin._gen.pluginregistration.v1 import api_pb2 as reg
from nodeagent.deviceplugin._gen.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from nodeagent.dra.carve import DraClaims, PrepareFailed
from nodeagent.dra.health import HEALTH_SERVICE, HealthStream

log = structlog.get_logger("dra.plugin")
DRA_SERVICE = "v1.DRAPlugin"  # k8s.io/kubelet/pkg/apis/dra/v1 DRAPluginService
PLUGIN_TYPE = "DRAPlugin"
REGISTRY_DIR = Path("/var/lib/kubelet/plugins_registry")
PLUGINS_DIR = Path("/var/lib/kubelet/plugins")
# the kubelet gives a prepare call 45 s (its DRA plugin client timeout); answer before it
PREPARE_TIMEOUT_S = 40.0


@dataclass(frozen=True)
class Sockets:
    registry_dir: Path = REGISTRY_DIR
    plugins_dir: Path = PLUGINS_DIR

    @property
    def registration(self) -> Path:
        return self.registry_dir / f"{DRA_DRIVER}-reg.sock"

    @property
    def plugin(self) -> Path:
        return self.plugins_dir / DRA_DRIVER / "dra.sock"


class Registration(reg_grpc.RegistrationServicer):  # type: ignore[misc]
    def __init__(self, plugin_socket: Path) -> None:
        self.plugin_socket = plugin_socket
        self.registered = asyncio.Event()

    async def GetInfo(self, request: Any, context: Any) -> Any:
        return reg.PluginInfo(
            type=PLUGIN_TYPE,
            name=DRA_DRIVER,
            endpoint=str(self.plugin_socket),
            supported_versions=[DRA_SERVICE, HEALTH_SERVICE],
        )

    async def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:
        if request.plugin_registered:
            log.info("registered with the kubelet", driver=DRA_DRIVER)
            self.registered.set()
        else:
            log.error("the kubelet refused the DRA plugin", error=request.error)
        return reg.RegistrationStatusResponse()


class DraPlugin(dra_grpc.DRAPluginServicer):  # type: ignore[misc]
    def __init__(
        self,
        claims: DraClaims,
        timeout_s: float = PREPARE_TIMEOUT_S,
        health: HealthStream | None = None,
    ) -> None:
        self.claims = claims
        self.timeout_s = timeout_s
        self.health = health

    async def _prepare_one(self, c: Any) -> Any:
        try:
            ids = await self.claims.prepare(c.namespace, c.name, c.uid, self.timeout_s)
        except PrepareFailed as exc:
            log.warning("prepare refused", claim=f"{c.namespace}/{c.name}", error=str(exc))
            return dra.NodePrepareResourceResponse(error=str(exc))
        view = self.claims.views[c.uid]
        devices = [
            dra.Device(
                request_names=[r.request],
                pool_name=self.claims.node,
                device_name=r.device,
                cdi_device_ids=[ids[r.device]],
            )
            for r in view.ours
        ]
        return dra.NodePrepareResourceResponse(devices=devices)

    async def NodePrepareResources(self, request: Any, context: Any) -> Any:
        answers = await asyncio.gather(*(self._prepare_one(c) for c in request.claims))
        if self.health is not None:  # the held devices changed: their health goes out now
            self.health.poke()
        out = dra.NodePrepareResourcesResponse()
        for c, a in zip(request.claims, answers, strict=True):
            out.claims[c.uid].CopyFrom(a)
        return out

    async def _unprepare_one(self, c: Any) -> Any:
        try:
            await self.claims.unprepare(c.uid, self.timeout_s)
        except PrepareFailed as exc:
            return dra.NodeUnprepareResourceResponse(error=str(exc))
        return dra.NodeUnprepareResourceResponse()

    async def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        answers = await asyncio.gather(*(self._unprepare_one(c) for c in request.claims))
        if self.health is not None:
            self.health.poke()
        out = dra.NodeUnprepareResourcesResponse()
        for c, a in zip(request.claims, answers, strict=True):
            out.claims[c.uid].CopyFrom(a)
        return out


def _remove(path: Path, *, make_dir: bool = False) -> None:
    if make_dir:
        path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


class SocketPathTooLong(ValueError):
    """A unix socket path longer than the kernel's sun_path (108 bytes with its NUL): neither
    the agent nor the kubelet could bind or dial it."""


MAX_SOCKET_PATH = 107


async def _serve(services: list[tuple[Any, Any]], path: Path) -> grpc.aio.Server:
    if len(str(path).encode()) > MAX_SOCKET_PATH:
        raise SocketPathTooLong(
            f"{path}: {len(str(path).encode())} bytes, a unix socket path has at most "
            f"{MAX_SOCKET_PATH}; use a shorter --kubelet-registry-dir / --kubelet-plugins-dir"
        )
    await asyncio.to_thread(_remove, path, make_dir=True)  # an earlier process's socket
    server = grpc.aio.server()
    for add, servicer in services:
        add(servicer, server)
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    return server


@contextlib.asynccontextmanager
async def serving(claims: DraClaims, sockets: Sockets) -> AsyncIterator[Registration]:
    """Both servers, plugin first (the kubelet dials it as soon as it registers)."""
    registration = Registration(sockets.plugin)
    health = HealthStream(claims.life.st)
    plugin = await _serve(
        [
            (dra_grpc.add_DRAPluginServicer_to_server, DraPlugin(claims, health=health)),
            (health_grpc.add_DRAResourceHealthServicer_to_server, health),
        ],
        sockets.plugin,
    )
    try:
        registrar = await _serve(
            [(reg_grpc.add_RegistrationServicer_to_server, registration)], sockets.registration
        )
        try:
            log.info(
                "DRA plugin serving",
                plugin=str(sockets.plugin),
                registration=str(sockets.registration),
            )
            yield registration
        finally:
            await registrar.stop(grace=1.0)
            await asyncio.to_thread(_remove, sockets.registration)
    finally:
        await plugin.stop(grace=1.0)
