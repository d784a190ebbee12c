"""The preemption benchmark (bench/preemption.py) on tiny inputs: its JSON shape, that the
planner's victims cost what the brute force finds on every small case, and that preemption
starts every high-priority pod of a full fleet within the grace period. Leaves out the full
run (make bench-placement) and timings (this machine is shared)."""

from __future__ import annotations

from bench import preemption as bench


def test_minimal_victims_match_the_brute_force() -> None:
    m = bench.minimal_experiment(seed=3, cases=25)
    assert m["cases_needing_preemption"] > 0
    assert m["planner_cost_equals_brute_force"] == m["cases_needing_preemption"]
    assert m["victims_fewest_any_priority_mean"] <= m["victims_planner_mean"]


def test_preemption_bounds_the_high_priority_wait_on_a_full_fleet() -> None:
    off = bench.wait_experiment(5, nodes=2, gpus=8, horizon=3000.0, preemption=False)
    on = bench.wait_experiment(5, nodes=2, gpus=8, horizon=3000.0, preemption=True)
    for profile in bench.HIGH_PROFILES:
        assert on[profile]["placed"] > 0
        assert on[profile]["wait_max_s"] <= bench.GRACE_S
    assert on["preemptions"] > 0
    assert off["7g.80gb"]["wait_mean_s"] > on["7g.80gb"]["wait_mean_s"]


def test_the_table_names_every_number() -> None:
    results = {
        "wait": {
            "fleet": "f",
            "horizon_s": 1.0,
            "off": bench.wait_experiment(1, nodes=1, gpus=2, horizon=800.0, preemption=False),
            "gpu": bench.wait_experiment(1, nodes=1, gpus=2, horizon=800.0, preemption=True),
        },
        "minimal": bench.minimal_experiment(seed=1, cases=5),
        "speed": bench.speed(nodes=2, repeats=1),
    }
    text = bench.table(results)
    assert "7g.80gb" in text and "victims vs brute force" in text and "plan speed" in text
    assert "whole GPUs: 1 " in text and results["speed"]["whole x4"]["victims"] == 28
