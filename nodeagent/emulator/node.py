"""Node-wide state changes as pure functions: `EmulatorState` in, `EmulatorState` out.

These wrap the per-GPU rules (`rules.py`) with what belongs to the node: instance serials
and MIG UUIDs, injected failures, emulated processes, the event log, reboots. Each
`apply_*` returns `(new_state, result)` where result may be `Rejected`; the new state is
worth keeping even then (an injected failure was used up).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType

from common.catalog import GpuModel
from nodeagent.emulator import rules
from nodeagent.emulator.state import (
    EVENT_HISTORY,
    EVENT_XID,
    MIG_DISABLE,
    MIG_ENABLE,
    NO_ID,
    NOT_FOUND,
    XID_FELL_OFF_BUS,
    ComputeInstance,
    EmulatorState,
    Event,
    FailRule,
    Gpu,
    GpuInstance,
    Op,
    Rejected,
)

_NAMESPACE = uuid.UUID("5b0e7c52-5a1c-4b43-9a55-6b7d1f0e4d21")  # emulator-private


def gpu_uuid(node: str, index: int) -> str:
    """Stable per (node, index): survives restarts and re-provisioning."""
    return f"GPU-{uuid.uuid5(_NAMESPACE, f'{node}/gpu/{index}')}"


def mig_uuid(node: str, serial: int) -> str:
    """New for every CI ever created on the node (serials are never reused)."""
    return f"MIG-{uuid.uuid5(_NAMESPACE, f'{node}/ci/{serial}')}"


def new_node(
    node: str,
    models: list[str],
    mig_enabled: bool,
    boot_id: str,
    tables: Mapping[str, GpuModel] = MappingProxyType({}),
) -> EmulatorState:
    """`models` are catalog names, or names of `tables` (models defined by a table file)."""
    mode = MIG_ENABLE if mig_enabled else MIG_DISABLE
    gpus = tuple(
        Gpu(
            index=i,
            model=m,
            uuid=gpu_uuid(node, i),
            mig_current=mode,
            mig_pending=mode,
            table=tables.get(m),
        )
        for i, m in enumerate(models)
    )
    return EmulatorState(node=node, boot_id=boot_id, gpus=gpus, provisioned_mode=mode)


# ---- injected failures ---------------------------------------------------------------------


def take_failure(state: EmulatorState, op: Op) -> tuple[EmulatorState, Rejected | None]:
    """Count one call of `op` against the first matching fail rule."""
    rules_ = list(state.settings.fail)
    for i, rule in enumerate(rules_):
        if rule.op != op:
            continue
        failure: Rejected | None = None
        if rule.skip > 0:
            rules_[i] = replace(rule, skip=rule.skip - 1)
        else:
            failure = Rejected(rule.code, f"injected failure of {op}")
            if rule.count > 1:
                rules_[i] = replace(rule, count=rule.count - 1)
            else:
                del rules_[i]
        settings = replace(state.settings, fail=tuple(rules_))
        return replace(state, settings=settings), failure
    return state, None


def add_fail_rule(state: EmulatorState, rule: FailRule) -> EmulatorState:
    return replace(state, settings=replace(state.settings, fail=(*state.settings.fail, rule)))


# ---- GI / CI with node bookkeeping ---------------------------------------------------------


def apply_create_gi(
    state: EmulatorState, index: int, profile_id: int, placement: tuple[int, int] | None
) -> tuple[EmulatorState, GpuInstance | Rejected]:
    state, failed = take_failure(state, "create_gi")
    if failed is not None:
        return state, failed
    res = rules.create_gi(state.gpus[index], profile_id, placement, state.next_serial)
    if isinstance(res, Rejected):
        return state, res
    gpu, gi = res
    return replace(state.with_gpu(gpu), next_serial=state.next_serial + 1), gi


def apply_create_ci(
    state: EmulatorState, index: int, gi_id: int, enum: int, start: int | None
) -> tuple[EmulatorState, ComputeInstance | Rejected]:
    state, failed = take_failure(state, "create_ci")
    if failed is not None:
        return state, failed
    serial = state.next_serial
    res = rules.create_ci(
        state.gpus[index], gi_id, enum, start, serial, mig_uuid(state.node, serial)
    )
    if isinstance(res, Rejected):
        return state, res
    gpu, ci = res
    return replace(state.with_gpu(gpu), next_serial=serial + 1), ci


def apply_destroy_ci(
    state: EmulatorState, index: int, gi_id: int, ci_id: int
) -> tuple[EmulatorState, Rejected | None]:
    state, failed = take_failure(state, "destroy_ci")
    if failed is not None:
        return state, failed
    res = rules.destroy_ci(state.gpus[index], gi_id, ci_id)
    if isinstance(res, Rejected):
        return state, res
    return state.with_gpu(res), None


def apply_destroy_gi(
    state: EmulatorState, index: int, gi_id: int
) -> tuple[EmulatorState, Rejected | None]:
    state, failed = take_failure(state, "destroy_gi")
    if failed is not None:
        return state, failed
    res = rules.destroy_gi(state.gpus[index], gi_id)
    if isinstance(res, Rejected):
        return state, res
    return state.with_gpu(res), None


# ---- processes, events, resets -------------------------------------------------------------


def add_process(state: EmulatorState, uuid_: str) -> tuple[EmulatorState, int] | Rejected:
    """Attach an emulated process to a GPU (GPU-...) or MIG device (MIG-...); its pid."""
    try:
        gpu, gi, ci = state.find_uuid(uuid_)
    except LookupError:
        return Rejected(NOT_FOUND, f"no GPU or MIG device {uuid_}")
    pid = state.next_pid
    if gi is None or ci is None:
        gpu = replace(gpu, processes=(*gpu.processes, pid))
    else:
        new_ci = replace(ci, processes=(*ci.processes, pid))
        new_gi = replace(gi, cis=tuple(new_ci if c.id == ci.id else c for c in gi.cis))
        gpu = replace(gpu, gis=tuple(new_gi if g.id == gi.id else g for g in gpu.gis))
    return replace(state.with_gpu(gpu), next_pid=pid + 1), pid


def remove_process(
    state: EmulatorState, uuid_: str, pid: int | None = None
) -> EmulatorState | Rejected:
    """Detach one process (or all, with pid None) from a GPU or MIG device."""
    try:
        gpu, gi, ci = state.find_uuid(uuid_)
    except LookupError:
        return Rejected(NOT_FOUND, f"no GPU or MIG device {uuid_}")

    def keep(pids: tuple[int, ...]) -> tuple[int, ...]:
        return () if pid is None else tuple(p for p in pids if p != pid)

    if gi is None or ci is None:
        gpu = replace(gpu, processes=keep(gpu.processes))
    else:
        new_ci = replace(ci, processes=keep(ci.processes))
        new_gi = replace(gi, cis=tuple(new_ci if c.id == ci.id else c for c in gi.cis))
        gpu = replace(gpu, gis=tuple(new_gi if g.id == gi.id else g for g in gpu.gis))
    return state.with_gpu(gpu)


def emit_event(
    state: EmulatorState,
    index: int,
    data: int,
    *,
    event_type: int = EVENT_XID,
    gi_id: int = NO_ID,
    ci_id: int = NO_ID,
) -> EmulatorState:
    event = Event(state.next_event, index, event_type, data, gi_id, ci_id)
    events = (*state.events, event)[-EVENT_HISTORY:]
    return replace(state, events=events, next_event=state.next_event + 1)


def gpu_lost(state: EmulatorState, index: int) -> EmulatorState:
    """The GPU fell off the bus: every call on it fails GPU_IS_LOST; XID 79 is raised."""
    state = state.with_gpu(replace(state.gpus[index], lost=True))
    return emit_event(state, index, XID_FELL_OFF_BUS)


def reboot(
    state: EmulatorState, boot_id: str, *, keep_mig_mode: bool | None = None
) -> EmulatorState:
    """Every GPU is reset, instances and processes are gone, and each GPU comes back with
    the MIG mode its model keeps across a reboot (`rules.mode_after_reboot`: Ampere keeps
    its pending mode, Hopper and newer come back disabled [INF]). `keep_mig_mode` True or
    False overrides the model (False: a VM whose MIG mode went with it, docs/mig-facts.md §1)."""
    gpus = []
    for gpu in state.gpus:
        mode = rules.mode_after_reboot(gpu, keep_mig_mode)
        gpus.append(
            replace(gpu, mig_current=mode, mig_pending=mode, lost=False, processes=(), gis=())
        )
    return replace(state, boot_id=boot_id, gpus=tuple(gpus))
