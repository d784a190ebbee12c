"""Provisioning and the test/chaos controls of an emulated node (not part of NVML).

Everything here goes through the node's state file, so a control used in one process (the
CLI, a test, `make chaos`) is seen by the next NVML call of every other process.
Controls raise `EmulatorError` for a bad request (unknown node, GPU, UUID, or a refused
reset); they never raise NVML errors.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Literal, NamedTuple

from common.catalog import GpuModel, load_catalog
from nodeagent.emulator import node as node_ops
from nodeagent.emulator import rules
from nodeagent.emulator.state import OPS, EmulatorState, FailRule, Op, Rejected
from nodeagent.emulator.store import NodeStore, StateError


class EmulatorError(Exception):
    """A control request the emulator cannot carry out."""


class InstanceRow(NamedTuple):
    gpu_index: int
    profile_name: str
    profile_id: int
    gi_id: int
    start: int
    size: int
    ci_id: int | None  # None for a GI without compute instances
    mig_uuid: str | None


Provisioned = Literal["created", "kept", "replaced"]


def provision(
    state_dir: Path,
    node: str,
    models: Sequence[str],
    mig_mode: Literal["enabled", "disabled"] = "enabled",
    tables: Sequence[GpuModel] = (),
) -> Provisioned:
    """Give the node the GPUs asked for (one model name per GPU, all in `mig_mode`): a
    catalog name, or the name of one of `tables` — models defined only by a table file
    (`common.catalog.load_model_file`), which win over a catalog entry of the same name.

    A node that already has exactly those (same models, provisioned with the same MIG mode,
    in order) keeps its state, instances and on-demand mode changes included ("kept": a
    restart with an unchanged spec); one that has other
    GPUs or modes is provisioned anew ("replaced": the spec changed); else "created". GPU
    UUIDs derive from node and index.
    """
    catalog = load_catalog()
    by_name = {t.name: t for t in tables}
    unknown = sorted({m for m in models if m not in by_name and catalog.model(m) is None})
    if unknown:
        known = ", ".join([*(m.name for m in catalog.models), *by_name])
        raise EmulatorError(f"unknown GPU model(s) {unknown}; known: {known}")
    if mig_mode not in ("enabled", "disabled"):
        raise EmulatorError(f"mig_mode must be enabled or disabled, not {mig_mode!r}")
    state = node_ops.new_node(node, list(models), mig_mode == "enabled", str(uuid.uuid4()), by_name)
    store = NodeStore(Path(state_dir), node)
    if store.create(state):
        return "created"
    try:
        have: EmulatorState | None = store.read()
    except StateError:
        have = None  # unreadable: provisioned anew
    if have is not None and _shape(have) == _shape(state):
        return "kept"
    store.overwrite(state)
    return "replaced"


def _shape(state: EmulatorState) -> list[tuple[str, int, GpuModel | None]]:
    """Models (and their tables) and the provisioned MIG mode: the agent may have changed the
    current mode on demand since, which is no change of the spec (an older file: its current
    mode)."""
    return [
        (g.model, state.provisioned_mode if state.provisioned_mode >= 0 else g.mig_current, g.table)
        for g in state.gpus
    ]


class EmulatorControl:
    """Controls of one provisioned node; see the module docstring."""

    def __init__(self, state_dir: Path, node: str) -> None:
        self._store = NodeStore(Path(state_dir), node)

    def state(self) -> EmulatorState:
        try:
            return self._store.read()
        except StateError as exc:
            raise EmulatorError(str(exc)) from None

    def boot_id(self) -> str:
        return self.state().boot_id

    def _change(self, fn: Callable[[EmulatorState], EmulatorState | Rejected]) -> EmulatorState:
        try:
            with self._store.transaction() as box:
                new = fn(box.state)
                if isinstance(new, Rejected):
                    raise EmulatorError(new.reason)
                box.state = new
                return new
        except StateError as exc:
            raise EmulatorError(str(exc)) from None

    def _index(self, state: EmulatorState, index: int) -> int:
        if state.gpu(index) is None:
            raise EmulatorError(f"node {state.node} has no GPU {index}")
        return index

    def reboot(self, *, keep_mig_mode: bool | None = None) -> str:
        """All instances and processes go, the boot id changes; returns the new boot id.
        MIG mode after it: per model (`rules.mode_after_reboot`) unless `keep_mig_mode`."""
        boot_id = str(uuid.uuid4())
        self._change(lambda s: node_ops.reboot(s, boot_id, keep_mig_mode=keep_mig_mode))
        return boot_id

    def reset_gpu(self, index: int, *, force: bool = False) -> None:
        """`nvidia-smi -r`: applies a pending MIG mode, clears instances and a lost state.
        Refused while processes use the GPU unless `force`."""

        def fn(s: EmulatorState) -> EmulatorState | Rejected:
            gpu = s.gpus[self._index(s, index)]
            held = index in s.settings.driver_clients
            res = rules.reset(gpu, force=force, vm=s.settings.vm, held=held)
            return res if isinstance(res, Rejected) else s.with_gpu(res)

        self._change(fn)

    def set_latency(
        self,
        create_ms: int | None = None,
        destroy_ms: int | None = None,
        mode_ms: int | None = None,
    ) -> None:
        """Sleeps before GI/CI creates, destroys, and MIG mode changes (None: unchanged)."""

        def fn(s: EmulatorState) -> EmulatorState:
            settings = s.settings
            if create_ms is not None:
                settings = replace(settings, create_ms=max(0, create_ms))
            if destroy_ms is not None:
                settings = replace(settings, destroy_ms=max(0, destroy_ms))
            if mode_ms is not None:
                settings = replace(settings, mode_ms=max(0, mode_ms))
            return replace(s, settings=settings)

        self._change(fn)

    def set_vm(self, vm: bool) -> None:
        """True: the node is a pass-through VM guest. SetMigMode only records the pending
        mode (RESET_REQUIRED) and `reset_gpu` is refused, so only a reboot changes it [INF]."""
        self._change(lambda s: replace(s, settings=replace(s.settings, vm=vm)))

    def set_driver_client(self, index: int, held: bool) -> None:
        """A driver client (DCGM, nvidia-persistenced) holds GPU `index` open, or lets go:
        while held, `reset_gpu` is refused with IN_USE [INF]."""

        def fn(s: EmulatorState) -> EmulatorState:
            clients = set(s.settings.driver_clients) - {index}
            if held:
                clients.add(self._index(s, index))
            return replace(s, settings=replace(s.settings, driver_clients=tuple(sorted(clients))))

        self._change(fn)

    def set_disable_with_instances(self, rule: Literal["in_use", "destroy"]) -> None:
        """What a Hopper+ SetMigMode(DISABLE) does while GPU instances exist [INF]:
        "in_use" (default) refuses with IN_USE, "destroy" drops them."""
        if rule not in ("in_use", "destroy"):
            raise EmulatorError(f"disable_with_instances must be in_use or destroy, not {rule!r}")
        self._change(
            lambda s: replace(s, settings=replace(s.settings, disable_with_instances=rule))
        )

    def set_capacity_without_mig(self, answer: bool) -> None:
        """True (default, like driver 580): RemainingCapacity answers with MIG disabled;
        False: it returns NOT_SUPPORTED then, as nvml.h documents."""
        self._change(
            lambda s: replace(s, settings=replace(s.settings, capacity_without_mig=answer))
        )

    def fail_next(self, op: Op, code: int, count: int = 1, *, skip: int = 0) -> None:
        """Let `skip` calls of `op` pass, then fail the next `count` with NVML error `code`."""
        if op not in OPS:
            raise EmulatorError(f"op must be one of {OPS}, not {op!r}")
        if code <= 0 or count <= 0 or skip < 0:
            raise EmulatorError("code and count must be positive, skip not negative")
        rule = FailRule(op=op, code=code, count=count, skip=skip)
        self._change(lambda s: node_ops.add_fail_rule(s, rule))

    def clear_failures(self) -> None:
        self._change(lambda s: replace(s, settings=replace(s.settings, fail=())))

    def gpu_lost(self, index: int) -> None:
        """The GPU falls off the bus (XID 79): every NVML call on it fails GPU_IS_LOST
        until `reset_gpu(index, force=True)` or `reboot()`."""
        self._change(lambda s: node_ops.gpu_lost(s, self._index(s, index)))

    def emit_xid(
        self, index: int, xid: int, *, gi_id: int | None = None, ci_id: int | None = None
    ) -> None:
        """Raise an XID critical-error event (e.g. 48 DBE, 79 fell off the bus)."""
        no_id = 0xFFFFFFFF

        def fn(s: EmulatorState) -> EmulatorState:
            return node_ops.emit_event(
                s,
                self._index(s, index),
                xid,
                gi_id=no_id if gi_id is None else gi_id,
                ci_id=no_id if ci_id is None else ci_id,
            )

        self._change(fn)

    def add_process(self, device_uuid: str) -> int:
        """Attach an emulated process to a MIG device (MIG-...) or whole GPU (GPU-...)."""
        pid: list[int] = []

        def fn(s: EmulatorState) -> EmulatorState | Rejected:
            res = node_ops.add_process(s, device_uuid)
            if isinstance(res, Rejected):
                return res
            pid.append(res[1])
            return res[0]

        self._change(fn)
        return pid[0]

    def remove_process(self, device_uuid: str, pid: int | None = None) -> None:
        """Detach process `pid` (all of them if None) from the device."""
        self._change(lambda s: node_ops.remove_process(s, device_uuid, pid))

    def instances(self) -> list[InstanceRow]:
        """One row per compute instance (and per GI without any), by GPU, GI id, CI id."""
        state = self.state()
        rows: list[InstanceRow] = []
        for gpu in state.gpus:
            for gi in sorted(gpu.gis, key=lambda g: g.id):
                profile = gpu.spec.profile_by_id(gi.profile_id)
                name = profile.name if profile is not None else f"id{gi.profile_id}"
                base = (gpu.index, name, gi.profile_id, gi.id, gi.start, gi.size)
                cis = sorted(gi.cis, key=lambda c: c.id)
                rows += [InstanceRow(*base, c.id, c.uuid) for c in cis]
                if not cis:
                    rows.append(InstanceRow(*base, None, None))
        return rows
