"""`make demo`: InstaSlice on a laptop, no GPU needed.

Brings up the local control plane with a heterogeneous fleet of KWOK GPU nodes (H100-80GB,
H200-141GB, A100-40GB; hack/specs/demo.yaml) backed by the NVML emulator, opts a namespace
in (to whole GPUs too), and submits a mixed workload: Jobs of several MIG sizes with
realistic run times, a Job of whole-GPU pods (`nvidia.com/gpu: 1`), a multi-container pod, a
request nothing can satisfy (and one the webhook refuses), and a burst of small inference
pods. One node's GPUs start with MIG off; the demo shows how their modes change as the
workload asks (MIG on demand; a whole GPU keeps MIG off). It shows live progress, then
prints the slice map at the busiest moment, time-to-slice p50/p99 (pod seen → gate removed →
Running), memory-slot utilisation over time (also `<dir>/utilization.png`), and every
pending reason seen. Tears everything down unless `--keep` (or DEMO_KEEP=1).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.constants import ENABLED_KEY, GATE_NAME, REASON_PENDING, WHOLE_GPU_KEY
from common.kubeapi import ApiError, Informer, Kube, Obj, core_path, group_path, instaslice_path
from common.kubectl_plugin import render_nodes, render_pods
from hack.cluster.nodes import load_spec
from hack.dev import REPO, DevSystem

NS = "demo"
BURST = 24


def job(name: str, profile: str, *, parallelism: int, completions: int, runtime_s: int) -> Obj:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "parallelism": parallelism,
            "completions": completions,
            "backoffLimit": 0,
            "template": {
                "metadata": {
                    "annotations": {"pod-complete.stage.kwok.x-k8s.io/delay": f"{runtime_s}s"}
                },
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [_container("main", {profile: 1})],
                },
            },
        },
    }


def _container(name: str, slices: dict[str, int], cpu: str = "1", mem: str = "4Gi") -> Obj:
    limits: dict[str, Any] = {f"nvidia.com/mig-{p.replace('+', '.')}": n for p, n in slices.items()}
    limits.update(cpu=cpu, memory=mem)
    return {
        "name": name,
        "image": "nvcr.io/nvidia/pytorch:25.01-py3",
        "resources": {"limits": limits},
    }


def pod(name: str, containers: list[Obj]) -> Obj:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": containers}}  # fmt: skip


@dataclass
class Tracker:
    """Watches the demo's pods and InstaSlice's allocations; samples utilisation."""

    total_slots: int
    seen: dict[str, float] = field(default_factory=dict)
    ungated: dict[str, float] = field(default_factory=dict)
    running: dict[str, float] = field(default_factory=dict)
    phases: dict[str, str] = field(default_factory=dict)
    allocs: dict[str, Obj] = field(default_factory=dict)
    samples: list[tuple[float, float, dict[str, float]]] = field(default_factory=list)
    peak: tuple[float, list[Obj]] = (-1.0, [])
    t0: float = field(default_factory=time.monotonic)

    async def on_pod(self, etype: str, p: Obj) -> None:
        name = p["metadata"]["name"]
        now = time.monotonic() - self.t0
        self.seen.setdefault(name, now)
        if etype == "DELETED":
            self.phases[name] = "Deleted"
            return
        gates = [g["name"] for g in p["spec"].get("schedulingGates", [])]
        if (
            GATE_NAME not in gates
            and name not in self.ungated
            and "instaslice.io/claim" in (p["metadata"].get("annotations") or {})
        ):
            self.ungated[name] = now
        phase = p.get("status", {}).get("phase", "Pending")
        if phase == "Running":
            self.running.setdefault(name, now)
        self.phases[name] = "Gated" if GATE_NAME in gates else phase

    async def on_alloc(self, etype: str, a: Obj) -> None:
        key = f"{a['metadata']['namespace']}/{a['metadata']['name']}"
        if etype == "DELETED":
            self.allocs.pop(key, None)
        else:
            self.allocs[key] = a

    def sample(self, slots_by_model: dict[str, int], gpu_model: dict[str, str]) -> float:
        used: dict[str, int] = {}
        for a in self.allocs.values():
            for s in a["spec"]["slices"]:
                m = gpu_model.get(s["gpuUUID"], "?")
                used[m] = used.get(m, 0) + int(s["size"])
        total = sum(used.values()) / self.total_slots
        per = {m: used.get(m, 0) / n for m, n in slots_by_model.items()}
        self.samples.append((time.monotonic() - self.t0, total, per))
        if total > self.peak[0]:
            self.peak = (total, list(self.allocs.values()))
        return total

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for ph in self.phases.values():
            out[ph] = out.get(ph, 0) + 1
        return out


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


async def run_workload(system: DevSystem) -> int:
    async with await Kube.connect(str(system.kubeconfig)) as kube:
        mignodes = (await kube.list(instaslice_path("mignodes")))["items"]
        gpu_model = {g["uuid"]: g["model"] for m in mignodes for g in m["status"]["gpus"]}
        slots_by_model: dict[str, int] = {}
        for m in mignodes:
            for g in m["status"]["gpus"]:
                slots = max(
                    p["start"] + p["size"] for pr in g["profiles"] for p in pr["placements"]
                )
                slots_by_model[g["model"]] = slots_by_model.get(g["model"], 0) + slots
        tr = Tracker(total_slots=sum(slots_by_model.values()))
        per_model = ", ".join(f"{m}: {n}" for m, n in sorted(slots_by_model.items()))
        print(
            f"fleet: {len(mignodes)} nodes, {len(gpu_model)} GPUs, "
            f"{tr.total_slots} memory slots ({per_model})"
        )

        print("MIG modes at start: " + _modes(mignodes))
        await kube.create(core_path("namespaces"), {"metadata": {
            "name": NS, "annotations": {ENABLED_KEY: "true", WHOLE_GPU_KEY: "true"}}})  # fmt: skip
        for _ in range(100):  # the mirror controller labels it within a second or so
            labels = (await kube.get(core_path("namespaces", name=NS)))["metadata"].get("labels")
            if (labels or {}).get(ENABLED_KEY) == (labels or {}).get(WHOLE_GPU_KEY) == "true":
                break
            await asyncio.sleep(0.1)
        print(f"namespace {NS!r} opted in, to whole GPUs too (annotations mirrored into labels)\n")

        async with asyncio.TaskGroup() as tg:
            watchers = [
                tg.create_task(Informer(kube, core_path("pods", NS), tr.on_pod, name="pods").run()),
                tg.create_task(
                    Informer(
                        kube, instaslice_path("sliceallocations"), tr.on_alloc, name="allocs"
                    ).run()
                ),
            ]
            await _submit(kube, tr, slots_by_model, gpu_model)
            for w in watchers:
                w.cancel()

        mignodes = (await kube.list(instaslice_path("mignodes")))["items"]
        print("\n=== slice map at the busiest moment "
              f"({tr.peak[0]:.0%} of all memory slots; MIG modes as now) ===")  # fmt: skip
        print(render_nodes(mignodes, tr.peak[1]))
        print("\n=== MIG modes changed on demand ===")
        print("  " + _modes(mignodes, changed_only=True))
        print("\n=== allocations at the busiest moment ===")
        print(render_pods(tr.peak[1]))
        _report(tr, await _pending_reasons(kube), system.dir / "utilization.png")
    return 0


def _modes(mignodes: list[Obj], changed_only: bool = False) -> str:
    """`h100off-0/GPU 0 disabled, ...`: GPUs with MIG off (or, `changed_only`, those the node
    agent changed, with the change)."""
    out = []
    for m in sorted(mignodes, key=lambda m: m["metadata"]["name"]):
        for g in m["status"]["gpus"]:
            where = f"{m['metadata']['name']}/GPU {g['index']}"
            last = g.get("lastModeChange")
            if changed_only and last:
                out.append(f"{where}: {last['from']} -> {last['to']} at {last['time']}")
            elif not changed_only and g["migMode"]["current"] != "enabled":
                out.append(f"{where} MIG {g['migMode']['current']}")
    return ", ".join(out) or "(none)"


def on_node(body: Obj, node: str) -> Obj:
    """A Job pinned to one node (a team's own node), by nodeSelector."""
    body["spec"]["template"]["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}
    return body


def whole_gpu_job(name: str, *, completions: int, runtime_s: int) -> Obj:
    """Pods each asking one whole GPU, as NVIDIA's device plugin names it."""
    body = job(name, "1g.10gb", parallelism=1, completions=completions, runtime_s=runtime_s)
    limits = {"nvidia.com/gpu": 1, "cpu": "1", "memory": "4Gi"}
    body["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] = limits
    return body


async def _submit(
    kube: Kube, tr: Tracker, slots: dict[str, int], gpu_model: dict[str, str]
) -> None:
    jobs = [
        job("train-h100-3g", "3g.40gb", parallelism=4, completions=6, runtime_s=14),
        job("infer-h100-1g", "1g.10gb", parallelism=8, completions=16, runtime_s=6),
        job("finetune-h200-4g", "4g.71gb", parallelism=2, completions=3, runtime_s=12),
        job("eval-h200-2g", "2g.35gb", parallelism=3, completions=6, runtime_s=8),
        job("notebook-a100-1g", "1g.5gb", parallelism=7, completions=10, runtime_s=7),
        job("pretrain-7g", "7g.80gb", parallelism=1, completions=2, runtime_s=10),
        whole_gpu_job("whole-gpu-bench", completions=2, runtime_s=10),
        on_node(
            job("team-off-1g", "1g.10gb", parallelism=4, completions=6, runtime_s=8), "h100off-0"
        ),
    ]
    for j in jobs:
        await kube.create(group_path("batch/v1", "jobs", NS), j)
        spec = j["spec"]
        prof = next(iter(spec["template"]["spec"]["containers"][0]["resources"]["limits"]))
        print(f"  job {j['metadata']['name']:<18} {prof:<26} x{spec['completions']} "
              f"({spec['parallelism']} at a time)")  # fmt: skip
    multi = pod("multi-container", [_container("trainer", {"1g.18gb": 2}),
                                    _container("sidecar", {"1g.18gb+me": 1})])  # fmt: skip
    await kube.create(core_path("pods", NS), multi)
    print("  pod multi-container: trainer 2 x 1g.18gb + sidecar 1 x 1g.18gb+me (one node, H200)")
    impossible = pod("impossible", [_container("main", {"7g.141gb": 6})])
    await kube.create(core_path("pods", NS), impossible)
    print("  pod impossible: 6 x 7g.141gb (no node has 6 H200s) -> stays pending, with a reason")
    try:
        await kube.create(core_path("pods", NS), pod("typo", [_container("m", {"5g.99gb": 1})]))
    except ApiError as exc:
        print(f"  pod typo (5g.99gb): refused at admission: {exc.message[:110]}")

    burst_at = 12.0
    t_start = time.monotonic()
    burst_done = False
    last = ""
    deleted: set[str] = set()
    while True:
        await asyncio.sleep(0.5)
        elapsed = time.monotonic() - t_start
        if not burst_done and elapsed >= burst_at:
            print(f"  burst: {BURST} inference pods (1g.10gb / 1g.18gb) created at once")
            await asyncio.gather(*(kube.create(core_path("pods", NS), pod(
                f"burst-{i:02d}", [_container("m", {("1g.10gb" if i % 2 else "1g.18gb"): 1},
                                              cpu="500m", mem="2Gi")]))
                for i in range(BURST)))  # fmt: skip
            burst_done = True
        # burst pods "serve" for 8 s once Running, then go away (as a scale-down would)
        for name, t in list(tr.running.items()):
            if (
                name.startswith("burst-")
                and name not in deleted
                and time.monotonic() - tr.t0 - t > 8
            ):
                deleted.add(name)
                await kube.delete_ignore_missing(core_path("pods", NS, name))
        util = tr.sample(slots, gpu_model)
        c = tr.counts()
        line = (f"t={elapsed:5.1f}s  slots {util:4.0%}  gated {c.get('Gated', 0):3}  "
                f"running {c.get('Running', 0):3}  done {c.get('Succeeded', 0):3}  "
                f"allocations {len(tr.allocs):3}")  # fmt: skip
        if line[10:] != last[10:]:
            print(line, flush=True)
            last = line
        others = ("burst-", "multi", "impossible")
        jobs_left = [
            n for n, ph in tr.phases.items() if not n.startswith(others) and ph != "Succeeded"
        ]
        burst_left = [
            n for n, ph in tr.phases.items() if n.startswith("burst-") and ph != "Deleted"
        ]
        if burst_done and not jobs_left and not burst_left and elapsed > 20:
            break
        if elapsed > 300:
            print("demo: giving up after 300 s")
            break


async def _pending_reasons(kube: Kube) -> list[str]:
    events = await kube.list(core_path("events", NS), fieldSelector=f"reason={REASON_PENDING}")
    out: dict[str, None] = {}
    for e in events["items"]:
        out[f"{e['involvedObject']['name']}: {e['message']}"] = None
    return list(out)


def _report(tr: Tracker, reasons: list[str], png: Path) -> None:
    to_ungate = [tr.ungated[n] - tr.seen[n] for n in tr.ungated if n in tr.seen]
    to_run = [tr.running[n] - tr.seen[n] for n in tr.running if n in tr.seen]
    print("\n=== time to slice (pod seen by the API → gate removed / Running) ===")
    print(f"  pods sliced: {len(to_ungate)}")
    print(f"  gate removed  p50 {_pct(to_ungate, 0.5):6.2f}s   p99 {_pct(to_ungate, 0.99):6.2f}s   "
          f"max {max(to_ungate, default=float('nan')):6.2f}s")  # fmt: skip
    print(f"  Running       p50 {_pct(to_run, 0.5):6.2f}s   p99 {_pct(to_run, 0.99):6.2f}s")
    print("  (includes time spent waiting for capacity while the fleet was full)")
    fast = [t for t in to_ungate if t < 5]
    if fast:
        print(f"  when capacity was free: p50 {statistics.median(fast):.2f}s over {len(fast)} pods")
    print("\n=== memory-slot utilisation over time ===")
    bars = " ▁▂▃▄▅▆▇█"
    step = max(1, len(tr.samples) // 72)
    line = "".join(bars[min(8, round(s[1] * 8))] for s in tr.samples[::step])
    print(f"  |{line}|  peak {max((s[1] for s in tr.samples), default=0):.0%}, "
          f"mean {statistics.fmean([s[1] for s in tr.samples] or [0]):.0%}")  # fmt: skip
    _plot(tr, png)
    print(f"  plot: {png}")
    print("\n=== pending reasons seen (AllocationPending events) ===")
    for r in reasons or ["(none)"]:
        print(f"  {r}")


def _plot(tr: Tracker, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    ts = [s[0] for s in tr.samples]
    ax.plot(ts, [100 * s[1] for s in tr.samples], label="all GPUs", linewidth=2, color="black")
    for model in sorted(tr.samples[0][2] if tr.samples else {}):
        ax.plot(ts, [100 * s[2][model] for s in tr.samples], label=model, alpha=0.7)
    ax.set_xlabel("seconds")
    ax.set_ylabel("memory slots in use (%)")
    ax.set_ylim(0, 105)
    ax.set_title("InstaSlice demo: MIG memory-slot utilisation")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hack.demo", description=__doc__)
    ap.add_argument("--dir", type=Path, default=Path(".dev/demo"))
    ap.add_argument("--spec", type=Path, default=REPO / "hack" / "specs" / "demo.yaml")
    ap.add_argument("--keep", action="store_true", default=os.environ.get("DEMO_KEEP") == "1")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    print("InstaSlice demo: starting a local control plane, KWOK GPU nodes and InstaSlice...")
    system = DevSystem.up(args.dir, load_spec(args.spec), die_with_parent=not args.keep)
    print(f"up in {time.monotonic() - t0:.1f}s (logs: {system.logs})\n")
    try:
        return asyncio.run(run_workload(system))
    finally:
        if args.keep:
            print(f"\nkept running: export KUBECONFIG={system.kubeconfig}; "
                  f"stop with: .venv/bin/python -m hack.dev down --dir {args.dir}")  # fmt: skip
        else:
            system.down()
            print("\ntorn down (run with --keep or DEMO_KEEP=1 to explore afterwards)")


if __name__ == "__main__":
    sys.exit(main())
