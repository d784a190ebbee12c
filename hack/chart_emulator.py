"""The Helm chart's test-only value `testing.emulator` (make dev-up's `install: chart`,
docs/control-plane.md): the node agent runs the NVML emulator on a node whose GPUs are
emulated, its state and device files in host directories. Never on real GPUs.

hack/gen_chart.py calls `parameterise` on the node agent's DaemonSet; with the value off (the
default) the marks render nothing, so the chart's defaults stay the overlay's rendering.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["parameterise"]

Obj = dict[str, Any]
Mark = Callable[[str, str], str]

_EMU = ".Values.testing.emulator"
# what `testing.emulator.enabled` adds (ternary: both branches evaluate)
_ARGS = (
    f'ternary (list "--emulate" (printf "--emu-state=%s" {_EMU}.stateDir) '
    f'(printf "--dev-root=%s" {_EMU}.devRoot)) (list) {_EMU}.enabled'
)
_MOUNTS = (
    f'ternary (list (dict "name" "emu-state" "mountPath" {_EMU}.stateDir) '
    f'(dict "name" "emu-dev" "mountPath" {_EMU}.devRoot "readOnly" true)) (list) {_EMU}.enabled'
)
_VOLUMES = (
    f'ternary (list (dict "name" "emu-state" "hostPath" (dict "path" {_EMU}.stateDir "type" '
    f'"Directory")) (dict "name" "emu-dev" "hostPath" (dict "path" {_EMU}.devRoot "type" '
    f'"Directory"))) (list) {_EMU}.enabled'
)


def _items(expr: str) -> str:
    """Template text for a list item mark: the items of expr's list there (none if empty)."""
    return f"{{{{- with {expr} }}}}{{{{ toYaml . | nindent {{i}} }}}}{{{{- end }}}}"


def parameterise(spec: Obj, mark: Mark) -> None:
    """Append the emulator's args, mounts and volumes to the node agent's pod spec."""
    (container,) = spec["containers"]
    container.setdefault("args", []).append(mark("item", _items(_ARGS)))
    container.setdefault("volumeMounts", []).append(mark("item", _items(_MOUNTS)))
    spec.setdefault("volumes", []).append(mark("item", _items(_VOLUMES)))
