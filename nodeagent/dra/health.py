"""The DRA plugin's resource health service (`v1.DRAResourceHealth`, docs/dra.md).

The kubelet (1.37: its ResourceHealthStatus feature) opens one `NodeWatchResources` stream
to a plugin that advertises the service at registration, and shows each prepared device's
health in the status of the pods using it (`allocatedResourcesStatus`). Each message is the
driver's complete list: here the devices of the claims this node holds (its ClaimRecords;
devices of no claim have no pod to tell), each with its GPU's health as the agent knows it
from NVML's events (nodeagent/agent.py `on_health`, GPU_IS_LOST answers): an unhealthy GPU
reports its devices UNHEALTHY with NVML's reason.

A message is sent when the stream opens, when a GPU's health changes, when the plugin
prepared or unprepared claims (`HealthStream.poke`), and every `RESEND_S` while nothing
changes: the kubelet takes a device it has not heard of within `TIMEOUT_S` as Unknown.
`device_health` is the pure part.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from nodeagent.checkpoint import ClaimRecord
from nodeagent.deviceplugin._gen.drahealth.v1 import api_pb2 as health
from nodeagent.deviceplugin._gen.drahealth.v1 import api_pb2_grpc as health_grpc
from nodeagent.model import Health
from nodeagent.state import AgentNode

HEALTH_SERVICE = "v1.DRAResourceHealth"  # k8s.io/kubelet/pkg/apis/dra-health/v1
RESEND_S = 20.0
TIMEOUT_S = 60  # each device's health_check_timeout_seconds: three resends missed


@dataclass(frozen=True, slots=True)
class DeviceHealth:
    device: str
    healthy: bool
    message: str


def device_health(
    records: Iterable[ClaimRecord], health_of: Mapping[int, Health], lost: Iterable[int]
) -> list[DeviceHealth]:
    """Each device of the held claims with its GPU's health, by device name."""
    gone = set(lost)
    out = {}
    for rec in records:
        for s in rec.slices:
            h = health_of.get(s.gpu_index, Health())
            if s.gpu_index in gone and h.healthy:
                h = Health(False, "GPU is lost (NVML: GPU_IS_LOST)")
            why = h.message if not h.healthy else ""
            out[s.container] = DeviceHealth(s.container, h.healthy, why[:1024])
    return [out[d] for d in sorted(out)]


class HealthStream(health_grpc.DRAResourceHealthServicer):  # type: ignore[misc]
    def __init__(self, st: AgentNode, resend_s: float = RESEND_S) -> None:
        self.st = st
        self.resend_s = resend_s
        self._poked = asyncio.Event()

    def poke(self) -> None:
        """The held claims changed (the plugin prepared or unprepared some): send now."""
        self._poked.set()
        self._poked = asyncio.Event()

    def response(self) -> Any:
        st = self.st
        now = int(time.time())
        devices = device_health(st.cp.claims.values(), st.health, {*st.lost, *st.inv.lost})
        return health.NodeWatchResourcesResponse(
            devices=[
                health.DeviceHealth(
                    device=health.DeviceIdentifier(pool_name=st.node, device_name=d.device),
                    health=health.HEALTHY if d.healthy else health.UNHEALTHY,
                    last_updated_time=now,
                    health_check_timeout_seconds=TIMEOUT_S,
                    message=d.message,
                )
                for d in devices
            ]
        )

    async def NodeWatchResources(self, request: Any, context: Any) -> AsyncIterator[Any]:
        while True:
            changed, poked = self.st.next_health_change(), self._poked
            yield self.response()
            waits = [asyncio.ensure_future(e.wait()) for e in (changed, poked)]
            try:
                await asyncio.wait(waits, timeout=self.resend_s, return_when="FIRST_COMPLETED")
            finally:
                for w in waits:
                    w.cancel()
