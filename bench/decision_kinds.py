"""One placement decision of every pod kind, as the allocator makes it, on a large fleet.

`bench.placement`'s decision speed times the engine (`Cluster.decide`) on one- and several-
slice asks; a pod asking whole GPUs, a size, a `+me` profile or one model by its node
selector goes another way through the allocator (`Placer._place`: common/placement/whole.py,
common/sizing.py, common/placement/modes.py). This times `Placer.decide` — the allocator's
own call, its pod view, request and pending bookkeeping included — for each kind, mixed in one
seeded stream on one fleet (issue 37's target: p99 at most 2 ms at 5000 nodes x 8 GPUs).

The fleet: N nodes x 8 GPUs, half H100-80GB, half H200-141GB (labelled with their model, as
the agent labels them), one GPU in 16 with MIG off (a whole GPU's home), the rest holding a
random legal set of instances (as the MigNode lists them): one in seven empty, the others
3 to 8 of their 8 slots taken.
Each decision placed is confirmed (the allocator's cache) and released `LIFE` decisions
later, so occupancy stays steady. The first `warmup` decisions of each kind fill the caches
a running allocator has warm and are not counted. Times are process CPU time.

    python -m bench.decision_kinds [--nodes 5000] [--per-kind 300] [--out FILE]

Also a scenario of `make bench-placement` (`kinds`, bench/placement_scenarios.py).
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import math
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from common.catalog import load_catalog
from common.constants import GPU_MODEL_LABEL, SIZE_ANNOTATION_PREFIX
from common.heap import settle_collector
from common.logsetup import configure_logging
from common.placement.tables import add, free_starts, gpu_state, model_tables
from testkit.builders import GpuSpec, make_mig_node, make_node, make_pod, quiet_placer
from webhook.allocator.state import ClusterState

Obj = dict[str, Any]
LIFE = 200  # a placed pod leaves this many decisions later
H100, H200 = "H100-80GB", "H200-141GB"


def _sized(size: str) -> Callable[[str], Obj]:
    def build(uid: str) -> Obj:
        pod = make_pod(uid, uid=uid, slices={})
        pod["metadata"]["annotations"][SIZE_ANNOTATION_PREFIX + "main"] = size
        return pod

    return build


def _asking(slices: dict[str, dict[str, int]], **kw: Any) -> Callable[[str], Obj]:
    return lambda uid: make_pod(uid, uid=uid, slices=slices, cpu="1", memory="4Gi", **kw)


# kind → how a pod of it looks (as admission leaves it)
KINDS: dict[str, Callable[[str], Obj]] = {
    "1g": _asking({"main": {"1g.10gb": 1}}),
    "3g": _asking({"main": {"3g.40gb": 1}}),
    "7g": _asking({"main": {"7g.80gb": 1}}),
    "1g+me": _asking({"main": {"1g.10gb+me": 1}}),
    "H200 2g": _asking({"main": {"2g.35gb": 1}}),
    "several slices, one container": _asking({"main": {"1g.10gb": 2, "2g.20gb": 1}}),
    "several containers": _asking({"a": {"1g.10gb": 1}, "b": {"3g.40gb": 1}}),
    "4 slices, 2 GPUs' worth": _asking({"a": {"4g.40gb": 2}, "b": {"3g.40gb": 2}}),
    "model by node selector": _asking(
        {"main": {"1g.18gb": 1}}, node_selector={GPU_MODEL_LABEL: H200}
    ),
    "whole GPU": _asking({"main": {"gpu": 1}}),
    "size ask": _sized("memory>=20Gi"),
    "size ask, count 2": _sized("memory>=40Gi,count=2"),
    "pending (fits no node)": _asking({"main": {"7g.80gb": 9}}),
}


def _occupied(rng: random.Random, model_name: str) -> list[Obj]:
    """A random legal set of instances on one GPU (none to all of its slots), as MigNode
    slices."""
    model = load_catalog().model(model_name)
    assert model is not None
    t = model_tables(model)
    plain = [p for p in t.profiles.values() if "+" not in p.name and "-" not in p.name]
    st = gpu_state(t, ())
    out: list[Obj] = []
    target = rng.choice([0, 3, 6, 7, 8, 8, 8])
    for _ in range(12):
        if bin(st.mask).count("1") >= target:
            break
        pt = rng.choice(plain)
        options = free_starts(t, st, pt)
        if options:
            i = rng.choice(options)
            st = add(st, pt, i)
            start = pt.starts[i]
            out.append({"profile": pt.name, "start": start, "size": pt.size, "migUUID": ""})
    return out


def fleet(nodes: int, gpus: int, seed: int) -> ClusterState:
    rng = random.Random(seed)
    state = ClusterState()
    for i in range(nodes):
        name = f"n{i:05d}"
        model = H100 if i % 2 == 0 else H200
        specs = [
            GpuSpec(model=model, mig=False)
            if (i * gpus + g) % 16 == 5
            else GpuSpec(model=model, slices=_occupied(rng, model))
            for g in range(gpus)
        ]
        state.upsert_node(
            make_node(name, cpu="256", memory="2Ti", pods=250, gpus=gpus, model=model,
                      labels={GPU_MODEL_LABEL: model})
        )  # fmt: skip
        state.upsert_mig_node(make_mig_node(name, specs))
    return state


def _pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))] if s else math.nan


def run(nodes: int = 5000, gpus: int = 8, per_kind: int = 300, warmup: int = 20,
        seed: int = 11) -> Obj:  # fmt: skip
    """Every kind's decision CPU (ms) on one fleet of `nodes` x `gpus`."""
    t0 = time.monotonic()
    state = fleet(nodes, gpus, seed)
    built_s = time.monotonic() - t0
    placer = quiet_placer(state)
    settle_collector()  # as the allocator does once it has listed the cluster
    rng = random.Random(seed)
    stream = [k for k in KINDS for _ in range(warmup + per_kind)]
    rng.shuffle(stream)
    seen = dict.fromkeys(KINDS, 0)
    cpu: dict[str, list[float]] = {k: [] for k in KINDS}
    placed = dict.fromkeys(KINDS, 0)
    living: deque[tuple[int, Obj]] = deque()
    collector = 0
    for i, kind in enumerate(stream):
        while living and living[0][0] <= i:
            body = living.popleft()[1]
            state.remove_allocation(body)
            state.remove_pod(state.pods[body["spec"]["podUID"]].obj)
        uid = f"p{i}"
        state.upsert_pod(KINDS[kind](uid))
        track = placer.tracks.ensure(uid)
        gcs = gc.get_count()[0]
        c0 = time.process_time()
        placer.decide(uid)
        took = (time.process_time() - c0) * 1000
        collector += gc.get_count()[0] < gcs  # a young collection ran inside
        seen[kind] += 1
        if seen[kind] > warmup:
            cpu[kind].append(took)
        made = track.create
        placer.tracks.forget(uid)
        if made is None:
            state.remove_pod(state.pods[uid].obj)
            continue
        placed[kind] += 1
        state.confirm(made)
        living.append((i + LIFE, made))
    every = [x for xs in cpu.values() for x in xs]
    return {
        "nodes": nodes,
        "gpus_per_node": gpus,
        "fleet_built_s": round(built_s, 1),
        "clock": "process CPU time, ms",
        "per_kind": per_kind,
        "warmup_per_kind": warmup,
        "all": {
            "p50": round(_pct(every, 0.5), 3),
            "p99": round(_pct(every, 0.99), 3),
            "max": round(max(every), 3),
        },
        "by_kind": {
            k: {
                "p50": round(_pct(xs, 0.5), 3),
                "p99": round(_pct(xs, 0.99), 3),
                "max": round(max(xs), 3),
                "placed": placed[k],
            }
            for k, xs in cpu.items()
        },
        "young_collections_inside": collector,
    }


def lines(r: Obj) -> list[str]:
    a = r["all"]
    out = [
        f"one decision at {r['nodes']} nodes x {r['gpus_per_node']} GPUs, every kind "
        f"({r['per_kind']} each after {r['warmup_per_kind']} warm-up; fleet built in "
        f"{r['fleet_built_s']} s): CPU p50 {a['p50']} ms, p99 {a['p99']} ms, max {a['max']} ms"
    ]
    for k, v in r["by_kind"].items():
        out.append(
            f"  {k:<32} p50 {v['p50']:>6} ms  p99 {v['p99']:>6} ms  max {v['max']:>6} ms  "
            f"placed {v['placed']}"
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.decision_kinds", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--nodes", type=int, default=5000)
    ap.add_argument("--per-kind", type=int, default=300)
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = ap.parse_args(argv)
    # the allocator logs a pending pod at info (JSON rendered, as it runs): kept, not shown
    configure_logging("info", io.StringIO())
    r = run(args.nodes, per_kind=args.per_kind)
    print("\n".join(lines(r)))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
