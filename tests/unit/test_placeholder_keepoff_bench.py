"""bench.placeholder_keepoff on a small fleet: every full node is kept off and found
misplaced (the bench asserts both), and the placeholder grows with the list."""

from __future__ import annotations

from bench.placeholder_keepoff import measure


def test_the_bench_measures_a_small_fleet() -> None:
    small, large = measure(nodes=10, gpus=2), measure(nodes=100, gpus=2)
    assert small["nodes"] == 10 and large["nodes"] == 100
    grown = int(str(large["placeholder_json_bytes"])) - int(str(small["placeholder_json_bytes"]))
    assert 90 * 20 < grown < 90 * 60  # some 20-60 bytes per node kept off
