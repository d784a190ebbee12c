"""Plots of `.dev/bench/latency.json` for docs/benchmarks.md.

- `latency-cdf.png`: time to ungate, one cumulative distribution per scenario, emulated NVML
  latency 0 on the left and the realistic setting on the right;
- `fleet-cost.png`: against fleet size (nodes): time to ungate of single pods on an idle
  fleet (p50/p99), idle CPU share and peak RSS of the allocator and the agent, startup time,
  and the bursts' throughput (pods/s) and CPU seconds of the whole system per pod.

`python -m bench.latency_report [JSON] [DIR]` redraws them from a saved run.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

Obj = dict[str, Any]


def _cdf(ax: Any, xs: list[float], label: str) -> None:
    xs = sorted(x for x in xs if math.isfinite(x))
    if not xs:
        return
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)})")


def latency_cdf(doc: Obj, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for key, sc in sorted(doc["scenarios"].items()):
        samples = _samples(sc)
        for name, xs in samples.items():
            if not xs:  # the static baseline: no gate to remove
                continue
            label = key if not name else f"{key} {name}"
            ax = axes[1] if "realistic" in key else axes[0]
            _cdf(ax, xs, label)
    titles = ("emulated NVML latency 0", "realistic emulated NVML latency")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log")
        ax.set_xlabel("pod created → scheduling gate removed (s, log)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.axvline(0.5, color="grey", linestyle=":", linewidth=1)
        ax.axvline(2.0, color="grey", linestyle="--", linewidth=1)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="lower right")
    axes[0].set_ylabel("share of pods")
    fig.suptitle("InstaSlice time to ungate (dotted: 0.5 s, dashed: 2 s)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _samples(sc: Obj) -> dict[str, list[float]]:
    if "samples" in sc:
        return {"": list(sc["samples"]["ungate_s"])}
    out = {}
    for part in ("probe", "burst"):
        if isinstance(sc.get(part), dict) and "samples" in sc[part]:
            out[part] = list(sc[part]["samples"]["ungate_s"])
    return out


def fleet_cost(doc: Obj, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fleets = sorted(doc.get("fleets", {}).values(), key=lambda f: f["nodes"])
    probes = []  # (nodes, p50, p99) of single pods on an otherwise idle fleet
    for key, sc in doc["scenarios"].items():
        if key == "sequential":
            probes.append((sc["nodes"], sc["ungate_p50_s"], sc["ungate_p99_s"]))
        elif key.startswith("scale-") and "probe" in sc:
            p = sc["probe"]
            probes.append((p["nodes"], p["ungate_p50_s"], p["ungate_p99_s"]))
    probes.sort()
    bursts = []  # (nodes, pods/s, system CPU s per pod) of the bursts without NVML latency
    for key, sc in doc["scenarios"].items():
        b = sc.get("burst") if key.startswith("scale-") else sc if key == "burst" else None
        if isinstance(b, dict) and "pods_per_s" in b:
            bursts.append((b["nodes"], b["pods_per_s"], b.get("system_cpu_s_per_pod", math.nan)))
    bursts.sort()
    fig, axes = plt.subplots(1, 5, figsize=(20, 4))
    ax = axes[0]
    if probes:
        ax.plot([p[0] for p in probes], [p[1] for p in probes], "o-", label="p50")
        ax.plot([p[0] for p in probes], [p[2] for p in probes], "s--", label="p99")
    ax.set_title("single pod, idle fleet: time to ungate")
    ax.set_ylabel("seconds")
    ax = axes[1]
    for proc in ("allocator", "agent", "kube-apiserver", "etcd"):
        pts = [(f["nodes"], 100 * f["idle"][proc]["cpu_share"]) for f in fleets if "idle" in f]
        if pts:
            ax.plot(*zip(*pts, strict=True), "o-", label=proc)
    ax.set_title("idle CPU (% of one core)")
    ax = axes[2]
    for proc in ("allocator", "agent"):
        pts = [(f["nodes"], _peak(doc, f["nodes"], proc)) for f in fleets]
        pts = [p for p in pts if math.isfinite(p[1])]
        if pts:
            ax.plot(*zip(*pts, strict=True), "o-", label=proc)
    ax.set_title("peak RSS (MiB)")
    ax = axes[3]
    pts = [(f["nodes"], f["startup_s"]) for f in fleets]
    if pts:
        ax.plot(*zip(*pts, strict=True), "o-", label="system up")
    ax.set_title("startup (s): control plane + nodes + InstaSlice")
    ax = axes[4]
    if bursts:
        ax.plot([b[0] for b in bursts], [b[1] for b in bursts], "o-", label="burst pods/s")
        ax.plot([b[0] for b in bursts], [100 * b[2] for b in bursts], "s--",
                label="system CPU per pod (cs)")  # fmt: skip
    ax.set_title("burst throughput, CPU per pod")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("nodes (x 8 GPUs)")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _peak(doc: Obj, nodes: int, proc: str) -> float:
    """The highest peak RSS any scenario on this fleet size recorded for `proc`."""
    best = math.nan
    for sc in doc["scenarios"].values():
        for part in (sc, sc.get("probe"), sc.get("burst")):
            if isinstance(part, dict) and part.get("nodes") == nodes and "processes" in part:
                v = part["processes"].get(proc, {}).get("peak_rss_mb", math.nan)
                best = v if not math.isfinite(best) else max(best, v)
    return best


def _f(x: Any, fmt: str = ".2f") -> str:
    if isinstance(x, (int, float)) and math.isfinite(x):
        return format(x, fmt)
    return "-"


def ratio_table(doc: Obj) -> str:
    """InstaSlice over the static baseline, per scenario (`ratio_to_static`), as Markdown."""
    rows = [
        "| scenario | Running p50 | Running p99 | burst: all Running | system CPU s/pod "
        "| InstaSlice Running p50 / p99 s | static Running p50 / p99 s |",
        "|---|---|---|---|---|---|---|",
    ]
    scenarios = doc["scenarios"]
    for key in sorted(scenarios, key=_scenario_order):
        sc = scenarios[key]
        ratio = sc.get("ratio_to_static") if isinstance(sc, dict) else None
        if not ratio:
            continue
        static = scenarios[key.split("-")[0] + "-static"]
        rows.append(
            f"| {key} | {_f(ratio.get('running_p50_s'))} | {_f(ratio.get('running_p99_s'))} "
            f"| {_f(ratio.get('all_running_s'))} | {_f(ratio.get('system_cpu_s_per_pod'))} "
            f"| {_f(sc.get('running_p50_s'))} / {_f(sc.get('running_p99_s'))} "
            f"| {_f(static.get('running_p50_s'))} / {_f(static.get('running_p99_s'))} |"
        )
    return "\n".join(rows) + "\n" if len(rows) > 2 else ""


def table(doc: Obj) -> str:
    """The numbers as Markdown: one row per scenario, then one per fleet."""
    rows = [
        "| scenario | nodes | pods | NVML create ms | ungate p50 s | ungate p99 s "
        "| Running p50 s | Running p99 s | all ungated s | pods/s | API writes/pod "
        "| system CPU s/pod | cores obtained | load start → end |",
        "|" + "---|" * 14,
    ]
    order = sorted(doc["scenarios"], key=_scenario_order)
    for key in order:
        sc = doc["scenarios"][key]
        parts = [(key, sc)] if "probe" not in sc else [
            (f"{key} probe", sc["probe"]), (f"{key} burst", sc["burst"])
        ]  # fmt: skip
        if key == "scale":
            continue  # the summary of the largest scale-N; its rows are listed already
        for name, r in parts:
            if "error" in r:
                rows.append(f"| {name} | {r.get('nodes')} | failed: {r['error'][:80]} |")
                continue
            api = r.get("api", {})
            load = f"{_f(r.get('load_start', [None])[0], '.1f')} → "
            load += _f(r.get("load_end", [None])[0], ".1f")
            rows.append(
                f"| {name} | {r['nodes']} | {r['pods']} | {r['emulated_create_ms']} "
                f"| {_f(r.get('ungate_p50_s'))} | {_f(r.get('ungate_p99_s'))} "
                f"| {_f(r.get('running_p50_s'))} | {_f(r.get('running_p99_s'))} "
                f"| {_f(r.get('all_ungated_s'), '.1f')} | {_f(r.get('pods_per_s'), '.1f')} "
                f"| {_f(api.get('writes_per_pod'), '.1f')} "
                f"| {_f(r.get('system_cpu_s_per_pod'), '.3f')} "
                f"| {_f(r.get('system_cores_used'))} | {load} |"
            )
    rows += [
        "",
        "| fleet (nodes x 8 GPUs) | startup s (control plane / nodes Ready / InstaSlice) "
        "| idle CPU % agent | idle CPU % allocator | idle CPU % apiserver "
        "| peak RSS MiB agent | peak RSS MiB allocator |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in sorted(doc.get("fleets", {}).values(), key=lambda f: f["nodes"]):
        idle = f.get("idle", {})
        phases = " / ".join(
            _f(f.get(k), ".0f") for k in ("control_plane_s", "nodes_ready_s", "instaslice_ready_s")
        )
        rows.append(
            f"| {f['nodes']} | {_f(f.get('startup_s'), '.0f')} ({phases}) "
            f"| {_f(100 * idle.get('agent', {}).get('cpu_share', math.nan), '.1f')} "
            f"| {_f(100 * idle.get('allocator', {}).get('cpu_share', math.nan), '.1f')} "
            f"| {_f(100 * idle.get('kube-apiserver', {}).get('cpu_share', math.nan), '.1f')} "
            f"| {_f(_peak(doc, f['nodes'], 'agent'), '.0f')} "
            f"| {_f(_peak(doc, f['nodes'], 'allocator'), '.0f')} |"
        )
    scales = [(k, sc) for k, sc in doc["scenarios"].items() if "processes" in sc and "probe" in sc]
    if scales:
        rows += [
            "",
            "| scale run (probe + burst) | allocator CPU s | agent CPU s | kube-apiserver CPU s "
            "| peak RSS MiB allocator | peak RSS MiB agent | peak RSS MiB kube-apiserver |",
            "|---|---|---|---|---|---|---|",
        ]
        for key, sc in sorted(scales, key=lambda kv: kv[1]["probe"]["nodes"]):
            procs = sc["processes"]
            cells = [_f(procs.get(p, {}).get("cpu_s"), ".1f") for p in _MAIN]
            cells += [_f(procs.get(p, {}).get("peak_rss_mb"), ".0f") for p in _MAIN]
            rows.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


_MAIN = ("allocator", "agent", "kube-apiserver")


def _scenario_order(key: str) -> tuple[int, str]:
    base = key.split("-")[0]
    rank = {"sequential": 0, "burst": 1, "churn": 2, "scale": 3}.get(base, 9)
    return rank, key


def plots(doc: Obj, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "latency-table.md"
    ratios = ratio_table(doc)
    md.write_text((f"InstaSlice / static baseline:\n\n{ratios}\n" if ratios else "") + table(doc))
    return [
        latency_cdf(doc, out_dir / "latency-cdf.png"),
        fleet_cost(doc, out_dir / "fleet-cost.png"),
        md,
    ]


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    src = Path(args[0]) if args else Path(".dev/bench/latency.json")
    out = Path(args[1]) if len(args) > 1 else Path("bench/results")
    for p in plots(json.loads(src.read_text()), out):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
