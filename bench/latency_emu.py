"""CPU cost of the node agent's NVML work on one emulated node (no cluster): the hot path
the profiles of `bench.latency` pointed at.

`python -m bench.latency_emu [--out FILE]` provisions one 8 x H100-80GB node in a temporary
directory and times, in CPU seconds of this process (not wall time: the machine is shared),
what the agent does through `nodeagent.nvml.NvmlSession` on the emulator:

- `event_poll_us`: one `nvmlEventSetWait(0)` with nothing pending (the health hub asks every
  emulated node 4 times a second);
- `scan_empty_ms` / `scan_full_ms`: `instances()` of all 8 GPUs (the MIG-handle walk garbage
  collection and every create/release do), with no slices and with 56 1g slices;
- `inventory_ms`: discovery at startup (profiles, placements, instances);
- `create_slice_ms`: one slice as the agent makes it (GI at a placement, its CI, the MIG
  UUID by walking MIG handles).

Used for the before/after table in docs/benchmarks.md (run it from a checkout of the old
commit with PYTHONPATH pointing there for "before").
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from common.catalog import load_catalog
from nodeagent.emulator import EmulatedNvml, provision
from nodeagent.nvml import EventWatcher, NvmlSession


def _cpu(fn: Callable[[], object], times: int) -> float:
    t = time.process_time()
    for _ in range(times):
        fn()
    return (time.process_time() - t) / times


def measure(state_dir: Path, rounds: int = 1) -> dict[str, float]:
    provision(state_dir, "n0", ["H100-80GB"] * 8)
    nv = EmulatedNvml(state_dir, "n0")
    s = NvmlSession(nv, load_catalog())
    s.open()
    watcher = EventWatcher(s, range(8))
    watcher.open()
    inv = s.inventory()
    out: dict[str, float] = {}
    out["event_poll_us"] = 1e6 * _cpu(lambda: watcher.wait(0), 500 * rounds)

    def scan() -> None:
        for g in inv.gpus:
            s.instances(g)

    out["scan_empty_ms"] = 1e3 * _cpu(scan, 5 * rounds)
    out["inventory_ms"] = 1e3 * _cpu(s.inventory, 3 * rounds)
    prof = next(p for p in inv.gpus[0].profiles if p.name == "1g.10gb")
    todo = [(g.index, start, size) for g in inv.gpus for start, size in prof.placements]

    def make() -> None:
        index, start, size = todo.pop()
        gi = s.create_gi(index, prof.id, start, size)
        ci = s.create_ci(index, gi, prof.slice_count, None)
        s.mig_uuid(index, gi, ci)

    out["create_slice_ms"] = 1e3 * _cpu(make, len(todo))
    out["scan_full_ms"] = 1e3 * _cpu(scan, 3 * rounds)
    s.close()
    return {k: round(v, 2) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.latency_emu", description=__doc__)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        res = measure(Path(tmp), args.rounds)
    print(json.dumps(res))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
