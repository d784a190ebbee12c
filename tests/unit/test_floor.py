"""bench.floor's arithmetic and its watch helper, bench.latency_track's admission metrics,
and the floor's place among bench.latency's scenarios.

The floor's links are measured against a control plane (`python -m bench.latency --scenarios
floor`); here only what turns them into the chain's floor, the reading of /metrics, and how
bench.latency runs the scenario (a stand-in fleet) are checked."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from bench import floor, latency
from bench.floor import LINKS, Seen, added, chain, phase_is, pin_patch
from bench.latency_track import admission_seconds

_HOOK = "apiserver_admission_webhook_admission_duration_seconds"
_STEP = "apiserver_admission_step_admission_duration_seconds"
_OURS = 'name="mig.pods.instaslice.io",operation="CREATE",rejected="false",type="admit"'
ADMISSION = "\n".join(
    [
        f"{_HOOK}_sum{{{_OURS}}} 0.5",
        f"{_HOOK}_count{{{_OURS}}} 100",
        f'{_STEP}_sum{{operation="CREATE",rejected="false",type="admit"}} 0.8',
        f'{_STEP}_count{{operation="CREATE",rejected="false",type="admit"}} 200',
        f'{_STEP}_sum{{operation="UPDATE",rejected="false",type="admit"}} 9',
        f'{_STEP}_count{{operation="UPDATE",rejected="false",type="admit"}} 9',
        'instaslice_webhook_review_seconds_sum{outcome="patched"} 0.05',
        'instaslice_webhook_review_seconds_count{outcome="patched"} 100',
        'instaslice_webhook_review_seconds_bucket{le="0.001",outcome="patched"} 90',
    ]
)


def test_admission_seconds_by_webhook_step_and_handler_creates_only() -> None:
    assert admission_seconds(ADMISSION) == {
        "webhook mig.pods.instaslice.io": (0.5, 100.0),
        "step admit": (0.8, 200.0),
        "handler": (0.05, 100.0),
    }


def test_the_floor_is_the_sum_of_the_contracts_links_over_the_static_path() -> None:
    """`Creating` is optional (docs/contract.md): its link, the status patch answered, is
    reported beside the floor, not counted in it."""
    p = dict.fromkeys(LINKS, 1.0)
    p.update(
        static=20.0, gated_seen=8.0, alloc_seen=6.0, status_answer=4.0, status_seen=6.0,
        ungate_put=21.0, post_plain=5.0, post_noop=7.0, post_instaslice=9.5,
    )  # fmt: skip
    got = chain(p)
    assert got["floor_ms"] == 8 + 6 + 6 + 21
    assert got["floor_with_creating_ms"] == 8 + 6 + 4 + 6 + 21
    assert got["floor_ratio"] == round(41 / 20, 2)
    assert got["webhook_noop_extra_ms"] == 2.0
    assert got["webhook_instaslice_extra_ms"] == 4.5


def test_pin_patch_removes_every_gate_and_pins_by_name() -> None:
    spec = pin_patch("gpu-3")["spec"]
    assert spec["schedulingGates"] is None  # merge patch: null removes the list
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"] == [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-3"]}]}
    ]


async def test_seen_completes_each_wait_once_on_the_first_matching_event() -> None:
    ticks = iter([1.0, 2.0, 3.0])
    seen = Seen(clock=lambda: next(ticks))
    first = seen.expect("a", added)
    creating = seen.expect("a", phase_is("Creating"))
    await seen.on_event("ADDED", {"metadata": {"name": "b"}})  # another object: t=1
    await seen.on_event("ADDED", {"metadata": {"name": "a"}})  # t=2
    await seen.on_event("MODIFIED", {"metadata": {"name": "a"}, "status": {"phase": "Creating"}})
    assert (await first, await creating) == (2.0, 3.0)
    assert seen.waiting == []


def test_the_floor_is_a_scenario_of_bench_latency(monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m bench.latency --scenarios floor`: once, at emulated latency 0, on the
    sequential scenario's fleet with the static baseline's capacity (its `static` link needs
    it, even with --no-static), its result under `scenarios.floor`. No cluster: the fleet
    and the floor's rounds are stand-ins."""
    seen: dict[str, Any] = {}

    class Fleet:
        def set_latency(self, create_ms: int, destroy_ms: int) -> None:
            seen["latency"] = (create_ms, destroy_ms)

    async def rounds(fleet: Any, out: dict[str, Any], rounds: int, warmup: int) -> None:
        seen["rounds"] = (rounds, warmup)
        out["chain"] = {"floor_ms": 60.0, "static_ms": 32.0, "floor_ratio": 1.88}

    def with_fleet(run_dir: Path, nodes: int, idle_s: float, body: Any, log: Any,
                   *, static: bool = False, webhook_args: Any = (), dra: bool = False,
                   agent_extra: Any = ()) -> dict[str, Any]:  # fmt: skip
        seen["nodes"], seen["static"] = nodes, static
        asyncio.run(body(Fleet(), {}))
        return {"nodes": nodes}

    monkeypatch.setattr(latency, "with_fleet", with_fleet)
    monkeypatch.setattr(floor, "run", rounds)
    monkeypatch.setattr(latency, "machine", dict)
    bench = latency.Bench(latency.Plan(), Path("unused"), ("floor",), static=False, quiet=True)
    doc = bench.run()
    assert doc["scenarios"] == {"floor": {"chain": {"floor_ms": 60.0, "static_ms": 32.0,
                                                     "floor_ratio": 1.88}}}  # fmt: skip
    assert seen == {"nodes": 10, "static": True, "latency": (0, 0), "rounds": (40, 3)}


def test_the_sequential_p50_is_set_against_the_floor_of_the_same_run() -> None:
    scenarios: dict[str, Any] = {
        "floor": {"chain": {"floor_ms": 40.0}},
        "sequential": {"running_p50_s": 0.05},
        "sequential-static": {"running_p50_s": 0.02},
    }
    latency.add_floor_ratio(scenarios)
    assert scenarios["sequential"]["ratio_to_floor"] == 1.25
    assert "ratio_to_floor" not in scenarios["sequential-static"]


def test_the_noop_webhook_copies_instaslices_entry_for_mig_pods() -> None:
    """The floor's pods ask for MIG slices: the entry copied must be the one that admits
    them (the whole-GPU entry, first in the file, matched none, and the floor waited for a
    gate that never came)."""
    hook = floor.noop_configuration("https://127.0.0.1:1/mutate", b"ca")["webhooks"][0]
    assert [c["name"] for c in hook["matchConditions"]] == ["asks-for-mig-slices"]
    assert hook["namespaceSelector"] == {"matchLabels": {floor.NOOP_LABEL: "true"}}
