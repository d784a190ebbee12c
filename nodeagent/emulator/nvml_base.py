"""Plumbing shared by the pynvml-shaped calls: init, state access, handles, errors, ctypes I/O.

Every call reads the node's state file under its lock (so it sees other processes'
changes), resolves handles against that state, and raises the real `pynvml.NVMLError`
subclass for the nvml.h code (with the emulator's reason attached as an exception note).
Attributes the emulator does not implement fall through to `pynvml`: constants, struct
classes and exception classes are pynvml's own; an unimplemented `nvml*` function raises
NVMLError_FunctionNotFound, as real pynvml does on a driver that lacks the symbol.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import pynvml

from nodeagent.emulator import handles
from nodeagent.emulator.handles import Kind, Ref
from nodeagent.emulator.state import (
    DRIVER_NOT_LOADED,
    FUNCTION_NOT_FOUND,
    GPU_IS_LOST,
    INSUFFICIENT_SIZE,
    INVALID_ARGUMENT,
    NOT_SUPPORTED,
    UNINITIALIZED,
    ComputeInstance,
    EmulatorState,
    Gpu,
    GpuInstance,
    Op,
    Rejected,
)
from nodeagent.emulator.store import NodeStore, StateError

T = TypeVar("T")
# pynvml helpers that never reach the library: passed through, not stubbed.
_PURE_HELPERS = frozenset(
    {"nvmlStructToFriendlyObject", "nvmlFriendlyObjectToStruct", "nvmlExceptionClass"}
)


def nvml_error(code: int, reason: str = "") -> pynvml.NVMLError:
    """pynvml's own exception for `code` (NVMLError(23) is an NVMLError_InsufficientResources)."""
    err = pynvml.NVMLError(code)
    if reason:
        err.add_note(f"emulator: {reason}")
    return err


def fail(code: int, reason: str = "") -> NoReturn:
    raise nvml_error(code, reason)


def _out(ref: object) -> Any:
    """The ctypes scalar behind `byref(x)`, `pointer(x)` or `x` itself."""
    if isinstance(ref, ctypes._SimpleCData):
        return ref
    inner = getattr(ref, "_obj", None)  # byref(): CArgObject
    if isinstance(inner, ctypes._SimpleCData):
        return inner
    if isinstance(ref, ctypes._Pointer):
        return ref.contents
    fail(INVALID_ARGUMENT, f"expected byref(c_uint()), got {type(ref).__name__}")


def _target(ref: object) -> Any:
    """An array argument: a ctypes array (or byref/pointer to one) or a Python list."""
    inner = getattr(ref, "_obj", None)
    return inner if inner is not None else ref


@dataclass
class EventSet:
    """An in-process event set: per GPU the registered mask and the event seq it began at."""

    registered: dict[int, tuple[int, int]] = field(default_factory=dict)
    cursor: int = 0  # last event seq looked at


class NvmlBase:
    def __init__(
        self,
        state_dir: Path,
        node: str,
        *,
        sleep: Callable[[float], None] = time.sleep,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = NodeStore(Path(state_dir), node)
        self._tag = handles.node_tag(node)
        self._sleep = sleep
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._init_count = 0
        self._event_sets: dict[int, EventSet] = {}
        self._next_event_set = 1

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        value = getattr(pynvml, name)  # AttributeError for names pynvml lacks, as a module
        pure = name in _PURE_HELPERS or isinstance(value, type)
        if name.startswith("nvml") and callable(value) and not pure:

            def not_emulated(*_args: object, **_kwargs: object) -> NoReturn:
                fail(FUNCTION_NOT_FOUND, f"{name} is not emulated")

            return not_emulated
        return value

    # ---- init ------------------------------------------------------------------------------

    def nvmlInitWithFlags(self, flags: int) -> None:
        if not self._store.exists():
            fail(DRIVER_NOT_LOADED, f"node {self._store.node} is not provisioned")
        with self._lock:
            self._init_count += 1

    def nvmlInit(self) -> None:
        self.nvmlInitWithFlags(0)

    def nvmlShutdown(self) -> None:
        with self._lock:
            if self._init_count == 0:
                fail(UNINITIALIZED)
            self._init_count -= 1

    # ---- state -----------------------------------------------------------------------------

    def _read(self) -> EmulatorState:
        if self._init_count == 0:
            fail(UNINITIALIZED, "call nvmlInit first")
        try:
            return self._store.read()
        except StateError as exc:
            fail(DRIVER_NOT_LOADED, str(exc))

    def _mutate(
        self,
        latency: Op | None,
        change: Callable[[EmulatorState], tuple[EmulatorState, T | Rejected]],
    ) -> T:
        """Apply `change` atomically; sleep the configured latency first (outside the lock)."""
        settings = self._read().settings
        if latency is not None:
            ms = settings.create_ms if latency.startswith("create") else settings.destroy_ms
            if ms > 0:
                self._sleep(ms / 1000)
        try:
            with self._store.transaction() as box:
                box.state, result = change(box.state)
        except StateError as exc:
            fail(DRIVER_NOT_LOADED, str(exc))
        if isinstance(result, Rejected):
            fail(result.code, result.reason)
        return result

    # ---- handles ---------------------------------------------------------------------------

    @staticmethod
    def _gpu_of(state: EmulatorState, ref: Ref | None) -> Gpu:
        gpu = state.gpu(ref.gpu) if ref is not None else None
        if gpu is None:
            fail(INVALID_ARGUMENT, "not a handle of this node")
        if gpu.lost:
            fail(GPU_IS_LOST, f"GPU {gpu.index} fell off the bus")
        return gpu

    def _device(self, state: EmulatorState, handle: object) -> Gpu:
        """A full-GPU handle (MIG device handles are refused with INVALID_ARGUMENT)."""
        ref = self._ref(handle)
        if ref is None or ref.kind is not Kind.DEVICE:
            fail(INVALID_ARGUMENT, "expected a GPU handle")
        return self._gpu_of(state, ref)

    def _any_device(
        self, state: EmulatorState, handle: object
    ) -> tuple[Gpu, tuple[GpuInstance, ComputeInstance] | None]:
        """A GPU handle, or a MIG device handle with the GI and CI behind it."""
        ref = self._ref(handle)
        if ref is not None and ref.kind is Kind.MIG_DEVICE:
            gpu, gi, ci = self._compute(state, ref)
            return gpu, (gi, ci)
        return self._device(state, handle), None

    def _gpu_instance(self, state: EmulatorState, handle: object) -> tuple[Gpu, GpuInstance]:
        ref = self._ref(handle)
        if ref is None or ref.kind is not Kind.GPU_INSTANCE:
            fail(INVALID_ARGUMENT, "expected a GPU instance handle")
        gpu = self._gpu_of(state, ref)
        gi = gpu.gi(ref.gi)
        if gi is None or gi.serial != ref.serial:
            fail(INVALID_ARGUMENT, f"GPU instance {ref.gi} no longer exists")
        return gpu, gi

    def _compute(
        self, state: EmulatorState, ref: Ref | None
    ) -> tuple[Gpu, GpuInstance, ComputeInstance]:
        gpu = self._gpu_of(state, ref)
        assert ref is not None
        gi = gpu.gi(ref.gi)
        ci = gi.ci(ref.ci) if gi is not None else None
        if gi is None or ci is None or ci.serial != ref.serial:
            fail(INVALID_ARGUMENT, f"compute instance {ref.gi}/{ref.ci} no longer exists")
        return gpu, gi, ci

    def _compute_instance(
        self, state: EmulatorState, handle: object
    ) -> tuple[Gpu, GpuInstance, ComputeInstance]:
        ref = self._ref(handle)
        if ref is None or ref.kind is not Kind.COMPUTE_INSTANCE:
            fail(INVALID_ARGUMENT, "expected a compute instance handle")
        return self._compute(state, ref)

    @staticmethod
    def _require_mig(gpu: Gpu) -> None:
        if gpu.mig_current != pynvml.NVML_DEVICE_MIG_ENABLE:
            fail(NOT_SUPPORTED, f"GPU {gpu.index}: MIG mode is disabled")

    def _ref(self, handle: object) -> Ref | None:
        """What `handle` names, if it is one of this node's handles."""
        ref = handles.read(handle)
        return ref if ref is not None and ref.node == self._tag else None

    def _make(self, kind: Kind, gpu: int = 0, gi: int = 0, ci: int = 0, serial: int = 0) -> Any:
        return handles.make(Ref(kind, gpu, gi, ci, serial, self._tag))

    def _device_handle(self, gpu: Gpu) -> Any:
        return self._make(Kind.DEVICE, gpu.index)

    def _gi_handle(self, gpu: Gpu, gi: GpuInstance) -> Any:
        return self._make(Kind.GPU_INSTANCE, gpu.index, gi.id, serial=gi.serial)

    def _ci_handle(self, gpu: Gpu, gi: GpuInstance, ci: ComputeInstance, kind: Kind) -> Any:
        return self._make(kind, gpu.index, gi.id, ci.id, ci.serial)

    # ---- ctypes in/out parameters ----------------------------------------------------------

    @staticmethod
    def _fill(array_ref: object, count_ref: object, items: Sequence[object]) -> None:
        """Write `items` into a caller's array (NULL: only report the count) and the count."""
        count = _out(count_ref)
        target = _target(array_ref)
        if target is not None:
            if isinstance(target, list):
                target[:] = list(items)
            else:
                try:
                    capacity = len(target)
                except TypeError:
                    capacity = len(items)  # a bare pointer: trust the caller
                if capacity < len(items):
                    count.value = len(items)
                    fail(INSUFFICIENT_SIZE, f"array holds {capacity}, need {len(items)}")
                for i, item in enumerate(items):
                    target[i] = item
        count.value = len(items)
