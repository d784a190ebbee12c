"""bench.check, `make bench-check`'s comparison: figures looked up by path, compared with
their ranges, reported, and the exit status.

Covers: a figure in range, below, above, at either bound, with an open bound; a path that
is missing or leads to no number; lists (by length) and bools; a file not run and a figure
not in its file (reported, not a failure unless --strict) and no file at all; a malformed
range; the committed bench/expected.yaml parses
and names only files the benchmarks write. Leaves out: the benchmarks' numbers themselves
(a benchmark, not a test: `make bench-placement` then `make bench-check`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from bench.check import (
    EXPECTED,
    Figure,
    compare,
    lookup,
    main,
    missing,
    outside,
    parse_range,
    report,
)

DOC = {
    "totals": {"instaslice": {"accepted_pods": 18168, "slot_time_vs_instaslice": 1.0}},
    "decision_ms_by_nodes": {"1000": {"p99": 0.92, "identical_to_scan": True}},
    "violations": [],
    "runs": [{"p50": 3}],
    "name": "x",
    "wait": {"gpu": {"4g.40gb": {"wait_max_s": 30.5}}},
}


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("totals.instaslice.accepted_pods", 18168.0),
        ("decision_ms_by_nodes.1000.p99", 0.92),
        ("decision_ms_by_nodes.1000.identical_to_scan", 1.0),
        ("violations", 0.0),
        ("runs.0.p50", 3.0),
        ("runs.1.p50", None),
        ("totals.first-fit.accepted_pods", None),
        ("totals.instaslice", None),  # a mapping, not a number
        ("name", None),
        ("wait.gpu.4g.40gb.wait_max_s", 30.5),  # a key with a dot in it
        ("wait.gpu.4g", None),
    ],
)
def test_lookup_follows_the_dotted_path(path: str, value: float | None) -> None:
    assert lookup(DOC, path) == value


@pytest.mark.parametrize(
    ("value", "low", "high", "ok"),
    [
        (0.92, 0.0, 2.0, True),
        (2.0, 0.0, 2.0, True),  # bounds are inclusive
        (0.0, 0.0, 2.0, True),
        (2.01, 0.0, 2.0, False),
        (-0.1, 0.0, 2.0, False),
        (1e9, 10.0, None, True),  # open above
        (9.0, 10.0, None, False),
        (-1e9, None, 1.0, True),  # open below
        (None, 0.0, 1.0, False),  # missing: never in range
        (float("nan"), None, None, False),
    ],
)
def test_a_figure_is_ok_only_within_its_range(
    value: float | None, low: float | None, high: float | None, ok: bool
) -> None:
    assert Figure("f.json", "p", low, high, value).ok is ok


def test_compare_checks_the_files_that_are_there_and_skips_the_others() -> None:
    expected = {
        "placement.json": {
            "totals.instaslice.accepted_pods": [18100, None],
            "decision_ms_by_nodes.1000.p99": [None, 0.5],
            "totals.gone": [0, 1],
        },
        "latency.json": {"scenarios.burst.all_ungated_s": [0, 60]},
    }
    figures = compare(expected, {"placement.json": DOC})
    assert [(f.path, f.ok) for f in figures] == [
        ("totals.instaslice.accepted_pods", True),
        ("decision_ms_by_nodes.1000.p99", False),  # above its max
        ("totals.gone", False),  # missing
    ]
    assert [f.path for f in outside(figures)] == ["decision_ms_by_nodes.1000.p99"]
    assert [f.path for f in missing(figures)] == ["totals.gone"]
    text = report(figures, ["latency.json"])
    assert "OUT placement.json: decision_ms_by_nodes.1000.p99 = 0.92  expected [-inf, 0.5]" in text
    assert "--- placement.json: totals.gone not in this run  expected [0, 1]" in text
    assert "ok  placement.json: totals.instaslice.accepted_pods = 18168" in text
    assert "latency.json: not run" in text
    assert "1 of 2 figures outside their range" in text
    assert "1 figures not in this run" in text


@pytest.mark.parametrize("spec", [[1], [2, 1], "1..2", None])
def test_a_malformed_range_is_refused(spec: object) -> None:
    with pytest.raises(ValueError, match="p:"):
        parse_range(spec, "p")


def _write(tmp: Path, expected: object, **docs: object) -> list[str]:
    (tmp / "expected.yaml").write_text(yaml.safe_dump(expected))
    for name, doc in docs.items():
        (tmp / f"{name}.json").write_text(json.dumps(doc))
    return ["--dir", str(tmp), "--expected", str(tmp / "expected.yaml")]


def test_main_exits_by_what_it_found(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ranges = {"a.json": {"x": [0, 1]}, "b.json": {"y": [0, 1]}}
    assert main(_write(tmp_path, ranges)) == 2  # nothing run
    assert "nothing to check" in capsys.readouterr().out
    assert main(_write(tmp_path, ranges, a={"x": 0.5})) == 0  # b not run: not a failure
    assert "all 1 figures within their range" in capsys.readouterr().out
    assert main(_write(tmp_path, ranges, a={"x": 0.5}, b={"y": 3})) == 1
    assert "OUT b.json: y = 3" in capsys.readouterr().out
    # a figure its file does not hold (a scenario not run) fails only with --strict
    assert main(_write(tmp_path, ranges, a={"x": 0.5}, b={"z": 3})) == 0
    assert "--- b.json: y not in this run" in capsys.readouterr().out
    assert main([*_write(tmp_path, ranges, a={"x": 0.5}, b={"z": 3}), "--strict"]) == 1


def test_the_committed_ranges_parse_and_name_the_benchmarks_files() -> None:
    expected = yaml.safe_load(EXPECTED.read_text())
    known = {"placement.json", "preemption.json", "placement-scenarios.json", "latency.json",
             "chaos.json", "fuzz.json", "apiserver.json"}  # fmt: skip
    assert set(expected) <= known and "placement.json" in expected
    for file, figures in expected.items():
        assert figures, file
        for path, spec in figures.items():
            parse_range(spec, f"{file}: {path}")
