"""`make chaos-dra`: the chaos soak in DRA mode, with users' own ResourceClaims.

    python -m bench.chaos_dra --minutes M --seed S [--dir D] [--out F]

Brings up the local control plane in DRA mode (`dra: true`: the node agent process serving
the KWOK GPU nodes publishes their pools as ResourceSlices; `hack.dev.DevSystem` in its own
dir, always torn down) and for M minutes runs at once:

- churn: in plain namespaces, ResourceClaims that users write themselves
  (`deviceClassName: mig.instaslice.io`, CEL on `profile`), each with a pod naming it;
  kube-scheduler allocates them from the agents' pools, KWOK runs the pods, the agent carves
  each claim's slice as soon as it is allocated and reserved, and releases it when the pod
  and claim go (deleted at random, around a target number of live pods);
- faults, the two of issue 35 plus the plain one, drawn from the seed:
  `kill-mid-carve` (the agent killed -9 between seeing an allocation and answering for it:
  within 0-300 ms of a claim's allocation appearing), `kill-mid-publish` (a GPU goes
  unhealthy, an XID, so the agent writes a new pool generation; it is killed -9 at the first
  slice write of that generation, between the pool's slice writes), `kill-agent` (-9 at any
  time); each restarted after 1-3 s;
- a sampler: every second, the allocated claims are checked for double bookings (two claims
  on overlapping memory slots of one GPU, by the devices' `start`/`size` attributes).

Then the churn stops, every pod and claim is deleted, and the soak waits (up to the settle
timeout) for the settled invariants: no MIG instance, no CDI file, no claim left (a claim
that cannot go holds a finalizer), and every pool complete (as many slices of its highest
generation as it says, none of an older one). The result goes to `.dev/bench/chaos-dra.json`;
exit status 1 if any count is not 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.chaos_faults import detached
from bench.invariants import cdi_claims, gpu_instances
from common.kubeapi import ApiError, Kube, Obj, core_path, group_path
from hack.cluster.nodes import parse_spec
from hack.dev import REPO, DevSystem
from nodeagent.emulator import EmulatorControl

_NODE = {"cpu": "16", "memory": "64Gi", "pods": 110}
_GROUP = {"prefix": "dra", "count": 2, "gpus": 2, "model": "H100-80GB", **_NODE}
SPEC = {"dra": True, "nodes": [_GROUP]}
PROFILES = ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb")
TARGET_PODS = 10
AGENT = "nodeagent"
AGENT_ARGS = ("--gc-grace-s=10", "--gc-period-s=5")
FAULTS = {"kill-mid-carve": 3, "kill-mid-publish": 2, "kill-agent": 1}
SETTLE_S = 240.0
COUNTS = ("double_booked", "claims_left", "leaked_instances", "leaked_cdi_files",
          "incomplete_pools")  # fmt: skip
V1 = "resource.k8s.io/v1"


def claims_path(ns: str | None = None) -> str:
    return group_path(V1, "resourceclaims", ns)


def slices_path() -> str:
    return group_path(V1, "resourceslices")


def a_claim(name: str, profile: str) -> Obj:
    cel = f'device.attributes["instaslice.io"].profile == "{profile}"'
    exactly = {"deviceClassName": "mig.instaslice.io", "selectors": [{"cel": {"expression": cel}}]}
    request = {"name": "slice", "exactly": exactly}
    return {"metadata": {"name": name}, "spec": {"devices": {"requests": [request]}}}


def a_pod(name: str) -> Obj:
    return {
        "metadata": {"name": name, "labels": {"instaslice.io/chaos": "dra"}},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
            "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                            "resources": {"claims": [{"name": "gpu"}]}}],
        },
    }  # fmt: skip


# --- invariants (pure) ------------------------------------------------------------------------


def device_slots(slices: Sequence[Obj]) -> dict[tuple[str, str], tuple[int, int, int]]:
    """(pool, device) -> (GPU index, start, size) of every MIG device published."""
    out = {}
    for s in slices:
        for d in s["spec"].get("devices") or []:
            attrs = d.get("attributes") or {}
            if (attrs.get("type") or {}).get("string") != "mig":
                continue
            gpu = int(d["name"].split("-")[1])
            start, size = attrs["start"]["int"], attrs["size"]["int"]
            out[(s["spec"]["pool"]["name"], d["name"])] = (gpu, start, size)
    return out


def allocated(claims: Sequence[Obj]) -> list[tuple[str, str, str]]:
    """(claim namespace/name, pool, device) of every allocated instaslice.io device."""
    out = []
    for c in claims:
        results = ((c.get("status") or {}).get("allocation") or {}).get("devices") or {}
        for r in results.get("results") or []:
            if r.get("driver") == "instaslice.io":
                key = f"{c['metadata']['namespace']}/{c['metadata']['name']}"
                out.append((key, str(r["pool"]), str(r["device"])))
    return out


def ready_devices(claim: Obj) -> list[str]:
    """The claim's instaslice.io devices its status shows Ready (the agent made them)."""
    return [
        str(d.get("device"))
        for d in (claim.get("status") or {}).get("devices") or []
        if d.get("driver") == "instaslice.io"
        and any(c.get("type") == "Ready" and c.get("status") == "True" for c in d["conditions"])
    ]


def double_bookings(
    claims: Sequence[Obj], slots: dict[tuple[str, str], tuple[int, int, int]]
) -> list[str]:
    """Pairs of claims holding the same or overlapping memory slots of one GPU."""
    held = [(k, pool, slots.get((pool, dev)), dev) for k, pool, dev in allocated(claims)]
    out = []
    for i, (k1, p1, s1, d1) in enumerate(held):
        for k2, p2, s2, d2 in held[i + 1 :]:
            if k1 == k2 or p1 != p2 or s1 is None or s2 is None or s1[0] != s2[0]:
                continue
            if s1[1] < s2[1] + s2[2] and s2[1] < s1[1] + s1[2]:
                out.append(f"{p1}: {k1} ({d1}) and {k2} ({d2}) share GPU {s1[0]} slots")
    return out


def incomplete_pools(slices: Sequence[Obj]) -> list[str]:
    """Pools whose highest generation lacks slices, or with slices of an older one left."""
    by_pool: dict[str, list[Obj]] = {}
    for s in slices:
        by_pool.setdefault(s["spec"]["pool"]["name"], []).append(s)
    out = []
    for pool, items in sorted(by_pool.items()):
        top = max(s["spec"]["pool"]["generation"] for s in items)
        current = [s for s in items if s["spec"]["pool"]["generation"] == top]
        want = current[0]["spec"]["pool"]["resourceSliceCount"]
        if len(current) != want or len(items) != want:
            out.append(f"{pool}: generation {top} has {len(current)}/{want} slices, "
                       f"{len(items) - len(current)} older left")  # fmt: skip
    return out


# --- the soak ---------------------------------------------------------------------------------


@dataclass
class Soak:
    system: DevSystem
    kube: Kube
    rng: random.Random
    ns: str = ""
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    created: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    missed: Counter[str] = field(default_factory=Counter)  # a trigger that never came
    violations: dict[str, str] = field(default_factory=dict)
    samples: int = 0
    carved: set[str] = field(default_factory=set)  # claims whose status showed a Ready device
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one agent fault at a time

    async def churn(self) -> None:
        while not self.stop.is_set():
            pods = (await self.kube.list(core_path("pods", self.ns)))["items"]
            live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
            with contextlib.suppress(ApiError):  # a blip: the next round tries again
                if len(live) < TARGET_PODS or self.rng.random() < 0.3:
                    name = f"c{self.created}"
                    await self.kube.create(claims_path(self.ns),
                                           a_claim(name, self.rng.choice(PROFILES)))  # fmt: skip
                    await self.kube.create(core_path("pods", self.ns), a_pod(name))
                    self.created += 1
                else:
                    name = self.rng.choice(live)["metadata"]["name"]
                    await self.kube.delete(
                        core_path("pods", self.ns, name), {"gracePeriodSeconds": 0}
                    )
                    await self.kube.delete_ignore_missing(claims_path(self.ns) + f"/{name}")
            await asyncio.sleep(self.rng.uniform(0.2, 0.8))

    async def sample(self) -> None:
        while True:
            with contextlib.suppress(ApiError):
                slots = device_slots((await self.kube.list(slices_path()))["items"])
                claims = (await self.kube.list(claims_path()))["items"]
                for v in double_bookings(claims, slots):
                    self.violations.setdefault(v, time.strftime("%H:%M:%S"))
                self.carved |= {c["metadata"]["uid"] for c in claims if ready_devices(c)}
                self.samples += 1
            await asyncio.sleep(1.0)

    async def _restart_after(self, low: float, high: float) -> None:
        await asyncio.sleep(self.rng.uniform(low, high))
        with detached():
            self.system.start_agent(die_with_parent=True)

    async def _first_event(self, path: str, want: Any, within: float) -> bool:
        """Whether a watch event of `path` satisfying `want(obj)` came within `within` s."""
        rv = (await self.kube.list(path))["metadata"]["resourceVersion"]
        try:
            async with asyncio.timeout(within):
                async for _, obj in self.kube.watch(path, rv, timeout_s=int(within) + 1):
                    if want(obj):
                        return True
        except TimeoutError:
            pass
        return False

    async def kill_mid_carve(self) -> None:
        seen = {c["metadata"]["uid"] for c in (await self.kube.list(claims_path()))["items"]
                if (c.get("status") or {}).get("allocation")}  # fmt: skip

        def new_allocation(c: Obj) -> bool:
            return (
                bool((c.get("status") or {}).get("allocation")) and c["metadata"]["uid"] not in seen
            )

        if not await self._first_event(claims_path(), new_allocation, 20.0):
            self.missed["kill-mid-carve"] += 1
            return
        await asyncio.sleep(self.rng.uniform(0.0, 0.3))
        self.system.kill(AGENT)
        await self._restart_after(1.0, 3.0)

    async def kill_mid_publish(self) -> None:
        node = self.rng.choice(self.system.nodes)
        slices = [s for s in (await self.kube.list(slices_path()))["items"]
                  if s["spec"]["pool"]["name"] == node]  # fmt: skip
        gen = max((s["spec"]["pool"]["generation"] for s in slices), default=0)
        EmulatorControl(self.system.gpu_state, node).emit_xid(self.rng.randrange(2), 48)

        def newer(s: Obj) -> bool:
            return bool(s["spec"]["pool"]["name"] == node and s["spec"]["pool"]["generation"] > gen)

        if not await self._first_event(slices_path(), newer, 20.0):
            self.missed["kill-mid-publish"] += 1
            return
        self.system.kill(AGENT)  # between the new generation's slice writes
        await self._restart_after(1.0, 3.0)  # healthy again: the pool grows back, anew

    async def kill_any(self) -> None:
        self.system.kill(AGENT)
        await self._restart_after(1.0, 3.0)

    async def faults_loop(self) -> None:
        kinds = list(FAULTS)
        run = {"kill-mid-carve": self.kill_mid_carve, "kill-mid-publish": self.kill_mid_publish,
               "kill-agent": self.kill_any}  # fmt: skip
        while not self.stop.is_set():
            await asyncio.sleep(self.rng.expovariate(1 / 6.0))
            kind = self.rng.choices(kinds, weights=[FAULTS[k] for k in kinds])[0]
            async with self.lock:
                self.faults[kind] += 1
                await run[kind]()

    async def settled(self) -> dict[str, list[str]]:
        """What is left once everything was deleted (empty lists: settled)."""
        nodes = self.system.nodes
        claims = (await self.kube.list(claims_path()))["items"]
        slices = (await self.kube.list(slices_path()))["items"]
        instances = await asyncio.to_thread(gpu_instances, self.system.gpu_state, nodes)
        files = await asyncio.to_thread(cdi_claims, self.system.dir / "nodes", nodes)
        return {
            "claims_left": [
                f"{c['metadata']['namespace']}/{c['metadata']['name']} "
                f"{c['metadata'].get('finalizers')}"
                for c in claims
            ],
            "leaked_instances": [
                f"{i.node} GPU {i.gpu_index} {i.profile}@{i.start}" for i in instances
            ],
            "leaked_cdi_files": [f"{n}: {ns}/{c}" for n, got in files.items() for ns, c in got],
            "incomplete_pools": incomplete_pools(slices),
        }


async def run(system: DevSystem, minutes: float, seed: int) -> Obj:
    async with await Kube.connect(str(system.kubeconfig)) as kube:
        soak = Soak(system, kube, random.Random(f"{seed}/dra"))
        ns = await kube.create(
            core_path("namespaces"), {"metadata": {"generateName": "chaos-dra-"}}
        )
        soak.ns = ns["metadata"]["name"]
        for _ in range(300):  # its default ServiceAccount, which pods need
            if (await kube.list(core_path("serviceaccounts", soak.ns)))["items"]:
                break
            await asyncio.sleep(0.2)
        sampler = asyncio.create_task(soak.sample())
        tasks = [asyncio.create_task(soak.churn()), asyncio.create_task(soak.faults_loop())]
        t0 = time.monotonic()
        await asyncio.sleep(minutes * 60)
        soak.stop.set()
        await asyncio.gather(*tasks)
        if AGENT not in system.processes:
            with detached():
                system.start_agent(die_with_parent=True)
        await kube.delete(core_path("namespaces", name=soak.ns))
        deadline, left = time.monotonic() + SETTLE_S, await soak.settled()
        while any(left.values()) and time.monotonic() < deadline:
            await asyncio.sleep(3.0)
            left = await soak.settled()
        settle_s = time.monotonic() - t0 - minutes * 60
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
    return {
        "minutes": minutes,
        "seed": seed,
        "claims_created": soak.created,
        "claims_carved": len(soak.carved),  # seen with a Ready status.devices entry
        "faults_injected": dict(soak.faults),
        "fault_triggers_missed": dict(soak.missed),
        "double_booked": len(soak.violations),
        "double_booking_samples": soak.samples,
        **{k: len(v) for k, v in left.items()},
        "settle_s": round(settle_s, 1),
        "violations": [*soak.violations, *(x for v in left.values() for x in v)][:200],
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.chaos_dra", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dir", type=Path, default=REPO / ".dev" / "bench" / "chaos-dra-run")
    ap.add_argument("--out", type=Path, default=REPO / ".dev" / "bench" / "chaos-dra.json")
    a = ap.parse_args(argv)
    dir = a.dir.absolute()
    old = DevSystem.attach(dir)
    if old is not None:
        with contextlib.suppress(Exception):
            old.down()
    shutil.rmtree(dir, ignore_errors=True)
    dir.mkdir(parents=True)
    t0 = time.monotonic()
    with detached():
        system = DevSystem.up(dir, parse_spec(SPEC), agent_args=AGENT_ARGS, die_with_parent=True)
    print(f"DRA mode up in {time.monotonic() - t0:.0f}s on {len(system.nodes)} nodes; soaking "
          f"{a.minutes:g} min, seed {a.seed}; logs in {system.logs}", flush=True)  # fmt: skip
    try:
        result = asyncio.run(run(system, a.minutes, a.seed))
        if any(result[k] for k in COUNTS):
            kept = dir.parent / f"{dir.name}-logs-seed{a.seed}"
            shutil.rmtree(kept, ignore_errors=True)
            shutil.copytree(system.logs, kept)
            result["logs_kept"] = str(kept)
    finally:
        system.down()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    shown = ("minutes", "claims_created", "claims_carved", "faults_injected", *COUNTS)
    print(json.dumps({k: result[k] for k in shown}))
    return 1 if any(result[k] for k in COUNTS) else 0


if __name__ == "__main__":
    sys.exit(main())
