"""The node agent's create phases from its log: p50, p90 and mean of each `steps` phase and
each `took` entry of its "slices ready" lines (nodeagent/lifecycle.py), in ms.

`steps` are the phases of a create in order (intent: the `Creating` write beside the intent
record; nvml; cdi; ready: the `Ready` write); `took` is how long each write and record took
on its own, so a phase can be told apart from the write inside it.

    python -m bench.agent_took .dev/bench/latency-run/logs/nodeagent.log [--json]

The log of a `bench.latency` run is `<--dir>/logs/nodeagent.log` (overwritten by the next run).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _q(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def summary(lines: Sequence[str]) -> dict[str, Any]:
    """`name` → {n, p50, p90, mean} (ms) over the "slices ready" lines; `creates`: how many."""
    series: dict[str, list[float]] = {}
    creates = 0
    for line in lines:
        if '"slices ready"' not in line:
            continue
        doc = json.loads(line)
        creates += 1
        series.setdefault("total", []).append(float(doc["ms"]))
        for group in ("steps", "took"):
            for k, v in (doc.get(group) or {}).items():
                series.setdefault(f"{group}.{k}", []).append(float(v))
    out: dict[str, Any] = {"creates": creates}
    for k, xs in sorted(series.items()):
        out[k] = {
            "n": len(xs),
            "p50": round(statistics.median(xs), 1),
            "p90": round(_q(xs, 0.9), 1),
            "mean": round(statistics.fmean(xs), 1),
        }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.agent_took", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("log", type=Path)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    res = summary(args.log.read_text().splitlines())
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    print(f"{res['creates']} creates (ms)")
    for k, v in res.items():
        if k != "creates":
            n, p50, p90, mean = v["n"], v["p50"], v["p90"], v["mean"]
            print(f"{k:22s} n={n:4d} p50={p50:7.1f} p90={p90:7.1f} mean={mean:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
