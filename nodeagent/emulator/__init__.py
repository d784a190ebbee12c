"""NVML emulator: GPUs of emulated nodes that follow the real MIG rules, with pynvml's API.

Public API (other components code against these names):

- `provision(state_dir, node, models, mig_mode="enabled")` creates `<state_dir>/<node>.json`
  with one GPU per catalog model name, unless it exists (idempotent; GPU UUIDs are stable
  per node and index).
- `EmulatedNvml(state_dir, node)` is a drop-in for the `pynvml` module for that node's GPUs
  (`nvmlInit`, `nvmlDeviceGetHandleByIndex`, `nvmlDeviceCreateGpuInstanceWithPlacement`, ...;
  constants, ctypes structs and `NVMLError` classes are pynvml's own).
- `EmulatorControl(state_dir, node)`: `reboot()`, `reset_gpu(i)`, `set_latency(create_ms=,
  destroy_ms=)`, `fail_next(op, code, count=1, skip=0)`, `gpu_lost(i)`, `emit_xid(i, xid)`,
  `add_process(uuid)` / `remove_process(uuid)`, `instances()`, `boot_id()`, `state()`.
- `EmulatorState` is the node's state as frozen data (see `state.py`).

Layers: `state.py` (data) ← `rules.py` / `node.py` (pure rules) ← `store.py` (file, lock)
← `nvml*.py` (pynvml-shaped facade) and `control.py`; `smi.py` + `cli.py` are
`instaslice-emu`. docs/emulator.md describes the rules and what is inferred.
"""

from nodeagent.emulator.control import EmulatorControl, EmulatorError, InstanceRow, provision
from nodeagent.emulator.nvml import EmulatedNvml
from nodeagent.emulator.state import EmulatorState

__all__ = [
    "EmulatedNvml",
    "EmulatorControl",
    "EmulatorError",
    "EmulatorState",
    "InstanceRow",
    "provision",
]
