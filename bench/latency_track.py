"""What `bench.latency` measures: per-pod milestones, percentiles, process CPU and memory.

`Tracker` is fed by two informers (the benchmark's pods, their SliceAllocations) and keeps,
per pod, when each step of the protocol (docs/protocol.md) was first seen on the bench's
monotonic clock: create sent → admitted (the POST returned) → SliceAllocation created
(placement) → allocation Ready (the node agent) → gate removed (the pin) → Running (the
scheduler and KWOK) → deleted → allocation gone (release). All times are seen through
watches from the benchmark process, so they include watch delivery (milliseconds here).

`ProcSampler` reads /proc for CPU seconds (utime+stime) and peak RSS (VmHWM) of the
components; `load()` is the machine's load average, recorded because the machine is shared.
`api_writes`, `request_seconds`, `admission_seconds` and `latency_delta` read the API
server's /metrics: writes by kind, and the mean latency per request kind and admission step
between two scrapes. Nothing here starts or stops anything.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.constants import GATE_NAME

Obj = dict[str, Any]
CLAIM = "instaslice.io/claim"
_TICK = os.sysconf("SC_CLK_TCK")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


@dataclass
class PodTimes:
    sent: float
    admitted: float | None = None
    allocated: float | None = None
    ready: float | None = None
    ungated: float | None = None
    bound: float | None = None  # spec.nodeName seen: the scheduler's binding
    running: float | None = None
    deleted: float | None = None
    released: float | None = None
    node: str = ""

    def since(self, attr: str) -> float | None:
        t = getattr(self, attr)
        return None if t is None else t - self.sent


@dataclass
class Tracker:
    """Milestones per pod name, from watch events; `changed` wakes waiters."""

    clock: Callable[[], float] = time.monotonic
    pods: dict[str, PodTimes] = field(default_factory=dict)
    claim_to_pod: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.changed = asyncio.Event()

    def sent(self, name: str) -> PodTimes:
        t = self.pods[name] = PodTimes(sent=self.clock())
        return t

    async def on_pod(self, etype: str, p: Obj) -> None:
        now = self.clock()
        meta = p.get("metadata", {})
        t = self.pods.get(meta.get("name", ""))
        if t is None:
            return
        claim = (meta.get("annotations") or {}).get(CLAIM)
        if claim:
            self.claim_to_pod[claim] = meta["name"]
        if etype == "DELETED":
            if not claim and t.released is None:  # a static pod: its slice is free now
                t.released = now
                self.changed.set()
            return
        if meta.get("deletionTimestamp") and t.deleted is None:
            t.deleted = now
        gates = [g.get("name") for g in p.get("spec", {}).get("schedulingGates") or []]
        if claim and GATE_NAME not in gates and t.ungated is None:
            t.ungated = now
            t.node = _pinned_node(p)
        if p.get("spec", {}).get("nodeName") and t.bound is None:
            t.bound = now
        if p.get("status", {}).get("phase") == "Running" and t.running is None:
            t.running = now
        self.changed.set()

    async def on_alloc(self, etype: str, a: Obj) -> None:
        now = self.clock()
        name = self.claim_to_pod.get(a.get("metadata", {}).get("name", ""))
        if name is None:
            name = a.get("spec", {}).get("podName", "")
        t = self.pods.get(name)
        if t is None:
            return
        if t.allocated is None:
            t.allocated = now
        if etype == "DELETED":
            t.released = now
        elif (a.get("status") or {}).get("phase") == "Ready" and t.ready is None:
            t.ready = now
        self.changed.set()

    def reached(self, name: str, attr: str) -> Callable[[], bool]:
        t = self.pods[name]
        return lambda: getattr(t, attr) is not None

    async def wait(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Until `done()` holds (checked on every change) or the timeout; whether it held."""
        deadline = self.clock() + timeout_s
        while not done():
            left = deadline - self.clock()
            if left <= 0:
                return False
            self.changed.clear()
            try:
                async with asyncio.timeout(min(left, 1.0)):
                    await self.changed.wait()
            except TimeoutError:
                pass
        return True

    def durations(self, names: Iterable[str], attr: str, start: str = "sent") -> list[float]:
        out = []
        for n in names:
            t = self.pods[n]
            a, b = getattr(t, start), getattr(t, attr)
            if a is not None and b is not None:
                out.append(b - a)
        return out


def _pinned_node(p: Obj) -> str:
    """The node the allocator pinned the pod to (node affinity on metadata.name)."""
    aff = p.get("spec", {}).get("affinity", {}).get("nodeAffinity", {})
    req = aff.get("requiredDuringSchedulingIgnoredDuringExecution", {})
    for term in req.get("nodeSelectorTerms", []):
        for f in term.get("matchFields", []):
            if f.get("key") == "metadata.name" and f.get("values"):
                return str(f["values"][0])
    return ""


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]); NaN for no data."""
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def r3(x: float) -> float:
    return round(x, 3) if math.isfinite(x) else x


def summary(tr: Tracker, names: list[str]) -> dict[str, Any]:
    """p50/p99 of each step for `names`; the breakdown medians explain where time goes."""
    ung = tr.durations(names, "ungated")
    run = tr.durations(names, "running")
    out: dict[str, Any] = {
        "ungated": len(ung),
        "ungate_p50_s": r3(pct(ung, 0.5)),
        "ungate_p99_s": r3(pct(ung, 0.99)),
        "ungate_max_s": r3(max(ung, default=math.nan)),
        "running_p50_s": r3(pct(run, 0.5)),
        "running_p99_s": r3(pct(run, 0.99)),
    }
    per_node: Counter[str] = Counter(tr.pods[n].node for n in names if tr.pods[n].node)
    if per_node:  # placement packs: pods per node bound a node's serialized NVML work
        out["nodes_used"] = len(per_node)
        out["max_pods_per_node"] = max(per_node.values())
    steps = {
        "admit": ("sent", "admitted"),
        "place": ("admitted", "allocated"),
        "agent": ("allocated", "ready"),
        "pin": ("ready", "ungated"),
        "bind_run": ("ungated", "running"),
        "bind": ("ungated", "bound"),  # bind_run split: the scheduler's part...
        "start": ("bound", "running"),  # ...and the (KWOK) kubelet's
        "release": ("deleted", "released"),
    }
    for step, (a, b) in steps.items():
        xs = tr.durations(names, b, a)
        if xs:
            out[f"{step}_p50_s"] = r3(pct(xs, 0.5))
            out[f"{step}_p99_s"] = r3(pct(xs, 0.99))
    return out


# ---- where pods wait, over time ---------------------------------------------------------------

# each step named by the milestone that ends it (as in `summary`), in protocol order
STEP_ENDS = (
    ("admit", "admitted"),
    ("place", "allocated"),
    ("agent", "ready"),
    ("pin", "ungated"),
    ("bind", "bound"),
    ("start", "running"),
)


def occupancy(tr: Tracker, names: list[str], t0: float, step_s: float = 1.0) -> Obj:
    """How many of `names` sat in each step every `step_s` seconds after `t0` (the bench's
    clock), and how many were Running: where a burst queues, and when. A pod is in the
    step whose ending milestone it has not reached yet; milestones it never has (a static
    pod has no allocation, Ready or gate) are skipped, so a static pod goes from `admit`
    straight to `bind`. Sampled until the last pod ran (or its last milestone)."""
    rows: list[tuple[float, list[float]]] = []  # (sent, end time of each step; inf: never)
    last = t0
    for n in names:
        t = tr.pods.get(n)
        if t is None:
            continue
        ends: list[float] = []
        for _, attr in STEP_ENDS:
            v = getattr(t, attr)
            if v is not None:
                last = max(last, v)
            ends.append(math.inf if v is None else v)
        # a milestone not reached while a later one was is a step this pod never had
        later = False
        for i in range(len(ends) - 1, -1, -1):
            if ends[i] < math.inf:
                later = True
            elif later:
                ends[i] = -math.inf  # skipped: passed at once
        rows.append((t.sent, ends))
    out: Obj = {"step_s": step_s, "t_s": []}
    out.update({name: [] for name, _ in STEP_ENDS})
    out["running"] = []
    k = 0
    while True:
        at = t0 + k * step_s
        counts = [0] * len(STEP_ENDS)
        done = 0
        for sent, ends in rows:
            if sent > at:
                continue
            for i, end in enumerate(ends):
                if end > at:
                    counts[i] += 1
                    break
            else:
                done += 1
        out["t_s"].append(round(k * step_s, 3))
        for (name, _), c in zip(STEP_ENDS, counts, strict=True):
            out[name].append(c)
        out["running"].append(done)
        if at >= last or k > 100_000:
            return out
        k += 1


def peaks(occ: Obj) -> str:
    """`step max@t` for each step of an `occupancy`: the deepest each queue got, and when."""
    parts = []
    for name, _ in STEP_ENDS:
        xs = occ.get(name) or [0]
        m = max(xs)
        parts.append(f"{name} {m}@{occ['t_s'][xs.index(m)]:.0f}s" if m else f"{name} 0")
    return ", ".join(parts)


# ---- API server requests ---------------------------------------------------------------------

_WRITE_VERBS = ("POST", "PUT", "PATCH", "DELETE", "APPLY")


def api_writes(metrics_text: str) -> Counter[str]:
    """Mutating requests served so far, by `VERB resource[/subresource]`, from the API
    server's /metrics (apiserver_request_total)."""
    out: Counter[str] = Counter()
    for line in metrics_text.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels_part, _, value = line.rpartition(" ")
        labels = dict(_LABEL.findall(labels_part))
        verb = labels.get("verb", "")
        if verb not in _WRITE_VERBS:
            continue
        res = labels.get("resource", "")
        if labels.get("subresource"):
            res += "/" + labels["subresource"]
        out[f"{verb} {res}"] += int(float(value))
    return out


# the kinds a pod's writes are counted by (issue 37 §3): `resource[/subresource]` → kind
WRITE_KINDS = {
    "sliceallocations/status": "status",
    "sliceallocations": "SliceAllocation",
    "events": "events",
    "mignodes": "MigNode",
    "mignodes/status": "MigNode",
    "leases": "Leases",
}


def write_kind(resource: str) -> str:
    """The kind a write to `resource[/subresource]` counts as: `pod` for a pod and its
    subresources (binding, status), `other` for what no kind names (Node status, ...)."""
    if resource == "pods" or resource.startswith("pods/"):
        return "pod"
    return WRITE_KINDS.get(resource, "other")


def writes_per_pod(delta: Counter[str], pods: int) -> dict[str, float]:
    """`delta` (`VERB resource[/subresource]` → writes) per pod by kind (`write_kind`), every
    kind listed, with their `total`."""
    kinds: Counter[str] = Counter(
        dict.fromkeys((*dict.fromkeys(WRITE_KINDS.values()), "pod", "other"), 0)
    )
    for key, n in delta.items():
        kinds[write_kind(key.partition(" ")[2])] += n
    out = {k: r3(n / pods) if pods else math.nan for k, n in kinds.items()}
    out["total"] = r3(sum(kinds.values()) / pods) if pods else math.nan
    return out


def writes_summary(before: Counter[str], after: Counter[str], pods: int, wall: float) -> Obj:
    delta = after - before
    total = sum(delta.values())
    return {
        "writes": total,
        "writes_per_pod": r3(total / pods) if pods else math.nan,
        "writes_per_s": r3(total / wall) if wall > 0 else math.nan,
        "by_kind": dict(delta.most_common(12)),
        "per_pod_by_kind": writes_per_pod(delta, pods),
    }


# mean latency per request kind and admission step, from the API server's histograms

_DURATION = re.compile(r"^(apiserver_request_duration_seconds)_(sum|count)\{([^}]*)\} (\S+)$")
# the API server's admission, by webhook and by step (admit = mutating, validate), and the
# webhook's own handler time as it measures it (instaslice_webhook_review_seconds)
_ADMISSION = re.compile(
    r"^(apiserver_admission_webhook_admission_duration_seconds|"
    r"apiserver_admission_step_admission_duration_seconds|"
    r"instaslice_webhook_review_seconds)_(sum|count)\{([^}]*)\} (\S+)$"
)
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


# ---- processes -----------------------------------------------------------------------------


def cpu_s(pid: int) -> float:
    """utime + stime of `pid` in seconds (NaN if gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return math.nan
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def mem_mb(pid: int) -> tuple[float, float]:
    """(current RSS, peak RSS) in MiB from /proc/<pid>/status (NaN if gone)."""
    rss = hwm = math.nan
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) / 1024
    except OSError:
        pass
    return rss, hwm


def machine_busy_s() -> float:
    """CPU seconds every core of the machine has been busy since boot (/proc/stat: all
    but idle and iowait); NaN where unreadable."""
    try:
        head = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return math.nan
    ticks = [int(x) for x in head[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    return (sum(ticks[:8]) - idle) / _TICK


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


@dataclass
class ProcSampler:
    """CPU seconds of named processes between `start()` and `stop()`; peak RSS at stop."""

    pids: dict[str, int]
    t0: float = 0.0
    cpu0: dict[str, float] = field(default_factory=dict)

    def start(self) -> None:
        self.t0 = time.monotonic()
        self.cpu0 = {k: cpu_s(p) for k, p in self.pids.items()}

    def stop(self) -> dict[str, dict[str, float]]:
        wall = time.monotonic() - self.t0
        out: dict[str, dict[str, float]] = {}
        for k, p in self.pids.items():
            used = cpu_s(p) - self.cpu0.get(k, math.nan)
            rss, hwm = mem_mb(p)
            out[k] = {
                "cpu_s": r3(used),
                "cpu_share": r3(used / wall) if wall > 0 else math.nan,
                "rss_mb": round(rss, 1),
                "peak_rss_mb": round(hwm, 1),
            }
        return out
