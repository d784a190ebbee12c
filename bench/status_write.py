"""Where a node agent's SliceAllocation status write spends its time (issue 25).

The agent's `Creating` and `Ready` writes (`nodeagent.writes.patch_alloc_status`) seemed to
take it 18-27 ms in the sequential scenario against 7-8 ms for the same request from the floor's
client (bench/floor.py). This runs the agent's own write function from this process, on the
same fleet and control plane as `bench.latency` (InstaSlice up, idle), in blocks of `--writes`
sequential writes, the variants taking turns so the machine's drift touches all alike:

- `quiet`: the write alone, nothing else in the process;
- `thread`: beside pure-Python work on a worker thread started with it (what the agent runs
  beside its writes: the emulated NVML scan, the checkpoint's JSON), `--thread-ms` of it;
- `loop`: beside coroutines on the event loop doing 1 ms of work at a time (other nodes'
  publishing, informer events), for the write's whole duration;
- `raw`: the same PATCH sent with the aiohttp session directly, skipping kubernetes_asyncio
  (its per-call work: header and body sanitising, auth hooks, the response wrapper);
- `server`: the API server's own mean for `PATCH sliceallocations/status` in each block
  (`apiserver_request_duration_seconds`), beside the client-side p50 and mean.

Also the process CPU per write of each variant (`quiet` and `raw`: the client's own cost).

    python -m bench.status_write --rounds 6 --writes 20 --out FILE

A tool for finding where the time goes, not part of `make bench-latency`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Any

from bench import latency as bl
from bench.floor import PLAIN_NS, alloc_body
from bench.latency_probe import latency_delta, scrape
from bench.latency_track import load
from common.kubeapi import Kube, core_path, instaslice_path
from nodeagent import writes
from nodeagent.report import condition, status_creating, status_ready

Obj = dict[str, Any]
KEY = "PATCH sliceallocations/status"
VARIANTS = ("quiet", "thread", "loop", "raw")


def bodies(i: int) -> Obj:
    """The agent's two bodies, in turn: `Creating`, then `Ready` as lifecycle.ready sends it."""
    if i % 2 == 0:
        return status_creating("")
    now = "2026-12-02T00:00:00Z"
    conds = [
        condition("Ready", True, "SlicesCreated", "main: MIG-x", now),
        condition("GPUHealthy", True, "Healthy", "", now),
    ]
    slices: Any = [{"container": "main", "migUUID": f"MIG-{i}", "giID": 1, "ciID": 0}]
    return status_ready(slices, "boot", conds)


def burn(ms: float) -> None:
    """Pure-Python work holding the interpreter lock for about `ms`."""
    end = time.perf_counter() + ms / 1000
    x = 0
    while time.perf_counter() < end:
        x += sum(range(200))


class Raw:
    """The same PATCH through the aiohttp session kubernetes_asyncio opened (its TLS, its
    pool), without the library's per-call work."""

    def __init__(self, kube: Kube) -> None:
        api = kube._api  # a measuring tool: the library's own session
        self.session = api.rest_client.pool_manager
        self.host = str(api.configuration.host)
        self.headers = {
            "Content-Type": "application/merge-patch+json",
            "Accept": "application/json",
        }
        token = api.configuration.api_key.get("authorization") or api.configuration.api_key.get(
            "BearerToken"
        )
        if token:
            self.headers["Authorization"] = token

    async def patch(self, path: str, body: Obj) -> None:
        async with self.session.patch(
            self.host + path, data=json.dumps(body), headers=self.headers
        ) as resp:
            await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"{resp.status}")


async def timed(aw: Awaitable[Any]) -> float:
    t0 = time.perf_counter()
    await aw
    return (time.perf_counter() - t0) * 1000


async def one(variant: str, kube: Kube, raw: Raw, name: str, i: int, thread_ms: float) -> float:
    body = bodies(i)
    if variant == "raw":
        return await timed(
            raw.patch(instaslice_path("sliceallocations", PLAIN_NS, name) + "/status", body)
        )
    write = writes.patch_alloc_status(kube, PLAIN_NS, name, body)
    if variant == "quiet":
        return await timed(write)
    if variant == "thread":
        t = threading.Thread(target=burn, args=(thread_ms,))
        t0 = time.perf_counter()
        task = asyncio.ensure_future(write)  # the write first, as lifecycle._both starts it
        await asyncio.sleep(0)
        t.start()
        await task
        ms = (time.perf_counter() - t0) * 1000
        await asyncio.to_thread(t.join)
        return ms
    stop = asyncio.Event()

    async def busy() -> None:
        while not stop.is_set():
            burn(1.0)
            await asyncio.sleep(0)

    workers = [asyncio.create_task(busy()) for _ in range(3)]
    try:
        return await timed(write)
    finally:
        stop.set()
        await asyncio.gather(*workers)


def _stats(xs: list[float]) -> Obj:
    s = sorted(xs)
    return {
        "n": len(s),
        "p50_ms": round(statistics.median(s), 2),
        "p90_ms": round(s[int(0.9 * (len(s) - 1))], 2),
        "mean_ms": round(statistics.fmean(s), 2),
    }


async def run(fleet: bl.Fleet, out: Obj, rounds: int, per_block: int, thread_ms: float) -> None:
    kube = fleet.kube
    await kube.create(core_path("namespaces"), {"metadata": {"name": PLAIN_NS}})
    name = "status-write"
    await kube.create(instaslice_path("sliceallocations", PLAIN_NS), alloc_body(name))
    raw = Raw(kube)
    for i in range(10):  # warm: connections open, the CR's storage up
        await one("quiet", kube, raw, name, i, thread_ms)
    client: dict[str, list[float]] = {v: [] for v in VARIANTS}
    server: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
        for v in order:
            before = await scrape(fleet)
            c0 = time.process_time()
            for i in range(per_block):
                client[v].append(await one(v, kube, raw, name, i, thread_ms))
            cpu[v].append((time.process_time() - c0) * 1000 / per_block)
            d = latency_delta(before, await scrape(fleet)).get(KEY)
            if d:
                server[v].append(d["mean_ms"])
    out["variants"] = {
        v: {
            "client": _stats(client[v]),
            "server_mean_ms": round(statistics.fmean(server[v]), 2) if server[v] else None,
            "process_cpu_ms_per_write": round(statistics.fmean(cpu[v]), 2),
        }
        for v in VARIANTS
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.status_write", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--writes", type=int, default=20, help="writes per block")
    ap.add_argument("--thread-ms", type=float, default=15.0)
    ap.add_argument("--nodes", type=int, default=10)
    ap.add_argument("--dir", type=Path, default=Path(".dev/bench/status-write-run"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    out: Obj = {"load_start": load(), "thread_ms": args.thread_ms}

    async def body(fleet: bl.Fleet, rec: Obj) -> None:
        await run(fleet, out, args.rounds, args.writes, args.thread_ms)

    bl.with_fleet(args.dir, args.nodes, 3.0, body, print)
    out["load_end"] = load()
    print(json.dumps(out, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
