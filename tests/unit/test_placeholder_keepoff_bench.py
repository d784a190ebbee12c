"""bench.placeholder_keepoff on a small fleet: every full node is kept off and found
misplaced (the bench asserts both), and the placeholder grows with the list; in the mixed
fleet, the advertised room leaves off exactly the nodes the scheduler would not take."""

from __future__ import annotations

from typing import Any

from bench.placeholder_keepoff import measure


def test_the_bench_measures_a_small_fleet() -> None:
    small, large = measure(nodes=10, gpus=2), measure(nodes=100, gpus=2)
    assert small["nodes"] == 10 and large["nodes"] == 100
    grown = int(str(large["placeholder_json_bytes"])) - int(str(small["placeholder_json_bytes"]))
    assert 90 * 20 < grown < 90 * 60  # some 20-60 bytes per node kept off
    mixed: Any = large["mixed"]
    # of 100: the 10 A100-40GB nodes with cpu to spare and the 12 or 13 H100-80GB nodes
    # full of 7g.80gb look free; the rest offer no 1g.10gb, have it used up or lack cpu
    assert mixed["all_listed"] == 100 and mixed["room_listed"] in (22, 23)
    assert mixed["room_placeholder_json_bytes"] < mixed["all_placeholder_json_bytes"] / 2
