"""`python -m bench.agent_settle [--nodes 1000] [--windows 8] [--window-s 30]`: what a fleet
writes to the API server once it is up and idle (no pods), window by window.

A fresh fleet as `bench.latency` brings up for `scale` (the same control plane settings,
KWOK nodes, one emulated node-agent process serving every node, the same agent flags), then
`--windows` windows of `--window-s` seconds with nothing asked of it. Per window: the API
server's mutating requests by kind (its /metrics), each process's CPU share, and the node
agent's log lines per message. A settled agent writes its MigNode status and Node capacity on
change only (docs/contract.md §3): once the startup wave is through, `PATCH mignodes/status`
should be near zero and `PATCH leases` near nodes / (lease duration / 4) per second.
Writes `.dev/bench/agent_settle.json` (or `--out`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.latency import RUN_DIR, agent_args, lease_s, with_fleet
from bench.latency_track import api_writes, load, r3

OUT = Path(".dev/bench/agent_settle.json")
Obj = dict[str, Any]


class LogTail:
    """Lines appended to a JSON-lines log since the last read, counted by message."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def read(self) -> Counter[str]:
        out: Counter[str] = Counter()
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a half-written last line waits for the next read
        self.offset += end
        for raw in data[:end].splitlines():
            try:
                rec = json.loads(raw)
            except ValueError:
                out["(not JSON)"] += 1
                continue
            out[str(rec.get("event", "?"))] += 1
        return out


async def windows(fleet: Any, rec: Obj, count: int, seconds: float, log: Any) -> None:
    tail = LogTail(Path(fleet.system.processes["nodeagent"].log))
    rec["agent_log_startup"] = dict(tail.read().most_common())
    # every write since the control plane started: the fleet's setup and the agent's startup
    rec["writes_through_startup"] = dict(api_writes(await fleet.api_metrics()).most_common())
    rec["windows"] = []
    for i in range(count):
        before = api_writes(await fleet.api_metrics())
        tail.read()
        sampler = fleet.sampler()
        sampler.start()
        await asyncio.sleep(seconds)
        procs = sampler.stop()
        writes = api_writes(await fleet.api_metrics()) - before
        lines = tail.read()
        w = {
            "window": i,
            "seconds": seconds,
            "load": load(),
            "writes": dict(writes.most_common()),
            "cpu_share": {k: p["cpu_share"] for k, p in procs.items()},
            "agent_log": dict(lines.most_common()),
        }
        rec["windows"].append(w)
        top = ", ".join(f"{k} {v}" for k, v in writes.most_common(5))
        log(
            f"  window {i}: {top}; agent CPU {procs['agent']['cpu_share']:.2f}, "
            f"apiserver {procs['kube-apiserver']['cpu_share']:.2f}; "
            f"agent log {dict(lines.most_common(3))}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.agent_settle", description=__doc__)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--window-s", type=float, default=30.0)
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, flush=True)

    t0 = time.monotonic()

    async def body(fleet: Any, rec: Obj) -> None:
        await windows(fleet, rec, a.windows, a.window_s, log)

    rec = with_fleet(RUN_DIR, a.nodes, 1.0, body, log)
    rec["lease_s"] = lease_s(a.nodes)
    rec["agent_args"] = agent_args(a.nodes)
    rec["wall_s"] = r3(time.monotonic() - t0)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(rec, indent=1))
    log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
