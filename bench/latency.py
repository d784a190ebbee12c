"""`make bench-latency`: time-to-slice, throughput and scale on the local control plane.

Each fleet is a fresh `hack.dev.DevSystem` (etcd, kube-apiserver, scheduler, KCM, KWOK,
InstaSlice's webhook/allocator process and ONE emulated node-agent process serving every
node) of N KWOK nodes x 8 emulated H100-80GB, in `.dev/bench/latency-run/`, always torn
down. Pods ask for one `nvidia.com/mig-1g.10gb`. Every scenario runs twice: with emulated
NVML latency 0 and with a realistic setting (`--create-ms`/`--destroy-ms`, default 300/200
per GI/CI create/destroy call, so one slice costs 600 ms to make and 400 ms to destroy):

- sequential: 100 pods one after another (each waits for the previous to run), 10 nodes;
- burst: 1000 pods created at once (64 creates in flight), 100 nodes;
- churn: Poisson arrivals, each pod deleted a random lifetime after it runs, 500 nodes;
- scale: the largest fleets (1000, 2000, 5000 nodes x 8 GPUs; the largest that completes is
  the `scale` entry): startup, idle cost, then a sequential probe and a burst; allocator
  and agent CPU seconds and peak RSS;
- `--modes gates,dra`: the simple scenarios again on fleets in DRA mode (docs/dra.md), keyed
  `<scenario>-dra`, with their own static baseline; there the "agent" step ends when the
  claim is allocated and reserved (no agent round trip stands before the gate comes off);
- floor: the least time the contract's chain of writes can take on this machine, each link
  measured alone (bench/floor.py), against the static pod's create → Running, on the
  sequential scenario's fleet; once, at emulated latency 0.

Every fleet also records its idle cost (CPU share of each process with no pods) and peak
RSS, which is what "cost against fleet size" plots. Times are from the create request
being sent to the milestone being seen in a watch (bench/latency_track.py).
Writes `.dev/bench/latency.json`; `--report DIR` also writes the plots there
(bench/latency_report.py). `--quick` is the small variant `make test` runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench import floor as floor_chain
from bench.latency_fleet import GPUS_PER_NODE, NS, RUN_DIR, STATIC_NS, Fleet, machine, with_fleet
from bench.latency_profile import Profiler
from bench.latency_track import (
    Tracker,
    load,
    occupancy,
    peaks,
    r3,
    summary,
)
from common.kubeapi import Obj

OUT = Path(".dev/bench/latency.json")
SCENARIOS = ("sequential", "burst", "churn", "scale", "floor")


@dataclass(frozen=True)
class Plan:
    """Sizes of every scenario (the full run, or `--quick`)."""

    seq_nodes: int = 10
    seq_pods: int = 100
    burst_nodes: int = 100
    burst_pods: int = 1000
    churn_nodes: int = 500
    churn_s: float = 180.0
    churn_rate: float = 4.0  # arrivals per second
    churn_life_s: float = 20.0  # mean lifetime once Running (exponential)
    scale_nodes: tuple[int, ...] = (1000, 2000, 5000)
    scale_probe: int = 20
    scale_burst: int = 500
    idle_s: float = 30.0
    create_ms: int = 300
    destroy_ms: int = 200
    in_flight: int = 64
    floor_rounds: int = 40
    floor_warmup: int = 3
    shared_fleet: bool = False  # run sequential/burst/churn on one fleet (saves startups)


QUICK = Plan(
    seq_nodes=3,
    seq_pods=12,
    burst_nodes=5,
    burst_pods=30,
    churn_nodes=5,
    churn_s=15.0,
    churn_rate=2.0,
    churn_life_s=3.0,
    scale_nodes=(20,),
    scale_probe=5,
    scale_burst=50,
    idle_s=3.0,
    create_ms=100,
    destroy_ms=50,
    floor_rounds=5,
    floor_warmup=1,
    shared_fleet=True,
)
QUICK_SCENARIOS = ("sequential", "burst")


# ---- scenarios ---------------------------------------------------------------------------------


def _head(nodes: int, pods: int, create_ms: int) -> dict[str, Any]:
    return {"nodes": nodes, "gpus": nodes * GPUS_PER_NODE, "pods": pods,
            "emulated_create_ms": create_ms}  # fmt: skip


async def sequential(fleet: Fleet, pods: int, create_ms: int, timeout_s: float = 120.0) -> Obj:
    """`pods` pods one after another: each is created once the previous one runs."""
    res = _head(len(fleet.system.nodes), pods, create_ms)
    names: list[str] = []

    async def run() -> None:
        for _ in range(pods):
            name = await fleet.create()
            names.append(name)
            if not await fleet.tr.wait(fleet.tr.reached(name, "running"), timeout_s):
                return

    await fleet.measured(res, pods, run())
    await finish(fleet, res, names, one_by_one=True)
    return res


async def burst(fleet: Fleet, pods: int, create_ms: int, in_flight: int, timeout_s: float) -> Obj:
    """`pods` pods created at once (`in_flight` create requests at a time)."""
    res = _head(len(fleet.system.nodes), pods, create_ms)
    names: list[str] = []
    tr = fleet.tr
    t0 = math.nan  # set as the first create is sent

    async def run() -> None:
        nonlocal t0
        t0 = tr.clock()
        sem = asyncio.Semaphore(in_flight)
        names.extend(await asyncio.gather(*(fleet.create(sem) for _ in range(pods))))
        res["all_created_s"] = r3(tr.clock() - t0)
        if not fleet.static:  # a static pod has no gate: Running is its only milestone
            ok = await tr.wait(
                lambda: all(tr.pods[n].ungated is not None for n in names), timeout_s
            )
            ung = [u for n in names if (u := tr.pods[n].ungated) is not None]
            last = max(ung, default=math.nan)
            res["all_ungated_s"] = r3(last - t0) if ok else math.nan
            res["pods_per_s"] = r3(len(ung) / (last - t0)) if ung else 0.0
        ok = await tr.wait(lambda: all(tr.pods[n].running is not None for n in names), timeout_s)
        ran = [u for n in names if (u := tr.pods[n].running) is not None]
        res["all_running_s"] = r3(max(ran) - t0) if ok and ran else math.nan

    await fleet.measured(res, pods, run())
    res["occupancy"] = occupancy(tr, names, t0)
    await finish(fleet, res, names)
    return res


async def finish(fleet: Fleet, res: Obj, names: list[str], *, one_by_one: bool = False) -> None:
    """Summaries, then delete the pods (timing release: delete seen → allocation gone) —
    all at once, or `one_by_one` (each deleted once the previous one is released, so the
    time is one release on an otherwise idle system, as in the sequential scenario)."""
    res.update(summary(fleet.tr, names))
    res["samples"] = {"ungate_s": [r3(x) for x in fleet.tr.durations(names, "ungated")]}
    if one_by_one:
        for n in names:
            await fleet.delete(n)
            await fleet.tr.wait(fleet.tr.reached(n, "released"), 60.0)
    await release_all(fleet, names)
    rel = summary(fleet.tr, names)
    res["release_p50_s"] = rel.get("release_p50_s", math.nan)
    res["release_p99_s"] = rel.get("release_p99_s", math.nan)


async def churn(
    fleet: Fleet, seconds: float, rate: float, life_s: float, create_ms: int, seed: int = 1
) -> Obj:
    """Poisson arrivals at `rate`/s for `seconds`; each pod is deleted an exponential
    lifetime (mean `life_s`) after it runs. Latency counts pods that arrived in the window."""
    rnd = random.Random(seed)
    res = _head(len(fleet.system.nodes), 0, create_ms)
    res.update(duration_s=seconds, arrival_rate_per_s=rate, mean_life_s=life_s)
    names: list[str] = []
    tr = fleet.tr

    async def live(name: str) -> None:
        await fleet.create(sem, name)
        if await tr.wait(tr.reached(name, "running"), 120.0):
            await asyncio.sleep(rnd.expovariate(1 / life_s))
        await fleet.delete(name)

    sem = asyncio.Semaphore(32)

    async def run() -> None:
        lifetimes: list[asyncio.Task[None]] = []
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            name = fleet.next_name()
            names.append(name)
            lifetimes.append(asyncio.create_task(live(name)))
            await asyncio.sleep(rnd.expovariate(rate))
        await asyncio.gather(*lifetimes, return_exceptions=True)
        await tr.wait(lambda: all(tr.pods[n].released for n in names), 120.0)

    await fleet.measured(res, 1, run())
    res["pods"] = len(names)
    res["api"]["writes_per_pod"] = r3(res["api"]["writes"] / max(1, len(names)))
    # measured as one "pod": the totals, per pod now that the arrivals are known
    res["writes_per_pod"] = {
        k: r3(v / max(1, len(names))) for k, v in res["writes_per_pod"].items()
    }
    res["system_cpu_s_per_pod"] = r3(res["system_cpu_s"] / max(1, len(names)))
    res.update(summary(tr, names))
    res["completed"] = sum(1 for n in names if tr.pods[n].released is not None)
    res["samples"] = {"ungate_s": [r3(x) for x in tr.durations(names, "ungated")]}
    await fleet.clean()
    return res


async def release_all(fleet: Fleet, names: list[str]) -> None:
    """Delete the pods (measuring release: delete seen → allocation gone); wait for it."""
    sem = asyncio.Semaphore(64)

    async def one(n: str) -> None:
        async with sem:
            await fleet.delete(n)

    await asyncio.gather(*(one(n) for n in names))
    await fleet.tr.wait(lambda: all(fleet.tr.pods[n].released for n in names), 300.0)
    await fleet.clean()


# ---- the run ------------------------------------------------------------------------------------


@dataclass
class Bench:
    plan: Plan
    run_dir: Path
    scenarios: tuple[str, ...]
    realistic: bool = True
    quiet: bool = False
    profile: Path | None = None
    static: bool = True
    base: bool = True  # the variant at emulated NVML latency 0
    trace: Path | None = None  # per-pod milestones of each variant, one JSON line a pod
    webhook_args: tuple[str, ...] = ()  # extra flags for the webhook/allocator process
    modes: tuple[str, ...] = ("gates",)  # each on fleets of its own; dra's keyed <scenario>-dra
    agent_args: tuple[str, ...] = ()  # and for the node agent's (e.g. --warm-slices=on)

    def _profiled(self, label: str, fleet: Fleet) -> Profiler | None:
        if self.profile is None:
            return None
        prof = Profiler(self.profile)
        prof.start(label, {k: fleet.pids[k] for k in ("agent", "allocator")})
        return prof

    def log(self, msg: str) -> None:
        if not self.quiet:
            print(msg, flush=True)

    def variants(self) -> list[tuple[str, int, int]]:
        out = [("", 0, 0)] if self.base else []
        if self.realistic:
            out.append(("-realistic", self.plan.create_ms, self.plan.destroy_ms))
        if self.static:
            out.append(("-static", 0, 0))
        return out

    def _simple_nodes(self, sc: str) -> int:
        p = self.plan
        return {"sequential": p.seq_nodes, "burst": p.burst_nodes, "churn": p.churn_nodes,
                "floor": p.seq_nodes}[sc]  # fmt: skip

    def run(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"machine": machine(), "plan": _plan_json(self.plan),
                               "scenarios": {}, "fleets": {}}  # fmt: skip
        simple = [sc for sc in self.scenarios if sc != "scale"]
        for mode in self.modes:
            dra = mode == "dra"
            if self.plan.shared_fleet and simple:
                # --quick: one fleet (the largest asked for) serves every small scenario
                t0 = time.monotonic()
                self._fleet(doc, simple, max(self._simple_nodes(sc) for sc in simple), dra)
                self.log(f"{','.join(simple)} ({mode}): done in {time.monotonic() - t0:.0f}s")
            else:
                for sc in simple:
                    t0 = time.monotonic()
                    self._fleet(doc, [sc], self._simple_nodes(sc), dra)
                    self.log(f"{sc} ({mode}): done in {time.monotonic() - t0:.0f}s")
        if "scale" in self.scenarios:
            t0 = time.monotonic()
            self._scale(doc)
            self.log(f"scale: done in {time.monotonic() - t0:.0f}s")
        add_floor_ratio(doc["scenarios"])
        doc["machine"]["load_at_end"] = load()
        return doc

    def _fleet(self, doc: Obj, scenarios: list[str], nodes: int, dra: bool = False) -> None:
        fns = {"sequential": self._sequential, "burst": self._burst, "churn": self._churn}

        async def body(fleet: Fleet, rec: Obj) -> None:
            for name in scenarios:
                if name == "floor":  # once: its links are the chain's writes, not NVML's
                    self.log(f"  floor: running (load {load()})")
                    doc["scenarios"]["floor"] = res = await self._floor(fleet)
                    self.log("  floor: " + floor_chain.line(res))
                    continue
                mode = "-dra" if dra else ""
                for suffix, cms, dms in self.variants():
                    fleet.set_latency(cms, dms)
                    fleet.ns = STATIC_NS if suffix == "-static" else NS
                    key = name + mode + suffix
                    self.log(f"  {key}: running (load {load()})")
                    prof = self._profiled(key, fleet)
                    first = fleet.seq
                    try:
                        doc["scenarios"][key] = res = await fns[name](fleet, cms)
                    finally:
                        fleet.ns = NS
                        if prof is not None:
                            prof.stop()
                    if self.trace is not None:
                        write_trace(self.trace / f"{key}.jsonl", fleet.tr, first + 1, fleet.seq)
                    self.log("  " + line(key, res))
                add_ratios(doc["scenarios"], name + mode)

        doc["fleets"][f"{nodes}{'-dra' if dra else ''}"] = with_fleet(
            self.run_dir,
            nodes,
            self.plan.idle_s,
            body,
            self.log,
            static=self.static or "floor" in scenarios,  # the floor's static link
            webhook_args=self.webhook_args,
            dra=dra,
            agent_extra=self.agent_args,
        )

    async def _sequential(self, fleet: Fleet, cms: int) -> Obj:
        return await sequential(fleet, self.plan.seq_pods, cms)

    async def _burst(self, fleet: Fleet, cms: int) -> Obj:
        return await burst(fleet, self.plan.burst_pods, cms, self.plan.in_flight, 600.0)

    async def _churn(self, fleet: Fleet, cms: int) -> Obj:
        p = self.plan
        return await churn(fleet, p.churn_s, p.churn_rate, p.churn_life_s, cms)

    async def _floor(self, fleet: Fleet) -> Obj:
        fleet.set_latency(0, 0)
        out: Obj = {}
        await floor_chain.run(fleet, out, self.plan.floor_rounds, self.plan.floor_warmup)
        return out

    def _scale(self, doc: Obj) -> Obj:
        p = self.plan
        best: Obj = {}
        for nodes in p.scale_nodes:
            key = f"scale-{nodes}"

            async def body(fleet: Fleet, rec: Obj, key: str = key) -> None:
                out: Obj = {}
                s = fleet.sampler()
                s.start()
                prof = self._profiled(key, fleet)
                out["probe"] = await sequential(fleet, p.scale_probe, 0)
                self.log("  " + line(f"{key} probe", out["probe"]))
                out["burst"] = await burst(fleet, p.scale_burst, 0, p.in_flight, 900.0)
                self.log("  " + line(f"{key} burst", out["burst"]))
                out["processes"] = s.stop()
                if prof is not None:
                    prof.stop()
                doc["scenarios"][key] = out

            try:
                rec = with_fleet(
                    self.run_dir,
                    nodes,
                    p.idle_s,
                    body,
                    self.log,
                    webhook_args=self.webhook_args,
                    agent_extra=self.agent_args,
                )
            except Exception as exc:  # the largest fleet may not fit: record why, keep going
                self.log(f"  {key}: FAILED: {exc!r}")
                doc["scenarios"][key] = {"nodes": nodes, "error": repr(exc)}
                continue
            doc["fleets"][str(nodes)] = rec
            sc = doc["scenarios"][key]
            procs = sc["processes"]
            best = {
                **_head(nodes, p.scale_probe + p.scale_burst, 0),
                "ungate_p50_s": sc["burst"]["ungate_p50_s"],
                "ungate_p99_s": sc["burst"]["ungate_p99_s"],
                "probe_ungate_p50_s": sc["probe"]["ungate_p50_s"],
                "probe_ungate_p99_s": sc["probe"]["ungate_p99_s"],
                "burst_all_ungated_s": sc["burst"]["all_ungated_s"],
                "startup_s": rec["startup_s"],
                "allocator_rss_mb": procs["allocator"]["peak_rss_mb"],
                "allocator_cpu_s": procs["allocator"]["cpu_s"],
                "agent_rss_mb": procs["agent"]["peak_rss_mb"],
                "agent_cpu_s": procs["agent"]["cpu_s"],
                "allocator_idle_cpu_share": rec["idle"]["allocator"]["cpu_share"],
                "agent_idle_cpu_share": rec["idle"]["agent"]["cpu_share"],
            }
            doc["scenarios"]["scale"] = best
        return best


def write_trace(path: Path, tr: Tracker, first: int, last: int) -> None:
    """Each pod `p<first>`..`p<last>`: its node and every milestone, in seconds after its
    create was sent (None: not reached), one JSON object a line: the tail's pods can be
    looked at one by one (which node, which step)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    steps = ("admitted", "allocated", "ready", "ungated", "bound", "running", "deleted", "released")
    with path.open("w") as f:
        for i in range(first, last + 1):
            t = tr.pods.get(f"p{i:05d}")
            if t is None:
                continue
            row: Obj = {"pod": f"p{i:05d}", "node": t.node, "sent": r3(t.sent)}
            row.update({k: None if t.since(k) is None else r3(t.since(k) or 0.0) for k in steps})
            f.write(json.dumps(row) + "\n")


RATIO_FIELDS = ("running_p50_s", "running_p99_s", "all_running_s", "system_cpu_s_per_pod")


def add_ratios(scenarios: Obj, name: str) -> None:
    """`ratio_to_static` of each InstaSlice variant of scenario `name`: its value over the
    static baseline's (the same fleet, pods asking pre-sliced capacity), per field."""
    static = scenarios.get(f"{name}-static")
    if static is None:
        return
    for key in (name, f"{name}-realistic"):
        res = scenarios.get(key)
        if res is None:
            continue
        ratios = {}
        for f in RATIO_FIELDS:
            ours, base = res.get(f), static.get(f)
            if isinstance(ours, int | float) and isinstance(base, int | float) and base > 0:
                ratios[f] = r3(ours / base)
        res["ratio_to_static"] = ratios


def add_floor_ratio(scenarios: Obj) -> None:
    """`ratio_to_floor` of the sequential scenarios: Running p50 over the contract chain's
    floor measured in the same run (issue 37's target: at most 1.25 at NVML 0 ms)."""
    floor_ms = (scenarios.get("floor", {}).get("chain") or {}).get("floor_ms")
    if not isinstance(floor_ms, int | float) or not floor_ms > 0:
        return
    for key in ("sequential", "sequential-realistic"):
        p50 = scenarios.get(key, {}).get("running_p50_s")
        if isinstance(p50, int | float) and math.isfinite(p50):
            scenarios[key]["ratio_to_floor"] = r3(p50 * 1000 / floor_ms)


def line(key: str, r: Obj) -> str:
    parts = [f"{key}: {r.get('ungated', 0)}/{r.get('pods', 0)} ungated",
             f"ungate p50 {r.get('ungate_p50_s', math.nan):.2f}s "
             f"p99 {r.get('ungate_p99_s', math.nan):.2f}s",
             f"running p50 {r.get('running_p50_s', math.nan):.2f}s"]  # fmt: skip
    if "all_ungated_s" in r:
        parts.append(f"all ungated {r['all_ungated_s']:.1f}s ({r['pods_per_s']:.1f} pods/s)")
    if "all_running_s" in r:
        parts.append(f"all running {r['all_running_s']:.1f}s")
    if "system_cpu_s_per_pod" in r:
        parts.append(f"system CPU {r['system_cpu_s_per_pod']:.3f} s/pod")
    if "ratio_to_static" in r:
        parts.append("vs static " + ", ".join(f"{k} x{v}" for k, v in r["ratio_to_static"].items()))
    if "occupancy" in r:
        parts.append("deepest queues " + peaks(r["occupancy"]))
    steps = [k.removesuffix("_p50_s") for k in r if k.endswith("_p50_s")]
    brk = ", ".join(f"{k} {r[k + '_p50_s']:.3f}" for k in steps if k not in ("ungate", "running"))
    return "; ".join(parts) + f"  [p50 steps: {brk}]"


def _plan_json(p: Plan) -> Obj:
    d = dict(p.__dict__)
    d["scale_nodes"] = list(p.scale_nodes)
    return d


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.latency", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="small sizes (make test runs this)")
    ap.add_argument(
        "--scenarios",
        default=None,
        help=f"comma-separated subset of {','.join(SCENARIOS)} "
        f"(default: all; with --quick: {','.join(QUICK_SCENARIOS)})",
    )
    ap.add_argument("--scale-nodes", default=None, help="fleet sizes for scale, e.g. 1000,2000")
    ap.add_argument("--no-realistic", action="store_true", help="only emulated latency 0")
    ap.add_argument(
        "--no-static",
        action="store_true",
        help="skip the static baseline (pre-sliced nvidia.com/mig-* capacity, no InstaSlice)",
    )
    ap.add_argument(
        "--only-realistic",
        action="store_true",
        help="skip the variant at emulated latency 0 (realistic and static only)",
    )
    ap.add_argument("--create-ms", type=int, default=None)
    ap.add_argument("--destroy-ms", type=int, default=None)
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a size of the plan, e.g. --set seq_pods=30 (see Plan)",
    )
    ap.add_argument(
        "--webhook-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="pass ARG to the webhook/allocator process, e.g. --webhook-arg=--policy=spread",
    )
    ap.add_argument(
        "--modes",
        default="gates",
        help="comma-separated allocation modes to run, each on its own fleets: gates, dra "
        "(docs/dra.md); a DRA fleet's results are keyed <scenario>-dra",
    )
    ap.add_argument(
        "--agent-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="pass ARG to the node agent, e.g. --agent-arg=--warm-slices=on",
    )
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--dir", type=Path, default=RUN_DIR, help="where the system runs")
    ap.add_argument("--report", type=Path, default=None, help="write plots into this dir")
    ap.add_argument("--profile", type=Path, default=None, help="py-spy raw stacks into DIR")
    ap.add_argument(
        "--trace", type=Path, default=None, help="per-pod milestones into DIR/<scenario>.jsonl"
    )
    args = ap.parse_args(argv)
    plan = QUICK if args.quick else Plan()
    if args.scale_nodes:
        plan = replace(plan, scale_nodes=tuple(int(x) for x in args.scale_nodes.split(",")))
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in Plan.__dataclass_fields__:
            ap.error(f"--set: no plan field {key!r}")
        current = getattr(plan, key)
        if isinstance(current, tuple):
            new: Any = tuple(int(x) for x in value.split(","))
        else:
            new = type(current)(value)
        plan = replace(plan, **{key: new})
    if args.create_ms is not None:
        plan = replace(plan, create_ms=args.create_ms)
    if args.destroy_ms is not None:
        plan = replace(plan, destroy_ms=args.destroy_ms)
    chosen = args.scenarios or ",".join(QUICK_SCENARIOS if args.quick else SCENARIOS)
    scenarios = tuple(s.strip() for s in chosen.split(",") if s.strip())
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if not modes or set(modes) - {"gates", "dra"}:
        ap.error(f"--modes: {args.modes!r}; known: gates, dra")
    if args.only_realistic and args.no_realistic:
        ap.error("--only-realistic and --no-realistic leave no InstaSlice variant")
    bench = Bench(
        plan,
        args.dir,
        scenarios,
        realistic=not args.no_realistic,
        profile=args.profile,
        static=not args.no_static,
        base=not args.only_realistic,
        trace=args.trace,
        webhook_args=tuple(args.webhook_arg),
        modes=modes,
        agent_args=tuple(args.agent_arg),
    )
    # SIGTERM (and SIGINT, which background shells ignore) unwind through the `finally`s,
    # so the fleet is torn down; children die with this process anyway (PDEATHSIG)
    before = {sig: signal.signal(sig, _exit_on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        doc = bench.run()
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")
    if args.report is not None:
        from bench.latency_report import plots

        for path in plots(doc, args.report):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
