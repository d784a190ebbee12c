"""What one MigNode GPU entry costs the allocator that first meets it: time and memory.

A node agent publishes its GPUs' profile tables (docs/contract.md §3); the allocator plans a
table that differs from the catalog's with tables built from it (docs/placement.md, geometry
per GPU), whose size doubles with every memory slot. This replays what the allocator does
with one published GPU — parse it (`views.gpus_of`, with the bounds check of
docs/security.md) and build the tables its first decision there asks for (`CatalogTables.tables`,
every profile's `free_spots`, a 1g.10gb's `single_table`) — for a
table whose highest placement starts at `--start` (an H100 table plus one 1-slot placement
there), each in a fresh process so no cache or allocation of one row helps the next.

    python -m bench.table_build --start 12 16 20

`--start worst` (-1) stands for the costliest table the bounds allow (`worst_node`).

One JSON line per start: `seconds` (wall time, parse and build), `peak_mib` (tracemalloc's
peak over the same work, measured in a second run: tracing slows it) and `refused` (the
bounds check's reason, or null). Run from another checkout (`cd OLD && python -m
bench.table_build`) to measure that code.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import tracemalloc
from typing import Any

from common.catalog import load_catalog, model_to_json
from common.catalog.learned import Geometries
from common.placement.geometry import token
from common.placement.search import catalog_tables
from common.placement.tables import FitMode, free_spots, single_table
from webhook.allocator.views import gpus_of


def mig_node(start: int) -> dict[str, Any]:
    """A MigNode with one H100-80GB whose 1g.10gb also lists a placement at `start`."""
    h100 = model_to_json(load_catalog().model("H100-80GB"))  # type: ignore[arg-type]
    profiles = []
    for p in h100["profiles"]:
        placements = [{"start": s, "size": p["memorySlots"]} for s in p["starts"]]
        if p["name"] == "1g.10gb":
            placements.append({"start": start, "size": 1})
        profiles.append(
            {
                "name": p["name"],
                "id": p["id"],
                "memoryMiB": p["memoryMiB"],
                "multiprocessors": p["multiprocessors"],
                "maxCount": p["maxCount"],
                "placements": placements,
            }
        )
    gpu = {
        "index": 0,
        "uuid": "GPU-bench",
        "model": "H100-80GB",
        "migMode": {"current": "enabled", "pending": "enabled"},
        "healthy": True,
        "profiles": profiles,
        "slices": [],
    }
    return {"metadata": {"name": "bench"}, "status": {"gpus": [gpu]}}


WORST = -1


def worst_node() -> dict[str, Any]:
    """The H100 MigNode with the costliest table within the bounds (MIG_MAX_*): 16 slots,
    32 profiles, four shapes of 16 + 15 + 15 + 14 = 60 placements (at most 64), each listed
    by eight profiles (variants share a shape)."""
    node = mig_node(0)
    gpu = node["status"]["gpus"][0]
    gpu["model"] = "worst"
    shapes = [(1, range(16)), (2, range(15)), (1, range(1, 16)), (2, range(1, 15))]
    gpu["profiles"] = [
        {
            "name": f"{size}g.{i}gb",
            "id": i,
            "memoryMiB": 1000 * size,
            "multiprocessors": 10,
            "maxCount": 16,
            "placements": [{"start": s, "size": size} for s in starts],
        }
        for i in range(32)
        for size, starts in [shapes[i % 4]]
    ]
    return node


def meet(start: int) -> str | None:
    """Parse the GPU and build what placement would ask for; the refusal, if any."""
    node = worst_node() if start == WORST else mig_node(start)
    views = gpus_of(node, Geometries(load_catalog()))
    ct = catalog_tables(None)
    for g in views:
        t = ct.tables(token(g.geometry)) if g.geometry is not None else None
        if t is not None:  # what the first decision on the GPU asks: its room, a 1g's spot
            for name in t.profiles:
                free_spots(t, name)
            single_table(t, next(iter(t.profiles)) if start == WORST else "1g.10gb", FitMode.BEST)
    return getattr(views[0], "refused", None) or None


def one(start: int, trace: bool) -> dict[str, Any]:
    if trace:
        tracemalloc.start()
        meet(start)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return {"peak_mib": round(peak / 2**20, 1)}
    t0 = time.perf_counter()
    refused = meet(start)
    return {"seconds": round(time.perf_counter() - t0, 4), "refused": refused}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--start", type=lambda v: WORST if v == "worst" else int(v), nargs="+", default=[12, 16, 20]
    )
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--trace", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.one, args.trace)))
        return
    for start in args.start:
        row: dict[str, Any] = {"start": start}
        for trace in (False, True):
            cmd = [sys.executable, "-m", "bench.table_build", "--one", str(start)]
            out = subprocess.run(
                cmd + (["--trace"] if trace else []), check=True, capture_output=True, text=True
            )
            row.update(json.loads(out.stdout))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
