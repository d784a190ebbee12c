"""A create behind releases on one GPU's NVML lane, in the old order and in the new (issue 25).

The churn's pieces without the machine's noise: the agent's own lane (`nodeagent.device.
NodeGpus`, `nodeagent.lane`) on one emulated H100-80GB at the benchmark's realistic latency
(300 ms per GI or CI create, 200 ms per destroy). Each round: `K` releases of other claims
start on the GPU (each, as `Lifecycle.release` asks: an instance scan, destroy CI, destroy
GI, one call at a time); `--after-ms` later a create asks, as `Lifecycle.create` does: an
instance scan, then (after its `Creating` write and intent record, `--gap-ms`) the GI + CI
+ MIG UUID trip. Orders, alternated round by round:

- `fifo`: every call in the order asked for (the agent before);
- `creates-first`: the create's two calls through `call_gpu_first` (the agent now).

Printed per order and K: the create's time from asking to made (p50 / max, s) and when the
last release was done (p50, s from its start). No cluster; wall times of NVML sleeps, so the
machine's load moves them by milliseconds, not by the 200 ms steps measured.

    python -m bench.lane_order [--releases 1,2,4] [--rounds 6]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common.catalog import load_catalog
from nodeagent.device import NodeGpus
from nodeagent.emulator import EmulatedNvml, EmulatorControl, provision
from nodeagent.lifecycle import _gi_ci_uuid

ORDERS = ("fifo", "creates-first")
PROFILE = "1g.10gb"


async def _round(
    gpus: NodeGpus, ctl: EmulatorControl, order: str, k: int, after_s: float, gap_s: float
) -> tuple[float, float]:
    """One round on GPU 0: (create ask → made, releases' start → last done), seconds."""
    s = gpus.s
    inv = await gpus.call(s.inventory)
    gpu = inv.gpus[0]
    prof = next(p for p in gpu.profiles if p.name == PROFILE)
    ctl.set_latency(create_ms=0, destroy_ms=0)
    held = []
    for start in range(k):  # the claims being released: slots 0..k-1
        held.append(await gpus.call_gpu(0, _gi_ci_uuid, s, 0, prof.id, start, 1, None, 1, None))
    ctl.set_latency(create_ms=300, destroy_ms=200)

    async def release(gi: int, ci: int) -> None:
        await gpus.call_gpu(0, s.instances, gpu)
        await gpus.call_gpu(0, s.destroy_ci, 0, gi, ci)
        await gpus.call_gpu(0, s.destroy_gi, 0, gi)

    call = gpus.call_gpu_first if order == "creates-first" else gpus.call_gpu

    async def create() -> tuple[int, int, str]:
        await call(0, s.instances, gpu)
        await asyncio.sleep(gap_s)  # the Creating write and the intent record
        return await call(0, _gi_ci_uuid, s, 0, prof.id, 6, 1, None, 1, None)

    t0 = time.perf_counter()
    releases = [asyncio.create_task(release(gi, ci)) for gi, ci, _ in held]
    await asyncio.sleep(after_s)
    t1 = time.perf_counter()
    gi, ci, _ = await create()
    made = time.perf_counter() - t1
    await asyncio.gather(*releases)
    released = time.perf_counter() - t0
    ctl.set_latency(create_ms=0, destroy_ms=0)
    await gpus.call_gpu(0, s.destroy_ci, 0, gi, ci)
    await gpus.call_gpu(0, s.destroy_gi, 0, gi)
    return made, released


async def measure(
    state_dir: Path, ks: Sequence[int], rounds: int, after_s: float, gap_s: float
) -> list[dict[str, Any]]:
    provision(state_dir, "n0", ["H100-80GB"])
    ctl = EmulatorControl(state_dir, "n0")
    out: list[dict[str, Any]] = []
    async with NodeGpus(EmulatedNvml(state_dir, "n0"), load_catalog(), "n0") as gpus:
        for k in ks:
            made: dict[str, list[float]] = {o: [] for o in ORDERS}
            released: dict[str, list[float]] = {o: [] for o in ORDERS}
            for r in range(rounds):
                for order in ORDERS if r % 2 == 0 else ORDERS[::-1]:
                    m, rel = await _round(gpus, ctl, order, k, after_s, gap_s)
                    made[order].append(m)
                    released[order].append(rel)
            for order in ORDERS:
                out.append(
                    {
                        "order": order,
                        "releases": k,
                        "rounds": rounds,
                        "create_p50_s": round(statistics.median(made[order]), 3),
                        "create_max_s": round(max(made[order]), 3),
                        "releases_done_p50_s": round(statistics.median(released[order]), 3),
                    }
                )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lane_order", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--releases", default="1,2,4", help="comma-separated K")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--after-ms", type=float, default=50.0)
    ap.add_argument("--gap-ms", type=float, default=20.0)
    args = ap.parse_args(argv)
    ks = [int(x) for x in args.releases.split(",")]
    if any(k < 0 or k > 6 for k in ks):
        ap.error("--releases: each K must be 0..6 (slots 0..K-1; the create takes slot 6)")
    with tempfile.TemporaryDirectory() as tmp:
        res = asyncio.run(
            measure(Path(tmp), ks, args.rounds, args.after_ms / 1000, args.gap_ms / 1000)
        )
    for row in res:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
