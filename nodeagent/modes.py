"""MIG mode on demand: when the agent may change a GPU's MIG mode itself (pure; no NVML).

The allocator decides each GPU's mode as part of placement; the agent carries it out lazily,
as one step of realising an allocation (docs/nodeagent.md "MIG mode on demand"):

- Hopper and newer change MIG mode without a reset when the GPU is idle ("resetless");
  Ampere only through a GPU reset ("reset"), never per pod; a GPU whose reset-less change
  answered RESET_REQUIRED (a VM guest) or of an unknown architecture cannot ("none").
- Idle means no compute process and, when disabling, no GPU instance at all (InstaSlice
  releases its own first; a foreign one is never touched).
- A change that failed is not retried for `BACKOFF_S` (never loop: the DRA driver once
  looped on "GPU requires reset", kubernetes-sigs/dra-driver-nvidia-gpu#883).

- Resting mode (`instaslice.io/idle-mig-mode` on the Node): a Hopper+ GPU with nothing on it
  for longer than the agent's `--idle-mig-mode-after-s` is brought to the mode the label
  names, through the same intent/verify/back-off path (`rest_target`).

What it does not do: reset GPUs (Ampere maintenance: nodeagent/maintenance.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from common.constants import IDLE_MIG_MODE_LABEL
from nodeagent.checkpoint import SliceRecord
from nodeagent.model import MIG_DISABLED, MIG_ENABLED, GpuInfo, Instance

Obj = dict[str, Any]
Toggle = Literal["resetless", "reset", "none"]
RESETLESS_ARCHITECTURES = frozenset({"hopper", "blackwell"})
BACKOFF_S = 300.0
RESTING_CLAIM = "idle-mig-mode"  # the `claim` of a resting change's intent record


@dataclass(frozen=True, slots=True)
class ModeFailure:
    """A mode change that failed: avoided until `until` (the agent's monotonic clock)."""

    target: str
    message: str
    time: str  # RFC 3339, for MigNode
    until: float
    # MigNode `modeChange.reason`: constants.DRAIN_TIMED_OUT for an ask given up (final while
    # it stands); empty for a failure retried after the back-off
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ModeChanged:
    """The last mode change that succeeded on a GPU."""

    from_mode: str
    to_mode: str
    time: str  # RFC 3339


def toggle(gpu: GpuInfo, refused: bool = False) -> Toggle:
    """How this GPU's MIG mode can change. `refused`: a reset-less change answered
    RESET_REQUIRED on it before (a pass-through VM guest)."""
    if refused:
        return "none"
    if gpu.architecture == "ampere":
        return "reset"
    if gpu.architecture in RESETLESS_ARCHITECTURES:
        return "resetless"
    return "none"


def in_mode(gpu: GpuInfo, target: str) -> bool:
    return gpu.mig_current == target and gpu.mig_pending == target


def needed_modes(slices: Iterable[SliceRecord]) -> dict[str, str]:
    """GPU UUID → the MIG mode the slices need there (MIG slices: enabled; a whole GPU:
    disabled, since a GPU in MIG mode without instances runs no CUDA work,
    docs/mig-facts.md §3.1)."""
    return {s.gpu_uuid: MIG_DISABLED if s.whole else MIG_ENABLED for s in slices}


def mode_problem(
    gpu: GpuInfo, target: str, how: Toggle, failure: ModeFailure | None, now: float
) -> str | None:
    """Why the agent cannot bring `gpu` to `target` itself now; None when it can (or it is
    there already)."""
    if in_mode(gpu, target):
        return None
    if gpu.mig_current != gpu.mig_pending:
        return (
            f"GPU {gpu.index} has a MIG mode change pending ({gpu.mig_current} → "
            f"{gpu.mig_pending}) that needs a GPU reset"
        )
    if failure is not None and now < failure.until:
        return (
            f"changing MIG mode of GPU {gpu.index} failed ({failure.message}); "
            f"not retried for {round(failure.until - now)} s"
        )
    if how == "reset":
        return (
            f"GPU {gpu.index} ({gpu.model}, {gpu.architecture}) needs a GPU reset to change "
            "MIG mode, which the agent never does for a pod"
        )
    if how == "none":
        arch = gpu.architecture or "unknown architecture"
        return f"GPU {gpu.index} ({gpu.model}, {arch}) cannot change MIG mode without a reset here"
    return None


def idle_problem(
    gpu_index: int, target: str, processes: int, instances: Sequence[Instance]
) -> str | None:
    """The re-check right before SetMigMode: why the GPU is not idle, or None."""
    if processes:
        return f"GPU {gpu_index}: {processes} compute process(es) run on it"
    if target != MIG_ENABLED and instances:
        return f"GPU {gpu_index} holds {len(instances)} GPU instance(s)"
    return None


def failures_now(failures: Mapping[str, ModeFailure], now: float) -> dict[str, ModeFailure]:
    """The failures whose back-off still runs."""
    return {uuid: f for uuid, f in failures.items() if now < f.until}


def mode_status(
    how: Toggle,
    failure: ModeFailure | None,
    changed: ModeChanged | None,
    changing: bool,
    now: float,
    phase: str | None = None,
) -> Obj:
    """The MigNode GPU fields about MIG mode changes (docs/contract.md §3): `modeToggle`;
    `modeChange` while one runs (`Changing`) or failed within its back-off (`Failed`, the
    allocator then leaves the GPU's mode alone); `Draining` / `Resetting` during an Ampere
    maintenance (`phase`); `lastModeChange` after a success."""
    out: Obj = {"modeToggle": how}
    if phase is not None:  # Ampere maintenance (nodeagent/maintenance.py)
        out["modeChange"] = {"phase": phase}
    elif changing:
        out["modeChange"] = {"phase": "Changing"}
    elif failure is not None and now < failure.until:
        out["modeChange"] = {
            "phase": "Failed",
            "target": failure.target,
            "message": failure.message[:1000],
            "time": failure.time,
        }
        if failure.reason:
            out["modeChange"]["reason"] = failure.reason
    if changed is not None:
        out["lastModeChange"] = {
            "from": changed.from_mode,
            "to": changed.to_mode,
            "time": changed.time,
        }
    return out


IDLE_MODES = ("enabled", "disabled", "any")


class BadIdleMode(ValueError):
    """The Node's `instaslice.io/idle-mig-mode` label holds no known value."""


def idle_mode(labels: Mapping[str, str]) -> str | None:
    """The resting MIG mode a node's labels ask for: `enabled`, `disabled`, or None (label
    absent or `any`: idle GPUs keep their mode)."""
    value = labels.get(IDLE_MIG_MODE_LABEL)
    if value is None or value == "any":
        return None
    if value not in IDLE_MODES:
        raise BadIdleMode(
            f"node label {IDLE_MIG_MODE_LABEL}={value!r}: expected one of "
            f"{', '.join(IDLE_MODES)}; idle GPUs keep their mode"
        )
    return value


def rest_target(
    gpu: GpuInfo,
    target: str | None,
    how: Toggle,
    busy: bool,
    idle_for: float,
    after_s: float,
) -> str | None:
    """The mode to bring an idle GPU to now, or None. Only a reset-less GPU (Hopper and
    newer; never Ampere, never a VM guest), settled (no pending mode), with nothing on it
    (no allocation, record, instance or compute process: `busy`) for longer than `after_s`."""
    if target is None or busy or how != "resetless" or in_mode(gpu, target):
        return None
    if gpu.mig_current != gpu.mig_pending or gpu.compute_processes:
        return None
    return target if idle_for > after_s else None
