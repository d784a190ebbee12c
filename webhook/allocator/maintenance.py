"""Ampere maintenance, the allocator's half (`--ampere-mode-changes=drain`; docs/allocator.md).

A pod that fits only after a MIG mode change on Ampere GPUs (NeedsMigModeChange) makes the
allocator ask for that change: it writes `spec.gpus[].desiredMigMode` on the node's MigNode
for exactly the GPUs the pod's would-be placement uses, and the node agent drains, pauses
the GPU Operator's clients, resets and restores (nodeagent/maintenance.py). From the moment
the ask is seen, the GPU takes nothing new (views.in_maintenance); once the agent publishes
the mode, the pod is placed like any other.

Never per pod, never a loop: one ask in flight in the whole cluster at a time (other pods
that need a reset wait for it, then ask if they still need one); the ask is withdrawn
(`desiredMigMode` removed) when the mode is reached or the agent reports `modeChange.phase:
Failed` — the failed GPU is then avoided for the agent's back-off, so a pod that still
needs a reset asks again at most once per back-off.

Pure helpers here; the write is the controller's (one merge patch of the MigNode's spec).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from common.objects import DesiredGpu, desired_modes
from webhook.allocator.views import GpuView

Obj = dict[str, Any]
ASK_OFF = "off"
ASK_DRAIN = "drain"
AMPERE_MODE_CHANGES = (ASK_OFF, ASK_DRAIN)


def in_flight(gpus: Mapping[str, Iterable[GpuView]]) -> list[tuple[str, GpuView]]:
    """(node, GPU) of every GPU whose asked mode is not reached yet (whoever asked)."""
    return [(node, g) for node, views in gpus.items() for g in views if g.maintenance]


def withdrawals(mig_node: Obj) -> set[str]:
    """GPU UUIDs whose `desiredMigMode` is done with: reached, or the agent failed it."""
    desired = desired_modes(mig_node)
    out = set()
    for g in (mig_node.get("status") or {}).get("gpus") or []:
        uuid = str(g.get("uuid", ""))
        if uuid not in desired:
            continue
        mode = g.get("migMode") or {}
        reached = mode.get("current") == mode.get("pending") == desired[uuid]
        failed = (g.get("modeChange") or {}).get("phase") == "Failed"
        if reached or failed:
            out.add(uuid)
    return out


def spec_patch(current: Mapping[str, str], add: Mapping[str, str], drop: set[str]) -> Obj:
    """The merge patch setting the MigNode's whole `spec.gpus` list (a JSON merge patch
    replaces a list): `current` with `add` set and `drop` removed."""
    want = {**{u: m for u, m in current.items() if u not in drop}, **add}
    gpus: list[DesiredGpu] = [{"uuid": u, "desiredMigMode": m} for u, m in sorted(want.items())]
    return {"spec": {"gpus": gpus}}
