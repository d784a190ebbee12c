"""The DRA pool's device model (nodeagent/dra/pool.py), against the NVML emulator.

- The counter model is exact: for random streams of claims on random catalog models, a
  device the published counters admit (what kube-scheduler checks) is one the emulator
  creates at exactly that placement, and one they refuse is one the emulator refuses (no
  overlap, counts and engines respected, and nothing legal left unpublished).
- Device order: InstaSlice's static preference, small profiles at high starts first, the
  full GPU's profile at 0 last, the whole GPU after its MIG devices.
- Layout: counter sets in slices of their own (8 a slice), devices per GPU (128 a slice);
  unhealthy and lost GPUs publish nothing; whole-GPU devices only where the mode allows.
Leaves out: writing the slices (tests/integration/test_dra_pool.py).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as hs

from common.catalog import load_catalog
from nodeagent.dra.pool import MAX_COUNTER_SETS, devices_of, gpu_counters, pool_slices
from nodeagent.dra.publish import slice_name
from nodeagent.emulator import EmulatedNvml, provision
from nodeagent.model import Health, NodeInventory, NvmlFailure
from nodeagent.nvml import NvmlSession

CATALOG = load_catalog()
MODELS = sorted(m.name for m in CATALOG.models)
MIG, WHOLE = (lambda g: True), (lambda g: False)


@contextmanager
def emulated(models: list[str]) -> Iterator[NvmlSession]:
    with tempfile.TemporaryDirectory() as d:
        provision(Path(d), "n", models, "enabled")
        s = NvmlSession(EmulatedNvml(Path(d), "n"), CATALOG)
        s.open()
        try:
            yield s
        finally:
            s.close()


def _value(q: dict[str, str]) -> int:
    return int(q["value"])


@settings(max_examples=60, deadline=None)
@given(model=hs.sampled_from(MODELS), picks=hs.lists(hs.integers(0, 10_000), max_size=14))
def test_counters_admit_exactly_what_nvml_creates(model: str, picks: list[int]) -> None:
    with emulated([model]) as s:
        inv = s.inventory()
        (counters, devices) = pool_slices(inv, {}, MIG, WHOLE)
        left = {k: _value(v) for k, v in counters.counters[0]["counters"].items()}
        assert left == gpu_counters(inv.gpus[0])
        for pick in picks:
            d = devices.devices[pick % len(devices.devices)]
            (use,) = d["consumesCounters"]
            need = {k: _value(v) for k, v in use["counters"].items()}
            fits = all(left[k] >= v for k, v in need.items())
            a = d["attributes"]
            try:
                s.create_gi(0, a["profileID"]["int"], a["start"]["int"], a["size"]["int"])
                made = True
            except NvmlFailure:
                made = False
            assert fits == made, f"{model}: {d['name']} counters {fits}, NVML {made}"
            if fits:
                left = {k: v - need.get(k, 0) for k, v in left.items()}
        # nothing made overlaps, in the emulator's own view
        taken = [k for i in s.instances(inv.gpus[0]) for k in range(i.start, i.start + i.size)]
        assert len(taken) == len(set(taken))


def test_device_order_is_the_static_preference() -> None:
    with emulated(["H100-80GB"]) as s:
        inv = s.inventory()
    (_, devices) = pool_slices(inv, {}, MIG, lambda g: True)
    names = devices_of([devices])
    profiles = [d["attributes"]["profile"]["string"] for d in devices.devices]
    starts = [d["attributes"]["start"]["int"] for d in devices.devices]
    assert (profiles[0], starts[0]) == ("1g.10gb", 5)  # small, high start
    assert profiles[-2:] == ["7g.80gb", "gpu"] and names[-1] == "gpu-0"
    assert profiles.index("3g.40gb") < profiles.index("4g.40gb") < profiles.index("7g.80gb")
    # a 1g at start 0 comes after every 1g at a higher start
    ones = [s for p, s in zip(profiles, starts, strict=True) if p == "1g.10gb"]
    assert ones[-1] == 0 and ones[0] > 0
    assert names[0] == "gpu-0-mig-19-5"


def test_layout_limits_and_health() -> None:
    with emulated(["A30-24GB"] * 12) as s:
        inv = s.inventory()
    health = {3: Health(False, "XID 79")}
    inv = NodeInventory(gpus=inv.gpus, lost=(4,))
    slices = pool_slices(inv, health, MIG, lambda g: g.index == 0)
    counters = [s for s in slices if s.counters]
    assert [len(s.counters) for s in counters] == [MAX_COUNTER_SETS, 2]  # 12 GPUs, 2 out
    assert all(not s.devices for s in counters) and all(not s.counters for s in slices[2:])
    sets = [c["name"] for s in counters for c in s.counters]
    assert "gpu-3" not in sets and "gpu-4" not in sets and len(sets) == 10
    names = devices_of(slices)
    assert not any(n.startswith(("gpu-3-", "gpu-4-")) for n in names)
    assert "gpu-0" in names and "gpu-1" not in names  # whole only where the mode allows
    assert max(len(s.devices) for s in slices) <= 128


def test_slice_names_are_dns_subdomains_of_at_most_253() -> None:
    assert slice_name("node-0", "counters-0") == "node-0-instaslice.io-counters-0"
    long = "n" * 250
    a, b = slice_name(long, "gpu-0-0"), slice_name(long[:-1] + "m", "gpu-0-0")
    assert len(a) <= 253 and len(b) <= 253 and a != b  # cut, and told apart by the hash
    assert a.endswith("-instaslice.io-gpu-0-0")
