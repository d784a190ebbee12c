"""Where the sequential path's time goes, seen from the API server (issue 25).

One fleet (`bench.latency`'s), N pods one after another on each path (InstaSlice, then
static), and for each: the API server's mean latency per request kind
(`apiserver_request_duration_seconds`), the size of the largest object of each kind the
InstaSlice path writes, and with `--pprof DIR` a Go CPU profile of the API server over the
first seconds of each path (`go tool pprof -top DIR/apiserver-instaslice.pprof`).

    python -m bench.latency_probe --pods 60 --pprof DIR --out FILE

A tool for finding what to shorten, not part of `make bench-latency`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import latency as bl
from bench.latency_track import load, summary
from common.kubeapi import ApiError, core_path, instaslice_path
from hack.cluster.controlplane import ClusterSettings

_DURATION = re.compile(r"^(apiserver_request_duration_seconds)_(sum|count)\{([^}]*)\} (\S+)$")
# the API server's admission, by webhook and by step (admit = mutating, validate), and the
# webhook's own handler time as it measures it (instaslice_webhook_review_seconds)
_ADMISSION = re.compile(
    r"^(apiserver_admission_webhook_admission_duration_seconds|"
    r"apiserver_admission_step_admission_duration_seconds|"
    r"instaslice_webhook_review_seconds)_(sum|count)\{([^}]*)\} (\S+)$"
)
_LABEL = re.compile(r'(\w+)="([^"]*)"')
PROFILE_S = 8
Sums = dict[str, tuple[float, float]]


def _sums(
    metrics_text: str, line_re: re.Pattern[str], key: Callable[[str, dict[str, str]], str | None]
) -> Sums:
    """`key(metric, labels)` → (seconds in total, count) of the histograms `line_re` matches;
    lines whose key is None are left out."""
    out: Sums = {}
    for line in metrics_text.splitlines():
        m = line_re.match(line)
        if not m or (k := key(m.group(1), dict(_LABEL.findall(m.group(3))))) is None:
            continue
        total, count = out.get(k, (0.0, 0.0))
        if m.group(2) == "sum":
            total += float(m.group(4))
        else:
            count += float(m.group(4))
        out[k] = (total, count)
    return out


def _request_key(metric: str, labels: dict[str, str]) -> str | None:
    if labels.get("verb") in ("WATCH", "CONNECT"):
        return None
    key = f"{labels.get('verb')} {labels.get('resource')}"
    return key + "/" + labels["subresource"] if labels.get("subresource") else key


def _admission_key(metric: str, labels: dict[str, str]) -> str | None:
    if labels.get("operation", "CREATE") != "CREATE":
        return None
    if metric.startswith("instaslice"):
        return "handler"
    if "webhook" in metric:
        return f"webhook {labels.get('name')}"
    return f"step {labels.get('type')}"


def request_seconds(metrics_text: str) -> Sums:
    """`VERB resource[/subresource]` → (seconds in total, requests), watches left out."""
    return _sums(metrics_text, _DURATION, _request_key)


def admission_seconds(metrics_text: str) -> Sums:
    """`webhook NAME` / `step TYPE` / `handler` → (seconds in total, calls), pod CREATEs."""
    return _sums(metrics_text, _ADMISSION, _admission_key)


def latency_delta(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, dict[str, float]]:
    """Per request kind between two scrapes: how many, and their mean latency in ms."""
    res: dict[str, dict[str, float]] = {}
    for key, (total, count) in after.items():
        t0, c0 = before.get(key, (0.0, 0.0))
        if count > c0:
            res[key] = {
                "n": int(count - c0),
                "mean_ms": round((total - t0) / (count - c0) * 1e3, 2),
            }
    return dict(sorted(res.items(), key=lambda kv: -kv[1]["n"]))


async def scrape(fleet: bl.Fleet) -> dict[str, tuple[float, float]]:
    proc = await asyncio.to_thread(fleet.system.cp.kubectl, "get", "--raw", "/metrics", check=False)
    return {**request_seconds(proc.stdout), **admission_seconds(proc.stdout)}


async def scrape_webhook(fleet: bl.Fleet) -> dict[str, tuple[float, float]]:
    url = f"http://127.0.0.1:{fleet.system.metrics_port}/metrics"

    def get() -> str:
        with urllib.request.urlopen(url, timeout=5) as r:
            return str(r.read().decode())

    return admission_seconds(await asyncio.to_thread(get))


async def _one_by_one(fleet: bl.Fleet, pods: int, names: list[str]) -> None:
    for _ in range(pods):
        name = await fleet.create()
        names.append(name)
        await fleet.tr.wait(fleet.tr.reached(name, "running"), 60.0)


async def probe(fleet: bl.Fleet, out: dict[str, Any], pods: int, pprof: Path | None) -> None:
    for ns, key in ((bl.NS, "instaslice"), (bl.STATIC_NS, "static")):
        fleet.ns = ns
        before = {**await scrape(fleet), **await scrape_webhook(fleet)}
        profiler = None
        if pprof is not None:
            profiler = await asyncio.create_subprocess_exec(
                str(fleet.system.cp.kubectl_path),
                f"--kubeconfig={fleet.system.kubeconfig}",
                "get",
                "--raw",
                f"/debug/pprof/profile?seconds={PROFILE_S}",
                stdout=asyncio.subprocess.PIPE,
            )
        res: dict[str, Any] = {}
        names: list[str] = []
        await fleet.measured(res, pods, _one_by_one(fleet, pods, names))
        if profiler is not None and pprof is not None:
            data, _ = await profiler.communicate()
            (pprof / f"apiserver-{key}.pprof").write_bytes(data)
        after = {**await scrape(fleet), **await scrape_webhook(fleet)}
        res["apiserver_latency"] = latency_delta(before, after)
        res.update(summary(fleet.tr, names))
        if ns == bl.NS:  # the largest object of each kind this path writes
            for what, path in (
                ("mignode", instaslice_path("mignodes")),
                ("sliceallocation", instaslice_path("sliceallocations", ns)),
                ("pod", core_path("pods", ns)),
            ):
                items = (await fleet.kube.list(path)).get("items") or [{}]
                res[f"{what}_bytes"] = max(len(json.dumps(o)) for o in items)
        out[key] = res
        print(key, json.dumps({k: v for k, v in res.items() if k != "apiserver_latency"}))
        for kind, v in res["apiserver_latency"].items():
            print(f"   {kind:40s} n={v['n']:4d} mean {v['mean_ms']:7.2f} ms")
        for attempt in range(3):  # a delete of 60 pods can time out on a loaded machine
            try:
                await fleet.clean()
                break
            except ApiError as exc:
                if not exc.retryable or attempt == 2:
                    raise
    fleet.ns = bl.NS


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.latency_probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--pods", type=int, default=60)
    ap.add_argument("--nodes", type=int, default=10)
    ap.add_argument("--pprof", type=Path, default=None, help="API server CPU profiles into DIR")
    ap.add_argument("--dir", type=Path, default=Path(".dev/bench/probe-run"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    pprof: Path | None = args.pprof
    extra = ("--profiling=true",) if pprof is not None else ()
    if pprof is not None:
        pprof.mkdir(parents=True, exist_ok=True)
    # the fleet's control plane, with the API server's profiling endpoint when asked for
    bl.cluster_settings = lambda nodes: ClusterSettings(extra_apiserver_args=extra)
    out: dict[str, Any] = {"load_start": load()}

    async def body(fleet: bl.Fleet, rec: dict[str, Any]) -> None:
        await probe(fleet, out, args.pods, pprof)

    t0 = time.monotonic()
    bl.with_fleet(args.dir, args.nodes, 3.0, body, print, static=True)
    out.update(load_end=load(), wall_s=round(time.monotonic() - t0, 1))
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
