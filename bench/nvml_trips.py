"""One slice made through the agent's NVML lanes in three trips (GI, CI, MIG UUID: before)
and in one (`nodeagent.lifecycle._gi_ci_uuid`: now), on one emulated 8 x H100 node, with
the event loop kept busy beside it (0.2 ms of work every ms, as watch decoding keeps a
loaded agent's loop). Median wall ms and mean CPU ms of the process per slice, the two ways
alternated. No cluster.

    python -m bench.nvml_trips [--slices 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common.catalog import load_catalog
from nodeagent.device import NodeGpus
from nodeagent.emulator import EmulatedNvml, provision
from nodeagent.lifecycle import _gi_ci_uuid


async def measure(state_dir: Path, slices: int) -> dict[str, dict[str, float]]:
    provision(state_dir, "n0", ["H100-80GB"] * 8)
    nv = EmulatedNvml(state_dir, "n0")
    wall: dict[str, list[float]] = {"three": [], "one": []}
    cpu: dict[str, list[float]] = {"three": [], "one": []}
    stop = asyncio.Event()

    async def busy() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            while time.perf_counter() - t < 0.0002:
                pass
            await asyncio.sleep(0.001)

    async with NodeGpus(nv, load_catalog(), "n0") as gpus:
        s = gpus.s
        inv = await gpus.call(s.inventory)
        prof = next(p for p in inv.gpus[0].profiles if p.name == "1g.10gb")
        beside = asyncio.create_task(busy())
        for r in range(slices):
            for how in ("three", "one") if r % 2 else ("one", "three"):
                i = inv.gpus[r % len(inv.gpus)].index
                t0, c0 = time.perf_counter(), time.process_time()
                if how == "three":
                    gi = await gpus.call_gpu(i, s.create_gi, i, prof.id, 0, 1)
                    ci = await gpus.call_gpu(i, s.create_ci, i, gi, prof.slice_count, None)
                    await gpus.call_gpu(i, s.mig_uuid, i, gi, ci)
                else:
                    gi, ci, _ = await gpus.call_gpu(
                        i, _gi_ci_uuid, s, i, prof.id, 0, 1, None, prof.slice_count, None
                    )
                wall[how].append((time.perf_counter() - t0) * 1e3)
                cpu[how].append((time.process_time() - c0) * 1e3)
                await gpus.call_gpu(i, s.destroy_ci, i, gi, ci)
                await gpus.call_gpu(i, s.destroy_gi, i, gi)
        stop.set()
        await beside
    return {
        how: {
            "wall_ms_p50": round(statistics.median(wall[how]), 2),
            "cpu_ms_mean": round(statistics.mean(cpu[how]), 3),
        }
        for how in wall
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.nvml_trips", description=__doc__)
    ap.add_argument("--slices", type=int, default=200)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(asyncio.run(measure(Path(tmp), args.slices))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
